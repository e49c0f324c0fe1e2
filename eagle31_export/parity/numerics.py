"""What the runtime's precision explains, measured decision by decision.

Greedy replay (reference/replay.py) follows the runtime's own sequence. Every prompt is replayed
twice along it: by the verdict's reference (fp32) and by the same pair at the runtime's precision
(`measure_dtype`: bf16 or fp16 weights and activations, FP4 activations too where the runtime
quantizes them; fp64 for an fp32 runtime, whose error is fp32's own rounding), the latter feeding back
the fp32 replay's drafts so that both are read at the very same decisions. At every decision (a
generated token, a draft step) the two replays' best candidates give the step's error scale

    e = sqrt(2) * std_i(lo_i - hi_i)  over the fp32 replay's TOP_MEASURED best candidates i,

the standard deviation of a two-token margin's shift were the candidates' shifts independent (a
shift common to all candidates moves no decision, hence the spread, not the mean). It is that
step's own: a decision whose inputs sit near a rounding boundary (an FP4 step of an activation)
measures a larger one.

Every verdict that excuses a difference as a numerical tie reads this one rule: greedy runs, runs
under load, sampled runs' drafts and greedy requests in mixed batches (parity/ties.py: `judge`;
parity/sampling.py for a sampled round's drafts). No verdict uses a fixed logit gap. Where each
threshold comes from:

- TIE_ERRORS: a difference is a numerical tie when the reference's fp32 logit of the runtime's choice
  is within TIE_ERRORS x e of its best (parity/ties.py). The value comes from the distribution of
  z = |shift of the top-2 margin| / e over every faithful decision, and of the faithful differences'
  margins / e, that `benchmarks/verdict_power.py` prints (docs/runtimes.md, "Why TIE_ERRORS = 5").
- The tie budget: a runtime whose margins move by N(0, (RUNTIME_ERROR_RATIO x e)^2) flips decision s
  with probability p_s = Phi(-margin_s / (RUNTIME_ERROR_RATIO x e_s)); over the decisions whose flip
  the comparison would see, the expected number of ties is sum p_s. RUNTIME_ERROR_RATIO is measured by
  `benchmarks/runtime_error_ratio.py`: the scale at which the faithful runs' expected ties equal the
  ties they showed (a runtime's own rounding is another draw of the same precision; docs/runtimes.md,
  "The tie budget"). More ties than the Poisson tail allows at BUDGET_ALPHA (a Poisson-binomial count
  is no wider than the Poisson of its mean) is "more differences than the runtime's precision
  explains": a small systematic error, each of whose differences alone is a tie. BUDGET_ALPHA is a
  chosen false-alarm rate, not a measurement.
- FP4_ROUNDING_BAND: `benchmarks/fp4_rounding_band.py` (below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from eagle31_export.formats.nvfp4.numerics import ambiguous_roundings
from eagle31_export.reference.speculate import SpecResult, Top

TOP_MEASURED = 16  # candidates whose shifts give a decision's error scale
TIE_ERRORS = 5.0  # a tie: within this many measured errors (benchmarks/verdict_power.py; docs/runtimes.md, "Why TIE_ERRORS = 5")
# a runtime's margin shifts against the measured error's, for the budget: benchmarks/runtime_error_ratio.py
# --runs 20 fits 1.70 (drafts compared) and 1.74 (accepted counts only) on our bf16 runtime; the larger,
# rounded up to 0.05
RUNTIME_ERROR_RATIO = 1.75
BUDGET_ALPHA = 1e-3  # a faithful runtime exceeds the tie budget at most this often (under the model)
MIN_ERROR = 1e-12  # an error scale of exactly 0 (identical candidates) stays a scale
# Against an fp32 runtime that quantizes activations to FP4: the float64 replay rounds every activation
# within this many E2M1 units of a rounding boundary the other way (formats/nvfp4/numerics.py:
# ambiguous_roundings). fp32 activations differ from float64 by up to 6.4e-5 units on the tiny NVFP4
# target, 3.0e-5 on SmolLM2's (benchmarks/fp4_rounding_band.py); an engine summing in another order is
# another draw of as much, so a rounding within twice that of a boundary may go either way on a faithful
# engine, and with it every decision after it (docs/runtimes.md, "FP4 roundings in fp32").
FP4_ROUNDING_BAND = 1.5e-4


def error_scale(hi: Top, lo: Top) -> float:
    """sqrt(2) x the spread of the candidates' logit shifts from `hi` (fp32) to `lo` (the runtime's
    precision), over `hi`'s best TOP_MEASURED that `lo` kept too."""
    shifts = [lo.value(t) - v for t, v in zip(hi.ids[:TOP_MEASURED], hi.values) if lo.value(t) is not None]
    if len(shifts) < 2:
        return math.inf  # nothing to measure against: every candidate moved out of reach
    mean = sum(shifts) / len(shifts)
    return max(math.sqrt(2 * sum((s - mean) ** 2 for s in shifts) / len(shifts)), MIN_ERROR)


