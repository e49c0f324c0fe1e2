"""Parity under load (`parity --concurrency`) on the batched ONNX Runtime runtime, in process: exact
at C = 4 and 16 for EAGLE 3.1 and EAGLE-3, with the 16 requests at C = 16 really run together (the
batch sizes the runtime measured, as the report prints them); a batched step broken on purpose (here,
in the test) that C = 1 cannot see and C > 1 must; and a runtime that runs one request at a time
failing as "did not batch".

The same check against real engines: tests/test_vllm_engine.py (vLLM) and tests/test_triton_concurrency.py
(the Triton `cpu` repository, batched).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eagle31_export.parity.concurrency import NOT_BATCHED
from eagle31_export.parity.sides import check_parity
from eagle31_export.runtime import batching
from eagle31_export.runtime import onnxruntime as ort_runtime

PAIR = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"


@pytest.mark.parametrize("drafter", ["drafter-eagle31", "drafter-eagle3"])
def test_parity_under_load_is_exact_on_the_batched_onnxruntime(cli, tmp_path, drafter):
    code, out, err = cli("parity", "--drafter", PAIR / drafter, "--target", PAIR / "target", "--runtime",
                         "onnxruntime", "--concurrency", "4,16", "--max-new-tokens", "16", "--out", tmp_path / "r",
                         "--json")
    assert code == 0, out + err
    report = json.loads(out)
    rows = {row["concurrency"]: row for row in report["concurrency"]}
    assert sorted(rows) == [1, 4, 16] and len(report["prompts"]) == 16  # 16 prompts: C = 16 really has 16 in flight
    for row in rows.values():
        assert row["same_tokens_as_c1"] == row["same_rounds_as_c1"] == row["same_tokens_as_reference"] == 16
        assert row["accepted_per_position"] == rows[1]["accepted_per_position"]
    reference = [sum(p["accepted_per_position_reference"][i] for p in report["prompts"]) for i in range(3)]
    assert rows[1]["accepted_per_position"] == reference and rows[1]["accepted"] > 0
    steady = rows[16]["batching"]
    assert steady["in_flight"] == 16 and steady["largest"] == 16 and steady["steady_calls"] > 0
    assert steady["steady_mean"] >= 0.8 * 16, steady  # in step: most calls serve every request in flight
    assert rows[4]["batching"]["largest"] == 4 and rows[4]["batching"]["in_flight"] == 4
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert f"| 16 | 16 | 16 / {steady['mean']:.1f} / {steady['steady_mean']:.1f} |" in markdown
    assert (tmp_path / "r" / "tau_by_concurrency.png").stat().st_size > 10_000


def _positions_from_the_padded_length(run_batch):
    """A classic batching bug: every sequence's positions counted from the batch's longest cache,
    not its own. Alone in a call, a sequence's own cache is the longest: nothing changes at C = 1."""
    def broken(session, caches, feeds, per_token):
        longest = max(c.length for c in caches)
        shifted = [{**f, "position_ids": f["position_ids"] + (longest - c.length)} for c, f in zip(caches, feeds)]
        return run_batch(session, caches, shifted, per_token)

    return broken


def test_broken_per_sequence_positions_pass_at_c1_and_fail_under_load(monkeypatch):
    monkeypatch.setattr(ort_runtime, "run_batch", _positions_from_the_padded_length(ort_runtime.run_batch))
    alone = check_parity("onnxruntime", None, PAIR / "drafter-eagle31", PAIR / "target", None, None, 3, 16)
    assert alone.passed, alone.failures
    loaded = check_parity("onnxruntime", None, PAIR / "drafter-eagle31", PAIR / "target", None, None, 3, 16,
                          concurrency=(1, 4))
    assert not loaded.passed
    assert all(f.startswith("concurrency 4: ") for f in loaded.failures), loaded.failures
    assert any("prompts differ from concurrency 1" in f and "per-sequence positions" in f for f in loaded.failures)
    row = {r.concurrency: r for r in loaded.concurrency}[4]
    assert row.differing_prompts and row.same_tokens_as_c1 < row.prompts


def test_a_runtime_that_runs_one_request_at_a_time_fails_as_not_batched(monkeypatch):
    """Every backend call narrowed to one sequence (a deliberate fault, in the test): requests in flight
    then queue; the tokens still match, and parity fails on the batch sizes alone."""
    monkeypatch.setattr(batching, "MAX_BATCH", 1)
    report = check_parity("onnxruntime", None, PAIR / "drafter-eagle31", PAIR / "target", None, None, 3, 8,
                          concurrency=(1, 4))
    row = {r.concurrency: r for r in report.concurrency}[4]
    assert row.batching["largest"] == 1 and row.same_tokens_as_c1 == row.prompts
    assert [f for f in report.failures if NOT_BATCHED in f] and all(
        f.startswith("concurrency 4: ") for f in report.failures), report.failures
    assert not report.passed


