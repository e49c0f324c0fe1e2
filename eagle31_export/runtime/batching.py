"""Continuous batching for the speculation loop: the requests in flight share each backend call.

Each request runs the one speculation loop (`reference.speculate.speculate`) in its own thread, on
its own sequence: backends forked from the loaded ones (`fork()`: same sessions, a cache of its
own). Their forward calls meet at a `Batcher`: once every sequence in flight waits on a call, the
calls of one kind (the target's verify or prefill, the drafter's first or next step, a chain) run
as ONE batched call of the backend's `*_batch` method, sequences of different lengths padded and
masked there (`runtime/onnxruntime.py: run_batch`). A request that arrives joins at the next
meeting; one that finishes leaves. Cache bookkeeping (`length`, `truncate`, `reset`) stays per
sequence and never waits.

This is what a serving engine does under load, so the exported graphs run at batch > 1 with
per-sequence positions, cache lengths and padding, and parity at concurrency C checks them there.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from eagle31_export.reference.speculate import speculate
from eagle31_export.runtime.contract import LoopSpeculator

MAX_BATCH = 64  # sequences per backend call; more wait for the next one


@dataclass(eq=False)
class _Call:
    key: tuple
    run: Callable[[list], list]  # the backend's batched method: items -> results, in order
    item: Any
    done: bool = False
    result: Any = None
    error: BaseException | None = field(default=None, repr=False)


class Batcher:
    """Where the sequences in flight meet: a call waits until every member waits, then the calls
    run grouped by key, up to `max_batch` a call, in the thread that completed the meeting."""

    def __init__(self, max_batch: int = MAX_BATCH):
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._members = 0
        self._pending: list[_Call] = []
        self.batch_sizes: Counter[int] = Counter()  # batched calls per size: what the batching did

    @contextmanager
    def member(self):
        """One sequence in flight, for the duration of its loop."""
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                self._run_if_all_wait()

    def call(self, key: tuple, run: Callable[[list], list], item):
        call = _Call(key, run, item)
        with self._cond:
            self._pending.append(call)
            self._run_if_all_wait()
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _run_if_all_wait(self) -> None:
        if not self._pending or len(self._pending) < self._members:
            return
        pending, self._pending = self._pending, []
        groups: dict[tuple, list[_Call]] = defaultdict(list)
        for call in pending:
            groups[call.key].append(call)
        for calls in groups.values():
            for start in range(0, len(calls), self.max_batch):
                self._run_group(calls[start: start + self.max_batch])
        self._cond.notify_all()

    def _run_group(self, calls: list[_Call]) -> None:
        self.batch_sizes[len(calls)] += 1
        try:
            results = calls[0].run([c.item for c in calls])
        except BaseException as err:  # every sequence of the failed call hears of it; the others go on
            for c in calls:
                c.error, c.done = err, True
            return
        for c, result in zip(calls, results):
            c.result, c.done = result, True


class BatchedTarget:
    """A `TargetBackend` for one sequence whose forwards meet the others' at the batcher."""

    def __init__(self, inner, batcher: Batcher):
        self.inner, self.batcher = inner, batcher

    def __getattr__(self, name):  # length, truncate, reset, vocab_size, max_positions: this sequence's own
        return getattr(self.inner, name)

    def forward(self, input_ids):
        return self.batcher.call(("target",), self.inner.forward_batch, (self.inner, input_ids))


class BatchedDrafter:
    """A `DrafterBackend` (and `ChainDrafterBackend` where the inner one is) for one sequence."""

    def __init__(self, inner, batcher: Batcher):
        self.inner, self.batcher = inner, batcher

    def __getattr__(self, name):  # length, truncate, reset, draft_to_target, chain_depth
        return getattr(self.inner, name)

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        return self.batcher.call(("drafter", bool(hidden_is_aux)), self.inner.forward_batch,
                                 (self.inner, (input_ids, positions, hidden, hidden_is_aux)))

    def draft_chain(self, input_ids, positions, hidden, depth):
        # one chain call continues every sequence from its last position: same new-token count per call
        return self.batcher.call(("chain", int(input_ids.shape[1])), self.inner.draft_chain_batch,
                                 (self.inner, (input_ids, positions, hidden, depth)))


class BatchingSpeculator(LoopSpeculator):
    """A `LoopSpeculator` whose concurrent `run` calls are served together, batched per backend call.
    The loaded backends stay for `replay` and the per-depth measurement; each run forks its own."""

    serves_concurrently = True

    def __init__(self, name: str, target, drafter, exact: bool = True, max_batch: int = MAX_BATCH):
        super().__init__(name, target, drafter, exact)
        self.batcher = Batcher(max_batch)

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        target = BatchedTarget(self.target.fork(), self.batcher)
        drafter = BatchedDrafter(self.drafter.fork(), self.batcher)
        with self.batcher.member():
            return speculate(target, drafter, list(prompt_ids), max_new_tokens, depth, temperature, seed,
                             tuple(stop_ids), observer)
