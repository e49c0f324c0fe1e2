"""Sampling parity under the greedy-drafts rule (vLLM's): the drafter checked exactly, acceptance statistically.

Under that rule a round's drafts are the drafter's argmax after the tokens before it, so along the
runtime's own output (its tokens and per-round accepted counts) the reference's drafts are determined
(reference/replay.py: replay_sampled):
(a) exact: every accepted token equals the reference's draft at its position, and the token emitted
    at a rejection differs from it (a rejection is resampled with the draft masked out). A difference
    where the reference drafter's top-2 margin is within the tie tolerance is a numerical tie: listed,
    and the rest of that round is not judged (the runtime drafted another token from there).
(b) statistical: draft d_i of a round was accepted with probability p_i = p_target(d_i) on its prefix.
    Summed over the rounds reaching a draft position, the accepted count has expectation sum(p_i) and
    variance sum(p_i (1 - p_i)) (each term given the rounds before: a martingale, so the z-score holds
    without independence); each position and the total (tau) are held to it at `z` sigma.

Which side is at fault, per draft position, with a correct sampler and ANY drafter:
- a round whose runtime drafted d (ours) accepts it with probability p(d) and never emits it at a
  rejection; one that drafted another d' never accepts d and, rejecting d', emits d with probability
  (1 - p(d')) p(d) / (1 - p(d')) = p(d). So "d accepted, or a rejection that emitted d" happens with
  probability exactly p(d) in every round: that count beyond sum(p) at `z` sigma, either way, is the
  sampler's fault whatever the runtime drafted (`low`, `high`);
- a rejection emits d with probability <= p(d) / (1 - max over x != d of p(x)) (0 if it drafted d):
  far more such rejections than those bounds allow (a Chernoff bound) is the sampler emitting its
  drafts (`emits`);
- an accepted token that is not d is the drafter's (its symptom by position);
- a rejection that emitted d is the drafter's (it drafted another token) or the sampler's (it did not
  mask its draft). One run under sampling cannot always tell which, so the runtime is then run greedy
  over the same prompts and replayed (`GreedyDrafts`): under this rule drafts are the drafter's argmax
  whatever the temperature, so a greedy run with every round as the reference's (ties aside) clears
  the drafter and leaves those rejections to the sampler; one that differs names the drafter. Without
  that run, they are the drafter's where no position shows the sampler wrong (a sampler that emits
  drafts somewhere may emit them anywhere: then they tell nothing of the drafter);
- with none of these, (b) on the accepted count alone, both ways, is the sampler's ("its rejection
  sampler or its sampling parameters").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from eagle31_export.parity.symptoms import position_symptom
from eagle31_export.reference.replay import SampledRound

Z_95 = 1.959964  # two-sided 95 %
Z_80_POWER = 0.841621  # one-sided 80 %
EMITTED_DRAFT_ALPHA = 1e-3  # below this, no drafter with a correct sampler explains the drafts emitted at rejections
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
    # rejections that emitted the reference's own draft: [round, draft position]
    emitted_drafts: list[list] = field(default_factory=list)


@dataclass
class PositionLaw:
    """(b) at one draft position: how often it was reached and accepted, against the expectation; and
    the rejections there that emitted the reference's draft (`matched`), with the most a correct
    sampler lets them be (`match_bound`, summed over every rejection)."""

    position: int
    reached: int = 0
    accepted: int = 0
    expected: float = 0.0
    variance: float = 0.0
    matched: int = 0
    match_bound: float = 0.0
    accepted_other: int = 0  # accepted tokens that are not the reference's draft (the drafter's, by (a))

    @property
    def z(self) -> float | None:
        return (self.accepted - self.expected) / math.sqrt(self.variance) if self.variance > 0 else None

    @property
    def drafted_or_emitted(self) -> int:
        """Rounds here that accepted the reference's draft d or emitted d at a rejection: each one's
        probability is exactly p(d) with a correct sampler, whatever the runtime drafted."""
        return self.accepted - self.accepted_other + self.matched

    @property
    def z_either(self) -> float | None:
        """z of `drafted_or_emitted` against sum(p): 0 in expectation whatever was drafted."""
        return ((self.drafted_or_emitted - self.expected) / math.sqrt(self.variance)
                if self.variance > 0 else None)

    @property
    def emits_tail(self) -> float:
        """Chernoff bound on P(at least `matched` such rejections) with a correct sampler and any drafter."""
        m, mu = self.matched, self.match_bound
        if m == 0 or m <= mu:
            return 1.0
        if mu <= 0:
            return 0.0
        return math.exp(m - mu + m * math.log(mu / m))

    def interval(self) -> tuple[float, float]:
        """The 95 % interval of the accepted count under the target's probabilities."""
        half = Z_95 * math.sqrt(self.variance)
        return self.expected - half, self.expected + half

    def to_json(self) -> dict:
        low, high = self.interval()
        return {**asdict(self), "z": self.z, "drafted_or_emitted": self.drafted_or_emitted,
                "z_drafted_or_emitted": self.z_either, "emits_tail": self.emits_tail,
                "interval_95": [low, high]}


