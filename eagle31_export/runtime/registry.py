"""The runtime registry: what the user gave (checkpoints, exported artifacts, a server URL) and a
runtime name become one `Speculator`. Every caller (speculate, parity, the demo, the Triton
model) goes through `load_speculator`; runtime names exist only in `RUNTIMES`.

Adding a runtime = one module with `load(source, options, workdir) -> Speculator` (and, if the
Triton `cpu` repository can serve it, `prepare_servable(pair_dir, target) -> artifacts`) plus one entry below.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from eagle31_export.errors import UserError
from eagle31_export.reference.replay import replay_greedy
from eagle31_export.reference.speculate import DrafterBackend, LoopObserver, SpecResult, TargetBackend, speculate


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
    nvfp4_semantics: str = "exact"  # NVFP4 targets: how stored scales are read (formats/nvfp4_scheme.NVFP4_SEMANTICS)
    kernels: str = "torch"  # reference drafter: plain torch or the plugin kernels
    chain: bool = False  # onnxruntime: draft with the exported chain graph
    threads: int | None = None
    device: str = "cpu"  # cpu, cuda or auto (resolve_device); where the reference target and drafter compute
    depth: int | None = None  # vllm: num_speculative_tokens of a local engine (None: the bundle's)
    vllm: str | None = None  # vllm: a python interpreter or virtual environment that has vLLM ($EAGLE31_VLLM)
    port: int | None = None  # vllm: the local engine's port on 127.0.0.1 (None: a free one)
    engine_timeout: float = 600.0  # vllm: seconds a local engine may take to become ready


DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str | None, runtime: str | None = None) -> str:
    """`cpu` or `cuda` for `--device NAME` (`auto`: cuda where torch sees a GPU, else cpu); refuses
    cuda where torch sees none, and on a runtime that computes on CPU only (`Runtime.devices`)."""
    name = (name or "cpu").lower()
    if name not in DEVICES:
        raise UserError(f"unknown --device {name!r}; choose one of {', '.join(DEVICES)}")
    devices = runtime_named(runtime).devices if runtime is not None else ("cpu", "cuda")
    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available and "cuda" in devices else "cpu"
    if name == "cuda" and not available:
        version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
        raise UserError(f"--device cuda: no CUDA device is visible to torch (torch {version}, CUDA build: "
                        f"{torch.version.cuda or 'no'}); use --device cpu")
    if name not in devices:
        raise UserError(f"--device {name}: --runtime {runtime} computes on {' or '.join(devices)} only in this "
                        f"process; use --device {devices[0]}, or --runtime reference")
    return name


class Speculator:
    """A runtime that generates with speculation; `exact` when it computes in fp32 end to end."""

    name: str = ""
    exact: bool = True
    reports_drafts = True  # False: the runtime returns tokens and acceptance counts, not its drafts (vLLM)
    rounds_in_order = True  # False: accepted counts per round are known as counts only, not in order
    serves_concurrently = False  # True: requests in flight together are served together (batched), not queued

    def close(self) -> None:
        """Release what the runtime holds outside this process (a server it started)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, prompt_ids: list[int], max_new_tokens: int, depth: int, temperature: float = 0.0, seed: int = 0,
            stop_ids: tuple[int, ...] = (), observer: LoopObserver | None = None) -> SpecResult:
        raise NotImplementedError

    def run_concurrently(self, prompts: list[list[int]], max_new_tokens: int, depth: int, concurrency: int,
                         temperature: float = 0.0, seed: int = 0) -> "ConcurrentRun":
        """Every prompt with `concurrency` requests in flight at a time (prompt i with seed + i, as
        one at a time), the results in prompt order."""
        def one(i: int) -> SpecResult:
            return self.run(prompts[i], max_new_tokens, depth, temperature, seed + i)

        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eagle31-request") as pool:
            return ConcurrentRun(list(pool.map(one, range(len(prompts)))))


@dataclass
class ConcurrentRun:
    """What `run_concurrently` saw: per-request results, and the runtime's own pooled acceptance
    counters over the whole run where it keeps them (vLLM's /metrics: rounds, accepted drafts,
    accepted per draft position), which per-request results must add up to."""

    results: list[SpecResult]
    pooled: dict | None = None
    per_request: bool = True  # False: the results carry tokens only; acceptance is known pooled


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

    def replay(self, prompt_ids: list[int], run: SpecResult, observer: LoopObserver | None = None) -> SpecResult:
        """This pair's drafts at another greedy run's round boundaries, with one target forward."""
        with self._turn:
            return replay_greedy(self.target, self.drafter, list(prompt_ids), run, observer)


@dataclass(frozen=True)
class Runtime:
    name: str
    help: str
    module: Callable[[], object]  # imported on use: runtimes pull in heavy libraries
    devices: tuple[str, ...] = ("cpu", "cuda")  # where it can compute (--device)
    # how the engine reads NVFP4 scales; parity's reference reads them the same way (NVFP4_SEMANTICS)
    nvfp4_semantics: str = "exact"

    def load(self, source: PairSource, options: LoadOptions = LoadOptions(),
             workdir: Path | None = None) -> Speculator:
        return self.module().load(source, options, workdir)

    @property
    def servable(self) -> bool:
        """Whether the Triton `cpu` repository can serve the pair on this runtime."""
        return hasattr(self.module(), "prepare_servable")

    def prepare_servable(self, pair_dir: Path, target: Path) -> Path | None:
        """Write what this runtime needs next to `pair_dir/drafter` (e.g. the ONNX graphs); returns
        the artifacts folder to pass back as `PairSource.artifacts`, or None."""
        return self.module().prepare_servable(pair_dir, target)


def _reference():
    from eagle31_export.runtime import reference_runtime

    return reference_runtime


def _onnxruntime():
    from eagle31_export.runtime import onnxruntime

    return onnxruntime


def _vllm():
    from eagle31_export.runtime import vllm_runtime

    return vllm_runtime


def _triton():
    from eagle31_export.runtime import triton_client

    return triton_client


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    Runtime("reference", "the PyTorch reference over checkpoints", _reference),
    # ONNX Runtime runs here with its CPUExecutionProvider only
    Runtime("onnxruntime", "the exported ONNX graphs on ONNX Runtime (CPU)", _onnxruntime, ("cpu",)),
    # the server decides where it computes; this process only sends requests
    Runtime("triton", "a running Triton server (--url HOST:PORT)", _triton, ("cpu",)),
    # the engine decides where it computes (its own build: CPU or GPU); this process sends requests
    Runtime("vllm", "a real vLLM engine: a server at --url, or one started locally from --vllm VENV over a "
                    "bundle of `export vllm`", _vllm, ("cpu",), nvfp4_semantics="vllm"),
)}

DEFAULT_SERVING_RUNTIME = "onnxruntime"  # what the Triton `cpu` repository runs unless told otherwise


def runtime_named(name: str) -> Runtime:
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UserError(f"unknown --runtime {name!r}; choose one of {', '.join(RUNTIMES)}") from None


def load_speculator(name: str, source: PairSource, options: LoadOptions = LoadOptions(),
                    workdir: str | os.PathLike | None = None) -> Speculator:
    """The speculator for runtime `name` over `source`. `workdir`: where a runtime may write what it
    derives on the fly (the caller owns and removes it). `options.device` is resolved here, once."""
    runtime = runtime_named(name)
    options = replace(options, device=resolve_device(options.device, name))
    return runtime.load(source, options, Path(workdir) if workdir is not None else None)