def margin_shift(hi: Top, lo: Top) -> float | None:
    """How far the runtime's precision moved the fp32 top-2 margin (None: `lo` lost one of them)."""
    a, b = lo.value(hi.ids[0]), lo.value(hi.ids[1]) if len(hi.ids) > 1 else None
    if a is None or b is None:
        return None
    return (a - b) - (hi.values[0] - hi.values[1])


@dataclass
class Measured:
    """One prompt's measured error scale at every decision of its fp32 replay."""

    precision: str  # what the low side computed in, e.g. "bfloat16 + FP4 activations"
    token_errors: list[float]
    draft_errors: list[list[float]]
    z: list[float] = field(default_factory=list)  # |top-2 margin shift| / e at every decision
    flips: int = 0  # decisions the low side itself decided otherwise than fp32

    @property
    def errors(self) -> list[float]:
        return self.token_errors + [e for steps in self.draft_errors for e in steps]

    @classmethod
    def unmeasured(cls, ref: SpecResult, precision: str) -> "Measured":
        """No measurement (the reference cannot compute at the runtime's precision): every error 0, so
        no difference is excused as a tie, and the budget expects none."""
        return cls(precision, [0.0] * len(ref.token_tops or []), [[0.0] * len(steps) for steps in ref.draft_tops or []])


def measure(hi: SpecResult, lo: SpecResult, precision: str) -> Measured:
    """The error scale of every decision of `hi` (the fp32 replay), from `lo` (the same run replayed
    at the runtime's precision, following `hi`'s drafts)."""
    pairs = list(zip(hi.token_tops or [], lo.token_tops or []))
    pairs += [(a, b) for ra, rb in zip(hi.draft_tops or [], lo.draft_tops or []) for a, b in zip(ra, rb)]
    out = Measured(precision, [error_scale(a, b) for a, b in zip(hi.token_tops or [], lo.token_tops or [])],
                   [[error_scale(a, b) for a, b in zip(ra, rb)]
                    for ra, rb in zip(hi.draft_tops or [], lo.draft_tops or [])])
    for a, b in pairs:
        shift, e = margin_shift(a, b), error_scale(a, b)
        if shift is not None and math.isfinite(e):
            out.z.append(abs(shift) / e)
        out.flips += a.ids[0] != b.ids[0]
    return out


def flip_probability(margin: float, error: float, ratio: float = RUNTIME_ERROR_RATIO) -> float:
    """P(a N(0, (ratio x error)^2) shift of the margin takes it below zero)."""
    if not math.isfinite(error):
        return 0.0
    if error <= 0:
        return 0.0 if margin > 0 else 0.5
    return 0.5 * math.erfc(margin / (ratio * error * math.sqrt(2)))


def poisson_budget(expected: float, alpha: float = BUDGET_ALPHA) -> int:
    """The smallest n with P(Poisson(expected) > n) <= alpha."""
    n, term = 0, math.exp(-expected)
    cumulative = term
    while 1 - cumulative > alpha:
        n += 1
        term *= expected / n
        cumulative += term
    return n