def test_run_batch_pads_caches_left_and_new_tokens_right():
    """The layout `attention_bias` relies on, read back from what the session is fed."""
    kv = {"layers": 1, "heads": 1, "key_dim": 2, "value_dim": 2}
    caches = [ort_runtime._Cache(kv, np.float32) for _ in range(2)]
    caches[0].keys = [np.ones((1, 1, 3, 2), np.float32)]
    caches[0].values = [np.ones((1, 1, 3, 2), np.float32)]
    fed = {}

    class Session:
        def get_outputs(self):
            return [type("O", (), {"name": n})() for n in ("logits", "new_key_0", "new_value_0")]

        def run(self, names, feeds):
            fed.update(feeds)
            new = np.full((2, 1, 2, 2), 7, np.float32)  # this call's entries, new tokens right-padded
            return [np.zeros((2, 2, 5), np.float32), new, new]

    feeds = [{"input_ids": np.array([[4]])}, {"input_ids": np.array([[5, 6]])}]
    out = ort_runtime.run_batch(Session(), caches, feeds, ("logits",))
    assert fed["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert fed["input_ids"].tolist() == [[4, 0], [5, 6]]
    assert fed["past_key_0"][1].sum() == 0 and fed["past_key_0"].shape == (2, 1, 3, 2)
    assert [o["logits"].shape[1] for o in out] == [1, 2]
    assert caches[0].length == 4 and caches[1].length == 2  # own past + own new entries
    assert caches[0].keys[0].tolist() == [[[[1, 1], [1, 1], [1, 1], [7, 7]]]]
    assert caches[1].keys[0].tolist() == [[[[7, 7], [7, 7]]]]


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "each level must be between 1 and 256"),
    (["--concurrency", "4,x"], "give request counts separated by commas"),
    (["--runtime", "reference", "--concurrency", "4"], "runs one sequence at a time"),
])
def test_bad_concurrency_is_one_line_and_exit_2(cli, args, message):
    code, out, err = cli("parity", "--drafter", PAIR / "drafter-eagle31", "--target", PAIR / "target",
                         "--max-new-tokens", "4", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def _level_run(kept: int, engine_largest: int, engine_steps: int) -> tuple:
    """A C = 4 level over 4 identical prompts whose client kept `kept` requests in flight at most and
    whose engine ran at most `engine_largest` together (its counters: `engine_steps` steps)."""
    from eagle31_export.parity.concurrency import LoadRuns, compare_levels, pooled_counts
    from eagle31_export.reference.speculate import SpecResult
    from eagle31_export.runtime.contract import BatchFigures, ConcurrentRun

    results = [SpecResult(tokens=[5, 6, 7, 8], drafts=[[5, 6], [8, 1]], accepted_per_step=[1, 1], depth=2)
               for _ in range(4)]
    counters = {**pooled_counts(results, 2), "engine_steps": engine_steps}
    figures = BatchFigures(source="test samples", histogram={engine_largest: 3}, largest=engine_largest, mean=1.0,
                           in_flight=kept)
    load = LoadRuns(runs={4: ConcurrentRun(results, pooled=counters, batching=figures)}, seconds={4: 1.0})
    rows, failures = compare_levels(results, 1.0, results, load, 2, True, 0.05)
    return rows[1], failures


def test_a_starved_client_is_inconclusive_on_batching_never_an_engine_failure():
    """The client, short of CPU, had one request in flight at a time: the engine ran one at a time because
    it was sent one at a time. Not NOT_BATCHED; the row says what the client kept in flight."""
    row, failures = _level_run(kept=1, engine_largest=1, engine_steps=8)
    assert failures == []
    assert row.batching_not_shown == ("concurrency 4: the client kept at most 1 of 4 in flight: batching not shown "
                                      "(the engine's side judged on what it was sent)")
    row, failures = _level_run(kept=2, engine_largest=2, engine_steps=4)
    assert failures == [] and "kept at most 2 of 4 in flight: batching shown up to 2 only" in row.batching_not_shown


def test_an_engine_sent_requests_together_that_ran_them_one_at_a_time_fails():
    """Two or four requests in flight at once, and every engine step verified one: the engine's fault."""
    for kept in (2, 4):
        row, failures = _level_run(kept=kept, engine_largest=1, engine_steps=8)
        assert len(failures) == 1 and NOT_BATCHED in failures[0] and f"client had {kept} in flight" in failures[0]
    row, failures = _level_run(kept=4, engine_largest=4, engine_steps=2)
    assert failures == [] and row.batching_not_shown is None
