"""The `vllm` runtime: a real vLLM engine runs the speculation loop; we send token ids and read back
the tokens and vLLM's own acceptance counts (docs/runtimes.md, "vLLM").

Two ways in:
- `--url http://HOST:PORT`: any running vLLM OpenAI-compatible server (GPU included); what it computes
  in is read from its /server_info where it tells (vLLM's development endpoints), else as stated with
  --runtime-dtype (`served_dtype`);
- a local engine: `python -m vllm.entrypoints.openai.api_server` started from the vLLM environment the
  user names (`--vllm VENV`), over an `export vllm` bundle (or one exported on the fly from
  `--drafter`/`--target`), bound to 127.0.0.1, with the arguments that make the comparison exact:
  the requested dtype (fp32: exact), the requested depth as `num_speculative_tokens`, eager mode,
  token ids in and out, and per-request acceptance of every verification step. Stopped on `close()`.

vLLM does not report its drafts. A local engine with our vLLM plugin logs them (runtime/vllm_drafts.py),
and parity compares every draft as it does on our runtimes; a server at --url is compared on tokens,
the accepted count of every round and the per-position counts (`reports_drafts` False).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.reference.speculate import SpecResult, replay_rounds
from eagle31_export.runtime.contract import (
    BatchFigures, ConcurrentRun, LoadOptions, PairSource, Speculator, request_sampling,
)
from eagle31_export.runtime.vllm_client import Completion, EngineMetrics, RunningSampler, SpecCounters, VllmClient
from eagle31_export.runtime.vllm_drafts import DRAFT_LOG_PLUGIN, HOW as DRAFTS_HOW, DraftLog
from eagle31_export.runtime.vllm_engine import CPU_NVFP4_PLUGIN, LocalServer, VllmInstall, find_vllm

_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # model.layers.1.mlp.experts.7.gate_proj

MAX_MODEL_LEN = 4096  # the engine's context; enough for parity's prompts, small enough for a 1 GiB KV cache
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VllmSpeculator(Speculator):
    name = "vllm"
    serves_concurrently = True  # the engine schedules the requests in flight as one batch

    def __init__(self, client: VllmClient, exact: bool, server: LocalServer | None = None,
                 cleanup: Path | None = None, runtime_dtype: dict | None = None, draft_log: DraftLog | None = None):
        self.client, self.exact, self.server = client, exact, server
        metrics = client.metrics()
        # what our vLLM plugin found of each thing it patches; `unknown` where it did not recognise it
        self.engine_sampler = engine_sampler(metrics)  # what its sampler is, as our plugin found it
        self.engine_chunk_tail = engine_chunk_tail(metrics)  # its drafter at a prefill chunk's end, likewise
        self.engine_draft_log = engine_draft_log(metrics, draft_log is not None)
        self.engine_nvfp4 = engine_nvfp4(metrics)
        if self.engine_draft_log.get("unknown"):
            draft_log = None  # the plugin did not wrap this scheduler: nothing is logged, counts are compared
        # vLLM returns tokens and acceptance counts; its drafts only where our plugin logs them (a local engine).
        # `engine_state` is what parity reads back after the run (the speculator itself may be released):
        # drafts_source, drafts_reported (False once a request's logged drafts are refused) and unknown
        self.draft_log = draft_log
        self.engine_state = {"drafts_reported": draft_log is not None,
                             "drafts_source": DRAFTS_HOW if draft_log is not None else (
                                 self.engine_draft_log["state"] if self.engine_draft_log.get("unknown") else None),
                             "unknown": [f"{what}: {state['unknown']}" for what, state in (
                                 ("the CPU sampler's expand shim", self.engine_sampler),
                                 ("the EAGLE drafter at a prefill chunk's end", self.engine_chunk_tail),
                                 ("the draft log", self.engine_draft_log),
                                 ("NVFP4 linear kernels on the CPU", self.engine_nvfp4)) if state.get("unknown")]}
        # what the engine computes in, and how we know: {"dtype", "basis": set | observed | stated, "how"}
        self.runtime_dtype = runtime_dtype
        names = {name: dtype for dtype, name in VLLM_DTYPES.items()}
        self.compute_dtype = names.get((runtime_dtype or {}).get("dtype"), torch.float32 if exact else torch.bfloat16)
        self.rounds_in_order = True  # False once a server answers without per-step acceptance
        self._finalizer = weakref.finalize(self, _shutdown, server, cleanup)

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def reports_drafts(self) -> bool:
        return self.engine_state["drafts_reported"]

    @property
    def drafts_source(self) -> str | None:
        return self.engine_state["drafts_source"]

    def sampling_rule(self, requested: str | None) -> tuple[str, str]:
        """vLLM 0.32 drafts by argmax unless started with draft_sample_method "probabilistic", whose draft
        probabilities it never reports (nothing to compare with); a local engine of ours drafts greedily,
        a server at --url is asked (/server_info) or taken at --sampling-rule's word."""
        if requested not in (None, "greedy-drafts"):
            raise UserError(f"--sampling-rule {requested}: vLLM samples by greedy-drafts (its drafts are the drafter's "
                            "argmax; draft_sample_method greedy, its default); drop --sampling-rule")
        if self.server is not None:
            return "greedy-drafts", ("set: the local engine this run started drafts greedily (draft_sample_method "
                                     "greedy, vLLM's default)")
        method = self.client.draft_sample_method()
        if method == "greedy":
            return "greedy-drafts", "observed: the server's /server_info (speculative_config.draft_sample_method greedy)"
        if method is not None:
            raise UserError(f"the vLLM server at {self.url} drafts by draft_sample_method {method!r} (its /server_info): "
                            "its draft probabilities are not reported, so its sampling cannot be compared; serve it "
                            "with the default greedy drafts")
        if requested is None:
            raise UserError(f"--url {self.url}: the vLLM server does not say how it drafts (its /server_info answers "
                            "only with VLLM_SERVER_DEV_MODE=1); pass --sampling-rule greedy-drafts if it was started "
                            "without draft_sample_method probabilistic")
        return "greedy-drafts", "stated with --sampling-rule greedy-drafts, not observed: the server does not tell"

    def close(self) -> None:
        self._finalizer()

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        before = self._counters()
        name = self.draft_log.new_request_id() if self.draft_log else None
        done = self.client.complete(list(prompt_ids), max_new_tokens, temperature, seed, tuple(stop_ids), name)
        counts = self._counters() - before
        accepted = self._accepted_per_step(done, counts, depth)
        result = SpecResult(done.tokens, self._drafts(name, accepted, done.spec_metrics), accepted, depth)
        if observer is not None:
            replay_rounds(result, observer)
        return result

    def run_concurrently(self, prompts, max_new_tokens, depth, concurrency, temperature=0.0, seed=0) -> ConcurrentRun:
        """Every prompt with `concurrency` requests in flight. Each request's rounds come from its own
        response (vLLM's per-request metrics); the /metrics counters, read before and after the whole
        run, are the engine's pooled view, which those must add up to (parity/concurrency.py), with
        its prefix-cache lookups and engine steps over the run. Above one request in flight, the
        engine's `vllm:num_requests_running` is sampled throughout (`batching`): how many requests
        its steps really ran together."""
        sampler = RunningSampler(self.client) if concurrency > 1 else None
        # the first `concurrency` requests leave together, as a serving front end's burst does: on a busy
        # machine, threads started one by one let short requests finish before the last one is sent
        opening = threading.Barrier(min(concurrency, len(prompts)))

        names = [self.draft_log.new_request_id() if self.draft_log else None for _ in prompts]

        def one(i: int) -> Completion:
            with sampler.request() if sampler else contextlib.nullcontext():
                if i < opening.parties:
                    _wait(opening)
                return self.client.complete(list(prompts[i]), max_new_tokens, request_sampling(temperature, i),
                                            seed + i, (), names[i])

        before = self._metrics()
        with sampler or contextlib.nullcontext():
            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eagle31-vllm") as pool:
                done = list(pool.map(one, range(len(prompts))))
        after = self._metrics()
        pooled = after.spec - before.spec
        self._check_depth(next((d.spec_metrics for d in done if d.spec_metrics), None), pooled, depth)
        per_request = all("per_step_accepted" in (d.spec_metrics or {}) for d in done)
        accepted = [[int(a) for a in d.spec_metrics["per_step_accepted"]] if per_request else [] for d in done]
        results = [SpecResult(d.tokens, self._drafts(name, steps, d.spec_metrics) if per_request else [], steps, depth)
                   for d, name, steps in zip(done, names, accepted)]
        if not self.reports_drafts:  # a request's drafts refused: none of this run's are compared
            results = [replace(r, drafts=[]) for r in results]
        counters = {"rounds": pooled.drafts, "accepted": pooled.accepted_tokens,
                    "accepted_per_position": (pooled.accepted_per_position + [0] * depth)[:depth],
                    **engine_deltas(before, after)}
        batching = batch_figures(sampler, min(concurrency, len(prompts)), counters) if sampler else None
        return ConcurrentRun(results, counters, per_request, batching)

    def _drafts(self, name: str | None, accepted: list[int], spec: dict | None = None) -> list[list[int]]:
        """The request's drafts, round by round, from the engine's draft log, checked against what its
        response says of them (`spec`: per_step_drafted, num_spec_tokens); [] where none is kept. A
        request whose logged drafts are placeholders (vLLM's async scheduler) stops the drafts of this
        engine being reported at all: from here on parity compares counts only, and says why."""
        if self.draft_log is None or not self.reports_drafts:
            return []
        spec = spec or {}
        drafts = self.draft_log.take(name, accepted, spec.get("per_step_drafted"), spec.get("num_spec_tokens"))
        if drafts is None:
            self.engine_state.update(drafts_reported=False, drafts_source=f"not reported: {self.draft_log.refused}")
            return []
        return drafts

    def _metrics(self) -> EngineMetrics:
        metrics = self.client.metrics()
        if metrics.spec is None:
            raise UserError(f"vLLM server at {self.url} reports no speculative decoding counters on /metrics: start "
                            "it with --speculative-config (see the bundle's README.md)")
        return metrics

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


