"""benchmarks/verdict_power.py's records judged at another tie factor (TIE_ERRORS, "k" in records before it was
named): a run judged at a larger K stands at
a smaller one only where lowering K cannot change it (it failed, or no difference of it lay beyond the
new K); every other run must be judged again, and a run is never carried to a larger K."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from verdict_power import at_tie_errors, read_records  # noqa: E402


def record(run: int, verdicts: list[bool], k: float | None = 6.0, key: str = "k", **more) -> dict:
    found = {"precision": "bf16", "sabotage": "rope_theta x4", "prompts": 8, "tokens": 32, "run": run,
             "verdicts": verdicts, **more}
    if k is not None:
        found[key] = k
    return found


def test_a_failed_run_stands_at_a_smaller_k_and_nowhere_above():
    failed = record(0, [True, True, False, False], max_ratio=40.0)
    assert at_tie_errors(failed, 5.0)["verdicts"] == failed["verdicts"] and at_tie_errors(failed, 5.0)["carried_from"] == 6.0
    assert at_tie_errors(failed, 7.0) is None  # a larger K may excuse what failed


def test_a_passed_run_stands_only_where_its_largest_difference_is_within_the_new_k():
    passed = record(1, [False, False, False, False], max_ratio=4.22)
    assert at_tie_errors(passed, 5.0)["verdicts"] == [False] * 4
    assert at_tie_errors(passed, 4.0) is None  # its 4.22 e difference would fail at K = 4: judge it again
    half = record(2, [True, False, False, False], max_ratio=5.6)  # failed with drafts, passed on counts
    assert at_tie_errors(half, 5.0) is None


def test_runs_without_k_are_the_k_6_runs_and_faithful_ones_read_their_ratios():
    faithful = record(3, [False] * 4, k=None, ratios=[0.4, 3.84])
    assert at_tie_errors(faithful, 5.0)["tie_errors"] == 5.0 and at_tie_errors(faithful, 3.8) is None
    unknown = record(4, [False] * 4, k=None)  # a sabotaged run recorded before its largest difference was
    assert at_tie_errors(unknown, 5.0) is None


def test_a_run_judged_at_k_itself_comes_before_a_carried_one(tmp_path):
    old, new = record(5, [True, True, False, False]), record(5, [True, False, False, False], k=5.0, key="tie_errors")
    (tmp_path / "1.jsonl").write_text(json.dumps(new) + "\n")
    (tmp_path / "2.jsonl").write_text(json.dumps(old) + "\n")
    found = read_records(tmp_path, 5.0)
    assert len(found) == 1 and found[0]["verdicts"] == new["verdicts"] and "carried_from" not in found[0]