@dataclass
class GreedyDrafts:
    """The runtime run greedy over the same prompts and replayed: whether its drafter drafts as the
    reference's (every round's accepted count and token equal, ties aside)."""

    prompts: int
    rounds: int
    ties: int
    untied: list[str]  # differences beyond the tie tolerance, each with its symptom

    @property
    def exact(self) -> bool:
        return self.rounds > 0 and not self.untied

    def describe(self) -> str:
        return (f"run greedy over the same {self.prompts} prompts, its {self.rounds} rounds "
                + ("are the reference's" + (f" ({self.ties} ties)" if self.ties else "") if self.exact else
                   f"differ from the reference's in {len(self.untied)} places"))


@dataclass
class SamplingCheck:
    """(a) and (b) over every prompt of one run, and what they say together."""

    rule: str
    tie_gap: float
    z: float
    prompts: list[PromptDrafts]
    positions: list[PositionLaw]
    rounds: int
    greedy: GreedyDrafts | None = None  # the drafter checked greedy, where the sampled run left it open

    @property
    def drafter_open(self) -> bool:
        """The sampled run alone cannot clear or name the drafter: rejections emitted the reference's
        draft (another draft, or a sampler that did not mask it) and no accepted token names it."""
        return bool(self.emitted_drafts) and not any(p.mismatch for p in self.prompts)

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

    def _sampler_positions(self) -> tuple[list[PositionLaw], list[PositionLaw], list[PositionLaw]]:
        """Positions showing the sampler wrong whatever the runtime drafted: (the reference's draft
        accepted or emitted far less often than p(d) allows, far more often, rejections emitting it more
        often than a correct sampler can)."""
        low = [law for law in self.positions if law.z_either is not None and law.z_either < -self.z]
        high = [law for law in self.positions if law.z_either is not None and law.z_either > self.z]
        emits = [law for law in self.positions if law.emits_tail < EMITTED_DRAFT_ALPHA]
        return low, high, emits

    @property
    def sampler_wrong(self) -> bool:
        """Some draft position shows the sampler wrong whatever the runtime drafted."""
        return any(self._sampler_positions())

    @property
    def at_fault(self) -> str | None:
        """Which side the failures name: "drafter", "sampler" (the runtime's sampling), "both", or None."""
        drafter = bool(self._drafter_failures())
        sampler = bool(self._sampler_failures())
        return {(True, True): "both", (True, False): "drafter", (False, True): "sampler"}.get((drafter, sampler))

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
        """The drafter's failures (a), then the sampler's."""
        return self._drafter_failures() + self._sampler_failures()

    def _drafter_failures(self) -> list[str]:
        out = [f"prompt {p.prompt_index}: {p.mismatch} ({p.symptom})" for p in self.prompts if p.mismatch]
        if self.greedy is not None and self.greedy.untied:
            out += [f"{self.greedy.describe()}: {self.greedy.untied[0]}"]
        elif self.greedy is not None or self.sampler_wrong:
            return out  # drafts emitted at rejections are the sampler's (greedy cleared the drafter) or tell nothing
        for law in self.positions:
            if law.matched:
                first = next(p for p in self.prompts for e in p.emitted_drafts if e[1] == law.position)
                at = next(e[0] for e in first.emitted_drafts if e[1] == law.position)
                out.append(f"draft position {law.position}: {law.matched} rejections emitted the reference's own "
                           f"draft (first: prompt {first.prompt_index}, round {at}), which a rejection masks out: "
                           f"the runtime drafted another token ({position_symptom(law.position)})")
        return out

    def _sampler_failures(self) -> list[str]:
        low, high, emits = self._sampler_positions()
        out = [f"draft position {law.position}: {law.matched} of {law.reached - law.accepted} rejections emitted the "
               f"reference's draft, at most {law.match_bound:.1f} expected with a correct sampler whatever was "
               f"drafted (P <= {law.emits_tail:.1g}): {ENGINE_EMITS}" for law in emits]
        out += [f"draft position {law.position}: {law.drafted_or_emitted} of {law.reached} rounds accepted the "
                f"reference's draft or emitted it at a rejection, {law.expected:.1f} expected whatever was drafted "
                f"(z = {law.z_either:+.1f}): {ENGINE_FEWER if law.z_either < 0 else ENGINE_MORE}"
                for law in sorted(low + high, key=lambda law: law.position)]
        if self.greedy is not None and self.greedy.exact:
            out += [f"draft position {law.position}: {law.matched} rejections emitted the reference's own draft, "
                    f"which a rejection masks out, and the engine's drafter drafts as the reference's "
                    f"({self.greedy.describe()}): {ENGINE_EMITS}"
                    for law in self.positions if law.matched and law not in emits]
        if out or any(p.mismatch for p in self.prompts) or self.emitted_drafts:
            return out  # the law of the accepted count alone holds only where every draft was ours
        out = [self._law_failure(f"draft position {law.position}", law.accepted, law.expected, law.z, law.reached)
               for law in self.positions if law.z is not None and abs(law.z) > self.z]
        tau_z = self.tau_z
        if tau_z is not None and abs(tau_z) > self.z:
            observed, expected, _ = self.tau
            out.append(f"tau {observed:.3f} vs {expected:.3f} expected from the target's probabilities "
                       f"(z = {tau_z:+.1f}): {ENGINE_FEWER if tau_z < 0 else ENGINE_MORE}")
        return out

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
                "emitted_drafts": len(self.emitted_drafts),
                "accepted_checked": self.accepted_checked, "rejections_checked": self.rejections_checked,
                "ties": sum(len(p.ties) for p in self.prompts),
                "tau": {"observed": observed, "expected": expected, "half_width_95": half, "z": self.tau_z},
                "positions": [law.to_json() for law in self.positions],
                "prompts_to_see_tau_change": {"change": TAU_CHANGE, "prompts": self.prompts_to_see()},
                "prompts": [asdict(p) for p in self.prompts],
                "greedy": None if self.greedy is None else {**asdict(self.greedy), "exact": self.greedy.exact}}


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
        judged, matched, other = _judge_round(r, tie_gap, found)
        for i in range(judged):
            p = r.p_drafts[i]
            if p is None:
                break  # past the drafts the run's sequence holds (a differing accepted token, the end)
            law = positions[i]
            law.reached += 1
            law.accepted += int(r.accepted > i)
            law.expected += p
            law.variance += p * (1 - p)
            law.accepted_other += int(other == i)
            if r.accepted == i:  # the rejection: how likely a correct sampler emits d here, at most
                law.match_bound += _emit_bound(p, r.p_rivals[i])
                law.matched += int(matched)
    return found