@dataclass
class TieBudget:
    """Ties a run of this precision would show, from the measured per-decision errors."""

    expected: float = 0.0
    decisions: int = 0  # decisions whose flip the comparison would see
    observed: int = 0

    @property
    def allowed(self) -> int:
        return poisson_budget(self.expected)

    @property
    def exceeded(self) -> bool:
        return self.observed > self.allowed

    def add(self, other: "TieBudget") -> None:
        self.expected += other.expected
        self.decisions += other.decisions
        self.observed += other.observed

    def to_json(self) -> dict:
        return {"observed": self.observed, "expected": self.expected, "allowed": self.allowed,
                "alpha": BUDGET_ALPHA, "decisions": self.decisions}


def expected_ties(ref: SpecResult, run: SpecResult, measured: Measured, drafts_reported: bool,
                  ratio: float = RUNTIME_ERROR_RATIO) -> TieBudget:
    """The expected number of ties of one prompt: every generated token, and per round the chance
    that some draft step the comparison sees flips. A runtime that reports its drafts shows any
    flip; one that reports accepted counts only (vLLM) shows a flip at a step the reference accepted,
    or at its first rejected step where the runner-up is what the target chose."""
    budget = TieBudget()
    for top, e in zip((ref.token_tops or [])[:len(ref.tokens)], measured.token_errors):
        budget.expected += flip_probability(_margin(top), e, ratio)
        budget.decisions += 1
    greedy = _greedy_after_rounds(ref, run)
    for r, (tops, errors) in enumerate(zip(ref.draft_tops or [], measured.draft_errors)):
        accepted = ref.accepted_per_step[r] if r < len(ref.accepted_per_step) else 0
        stay = 1.0
        for j, (top, e) in enumerate(zip(tops, errors)):
            seen = drafts_reported or j < accepted or (
                j == accepted and len(top.ids) > 1 and greedy.get((r, j)) == top.ids[1])
            if seen:
                stay *= 1 - flip_probability(_margin(top), e, ratio)
                budget.decisions += 1
        budget.expected += 1 - stay
    return budget


def _margin(top: Top) -> float:
    return top.values[0] - top.values[1] if len(top.values) > 1 else math.inf


def _greedy_after_rounds(ref: SpecResult, run: SpecResult) -> dict[tuple[int, int], int]:
    """(round, step index) -> the target's greedy token at the reference's first rejected draft step,
    where the replay holds it: the runtime's sequence carries the reference's accepted drafts there
    (the runtime accepted as many or more), so the target read the same prefix."""
    out, done = {}, 1  # tokens[0] is the prefill's; round r verifies tokens[done:]
    for r, (accepted, theirs) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step)):
        if theirs >= accepted and done + accepted < len(ref.tokens):
            out[(r, accepted)] = ref.tokens[done + accepted]
        done += theirs + 1
    return out


def precision_name(dtype: torch.dtype, fp4_activations: bool) -> str:
    return str(dtype).replace("torch.", "") + (" + FP4 activations" if fp4_activations else "")


def measure_dtype(exact: bool, compute_dtype: torch.dtype) -> torch.dtype:
    """What the measuring pair computes in: fp64 against an fp32 runtime (fp32's own rounding is its
    error), else the runtime's half precision."""
    if exact:
        return torch.float64
    return compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass
