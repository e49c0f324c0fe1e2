"""Every draft vLLM verified, per request, written where the parity runtime reads it.

vLLM returns a request's tokens and, with `--per-request-spec-decode-metrics detailed`, the accepted
count of every verification step (`per_step_accepted`), never the drafts themselves. A parity check
that sees counts only cannot tell a wrong draft from a right one that the target rejected, so some
drafter bugs pass where their effect on the counts is within the runtime's precision
(docs/runtimes.md, "Where it cannot see").

With EAGLE31_VLLM_DRAFT_LOG naming a folder, this plugin wraps two methods of vLLM 0.32's V1
scheduler (`vllm/v1/core/sched/scheduler.py`):
- `update_from_output(scheduler_output, model_runner_output)` keeps the step's scheduler output
  while it runs;
- `make_spec_decoding_stats(..., num_draft_tokens, num_accepted_tokens, ..., request_id)`, which
  vLLM calls once for every request a step verified drafts of, right before it records that step's
  accepted count into the request's `per_step_accepted`, appends one JSON line: the request's id,
  the drafts the step verified (`scheduled_spec_decode_tokens[request_id]`, vLLM's own list) and the
  accepted count.
The lines are therefore the request's verification steps, in order, one for one with its
`per_step_accepted`. Nothing vLLM computes changes. Each process writes its own file
(`drafts-<pid>.jsonl`), a line at a time, before vLLM sends the step's tokens on, so the line is in
the file before the response that contains them. Unset, the plugin does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading

log = logging.getLogger("vllm.eagle31_vllm_plugin")

LOG_ENV = "EAGLE31_VLLM_DRAFT_LOG"  # a folder: every verified draft is appended there (read by the parity runtime)
WRAPPED_MARK = "_eagle31_draft_log"  # on a wrapper: a second load of the plugin does not wrap twice
STEP_ATTR = "_eagle31_step"  # on the scheduler: the scheduler output of the step being processed

_lock = threading.Lock()
_file = None


def _write(record: dict) -> None:
    global _file
    with _lock:
        if _file is None:
            path = os.path.join(os.environ[LOG_ENV], f"drafts-{os.getpid()}.jsonl")
            _file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: each line lands as written
        _file.write(json.dumps(record) + "\n")


def keeping_the_step(update_from_output):
    """`Scheduler.update_from_output`, with its scheduler output kept on the scheduler while it runs."""

    def wrapped(self, scheduler_output, model_runner_output, *args, **kwargs):
        setattr(self, STEP_ATTR, scheduler_output)
        try:
            return update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)
        finally:
            setattr(self, STEP_ATTR, None)

    setattr(wrapped, WRAPPED_MARK, True)
    return wrapped


def logging_the_drafts(make_spec_decoding_stats):
    """`Scheduler.make_spec_decoding_stats`, which first logs the request's verified drafts."""

    def wrapped(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                request_id, *args, **kwargs):
        step = getattr(self, STEP_ATTR, None)
        drafts = None if step is None else step.scheduled_spec_decode_tokens.get(request_id)
        if drafts is not None:
            _write({"request": request_id, "drafts": [int(t) for t in drafts], "accepted": int(num_accepted_tokens)})
        return make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                        num_invalid_spec_tokens, request_id, *args, **kwargs)

    setattr(wrapped, WRAPPED_MARK, True)
    return wrapped


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    if not os.environ.get(LOG_ENV):
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.make_spec_decoding_stats, WRAPPED_MARK, False):
        return
    Scheduler.update_from_output = keeping_the_step(Scheduler.update_from_output)
    Scheduler.make_spec_decoding_stats = logging_the_drafts(Scheduler.make_spec_decoding_stats)
    log.info("eagle31-vllm-plugin: every verified draft is logged to %s", os.environ[LOG_ENV])
