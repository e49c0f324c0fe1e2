"""The runtime contract, at the bottom of runtime/: what every runtime module implements and takes.

- `PairSource`: what the user named (checkpoints, exported artifacts, a server URL, a capture);
- `LoadOptions`: how to load it;
- `Speculator`: a runtime that generates with speculation (`run`, `run_concurrently`, `close`);
- `LoopSpeculator`: the one speculation loop over a target and a drafter backend.

A runtime module imports this module (and lower layers) only, never the registry
(`runtime/registry.py`), which sits on top and imports the runtimes; import-linter holds it
(pyproject.toml, tests/test_architecture.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle31_export.reference.replay import SampledRound, replay_greedy, replay_sampled
from eagle31_export.reference.speculate import (
    DrafterBackend, LoopObserver, Sampling, SpecResult, TargetBackend, speculate,
)


@dataclass(frozen=True)
class PairSource:
    """What the user named. `artifacts` is the runtime's own input: an `export onnx` folder, a
    serving bundle or an exported drafter checkpoint. With `capture`, runtimes that support it
    (`reference`, `onnxruntime`) read the target's outputs from the capture instead of loading it."""

    drafter: Path | None = None
    target: Path | None = None
    artifacts: Path | None = None
    url: str | None = None
    capture: Path | None = None  # an `eagle31-export capture` folder standing in for the target (greedy only)

    @classmethod
    def of(cls, drafter=None, target=None, artifacts=None, url=None, capture=None) -> "PairSource":
        as_path = lambda p: None if p is None else Path(p)  # noqa: E731
        return cls(as_path(drafter), as_path(target), as_path(artifacts), url, as_path(capture))


@dataclass(frozen=True)
class LoadOptions:
    dtype: torch.dtype = torch.float32
    act_quant: bool = False  # NVFP4 targets: emulate W4A4
    nvfp4_semantics: str = "exact"  # NVFP4 targets: how stored scales are read (formats/nvfp4/scheme.py: NVFP4_SEMANTICS)
    kernels: str = "torch"  # reference drafter: plain torch or the plugin kernels
    chain: bool = False  # onnxruntime: draft with the exported chain graph
    threads: int | None = None
    device: str = "cpu"  # cpu, cuda or auto (resolve_device); where the reference target and drafter compute
    depth: int | None = None  # vllm: num_speculative_tokens of a local engine (None: the bundle's)
    vllm: str | None = None  # vllm: a python interpreter or virtual environment that has vLLM ($EAGLE31_VLLM)
    port: int | None = None  # vllm: the local engine's port on 127.0.0.1 (None: a free one)
    engine_timeout: float = 600.0  # vllm: seconds a local engine may take to become ready
    max_context: int | None = None  # the longest sequence a run holds (vllm: the local engine serves at least this)
    max_num_batched_tokens: int | None = None  # vllm: the local engine's tokens per step (None: vLLM's default)
    draft_log: Path | None = None  # vllm: the folder our plugin logs the engine's drafts in (runtime/vllm_drafts.py)


def request_sampling(temperature: float | Sampling | list, i: int) -> float | Sampling:
    """What request i of a concurrent run samples by (`Speculator.run_concurrently`)."""
    return temperature[i] if isinstance(temperature, (list, tuple)) else temperature