def _judge_round(r: SampledRound, tie_gap: float, found: PromptDrafts) -> tuple[int, bool, int | None]:
    """(a) on one round: (how many of its draft positions to judge by (b), whether its rejection emitted
    the reference's draft, the position (0-based) of an accepted token that is not it). Records ties, drafts emitted at a rejection and the first accepted token
    that is not the reference's draft in `found`."""
    for i, token in enumerate(r.committed[: len(r.drafts)]):
        draft, accepted = r.drafts[i], i < r.accepted
        if accepted == (token == draft):
            if not accepted:
                found.rejections_checked += 1
                return i + 1, False, None
            found.accepted_checked += 1
            continue
        what = (f"round {r.index}, draft position {i + 1}: " +
                (f"accepted token {token} is not the reference's draft {draft}" if accepted else
                 f"the token emitted at a rejection is the reference's draft {draft}"))
        if r.margins[i] <= tie_gap:
            found.ties.append(f"{what}, within the drafter's top-2 margin {r.margins[i]:.3g}")
            return i, False, None  # the runtime's draft here is the other candidate: this position is not judged
        if not accepted:
            found.rejections_checked += 1
            found.emitted_drafts.append([r.index, i + 1])
            return i + 1, True, None
        if found.mismatch is None:
            found.mismatch, found.symptom = what, position_symptom(i + 1)
        return i + 1, False, i  # its own draft was accepted here; later positions left the reference's drafts
    return min(r.accepted + 1, len(r.drafts)), False, None


def _emit_bound(p: float, rival: float | None) -> float:
    """p(d) / (1 - max over x != d of p(x)), at most 1: the most likely a correct sampler that masked out
    some other draft emits the reference's draft d."""
    if rival is None or rival >= 1:
        return 1.0
    return min(p / (1 - rival), 1.0)
