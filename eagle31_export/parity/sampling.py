"""Sampling parity under the greedy-drafts rule (vLLM's): the drafter checked exactly, acceptance statistically.

Under that rule a round's drafts are the drafter's argmax after the tokens before it, so along the
runtime's own output (its tokens and per-round accepted counts) the reference's drafts are determined
(reference/replay.py: replay_sampled):
(a) exact: every accepted token equals the reference's draft at its position, and the token emitted
    at a rejection differs from it (a rejection is resampled with the draft masked out). A position
    whose reference drafter's top-2 margin is within TIE_ERRORS x the error the runtime's precision
    measurably makes at that draft step (parity/numerics.py: the pair replayed at that precision along
    the same drafts, `Measurer.replay_sampled`; the one tie rule, parity/ties.py) is a numerical tie,
    decided from the reference's numbers before the outcome is read: a difference there is listed,
    not failed, and the rest of that round is not judged by (a) (the runtime may have drafted the
    other candidate). The ties are counted against a tie budget: a flip of the runtime's draft d to d'
    at a reached position shows as a difference with probability p(d') + p(d) (d' accepted, or d
    emitted at its rejection), at most p(d) + max over x != d of p(x); with the flip's probability from
    the measured error (parity/numerics.py: flip_probability), a round shows a tie with probability at
    most 1 - prod(1 - flip_i x seen_i) over its tied positions reached, and more ties than the Poisson
    tail of their sum allows at BUDGET_ALPHA fails as a small systematic error of the drafter.
(b) statistical: a round that reached draft position i along the reference's drafts d_1 .. d_{i-1}
    COMMITS the reference's d_i there (accepts it, or emits it at a rejection) with probability exactly
    p_i = p_target(d_i) on its prefix, whatever the runtime drafted: a runtime that drafted d accepts it
    with p(d) and never emits it; one that drafted d' != d never accepts d and, rejecting d', emits d with
    probability (1 - p(d')) p(d) / (1 - p(d')) = p(d). So that count needs no tie excluded, and a tie
    that flipped the runtime's draft moves nothing. Which rounds count is decided before their outcome
    (the rounds before, the tokens the run holds), and each p_i is the target's on the round's own
    prefix, known before its outcome.

The tests of (b), one family at a family-wise false-alarm rate ALPHA (Holm's step-down over every test
that runs; parity/tails.py):
- per draft position reached in at least MIN_REACHED rounds, the count of rounds committing the
  reference's draft, split by whether the target ranks that draft first (p(d) >= every other p, read
  from the reference before the outcome; a sampler that sharpens or flattens p moves the two the
  opposite ways, and a single count would let them cancel), each against the exact Poisson-binomial
  law of its p_i, two-sided;
- all positions together (tau), the same way;
- per draft position, rejections emitting the reference's draft: event j happens with probability at
  most p(d) / (1 - max over x != d of p(x)), however the runtime drafted; their count against a
  Chernoff bound over a fixed lambda grid with a union bound (`exceedance_p`). A position reached in
  fewer rounds than MIN_REACHED is not tested for its count: it makes a PASS inconclusive, never a FAIL.

Which side is at fault:
- an accepted token that is not the reference's draft is the drafter's (its symptom by position);
- a rejection that emitted d is the drafter's (it drafted another token) or the sampler's (it did not
  mask its draft). One run under sampling cannot always tell which, so the runtime is then run greedy
  over the same prompts and replayed (`GreedyDrafts`): under this rule drafts are the drafter's argmax
  whatever the temperature, so a greedy run with every round as the reference's (ties aside) clears
  the drafter and leaves those rejections to the sampler; one whose drafts differ names the drafter.
  Without that run, they are the drafter's where (b) does not show the sampler wrong;
- a failing (b) test is the engine's sampling: its rejection sampler, its sampling parameters, or its
  target's probabilities (a target with the same greedy tokens may still differ in probability). The
  greedy run (made for a failing (b) too) says which of the last it can: target tokens that differ from
  the reference target's are the target's fault (`at_fault` "target"), and (b) is then not laid on the
  sampler; tokens that agree leave all three named.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property

from eagle31_export.parity.numerics import BUDGET_ALPHA, TieBudget, flip_probability
from eagle31_export.parity.symptoms import position_symptom
from eagle31_export.parity.tails import exceedance_p, holm, two_sided_p
from eagle31_export.reference.replay import SampledRound

Z_95 = 1.959964  # two-sided 95 %
Z_80_POWER = 0.841621  # one-sided 80 %
ALPHA = 1e-3  # family-wise: a correct engine fails (b) at most this often over all of its tests together
CORRECTION = "Holm"
MIN_REACHED = 10  # rounds reaching a draft position before (b) tests its count
TAU_CHANGE = 0.1  # the change in tau the report says how many prompts (b) needs to see
CAUSES = "its rejection sampler, its sampling parameters (temperature, top-p, top-k as it applies them) or its " \
         "target's probabilities"
ENGINE_FEWER = f"the engine accepts fewer drafts than its target's probabilities allow: {CAUSES}"
ENGINE_EMITS = ("the engine emits drafts at rejections (a rejection resamples with its draft masked out): its "
                "rejection sampler, not the drafter")
ENGINE_MORE = f"the engine accepts more drafts than its target's probabilities allow: {CAUSES}"


@dataclass
class PromptDrafts:
    """(a) on one prompt."""

    prompt_index: int
    rounds: int = 0
    accepted_checked: int = 0  # accepted tokens compared with the reference's drafts
    rejections_checked: int = 0  # emitted tokens at a rejection compared (must differ)
    ties: list[str] = field(default_factory=list)
    mismatch: str | None = None  # the first accepted token that is not the reference's draft, beyond a tie
    symptom: str | None = None
    # rejections that emitted the reference's own draft: [round, draft position]
    emitted_drafts: list[list] = field(default_factory=list)


@dataclass
class PositionLaw:
    """(b) at one draft position: the rounds that reached it along the reference's drafts, what they
    committed there, against the target's probabilities; and the rejections there that emitted the
    reference's draft (`matched`), with the most a correct sampler lets them be (`match_bound`)."""

    position: int
    reached: int = 0
    accepted: int = 0
    expected: float = 0.0
    variance: float = 0.0
    matched: int = 0
    match_bound: float = 0.0
    accepted_other: int = 0  # accepted tokens that are not the reference's draft (the drafter's, or a tie)
    ties: int = 0  # rounds reaching it whose drafter top-2 margin is within the tie gap (outcome not read)
    # per round reaching it: p(d), whether it committed d, whether the target ranks d first
    p_drafts: list[float] = field(default_factory=list, repr=False)
    hits: list[bool] = field(default_factory=list, repr=False)
    ranked_first: list[bool] = field(default_factory=list, repr=False)
    emit_bounds: list[float] = field(default_factory=list, repr=False)  # per rejection here

    def add(self, p: float, rival: float | None, committed_draft: bool, accepted: bool, tie: bool) -> None:
        """One round that reached this position along the reference's drafts."""
        self.reached += 1
        self.accepted += accepted
        self.expected += p
        self.variance += p * (1 - p)
        self.accepted_other += accepted and not committed_draft
        self.ties += tie
        self.p_drafts.append(p)
        self.hits.append(committed_draft)
        self.ranked_first.append(rival is None or p >= rival)
        if not accepted:  # the rejection: how likely a correct sampler emits d here, at most
            bound = _emit_bound(p, rival)
            self.match_bound += bound
            self.emit_bounds.append(bound)
            self.matched += committed_draft

    @property
    def z(self) -> float | None:
        """The accepted count's z-score against the target's probabilities (shown, not tested)."""
        return (self.accepted - self.expected) / math.sqrt(self.variance) if self.variance > 0 else None

    @property
    def drafted_or_emitted(self) -> int:
        """Rounds here that accepted the reference's draft d or emitted d at a rejection: each one's
        probability is exactly p(d) with a correct sampler, whatever the runtime drafted."""
        return sum(self.hits)

    @property
    def z_either(self) -> float | None:
        """z of `drafted_or_emitted` against sum(p): 0 in expectation whatever was drafted (shown; the
        test is exact, `strata`)."""
        return ((self.drafted_or_emitted - self.expected) / math.sqrt(self.variance)
                if self.variance > 0 else None)

    @property
    def emits_tail(self) -> float:
        """A bound on P(at least `matched` such rejections) with a correct sampler and any drafter."""
        return exceedance_p(self.matched, self.emit_bounds)

    def strata(self) -> list[tuple[str, int, list[float]]]:
        """(which rounds, how many committed the reference's draft, their p) for the rounds whose draft
        the target ranks first and for the others."""
        out = []
        for first, name in ((True, "where the target ranks it first"), (False, "where the target ranks another "
                                                                                 "token first")):
            rows = [(p, hit) for p, hit, f in zip(self.p_drafts, self.hits, self.ranked_first) if f == first]
            if rows:
                out.append((name, sum(hit for _, hit in rows), [p for p, _ in rows]))
        return out

    def interval(self) -> tuple[float, float]:
        """The 95 % interval of the accepted count under the target's probabilities (normal, shown)."""
        half = Z_95 * math.sqrt(self.variance)
        return self.expected - half, self.expected + half

    def to_json(self) -> dict:
        low, high = self.interval()
        return {"position": self.position, "reached": self.reached, "accepted": self.accepted,
                "expected": self.expected, "variance": self.variance, "matched": self.matched,
                "match_bound": self.match_bound, "accepted_other": self.accepted_other, "ties": self.ties,
                "z": self.z, "drafted_or_emitted": self.drafted_or_emitted, "z_drafted_or_emitted": self.z_either,
                "emits_tail": self.emits_tail, "interval_95": [low, high]}