UPSTREAM_SAMPLER_ISSUE = "vllm#55005"
SAMPLER_STATES = {  # our plugin's gauge labels (shim, sampler) -> what the report says of the engine's sampler
    ("broken", "fixed_by_plugin"): f"shipped shim broken ({UPSTREAM_SAMPLER_ISSUE}), fixed by the plugin",
    ("correct", "as_shipped"): "not broken",
    ("none", "as_shipped"): "not broken (this build runs no CPU expand shim: vLLM's own Triton kernel)",
    ("broken", "left_as_shipped"): f"left as shipped: shipped shim broken ({UPSTREAM_SAMPLER_ISSUE})",
}
SAMPLER_HOW = ("the server's /metrics (eagle31_vllm_cpu_sampler, set by our vLLM plugin, which calls vLLM's CPU "
               "expand_kernel shim on a small tensor in every process)")


def engine_sampler(metrics: EngineMetrics) -> dict:
    """What the engine's rejection sampler is, as our vLLM plugin found it and left it: {"state",
    "broken" (True: it samples with per-token parameters that are not the request's; None: not known),
    "how"}. vLLM 0.32's CPU build expands them through a broken shim (vllm#55005;
    plugins/vllm/eagle31_vllm_plugin/cpu_sampler.py), which the plugin replaces unless told not to."""
    return plugin_state(metrics.sampler_plugin, ("shim", "sampler"), SAMPLER_STATES, (("broken", "left_as_shipped"),),
                        SAMPLER_HOW, "unknown: the server runs without our vLLM plugin's sampler check (no "
                        "eagle31_vllm_cpu_sampler on /metrics; vLLM's CPU build up to 0.32 has a broken expand shim, "
                        f"{UPSTREAM_SAMPLER_ISSUE}: install plugins/vllm)")


