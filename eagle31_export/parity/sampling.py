"""Sampling parity under the greedy-drafts rule (vLLM's): the drafter checked exactly, acceptance statistically.

Under that rule a round's drafts are the drafter's argmax after the tokens before it, so along the
runtime's own output (its tokens and per-round accepted counts) the reference's drafts are determined
(reference/replay.py: replay_sampled):
(a) exact: every accepted token equals the reference's draft at its position, and the token emitted
    at a rejection differs from it (a rejection is resampled with the draft masked out). A difference
    where the reference drafter's top-2 margin is within the tie tolerance is a numerical tie: counted,
    and the rest of that round is not judged (the runtime drafted another token from there).
(b) statistical: draft i of a round was accepted with probability p_i = p_target(d_i) on its prefix.
    Summed over every draft position a round reached, the accepted count has expectation sum(p_i) and
    variance sum(p_i (1 - p_i)) (each term given the rounds before: a martingale, so the z-score holds
    without independence). Each position and the total (tau) are compared at `z` sigma.
(a) failing is the drafter's (its symptom by position); (a) holding while (b) fails is the runtime's
sampling (its rejection sampler or its sampling parameters), never the drafter.

A rejection that emits the reference's own draft has two explanations: the runtime drafted another
token (the drafter), or its sampler emitted its draft without accepting it (the engine). With a
correct sampler and any other draft d', the token would be the reference's draft d with probability
p(d) / (1 - p(d')) <= p(d) / (1 - max over x != d of p(x)); over all such rejections the product of
those bounds says how likely the drafter explanation is at best. Below EMITTED_DRAFT_ALPHA the
failure names the engine's sampler (vLLM's CPU build does this: docs/runtimes.md, "Sampling").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from eagle31_export.parity.symptoms import position_symptom
from eagle31_export.reference.replay import SampledRound

Z_95 = 1.959964  # two-sided 95 %
Z_80_POWER = 0.841621  # one-sided 80 %
EMITTED_DRAFT_ALPHA = 1e-3  # below this, a differing drafter cannot explain the drafts emitted at rejections
MIN_REACHED = 10  # rounds reaching a draft position before (b) can say anything of its rate
TAU_CHANGE = 0.1  # the change in tau the report says how many prompts (b) needs to see
ENGINE_FEWER = ("the engine accepts fewer drafts than its target's probabilities allow: its rejection sampler or "
                "its sampling parameters")
ENGINE_EMITS = ("the engine emits drafts at rejections (a rejection resamples with its draft masked out): its "
                "rejection sampler, not the drafter")
ENGINE_MORE = ("the engine accepts more drafts than its target's probabilities allow: its rejection sampler or its "
               "sampling parameters")


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
    # rejections that emitted the reference's own draft: [round, draft position, log10 of the bound on how
    # likely a differing drafter with a correct sampler makes that token]
    emitted_drafts: list[list] = field(default_factory=list)


@dataclass
class PositionLaw:
    """(b) at one draft position: how often it was reached and accepted, against the expectation."""

    position: int
    reached: int = 0
    accepted: int = 0
    expected: float = 0.0
    variance: float = 0.0

    @property
    def z(self) -> float | None:
        return (self.accepted - self.expected) / math.sqrt(self.variance) if self.variance > 0 else None

    def interval(self) -> tuple[float, float]:
        """The 95 % interval of the accepted count under the target's probabilities."""
        half = Z_95 * math.sqrt(self.variance)
        return self.expected - half, self.expected + half

    def to_json(self) -> dict:
        low, high = self.interval()
        return {**asdict(self), "z": self.z, "interval_95": [low, high]}


