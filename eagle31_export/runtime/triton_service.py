"""What the Triton `cpu` model does, without Triton: load the pair, speculate, report per round.

The Triton model.py is a thin adapter over `SpeculationService` (so the logic is testable in
process), and picks its backends through `select_backends`: switching from the PyTorch
reference to another runtime implementing the loop's protocols is a change of one name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.safetensors_io import read_json
from eagle31_export.reference.speculate import DrafterBackend, SpecResult, TargetBackend, speculate

PAIR_FILE = "pair.json"
RUNTIMES = ("reference", "onnxruntime")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def select_backends(pair_dir: str | os.PathLike, runtime: str = "reference") -> tuple[TargetBackend, DrafterBackend]:
    """The loop's target and drafter backends for the pair described by `pair_dir/pair.json`."""
    pair_dir = Path(pair_dir)
    spec = read_json(pair_dir / PAIR_FILE)
    drafter, target = pair_dir / spec["drafter"], Path(spec["target"])
    if runtime == "reference":
        from eagle31_export.reference.pair import load_pair

        pair = load_pair(drafter, target, dtype=DTYPES[spec.get("dtype", "fp32")])
        return pair.target, pair.drafter
    if runtime == "onnxruntime":
        # ONNX Runtime backends run the graphs of `eagle31-export export onnx --drafter D --target T
        # --out pair/onnx`, kept next to pair.json.
        from eagle31_export.runtime.onnxruntime import OnnxExport, OrtDrafterBackend, OrtTargetBackend

        onnx_dir = pair_dir / spec.get("onnx", "onnx")
        if not onnx_dir.is_dir():
            raise UserError(f"{onnx_dir}: no ONNX export; run `eagle31-export export onnx --out {onnx_dir}` "
                            "with this pair's drafter and target first")
        export = OnnxExport.open(onnx_dir)
        return OrtTargetBackend(export), OrtDrafterBackend(export)
    raise UserError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")


class _CommitObserver:
    """Wraps a DrafterBackend and reports tokens as the loop commits them.

    Each round of `speculate` starts with one drafter call on the tokens not yet in the
    drafter's cache; from the second round on these are exactly the tokens the previous round
    produced (accepted drafts + bonus). The observer forwards every call unchanged, so the
    loop, and its results, are the reference loop's own.
    """

    def __init__(self, inner: DrafterBackend, prompt_len: int, on_tokens: Callable[[list[int]], None]):
        self.inner, self.prompt_len, self.on_tokens = inner, prompt_len, on_tokens
        self.emitted = 0

    def reset(self) -> None:
        self.inner.reset()
        self.emitted = 0

    @property
    def length(self) -> int:
        return self.inner.length

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        if hidden_is_aux:  # first call of a round: input_ids end with the newest token seq[m]
            generated = int(positions[0, -1]) + 2 - self.prompt_len  # tokens after the prompt, up to seq[m]
            new = generated - self.emitted
            if new > 0:
                self.on_tokens([int(t) for t in input_ids[0, -new:]])
                self.emitted = generated
        return self.inner.forward(input_ids, positions, hidden, hidden_is_aux)

    def draft_to_target(self, draft_ids):
        return self.inner.draft_to_target(draft_ids)

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)


class SpeculationService:
    def __init__(self, target: TargetBackend, drafter: DrafterBackend, tokenizer=None, depth: int = 3):
        self.target, self.drafter, self.tokenizer, self.depth = target, drafter, tokenizer, depth

    @classmethod
    def from_dir(cls, pair_dir: str | os.PathLike, runtime: str | None = None) -> "SpeculationService":
        """`runtime` None: the one pair.json names (what `export triton` chose)."""
        spec = read_json(Path(pair_dir) / PAIR_FILE)
        target, drafter = select_backends(pair_dir, runtime or spec.get("runtime", "reference"))
        return cls(target, drafter, load_tokenizer(spec["target"]), int(spec.get("max_draft_len", 3)))

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
        drafter = self.drafter if on_tokens is None else _CommitObserver(self.drafter, len(prompt_ids), on_tokens)
        return speculate(self.target, drafter, list(prompt_ids), max_new_tokens, depth or self.depth,
                         temperature, seed, stop_ids=tuple(stop_ids))


def load_tokenizer(target: str | os.PathLike):
    """The target's tokenizer when one is saved next to it, else None (clients send token ids)."""
    target = Path(target)
    if not any((target / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError):
        return None


def statistics(result: SpecResult) -> dict[str, float | int | list]:
    """Acceptance statistics under the names TensorRT-LLM's Triton model uses, plus tau."""
    drafted = result.drafts_proposed
    accepted = sum(result.accepted_per_step)
    return {
        "accepted_per_step": list(result.accepted_per_step),
        "acceptance_length": result.acceptance_length,
        "total_accepted_draft_tokens": accepted,
        "total_draft_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "draft_tokens": [list(d) for d in result.drafts],
    }
