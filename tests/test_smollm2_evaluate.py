"""examples/smollm2/evaluate.py runs end to end on the real pair with a few prompts (its code, not its
figures), and its prompt sets are what its tables say they are."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from required import require_real_pair

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "smollm2" / "evaluate.py"


@pytest.fixture(scope="module", autouse=True)
def _real_pair():  # before the module's other fixtures
    require_real_pair()


@pytest.fixture(scope="module")
def evaluate():
    spec = importlib.util.spec_from_file_location("smollm2_evaluate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(evaluate):
    return evaluate.prompt_builder_tokenizer()


def test_template_variants_change_only_the_frame_around_the_same_user_turn(evaluate, tokenizer):
    prompts = evaluate.held_out_prompts(tokenizer, 3)
    variants = evaluate.template_variants(tokenizer, prompts)
    default, none, long, alpaca = variants.values()
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    for i, p in enumerate(prompts):
        assert p.text in decode(default[i]) and p.text in decode(none[i]) and p.text in decode(alpaca[i])
        assert "<|im_start|>system" in decode(default[i]) and "<|im_start|>system" not in decode(none[i])
        assert decode(default[i]).endswith("<|im_start|>assistant\n") and decode(none[i]).endswith("<|im_start|>assistant\n")
        assert evaluate.LONG_SYSTEM in decode(long[i]) and len(long[i]) > len(default[i]) + 100
        assert "<|im_start|>" not in decode(alpaca[i]) and decode(alpaca[i]).endswith("### Response:\n")


def test_context_prompts_fill_their_length_less_the_answers_room(evaluate, tokenizer):
    docs = evaluate.long_documents(tokenizer, 3, 4096)
    assert len({name for name, _ in docs}) == 3  # one section of each file before a second of any
    room = 71
    sets = evaluate.context_sets(tokenizer, docs, [512, 4096], room)
    for length, prompts in sets.items():
        for ids in prompts:
            assert int(length) - room - 300 <= len(ids) <= int(length) - room
            assert tokenizer.decode(ids).endswith(evaluate.READ_QUESTION + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.engine  # minutes: the whole script in a subprocess, so `make test-quick` leaves it out
def test_the_script_measures_every_table_on_a_few_prompts(tmp_path):
    out = tmp_path / "claims"
    run = subprocess.run([sys.executable, str(SCRIPT), "--prompts", "2", "--template-prompts", "2", "--documents", "2",
                          "--contexts", "512,1024", "--diagnose-prompts", "1", "--new-tokens", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / "claims.json").read_text())
    assert (out / "tau_by_context.png").stat().st_size > 10_000 and (out / "tau_by_template.png").stat().st_size > 10_000
    assert [r["label"] for r in record["context"]] == ["512", "1024"]
    assert len(record["template"]) == 4 and record["depth"]["prompts"] == 2
    check_record(record)
    assert "| 6 |" in run.stdout and "3. under template" in run.stdout


def check_record(record: dict) -> None:
    """What claims.json must hold whatever the prompts: every prompt's tau is 1 + its accepted drafts per
    round, at most depth + 1; the trained EAGLE 3.1 drafter accepts drafts (mean tau above 1 at every
    depth: a count that drops acceptances, or a drafter that drafts nothing the target takes, fails); and
    the fed-back RMS relative to depth 1 is each depth's RMS over depth 1's, with that RMS recorded."""
    for row in [record["depth"], *record["context"], *record["template"]]:
        for drafter, by_depth in row["tau_per_prompt"].items():
            for depth, taus in by_depth.items():
                assert taus and all(1.0 <= t <= int(depth) + 1 for t in taus), (row["label"], drafter, depth)
        for depth, taus in row["tau_per_prompt"]["EAGLE 3.1"].items():
            assert sum(taus) / len(taus) > 1.0, (row["label"], depth, taus)
    assert set(record["diagnose"]) == {"EAGLE-3", "EAGLE 3.1"}
    for drafter, rows in record["diagnose"].items():
        rms, rel = rows["fed-back RMS"], rows["fed-back RMS / depth 1"]
        assert len(rms) == len(rel) > 1 and rms[0] > 0, (drafter, rms)
        assert rel == pytest.approx([r / rms[0] for r in rms]), (drafter, rms, rel)