NOT_RECOGNISED = "not_recognised"  # plugins/vllm/eagle31_vllm_plugin/outcome.py: NOT_RECOGNISED


def plugin_state(labels: dict | None, names: tuple[str, ...], states: dict, broken: tuple[tuple[str, ...], ...],
                 how: str, unknown: str | None) -> dict:
    """{"state", "broken", "how", "unknown"} from one of our plugin's state gauges: its labels `names`
    read through `states`; `broken` True for the `broken` labels. None (and `unknown` said) where the
    server publishes no such gauge. Where the plugin did not recognise what it patches (a label
    NOT_RECOGNISED), or says labels `states` does not list (another version of the plugin), the
    state is "unknown on vLLM X.Y (reason)", `broken` None and `unknown` that line: never healthy."""
    if labels is None:
        return {"state": unknown, "broken": None, "how": how, "unknown": None}
    key = tuple(labels.get(name) for name in names)
    version = labels.get("vllm") or "?"
    if NOT_RECOGNISED in key or key not in states:
        said = (labels.get("reason") or "no reason given") if NOT_RECOGNISED in key else (
            "labels this runtime does not know: " + ", ".join(f"{n} {v}" for n, v in zip(names, key)))
        line = f"unknown on vLLM {version} ({said}): left as shipped"
        return {"state": line, "broken": None, "how": how, "unknown": line}
    return {"state": states[key], "broken": key in broken, "how": how, "unknown": None}