@dataclass
class LawTest:
    """One test of (b): where, what was counted against what, its p-value, and whether Holm rejects it."""

    kind: str  # "committed" (the reference's draft committed, two-sided), "tau", "emits" (one-sided)
    position: int | None  # None: every position (tau)
    rounds: str  # which rounds, in words
    observed: int
    expected: float  # sum of p (committed, tau), or the most a correct sampler allows (emits)
    reached: int
    p_value: float
    rejected: bool = False

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class GreedyDrafts:
    """The runtime run greedy over the same prompts and replayed: whether its drafter drafts as the
    reference's (every round's drafts, ties aside), and whether its target's greedy tokens are the
    reference target's."""

    prompts: int
    rounds: int
    ties: int
    untied: list[str]  # the drafter's differences beyond the tie tolerance, each with its symptom
    target_tokens: list[str] = field(default_factory=list)  # target tokens that differ beyond a tie
    unaligned: list[int] = field(default_factory=list)  # prompts whose rounds could not be compared
    budget: TieBudget | None = None  # its ties against what the runtime's precision explains (parity/numerics.py)

    @property
    def exact(self) -> bool:
        """The drafter drafts as the reference's in every round compared (ties within the budget), and
        every prompt was compared."""
        return (self.rounds > 0 and not self.untied and not self.unaligned
                and not (self.budget is not None and self.budget.exceeded))

    def describe(self) -> str:
        said = f"run greedy over the same {self.prompts} prompts, its {self.rounds} rounds "
        if self.unaligned:
            return said + (f"could not be compared with the reference's on prompt(s) "
                           f"{', '.join(map(str, self.unaligned))}, so the drafter is not cleared")
        if self.untied:
            return said + f"differ from the reference's in {len(self.untied)} places"
        return said + "are the reference's" + (f" ({self.ties} ties)" if self.ties else "")

    def target_finding(self) -> str:
        """What the greedy run says of the target's tokens, for a failing (b)."""
        if self.target_tokens:
            return (f"run greedy, its target's tokens differ from the reference target's in {len(self.target_tokens)} "
                    f"places (first: {self.target_tokens[0]}): its target's probabilities differ")
        if self.unaligned or not self.rounds:
            return "the greedy run could not compare the target's tokens"
        return (f"run greedy over the same {self.prompts} prompts, its target's tokens are the reference target's "
                f"({self.rounds} rounds): the same argmax, which leaves its probabilities free to differ")