@dataclass
class SamplingCheck:
    """(a) and (b) over every prompt of one run, and what they say together."""

    rule: str
    tie_gap: float
    z: float
    prompts: list[PromptDrafts]
    positions: list[PositionLaw]
    rounds: int

    @property
    def drafts_exact(self) -> bool:
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

    @property
    def emitted_log10_bound(self) -> float:
        """log10 of the most likely a differing drafter (with a correct sampler) makes every emitted draft."""
        return sum(e[2] for e in self.emitted_drafts)

    @property
    def at_fault(self) -> str | None:
        """Which side the failures name: "drafter", "sampler" (the runtime's sampling), or None."""
        if any(p.mismatch for p in self.prompts):
            return "drafter"
        if self.emitted_drafts:
            return "sampler" if self.sampler_emits else "drafter"
        return "sampler" if self.failures() else None

    @property
    def sampler_emits(self) -> bool:
        """Drafts were emitted at rejections more often than any differing drafter could explain."""
        return bool(self.emitted_drafts) and self.emitted_log10_bound < math.log10(EMITTED_DRAFT_ALPHA)

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
        """(observed, expected, 95 % half-width) over the judged positions of every round."""
        n = max(self.rounds, 1)
        return 1 + self.accepted / n, 1 + self.expected / n, Z_95 * math.sqrt(self.variance) / n

    @property
    def tau_z(self) -> float | None:
        return (self.accepted - self.expected) / math.sqrt(self.variance) if self.variance > 0 else None

    def prompts_to_see(self, change: float = TAU_CHANGE) -> int | None:
        """Prompts like these (rounds per prompt as here) for a two-sided 95 % test of tau to flag a shift
        of `change` with 80 % power, from the per-round variance measured here."""
        if not self.rounds or not self.variance or not self.prompts:
            return None
        rounds = ((Z_95 + Z_80_POWER) / change) ** 2 * self.variance / self.rounds
        return math.ceil(rounds / (self.rounds / len(self.prompts)))

    def failures(self) -> list[str]:
        """(a)'s differences name the drafter, but drafts emitted at rejections more often than any drafter
        could explain name the sampler; (b) is judged where no drafter difference was found."""
        if any(p.mismatch for p in self.prompts):
            return [f"prompt {p.prompt_index}: {p.mismatch} ({p.symptom})" for p in self.prompts if p.mismatch]
        out = self._emitted_failures()
        if out and not self.sampler_emits:
            return out
        out += [self._law_failure(f"draft position {law.position}", law.accepted, law.expected, law.z, law.reached)
               for law in self.positions if law.z is not None and abs(law.z) > self.z]
        tau_z = self.tau_z
        if tau_z is not None and abs(tau_z) > self.z:
            observed, expected, _ = self.tau
            out.append(f"tau {observed:.3f} vs {expected:.3f} expected from the target's probabilities "
                       f"(z = {tau_z:+.1f}): {ENGINE_FEWER if tau_z < 0 else ENGINE_MORE}")
        return out

    def _emitted_failures(self) -> list[str]:
        events = self.emitted_drafts
        if not events:
            return []
        positions = sorted({e[1] for e in events})
        where = ", ".join(f"position {p}: {sum(e[1] == p for e in events)}" for p in positions)
        bound = self.emitted_log10_bound
        said = (f"{len(events)} rejections emitted the reference's own draft ({where}); a drafter drafting another "
                f"token would do that with probability <= 1e{bound:.0f}")
        if self.sampler_emits:
            return [f"{said}: {ENGINE_EMITS}"]
        first = next(p for p in self.prompts if p.emitted_drafts)
        return [f"{said}; first: prompt {first.prompt_index}, round {first.emitted_drafts[0][0]}: the runtime drafted "
                f"another token ({position_symptom(positions[0])})"]

    def _law_failure(self, where: str, accepted: int, expected: float, z: float, reached: int) -> str:
        return (f"{where}: {accepted} of {reached} drafts accepted, {expected:.1f} expected from the target's "
                f"probabilities (z = {z:+.1f}, beyond {self.z:g} sigma): {ENGINE_FEWER if z < 0 else ENGINE_MORE}")

    def inconclusive_reasons(self) -> list[str]:
        """Why a PASS would show little: no round, or draft positions reached too rarely for (b)."""
        if not self.rounds:
            return ["the runtime ran no speculation rounds: nothing was compared (give longer --max-new-tokens)"]
        thin = [(law.position, law.reached) for law in self.positions if law.reached < MIN_REACHED]
        if not thin:
            return []
        shown = ", ".join(f"position {p}: {n}" for p, n in thin)
        return [f"too few rounds reached draft positions for (b) to tell their acceptance ({shown} of {self.rounds} "
                f"rounds; at least {MIN_REACHED} each): longer prompts or --max-new-tokens; PASS is inconclusive there"]

    def to_json(self) -> dict:
        observed, expected, half = self.tau
        return {"rule": self.rule, "tie_gap": self.tie_gap, "z": self.z, "rounds": self.rounds,
                "drafts_exact": self.drafts_exact, "at_fault": self.at_fault,
                "emitted_drafts": len(self.emitted_drafts), "emitted_log10_bound": self.emitted_log10_bound,
                "accepted_checked": self.accepted_checked, "rejections_checked": self.rejections_checked,
                "ties": sum(len(p.ties) for p in self.prompts),
                "tau": {"observed": observed, "expected": expected, "half_width_95": half, "z": self.tau_z},
                "positions": [law.to_json() for law in self.positions],
                "prompts_to_see_tau_change": {"change": TAU_CHANGE, "prompts": self.prompts_to_see()},
                "prompts": [asdict(p) for p in self.prompts]}