class Measurer:
    """The reference pair at the runtime's precision, replayed beside the fp32 reference; keeps every
    prompt's measurement for the report's summary."""

    pair: object  # a speculator with `replay(prompt, run, observer, follow)`
    precision: str
    measured: list[Measured] = field(default_factory=list)
    unavailable: str | None = None  # why the pair could not compute at that precision (an op without kernels)
    fp4_band: float | None = None  # FP4 activation roundings within this many units go the other way

    def replay(self, reference, prompt: list[int], run: SpecResult,
               observer=None) -> tuple[SpecResult, Measured | None]:
        """The fp32 reference's replay of `run` and the error scale of each of its decisions (None where
        the measuring pair cannot compute: then no difference is excused as a tie)."""
        ref = reference.replay(prompt, run, observer=observer)
        if self.unavailable is not None:
            return ref, None
        try:
            with ambiguous_roundings(self.fp4_band):
                low = self.pair.replay(prompt, run, follow=ref.drafts)
        except (RuntimeError, NotImplementedError) as err:  # e.g. no float64 kernel for an MoE's grouped GEMM
            self.unavailable = f"the reference pair does not compute in {self.precision} here ({err})".split("\n")[0]
            return ref, None
        found = measure(ref, low, self.precision)
        self.measured.append(found)
        return ref, found

    def replay_sampled(self, reference, prompt: list[int], run: SpecResult, sampling
                       ) -> tuple[list, list[list[float]]]:
        """The fp32 reference along a sampled run (reference/replay.py: replay_sampled) and the error
        scale of each of its draft steps, from the same pair at the runtime's precision fed back the fp32
        replay's drafts (every error 0 where the pair cannot compute there: no difference excused)."""
        rounds = reference.replay_sampled(prompt, run, sampling)
        unmeasured = [[0.0] * len(r.tops) for r in rounds]
        if self.unavailable is not None:
            return rounds, unmeasured
        try:
            with ambiguous_roundings(self.fp4_band):
                low = self.pair.replay_sampled(prompt, run, sampling, follow=[r.drafts for r in rounds])
        except (RuntimeError, NotImplementedError) as err:
            self.unavailable = f"the reference pair does not compute in {self.precision} here ({err})".split("\n")[0]
            return rounds, unmeasured
        errors = [[error_scale(a, b) for a, b in zip(hi.tops, lo.tops)] for hi, lo in zip(rounds, low)]
        found = Measured(self.precision, [], errors)
        for hi, lo in zip(rounds, low):
            for a, b in zip(hi.tops, lo.tops):
                shift, e = margin_shift(a, b), error_scale(a, b)
                if shift is not None and math.isfinite(e):
                    found.z.append(abs(shift) / e)
                found.flips += a.ids[0] != b.ids[0]
        self.measured.append(found)
        return rounds, errors

    def summary(self, tie_errors: float) -> dict:
        """What the report says of the measurement: the error scales and normalized shifts over every
        decision replayed (the runs under load included)."""
        if self.unavailable is not None:
            return {"precision": self.precision, "tie_errors": tie_errors, "unavailable": self.unavailable}
        errors = sorted(e for m in self.measured for e in m.errors if math.isfinite(e))
        z = sorted(v for m in self.measured for v in m.z)
        quantile = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
        return {"precision": self.precision, "tie_errors": tie_errors, "decisions": len(errors),
                "median_error": quantile(errors, 0.5), "p99_error": quantile(errors, 0.99),
                "z_median": quantile(z, 0.5), "z_p99": quantile(z, 0.99), "z_max": z[-1] if z else None,
                "beyond_tie_errors": sum(v > tie_errors for v in z), "low_precision_flips": sum(m.flips for m in self.measured)}


def measurer_for(reference, exact: bool, compute_dtype: torch.dtype, fp4_activations: bool) -> Measurer | None:
    """The measuring pair for a runtime of this precision; None where the reference cannot load itself
    at another precision (a capture's)."""
    dtype = measure_dtype(exact, compute_dtype)
    at = getattr(reference, "at_precision", None)
    pair = at(dtype) if at is not None else None
    band = FP4_ROUNDING_BAND if exact and fp4_activations else None
    name = (precision_name(torch.float32, fp4_activations) + " (against float64" +
            (f", FP4 roundings within {band:g} of a boundary taken the other way)" if band else ")") if exact
            else precision_name(dtype, fp4_activations))
    return None if pair is None else Measurer(pair, name, fp4_band=band)
