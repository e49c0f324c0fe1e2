"""The drafts a local vLLM engine verified, read back per request from our vLLM plugin's log.

vLLM returns tokens and per-step accepted counts only. Our plugin
(`plugins/vllm/eagle31_vllm_plugin/draft_log.py`), loaded by an engine started with DRAFT_LOG_ENV
naming a folder, appends one JSON line per verification step of every request: the engine's
request id, the drafts it verified, the accepted count. Our client names each request
(`request_id`, which vLLM keeps inside its own id), so the lines of one request are found by that
name; they must be its `per_step_accepted`, step for step, and each step's drafts must be as many as
its `per_step_drafted`, no more than `num_spec_tokens`, and no fewer than it accepted, or the log is
not trusted. A step logged with placeholders (-1: vLLM's async scheduler schedules them before the
worker drafts; the plugin marks the line) is no draft at all: that request's drafts are not reported.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

from eagle31_export.errors import UserError

DRAFT_LOG_PLUGIN = "eagle31_draft_log"  # the entry point's name (plugins/vllm/pyproject.toml)
DRAFT_LOG_ENV = "EAGLE31_VLLM_DRAFT_LOG"  # plugins/vllm/eagle31_vllm_plugin/draft_log.py: LOG_ENV
HOW = ("every draft the engine verified, logged per request by our vLLM plugin in vLLM's scheduler "
       "(eagle31_vllm_plugin.draft_log)")


class DraftLog:
    """The folder the engine logs into; `take` a finished request's drafts, round by round."""

    def __init__(self, folder: Path, served: bool = False):
        """`served`: a server started apart logs there (--draft-log), so the folder must exist; else the
        folder is made for a local engine."""
        self.folder = Path(folder)
        if served and not self.folder.is_dir():
            raise UserError(f"--draft-log {folder}: no such folder; start the vLLM server with {DRAFT_LOG_ENV}="
                            f"{folder} and our plugin installed (pip install --no-deps plugins/vllm), on this machine")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._offsets: dict[Path, int] = {}
        self._steps: dict[str, list[tuple[list[int], int, bool]]] = {}
        self.refused: str | None = None  # why the last request `take` returned None for was not reported
        self._lock = threading.Lock()

    @staticmethod
    def new_request_id() -> str:
        return f"eagle31-{uuid.uuid4().hex}"

    @property
    def env(self) -> dict[str, str]:
        """What the engine's environment needs for the plugin to log here."""
        return {DRAFT_LOG_ENV: str(self.folder)}

    def take(self, request_id: str, accepted: list[int], drafted: list[int] | None = None,
             depth: int | None = None) -> list[list[int]] | None:
        """The drafts of each verification step of the request named `request_id`, checked against what
        its response reports: the accepted counts, and where given the drafts per step (`drafted`, vLLM's
        per_step_drafted) and the most per step (`depth`, num_spec_tokens); forgotten once taken. None
        where the engine logged placeholders for them (`refused` says why): not drafts, not reported."""
        with self._lock:
            self._read()
            names = [name for name in self._steps if request_id in name]
            steps = [step for name in names for step in self._steps.pop(name)]
        logged = [count for _, count, _ in steps]
        if logged != list(accepted):
            raise UserError(f"the vLLM engine's draft log ({self.folder}) holds {len(steps)} verification steps for "
                            f"request {request_id} (accepted {logged[:8]}...), its response {len(accepted)} "
                            f"(accepted {list(accepted)[:8]}...): "
                            f"the engine did not log this request's drafts there: our vLLM plugin (plugins/vllm) must be "
                            f"installed where it runs, with {DRAFT_LOG_ENV} naming this folder, and match its vLLM")
        marked = [i for i, (drafts, _, placeholders) in enumerate(steps) if placeholders or any(t < 0 for t in drafts)]
        if marked:
            self.refused = (f"the vLLM engine logged placeholders, not drafts, for {len(marked)} of the {len(steps)} "
                            f"verification steps of request {request_id} (step {marked[0]}: {steps[marked[0]][0]}): "
                            "vLLM's async scheduler schedules -1 for every draft before the worker drafts them; "
                            "compared on tokens and accepted counts only (start vLLM with --no-async-scheduling "
                            "to compare every draft)")
            return None
        for i, (drafts, count, _) in enumerate(steps):
            wrong = (f"{len(drafts)} drafts, the response {drafted[i]}" if drafted is not None and i < len(drafted)
                     and len(drafts) != int(drafted[i]) else
                     f"{len(drafts)} drafts, more than the engine's depth {depth}" if depth and len(drafts) > depth
                     else f"{len(drafts)} drafts, fewer than the {count} accepted" if count > len(drafts) else None)
            if wrong is not None:
                raise UserError(f"the vLLM engine's draft log ({self.folder}) does not match request {request_id}'s "
                                f"response: its verification step {i} logged {wrong}: the log is not this "
                                f"engine's drafts; our vLLM plugin (plugins/vllm) must match its vLLM")
        if drafted is not None and len(drafted) != len(steps):
            raise UserError(f"the vLLM engine's draft log ({self.folder}) holds {len(steps)} verification steps for "
                            f"request {request_id}, its response's per_step_drafted {len(drafted)}: the log is not "
                            "this engine's drafts")
        return [drafts for drafts, _, _ in steps]

    def _read(self) -> None:
        """New complete lines of every process's file (a line still being written waits)."""
        for path in sorted(self.folder.glob("drafts-*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                record = json.loads(line)
                self._steps.setdefault(record["request"], []).append(
                    ([int(t) for t in record["drafts"]], int(record["accepted"]), bool(record.get("placeholders"))))