def check_sampled(replays: list[list[SampledRound]], depth: int, tie_gap: float, z: float,
                  rule: str = "greedy-drafts", first_index: int = 0) -> SamplingCheck:
    """(a) and (b) over every prompt's replayed rounds (`replays[i]`: prompt first_index + i's)."""
    positions = [PositionLaw(i + 1) for i in range(depth)]
    prompts = [_check_prompt(first_index + i, rounds, tie_gap, positions) for i, rounds in enumerate(replays)]
    return SamplingCheck(rule, tie_gap, z, prompts, positions, sum(len(r) for r in replays))


def _check_prompt(index: int, rounds: list[SampledRound], tie_gap: float, positions: list[PositionLaw]
                  ) -> PromptDrafts:
    found = PromptDrafts(index, rounds=len(rounds))
    for r in rounds:
        judged = _judge_round(r, tie_gap, found)
        for i in range(judged):
            p = r.p_drafts[i]
            if p is None:
                break
            law = positions[i]
            law.reached += 1
            law.accepted += int(r.accepted > i)
            law.expected += p
            law.variance += p * (1 - p)
        if found.mismatch:
            break  # past a drafter difference the runtime's rounds no longer follow the reference's drafts
    return found


def _judge_round(r: SampledRound, tie_gap: float, found: PromptDrafts) -> int:
    """(a) on one round; the number of its draft positions that followed the reference's drafts (to
    judge by (b)). Records a tie, a draft emitted at a rejection, or the first mismatch in `found`."""
    for i, token in enumerate(r.committed[: len(r.drafts)]):
        draft, accepted = r.drafts[i], i < r.accepted
        if accepted == (token == draft):
            if not accepted:
                found.rejections_checked += 1
                return i + 1
            found.accepted_checked += 1
            continue
        what = (f"round {r.index}, draft position {i + 1}: " +
                (f"accepted token {token} is not the reference's draft {draft}" if accepted else
                 f"the token emitted at a rejection is the reference's draft {draft}"))
        if r.margins[i] <= tie_gap:
            found.ties.append(f"{what}, within the drafter's top-2 margin {r.margins[i]:.3g}")
            return i  # the runtime's draft here is the other candidate: this position is not judged
        if not accepted:
            found.rejections_checked += 1
            found.emitted_drafts.append([r.index, i + 1, _log10_bound(r, i)])
            return i + 1  # judged by (b) as the rejection the runtime counted
        found.mismatch, found.symptom = what, position_symptom(i + 1)
        return i
    return min(r.accepted + 1, len(r.drafts))


def _log10_bound(r: SampledRound, i: int) -> float:
    """log10 of p(d) / (1 - max over x != d of p(x)): the most likely a correct sampler with another draft
    masked out emits the reference's draft d here."""
    p, rival = r.p_drafts[i], r.p_rivals[i]
    if p is None or rival is None or rival >= 1:
        return 0.0
    return math.log10(max(min(p / (1 - rival), 1.0), 1e-300))
