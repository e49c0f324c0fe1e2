"""Attention drift, measured: what a drafter does at each draft depth (`eagle31-export diagnose`).

EAGLE 3.1 exists because, as speculation goes deeper, an EAGLE-3 drafter (a) moves its attention
away from the sink tokens toward its own drafted tokens, (b) sees a fused input dominated by the
tapped layers with the largest activations, and (c) feeds back a state whose magnitude grows along
the unnormalised residual path. This module measures each of these per depth 1..N.

Teacher forcing on the target's own continuation, so every depth is measured at every position:
each prompt is continued greedily by the target (`positions + depth - 1` tokens); for every anchor
position j from the prompt's last token on (`positions` anchors), the drafter drafts a chain of
`depth` steps the way the speculation loop drafts from j, except that step k reads the real token
x[j+k] rather than its own draft k-1 (they are equal whenever the earlier drafts were accepted).
Step k at anchor j sits at position j+k-1 and is compared with the target's greedy token at j+k.
Its keys are the committed (real) keys at positions <= j plus the chain's own keys from steps
1..k-1, exactly the cache the loop holds; anchors run from the last to the first so that one
`truncate(j + 1)` per anchor restores that cache on every drafter backend.

Quantities, per depth k (means over prompts and anchors):
- agreement: the step-k draft equals the target's token (given steps < k read the real tokens);
  acceptance: steps 1..k all agree (the chance a round from there accepts >= k drafts);
- RMS of the state fed back into step k+1, of the pre-norm h and of the post-norm norm(h), absolute
  and relative to depth 1 (per token, sqrt(mean over hidden of x^2));
- attention mass (mean over layers, heads and queries) on the first `num_sinks` keys (sinks), on the
  prompt's keys, on the target's continuation up to the anchor, and on the chain's drafted keys;
- entropy (nats) of the draft distribution.
And, independent of depth: per tapped source, the RMS of the target state entering fc (and after
fc_norm / norm_before_fc, what fc multiplies), over the anchors' positions.

The reference drafter shows everything; another runtime (an ONNX export) exposes only each step's
logits and fed-back state: what it cannot show is listed in `unavailable` with the reason, never
estimated.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from eagle31_export.errors import UserError
from eagle31_export.progress import Phases
from eagle31_export.reference.speculate import ReferenceDrafterBackend
from eagle31_export.runtime.registry import LoadOptions, LoopSpeculator, PairSource, load_speculator, resolve_device

ATTENTION_KINDS = ("sink", "prompt", "continuation", "drafted")


@dataclass(frozen=True)
class DriftThresholds:
    """When a change from depth 1 to depth N counts as a symptom in the verdict."""

    rms_growth: float = 1.25  # fed-back RMS at depth N / depth 1 above this (or below its inverse): a symptom
    rms_flat: float = 1.1  # within this factor of depth 1: flat
    sink_drop: float = 0.7  # sink mass at depth N / depth 1 below this: falling
    min_sink_mass: float = 0.02  # below this at depth 1 there is no sink to lose
    agreement_drop: float = 0.85  # agreement at depth N / depth 1 below this: decaying
    min_agreement: float = 0.05  # below this at depth 1 the drafter does not fit the target at all
    entropy_growth: float = 1.25
    fc_imbalance: float = 2.0  # largest / smallest tapped-source RMS above this: imbalanced


@dataclass
class DepthRow:
    depth: int
    agreement: float
    acceptance: float
    fed_back_rms: float
    fed_back_rms_rel: float
    pre_norm_rms: float | None
    pre_norm_rms_rel: float | None
    post_norm_rms: float | None
    post_norm_rms_rel: float | None
    attention_sink: float | None
    attention_prompt: float | None
    attention_continuation: float | None
    attention_drafted: float | None
    attention_by_layer: list[dict[str, float]] | None
    entropy: float


@dataclass
class FcInput:
    """Per tapped source (in `aux_layer_ids` order): RMS of the target state, and of what fc multiplies."""

    aux_layer_ids: list[int]
    rms: list[float]
    rms_into_fc: list[float] | None  # after fc_norm / norm_before_fc; None where not visible
    normalised_by: str | None  # "fc_norm", "norm_before_fc" or None (EAGLE-3: raw states into fc)

    @property
    def imbalance(self) -> float:
        return max(self.rms) / max(min(self.rms), 1e-30)


@dataclass
class DiagnoseReport:
    drafter: str
    target: str | None
    runtime: str
    eagle_version: str
    attention: str
    fc_norm: bool
    norm_output: bool
    depth: int
    num_sinks: int
    prompts: int
    prompt_lengths: list[int]
    positions: int  # anchors over all prompts (every depth is measured at each)
    rows: list[DepthRow]
    fc_input: FcInput
    unavailable: dict[str, str] = field(default_factory=dict)  # quantity -> why this runtime cannot show it
    symptoms: list[str] = field(default_factory=list)  # what drifts from depth 1 to N (empty: nothing)
    verdict: list[str] = field(default_factory=list)  # the verdict in words, headline first

    @property
    def label(self) -> str:
        """"EAGLE-3" or "EAGLE 3.1", as the project writes them."""
        return "EAGLE-3" if self.eagle_version == "3" else f"EAGLE {self.eagle_version}"

    @property
    def tau_estimate(self) -> float:
        """1 + sum of acceptance over depths: the expected tokens per round of a chain of `depth` drafts."""
        return 1.0 + sum(r.acceptance for r in self.rows)

    @property
    def drifts(self) -> bool:
        return bool(self.symptoms)

    def column(self, name: str) -> list[float | None]:
        return [getattr(r, name) for r in self.rows]

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("rows", "fc_input", "symptoms", "verdict")}
        out["tau_estimate"] = self.tau_estimate
        out["drifts"] = self.drifts
        out["symptoms"] = self.symptoms
        out["verdict"] = self.verdict
        out["per_depth"] = [asdict(r) for r in self.rows]
        out["fc_input"] = {**asdict(self.fc_input), "imbalance": self.fc_input.imbalance,
                           "depends_on_depth": False}
        return out


# --------------------------------------------------------------------------- drafter probes


@dataclass
class _Step:
    logits: torch.Tensor  # [1, T, Vd]
    fed_back: torch.Tensor  # [1, T, H]
    pre_norm: torch.Tensor | None
    post_norm: torch.Tensor | None


class _Probe:
    """A drafter backend seen through diagnose: cache handling is the backend's own."""

    def reset(self) -> None:
        self.backend.reset()

    def truncate(self, length: int) -> None:
        self.backend.truncate(length)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.draft_to_target(ids)


