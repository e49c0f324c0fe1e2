"""Clients for the `cpu` Triton repository: plain (HTTP `infer`) and streaming (gRPC stream).

    result = generate("127.0.0.1:8000", [1, 2, 3], max_tokens=16)
    for new, so_far in stream("127.0.0.1:8001", [1, 2, 3], max_tokens=16): ...
    spec = remote_speculate("127.0.0.1:8000", [1, 2, 3], 16, depth=3)   # a SpecResult, for parity

The server runs the whole speculation loop, so parity with a deployed server compares whole
results (tokens, every round's drafts, accepted_per_step), not individual forward passes. Where the
server batches the requests in flight, each response lists the batched calls it took part in
(`batched_calls`); `RemoteSpeculator.run_concurrently` unions a level's by call id into its batch sizes.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from eagle31_export.errors import UserError
from eagle31_export.reference.speculate import Sampling, SpecResult, replay_rounds
from eagle31_export.runtime.batching import BatchedCall, batch_figures
from eagle31_export.runtime.contract import ConcurrentRun, LoadOptions, PairSource, Speculator
from eagle31_export.runtime.triton_names import GENERATE_MODEL, SPECULATE_MODEL

STAT_NAMES = ("accepted_per_step", "acceptance_length", "acceptance_rate", "total_accepted_draft_tokens",
              "total_draft_tokens", "draft_tokens", "batched_calls")
REPORTED = "backend calls, as the server reported them"  # BatchFigures.source of a run over Triton


@dataclass
class Generation:
    tokens: list[int]
    text: str | None = None
    stats: dict = field(default_factory=dict)

    @property
    def accepted_per_step(self) -> list[int]:
        return [int(a) for a in self.stats.get("accepted_per_step", [])]

    @property
    def acceptance_length(self) -> float:
        return float(self.stats["acceptance_length"][0])

    @property
    def batched_calls(self) -> list[BatchedCall] | None:
        """The server's batched calls this request took part in (None: the server does not report them)."""
        rows = self.stats.get("batched_calls")
        return None if rows is None else [BatchedCall.from_row(row) for row in rows]


def _inputs(module, prompt: list[int] | str, max_tokens: int, depth: int | None, streaming: bool | None,
            temperature: float | Sampling = 0.0, seed: int = 0):
    """The request's tensors; sampling settings only when sampling, and each only where it is not the
    server's default (a server from before they existed then still serves the request)."""
    sampling = Sampling.of(temperature)
    tensors = []

    def add(name, array, dtype):
        t = module.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        tensors.append(t)

    if isinstance(prompt, str):
        add("text_input", np.asarray([prompt.encode("utf-8")], dtype=np.object_), "BYTES")
    else:
        add("input_ids", np.asarray(prompt, dtype=np.int64), "INT64")
    add("max_tokens", np.asarray([max_tokens], dtype=np.int32), "INT32")
    if depth is not None:
        add("num_draft_tokens", np.asarray([depth], dtype=np.int32), "INT32")
    if streaming is not None:
        add("streaming", np.asarray([streaming]), "BOOL")
    if sampling.temperature:
        add("temperature", np.asarray([sampling.temperature], dtype=np.float32), "FP32")
        add("seed", np.asarray([seed], dtype=np.int64), "INT64")
        if sampling.top_p != 1:
            add("top_p", np.asarray([sampling.top_p], dtype=np.float32), "FP32")
        if sampling.top_k:
            add("top_k", np.asarray([sampling.top_k], dtype=np.int32), "INT32")
        if sampling.rule != "rejection":
            add("sampling_rule", np.asarray([sampling.rule.encode("utf-8")], dtype=np.object_), "BYTES")
    return tensors


def _collect(result, into: Generation) -> list[int]:
    """Append one response's tokens/text/statistics to `into`; return the new tokens."""
    ids = result.as_numpy("output_ids")
    new = [int(t) for t in ids] if ids is not None else []
    into.tokens += new
    text = result.as_numpy("text_output")
    if text is not None:
        into.text = (into.text or "") + b"".join(text).decode("utf-8")
    for name in STAT_NAMES:
        value = result.as_numpy(name)
        if value is not None:
            into.stats[name] = value.tolist()
    return new


