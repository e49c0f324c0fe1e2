"""Continuous batching for the speculation loop: the requests in flight share each backend call.

Each request runs the one speculation loop (`reference.speculate.speculate`) in its own thread, on
its own sequence: backends forked from the loaded ones (`fork()`: same sessions, a cache of its
own). Their forward calls meet at a `Batcher`; once every sequence in flight waits on a call, the
batcher schedules like an engine's step, so that the sequences advance in step:

- every call has a phase, its place in the speculation round: 0 the target's forward (prefill or
  verify), 1 the drafter's first step (or a chain), 1 + k its k-th next step;
- at each meeting only the calls of ONE phase run: the phase most sequences wait at (ties: the
  earliest in the round), one backend call per key, up to `max_batch` sequences a call (a prefill
  and a verify share one padded target call); the others wait. The most sequences thus make
  progress at every call, and a sequence out of phase (it joined late, or met the others at another
  step of its round) waits until they come round to its step, then runs with them: from then on
  every call of one kind serves every sequence in flight. A newcomer's prefill waits for the
  others' verify, so joining costs no call of its own;
- a sequence with a shorter round (fewer draft steps, or a chain) can lap one that waits at a later
  step without ever reaching it: a waiting call that another sequence has overtaken (run two target
  forwards while it waited) runs at the next meeting as well, so no call waits for good.

Sequences of different lengths are padded and masked in the backend's `*_batch` method
(`runtime/onnxruntime.py: run_batch`). A request that arrives joins at the next meeting; one that
finishes leaves, and its leaving can complete a meeting. Cache bookkeeping (`length`, `truncate`,
`reset`) stays per sequence and never waits.

Every backend call is recorded (`BatchedCall`: size, phase, prefill or not, sequences in flight)
with each sequence that took part, so a run can say how many requests really ran together
(`batch_figures`), in process or, through the Triton `cpu` repository's responses, on a client.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from eagle31_export.reference.speculate import SpecResult, speculate
from eagle31_export.runtime.contract import BatchFigures, ConcurrentRun, LoopSpeculator

MAX_BATCH = 64  # sequences per backend call; more wait for the next one
TARGET_PHASE, FIRST_DRAFT_PHASE = 0, 1  # a drafter's k-th next step is FIRST_DRAFT_PHASE + k
OVERTAKEN = 2  # target forwards another sequence ran while a call waited: it has lapped that call
SOURCE = "backend calls"  # how BatchFigures were measured


@dataclass(frozen=True)
class BatchedCall:
    """One backend call the batcher made: `id` unique per batcher, `size` sequences in it, `phase`
    as above, `prefill` when a sequence in it had an empty target cache, `in_flight` the sequences
    in flight when it ran."""

    id: int
    key: tuple
    phase: int
    size: int
    prefill: bool
    in_flight: int

    def row(self) -> list[int]:
        """What a Triton response carries per call (the client's `batch_figures` reads these four)."""
        return [self.id, self.size, int(self.prefill), self.in_flight]

    @classmethod
    def from_row(cls, row) -> "BatchedCall":
        id_, size, prefill, in_flight = (int(v) for v in row)
        return cls(id_, (), -1, size, bool(prefill), in_flight)


class Sequence:
    """One sequence in flight: the calls it took part in."""

    def __init__(self):
        self.calls: list[BatchedCall] = []


@dataclass(eq=False)
class _Call:
    sequence: Sequence
    key: tuple
    phase: int
    run: Callable[[list], list]  # the backend's batched method: items -> results, in order
    item: Any
    prefill: bool = False
    done: bool = False
    result: Any = None
    error: BaseException | None = field(default=None, repr=False)
    # target forwards each other sequence ran while this call waited
    overtaken_by: Counter = field(default_factory=Counter, repr=False)

    @property
    def overdue(self) -> bool:
        return any(n >= OVERTAKEN for n in self.overtaken_by.values())


class Batcher:
    """Where the sequences in flight meet: a call waits until every member waits; then the phase most
    of them wait at (and any overdue call's phase) runs, grouped by key, up to `max_batch` a call, in
    the thread that completed the meeting."""

    def __init__(self, max_batch: int | None = None):
        self.max_batch = max_batch or MAX_BATCH  # read at creation: a test can narrow MAX_BATCH
        self._cond = threading.Condition()
        self._members = 0
        self._arriving = 0  # members announced by `arrivals` that have not joined yet
        self._pending: list[_Call] = []
        self._ids = itertools.count(1)
        self.batch_sizes: Counter[int] = Counter()  # batched calls per size since creation

    @contextmanager
    def member(self):
        """One sequence in flight, for the duration of its loop; yields its `Sequence`."""
        sequence = Sequence()
        with self._cond:
            self._members += 1
            self._arriving = max(0, self._arriving - 1)
        try:
            yield sequence
        finally:
            with self._cond:
                self._members -= 1
                self._meet()

    @contextmanager
    def arrivals(self, count: int):
        """The next `count` members start together: nothing runs until they have all joined, so their
        prefills meet in one call (a start-up barrier). Ends with the block, whoever joined: it only
        holds calls back, it never makes one wait for good."""
        with self._cond:
            self._arriving += count
        try:
            yield
        finally:
            with self._cond:
                self._arriving = 0
                self._meet()

    def call(self, sequence: Sequence, key: tuple, phase: int, run: Callable[[list], list], item,
             prefill: bool = False):
        call = _Call(sequence, key, phase, run, item, prefill)
        with self._cond:
            self._pending.append(call)
            self._meet()
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _meet(self) -> None:
        if not self._pending or len(self._pending) < self._members or self._arriving:
            return
        chosen = self._choose()
        self._pending = [c for c in self._pending if c not in chosen]
        for calls in _by_key(chosen).values():
            for start in range(0, len(calls), self.max_batch):
                self._run_group(calls[start: start + self.max_batch])
        self._note_overtaking(chosen)
        self._cond.notify_all()

    def _choose(self) -> list[_Call]:
        """The calls of the phase most sequences wait at (ties: the earliest in the round), and of the
        phase of any overdue call."""
        waiting = Counter(c.phase for c in self._pending)
        busiest = min(waiting, key=lambda phase: (-waiting[phase], phase))
        phases = {busiest} | {c.phase for c in self._pending if c.overdue}
        return [c for c in self._pending if c.phase in phases]

    def _note_overtaking(self, ran: list[_Call]) -> None:
        movers = [c.sequence for c in ran if c.phase == TARGET_PHASE]
        for waiting in self._pending:
            waiting.overtaken_by.update(movers)

    def _run_group(self, calls: list[_Call]) -> None:
        record = BatchedCall(next(self._ids), calls[0].key, calls[0].phase, len(calls),
                             any(c.prefill for c in calls), self._members)
        self.batch_sizes[record.size] += 1
        for c in calls:
            c.sequence.calls.append(record)
        try:
            results = calls[0].run([c.item for c in calls])
            if len(results) != len(calls):
                raise RuntimeError(f"a batched backend call returned {len(results)} results for {len(calls)} sequences")
        except BaseException as err:  # every sequence of the failed call hears of it; the others go on
            for c in calls:
                c.error, c.done = err, True
            return
        for c, result in zip(calls, results):
            c.result, c.done = result, True


def _by_key(calls: list[_Call]) -> dict[tuple, list[_Call]]:
    groups: dict[tuple, list[_Call]] = defaultdict(list)
    for call in calls:
        groups[call.key].append(call)
    return groups


def _cache_length(backend) -> int:
    length = backend.length
    return length() if callable(length) else int(length)


class BatchedTarget:
    """A `TargetBackend` for one sequence whose forwards meet the others' at the batcher."""

    def __init__(self, inner, batcher: Batcher, sequence: Sequence):
        self.inner, self.batcher, self.sequence = inner, batcher, sequence

    def __getattr__(self, name):  # length, truncate, reset, vocab_size, max_positions: this sequence's own
        return getattr(self.inner, name)

    def forward(self, input_ids, logits_to_keep: int = 0):
        # the prompt's forward: nothing processed yet, or a later piece of a long prompt (the only
        # forwards that keep their last logits alone: reference.speculate.prefill)
        prefill = _cache_length(self.inner) == 0 or logits_to_keep > 0
        # the inner backend keeps the last `logits_to_keep` logits itself: a long prompt's piece never
        # holds its [T, V] block
        return self.batcher.call(self.sequence, ("target",), TARGET_PHASE, self.inner.forward_batch,
                                 (self.inner, input_ids, logits_to_keep), prefill)


class BatchedDrafter:
    """A `DrafterBackend` (and `ChainDrafterBackend` where the inner one is) for one sequence; it
    counts its steps within the round, which is the phase its calls are scheduled by."""

    def __init__(self, inner, batcher: Batcher, sequence: Sequence):
        self.inner, self.batcher, self.sequence = inner, batcher, sequence
        self.step = 0

    def __getattr__(self, name):  # length, truncate, reset, draft_to_target, chain_depth
        return getattr(self.inner, name)

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        self.step = 0 if hidden_is_aux else self.step + 1  # the first step of a round reads the tapped states
        return self.batcher.call(self.sequence, ("drafter", bool(hidden_is_aux)), FIRST_DRAFT_PHASE + self.step,
                                 self.inner.forward_batch, (self.inner, (input_ids, positions, hidden, hidden_is_aux)))

    def draft_chain(self, input_ids, positions, hidden, depth):
        # one chain call continues every sequence from its last position: same new-token count per call
        self.step = 0
        return self.batcher.call(self.sequence, ("chain", int(input_ids.shape[1])), FIRST_DRAFT_PHASE,
                                 self.inner.draft_chain_batch, (self.inner, (input_ids, positions, hidden, depth)))


def batch_figures(calls: Iterable[BatchedCall], concurrency: int, source: str = SOURCE) -> BatchFigures | None:
    """What the calls (each counted once, by id) say about one run at `concurrency` requests in flight:
    steady state is every call that is not a prefill and ran while `concurrency` sequences were in
    flight. None when there were no calls."""
    unique = list({c.id: c for c in calls}.values())
    if not unique:
        return None
    steady = [c.size for c in unique if not c.prefill and c.in_flight >= concurrency]
    return BatchFigures(source=source, histogram=dict(sorted(Counter(c.size for c in unique).items())),
                        largest=max(c.size for c in unique), mean=round(sum(c.size for c in unique) / len(unique), 3),
                        steady_mean=round(sum(steady) / len(steady), 3) if steady else None,
                        steady_calls=len(steady), in_flight=max(c.in_flight for c in unique))


class BatchingSpeculator(LoopSpeculator):
    """A `LoopSpeculator` whose concurrent `run` calls are served together, batched per backend call.
    The loaded backends stay for `replay` and the per-depth measurement; each run forks its own."""

    serves_concurrently = True

    def __init__(self, name: str, target, drafter, exact: bool = True, max_batch: int | None = None):
        super().__init__(name, target, drafter, exact)
        self.batcher = Batcher(max_batch)

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        return self.run_recorded(prompt_ids, max_new_tokens, depth, temperature, seed, stop_ids, observer)[0]

    def run_recorded(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(),
                     observer=None) -> tuple[SpecResult, list[BatchedCall]]:
        """`run`, and the batched calls this request took part in."""
        with self.batcher.member() as sequence:  # joined first: a failing fork still leaves, never hangs a meeting
            target = BatchedTarget(self.target.fork(), self.batcher, sequence)
            drafter = BatchedDrafter(self.drafter.fork(), self.batcher, sequence)
            result = speculate(target, drafter, list(prompt_ids), max_new_tokens, depth, temperature, seed,
                               tuple(stop_ids), observer)
        return result, sequence.calls

    def run_concurrently(self, prompts, max_new_tokens, depth, concurrency, temperature=0.0, seed=0) -> ConcurrentRun:
        """As `Speculator.run_concurrently` (prompt i with seed + i, results in prompt order), the
        first `concurrency` requests starting together, with the batch sizes of this run's calls."""
        def one(i: int) -> tuple[SpecResult, list[BatchedCall]]:
            return self.run_recorded(prompts[i], max_new_tokens, depth, temperature, seed + i)

        with self.batcher.arrivals(min(concurrency, len(prompts))), \
                ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eagle31-request") as pool:
            done = list(pool.map(one, range(len(prompts))))
        calls = [call for _, took_part in done for call in took_part]
        return ConcurrentRun([result for result, _ in done], batching=batch_figures(calls, concurrency))
