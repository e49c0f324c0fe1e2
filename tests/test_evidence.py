"""A PASS that showed nothing is said first and has its own exit status (parity/evidence.py): where drafts
are not compared one by one, a pair whose reference accepts no draft compares nothing a drafter bug would
change. The vLLM case (tokens and counts only, greedy): tests/test_vllm_engine.py."""

import json
import os
from pathlib import Path

import pytest
import torch

from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter

from eagle31_export.parity.compare import PromptRow
from eagle31_export.parity.evidence import EXIT_INCONCLUSIVE, inconclusive_reasons

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "examples" / "tiny" / "models"


def vllm_environment() -> str:
    """The vLLM environment (`make setup-vllm`), or a skip (a failure under `make test`)."""
    named = os.environ.get("EAGLE31_VLLM") or (str(ROOT / ".venv-vllm") if (ROOT / ".venv-vllm").is_dir() else None)
    if named is None:
        if os.environ.get("EAGLE31_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is required here: set EAGLE31_VLLM to a vLLM environment")
        pytest.skip("no vLLM environment (make setup-vllm)")
    return named


def random_weights(drafter: Path, out: Path) -> Path:
    """The drafter's layout and vocabulary map with random weights (as a published layout with random weights)."""
    ckpt = read_drafter(drafter)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.05
                      if t.is_floating_point() else t) for name, t in ckpt.tensors.items()}
    return write_drafter(DrafterCheckpoint(ckpt.config, tensors), out, "specforge")


@pytest.mark.engine  # its own engine: the command end to end, its exit status 3 included
def test_a_pair_whose_reference_accepts_nothing_is_inconclusive_on_vllm(cli, tmp_path, monkeypatch):
    """Random drafter weights against the tiny target, served by a real vLLM engine that loads our plugins
    but not the draft log (VLLM_PLUGINS, vLLM's own list of the plugins it loads; tokens and acceptance
    counts only): tau 1.000 on both sides, every token and round identical, and the PASS shows nothing,
    said first, exit 3. (With the draft log, every draft is compared: the next test's case.)"""
    monkeypatch.setenv("VLLM_PLUGINS", "eagle31_cpu_nvfp4,eagle31_cpu_sampler,eagle31_eagle_chunk_tail")
    drafter = random_weights(PAIR / "drafter-eagle31", tmp_path / "random")
    code, out, err = cli("parity", "--drafter", drafter, "--target", PAIR / "target", "--runtime", "vllm",
                         "--vllm", vllm_environment(), "--max-new-tokens", "32", "--out", tmp_path / "report", "--json")
    report = json.loads(out)
    assert code == EXIT_INCONCLUSIVE == 3, err
    assert report["passed"] and report["verdict"] == "INCONCLUSIVE" and report["failures"] == []
    assert report["tau_reference"] == report["tau_runtime"] == 1.0
    assert "accepted no draft" in report["inconclusive"][0] and not report["drafts_reported"]
    lines = (tmp_path / "report" / "report.md").read_text().splitlines()
    assert lines[0] == "# Acceptance parity: **INCONCLUSIVE**"
    assert next(line for line in lines[1:] if line.strip()).startswith("**Inconclusive:** the reference accepted no")


def test_drafts_compared_one_by_one_are_evidence_whatever_is_accepted(cli, eagle31_dir, llama_target):
    """The same pair greedy: a runtime that reports its drafts is compared draft by draft, which shows a
    drafter bug even where nothing is accepted (tests/parity/test_parity_reference.py breaks them)."""
    code, out, err = cli("parity", "--drafter", eagle31_dir, "--target", llama_target, "--runtime", "reference",
                         "--max-new-tokens", "16", "--json")
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "PASS" and report["tau_reference"] == 1.0, err


def test_a_trained_pair_passes_with_exit_0(cli):
    code, out, err = cli("parity", "--drafter", PAIR / "drafter-eagle31", "--target", PAIR / "target", "--runtime",
                         "reference", "--max-new-tokens", "16", "--json")
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "PASS" and report["inconclusive"] == [], err


def _row(accepted_per_position, rounds):
    return PromptRow(0, 4, True, True, True, None, 1.0, 1.0, None, [], [], rounds, rounds,
                     accepted_per_position_reference=accepted_per_position)


def test_a_position_never_accepted_is_named_and_statistics_need_more():
    rows = [_row([6, 2, 0], 20), _row([4, 1, 0], 20)]
    (reason,) = inconclusive_reasons(rows, 3, statistical=False)
    assert "position 3: 0 of 40 rounds" in reason and "position 2" not in reason
    (reason,) = inconclusive_reasons(rows, 3, statistical=True)  # rates over 3 accepted rounds tell nothing
    assert "position 2: 3" in reason and "position 3: 0" in reason and "position 1" not in reason
    assert inconclusive_reasons([_row([10, 10, 10], 20)], 3, statistical=True) == []
    assert "no speculation rounds" in inconclusive_reasons([_row([0, 0, 0], 0)], 3, statistical=False)[0]
