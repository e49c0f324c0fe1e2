"""What the Triton `cpu` model does, without Triton: load the pair, speculate, report per round.

The Triton model.py is a thin adapter over `SpeculationService` (so the logic is testable in
process); the runtime comes from the registry, named in `pair.json`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.safetensors_io import read_json
from eagle31_export.formats.tokenizer import load_tokenizer
from eagle31_export.reference.speculate import LoopObserver, Round, SpecResult
from eagle31_export.runtime.registry import LoadOptions, PairSource, Speculator, load_speculator

PAIR_FILE = "pair.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def load_pair_dir(pair_dir: str | os.PathLike, runtime: str | None = None) -> tuple[Speculator, dict]:
    """The speculator for the pair described by `pair_dir/pair.json` (`runtime` None: the one it names)."""
    pair_dir = Path(pair_dir)
    spec = read_json(pair_dir / PAIR_FILE)
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
    def __init__(self, speculator: Speculator, tokenizer=None, depth: int = 3):
        self.speculator, self.tokenizer, self.depth = speculator, tokenizer, depth

    @classmethod
    def from_dir(cls, pair_dir: str | os.PathLike, runtime: str | None = None) -> "SpeculationService":
        speculator, spec = load_pair_dir(pair_dir, runtime)
        return cls(speculator, load_tokenizer(spec["target"]), int(spec.get("max_draft_len", 3)))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UserError("this model has no tokenizer next to its target: send input_ids instead of text_input")
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, depth: int | None = None,
                 stop_ids: tuple[int, ...] = (), on_tokens: Callable[[list[int]], None] | None = None,
                 temperature: float = 0.0, seed: int = 0) -> SpecResult:
        """Chain speculation (greedy at temperature 0); `on_tokens` receives tokens round by round as they
        are committed (the last round's are in the result only: the caller sends them with the statistics)."""
        if not prompt_ids:
            raise UserError("empty prompt: send at least one token")
        if max_new_tokens < 1:
            raise UserError(f"max_tokens must be >= 1 (got {max_new_tokens})")
        if temperature < 0:
            raise UserError(f"temperature must be >= 0 (got {temperature})")
        observer = _Streamer(on_tokens) if on_tokens is not None else None
        return self.speculator.run(list(prompt_ids), max_new_tokens, depth or self.depth, temperature, seed,
                                   tuple(stop_ids), observer)
