"""Target captures: a target's greedy continuation of each prompt, with everything the greedy
speculation loop reads from the target, so that a target too large for one machine runs once
(`eagle31-export capture`, tensor-parallel under torchrun) and parity runs from the capture.

    capture/
      capture.json               format, target (path, config.json), tapped layers, sizes, prompts
      prompts-00000.safetensors  one or more prompts per shard:
                                   p{i}.tokens        int64 [L]      prompt + greedy continuation
                                   p{i}.aux           dtype [L-1, k*H] tapped states at positions 0..L-2
                                   p{i}.topk_values   fp32  [L-1, K] the K largest logits there
                                   p{i}.topk_indices  int64 [L-1, K] and their token ids
      embeddings.safetensors     embed_tokens.weight: the target's input embeddings (drafters borrow them)
      manifest.json              sha256 of every file

Row j holds what the target computes after tokens[0..j]: its argmax is tokens[j + 1], so the top-K
reproduces every argmax greedy speculation reads. A capture made with --max-new-tokens M --depth D
holds L - P = M + D + 1 continuation tokens (P = prompt length): enough for any greedy run with
max_new_tokens + depth <= M + D, whose verify forwards reach at most position P + M + D - 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle31_export.config import TargetInfo
from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.formats.safetensors_io import SafetensorsDir, read_json, write_json

FORMAT = "eagle31-export/capture"
FORMAT_VERSION = 1
CAPTURE_JSON = "capture.json"
EMBEDDINGS_FILE = "embeddings.safetensors"
EMBED_NAME = "embed_tokens.weight"
DEFAULT_SHARD_BYTES = 1 << 30
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


def continuation_length(max_new_tokens: int, depth: int) -> int:
    """Greedy tokens captured after each prompt for runs up to `max_new_tokens` at `depth`."""
    return max_new_tokens + depth + 1


@dataclass
class PromptCapture:
    """One prompt's capture: tokens [L] (prompt then greedy continuation) and, for rows 0..L-2,
    the tapped states and the top-K logits the target computed there."""

    prompt_len: int
    tokens: torch.Tensor
    aux: torch.Tensor
    topk_values: torch.Tensor
    topk_indices: torch.Tensor

    @property
    def prompt(self) -> list[int]:
        return [int(t) for t in self.tokens[: self.prompt_len]]

    @property
    def continuation(self) -> list[int]:
        return [int(t) for t in self.tokens[self.prompt_len:]]

    def tensors(self, index: int) -> dict[str, torch.Tensor]:
        return {f"p{index}.tokens": self.tokens.to(torch.int64), f"p{index}.aux": self.aux,
                f"p{index}.topk_values": self.topk_values.to(torch.float32),
                f"p{index}.topk_indices": self.topk_indices.to(torch.int64)}


class CaptureWriter:
    """Writes prompt captures, in order, into shards of about `shard_bytes` inside `folder` (the
    caller's atomic output folder), then capture.json and the embeddings."""

    def __init__(self, folder: Path, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder, self.shard_bytes = Path(folder), shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_prompts: list[dict[str, Any]] = []
        self.prompts: list[dict[str, Any]] = []
        self.shards = 0

    def add(self, record: PromptCapture) -> None:
        index = len(self.prompts) + len(self.pending_prompts)
        self.pending.update({k: v.contiguous() for k, v in record.tensors(index).items()})
        self.pending_prompts.append({"prompt_len": record.prompt_len, "length": int(record.tokens.numel())})
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending_prompts:
            return
        name = f"prompts-{self.shards:05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.prompts += [{**p, "shard": name} for p in self.pending_prompts]
        self.pending, self.pending_prompts = {}, []
        self.shards += 1

    def finish(self, meta: dict[str, Any], embeddings: torch.Tensor) -> None:
        """`meta`: the capture.json fields other than format, prompts and embeddings."""
        self._flush()
        save_file({EMBED_NAME: embeddings.detach().contiguous()}, str(self.folder / EMBEDDINGS_FILE),
                  metadata={"format": "pt"})
        write_json(self.folder / CAPTURE_JSON, {"format": FORMAT, "format_version": FORMAT_VERSION, **meta,
                                                "prompts": self.prompts, "embeddings": EMBEDDINGS_FILE})


class Capture:
    """A capture folder, read lazily: capture.json and every shard header on open, tensors on use."""

    def __init__(self, folder: Path, meta: dict[str, Any], tensors: SafetensorsDir):
        self.folder, self.meta, self.tensors = folder, meta, tensors
        self._index: dict[tuple[int, ...], int] | None = None

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "Capture":
        folder = Path(folder)
        if not folder.is_dir():
            raise UserError(f"{folder}: no such capture folder; write one with `eagle31-export capture`")
        if not (folder / CAPTURE_JSON).is_file():
            raise UserError(f"{folder}: no {CAPTURE_JSON}; pass a folder written by `eagle31-export capture`")
        meta = read_json(folder / CAPTURE_JSON)
        where = folder / CAPTURE_JSON
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{where}: format {meta.get('format')!r}, not {FORMAT!r}")
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{where}: format_version {meta.get('format_version')!r}; this version reads "
                                  f"{FORMAT_VERSION}: re-capture with this eagle31-export")
        _check_meta(meta, where)
        capture = cls(folder, meta, SafetensorsDir(folder))
        capture._check_tensors()
        return capture

    # --- what capture.json says ---
    @property
    def target_config(self) -> dict[str, Any]:
        return self.meta["target"]["config"]

    @property
    def target_info(self) -> TargetInfo:
        return TargetInfo.from_hf_config(self.target_config)

    @property
    def target_path(self) -> Path:
        return Path(self.meta["target"]["path"])

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.meta["aux_layer_ids"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def max_new_tokens(self) -> int:
        return int(self.meta["max_new_tokens"])

    @property
    def depth(self) -> int:
        return int(self.meta["depth"])

    @property
    def dtype(self) -> torch.dtype:
        return {v: k for k, v in DTYPE_NAMES.items()}[self.meta["dtype"]]

    def __len__(self) -> int:
        return len(self.meta["prompts"])

    def serves(self, max_new_tokens: int, depth: int) -> None:
        """Refuse, in one line, a greedy run this capture is too short for."""
        if max_new_tokens + depth > self.max_new_tokens + self.depth:
            raise UserError(f"{self.folder} was captured for max_new_tokens + depth <= "
                            f"{self.max_new_tokens + self.depth}; this run needs {max_new_tokens + depth}: "
                            f"re-capture with --max-new-tokens >= {max_new_tokens + depth - self.depth} "
                            f"(at --depth {self.depth})")

    # --- prompts ---
    def prompt(self, index: int) -> list[int]:
        length = self.meta["prompts"][index]["prompt_len"]
        return [int(t) for t in self.tensors[f"p{index}.tokens"][:length]]

    def prompts(self) -> list[list[int]]:
        return [self.prompt(i) for i in range(len(self))]

    def index_of(self, prompt: list[int]) -> int | None:
        if self._index is None:
            self._index = {}
            for i, p in enumerate(self.prompts()):
                self._index.setdefault(tuple(p), i)
        return self._index.get(tuple(int(t) for t in prompt))

    def require(self, prompt: list[int], what: str = "the prompt") -> int:
        index = self.index_of(prompt)
        if index is None:
            head = ",".join(str(t) for t in list(prompt)[:8]) + (",..." if len(prompt) > 8 else "")
            raise UserError(f"{what} [{head}] ({len(prompt)} tokens) is not in the capture {self.folder}; "
                            "re-capture with a --prompts file that holds it")
        return index

    def load(self, index: int) -> PromptCapture:
        t = self.tensors
        return PromptCapture(self.meta["prompts"][index]["prompt_len"], t[f"p{index}.tokens"], t[f"p{index}.aux"],
                             t[f"p{index}.topk_values"], t[f"p{index}.topk_indices"])

    def embeddings(self) -> torch.Tensor:
        return self.tensors[EMBED_NAME]

    def _check_tensors(self) -> None:
        hidden, k = int(self.meta["hidden_size"]), int(self.meta["top_k"])
        width = hidden * len(self.aux_layer_ids)
        for i, entry in enumerate(self.meta["prompts"]):
            n = entry["length"]
            expected = {f"p{i}.tokens": ([n], "I64"), f"p{i}.aux": ([n - 1, width], None),
                        f"p{i}.topk_values": ([n - 1, k], "F32"), f"p{i}.topk_indices": ([n - 1, k], "I64")}
            for name, (shape, dtype) in expected.items():
                if name not in self.tensors:
                    raise CheckpointError(f"{self.folder}: tensor {name} is missing; is the capture complete?")
                found, found_dtype = self.tensors.shape_and_dtype(name)
                if found != shape or (dtype is not None and found_dtype != dtype):
                    raise CheckpointError(f"{self.tensors.file_of(name)}: {name} is {found_dtype} {found}; "
                                          f"capture.json implies {dtype or 'float'} {shape}")
        if EMBED_NAME not in self.tensors:
            raise CheckpointError(f"{self.folder}: {EMBEDDINGS_FILE} with {EMBED_NAME} is missing")


def _check_meta(meta: dict[str, Any], where: Path) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: {what}")

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    target = meta.get("target")
    need(isinstance(target, dict) and isinstance(target.get("config"), dict) and isinstance(target.get("path"), str),
         "'target' must hold 'path' and 'config'")
    ids = meta.get("aux_layer_ids")
    need(isinstance(ids, list) and ids and all(is_int(i) and i >= 0 for i in ids),
         "'aux_layer_ids' must be a non-empty list of layer ids")
    for key in ("hidden_size", "vocab_size", "max_new_tokens", "depth", "top_k", "world_size"):
        need(is_int(meta.get(key)) and meta[key] >= 1, f"'{key}' must be a positive integer")
    need(meta.get("dtype") in DTYPE_NAMES.values(), f"'dtype' must be one of {', '.join(DTYPE_NAMES.values())}")
    prompts = meta.get("prompts")
    need(isinstance(prompts, list) and prompts, "'prompts' must be a non-empty list")
    continuation = continuation_length(meta["max_new_tokens"], meta["depth"])
    for i, p in enumerate(prompts):
        need(isinstance(p, dict) and is_int(p.get("prompt_len")) and p["prompt_len"] >= 1 and is_int(p.get("length"))
             and p["length"] == p["prompt_len"] + continuation and isinstance(p.get("shard"), str),
             f"prompts[{i}] must hold prompt_len >= 1, length = prompt_len + {continuation} and its shard")


def drafter_with_embeddings(drafter: str | os.PathLike, capture: Capture, out: str | os.PathLike) -> Path:
    """`drafter` as it is when it holds its embeddings; otherwise a copy written to `out` (in its own
    format) with the captured target's input embeddings (and lm_head, where the target ties it), so
    that it can be exported without loading the target."""
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
    from eagle31_export.formats.drafter.formats import FORMATS

    ckpt = read_drafter(drafter)
    tensors = {name: ckpt.tensors[name] for name in ckpt.tensors}
    if "embed_tokens.weight" in tensors and "lm_head.weight" in tensors:
        return Path(drafter)
    embed = capture.embeddings()
    tensors.setdefault("embed_tokens.weight", embed)
    if "lm_head.weight" not in tensors:
        if not capture.target_info.tie_word_embeddings or ckpt.config.draft_vocab_size != ckpt.config.vocab_size:
            raise UserError(f"drafter {drafter} has no lm_head and borrows the target's, which the capture "
                            f"{capture.folder} does not hold; export it with --target instead")
        tensors["lm_head.weight"] = embed
    fmt = ckpt.format if ckpt.format in FORMATS else "specforge"
    return write_drafter(DrafterCheckpoint(ckpt.config, tensors, fmt), out, fmt)