class _ReferenceProbe(_Probe):
    """The reference drafter: every quantity, attention probabilities through the cache's recorder."""

    def __init__(self, backend: ReferenceDrafterBackend):
        self.backend, self.drafter = backend, backend.drafter
        cfg = self.drafter.cfg
        self.eagle_version, self.attention = cfg.eagle_version, cfg.attention
        self.fc_norm, self.norm_output, self.num_aux = cfg.fc_norm, cfg.norm_output, cfg.num_aux_hidden_states
        self.normalised_by = "fc_norm" if cfg.fc_norm else ("norm_before_fc" if cfg.norm_before_fc else None)
        self.layers = cfg.num_layers
        self.unavailable: dict[str, str] = {}

    @torch.no_grad()
    def forward(self, ids, positions, hidden, hidden_is_aux: bool, recorder=None) -> _Step:
        # the drafter computes on its own device; every measurement is taken on the caller's (CPU)
        cache, device, back = self.backend.cache, self.backend.device, ids.device
        cache.recorder = None if recorder is None else (lambda layer, probs: recorder(layer, probs.to(back)))
        try:
            step = self.drafter(ids.to(device), positions.to(device), hidden.to(device), cache, hidden_is_aux)
        finally:
            cache.recorder = None
        here = lambda t: None if t is None else t.to(back)  # noqa: E731
        return _Step(here(step.logits), here(step.fed_back), here(step.pre_norm), here(step.normed))

    @torch.no_grad()
    def into_fc(self, sources: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The tapped states as fc multiplies them."""
        d, cfg = self.drafter, self.drafter.cfg
        dtype = d.fc.weight.dtype
        if cfg.fc_norm:
            return [n(s.to(dtype)) for n, s in zip(d.fc_norm, sources)]
        if cfg.norm_before_fc:
            normed = d.input_norm(torch.cat(sources, -1).to(dtype))
            return list(normed.split(cfg.effective_target_hidden_size, -1))
        return [s.to(dtype) for s in sources]


class _BackendProbe(_Probe):
    """Any other drafter backend (an ONNX export): per step only the logits and the fed-back state."""

    def __init__(self, backend, runtime: str):
        self.backend = backend
        cfg = _exported_config(backend)
        self.fc_norm, self.norm_output = bool(cfg.get("fc_norm")), bool(cfg.get("norm_output"))
        self.eagle_version = "3.1" if (self.fc_norm or self.norm_output) else "3"
        self.attention = cfg.get("attention", "gqa")
        self.num_aux = int(cfg.get("num_aux_hidden_states", 3))
        self.normalised_by = "fc_norm" if self.fc_norm else ("norm_before_fc" if cfg.get("norm_before_fc") else None)
        self.layers = 1  # attention is not visible
        graph = f"the {runtime} drafter outputs only logits and the fed-back state"
        self.unavailable = {"attention": f"{graph}, not its attention probabilities"}
        self.known = bool(cfg)
        if not self.known:
            for name in ("pre_norm_rms", "post_norm_rms"):
                self.unavailable[name] = f"{graph} and does not say whether that state is pre- or post-norm"
        else:
            self.unavailable["pre_norm_rms" if self.norm_output else "post_norm_rms"] = (
                f"{graph}, which is the {'post' if self.norm_output else 'pre'}-norm state for this drafter "
                f"(norm_output {'on' if self.norm_output else 'off'})")
        if self.normalised_by:
            self.unavailable["fc_input.rms_into_fc"] = f"{graph}; {self.normalised_by} runs inside the graph"

    def forward(self, ids, positions, hidden, hidden_is_aux: bool, recorder=None) -> _Step:
        logits, fed_back = self.backend.forward(ids, positions, hidden, hidden_is_aux)
        logits, fed_back = logits.double(), fed_back.double()
        if not self.known:
            return _Step(logits, fed_back, None, None)
        return _Step(logits, fed_back, None if self.norm_output else fed_back, fed_back if self.norm_output else None)

    def into_fc(self, sources):
        return None if self.normalised_by else sources  # without a norm, fc multiplies the states as they are


def _exported_config(backend) -> dict:
    export = getattr(backend, "export", None)
    meta = getattr(export, "meta", None) or {}
    return meta.get("drafter", {}).get("config", {})


# --------------------------------------------------------------------------- accumulation


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Per-token RMS over the hidden dimension."""
    return x.double().pow(2).mean(-1).sqrt()


class _Sums:
    def __init__(self, depth: int, layers: int):
        self.depth = depth
        z = lambda: [0.0] * depth  # noqa: E731
        self.agree, self.accept, self.fed, self.pre, self.post, self.entropy = z(), z(), z(), z(), z(), z()
        self.count = 0
        self.attn = [[dict.fromkeys(ATTENTION_KINDS, 0.0) for _ in range(layers)] for _ in range(depth)]
        self.attn_queries = [[0] * layers for _ in range(depth)]
        self.tap_rms: list[float] | None = None
        self.tap_into: list[float] | None = None


class _AttentionRecorder:
    """Receives each layer's probabilities [1, heads, T, S] for queries at anchors `anchors` (one per
    row of T) and adds the mass on sink / prompt / continuation / drafted keys (means over heads)."""

    def __init__(self, sums: _Sums, depth_index: int, anchors: list[int], prompt_len: int, num_sinks: int):
        self.sums, self.k, self.anchors, self.p, self.ns = sums, depth_index, anchors, prompt_len, num_sinks

    def __call__(self, layer_id: int, probs: torch.Tensor) -> None:
        probs = probs[0].double().mean(0)  # [T, S], mean over heads
        t, s = probs.shape
        keys = torch.arange(s)
        real = keys.unsqueeze(0) <= torch.tensor(self.anchors).unsqueeze(1)  # [T, S]: committed keys
        masses = {
            "sink": probs[:, :self.ns].sum(-1),
            "prompt": probs[:, :self.p].sum(-1),
            "continuation": (probs * (real & (keys >= self.p))).sum(-1),
            "drafted": (probs * ~real).sum(-1),
        }
        cell = self.sums.attn[self.k][layer_id]
        for kind, mass in masses.items():
            cell[kind] += float(mass.sum())
        self.sums.attn_queries[self.k][layer_id] += t


def _record(sums: _Sums, probe, depth_index: int, anchors: list[int], prompt_len: int, num_sinks: int):
    if "attention" in probe.unavailable:
        return None
    return _AttentionRecorder(sums, depth_index, anchors, prompt_len, num_sinks)


def _add_step(sums: _Sums, k: int, step: _Step, ids_target: torch.Tensor, greedy: torch.Tensor,
              alive: torch.Tensor) -> torch.Tensor:
    """Adds step k's measurements over the rows of `step` (anchors); returns the updated chain `alive`."""
    logits = step.logits[0].double()  # [T, Vd]
    hits = ids_target == greedy
    alive = alive & hits
    sums.agree[k] += float(hits.sum())
    sums.accept[k] += float(alive.sum())
    sums.fed[k] += float(_rms(step.fed_back[0]).sum())
    if step.pre_norm is not None:
        sums.pre[k] += float(_rms(step.pre_norm[0]).sum())
    if step.post_norm is not None:
        sums.post[k] += float(_rms(step.post_norm[0]).sum())
    logp = torch.log_softmax(logits, -1)
    sums.entropy[k] += float(-(logp.exp() * logp).sum(-1).sum())
    return alive


def _forward_whole(target, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    target.reset()
    return target.forward(torch.tensor([seq]))


def _continue_greedily(target, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The target's greedy continuation (incremental, as the loop runs it); the sequence, the target's
    logits at every position and its tapped states."""
    target.reset()
    logits, taps = target.forward(torch.tensor([prompt]))
    all_logits, all_taps, seq = [logits], [taps], list(prompt)
    for _ in range(new_tokens):
        seq.append(int(torch.argmax(all_logits[-1][0, -1])))
        logits, taps = target.forward(torch.tensor([[seq[-1]]]))
        all_logits.append(logits)
        all_taps.append(taps)
    return seq, torch.cat(all_logits, 1), torch.cat(all_taps, 1)


@torch.no_grad()
def _diagnose_prompt(target, probe, prompt: list[int], depth: int, positions: int, num_sinks: int,
                     sums: _Sums, continuation: list[int] | None = None) -> None:
    p, a = len(prompt), positions
    if continuation is None:
        seq, logits, taps = _continue_greedily(target, prompt, a + depth - 1)
    else:  # the target's greedy continuation, known already: one forward over the whole sequence
        seq = list(prompt) + list(continuation[:a + depth - 1])
        logits, taps = _forward_whole(target, seq)
    greedy = logits[0].argmax(-1)  # greedy[i]: the target's token after position i
    x = torch.tensor([seq])
    anchors = list(range(p - 1, p - 1 + a))

    k_src = probe.num_aux
    sources = list(taps[0, p - 1:p - 1 + a].split(taps.shape[-1] // k_src, -1))
    tap_rms = [float(_rms(s).sum()) for s in sources]
    sums.tap_rms = tap_rms if sums.tap_rms is None else [u + v for u, v in zip(sums.tap_rms, tap_rms)]
    into = probe.into_fc(sources)
    if into is not None:
        into_rms = [float(_rms(s).sum()) for s in into]
        sums.tap_into = into_rms if sums.tap_into is None else [u + v for u, v in zip(sums.tap_into, into_rms)]

    # step 1 at every position: the committed prefix first, then the anchors (recorded)
    probe.reset()
    if p > 1:
        probe.forward(x[:, 1:p], torch.arange(0, p - 1).unsqueeze(0), taps[:, :p - 1], True)
    first = probe.forward(x[:, p:p + a], torch.arange(p - 1, p - 1 + a).unsqueeze(0), taps[:, p - 1:p - 1 + a],
                          True, _record(sums, probe, 0, anchors, p, num_sinks))
    drafted = probe.draft_to_target(first.logits[0].argmax(-1))
    alive = _add_step(sums, 0, first, drafted, greedy[p:p + a], torch.ones(a, dtype=torch.bool))

    # steps 2..depth, one chain per anchor, last anchor first (truncate restores the committed cache)
    for i in reversed(range(a)):
        j, hidden, chain_alive = anchors[i], first.fed_back[:, i:i + 1], alive[i:i + 1]
        probe.truncate(j + 1)
        for k in range(1, depth):  # 0-based: step k sits at position j+k and reads the real token j+k+1
            step = probe.forward(x[:, j + k + 1:j + k + 2], torch.tensor([[j + k]]), hidden, False,
                                 _record(sums, probe, k, [j], p, num_sinks))
            draft = probe.draft_to_target(step.logits[0].argmax(-1))
            chain_alive = _add_step(sums, k, step, draft, greedy[j + k + 1:j + k + 2], chain_alive)
            hidden = step.fed_back[:, -1:]
    sums.count += a


# --------------------------------------------------------------------------- the diagnosis


def diagnose_speculator(speculator: LoopSpeculator, prompts: list[list[int]], depth: int, positions: int = 32,
                        num_sinks: int = 4, drafter_name: str = "", target_name: str | None = None,
                        thresholds: DriftThresholds = DriftThresholds(),
                        on_prompt: Callable[[int], None] | None = None,
                        continuations: list[list[int]] | None = None, progress=None) -> DiagnoseReport:
    """Measure the drafter of `speculator` (a loop over a target and a drafter backend) per depth.
    `continuations`: the target's greedy continuation of each prompt (at least `positions + depth - 1`
    tokens) when the caller has it; otherwise the target generates it. `progress`: phase `measure`,
    prompts done (eagle31_export/progress.py)."""
    _check_settings(prompts, depth, positions, num_sinks)
    phases = Phases.of(progress)
    if not isinstance(speculator, LoopSpeculator):
        raise UserError(f"diagnose drives the drafter step by step; the {speculator.name} runtime runs whole "
                        "generations: diagnose the checkpoint or its `export onnx` folder instead")
    target, backend = speculator.target, speculator.drafter
    probe = (_ReferenceProbe(backend) if isinstance(backend, ReferenceDrafterBackend)
             else _BackendProbe(backend, speculator.name))
    sums = _Sums(depth, probe.layers)
    if continuations is not None and any(len(c) < positions + depth - 1 for c in continuations):
        raise ValueError("each continuation needs positions + depth - 1 tokens")
    with phases.phase("measure", total=len(prompts)):
        for i, prompt in enumerate(prompts):
            if hasattr(target, "select"):  # a capture: the run reads this prompt's captured sequence
                target.select(list(prompt))
            _diagnose_prompt(target, probe, prompt, depth, positions, num_sinks, sums,
                             None if continuations is None else continuations[i])
            if on_prompt:
                on_prompt(i)
            phases("measure", i + 1, len(prompts))
    report = _report(sums, probe, speculator.name, target, prompts, depth, num_sinks, drafter_name, target_name)
    report.symptoms, report.verdict = verdict(report, thresholds)
    return report


def _check_settings(prompts, depth: int, positions: int, num_sinks: int) -> None:
    if depth < 1:
        raise UserError(f"--depth must be >= 1 (draft depths 1..N to measure), got {depth}")
    if positions < 1:
        raise UserError(f"--positions must be >= 1 (anchor positions per prompt), got {positions}")
    if num_sinks < 0:
        raise UserError(f"--num-sinks must be >= 0, got {num_sinks}")
    if not prompts:
        raise UserError("no prompts to diagnose on; pass --prompts FILE with at least one prompt")
    if any(not p for p in prompts):
        raise UserError("an empty prompt; every prompt needs at least one token")


def _report(sums: _Sums, probe, runtime: str, target, prompts, depth: int, num_sinks: int, drafter_name: str,
            target_name: str | None) -> DiagnoseReport:
    n = sums.count
    mean = lambda v: v / n  # noqa: E731
    unavailable = dict(probe.unavailable)
    pre_seen, post_seen = "pre_norm_rms" not in unavailable, "post_norm_rms" not in unavailable
    attn_seen = "attention" not in unavailable
    fed1, pre1, post1 = mean(sums.fed[0]), mean(sums.pre[0]), mean(sums.post[0])
    rows = []
    for k in range(depth):
        by_layer = None
        if attn_seen:
            by_layer = [{kind: cell[kind] / max(q, 1) for kind in ATTENTION_KINDS}
                        for cell, q in zip(sums.attn[k], sums.attn_queries[k])]
        attn = {kind: (sum(layer[kind] for layer in by_layer) / len(by_layer) if by_layer else None)
                for kind in ATTENTION_KINDS}
        pre, post = mean(sums.pre[k]) if pre_seen else None, mean(sums.post[k]) if post_seen else None
        rows.append(DepthRow(
            depth=k + 1, agreement=mean(sums.agree[k]), acceptance=mean(sums.accept[k]),
            fed_back_rms=mean(sums.fed[k]), fed_back_rms_rel=mean(sums.fed[k]) / fed1,
            pre_norm_rms=pre, pre_norm_rms_rel=None if pre is None else pre / pre1,
            post_norm_rms=post, post_norm_rms_rel=None if post is None else post / post1,
            attention_sink=attn["sink"], attention_prompt=attn["prompt"],
            attention_continuation=attn["continuation"], attention_drafted=attn["drafted"],
            attention_by_layer=by_layer, entropy=mean(sums.entropy[k])))
    fc = FcInput(aux_layer_ids=list(getattr(target, "aux_layer_ids", ()) or ()),
                 rms=[v / n for v in sums.tap_rms],
                 rms_into_fc=None if sums.tap_into is None else [v / n for v in sums.tap_into],
                 normalised_by=probe.normalised_by)
    return DiagnoseReport(
        drafter=drafter_name, target=target_name, runtime=runtime, eagle_version=probe.eagle_version,
        attention=probe.attention, fc_norm=probe.fc_norm, norm_output=probe.norm_output, depth=depth,
        num_sinks=num_sinks, prompts=len(prompts), prompt_lengths=[len(p) for p in prompts], positions=n,
        rows=rows, fc_input=fc, unavailable=unavailable)


# --------------------------------------------------------------------------- the verdict


def verdict(report: DiagnoseReport, th: DriftThresholds = DriftThresholds()) -> tuple[list[str], list[str]]:
    """(symptoms, sentences): the symptoms found from depth 1 to depth N, and the verdict in words.
    The first sentence says whether the drafter drifts ("drift: <symptoms>" or "no drift: ..."); the
    others give the numbers behind it."""
    first, last = report.rows[0], report.rows[-1]
    n = last.depth
    symptoms, notes = [], []
    if n > 1:
        growth = last.fed_back_rms_rel
        state = "post-norm" if report.norm_output else "pre-norm"
        if growth > th.rms_growth:
            symptoms.append(f"fed-back state RMS grows {growth:.1f}x from depth 1 to {n} ({state} feedback)")
        elif growth < 1 / th.rms_growth:
            symptoms.append(f"fed-back state RMS shrinks to {growth:.2f}x from depth 1 to {n} ({state} feedback)")
        elif 1 / th.rms_flat <= growth <= th.rms_flat:
            notes.append(f"fed-back state RMS stays flat ({growth:.2f}x from depth 1 to {n}, {state} feedback)")
        else:
            notes.append(f"fed-back state RMS changes {growth:.2f}x from depth 1 to {n} ({state} feedback)")
        if first.attention_sink is not None:
            s1, sn = first.attention_sink, last.attention_sink
            if s1 >= th.min_sink_mass and sn < th.sink_drop * s1:
                symptoms.append(f"sink attention falls from {s1:.2f} to {sn:.2f}")
            else:
                notes.append(f"sink attention {s1:.2f} at depth 1, {sn:.2f} at depth {n}")
            notes.append(f"at depth {n} its attention is {last.attention_drafted:.2f} on its own drafted tokens, "
                         f"{last.attention_prompt:.2f} on the prompt (depth 1: {first.attention_prompt:.2f})")
        a1, an = first.agreement, last.agreement
        if a1 > 0 and an < th.agreement_drop * a1:
            symptoms.append(f"agreement with the target decays from {a1:.2f} at depth 1 to {an:.2f} at depth {n}")
        else:
            notes.append(f"agreement {a1:.2f} at depth 1, {an:.2f} at depth {n}")
        e1, en = first.entropy, last.entropy
        if e1 > 0 and en > th.entropy_growth * e1:
            symptoms.append(f"draft entropy rises from {e1:.2f} to {en:.2f} nats")
    fc = report.fc_input
    listing = "/".join(f"{v:.3g}" for v in fc.rms)
    spread = f"tapped states enter fc at RMS {listing} ({fc.imbalance:.1f}x apart)"
    if fc.imbalance <= th.fc_imbalance:
        notes.append(spread)
    elif fc.normalised_by:
        notes.append(f"{spread}; {fc.normalised_by} evens them out")
    else:
        symptoms.append(f"{spread} and nothing normalises them (no fc_norm): the largest dominates the fused input")
    unfit = (f"at depth 1 the drafter agrees with the target on only {first.agreement:.2f} of positions "
             "(an untrained drafter, or not this target's?)")
    if symptoms:
        head = "drift: " + "; ".join(symptoms)
        if first.agreement < th.min_agreement:
            notes.insert(0, unfit)
    elif first.agreement < th.min_agreement:
        head = "nothing to drift from: " + unfit
    elif n == 1:
        head = "no drift measurable at depth 1 alone: run with --depth >= 2"
    else:
        head = f"no drift: the drafter holds up to depth {n}"
    seen_nowhere = [f"not visible on {report.runtime}: " + ", ".join(report.unavailable)] if report.unavailable else []
    return symptoms, [head, *notes, *seen_nowhere]


# --------------------------------------------------------------------------- loading


def is_onnx_export(folder: Path) -> bool:
    return (folder / "graphs.json").is_file()


def diagnose(drafter: str | os.PathLike, target: str | os.PathLike | None, prompts: list[list[int]] | None = None,
             prompts_file: str | os.PathLike | None = None, depth: int = 6, positions: int = 32, num_sinks: int = 4,
             thresholds: DriftThresholds = DriftThresholds(), progress=None,
             capture: str | os.PathLike | None = None, device: str = "cpu") -> DiagnoseReport:
    """`diagnose` from folders: `drafter` is a checkpoint (any format; the reference runs it) or an
    `export onnx` folder (ONNX Runtime runs it, with its target graph when it has one, else `target`).
    `capture` (an `eagle31-export capture` folder) replaces the target: its greedy continuations
    and tapped states are read instead of computed. `progress(phase, done, total)` hears of the phases
    `load` and `measure` (prompts done); pass a `Phases` to get their seconds (eagle31_export/progress.py).
    `device` (cpu, cuda, auto): where the reference pair computes (an ONNX export runs on CPU)."""
    drafter = Path(drafter)
    if not drafter.is_dir():
        raise UserError(f"{drafter}: no such drafter folder; pass a drafter checkpoint or an `export onnx` folder")
    onnx = is_onnx_export(drafter)
    _check_settings(prompts or [[0]], depth, positions, num_sinks)
    resolve_device(device, "onnxruntime" if onnx else "reference")  # before anything loads
    progress = Phases.of(progress)
    if capture is not None:
        if target is not None:
            raise UserError("pass --target or --capture, not both")
        return _diagnose_on_capture(drafter, Path(capture), onnx, prompts, prompts_file, depth, positions,
                                    num_sinks, thresholds, progress, device)
    from eagle31_export.formats.prompts import read_prompts
    from eagle31_export.formats.target.checkpoint import read_target_info
    from eagle31_export.parity.prompts import bundle_sources, default_prompts

    if target is None and onnx:
        target = bundle_sources(drafter)[1]
    if target is None:
        raise UserError("diagnose needs the target: pass --target T (or --capture C)")
    target = Path(target)
    if not target.is_dir():
        raise UserError(f"{target}: no such target folder; pass the target checkpoint with --target")
    vocab = read_target_info(target).vocab_size
    if prompts is None:
        prompts = read_prompts(prompts_file, target, vocab) if prompts_file is not None else default_prompts(vocab)
    options = LoadOptions(dtype=torch.float32, device=device)
    with tempfile.TemporaryDirectory(prefix="eagle31-diagnose-") as workdir:
        with progress.phase("load"):
            if onnx:
                speculator = load_speculator("onnxruntime", PairSource.of(None, target, drafter), options, workdir)
            else:
                speculator = load_speculator("reference", PairSource.of(drafter, target), options)
        return diagnose_speculator(speculator, prompts, depth, positions, num_sinks, str(drafter), str(target),
                                   thresholds, progress=progress)


def _diagnose_on_capture(drafter: Path, capture_dir: Path, onnx: bool, prompts, prompts_file, depth: int,
                         positions: int, num_sinks: int, thresholds: DriftThresholds, progress: Phases,
                         device: str = "cpu") -> DiagnoseReport:
    from eagle31_export.formats.capture import Capture
    from eagle31_export.parity.prompts import capture_prompts

    capture = Capture.open(capture_dir)
    if prompts is None:
        prompts = capture_prompts(capture, Path(prompts_file) if prompts_file is not None else None)
    needed = positions + depth - 1
    continuations = []
    for prompt in prompts:
        index = capture.require(list(prompt))
        tokens = [int(t) for t in capture.tensors[f"p{index}.tokens"]][len(prompt):]
        if len(tokens) < needed:
            raise UserError(f"{capture_dir} holds {len(tokens)} greedy tokens per prompt; diagnose with --positions "
                            f"{positions} --depth {depth} reads {needed}: re-capture with a larger --max-new-tokens, "
                            "or lower --positions")
        continuations.append(tokens[:needed])
    options = LoadOptions(dtype=torch.float32, device=device)
    with tempfile.TemporaryDirectory(prefix="eagle31-diagnose-") as workdir:
        source = (PairSource.of(None, None, drafter, capture=capture_dir) if onnx
                  else PairSource.of(drafter, capture=capture_dir))
        with progress.phase("load"):
            speculator = load_speculator("onnxruntime" if onnx else "reference", source, options, workdir)
        return diagnose_speculator(speculator, prompts, depth, positions, num_sinks, str(drafter), str(capture_dir),
                                   thresholds, continuations=continuations, progress=progress)


# --------------------------------------------------------------------------- both sides of a parity run


def per_depth_sides(reference, runtime, prompts: list[list[int]], depth: int, positions: int = 8) -> dict:
    """Per-depth agreement, acceptance and fed-back state RMS of both sides of a parity run, measured
    as `diagnose` measures them (teacher-forced, `positions` anchors per prompt): a runtime that feeds
    back the wrong state shows a different RMS curve. A side whose steps are not visible (a remote
    runtime) or that cannot be diagnosed on these prompts says why under "unavailable"."""
    continuations = None  # generated once, by the reference target, for both sides
    if isinstance(reference, LoopSpeculator):
        try:
            continuations = [_continue_greedily(reference.target, p, positions + depth - 1)[0][len(p):]
                             for p in prompts]
        except UserError:
            pass  # each side then says what stops it
    return {"positions_per_prompt": positions,
            "reference": per_depth_side(reference, prompts, depth, positions, continuations),
            "runtime": per_depth_side(runtime, prompts, depth, positions, continuations)}


def per_depth_side(speculator, prompts, depth: int, positions: int, continuations) -> dict:
    """One side's per-depth columns (`per_depth_sides`), or why they are unavailable."""
    if not isinstance(speculator, LoopSpeculator):
        return {"unavailable": f"the {speculator.name} runtime runs whole generations; its per-step states are "
                               "not visible"}
    try:
        report = diagnose_speculator(speculator, prompts, depth, positions, continuations=continuations)
    except UserError as err:
        return {"unavailable": str(err)}
    return {name: report.column(name) for name in ("agreement", "acceptance", "fed_back_rms", "fed_back_rms_rel")}