@dataclass
class SamplingCheck:
    """(a) and (b) over every prompt of one run, and what they say together."""

    rule: str
    tie_errors: float  # a tie: the drafter's top-2 margin within this many measured errors (parity/numerics.py)
    alpha: float
    prompts: list[PromptDrafts]
    positions: list[PositionLaw]
    rounds: int
    greedy: GreedyDrafts | None = None  # the runtime checked greedy, where the sampled run left it open
    budget: TieBudget = field(default_factory=TieBudget)  # (a)'s ties against what the precision explains
    precision: str | None = None  # what the errors were measured at; None: not measured, no tie excused

    @property
    def drafter_open(self) -> bool:
        """The sampled run alone cannot clear or name the drafter: rejections emitted the reference's
        draft (another draft, or a sampler that did not mask it) and no accepted token names it."""
        return bool(self.emitted_drafts) and not any(p.mismatch for p in self.prompts)

    @property
    def wants_greedy(self) -> bool:
        """A greedy run over the same prompts would settle something: the drafter where the sampled run
        left it open, or the target's tokens where (b) fails."""
        return self.drafter_open or self.sampler_wrong

    @property
    def drafts_exact(self) -> bool:
        """(a) held: no accepted token differs from the reference's draft and no rejection emitted it."""
        return all(p.mismatch is None and not p.emitted_drafts for p in self.prompts)

    @property
    def accepted_checked(self) -> int:
        return sum(p.accepted_checked for p in self.prompts)

    @property
    def rejections_checked(self) -> int:
        return sum(p.rejections_checked for p in self.prompts)

    @property
    def emitted_drafts(self) -> list[list]:
        return [e for p in self.prompts for e in p.emitted_drafts]

    @cached_property
    def law_tests(self) -> list[LawTest]:
        """Every test of (b) that runs, each with its p-value and Holm's decision at `alpha`."""
        found = []
        for law in self.positions:
            if law.reached >= MIN_REACHED:
                found += [LawTest("committed", law.position, name, hits, sum(ps), len(ps), two_sided_p(hits, ps))
                          for name, hits, ps in law.strata()]
            if law.emit_bounds:
                found.append(LawTest("emits", law.position, "rejections", law.matched, law.match_bound,
                                     len(law.emit_bounds), law.emits_tail))
        ps = [p for law in self.positions for p in law.p_drafts]
        if len(ps) >= MIN_REACHED:
            hits = sum(law.drafted_or_emitted for law in self.positions)
            found.append(LawTest("tau", None, "every position", hits, sum(ps), len(ps), two_sided_p(hits, ps)))
        for test, rejected in zip(found, holm([t.p_value for t in found], self.alpha)):
            test.rejected = rejected
        return found

    @property
    def sampler_wrong(self) -> bool:
        """(b) fails: some test shows the engine's sampling wrong whatever the runtime drafted."""
        return any(t.rejected for t in self.law_tests)

    @property
    def target_differs(self) -> bool:
        return self.greedy is not None and bool(self.greedy.target_tokens)

    @property
    def at_fault(self) -> str | None:
        """Which sides the failures name, from what differed: "drafter" (drafts), "target" (the greedy
        run's target tokens), "sampler" (the engine's sampling, (b)); several joined by " and "; None."""
        sides = [side for side, found in (("drafter", self._drafter_failures()), ("target", self.target_differs),
                                          ("sampler", self._sampler_failures(names_sampler=True))) if found]
        return " and ".join(sides) or None

    @property
    def accepted(self) -> int:
        return sum(p.accepted for p in self.positions)

    @property
    def expected(self) -> float:
        return sum(p.expected for p in self.positions)

    @property
    def variance(self) -> float:
        return sum(p.variance for p in self.positions)

    @property
    def tau(self) -> tuple[float, float, float]:
        """(observed, expected, 95 % half-width) over the positions reached along the reference's drafts."""
        n = max(self.rounds, 1)
        return 1 + self.accepted / n, 1 + self.expected / n, Z_95 * math.sqrt(self.variance) / n

    @property
    def tau_z(self) -> float | None:
        return (self.accepted - self.expected) / math.sqrt(self.variance) if self.variance > 0 else None

    def prompts_to_see(self, change: float = TAU_CHANGE, z_test: float = Z_95, z_power: float = Z_80_POWER
                       ) -> int | None:
        """Prompts like these (rounds per prompt as here) for a two-sided test of tau at `z_test` to flag
        a shift of `change` with the power `z_power` gives (default: 95 % confidence, 80 % power), from
        the variance per round measured here: rounds = ((z_test + z_power) / change)^2 x variance / rounds."""
        if not self.rounds or not self.variance or not self.prompts:
            return None
        rounds = ((z_test + z_power) / change) ** 2 * self.variance / self.rounds
        return math.ceil(rounds / (self.rounds / len(self.prompts)))

    def failures(self) -> list[str]:
        """The drafter's failures (a), the target's (greedy), then the engine's sampling (b)."""
        target = ([f"the target: {self.greedy.target_finding()} (target weights or numerics)"]
                  if self.target_differs else [])
        return self._drafter_failures() + target + self._sampler_failures()

    def _drafter_failures(self) -> list[str]:
        out = [f"prompt {p.prompt_index}: {p.mismatch} ({p.symptom})" for p in self.prompts if p.mismatch]
        if self.budget.exceeded:
            out.append(f"{self.budget.observed} numerical ties among the sampled drafts: more differences than the "
                       f"runtime's precision explains ({self.precision}: {self.budget.expected:.2g} expected over "
                       f"{self.budget.decisions} tied draft steps reached, at most {self.budget.allowed} at p = "
                       f"{BUDGET_ALPHA:g}): a small systematic error of the drafter, each of whose differences alone "
                       f"is within the measured error ({position_symptom(self._first_tie_position())})")
        if self.greedy is not None and self.greedy.budget is not None and self.greedy.budget.exceeded:
            b = self.greedy.budget
            out.append(f"{self.greedy.describe()}: {b.observed} numerical ties, more than the runtime's precision "
                       f"explains ({b.expected:.2g} expected over {b.decisions} decisions, at most {b.allowed} at "
                       f"p = {BUDGET_ALPHA:g}): a small systematic error")
        if self.greedy is not None and self.greedy.untied:
            out += [f"{self.greedy.describe()}: {self.greedy.untied[0]}"]
        elif (self.greedy is not None and self.greedy.exact) or self.sampler_wrong:
            return out  # drafts emitted at rejections are the sampler's (greedy cleared the drafter) or tell nothing
        for position, emitted in self._emitted_by_position().items():
            prompt, at = emitted[0]
            out.append(f"draft position {position}: {len(emitted)} rejections emitted the reference's own "
                       f"draft (first: prompt {prompt}, round {at}), which a rejection masks out: "
                       f"the runtime drafted another token ({position_symptom(position)})"
                       + (f"; {self.greedy.describe()}" if self.greedy is not None else ""))
        return out

    def _first_tie_position(self) -> int:
        """The draft position of the first listed tie (1 where none is parsed)."""
        for p in self.prompts:
            for tie in p.ties:
                at = tie.split("draft position ", 1)[-1].split(":", 1)[0]
                if at.isdigit():
                    return int(at)
        return 1

    def _emitted_by_position(self) -> dict[int, list[tuple[int, int]]]:
        """(a)'s rejections that emitted the reference's draft beyond a tie: position -> [(prompt, round)]."""
        out: dict[int, list[tuple[int, int]]] = {}
        for prompt in self.prompts:
            for at, position in prompt.emitted_drafts:
                out.setdefault(position, []).append((prompt.prompt_index, at))
        return dict(sorted(out.items()))

    def _sampler_failures(self, names_sampler: bool = False) -> list[str]:
        """(b)'s failures in words; `names_sampler`: only those that name the sampler (not those a target
        shown different by the greedy run explains)."""
        out = []
        if not (names_sampler and self.target_differs):
            failed = [t for t in self.law_tests if t.rejected]
            out += [self._law_failure(t, len(self.law_tests))
                    for t in sorted(failed, key=lambda t: (t.position or math.inf, t.kind))]
        if self.greedy is not None and self.greedy.exact:
            shown = {t.position for t in self.law_tests if t.rejected and t.kind == "emits"}
            out += [f"draft position {position}: {len(emitted)} rejections emitted the reference's own draft, "
                    f"which a rejection masks out, and the engine's drafter drafts as the reference's "
                    f"({self.greedy.describe()}): {ENGINE_EMITS}"
                    for position, emitted in self._emitted_by_position().items() if position not in shown]
        return out

    def _law_failure(self, t: LawTest, tests: int) -> str:
        held = f"P = {t.p_value:.2g}; Holm over {tests} tests at a family-wise {self.alpha:g}"
        if t.kind == "emits":
            return (f"draft position {t.position}: {t.observed} of {t.reached} rejections emitted the reference's "
                    f"draft, at most {t.expected:.1f} expected with a correct sampler whatever was drafted "
                    f"(P <= {t.p_value:.1g}; Holm over {tests} tests at a family-wise {self.alpha:g}): "
                    f"{ENGINE_EMITS}{self._target_note(target_only=True)}")
        side = ENGINE_FEWER if t.observed < t.expected else ENGINE_MORE
        if t.kind == "tau":
            observed, expected, _ = self.tau
            return (f"tau: over every draft position, {t.observed} of {t.reached} rounds reaching one accepted "
                    f"the reference's draft or emitted it at a rejection, {t.expected:.1f} expected from the target's "
                    f"probabilities whatever was drafted (tau {observed:.3f} vs {expected:.3f}; {held}): {side}"
                    f"{self._target_note()}")
        return (f"draft position {t.position}: {t.observed} of {t.reached} rounds {t.rounds} accepted the "
                f"reference's draft or emitted it at a rejection, {t.expected:.1f} expected whatever was drafted "
                f"({held}): {side}{self._target_note()}")

    def _target_note(self, target_only: bool = False) -> str:
        """What the greedy run found of the target's tokens, said with every failing (b)."""
        if self.greedy is None:
            return "" if target_only else "; the target's greedy tokens were not checked"
        if target_only and not self.greedy.target_tokens:
            return ""
        return f"; {self.greedy.target_finding()}"

    def inconclusive_reasons(self) -> list[str]:
        """Why a PASS would show little: no round, or draft positions reached too rarely for (b)."""
        if not self.rounds:
            return ["the runtime ran no speculation rounds: nothing was compared (give longer --max-new-tokens)"]
        thin = [(law.position, law.reached) for law in self.positions if law.reached < MIN_REACHED]
        if not thin:
            return []
        shown = ", ".join(f"position {p}: {n}" for p, n in thin)
        return [f"too few rounds reached draft positions for (b) to test their acceptance ({shown} of {self.rounds} "
                f"rounds; at least {MIN_REACHED} each): longer prompts or --max-new-tokens; PASS is inconclusive there"]

    def to_json(self) -> dict:
        observed, expected, half = self.tau
        return {"rule": self.rule, "tie_errors": self.tie_errors, "precision": self.precision,
                "tie_budget": self.budget.to_json(), "alpha": self.alpha, "correction": CORRECTION,
                "rounds": self.rounds, "drafts_exact": self.drafts_exact, "at_fault": self.at_fault,
                "emitted_drafts": len(self.emitted_drafts),
                "accepted_checked": self.accepted_checked, "rejections_checked": self.rejections_checked,
                "ties": sum(len(p.ties) for p in self.prompts),
                "tau": {"observed": observed, "expected": expected, "half_width_95": half, "z": self.tau_z},
                "positions": [law.to_json() for law in self.positions],
                "tests": [t.to_json() for t in self.law_tests],
                "prompts_to_see_tau_change": {"change": TAU_CHANGE, "prompts": self.prompts_to_see()},
                "prompts": [asdict(p) for p in self.prompts],
                "greedy": None if self.greedy is None else {**asdict(self.greedy), "exact": self.greedy.exact}}


