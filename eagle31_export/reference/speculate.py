"""Chain speculative decoding (batch 1) over pluggable backends, with acceptance statistics.

The loop is written once; the reference (PyTorch) and the exported runtimes (ONNX Runtime,
Triton, ...) plug in as `TargetBackend` / `DrafterBackend`.

Positions: the target has processed tokens 0..m-1 and tapped their hidden states; token m is
the newest (sampled, not yet processed). The drafter pairs the tapped state at position j with
token j+1, so its committed cache covers positions whose next token is known. Each round:
1. the drafter consumes the not-yet-committed (state, next token) pairs and proposes d_1;
2. steps 2..depth feed its own state back (post-norm under EAGLE 3.1's `norm_output`);
3. the target verifies [t_m, d_1..d_depth] in one forward; accepted drafts plus one bonus
   token are kept, both caches are cut back to what was verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle31_export.errors import UserError
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import Eagle3Drafter
from eagle31_export.reference.statistics import acceptance_length, per_position_acceptance


class TargetBackend(Protocol):
    def reset(self) -> None: ...

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ids [1, T]; return logits [1, T, V] (the last `logits_to_keep` positions only, when
        given) and tapped states [1, T, k*Ht]."""

    def truncate(self, length: int) -> None: ...


class DrafterBackend(Protocol):
    def reset(self) -> None: ...

    @property
    def length(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                hidden_is_aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Return draft logits [1, T, Vd] and the fed-back state [1, T, H]."""

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def truncate(self, length: int) -> None: ...


class ReferenceDrafterBackend:
    """The reference drafter module plus its KV cache."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.cache = KVCache()

    def reset(self) -> None:
        self.cache = KVCache()

    @property
    def length(self) -> int:
        return self.cache.length()

    @property
    def device(self) -> torch.device:
        return self.drafter.d2t.device

    @torch.no_grad()
    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        # computes on the module's device (its cache lives there); results go back to the caller's
        device, back = self.device, input_ids.device
        step = self.drafter(input_ids.to(device), positions.to(device), hidden.to(device), self.cache, hidden_is_aux)
        return step.logits.to(back), step.fed_back.to(back)

    def draft_to_target(self, draft_ids):
        return self.drafter.draft_to_target(draft_ids.to(self.device)).to(draft_ids.device)

    def truncate(self, length: int) -> None:
        self.cache.crop(length)


class ChainDrafterBackend(Protocol):
    """A drafter that drafts a whole greedy chain in one call (e.g. an exported chain graph).

    The loop uses it at temperature 0 for depths up to `chain_depth`; the backend still
    implements the single-step `DrafterBackend` calls for everything else.
    """

    chain_depth: int

    def draft_chain(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    depth: int) -> torch.Tensor:
        """Like the first `forward` of a round, then `depth - 1` greedy steps; logits [1, depth, Vd]."""


@dataclass(frozen=True)
class Round:
    """What one speculation round did, as the loop reports it to an observer."""

    index: int
    drafts: list[int]  # target-vocabulary ids proposed this round
    accepted: int
    committed: list[int]  # tokens appended this round (accepted drafts + bonus, cut at a stop or the limit)
    first_draft_logits: torch.Tensor | None = None  # step-1 draft logits [Vd], when the observer asks


class LoopObserver:
    """The loop's extension point: override what you need (streaming, parity, statistics)."""

    wants_draft_logits = False

    def on_prefill_piece(self, done: int, total: int) -> None:
        """A long prompt's piece is prefilled: `done` of its `total` tokens (`prefill`)."""

    def on_prefill(self, token: int) -> None:
        """The target's first token, from the prompt's forward (before any round)."""

    def on_round(self, round: Round) -> None:
        """A round is verified and its tokens committed."""


class ProgressObserver(LoopObserver):
    """Reports the tokens generated so far, of `total`, as phase `phase` to `progress(phase, done,
    total)` (eagle31_export/progress.py): one report after the prefill and after every round."""

    def __init__(self, progress, total: int, phase: str = "generate"):
        self.progress, self.total, self.phase, self.done = progress, total, phase, 0

    def on_prefill_piece(self, done: int, total: int) -> None:
        self.progress("prefill", done, total)

    def on_prefill(self, token: int) -> None:
        self.done = 1
        self.progress(self.phase, self.done, self.total)

    def on_round(self, round: Round) -> None:
        self.done += len(round.committed)
        self.progress(self.phase, self.done, self.total)


@dataclass
class SpecResult:
    tokens: list[int]
    drafts: list[list[int]]
    accepted_per_step: list[int]
    depth: int
    # Replay only (reference/replay.py), for telling numerical ties from bugs (parity/ties.py):
    # token_gaps[i]: the target's logit of its own greedy token minus its logit of the token the
    # replayed run committed at generated position i (0 where they agree);
    # draft_margins[r][k]: the drafter's top-1 minus top-2 logit at draft step k + 1 of round r.
    # (not part of a result's equality: they describe the reference's margins, not what was decided)
    token_gaps: list[float] | None = field(default=None, compare=False)
    draft_margins: list[list[float]] | None = field(default=None, compare=False)
    # the best candidates of every decision (parity/numerics.py measures how far precision moves them):
    # token_tops[i] the target's at generated position i (past the tokens: on the last round's drafts that
    # max_new_tokens cut), draft_tops[r][k] the drafter's at step k + 1
    token_tops: list["Top"] | None = field(default=None, compare=False)
    draft_tops: list[list["Top"]] | None = field(default=None, compare=False)

    @property
    def acceptance_length(self) -> float:
        """tau: tokens produced per target verification (accepted drafts + the bonus token)."""
        return acceptance_length(sum(self.accepted_per_step), len(self.accepted_per_step))

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of rounds whose draft at position i (1-based) was accepted."""
        return per_position_acceptance(self.accepted_per_step, self.depth)

    @property
    def drafts_proposed(self) -> int:
        return sum(len(d) for d in self.drafts)

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "drafts": self.drafts,
            "accepted_per_step": self.accepted_per_step,
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "drafts_proposed": self.drafts_proposed,
            "depth": self.depth,
        }


# How a sampled round drafts, accepts and recovers; the report names the rule it compared.
SAMPLING_RULES = {
    "rejection": "drafts sampled from the drafter's distribution q, each accepted with probability min(1, p/q), "
                 "a rejected one resampled from max(0, p - q)",
    # vLLM 0.32 without draft probabilities (v1/spec_decode/llm_base_proposer.py, v1/sample/rejection_sampler.py):
    # this is the rule above with q a point mass on the argmax, so it is lossless too
    "greedy-drafts": "drafts are the drafter's argmax, each accepted with probability p_target(d), a rejected one "
                     "resampled from the target distribution with d masked out (vLLM's rule)",
}


@dataclass(frozen=True)
class Sampling:
    """What a sampled run draws from: the target's logits over `temperature`, cut to the `top_k` largest
    (0: all) and to the smallest set holding `top_p` of the mass (vLLM's order and ties:
    v1/sample/ops/topk_topp_sampler.py), and the speculation `rule` (SAMPLING_RULES)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    rule: str = "rejection"

    def __post_init__(self):
        if self.rule not in SAMPLING_RULES:
            raise UserError(f"unknown sampling rule {self.rule!r}; choose one of {', '.join(SAMPLING_RULES)}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError(f"top_p must be in (0, 1] and top_k >= 0 (got {self.top_p}, {self.top_k})")

    @classmethod
    def of(cls, value: "float | Sampling") -> "Sampling":
        """A bare temperature is the default rule without top-p / top-k."""
        return value if isinstance(value, Sampling) else cls(float(value))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a token is sampled from, in fp64, over the last dimension."""
        scaled = logits.double() / self.temperature
        if self.top_k and self.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = scaled.sort(dim=-1)
            below = torch.softmax(ordered, dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            below[..., -1] = False  # the most likely token always stays
            scaled = scaled.scatter(-1, order, ordered.masked_fill(below, float("-inf")))
        return torch.softmax(scaled, dim=-1)

    def describe(self) -> str:
        cuts = [f"top_p {self.top_p:g}"] * (self.top_p < 1) + [f"top_k {self.top_k}"] * bool(self.top_k)
        return f"temperature {self.temperature:g}" + "".join(f", {c}" for c in cuts) + f", rule {self.rule}"

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "rule": self.rule,
                "rule_text": SAMPLING_RULES[self.rule]}


class _Sampler:
    """Greedy at temperature 0, else seeded sampling with speculative rejection under `sampling.rule`."""

    def __init__(self, temperature: "float | Sampling", seed: int):
        self.sampling = Sampling.of(temperature)
        self.temperature = self.sampling.temperature
        self.gen = torch.Generator().manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.sampling.probs(logits)

    def pick(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.gen))

    def draft(self, draft_logits: torch.Tensor, drafter: DrafterBackend, vocab: int) -> tuple[int, torch.Tensor | None]:
        """A draft token as a target id, and the drafter's distribution over the target vocab."""
        greedy = self.temperature == 0 or self.sampling.rule == "greedy-drafts"
        d = int(torch.argmax(draft_logits)) if greedy else self.pick(draft_logits)
        target_id = int(drafter.draft_to_target(torch.tensor([d]))[0])
        if self.temperature == 0:
            return target_id, None
        q = torch.zeros(vocab, dtype=torch.float64)
        if greedy:  # a point mass: accepted with p(d), recovered from p with d masked out
            q[target_id] = 1.0
            return target_id, q
        ids = drafter.draft_to_target(torch.arange(draft_logits.shape[-1]))
        q[ids] = self.probs(draft_logits)
        return target_id, q

    def verify(self, target_logits: torch.Tensor, drafts: list[int], q: list) -> tuple[int, int]:
        """(accepted count, next token) from the target logits at positions m..m+depth."""
        if self.temperature == 0:
            accepted = 0
            for i, d in enumerate(drafts):
                if int(torch.argmax(target_logits[i])) != d:
                    break
                accepted += 1
            return accepted, int(torch.argmax(target_logits[accepted]))
        for i, d in enumerate(drafts):
            p = self.probs(target_logits[i])
            u = float(torch.rand((), generator=self.gen, dtype=torch.float64))
            if u * float(q[i][d]) < float(p[d]):  # accept with probability min(1, p/q)
                continue
            residual = torch.clamp(p - q[i], min=0)
            residual = residual / residual.sum() if residual.sum() > 0 else p
            return i, int(torch.multinomial(residual, 1, generator=self.gen))
        return len(drafts), self.pick(target_logits[len(drafts)])


# Prompt tokens one prefill forward takes at most (`prefill`); shorter prompts go in one forward.
PREFILL_CHUNK = 512


def check_prompt_ids(prompt_ids: list[int], vocab_size: int, what: str = "prompt") -> None:
    """Refuse token ids the target's embedding has no row for (one line naming the first)."""
    bad = [i for i in prompt_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"{what}: token id {bad[0]!r} is outside the target's vocabulary (0..{vocab_size - 1})")


def speculate(target: TargetBackend, drafter: DrafterBackend, prompt_ids: list[int], max_new_tokens: int,
              depth: int, temperature: float = 0.0, seed: int = 0, stop_ids: tuple[int, ...] = (),
              observer: LoopObserver | None = None) -> SpecResult:
    """Generate up to `max_new_tokens` with chain drafts of length `depth`."""
    if depth < 1 or max_new_tokens < 1 or not prompt_ids:
        raise UserError(f"depth ({depth}) and max_new_tokens ({max_new_tokens}) must be >= 1 and the prompt "
                        "non-empty")
    vocab_size = getattr(target, "vocab_size", None)
    if vocab_size is not None:
        check_prompt_ids(list(prompt_ids), int(vocab_size))
    observer = observer or LoopObserver()
    sampler = _Sampler(temperature, seed)
    target.reset()
    drafter.reset()
    last_logits, taps = prefill(target, drafter, list(prompt_ids), observer)
    vocab = last_logits.shape[-1]
    seq = list(prompt_ids) + [sampler.pick(last_logits)]
    result = SpecResult(tokens=[seq[-1]], drafts=[], accepted_per_step=[], depth=depth)
    observer.on_prefill(seq[-1])
    # a drafter that drafts whole greedy chains in one call (ChainDrafterBackend) does so at temperature 0
    chain = temperature == 0 and depth <= getattr(drafter, "chain_depth", 0)
    while len(result.tokens) < max_new_tokens and seq[-1] not in stop_ids:
        m, committed = len(seq) - 1, drafter.length
        ids, positions = torch.tensor([seq[committed + 1:]]), torch.arange(committed, m).unsqueeze(0)
        if chain:
            drafts, q, first_logits = _draft_chain(drafter, ids, positions, taps, depth, sampler, vocab)
        else:
            drafts, q, first_logits = _draft_steps(drafter, ids, positions, taps, m, depth, sampler, vocab)
        verify_logits, verify_taps = target.forward(torch.tensor([[seq[m]] + drafts]))
        accepted, bonus = sampler.verify(verify_logits[0], drafts, q)
        target.truncate(m + accepted + 1)
        drafter.truncate(m)
        taps = verify_taps[:, : accepted + 1]
        new = drafts[:accepted] + [bonus]
        for stop in stop_ids:  # nothing after a stop token
            if stop in new:
                new = new[: new.index(stop) + 1]
        new = new[: max_new_tokens - len(result.tokens)]
        seq += new
        result.tokens += new
        result.drafts.append(drafts)
        result.accepted_per_step.append(accepted)
        observer.on_round(Round(len(result.drafts) - 1, drafts, accepted, new,
                                first_logits if observer.wants_draft_logits else None))
    return result


def prefill(target: TargetBackend, drafter: DrafterBackend, prompt: list[int],
            observer: LoopObserver | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's forward: the target's logits after it [V], and the tapped states the first round's
    drafter still has to read [1, n, k*Ht] (the whole prompt's, or only its last position's).

    A prompt over `PREFILL_CHUNK` tokens goes in pieces, as engines' chunked prefill does: each
    piece keeps only its last logits, and the drafter reads each piece's tapped states at once (the
    state at j with token j + 1, which the prompt holds up to its last position). So neither the
    [prompt, vocabulary] logits nor the [prompt, k*Ht] taps are ever held whole (8.4 GB and 0.8 GB
    at 16k tokens and 8B widths), and attention runs over one piece of queries at a time."""
    if len(prompt) <= PREFILL_CHUNK:
        logits, taps = target.forward(torch.tensor([prompt]))
        return logits[0, -1], taps
    for start in range(0, len(prompt), PREFILL_CHUNK):
        logits, taps = target.forward(torch.tensor([prompt[start: start + PREFILL_CHUNK]]), logits_to_keep=1)
        known = min(start + taps.shape[1], len(prompt) - 1)  # positions whose next token the prompt holds
        if known > start:
            drafter.forward(torch.tensor([prompt[start + 1: known + 1]]), torch.arange(start, known).unsqueeze(0),
                            taps[:, : known - start], True)
        if observer is not None:
            observer.on_prefill_piece(start + taps.shape[1], len(prompt))
    return logits[0, -1], taps[:, -1:]


def _draft_steps(drafter: DrafterBackend, ids, positions, taps, m: int, depth: int, sampler: _Sampler, vocab: int,
                 margins: list[float] | None = None, tops: list["Top"] | None = None, follow: list[int] | None = None):
    """Step 1 on the tapped states, steps 2..depth on the drafter's own fed-back state. `margins`, when
    given, receives each step's top-1 minus top-2 draft logit; `tops` its best candidates (`Top`, as
    target ids). `follow`: the draft tokens fed back instead of its own (another pair's chain, so that
    both are measured at the same decisions)."""
    draft_logits, fed_back = drafter.forward(ids, positions, taps, True)
    first_logits = draft_logits[0, -1].detach().clone()
    drafts, q = [], []
    for i in range(depth):
        if margins is not None:
            margins.append(top2_margin(draft_logits[0, -1]))
        if tops is not None:
            tops.append(Top.of(draft_logits[0, -1], drafter.draft_to_target))
        token, dist = sampler.draft(draft_logits[0, -1], drafter, vocab)
        drafts.append(token)
        q.append(dist)
        if i + 1 < depth:
            fed = follow[i] if follow is not None and i < len(follow) else token
            draft_logits, fed_back = drafter.forward(torch.tensor([[fed]]), torch.tensor([[m + i]]),
                                                     fed_back[:, -1:], False)
    return drafts, q, first_logits


TOP_RECORDED = 32  # candidates kept per decision: enough to rank a runtime's choice and measure a shift


@dataclass(frozen=True)
class Top:
    """A decision's best candidates, best first: target vocabulary ids and their logits (fp64)."""

    ids: tuple[int, ...]
    values: tuple[float, ...]

    @classmethod
    def of(cls, logits: torch.Tensor, to_target=None, k: int = TOP_RECORDED) -> "Top":
        found = torch.topk(logits.detach().double(), min(k, logits.numel()))
        ids = found.indices if to_target is None else to_target(found.indices)
        return cls(tuple(int(i) for i in ids), tuple(float(v) for v in found.values))

    def rank(self, token: int) -> int | None:
        """1 for the best candidate; None where `token` is not among those kept."""
        return self.ids.index(token) + 1 if token in self.ids else None

    def value(self, token: int) -> float | None:
        return self.values[self.ids.index(token)] if token in self.ids else None


def top2_margin(logits: torch.Tensor) -> float:
    """The top-1 minus the top-2 logit (infinite where there is one entry)."""
    if logits.numel() < 2:
        return float("inf")
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def _draft_chain(drafter: ChainDrafterBackend, ids, positions, taps, depth: int, sampler: _Sampler, vocab: int):
    """The whole greedy chain in one drafter call."""
    logits = drafter.draft_chain(ids, positions, taps, depth)
    drafts = [sampler.draft(logits[0, i], drafter, vocab)[0] for i in range(depth)]
    return drafts, [None] * depth, logits[0, 0].detach().clone()


def replay_rounds(result: SpecResult, observer: LoopObserver) -> None:
    """Report a finished result's rounds: each committed its accepted drafts plus one token. A runtime
    that does not report its drafts (vLLM) leaves `result.drafts` empty: the rounds then carry none."""
    if not result.tokens:
        return
    observer.on_prefill(result.tokens[0])
    done = 1
    for i, accepted in enumerate(result.accepted_per_step):
        committed = result.tokens[done: done + accepted + 1]
        done += len(committed)
        drafts = result.drafts[i] if i < len(result.drafts) else []
        observer.on_round(Round(i, list(drafts), accepted, committed))
