"""The memory-bandwidth bound on a speculative speed-up at C = 1, for benchmarks/speedup.py.

At one request in flight a decode step of a small dense model reads every weight once and does
little else, so its time is about (bytes it reads) / (memory bandwidth). A round of speculation
pays `depth` draft steps and one verify forward, which is assumed as costly as a decode step (it
reads the same weights for depth + 1 tokens instead of one), and makes tau tokens; the target
alone makes one token a step. So

    bound = tau * t_target / (t_target + depth * t_draft),   t = bytes / bandwidth

The bandwidth cancels out of the bound: only the bytes matter. It does not cancel out of
t_target itself, which, set beside the measured time per token of the target alone, says how
close the engine is to bandwidth-bound. Not counted: KV-cache and activation reads, which grow with
the context. A draft step is counted with the drafter's fc although vLLM runs the fc once a round
(on the target's hidden states): the drafting cost is over by (depth - 1) fc reads, so the bound is
a little low (about 1 % for SmolLM2 at depth 3).

Bytes are counted from the safetensors headers, at the served dtype (fp32: 4 bytes a value, whatever
the checkpoint stores); only floating-point tensors are weights a step reads in full (integer and
bool tensors, e.g. an EAGLE drafter's d2t / t2d vocabulary maps, are looked up, not streamed).
Quantized checkpoints (packed integer weights) are not counted right here.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

FP32_BYTES = 4
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # safetensors' names
EMBEDDING_SUFFIX = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def safetensors_shapes(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (safetensors dtype, shape)} over every *.safetensors file in `folder`, from their
    headers alone (an 8-byte little-endian length, then that many bytes of JSON)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    shapes = {}
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        shapes.update({name: (t["dtype"], t["shape"]) for name, t in header.items() if name != "__metadata__"})
    return shapes


def values(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def weights_read_per_token(shapes: dict[str, tuple[str, list[int]]], served_bytes: int = FP32_BYTES) -> int:
    """Bytes one forward over one token reads from these weights, served at `served_bytes` a value:
    every floating-point tensor in full, except the input embedding, whose lookup reads one row; where
    there is no lm_head tensor the embedding is tied to it, and the lm_head reads it in full (once)."""
    total = 0
    for name, (dtype, shape) in shapes.items():
        if dtype not in FLOAT_DTYPES:
            continue  # index maps: looked up, not streamed
        if name.endswith(EMBEDDING_SUFFIX):
            total += shape[-1] * served_bytes  # the lookup: one row
            if LM_HEAD not in shapes:
                total += values(shape) * served_bytes  # tied: the lm_head streams the matrix
        else:
            total += values(shape) * served_bytes
    return total


def embedding_row_bytes(shapes: dict[str, tuple[str, list[int]]], served_bytes: int = FP32_BYTES) -> int:
    """One row of the model's input embedding, served at `served_bytes` a value."""
    name = next((n for n in shapes if n.endswith(EMBEDDING_SUFFIX)), None)
    if name is None:
        raise KeyError(f"no tensor named *{EMBEDDING_SUFFIX}")
    return shapes[name][1][-1] * served_bytes


def target_bytes_per_forward(target: Path, served_bytes: int = FP32_BYTES) -> int:
    """Bytes a target decode step reads: all its weights, the embedding lookup one row."""
    return weights_read_per_token(safetensors_shapes(target), served_bytes)


def drafter_bytes_per_step(drafter: Path, target: Path, served_bytes: int = FP32_BYTES) -> int:
    """Bytes one EAGLE draft step reads: the drafter's own weights (fc, its decoder layer, norms,
    lm_head over the draft vocabulary) and, where it carries no embedding of its own, one row of the
    target's, which it embeds its input token with."""
    shapes = safetensors_shapes(drafter)
    own = weights_read_per_token(shapes, served_bytes)
    has_embedding = any(n.endswith(EMBEDDING_SUFFIX) for n in shapes)
    return own if has_embedding else own + embedding_row_bytes(safetensors_shapes(target), served_bytes)


def speedup_bound(tau: float, t_target: float, t_draft: float, depth: int) -> float:
    """The speed-up at C = 1 of a bandwidth-bound engine: tau tokens per round of one verify forward
    (as costly as a decode step) and `depth` draft steps, against one token per decode step."""
    return tau * t_target / (t_target + depth * t_draft)


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read in this process: the best of `repeats` timed sums over an fp32
    tensor of `gib` GiB (far beyond any cache), at torch's current thread count. Best, not median:
    the others were slowed by something else."""
    import torch

    tensor = torch.ones(int(gib * (1 << 30)) // FP32_BYTES, dtype=torch.float32)  # ones: pages touched
    tensor.sum()  # warm-up: the reduction's threads start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tensor.sum()
        best = min(best, time.perf_counter() - start)
    return tensor.numel() * FP32_BYTES / best