def check_sampled(replays: list[list[SampledRound]], depth: int, errors: list[list[list[float]]] | None,
                  tie_errors: float, alpha: float = ALPHA, rule: str = "greedy-drafts", first_index: int = 0,
                  precision: str | None = None) -> SamplingCheck:
    """(a) and (b) over every prompt's replayed rounds (`replays[i]`: prompt first_index + i's), each
    draft step's measured error in `errors[i][round][step]` (parity/numerics.py: Measurer.replay_sampled;
    None: not measured, so no difference is excused as a tie)."""
    positions = [PositionLaw(i + 1) for i in range(depth)]
    budget, prompts = TieBudget(), []
    for i, rounds in enumerate(replays):
        measured = errors[i] if errors is not None else [[0.0] * len(r.margins) for r in rounds]
        prompts.append(_check_prompt(first_index + i, rounds, measured, tie_errors, positions, budget))
    budget.observed = sum(len(p.ties) for p in prompts)
    return SamplingCheck(rule, tie_errors, alpha, prompts, positions, sum(len(r) for r in replays), budget=budget,
                         precision=precision)


def _check_prompt(index: int, rounds: list[SampledRound], errors: list[list[float]], tie_errors: float,
                  positions: list[PositionLaw], budget: TieBudget) -> PromptDrafts:
    found = PromptDrafts(index, rounds=len(rounds))
    for r, round_errors in zip(rounds, errors):
        # from the reference's numbers and the measurement, before any outcome is read
        tied = [m <= tie_errors * e for m, e in zip(r.margins, round_errors)]
        _judge_round(r, tied, found)
        _count_round(r, tied, positions)
        _expect_ties(r, tied, round_errors, budget)
    return found


