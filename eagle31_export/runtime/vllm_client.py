"""A client for a vLLM OpenAI-compatible server: token ids in, token ids out, and what vLLM says about
itself on `/metrics` (read with prometheus_client's text parser) and, where the server has them, its
development endpoints.

Acceptance comes from two places vLLM fills (docs/runtimes.md, "vLLM"):
- `/metrics`: the counters `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
  `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`, read around each request;
  one request at a time, their deltas are that request's;
- the response's `metrics.speculative_decoding` when the server runs with
  `--per-request-spec-decode-metrics detailed`: the accepted count of every verification step, in order.

What else `/metrics` of vLLM 0.32 tells (vllm/v1/metrics/loggers.py, PrometheusStatLogger), read here:
- `vllm:num_requests_running` / `vllm:num_requests_waiting`: gauges set after every engine step
  (the scheduler's `make_stats`, vllm/v1/core/sched/scheduler.py), so sampling them shows how many
  requests ran together;
- `vllm:iteration_tokens_total`: a histogram observed once per engine step; its count is the steps;
- `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`: tokens looked up in and served from the
  prefix cache;
- `vllm:cache_config_info`: the cache configuration as labels (block_size, cache_dtype,
  enable_prefix_caching).
The served dtype is on none of them, nor on `/v1/models`; `/server_info` (vLLM's development
endpoints, on a server started with VLLM_SERVER_DEV_MODE=1) has `model_config.dtype`.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from eagle31_export.errors import UserError
from eagle31_export.reference.speculate import Sampling

REQUEST_TIMEOUT_S = 600.0
METRICS_TIMEOUT_S = 30.0
SPEC_PREFIX = "vllm:spec_decode_"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
CACHE_HITS, CACHE_QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
STEPS = "vllm:iteration_tokens_total"  # histogram: one observation per engine step
GENERATED = "vllm:generation_tokens"  # counter: tokens the engine's steps produced
CACHE_INFO = "vllm:cache_config_info"
# our vLLM plugin's gauge (plugins/vllm/eagle31_vllm_plugin/cpu_sampler.py, STATE_METRIC): labels `shim`
# (what vLLM's CPU expand_kernel shim does: broken, correct, none, not_recognised) and `sampler`
# (fixed_by_plugin, left_as_shipped, as_shipped); every gauge of the plugin also has `vllm` and `reason`
# (plugins/vllm/eagle31_vllm_plugin/outcome.py)
ENGINE_SAMPLER = "eagle31_vllm_cpu_sampler"
ENGINE_CHUNK_TAIL = "eagle31_vllm_eagle_chunk_tail"  # plugins/vllm/eagle31_vllm_plugin/chunk_tail.py
ENGINE_DRAFT_LOG = "eagle31_vllm_draft_log"  # plugins/vllm/eagle31_vllm_plugin/draft_log.py: `log`
ENGINE_NVFP4 = "eagle31_vllm_cpu_nvfp4"  # plugins/vllm/eagle31_vllm_plugin/__init__.py: `kernels`
# label values a process sets where a patch is not what the plugin knows, or its fix did not apply: read
# before any other set label of the same gauge (the processes' gauges are merged by their largest value)
UNSURE_LABELS = ("not_recognised", "fix_found_no_runner")
_SPEC_FIELDS = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted_tokens"}

Samples = dict[str, list[tuple[dict, float]]]  # sample name -> (labels, value) of every engine


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        url = "http://" + url
    return url


def parse_metrics(text: str, families: tuple[str, ...] | None = None) -> Samples:
    """The samples of a Prometheus text page by sample name (a counter's are `NAME_total` and
    `NAME_created`), read with prometheus_client's parser. `families`: only lines of metrics whose
    name starts with one of these (vLLM's page is ~50 KB; the batch sampler reads two gauges of it
    every few tens of milliseconds). ValueError where the page is not Prometheus text."""
    if families is not None:
        text = "\n".join(line for line in text.splitlines() if _metric_name(line).startswith(families)) + "\n"
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def _metric_name(line: str) -> str:
    """The metric a line of the text format is about ('' for a comment that is neither HELP nor TYPE)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    return re.split(r"[{\s]", line.strip(), maxsplit=1)[0]