CHUNK_TAIL_STATES = {  # our plugin's gauge labels (shipped, drafter) -> what the report says
    ("last_prompt_token", "fixed_by_plugin"): "the next prompt token (shipped: the prompt's last token; fixed by the "
                                               "plugin)",
    ("last_prompt_token", "left_as_shipped"): "the prompt's last token: left as shipped",
    ("last_prompt_token", "fix_found_no_runner"): "the prompt's last token: the plugin's fix found no model runner "
                                                   "when it ran, so the shipped choice stood",
}
CHUNK_TAIL_HOW = ("the server's /metrics (eagle31_vllm_eagle_chunk_tail, set by our vLLM plugin, which calls vLLM's "
                  "prepare_next_token_ids_padded on one partial prefill in every process)")


def engine_chunk_tail(metrics: EngineMetrics) -> dict:
    """Which token the engine's EAGLE drafter reads at the end of a prefill chunk that is not a prompt's
    last, as our vLLM plugin found and left it: {"state", "broken" (True: the prompt's last token, so
    drafts after a chunked prefill are off; None: not known), "how"}
    (plugins/vllm/eagle31_vllm_plugin/chunk_tail.py)."""
    return plugin_state(metrics.chunk_tail_plugin, ("shipped", "drafter"), CHUNK_TAIL_STATES,
                        (("last_prompt_token", "left_as_shipped"), ("last_prompt_token", "fix_found_no_runner")),
                        CHUNK_TAIL_HOW,
                        "unknown: the server runs without our vLLM plugin's check (no eagle31_vllm_eagle_chunk_tail on "
                        "/metrics; vLLM 0.32's padded drafter batch reads the prompt's last token there: install "
                        "plugins/vllm)")


DRAFT_LOG_STATES = {("logging",): "logged by our vLLM plugin in vLLM's scheduler"}
DRAFT_LOG_HOW = ("the server's /metrics (eagle31_vllm_draft_log, set by our vLLM plugin, which reads the signatures "
                 "of vLLM's Scheduler.make_spec_decoding_stats and update_from_output and SchedulerOutput's fields "
                 "before it wraps them)")