def _expect_ties(r: SampledRound, tied: list[bool], errors: list[float], budget: TieBudget) -> None:
    """The most ties this round shows from the runtime's precision alone: a flip at a tied position the
    round reached along the reference's drafts, seen with probability at most p(d) + p(rival)."""
    stay = 1.0
    for i, p in enumerate(r.p_drafts):
        if p is None or i >= len(tied):
            break
        if tied[i]:
            seen = min(1.0, p + (r.p_rivals[i] or 0.0))
            stay *= 1 - flip_probability(r.margins[i], errors[i]) * seen
            budget.decisions += 1
    budget.expected += 1 - stay


def _count_round(r: SampledRound, tied: list[bool], positions: list[PositionLaw]) -> None:
    """(b): each position this round reached along the reference's drafts, with the token it committed
    there (the run's own tokens; a last round cut by max_new_tokens stops where they stop)."""
    for i, p in enumerate(r.p_drafts[: len(positions)]):
        if p is None or i >= len(r.committed):
            return
        committed_draft, accepted = r.committed[i] == r.drafts[i], i < r.accepted
        positions[i].add(p, r.p_rivals[i], committed_draft, accepted, i < len(tied) and tied[i])
        if not (accepted and committed_draft):
            return  # a rejection ends the round; an accepted other token leaves the reference's drafts


