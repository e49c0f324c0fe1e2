"""The batcher's scheduling (runtime/batching.py), with backends that only record what they were
called with: which calls run together, in which order, and that every call runs (no deadlock, no
starvation). Each sequence runs a script of (key, phase) calls in its own thread, as the speculation
loop would; the loop itself on real graphs is tests/test_parity_concurrency.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from eagle31_export.runtime.batching import BatchedCall, BatchedTarget, Batcher, batch_figures

TARGET, FIRST, NEXT = ("target",), ("drafter", True), ("drafter", False)
ROUND = [(TARGET, 0), (FIRST, 1), (NEXT, 2), (NEXT, 3)]  # one speculation round at depth 3
TIMEOUT = 20  # seconds a script may take: a deadlock fails the test instead of hanging it


class Recorder:
    """A backend's batched method: logs each call's items [(sequence name, phase)] and returns them."""

    def __init__(self, fail_key=None, seconds: float = 0.0):
        self.calls: list[list[tuple[str, int]]] = []
        self.fail_key, self.seconds = fail_key, seconds

    def method(self, key):
        def run(items):
            self.calls.append(list(items))
            time.sleep(self.seconds)
            if key == self.fail_key:
                raise ValueError("this call fails")
            return list(items)
        return run


def run_scripts(batcher: Batcher, scripts: dict[str, list], recorder: Recorder, together: bool = True,
                records: list | None = None) -> dict:
    """Each script in a thread of its own, as one sequence; returns each one's error or None.
    `records` receives the batcher's record of every call each sequence took part in."""
    errors: dict[str, BaseException | None] = {}

    def sequence(name):
        try:
            with batcher.member() as seq:
                for key, phase in scripts[name]:
                    batcher.call(seq, key, phase, recorder.method(key), (name, phase))
            errors[name] = None
            if records is not None:
                records.extend(seq.calls)
        except BaseException as err:  # noqa: BLE001 - the test reads what each sequence got
            errors[name] = err

    threads = [threading.Thread(target=sequence, args=(name,), daemon=True) for name in scripts]
    with batcher.arrivals(len(scripts) if together else 0):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), f"deadlock: {recorder.calls}"
    return errors


def names(call) -> set[str]:
    return {name for name, _ in call}


def test_a_sequence_out_of_phase_waits_for_the_others_to_come_round_then_every_call_serves_all():
    """Four sequences at the third step of their round, one at its prefill: the four run on (the most
    sequences make progress) and the prefill joins their verify; from then on every call serves all
    five."""
    ahead = ROUND[2:] + ROUND * 3
    scripts = {**{f"a{i}": ahead for i in range(4)}, "late": ROUND * 3}
    recorder = Recorder()
    assert run_scripts(Batcher(), scripts, recorder) == dict.fromkeys(scripts)
    assert [sorted(call) for call in recorder.calls[:2]] == [[(f"a{i}", phase) for i in range(4)] for phase in (2, 3)]
    assert names(recorder.calls[2]) == set(scripts)  # the verify of the four and the prefill, in one call
    assert [len(call) for call in recorder.calls[2:]] == [5] * 12
    assert all(len({phase for _, phase in call}) == 1 for call in recorder.calls)  # one step of the round a call


def test_as_many_sequences_at_two_steps_run_the_earlier_step_first():
    scripts = {"p": ROUND, "q": ROUND, "r": [(NEXT, 3)] + ROUND, "s": [(NEXT, 3)] + ROUND}
    recorder = Recorder()
    run_scripts(Batcher(), scripts, recorder)
    assert [sorted(call) for call in recorder.calls[:4]] == [
        [("p", 0), ("q", 0)], [("p", 1), ("q", 1)], [("p", 2), ("q", 2)], [("p", 3), ("q", 3), ("r", 3), ("s", 3)]]


def test_a_prefill_and_verifies_share_one_target_call():
    scripts = {"new": ROUND, "old": [(TARGET, 0)] + ROUND}
    recorder = Recorder()
    run_scripts(Batcher(), scripts, recorder)
    assert names(recorder.calls[0]) == {"new", "old"} and len(recorder.calls) == 5


