"""How long-running library functions report progress, and how they time their phases.

Every such function takes `progress=None`: a callable `progress(phase, done, total)`, where `phase`
is a short key (`load_target`, `generate`, `compare`, ...), `done` counts units of that phase
finished so far and `total` is how many there will be (None when unknown: a spinner, not a bar).
The library never draws; `cli/progress.py` renders these reports.

`Phases` times named phases with `time.perf_counter` and reports their start. A caller that wants
the timings of a whole command passes a `Phases` as `progress`: `Phases.of(progress)` hands the
very same object back, so the library's phases and the caller's own land in one `timings` dict.
Standard library only, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional, Protocol


class Progress(Protocol):
    def __call__(self, phase: str, done: int, total: Optional[int]) -> None: ...


class Phases:
    """Named phase timings (seconds, summed when a phase runs more than once), reported to `progress`."""

    def __init__(self, progress: Optional[Progress] = None):
        self.progress = progress
        self.timings: dict[str, float] = {}

    @classmethod
    def of(cls, progress: "Progress | Phases | None") -> "Phases":
        """The caller's own `Phases` when it passed one, else a new one reporting to `progress`."""
        return progress if isinstance(progress, Phases) else cls(progress)

    def __call__(self, phase: str, done: int, total: Optional[int] = None) -> None:
        """Report `done` of `total` units of `phase` (a `Phases` is itself a progress callback)."""
        if self.progress is not None:
            self.progress(phase, done, total)

    @contextlib.contextmanager
    def phase(self, name: str, total: Optional[int] = None) -> Iterator["Phases"]:
        """Time the block as `name`; reported as started (0 of `total`) on entry and as finished on exit."""
        self(name, 0, total)
        start = time.perf_counter()
        try:
            yield self
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        self(name, total if total is not None else 1, total if total is not None else 1)

    def as_json(self) -> dict[str, float]:
        """The timings for a JSON report: seconds as measured (not rounded up past the wall time)."""
        return dict(self.timings)
