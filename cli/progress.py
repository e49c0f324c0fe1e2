"""The one progress display of the commands: the library's `progress(phase, done, total)` reports
(eagle31_export/progress.py) drawn as rich bars on stderr, one row per running phase.

Drawn only when stderr is a terminal: piped or captured stderr gets no escape codes, and stdout
(where `--json` prints) is never written. The display is transient: it vanishes when the command
ends, leaving only what the command prints.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from rich.console import Console

from eagle31_export.progress import Phases

# The words drawn for the library's phase keys (unknown keys are drawn as they are).
LABELS = {
    "load": "loading the pair",
    "load_target": "loading the target",
    "load_drafter": "loading the drafter",
    "load_reference": "loading the reference pair",
    "load_runtime": "loading the runtime",
    "prefill": "prefilling the prompt (tokens)",
    "generate": "generating (tokens)",
    "compare": "parity (prompts)",
    "greedy_drafts": "the drafter run greedy (prompts)",
    "concurrency": "under load (concurrency levels)",
    "mixed_batches": "greedy among sampled requests (concurrency levels)",
    "measure": "measuring (prompts)",
    "capture": "capturing (prompts)",
    "export": "exporting",
    "export_drafter": "exporting drafter graphs",
    "export_target": "exporting the target graph",
    "write": "writing",
    "tensors": "tensors",
}


class ProgressDisplay:
    """Renders progress reports; use as a context manager and pass it (or `.phases()`) as `progress`.

    A phase's row appears with its first report and goes away when it reports done == total, so
    the screen shows what is running now. `label` (from `update`) replaces the phase's words, e.g.
    the tensor being written.
    """

    def __init__(self, title: str = "", console: Optional[Console] = None, enabled: Optional[bool] = None):
        self.title = title
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self._bar = None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> "ProgressDisplay":
        return self

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None
        return False

    def phases(self) -> Phases:
        """A phase timer that reports here: pass it as the library's `progress` to get the timings back."""
        return Phases(self)

    def __call__(self, phase: str, done: int, total: Optional[int]) -> None:
        self.update(phase, done, total)

    def update(self, phase: str, done: int, total: Optional[int], label: Optional[str] = None) -> None:
        if not self.enabled:
            return
        bar = self._start()
        words = label or LABELS.get(phase, phase.replace("_", " "))
        if self.title:
            words = f"{self.title}: {words}"
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = bar.add_task(words, total=total)
        finished = total is not None and done >= total
        bar.update(task, completed=done, total=total, description=words, visible=not finished)
        if finished:  # a later report of the same phase (a second prompt's generation) starts a new row
            self._tasks.pop(phase)

    def tensor_steps(self) -> Callable[[int, int, str], None]:
        """An adapter for the NVFP4 writers' `progress(done, total, description)` (tensors written)."""
        return lambda done, total, description: self.update("tensors", done, total, description)

    def _start(self):
        if self._bar is None:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=True)
            self._bar.__enter__()
        return self._bar


@contextlib.contextmanager
def working(title: str, phase: str = "write", console: Optional[Console] = None) -> Iterator[Phases]:
    """A spinner with the elapsed time, for library work that reports no steps of its own (writing a
    bundle, converting a checkpoint); yields the phase timer, which has timed `phase` on exit."""
    with ProgressDisplay(title, console) as display:
        phases = display.phases()
        with phases.phase(phase):
            yield phases