def engine_draft_log(metrics: EngineMetrics, asked: bool) -> dict:
    """Whether our vLLM plugin logs the drafts of the engine's scheduler: {"state", "broken", "how",
    "unknown"}; `unknown` where it did not recognise the scheduler and logs nothing (`asked`: the
    engine was started with the draft log's folder; a server that publishes no gauge says nothing)."""
    state = plugin_state(metrics.draft_log_plugin, ("log",), DRAFT_LOG_STATES, (), DRAFT_LOG_HOW, None)
    if state["unknown"]:
        state["state"] = f"not reported: our vLLM plugin's draft log is {state['unknown']}; compared on counts only"
    elif metrics.draft_log_plugin is None:
        state["state"] = "not published by the server" if asked else "not asked for"
    return state


NVFP4_STATES = {("emulation_listed_by_plugin",): "vLLM's EmulationNvFp4LinearKernel, listed by our plugin",
                ("vllm_own",): "vLLM's own CPU kernels (the plugin lists none)"}
NVFP4_HOW = ("the server's /metrics (eagle31_vllm_cpu_nvfp4, set by our vLLM plugin, which reads vLLM's "
             "_POSSIBLE_NVFP4_KERNELS)")


def engine_nvfp4(metrics: EngineMetrics) -> dict:
    """Which NVFP4 linear kernels vLLM's CPU build lists, as our plugin found and left them; `unknown`
    where it did not recognise vLLM's private kernel list (nothing listed; an NVFP4 target fails to load)."""
    return plugin_state(metrics.nvfp4_plugin, ("kernels",), NVFP4_STATES, (), NVFP4_HOW, None)


