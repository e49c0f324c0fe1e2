"""What the Triton `cpu` model does, without Triton: load the pair, check each request, speculate,
report per round.

The Triton model.py is a thin adapter over `SpeculationService` (so the logic is testable in
process); the runtime comes from the registry, named in `pair.json`.

Every request is checked before anything runs (`SpeculationService.parse`): a request that cannot
run raises `RequestError`, one line naming the input and the allowed range, which the model sends
as Triton's INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT). Anything else that fails is the server's
fault: the client gets `INTERNAL_ERROR` (one generic line, HTTP 500), the server log the detail
(`client_error`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.safetensors_io import read_json
from eagle31_export.formats.tokenizer import load_tokenizer
from eagle31_export.reference.speculate import SAMPLING_RULES, LoopObserver, Round, Sampling, SpecResult
from eagle31_export.runtime.registry import LoadOptions, PairSource, Speculator, load_speculator


PAIR_FILE = "pair.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
MAX_DRAFT_TOKENS = 16  # num_draft_tokens above this (or the pair's max_draft_len, if larger) is refused
INTERNAL_ERROR = "internal error while generating; the server log has the details"


class RequestError(UserError):
    """A request that cannot run (bad ids, counts, temperature...): one line naming the input and
    what it may hold. Sent to the client as INVALID_ARG (HTTP 400)."""


def client_error(err: BaseException) -> tuple[str, bool]:
    """(the one line the client gets, whether the client is at fault). Only our own request checks
    reach the client verbatim; any other failure (ONNX Runtime, torch, a bug) becomes one generic
    line, and the caller logs the detail on the server side."""
    if isinstance(err, RequestError):
        text = str(err).strip()
        return (text.splitlines()[0] if text else "invalid request"), True
    return INTERNAL_ERROR, False


@dataclass(frozen=True)
class Limits:
    """What a request may ask of the loaded pair."""

    vocab_size: int | None = None  # token ids must lie in 0..vocab_size-1
    max_positions: int | None = None  # prompt + max_tokens + num_draft_tokens - 1 must fit (rope tables)
    max_draft_tokens: int = MAX_DRAFT_TOKENS

    @classmethod
    def of(cls, speculator: Speculator, target_dir: str | os.PathLike, depth: int = 1) -> "Limits":
        """Vocabulary from the target's config.json; positions from the runtime's rope tables (the
        exported graphs' `max_positions`), else the target's `max_position_embeddings`."""
        config = read_json(Path(target_dir) / "config.json")
        text = config.get("text_config", config)
        tables = [getattr(getattr(speculator, part, None), "max_positions", None) for part in ("target", "drafter")]
        tables = [int(t) for t in tables if t]
        declared = text.get("max_position_embeddings")
        positions = min(tables) if tables else (int(declared) if declared else None)
        return cls(int(text["vocab_size"]), positions, max(MAX_DRAFT_TOKENS, depth))


@dataclass(frozen=True)
class GenerateRequest:
    """A checked request: every field is within what the loaded pair can run."""

    prompt: list[int]
    max_tokens: int
    depth: int
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    seed: int = 0
    streaming: bool = False
    top_p: float = 1.0  # sampling only: the nucleus, the top-k cut (0: all) and the rule (SAMPLING_RULES)
    top_k: int = 0
    sampling_rule: str = "rejection"

    @property
    def sampling(self) -> float | Sampling:
        """What the speculator samples by: a bare temperature at 0 (greedy), else a `Sampling`."""
        if self.temperature == 0:
            return self.temperature
        return Sampling(self.temperature, self.top_p, self.top_k, self.sampling_rule)


def _scalar(name: str, array: np.ndarray, kinds: str, what: str):
    """The single value of a [1] input, of numpy kind(s) `kinds` ('i' signed, 'u' unsigned, 'f', 'b')."""
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value (got {array.size})")
    if array.dtype.kind not in kinds:
        raise RequestError(f"{name} must be {what} (got {array.dtype.name})")
    return array.reshape(-1)[0].item()


def _string(name: str, array: np.ndarray) -> str:
    """The single string of a [1] STRING input (a numpy object array of bytes)."""
    array = np.asarray(array, dtype=object).reshape(-1)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one string (got {array.size})")
    raw = array[0]
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as err:
        raise RequestError(f"{name} is not valid UTF-8 (byte {err.start})") from None


def load_pair_dir(pair_dir: str | os.PathLike, runtime: str | None = None) -> tuple[Speculator, dict]:
    """The speculator for the pair described by `pair_dir/pair.json` (`runtime` None: the one it names)."""
    pair_dir = Path(pair_dir)
    spec = read_json(pair_dir / PAIR_FILE)
    spec["target"] = str(pair_dir / spec["target"])  # relative to pair.json's folder (an absolute path stays)
    artifacts = pair_dir / spec["artifacts"] if spec.get("artifacts") else None
    if artifacts is not None and not artifacts.exists():
        raise UserError(f"{artifacts}: missing, yet {pair_dir / PAIR_FILE} names it; re-export the repository")
    source = PairSource.of(pair_dir / spec["drafter"], spec["target"], artifacts)
    options = LoadOptions(dtype=DTYPES[spec.get("dtype", "fp32")])
    return load_speculator(runtime or spec["runtime"], source, options), spec


class _Streamer(LoopObserver):
    """Sends each round's committed tokens as the next round completes; the last round's stay
    pending, so that they leave with the statistics in the final response."""

    def __init__(self, send: Callable[[list[int]], None]):
        self.send, self.pending = send, []

    def on_prefill(self, token: int) -> None:
        self.pending = [token]

    def on_round(self, round: Round) -> None:
        self.send(self.pending)
        self.pending = list(round.committed)


class SpeculationService:
    def __init__(self, speculator: Speculator, tokenizer=None, depth: int = 3, limits: Limits | None = None):
        self.speculator, self.tokenizer, self.depth = speculator, tokenizer, depth
        self.limits = limits or Limits(max_draft_tokens=max(MAX_DRAFT_TOKENS, depth))

    @classmethod
    def from_dir(cls, pair_dir: str | os.PathLike, runtime: str | None = None) -> "SpeculationService":
        speculator, spec = load_pair_dir(pair_dir, runtime)
        depth = int(spec.get("max_draft_len", 3))
        return cls(speculator, load_tokenizer(spec["target"]), depth, Limits.of(speculator, spec["target"], depth))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("text_input needs a tokenizer and this model has none next to its target: "
                               "send input_ids instead")
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def parse(self, inputs: Mapping[str, np.ndarray | None], default_max_tokens: int = 64) -> GenerateRequest:
        """A checked request from the Triton inputs (name -> array, None when absent); RequestError
        (one line) for anything the pair cannot run."""
        ids, text = inputs.get("input_ids"), inputs.get("text_input")
        if ids is not None and text is not None:
            raise RequestError("send input_ids or text_input, not both")
        if ids is None and text is None:
            raise RequestError("send input_ids (INT64 token ids) or text_input (STRING)")
        if ids is not None:
            ids = np.asarray(ids)
            if ids.size and ids.dtype.kind not in "iu":
                raise RequestError(f"input_ids must be integer token ids (got {ids.dtype.name})")
            prompt = [int(i) for i in ids.reshape(-1)]
        else:
            prompt = self.encode(_string("text_input", text))
        get = lambda name, kinds, what, default: (  # noqa: E731
            default if inputs.get(name) is None else _scalar(name, inputs[name], kinds, what))
        max_tokens = get("max_tokens", "iu", "an integer", default_max_tokens)
        depth = get("num_draft_tokens", "iu", "an integer", self.depth)
        temperature = get("temperature", "fiu", "a number", 0.0)
        seed = get("seed", "iu", "an integer", 0)
        streaming = get("streaming", "b", "a boolean", False)
        top_p = get("top_p", "fiu", "a number", 1.0)
        top_k = get("top_k", "iu", "an integer", 0)
        rule = "rejection" if inputs.get("sampling_rule") is None else _string("sampling_rule", inputs["sampling_rule"])
        stop = inputs.get("stop_token_ids")
        if stop is not None and np.asarray(stop).size and np.asarray(stop).dtype.kind not in "iu":
            raise RequestError(f"stop_token_ids must be integer token ids (got {np.asarray(stop).dtype.name})")
        stop_ids = () if stop is None else tuple(int(s) for s in np.asarray(stop).reshape(-1))
        request = GenerateRequest(prompt, int(max_tokens), int(depth), stop_ids, float(temperature), int(seed),
                                  bool(streaming), float(top_p), int(top_k), rule)
        self.check(request)
        return request

    def check(self, request: GenerateRequest) -> None:
        """RequestError (one line) unless the loaded pair can run `request`."""
        limits = self.limits
        if not request.prompt:
            raise RequestError("the prompt is empty: send at least one token")
        if not 1 <= request.depth <= limits.max_draft_tokens:
            raise RequestError(f"num_draft_tokens must be between 1 and {limits.max_draft_tokens} "
                               f"(got {request.depth})")
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1 (got {request.max_tokens})")
        if not math.isfinite(request.temperature) or request.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (got {request.temperature})")
        if not (math.isfinite(request.top_p) and 0 < request.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1] (got {request.top_p})")
        if request.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0: all tokens; got {request.top_k})")
        if request.sampling_rule not in SAMPLING_RULES:
            shown = request.sampling_rule[:40] + ("..." if len(request.sampling_rule) > 40 else "")
            raise RequestError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)} (got {shown!r})")
        if limits.max_positions is not None:
            # the last round verifies up to position prompt + max_tokens - 2 + depth
            room = limits.max_positions - len(request.prompt) - request.depth + 1
            if request.max_tokens > room:
                if room < 1:
                    raise RequestError(f"the prompt is too long: {len(request.prompt)} tokens with "
                                       f"{request.depth} draft tokens leave no room in the model's "
                                       f"{limits.max_positions} positions")
                raise RequestError(f"max_tokens {request.max_tokens} is too many: a {len(request.prompt)}-token "
                                   f"prompt with {request.depth} draft tokens leaves room for at most {room} "
                                   f"(the model has {limits.max_positions} positions)")
        self._check_ids("input_ids", request.prompt)
        self._check_ids("stop_token_ids", request.stop_ids)

    def _check_ids(self, name: str, ids) -> None:
        vocab = self.limits.vocab_size
        for i, token in enumerate(ids):
            if token < 0 or (vocab is not None and token >= vocab):
                allowed = f"0..{vocab - 1}" if vocab is not None else ">= 0"
                raise RequestError(f"{name}: token id {token} at position {i} is out of range ({allowed})")

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, depth: int | None = None,
                 stop_ids: tuple[int, ...] = (), on_tokens: Callable[[list[int]], None] | None = None,
                 temperature: float | Sampling = 0.0, seed: int = 0) -> SpecResult:
        """Chain speculation (greedy at temperature 0); `on_tokens` receives tokens round by round as they
        are committed (the last round's are in the result only: the caller sends them with the statistics).
        `temperature`: a bare temperature or a `Sampling` (top_p, top_k, rule).
        The request is checked first (RequestError); `depth` None: the pair's default."""
        sampling = Sampling.of(temperature)
        request = GenerateRequest(list(prompt_ids), max_new_tokens, self.depth if depth is None else depth,
                                  tuple(stop_ids), sampling.temperature, seed, top_p=sampling.top_p,
                                  top_k=sampling.top_k, sampling_rule=sampling.rule)
        self.check(request)
        return self.run(request, on_tokens)

    def run(self, request: GenerateRequest, on_tokens: Callable[[list[int]], None] | None = None,
            calls: list | None = None) -> SpecResult:
        """Run a request already checked by `parse` / `check`. `calls`, when given, receives the batched
        backend calls the request took part in (`runtime/batching.py: BatchedCall`), where the runtime
        batches the requests in flight (its speculator has `run_recorded`); else it stays empty."""
        observer = _Streamer(on_tokens) if on_tokens is not None else None
        args = (list(request.prompt), request.max_tokens, request.depth, request.sampling, request.seed,
                request.stop_ids, observer)
        recorded = getattr(self.speculator, "run_recorded", None)
        if calls is None or recorded is None:
            return self.speculator.run(*args)
        result, took_part = recorded(*args)
        calls.extend(took_part)
        return result

    @property
    def batches(self) -> bool:
        """Whether the runtime batches the requests in flight and records its calls (`run(calls=...)`)."""
        return hasattr(self.speculator, "run_recorded")
