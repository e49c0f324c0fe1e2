"""`capture`: run a target over a prompt set once and keep what greedy speculation reads from it
(formats/capture.py has the format; reference/capture_target.py serves it back to the loop).

One process by default. Under `torchrun --nproc-per-node N` (WORLD_SIZE > 1) the target is loaded
tensor-parallel with transformers' own tensor parallelism (formats/target/tensor_parallel.py); every rank runs
the same forwards (the sharded layers exchange partial results), and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.capture import (
    DEFAULT_SHARD_BYTES, DTYPE_NAMES, CaptureWriter, PromptCapture, continuation_length,
)
from eagle31_export.formats.nvfp4.scheme import detect_scheme
from eagle31_export.formats.safetensors_io import atomic_output_dir
from eagle31_export.formats.target.checkpoint import read_target_config, read_target_info
from eagle31_export.formats.target.tensor_parallel import launch_world
from eagle31_export.progress import Phases
from eagle31_export.reference.target import ReferenceTarget


@dataclass(frozen=True)
class CaptureOptions:
    max_new_tokens: int = 32
    depth: int = 3
    top_k: int = 8
    dtype: torch.dtype = torch.float32
    shard_bytes: int = DEFAULT_SHARD_BYTES
    force: bool = False
    device: str = "cpu"  # resolved (cpu or cuda): where a one-process target computes


@dataclass
class CaptureResult:
    out: Path | None  # None on ranks other than 0 (they write nothing)
    rank: int
    world_size: int
    prompts: int
    continuation: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase: load_target, capture, write


def resolve_aux_layer_ids(target: str | os.PathLike, drafter: str | os.PathLike | None = None,
                          aux_layer_ids: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The tapped layers (output-of-layer numbering): the drafter's, resolved against the target
    exactly as `read_pair` does, or given."""
    if (drafter is None) == (aux_layer_ids is None):
        raise UserError("give the tapped layers: --drafter D (its own) or --aux-layer-ids 1,2,3, not both")
    if drafter is not None:
        from eagle31_export.formats.pair import read_pair

        return read_pair(drafter, target).aux_layer_ids
    n = read_target_info(target).num_hidden_layers
    bad = [i for i in aux_layer_ids if not 0 <= i < n]
    if bad or not aux_layer_ids:
        raise UserError(f"--aux-layer-ids: layer {bad[0] if bad else '(none)'} is not a layer of the target "
                        f"(0..{n - 1}, output-of-layer numbering)")
    return tuple(aux_layer_ids)


@torch.no_grad()
def capture_prompt(target: ReferenceTarget, prompt: list[int], continuation: int, top_k: int) -> PromptCapture:
    """The prompt's greedy continuation of `continuation` tokens, one forward per token after the
    prompt's (a KV cache, as `ReferenceTarget.forward`), with each row's taps and top-k logits."""
    from transformers import DynamicCache

    device = next(target.model.parameters()).device
    cache, length, ids = DynamicCache(), 0, list(prompt)
    tokens = list(prompt)
    aux, values, indices = [], [], []
    while len(tokens) < len(prompt) + continuation:
        x = torch.tensor([ids], device=device)
        positions = torch.arange(length, length + len(ids), device=device).unsqueeze(0)
        with target.tapping() as taps:
            out = target.model(input_ids=x, position_ids=positions, past_key_values=cache, use_cache=True)
        cache, length = out.past_key_values, length + len(ids)
        logits = out.logits[0].float()
        top = logits.topk(top_k, dim=-1)
        aux.append(taps()[0].cpu())
        values.append(top.values.cpu())
        indices.append(top.indices.cpu())
        ids = [int(logits[-1].argmax())]
        tokens += ids
    return PromptCapture(len(prompt), torch.tensor(tokens, dtype=torch.int64), torch.cat(aux),
                         torch.cat(values), torch.cat(indices))


def input_embeddings(model) -> torch.Tensor:
    """The full input embedding table (gathered from the ranks where the tp_plan shards it)."""
    module = model.get_input_embeddings()
    weight = module.weight.detach()
    plan = getattr(module, "_hf_tp_plan", None)
    if plan in ("embedding_rowwise", "embedding_colwise"):
        from transformers.integrations.tensor_parallel import gather_full_tensor

        weight = gather_full_tensor(weight, 0 if plan == "embedding_rowwise" else 1, module._hf_device_mesh)
    return weight.cpu()


