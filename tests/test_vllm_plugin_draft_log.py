"""Our vLLM plugin's draft log (plugins/vllm/eagle31_vllm_plugin/draft_log.py) on a scheduler of the shape
of vLLM 0.32's (its two methods written here), read back by the parity runtime (runtime/vllm_drafts.py).
The real scheduler, in a real engine: tests/test_vllm_engine.py (every draft of an fp32 run identical to
the reference's, and the sabotaged bundles failing on their drafts)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle31_export.errors import UserError
from eagle31_export.runtime.vllm_drafts import DRAFT_LOG_ENV, DRAFT_LOG_PLUGIN, DraftLog

PLUGIN = PLUGIN_ROOT = Path(__file__).resolve().parents[1] / "plugins" / "vllm"
sys.path.insert(0, str(PLUGIN_ROOT))  # the plugin package, which vLLM alone installs

from eagle31_vllm_plugin import draft_log  # noqa: E402


class Scheduler:
    """vLLM 0.32's order: update_from_output calls make_spec_decoding_stats for every request whose
    scheduled drafts the step verified (and that produced tokens), then records the accepted count."""

    def __init__(self):
        self.per_step_accepted: dict[str, list[int]] = {}

    def update_from_output(self, scheduler_output, model_runner_output):
        for req_id, tokens in model_runner_output.items():
            spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if spec and tokens:
                self.make_spec_decoding_stats(None, len(spec), len(tokens) - 1, None, request_id=req_id)
                self.per_step_accepted.setdefault(req_id, []).append(len(tokens) - 1)
        return "outputs"

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        return "stats"


def step(scheduler, spec: dict, sampled: dict):
    return scheduler.update_from_output(SimpleNamespace(scheduled_spec_decode_tokens=spec), sampled)


@pytest.fixture
def logged_scheduler(tmp_path, monkeypatch):
    monkeypatch.setenv(draft_log.LOG_ENV, str(tmp_path))
    monkeypatch.setattr(draft_log, "_file", None)
    Patched = type("Patched", (Scheduler,), {})
    Patched.update_from_output = draft_log.keeping_the_step(Scheduler.update_from_output)
    Patched.make_spec_decoding_stats = draft_log.logging_the_drafts(Scheduler.make_spec_decoding_stats)
    yield Patched()
    if draft_log._file is not None:
        draft_log._file.close()


def test_names_agree_between_the_plugin_and_the_runtime():
    assert draft_log.LOG_ENV == DRAFT_LOG_ENV
    assert f'{DRAFT_LOG_PLUGIN} = "eagle31_vllm_plugin.draft_log:register"' in (PLUGIN / "pyproject.toml").read_text()


def test_each_verification_step_is_logged_and_read_back_in_order(tmp_path, logged_scheduler):
    a, b = "cmpl-eagle31-aa-0-1234abcd", "cmpl-eagle31-bb-0-5678ef01"
    # step 1: a verifies [5, 6, 7] and accepts 2 (3 tokens), b is prefilling (no drafts)
    assert step(logged_scheduler, {a: [5, 6, 7]}, {a: [5, 6, 9], b: [4]}) == "outputs"
    # step 2: both verify; b's drafts produced no token (a finished step): vLLM records nothing for it
    step(logged_scheduler, {a: [1, 2, 3], b: [8, 8, 8]}, {a: [4], b: []})
    step(logged_scheduler, {b: [7, 7, 7]}, {b: [7, 7, 7, 2]})
    log = DraftLog(tmp_path)
    assert log.take("eagle31-aa", logged_scheduler.per_step_accepted[a]) == [[5, 6, 7], [1, 2, 3]]
    assert log.take("eagle31-bb", [3]) == [[7, 7, 7]]
    assert getattr(logged_scheduler, draft_log.STEP_ATTR) is None  # the step is not kept past its update


def test_a_log_that_does_not_match_the_response_is_refused(tmp_path, logged_scheduler):
    step(logged_scheduler, {"r-eagle31-cc": [1, 2, 3]}, {"r-eagle31-cc": [1, 5]})
    with pytest.raises(UserError, match="did not log this request.s drafts there"):
        DraftLog(tmp_path).take("eagle31-cc", [1, 0])  # the response has a step the log does not
    with pytest.raises(UserError, match="holds 0 verification steps"):
        DraftLog(tmp_path / "empty").take("eagle31-dd", [2])


def test_a_line_still_being_written_waits_for_its_end(tmp_path):
    log = DraftLog(tmp_path)
    path = tmp_path / "drafts-1.jsonl"
    path.write_text('{"request": "x-eagle31-ee", "drafts": [1, 2], "accepted": 1}\n{"request": "x-eagle31-ff", "dr')
    assert log.take("eagle31-ee", [1]) == [[1, 2]]
    with open(path, "a") as f:
        f.write('afts": [3], "accepted": 0}\n')
    assert log.take("eagle31-ff", [0]) == [[3]]


def test_register_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(draft_log.LOG_ENV, raising=False)
    assert draft_log.register() is None  # returns before importing vLLM (not installed here)