def _wait(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(timeout=60)
    except threading.BrokenBarrierError:  # a thread that never came: send anyway, the figures will show it
        pass


BATCH_SOURCE = "/metrics samples of vllm:num_requests_running"
COUNTED_SOURCE = "; largest also from the engine's counters (at least ceil(rounds / engine steps))"


def batch_figures(sampler: RunningSampler, level: int, counters: dict | None = None) -> BatchFigures | None:
    """The batch sizes a level's samples saw (parity/concurrency.py fails a level whose largest is 1).
    `mean`: over samples with a request running; `steady_mean`: over samples read while this client
    had all `level` requests in flight. Samples are sparse on a busy machine, so `largest` is also
    held against the engine's exact counters: rounds over engine steps is the mean number of requests
    a step verified, and some step verified at least its ceiling. None where the server has no such
    gauge or /metrics failed."""
    if sampler.missing or sampler.error or not sampler.samples:
        return None
    counted = _counted_largest(counters or {})
    busy = [s.running for s in sampler.samples if s.running >= 1]
    steady = [s.running for s in sampler.samples if s.running >= 1 and min(s.in_flight) >= level]
    histogram: dict[int, int] = {}
    for size in busy:
        histogram[size] = histogram.get(size, 0) + 1
    sampled = max(busy, default=0)
    return BatchFigures(source=BATCH_SOURCE + (COUNTED_SOURCE if counted else ""), histogram=histogram,
                        largest=max(sampled, counted or 0), mean=sum(busy) / len(busy) if busy else 0.0,
                        steady_mean=sum(steady) / len(steady) if steady else None, steady_calls=len(steady),
                        in_flight=sampler.most_in_flight, sampled_largest=sampled, counted_largest=counted)


def _counted_largest(counters: dict) -> int | None:
    rounds, steps = counters.get("rounds"), counters.get("engine_steps")
    return math.ceil(rounds / steps) if rounds and steps else None


def engine_deltas(before: EngineMetrics, after: EngineMetrics) -> dict:
    """What else the engine counted over a run: tokens looked up in and served from its prefix cache,
    engine steps (rounds / engine_steps: requests verified per step), and whether (and in blocks of
    how many tokens) it caches prefixes at all (vllm:cache_config_info); None where it does not say."""
    delta = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
    info = after.cache_info
    enabled = {"True": True, "False": False}.get(info.get("enable_prefix_caching", ""))
    block = info.get("block_size", "")
    return {"prefix_cache_hits": delta(after.prefix_cache_hits, before.prefix_cache_hits),
            "prefix_cache_queries": delta(after.prefix_cache_queries, before.prefix_cache_queries),
            "engine_steps": delta(after.steps, before.steps),
            "prefix_caching": enabled, "cache_block_size": int(block) if block.isdigit() else None}


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
    if source.url:
        if options.max_num_batched_tokens:
            raise UserError("--max-num-batched-tokens sets a local engine's step; a server at --url schedules by its "
                            "own (start it with --max-num-batched-tokens), so drop one of the two")
        client = VllmClient(source.url)
        served = served_dtype(client, options.dtype)
        draft_log = DraftLog(options.draft_log, served=True) if options.draft_log else None
        return VllmSpeculator(client, served["dtype"] == "float32", runtime_dtype=served, draft_log=draft_log)
    exact = options.dtype in (torch.float32, torch.float64)
    if source.capture is not None:
        raise UserError("--runtime vllm runs the target itself: give --target (or a bundle), not --capture")
    install = find_vllm(options.vllm)
    own = None if workdir is not None else Path(tempfile.mkdtemp(prefix="eagle31-vllm-"))
    try:
        bundle = _bundle(source, workdir or own, options.depth)
        record = _checked_record(bundle, install)
        if options.draft_log and DRAFT_LOG_PLUGIN not in install.plugins:
            raise UserError(f"--draft-log: {install.describe()} has no draft-log plugin: install ours into that "
                            "environment (pip install --no-deps plugins/vllm; `make setup-vllm` does)")
        draft_log = (DraftLog(options.draft_log or (workdir or own) / "drafts")
                     if DRAFT_LOG_PLUGIN in install.plugins else None)
        server = LocalServer(install, engine_args(record, options), workdir or own, port=options.port,
                             ready_timeout=options.engine_timeout, env=draft_log.env if draft_log else None)
        server.start()
    except BaseException:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        raise
    dtype = VLLM_DTYPES[options.dtype]  # engine_args refused any other
    how = f"the local engine this run started with --dtype {dtype}"
    return VllmSpeculator(VllmClient(server.url), exact, server, own, {"dtype": dtype, "basis": "set", "how": how},
                          draft_log)


DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # vLLM's names -> --runtime-dtype's


def served_dtype(client: VllmClient, stated: torch.dtype | None) -> dict:
    """What a running server computes in: observed where it tells (its /server_info), else as stated
    with --runtime-dtype (`stated` None: not given, refused then). A statement the server contradicts,
    its dtype or a KV cache of another dtype (vllm:cache_config_info cache_dtype), is refused."""
    said = None if stated is None else VLLM_DTYPES.get(stated)
    if stated is not None and said is None:
        raise UserError(f"--runtime vllm computes in {', '.join(DTYPE_NAMES.values())}; not {stated}")
    observed = client.served_dtype()
    flag = lambda name: DTYPE_NAMES.get(name, name)  # noqa: E731
    if observed is not None and said is not None and observed != said:
        raise UserError(f"--runtime-dtype {flag(said)}: the vLLM server at {client.url} computes in {observed} (its "
                        f"/server_info, model_config.dtype); pass --runtime-dtype {flag(observed)}, or none")
    dtype = observed or said
    if dtype is None:
        raise UserError(f"--url {client.url}: the vLLM server does not say what dtype it computes in (its /server_info "
                        "answers only with VLLM_SERVER_DEV_MODE=1); pass --runtime-dtype fp32 or bf16, as it was "
                        "started (--dtype)")
    kv = client.metrics().cache_info.get("cache_dtype", "auto")
    if dtype == "float32" and kv not in ("auto", "float32"):
        raise UserError(f"--runtime-dtype fp32: the vLLM server at {client.url} keeps its KV cache in {kv} "
                        "(vllm:cache_config_info cache_dtype), so it does not compute exactly in fp32; pass "
                        "--runtime-dtype bf16")
    if observed is not None:
        return {"dtype": dtype, "basis": "observed", "how": f"the server's /server_info (model_config.dtype: {dtype})"}
    return {"dtype": dtype, "basis": "stated", "how": f"stated with --runtime-dtype {flag(dtype)}, not observed: the "
            "server does not tell (its /server_info answers only with VLLM_SERVER_DEV_MODE=1)"}


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
    wanted = max(MAX_MODEL_LEN, options.max_context or 0)
    context = min(wanted, read_target_info(record["target"]).max_position_embeddings or wanted)
    speculation = (["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
                   if speculative else [])
    return ["--model", record["target"], "--served-model-name", "target", *speculation,
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(context), "--seed", "0",
            "--generation-config", "vllm", "--skip-tokenizer-init", "--tensor-parallel-size", "1",
            "--distributed-executor-backend", "uni",
            *(["--max-num-batched-tokens", str(options.max_num_batched_tokens)] if options.max_num_batched_tokens
              else [])]


EMULATION_KERNEL = ("vLLM's EmulationNvFp4LinearKernel (vllm/model_executor/kernels/linear/nvfp4/emulation.py), "
                    "which our plugin lists for the CPU build: it quantizes a Linear's input to FP4 wherever the "
                    "checkpoint gives it an input scale")


def served_activations(target: Path, url: str | None, stated: bool | None, vllm: str | None) -> dict | None:
    """Whether the engine feeds FP4 activations to the target's NVFP4 Linears, and how that is known:
    {"fp4", "basis", "how"}; None for a target without NVFP4 weights (and no statement). A local engine
    on vLLM's CPU build computes what the target's quantization config declares (EMULATION_KERNEL),
    which a contrary --act-quant / --no-act-quant cannot change: refused. A server at --url may run
    NVFP4 weight-only where its GPU has no FP4 GEMMs (Marlin), which it does not report: the config is
    followed unless stated otherwise."""
    from eagle31_export.formats.nvfp4.scheme import detect_scheme

    scheme = detect_scheme(target)
    if scheme is None:
        return None if not stated else {"fp4": True, "basis": "stated", "how": "--act-quant"}
    declared = "NVFP4 activations (input scales)" if scheme.act_quant else "weight-only NVFP4 (no input scales)"
    config = f"the target's quantization config ({scheme.format}: {declared})"
    if stated and not scheme.act_quant:
        raise UserError(f"--act-quant: {target} is {declared}, so vLLM computes its activations unquantized; drop "
                        "--act-quant")
    local_cpu = url is None and find_vllm(vllm).cpu_build
    if local_cpu:
        if stated is not None and stated != scheme.act_quant:
            raise UserError(f"--no-act-quant: the local vLLM engine (its CPU build) quantizes the target's activations "
                            f"to FP4 ({config}, run by {EMULATION_KERNEL}); drop --no-act-quant")
        return {"fp4": scheme.act_quant, "basis": "set",
                "how": f"the local engine this run started: {config}, run by {EMULATION_KERNEL}"}
    if stated is not None:
        return {"fp4": stated, "basis": "stated", "how": ("--act-quant" if stated else "--no-act-quant") +
                f", against {config}"}
    return {"fp4": scheme.act_quant, "basis": "config",
            "how": f"{config}; the server does not say which NVFP4 kernel it runs (a GPU without FP4 GEMMs runs "
                   "NVFP4 weight-only, through Marlin): pass --no-act-quant for such a server"}