def test_a_call_lapped_by_a_shorter_round_runs_and_does_not_starve():
    """A chain-drafting sequence (rounds of two calls) never reaches step 3: the call waiting there
    runs once the other has run two target forwards since it began waiting."""
    scripts = {"chain": [(TARGET, 0), (("chain", 1), 1)] * 6, "steps": [(NEXT, 3)]}
    recorder = Recorder()
    assert run_scripts(Batcher(), scripts, recorder) == dict.fromkeys(scripts)
    ran_at = next(i for i, call in enumerate(recorder.calls) if names(call) == {"steps"})
    # chain's target forward, chain step, target forward: overdue, it runs at the next meeting
    assert [call[0] for call in recorder.calls[:ran_at]] == [("chain", 0), ("chain", 1), ("chain", 0)]
    assert recorder.calls[ran_at + 1] == [("chain", 1)]  # beside chain's step, in a call of its own kind


def test_calls_are_split_at_max_batch():
    recorder = Recorder()
    run_scripts(Batcher(max_batch=2), {f"s{i}": [(TARGET, 0)] for i in range(5)}, recorder)
    assert sorted(len(call) for call in recorder.calls) == [1, 2, 2]


def test_a_failed_call_reaches_every_sequence_in_it_and_the_others_go_on():
    recorder = Recorder(fail_key=FIRST)
    scripts = {"x": ROUND, "y": ROUND, "z": [(TARGET, 0), (("chain", 2), 1), (TARGET, 0)]}
    errors = run_scripts(Batcher(), scripts, recorder)
    assert isinstance(errors["x"], ValueError) and isinstance(errors["y"], ValueError) and errors["z"] is None
    assert names(recorder.calls[-1]) == {"z"}  # its last call ran after the others had left


def test_a_member_that_leaves_completes_the_meeting():
    """The drafter step waits while the earlier target forward runs; then only the other's leaving
    (its loop ended) can complete the meeting."""
    recorder = Recorder()
    errors = run_scripts(Batcher(), {"waits": [(FIRST, 1)], "leaves": [(TARGET, 0)]}, recorder)
    assert errors == {"waits": None, "leaves": None}
    assert recorder.calls == [[("leaves", 0)], [("waits", 1)]]


def test_without_a_start_barrier_sequences_still_fall_in_step():
    """Sequences that start one after another (a server's requests): each runs as soon as it can;
    once all four are in flight, at most three calls (a round's steps after the first) run short."""
    recorder, records = Recorder(seconds=0.001), []
    scripts = {f"s{i}": ROUND * 50 for i in range(4)}
    assert run_scripts(Batcher(), scripts, recorder, together=False, records=records) == dict.fromkeys(scripts)
    assert sum(len(call) for call in recorder.calls) == 4 * 200
    all_in_flight = list({c.id: c for c in records if c.in_flight == 4}.values())
    assert len(all_in_flight) > 50
    assert sum(c.size < 4 for c in all_in_flight) <= 3, sorted((c.id, c.size) for c in all_in_flight)


class CountingTarget:
    """A target backend whose cache grows by the tokens it is fed (all `BatchedTarget` asks of one)."""

    length = 0

    def fork(self):
        return CountingTarget()

    @staticmethod
    def forward_batch(calls):
        for backend, ids, _logits_to_keep in calls:
            backend.length += len(ids)
        return [None] * len(calls)


def test_calls_are_recorded_with_prefills_and_sequences_in_flight():
    batcher = Batcher()
    took_part = {}

    def sequence(name, forwards):
        with batcher.member() as seq:
            target = BatchedTarget(CountingTarget(), batcher, seq)
            for _ in range(forwards):
                target.forward([1, 2])
        took_part[name] = seq.calls

    threads = [threading.Thread(target=sequence, args=(f"s{i}", 2 + i)) for i in range(3)]
    with batcher.arrivals(3):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
    calls = {c.id: c for calls in took_part.values() for c in calls}
    assert [(c.size, c.prefill, c.in_flight) for c in sorted(calls.values(), key=lambda c: c.id)] == [
        (3, True, 3), (3, False, 3), (2, False, 2), (1, False, 1)]
    figures = batch_figures([c for calls in took_part.values() for c in calls], concurrency=3)
    assert (figures.histogram, figures.largest, figures.mean) == ({1: 1, 2: 1, 3: 2}, 3, 2.25)
    assert (figures.steady_mean, figures.steady_calls, figures.in_flight) == (3.0, 1, 3)  # the prefill aside


@pytest.mark.parametrize("row", [[7, 16, 1, 16], [8, 3, 0, 4]])
def test_a_call_travels_as_four_integers(row):
    call = BatchedCall.from_row(row)
    assert call.row() == row
