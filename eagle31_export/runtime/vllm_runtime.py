"""The `vllm` runtime: a real vLLM engine runs the speculation loop; we send token ids and read back
the tokens and vLLM's own acceptance counts (docs/runtimes.md, "vLLM").

Two ways in:
- `--url http://HOST:PORT`: any running vLLM OpenAI-compatible server (GPU included);
- a local engine: `python -m vllm.entrypoints.openai.api_server` started from the vLLM environment the
  user names (`--vllm VENV`), over an `export vllm` bundle (or one exported on the fly from
  `--drafter`/`--target`), bound to 127.0.0.1, with the arguments that make the comparison exact:
  the requested dtype (fp32: exact), the requested depth as `num_speculative_tokens`, eager mode,
  token ids in and out, and per-request acceptance of every verification step. Stopped on `close()`.

vLLM does not report its drafts, so parity compares tokens, the accepted count of every round and the
per-position counts (`reports_drafts` is False).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.reference.speculate import SpecResult, replay_rounds
from eagle31_export.runtime.contract import ConcurrentRun, LoadOptions, PairSource, Speculator
from eagle31_export.runtime.vllm_client import Completion, SpecCounters, VllmClient
from eagle31_export.runtime.vllm_engine import CPU_NVFP4_PLUGIN, LocalServer, VllmInstall, find_vllm

_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # model.layers.1.mlp.experts.7.gate_proj

MAX_MODEL_LEN = 4096  # the engine's context; enough for parity's prompts, small enough for a 1 GiB KV cache
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VllmSpeculator(Speculator):
    name = "vllm"
    reports_drafts = False  # vLLM returns tokens and acceptance counts, not its drafts
    serves_concurrently = True  # the engine schedules the requests in flight as one batch

    def __init__(self, client: VllmClient, exact: bool, server: LocalServer | None = None,
                 cleanup: Path | None = None):
        self.client, self.exact, self.server = client, exact, server
        self.rounds_in_order = True  # False once a server answers without per-step acceptance
        self._finalizer = weakref.finalize(self, _shutdown, server, cleanup)

    @property
    def url(self) -> str:
        return self.client.url

    def close(self) -> None:
        self._finalizer()

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        before = self._counters()
        done = self.client.complete(list(prompt_ids), max_new_tokens, temperature, seed, tuple(stop_ids))
        counts = self._counters() - before
        result = SpecResult(done.tokens, [], self._accepted_per_step(done, counts, depth), depth)
        if observer is not None:
            replay_rounds(result, observer)
        return result

    def run_concurrently(self, prompts, max_new_tokens, depth, concurrency, temperature=0.0, seed=0) -> ConcurrentRun:
        """Every prompt with `concurrency` requests in flight. Each request's rounds come from its own
        response (vLLM's per-request metrics); the /metrics counters, read before and after the whole
        run, are the engine's pooled view, which those must add up to (parity/concurrency.py)."""
        def one(i: int) -> Completion:
            return self.client.complete(list(prompts[i]), max_new_tokens, temperature, seed + i, ())

        before = self._counters()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eagle31-vllm") as pool:
            done = list(pool.map(one, range(len(prompts))))
        pooled = self._counters() - before
        self._check_depth(next((d.spec_metrics for d in done if d.spec_metrics), None), pooled, depth)
        per_request = all("per_step_accepted" in (d.spec_metrics or {}) for d in done)
        results = [SpecResult(d.tokens, [], [int(a) for a in d.spec_metrics["per_step_accepted"]] if per_request else [],
                              depth) for d in done]
        counters = {"rounds": pooled.drafts, "accepted": pooled.accepted_tokens,
                    "accepted_per_position": (pooled.accepted_per_position + [0] * depth)[:depth]}
        return ConcurrentRun(results, counters, per_request)

    def _check_depth(self, spec: dict | None, counts: SpecCounters, depth: int) -> None:
        spec = spec or {}
        served_depth = spec.get("num_spec_tokens") or (counts.draft_tokens // counts.drafts if counts.drafts else None)
        if served_depth is not None and served_depth != depth:
            raise UserError(f"the vLLM server at {self.url} drafts {served_depth} tokens per round; run with --depth "
                            f"{served_depth} (or start it with num_speculative_tokens {depth})")

    def _counters(self) -> SpecCounters:
        counters = self.client.spec_counters()
        if counters is None:
            raise UserError(f"vLLM server at {self.url} reports no speculative decoding counters on /metrics: start "
                            "it with --speculative-config (see the bundle's README.md)")
        return counters

    def _accepted_per_step(self, done: Completion, counts: SpecCounters, depth: int) -> list[int]:
        """Every round's accepted count: in order from the response's per-request metrics where the
        server fills them, checked against the /metrics deltas; otherwise rebuilt from the deltas
        (the right counts per position, in no particular order)."""
        spec = done.spec_metrics or {}
        self._check_depth(spec, counts, depth)
        from_counts = accepted_from_counts(counts, depth)
        if "per_step_accepted" not in spec:
            self.rounds_in_order = False
            return from_counts
        steps = [int(a) for a in spec["per_step_accepted"]]
        if sorted(steps, reverse=True) != from_counts:
            raise UserError(f"vLLM server at {self.url}: its /metrics counters moved by more than this request "
                            f"(per-request {sorted(steps, reverse=True)} vs counters {from_counts}); is another "
                            "client using it? parity sends one request at a time")
        return steps


def accepted_from_counts(counts: SpecCounters, depth: int) -> list[int]:
    """Accepted counts per round, largest first, from the per-position counters: a chain accepts a
    prefix, so exactly c[j-1] - c[j] rounds accepted j drafts (c[-1] = all rounds)."""
    per_position = (counts.accepted_per_position + [0] * depth)[:depth]
    bounds = [counts.drafts, *per_position, 0]
    out: list[int] = []
    for accepted in range(depth, -1, -1):
        out += [accepted] * (bounds[accepted] - bounds[accepted + 1])
    return out


def _shutdown(server: LocalServer | None, cleanup: Path | None) -> None:
    if server is not None:
        server.stop()
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)


def load(source: PairSource, options: LoadOptions = LoadOptions(), workdir: Path | None = None) -> VllmSpeculator:
    if options.chain:
        raise UserError("--chain applies to --runtime onnxruntime")
    exact = options.dtype in (torch.float32, torch.float64)
    if source.url:
        return VllmSpeculator(VllmClient(source.url), exact)
    if source.capture is not None:
        raise UserError("--runtime vllm runs the target itself: give --target (or a bundle), not --capture")
    install = find_vllm(options.vllm)
    own = None if workdir is not None else Path(tempfile.mkdtemp(prefix="eagle31-vllm-"))
    try:
        bundle = _bundle(source, workdir or own, options.depth)
        record = _checked_record(bundle, install)
        server = LocalServer(install, engine_args(record, options), workdir or own, port=options.port,
                             ready_timeout=options.engine_timeout)
        server.start()
    except BaseException:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        raise
    return VllmSpeculator(VllmClient(server.url), exact, server, own)


def _bundle(source: PairSource, workdir: Path, depth: int | None) -> Path:
    """The `export vllm` bundle given, or one exported now from --drafter / --target."""
    if source.artifacts is not None:
        if not (source.artifacts / "bundle.json").is_file():
            raise UserError(f"{source.artifacts}: not a vLLM bundle (no bundle.json); write one with "
                            "`eagle31-export export vllm`, or pass --drafter and --target")
        return source.artifacts
    if source.drafter is None or source.target is None:
        raise UserError("--runtime vllm needs a bundle (`export vllm`), --drafter and --target, or --url of a server")
    from eagle31_export.export.vllm import export_vllm

    return export_vllm(source.drafter, source.target, workdir / "vllm-bundle", num_speculative_tokens=depth or 3)


def _checked_record(bundle: Path, install: VllmInstall) -> dict:
    """The bundle's record, refused in one line where this vLLM would drop a drafter flag or has no
    kernel for the target's weights."""
    from eagle31_export.export.bundle import read_bundle
    from eagle31_export.export.capabilities import check_runtime, target_quant_format

    record = read_bundle(bundle)
    if record["kind"] != "vllm":
        raise UserError(f"{bundle}: a {record['kind']} bundle; --runtime vllm runs `export vllm` bundles")
    needs = record.get("runtime_requirements") or {}
    if needs.get("runtime"):
        check_runtime(needs["runtime"], needs.get("features", []), install.version)
    quant = target_quant_format(record["target"])
    if quant is not None and install.cpu_build:
        _check_cpu_nvfp4(record["target"], quant, install)
    return record


def _check_cpu_nvfp4(target: str, quant: str, install: VllmInstall) -> None:
    """vLLM's CPU build runs NVFP4 Linears through our plugin only, and NVFP4 routed experts not at all:
    every NVFP4 MoE backend of vLLM 0.32 needs a CUDA, ROCm or XPU device
    (vllm/model_executor/layers/fused_moe/oracle/nvfp4.py; docs/nvfp4-engines.md)."""
    from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint

    experts = sorted(n for n in NVFP4Checkpoint.open(target).linears if _ROUTED_EXPERT.search(n))
    if experts:
        layer = _ROUTED_EXPERT.split(experts[0])[0] + ".experts"
        raise UserError(f"{install.describe()} (vLLM's CPU build) has no NVFP4 MoE backend, and {layer} of the "
                        f"{quant} target holds NVFP4 routed experts ({len(experts)} Linears): serve it on a GPU "
                        "vLLM and pass --url (docs/nvfp4-engines.md)")
    if CPU_NVFP4_PLUGIN not in install.plugins:
        raise UserError(f"{install.describe()} (vLLM's CPU build) lists no NVFP4 kernel for the {quant} target: "
                        f"install our vLLM plugin into that environment (pip install --no-deps plugins/vllm; "
                        "`make setup-vllm` does), or run against a vLLM on a GPU with --url (docs/runtimes.md)")


def engine_args(record: dict, options: LoadOptions, speculative: bool = True) -> list[str]:
    """The server arguments that make the comparison exact. `speculative` False: the same engine over
    the target alone (the baseline a speed-up is measured against)."""
    from eagle31_export.formats.target.checkpoint import read_target_info

    depth = options.depth or int(record["max_draft_len"])
    spec = {"method": "eagle3", "model": record["drafter"], "num_speculative_tokens": depth}
    dtype = VLLM_DTYPES.get(options.dtype)
    if dtype is None:
        raise UserError(f"--runtime vllm computes in {', '.join(VLLM_DTYPES.values())}; not {options.dtype}")
    context = min(MAX_MODEL_LEN, read_target_info(record["target"]).max_position_embeddings or MAX_MODEL_LEN)
    speculation = (["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
                   if speculative else [])
    return ["--model", record["target"], "--served-model-name", "target", *speculation,
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(context), "--seed", "0",
            "--generation-config", "vllm", "--skip-tokenizer-init", "--tensor-parallel-size", "1",
            "--distributed-executor-backend", "uni"]