def generate(http_url: str, prompt: list[int] | str, max_tokens: int = 32, depth: int | None = None,
             model: str = GENERATE_MODEL, temperature: float | Sampling = 0.0, seed: int = 0) -> Generation:
    """One plain HTTP request; one response with every token and the statistics. `temperature`: a bare
    temperature, or a `Sampling` (top_p, top_k, rule)."""
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(http_url) as client:
        result = client.infer(model, _inputs(httpclient, prompt, max_tokens, depth, None, temperature, seed))
    out = Generation([])
    _collect(result, out)
    return out


def stream(grpc_url: str, prompt: list[int] | str, max_tokens: int = 32, depth: int | None = None,
           model: str = SPECULATE_MODEL, timeout: float = 120.0) -> Iterator[tuple[list[int], Generation]]:
    """Stream over gRPC: yields (new tokens, everything so far) per response, the last with statistics."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, _inputs(grpcclient, prompt, max_tokens, depth, True),
                                  enable_empty_final_response=True)
        so_far = Generation([])
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            final = result.get_response().parameters.get("triton_final_response")
            if result.get_response().outputs:
                yield _collect(result, so_far), so_far
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def remote_speculate(http_url: str, prompt_ids: list[int], max_new_tokens: int, depth: int,
                     temperature: float | Sampling = 0.0, seed: int = 0) -> SpecResult:
    """The server's speculation as a `SpecResult`, comparable field by field with `speculate(...)`."""
    return remote_speculate_recorded(http_url, prompt_ids, max_new_tokens, depth, temperature, seed)[0]


def remote_speculate_recorded(http_url: str, prompt_ids: list[int], max_new_tokens: int, depth: int,
                              temperature: float | Sampling = 0.0,
                              seed: int = 0) -> tuple[SpecResult, list[BatchedCall] | None]:
    """`remote_speculate`, and the server's batched calls the request took part in (None: not reported)."""
    try:
        got = generate(http_url, list(prompt_ids), max_new_tokens, depth, temperature=temperature, seed=seed)
    except Exception as err:  # connection refused, model missing, server-side error: one line
        raise UserError(f"Triton server at {http_url}: {str(err).splitlines()[0] if str(err) else err!r}") from None
    drafts = [[int(t) for t in row] for row in got.stats.get("draft_tokens", [])]
    result = SpecResult(tokens=got.tokens, drafts=drafts, accepted_per_step=got.accepted_per_step, depth=depth)
    return result, got.batched_calls


class RemoteSpeculator(Speculator):
    """The registry's `triton` entry: the server runs the whole loop; its rounds are replayed to
    the observer afterwards (without draft logits, which do not leave the server)."""

    name = "triton"
    serves_concurrently = True  # one HTTP request per run; the `cpu` repository batches those in flight

    def __init__(self, http_url: str):
        self.url = http_url

    def sampling_rule(self, requested: str | None) -> tuple[str, str]:
        """The `cpu` repository's loop runs every rule; the request names it (`sampling_rule`)."""
        rule = requested or "rejection"
        Sampling(1.0, rule=rule)  # an unknown name is refused
        return rule, f"set: each request names it (sampling_rule), the server's loop samples by {rule}"

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        if stop_ids:
            raise UserError("stop ids are not sent to a remote server by this client")
        result = remote_speculate(self.url, prompt_ids, max_new_tokens, depth, temperature, seed)
        if observer is not None:
            replay_rounds(result, observer)
        return result

    def run_concurrently(self, prompts, max_new_tokens, depth, concurrency, temperature=0.0, seed=0) -> ConcurrentRun:
        """As `Speculator.run_concurrently`, with the batch sizes the server reported for this level's
        requests (None when a response carried none: a server whose runtime does not batch)."""
        def one(i: int) -> tuple[SpecResult, list[BatchedCall] | None]:
            return remote_speculate_recorded(self.url, prompts[i], max_new_tokens, depth, temperature, seed + i)

        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eagle31-request") as pool:
            done = list(pool.map(one, range(len(prompts))))
        reported = [calls for _, calls in done]
        batching = None if any(calls is None for calls in reported) else batch_figures(
            [call for calls in reported for call in calls], concurrency, REPORTED)
        return ConcurrentRun([result for result, _ in done], batching=batching)


def load(source: PairSource, options: LoadOptions = LoadOptions(), workdir=None) -> RemoteSpeculator:
    if not source.url:
        raise UserError("--runtime triton needs --url HOST:PORT (HTTP) of a running server (see `eagle31-export serve`)")
    return RemoteSpeculator(source.url)