def _total(samples: Samples, name: str) -> int | None:
    """A counter or gauge summed over engines; None where the page has no such metric."""
    rows = samples.get(f"{name}_total", samples.get(name))
    return None if rows is None else int(sum(value for _, value in rows))


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines); `accepted_per_position[i]`: rounds
    whose draft at position i+1 was accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda v: list(v) + [0] * (width - len(v))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens,
                            [a - b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))])


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters of a Prometheus text page; None when the page has none (a server
    started without speculative decoding). ValueError where the page is not Prometheus text."""
    return _spec_counters(parse_metrics(text, (SPEC_PREFIX,)))


def _spec_counters(samples: Samples) -> SpecCounters | None:
    counters, per_position, seen = SpecCounters(), {}, False
    for name, rows in samples.items():
        if not name.startswith(SPEC_PREFIX) or name.endswith("_created"):
            continue
        seen = True
        short = name.removeprefix(SPEC_PREFIX).removesuffix("_total")
        for labels, value in rows:
            if short == "num_accepted_tokens_per_pos":
                position = int(labels.get("position", 0))
                per_position[position] = per_position.get(position, 0) + int(value)
            elif short in _SPEC_FIELDS:
                attr = _SPEC_FIELDS[short]
                setattr(counters, attr, getattr(counters, attr) + int(value))
    if not seen:
        return None
    counters.accepted_per_position = [per_position.get(i, 0) for i in range(max(per_position, default=-1) + 1)]
    return counters


@dataclass
class EngineMetrics:
    """One read of an engine's /metrics (summed over its engines); None: the page has no such metric."""

    spec: SpecCounters | None
    running: int | None  # requests in the engine's batch after its last step
    waiting: int | None
    prefix_cache_hits: int | None  # tokens served from the prefix cache
    prefix_cache_queries: int | None  # tokens looked up in it
    steps: int | None  # engine steps that produced output (vllm:iteration_tokens_total's count)
    cache_info: dict  # vllm:cache_config_info's labels (the first engine's); {} where absent
    generated: int | None = None  # output tokens the engine produced (vllm:generation_tokens)
    sampler_plugin: dict | None = None  # ENGINE_SAMPLER's labels ({"shim", "sampler"}); None: no such gauge
    chunk_tail_plugin: dict | None = None  # ENGINE_CHUNK_TAIL's labels ({"shipped", "drafter"}); None: no such gauge
    draft_log_plugin: dict | None = None  # ENGINE_DRAFT_LOG's labels ({"log"}); None: no such gauge
    nvfp4_plugin: dict | None = None  # ENGINE_NVFP4's labels ({"kernels"}); None: no such gauge


def parse_engine_metrics(text: str) -> EngineMetrics:
    samples = parse_metrics(text)
    info = samples.get(CACHE_INFO) or [({}, 0.0)]
    return EngineMetrics(_spec_counters(samples), _total(samples, RUNNING), _total(samples, WAITING),
                         _total(samples, CACHE_HITS), _total(samples, CACHE_QUERIES),
                         _total(samples, f"{STEPS}_count"), info[0][0], _total(samples, GENERATED),
                         _set_labels(samples, ENGINE_SAMPLER), _set_labels(samples, ENGINE_CHUNK_TAIL),
                         _set_labels(samples, ENGINE_DRAFT_LOG), _set_labels(samples, ENGINE_NVFP4))


def _set_labels(samples: dict, gauge: str) -> dict | None:
    """The labels of `gauge`'s sample set to a non-zero value (our plugin's state gauges), else None;
    one with an UNSURE_LABELS value first (a process whose patch is unknown, or whose fix did not apply,
    says more than one where it did)."""
    found = [labels for labels, value in samples.get(gauge, []) if value]
    return next((labels for labels in found if set(labels.values()) & set(UNSURE_LABELS)), found[0] if found else None)


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str | None
    spec_metrics: dict | None  # the response's metrics.speculative_decoding, where the server fills it