def capture(target_path: str | os.PathLike, prompts: list[list[int]], aux_layer_ids: tuple[int, ...],
            out: str | os.PathLike, options: CaptureOptions = CaptureOptions(),
            progress=None, inputs: tuple[str | os.PathLike | None, ...] = ()) -> CaptureResult:
    """Run the target over `prompts` and write the capture to `out` (rank 0). Call it on every rank
    of a torchrun launch; `progress(phase, done, total)` hears, on rank 0, of the phases load_target,
    capture (prompts done) and write (eagle31_export/progress.py); their seconds are in the result."""
    from eagle31_export.formats.outputs import check_output

    rank, world = launch_world()
    phases = Phases.of(progress if rank == 0 else None)
    if not prompts:
        raise UserError("no prompts to capture")
    if options.max_new_tokens < 1 or options.depth < 1:
        raise UserError("--max-new-tokens and --depth must be >= 1")
    info = read_target_info(target_path)
    if not 1 <= options.top_k <= info.vocab_size:
        raise UserError(f"--top-k {options.top_k}: must be 1..{info.vocab_size} (the target's vocabulary)")
    if options.dtype not in DTYPE_NAMES:
        raise UserError(f"capture dtype must be one of {', '.join(DTYPE_NAMES.values())}")
    for n, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < info.vocab_size]
        if not p or bad:
            raise UserError(f"prompt {n}: " + (f"token id {bad[0]} is outside the target's vocabulary "
                                               f"(0..{info.vocab_size - 1})" if p else "empty"))
    inputs = (target_path, *inputs)
    check_output(out, options.force, inputs)  # before the slow part, on every rank
    if options.device not in ("cpu", "cuda"):
        raise UserError(f"capture device must be cpu or cuda (resolved), not {options.device!r}")
    if world > 1 and options.device != "cpu":
        raise UserError("--device applies to a one-process capture; under torchrun the ranks place the target")
    with phases.phase("load_target"):
        model = _load(target_path, options.dtype, world)
        if world == 1:
            model.to(options.device)
    target = ReferenceTarget(model, aux_layer_ids)
    length = continuation_length(options.max_new_tokens, options.depth)
    meta = {
        "target": {"path": str(Path(target_path).resolve()), "config": read_target_config(target_path),
                   "quantization": "NVFP4" if detect_scheme(target_path) is not None else None},
        "aux_layer_ids": list(aux_layer_ids), "hidden_size": info.hidden_size, "vocab_size": target.vocab_size,
        "max_new_tokens": options.max_new_tokens, "depth": options.depth, "continuation": length,
        "top_k": options.top_k, "dtype": DTYPE_NAMES[options.dtype], "world_size": world,
        # what rank 0 held of the weights: all of them in one process, its shards under tensor parallelism
        "rank0_parameters": _logical_parameters(target.model),
    }
    try:
        with (atomic_output_dir(out, force=options.force, inputs=inputs) if rank == 0
              else contextlib.nullcontext(None)) as tmp:
            writer = CaptureWriter(tmp, options.shard_bytes) if tmp is not None else None
            with phases.phase("capture", total=len(prompts)):
                for i, prompt in enumerate(prompts):
                    record = capture_prompt(target, prompt, length, options.top_k)
                    if writer is not None:
                        writer.add(record)
                    phases("capture", i + 1, len(prompts))
            with phases.phase("write"):
                embeddings = input_embeddings(target.model)  # a collective where sharded: every rank
                if writer is not None:
                    writer.finish(meta, embeddings)
        _barrier(world)  # every rank leaves the process group together, after rank 0 wrote
    finally:
        _leave_process_group(world)
    return CaptureResult(Path(out) if rank == 0 else None, rank, world, len(prompts), length, phases.as_json())


def _logical_parameters(model) -> int:
    """Weights rank 0 holds, counted as dense elements (a packed NVFP4 Linear counts out x in), so a
    tensor-parallel shard compares with a whole model however each is stored."""
    packed = [m for m in model.modules() if hasattr(m, "weight_packed")]
    return sum(p.numel() for p in model.parameters()) + sum(m.out_features * m.in_features for m in packed)


def _load(path, dtype: torch.dtype, world: int):
    if world > 1:
        from eagle31_export.formats.target.tensor_parallel import load_causal_lm_tp

        return load_causal_lm_tp(path, dtype)
    from eagle31_export.formats.target.checkpoint import load_causal_lm
    from eagle31_export.reference.upcast import compute_in

    # weights as stored (bf16 stays bf16, NVFP4 packed), computing in `dtype` per operation
    return compute_in(load_causal_lm(path, dtype=dtype, stored_weights=True), dtype)


def _barrier(world: int) -> None:
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _leave_process_group(world: int) -> None:
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