def _judge_round(r: SampledRound, tied: list[bool], found: PromptDrafts) -> None:
    """(a) on one round: records ties, drafts emitted at a rejection and the first accepted token that is
    not the reference's draft in `found`."""
    for i, token in enumerate(r.committed[: len(r.drafts)]):
        draft, accepted = r.drafts[i], i < r.accepted
        if accepted == (token == draft):
            if not accepted:
                found.rejections_checked += 1
                return
            found.accepted_checked += 1
            continue
        what = (f"round {r.index}, draft position {i + 1}: " +
                (f"accepted token {token} is not the reference's draft {draft}" if accepted else
                 f"the token emitted at a rejection is the reference's draft {draft}"))
        if i < len(tied) and tied[i]:
            found.ties.append(f"{what}, within the drafter's top-2 margin {r.margins[i]:.3g}")
            return  # the runtime's draft here may be the other candidate: the rest of the round is not judged
        if not accepted:
            found.rejections_checked += 1
            found.emitted_drafts.append([r.index, i + 1])
            return
        if found.mismatch is None:
            found.mismatch, found.symptom = what, position_symptom(i + 1)
        return  # its own draft was accepted here; later positions left the reference's drafts


def _emit_bound(p: float, rival: float | None) -> float:
    """p(d) / (1 - max over x != d of p(x)), at most 1: the most likely a correct sampler that masked out
    some other draft emits the reference's draft d."""
    if rival is None or rival >= 1:
        return 1.0
    return min(p / (1 - rival), 1.0)