class VllmClient:
    def __init__(self, url: str, timeout: float = REQUEST_TIMEOUT_S):
        self.url, self.timeout = base_url(url), timeout
        self._model: str | None = None

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
            return response.read()

    def _fail(self, what: str, err: Exception) -> UserError:
        if isinstance(err, urllib.error.HTTPError):
            try:
                detail = json.loads(err.read() or b"{}").get("error", {})
                reason = detail.get("message") if isinstance(detail, dict) else str(detail)
            except ValueError:
                reason = None
            reason = (reason or err.reason or "").splitlines()[0] if (reason or err.reason) else ""
            return UserError(f"vLLM server at {self.url}: {what} answered HTTP {err.code}: {reason}")
        reason = getattr(err, "reason", None) or err
        return UserError(f"vLLM server at {self.url}: {what} failed ({reason}); is the server running?")

    def healthy(self) -> bool:
        try:
            self._request("/health", timeout=5)
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def model(self) -> str:
        """The served model's name (the first `/v1/models` entry)."""
        if self._model is None:
            try:
                models = json.loads(self._request("/v1/models", timeout=30))["data"]
                self._model = models[0]["id"]
            except (urllib.error.URLError, OSError) as err:
                raise self._fail("/v1/models", err) from None
            except (ValueError, KeyError, IndexError, TypeError):
                raise UserError(f"{self.url}/v1/models is not a vLLM model list; is this a vLLM server?") from None
        return self._model

    def metrics_text(self) -> str:
        try:
            return self._request("/metrics", timeout=METRICS_TIMEOUT_S).decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as err:
            raise self._fail("/metrics", err) from None

    def _parsed(self, parse, *args):
        try:
            return parse(self.metrics_text(), *args)
        except ValueError as err:
            raise UserError(f"vLLM server at {self.url}: /metrics is not Prometheus text ({str(err)[:80]}); is this a "
                            "vLLM server?") from None

    def spec_counters(self) -> SpecCounters | None:
        return self._parsed(parse_spec_counters)

    def metrics(self) -> EngineMetrics:
        return self._parsed(parse_engine_metrics)

    def scheduler(self) -> tuple[int | None, int | None]:
        """(requests running, requests waiting) as the engine's gauges say now."""
        samples = self._parsed(parse_metrics, (RUNNING, WAITING))
        return _total(samples, RUNNING), _total(samples, WAITING)

    def server_config(self) -> dict:
        """The engine's `vllm_config` from `/server_info`; {} where the server does not tell (that endpoint
        is one of vLLM's development endpoints: it answers only on a server started with
        VLLM_SERVER_DEV_MODE=1)."""
        try:
            info = json.loads(self._request("/server_info?config_format=json", timeout=120))
        except urllib.error.HTTPError:
            return {}  # 404: no development endpoints
        except (urllib.error.URLError, OSError) as err:
            raise self._fail("/server_info", err) from None
        except ValueError:
            return {}
        config = (info.get("vllm_config") or {}) if isinstance(info, dict) else {}
        return config if isinstance(config, dict) else {}

    def served_dtype(self) -> str | None:
        """The dtype the engine computes in (`model_config.dtype`: float32, bfloat16, ...); None: not told."""
        dtype = (self.server_config().get("model_config") or {}).get("dtype")
        return str(dtype).removeprefix("torch.") if dtype else None

    def draft_sample_method(self) -> str | None:
        """How the engine drafts (`speculative_config.draft_sample_method`: greedy, probabilistic); None: not told."""
        method = (self.server_config().get("speculative_config") or {}).get("draft_sample_method")
        return str(method) if method else None

    def complete(self, prompt_ids: list[int], max_tokens: int, temperature: float | Sampling = 0.0, seed: int = 0,
                 stop_ids: tuple[int, ...] = (), request_id: str | None = None) -> Completion:
        """One completion from token ids. Generation runs to `max_tokens` (or a stop id), as our own
        loop does: the model's EOS and the server's default sampling settings do not apply.
        `request_id`: the request's name, which vLLM keeps inside its own id (runtime/vllm_drafts.py)."""
        # No top_k / top_p / min_p / repetition_penalty unless asked, not even at their neutral values:
        # vLLM 0.32 then takes another sampling path (docs/runtimes.md, "Sampling").
        sampling = Sampling.of(temperature)
        body = {"model": self.model(), "prompt": list(prompt_ids), "max_tokens": max_tokens,
                "temperature": sampling.temperature, "seed": seed, "ignore_eos": True,
                "stop_token_ids": list(stop_ids), "return_token_ids": True,
                **({"top_p": sampling.top_p} if sampling.top_p < 1 else {}),
                **({"top_k": sampling.top_k} if sampling.top_k else {}),
                **({"request_id": request_id} if request_id else {})}
        try:
            answer = json.loads(self._request("/v1/completions", body))
        except (urllib.error.URLError, OSError) as err:
            raise self._fail("/v1/completions", err) from None
        try:
            choice = answer["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise UserError(f"vLLM server at {self.url}: the completion has no token_ids (vLLM older than "
                            "return_token_ids?); use a newer vLLM") from None
        spec = (answer.get("metrics") or {}).get("speculative_decoding")
        return Completion(tokens, choice.get("finish_reason"), spec)


SAMPLE_INTERVAL_S = 0.03  # between the end of one /metrics read and the start of the next


@dataclass(frozen=True)
class BatchSample:
    running: int  # vllm:num_requests_running when read
    waiting: int
    in_flight: tuple[int, int]  # this client's requests in flight when the read started and when it ended


class RunningSampler:
    """Reads `vllm:num_requests_running` (and waiting) on /metrics every SAMPLE_INTERVAL_S in a thread
    while a block runs, beside this client's own count of its requests in flight (`request()` around
    each). vLLM sets those gauges after every engine step, so the samples show how many requests its
    steps ran together. Never raises into the block: a read that fails ends the sampling (`error`)."""

    def __init__(self, client: VllmClient, interval: float = SAMPLE_INTERVAL_S):
        self.client, self.interval = client, interval
        self.samples: list[BatchSample] = []
        self.most_in_flight = 0
        self.error: str | None = None
        self.missing = False  # the server has no vllm:num_requests_running gauge
        self._in_flight, self._lock, self._stop = 0, threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle31-vllm-sampler", daemon=True)

    def __enter__(self) -> "RunningSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def request(self):
        """Around one request: counts it in flight."""
        with self._lock:
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def _run(self) -> None:
        while not self._stop.is_set():
            before = self._in_flight
            try:
                running, waiting = self.client.scheduler()
            except UserError as err:
                self.error = str(err)
                return
            if running is None:
                self.missing = True
                return
            self.samples.append(BatchSample(running, waiting or 0, (before, self._in_flight)))
            self._stop.wait(self.interval)