class Speculator:
    """A runtime that generates with speculation; `exact` when it computes in fp32 end to end."""

    name: str = ""
    exact: bool = True
    reports_drafts = True  # False: the runtime returns tokens and acceptance counts, not its drafts (vLLM)
    rounds_in_order = True  # False: accepted counts per round are known as counts only, not in order
    serves_concurrently = False  # True: requests in flight together are served together (batched), not queued
    compute_dtype: torch.dtype = torch.float32  # what it computes in: parity measures ties at this precision
    # what it says of its activation precision, where it tells: {"fp4": bool, "basis", "how"} (vllm)
    activations: dict | None = None

    def close(self) -> None:
        """Release what the runtime holds outside this process (a server it started)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, prompt_ids: list[int], max_new_tokens: int, depth: int, temperature: float | Sampling = 0.0,
            seed: int = 0, stop_ids: tuple[int, ...] = (), observer: LoopObserver | None = None) -> SpecResult:
        """`temperature`: a bare temperature, or a `Sampling` (top-p, top-k, the rule) to sample by."""
        raise NotImplementedError

    def sampling_rule(self, requested: str | None) -> tuple[str, str]:
        """(the rule this runtime samples by, how that is known) for a run at temperature > 0; `requested`
        None: its own. Our loop runs every rule of SAMPLING_RULES, the default one unless asked."""
        rule = requested or "rejection"
        Sampling(1.0, rule=rule)  # an unknown name is refused
        return rule, f"set: this run's own loop samples by {rule}"

    def run_concurrently(self, prompts: list[list[int]], max_new_tokens: int, depth: int, concurrency: int,
                         temperature: float | Sampling | list = 0.0, seed: int = 0) -> "ConcurrentRun":
        """Every prompt with `concurrency` requests in flight at a time (prompt i with seed + i, as
        one at a time), the results in prompt order. `temperature`: one for every request, or a list
        (request i samples by `temperature[i]`: a batch mixing greedy and sampled requests)."""
        def one(i: int) -> SpecResult:
            return self.run(prompts[i], max_new_tokens, depth, request_sampling(temperature, i), seed + i)

        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eagle31-request") as pool:
            return ConcurrentRun(list(pool.map(one, range(len(prompts)))))


@dataclass
class BatchFigures:
    """How many requests the runtime really ran together during one level, as measured there (never
    computed from C): our batched runtimes count every backend call they made; a vLLM engine is
    sampled (its `vllm:num_requests_running` gauge) while the level runs."""

    source: str  # how it was measured, in words ("backend calls", "/metrics samples")
    histogram: dict[int, int]  # batch size -> calls (or samples) of that size
    largest: int  # the most requests run together
    mean: float  # mean batch over every call (or every sample with a request running)
    steady_mean: float | None = None  # mean batch in steady state: prefills aside, while C requests were in flight
    steady_calls: int = 0  # the calls (or samples) steady_mean is over
    in_flight: int = 0  # the most requests in flight at once, as the runtime saw them
    # vLLM: the largest batch its exact counters prove (ceil of rounds over engine steps: a mean the largest
    # step reaches at least), beside the largest the sampled gauge saw; `largest` is the larger of the two
    sampled_largest: int | None = None
    counted_largest: int | None = None

    def to_json(self) -> dict:
        return {"source": self.source, "histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                "largest": self.largest, "mean": self.mean, "steady_mean": self.steady_mean,
                "steady_calls": self.steady_calls, "in_flight": self.in_flight,
                "sampled_largest": self.sampled_largest, "counted_largest": self.counted_largest}


@dataclass
class ConcurrentRun:
    """What `run_concurrently` saw: per-request results, and the runtime's own pooled acceptance
    counters over the whole run where it keeps them (vLLM's /metrics: rounds, accepted drafts,
    accepted per draft position), which per-request results must add up to; `batching`: how many
    requests it really ran together (None: the runtime cannot tell)."""

    results: list[SpecResult]
    pooled: dict | None = None
    per_request: bool = True  # False: the results carry tokens only; acceptance is known pooled
    batching: BatchFigures | None = None


class LoopSpeculator(Speculator):
    """The one speculation loop over a (TargetBackend, DrafterBackend) pair. The backends hold one
    sequence's caches, so concurrent runs take turns."""

    def __init__(self, name: str, target: TargetBackend, drafter: DrafterBackend, exact: bool = True):
        self.name, self.target, self.drafter, self.exact = name, target, drafter, exact
        self._turn = threading.Lock()

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        with self._turn:
            return speculate(self.target, self.drafter, list(prompt_ids), max_new_tokens, depth, temperature, seed,
                             tuple(stop_ids), observer)

    def replay(self, prompt_ids: list[int], run: SpecResult, observer: LoopObserver | None = None,
               follow: list[list[int]] | None = None) -> SpecResult:
        """This pair's drafts at another greedy run's round boundaries, with one target forward
        (`follow`: reference/replay.py, replay_greedy)."""
        with self._turn:
            return replay_greedy(self.target, self.drafter, list(prompt_ids), run, observer, follow)

    def replay_sampled(self, prompt_ids: list[int], run: SpecResult, sampling: Sampling,
                       follow: list[list[int]] | None = None) -> list[SampledRound]:
        """This pair along a sampled greedy-drafts run: its drafts and the target's probability of each
        (`follow`: reference/replay.py, replay_sampled)."""
        with self._turn:
            return replay_sampled(self.target, self.drafter, list(prompt_ids), run, sampling, follow)
