"""Quantize a BF16/FP16/FP32 Hugging Face checkpoint to NVFP4 (ModelOpt or compressed-tensors).

The numerics are ModelOpt's (`mtq.NVFP4_DEFAULT_CFG` with max calibration, then
`export_hf_checkpoint`), bit for bit: per-tensor weight scale amax/2688 shared by fused
groups (q/k/v, gate/up), FP8 block scales, and input scales from the activations' amax over
the calibration prompts. The compressed-tensors output is the lossless conversion of that.

Memory: the model is loaded once for calibration and released; weights are then streamed
from the source checkpoint one fused group at a time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.formats import nvfp4
from eagle31_export.formats.nvfp4_calib import calibrate_input_amax, default_calibration_prompts
from eagle31_export.formats.nvfp4_convert import convert_checkpoint
from eagle31_export.formats.nvfp4_scheme import (
    FORMATS, FUSED_GROUPS, Format, QuantScheme, detect_scheme, is_excluded, unmatched_patterns, write_declarations,
)
from eagle31_export.formats.nvfp4_writer import (
    DEFAULT_MAX_SHARD_BYTES, LinearWriter, ProgressCallback, ShardedWriter, check_distinct, copy_side_files,
    tensor_steps,
)
from eagle31_export.formats.outputs import atomic_output_dir, check_output
from eagle31_export.formats.safetensors_io import SafetensorsDir, read_json

# Linears kept in high precision by default, as ModelOpt's NVFP4_DEFAULT_CFG does (output
# head, MoE routers, vision towers, MTP heads). Embeddings and norms are not Linears.
DEFAULT_EXCLUDES = (
    "*lm_head*", "*router*", "*mlp.gate", "*block_sparse_moe.gate", "*shared_expert_gate", "*output_layer*",
    "*proj_out", "mtp*", "*vision_tower*", "*vision_model*", "*visual*", "*multi_modal_projector*",
)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class QuantizeResult:
    out: Path
    format: str
    quantized: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # Linears left unquantized, and why


def quantize_checkpoint(model_dir: str | os.PathLike, out: str | os.PathLike, fmt: Format = "modelopt",
                        exclude: tuple[str, ...] | list[str] = (), prompts: list[list[int]] | None = None,
                        force: bool = False, progress: ProgressCallback | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        inputs: tuple[str | os.PathLike, ...] = ()) -> QuantizeResult:
    """Quantize `model_dir` to NVFP4 in `fmt` at `out` (written atomically). `inputs`: other files
    the caller read (a calibration prompts file): `out` may not touch them either.

    An NVFP4 `model_dir` is converted to `fmt` instead (lossless); it cannot be re-quantized.
    `progress(done, total, description)` is told about every tensor written (see ProgressCallback);
    calibration, before the first tensor, is not reported.
    """
    if fmt not in FORMATS:
        raise UserError(f"unknown NVFP4 format {fmt!r}; use one of {', '.join(FORMATS)}")
    model_dir = Path(model_dir)
    check_distinct(model_dir, Path(out))
    check_output(out, force, [model_dir, *inputs])  # before the (slow) calibration
    config = read_json(model_dir / "config.json")
    if detect_scheme(model_dir, config) is not None:
        if exclude or prompts:
            raise UserError(f"{model_dir} is already NVFP4: it can only be converted between formats, so "
                            "--exclude and --calib-prompts do not apply")
        convert_checkpoint(model_dir, out, fmt, force=force, progress=progress, max_shard_bytes=max_shard_bytes)
        return QuantizeResult(Path(out), fmt, notes=[f"{model_dir} was already NVFP4: converted to {fmt}"])

    source = SafetensorsDir(model_dir)
    plan = _plan(model_dir, config, source, list(exclude), prompts)
    scheme = QuantScheme(fmt, tuple(plan.excluded))
    step = tensor_steps(progress, len(source), "quantize")
    with atomic_output_dir(out, force=force, inputs=[model_dir, *inputs]) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        linears = LinearWriter(writer, scheme)
        done: set[str] = set()
        for _shard, names in source.iter_shards():
            for name in names:
                if name in done:
                    continue
                module = name.rpartition(".")[0]
                if name.endswith(".weight") and module in plan.quantize:
                    group = _quantize_group(source, plan, module, linears)
                    done |= {f"{m}.weight" for m in group}
                    step(name, len(group))
                else:
                    writer.add(name, source[name])
                    step(name)
        writer.close()
        # Groups whose weights turned out all-zero stayed unquantized: declare them excluded.
        scheme = QuantScheme(fmt, tuple(sorted(set(plan.excluded) | set(plan.zero_weight))))
        write_declarations(tmp, config, scheme)
        copy_side_files(model_dir, tmp)
    notes = plan.notes + [f"{m}: all-zero weight, left unquantized" for m in plan.zero_weight]
    quantized = sorted(set(plan.quantize) - set(plan.zero_weight))
    return QuantizeResult(Path(out), fmt, quantized, list(scheme.excluded), notes)


@dataclass
class _Plan:
    quantize: dict[str, float]  # module -> input_scale
    excluded: list[str]
    notes: list[str]
    zero_weight: list[str] = field(default_factory=list)


def _plan(model_dir: Path, config: dict, source: SafetensorsDir, exclude: list[str],
          prompts: list[list[int]] | None) -> _Plan:
    """Decide which Linears to quantize and calibrate their input scales."""
    from eagle31_export.formats.target import load_causal_lm

    dtype = _stored_dtype(source)
    model = load_causal_lm(model_dir, dtype=dtype)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unmatched = unmatched_patterns(exclude, linears)
    if unmatched:
        raise UserError(f"--exclude {unmatched[0]!r} matches no Linear of {model_dir} (names look like "
                        f"{next(iter(linears))!r}); check the pattern")
    notes: list[str] = []
    chosen: dict[str, nn.Linear] = {}
    for name, module in linears.items():
        if is_excluded(name, DEFAULT_EXCLUDES) or is_excluded(name, exclude):
            continue
        if module.in_features % nvfp4.BLOCK_SIZE:
            notes.append(f"{name}: in_features {module.in_features} is not a multiple of 16, left unquantized")
        elif f"{name}.weight" not in source:
            notes.append(f"{name}: its weight is not stored under {name}.weight, left unquantized")
        else:
            chosen[name] = module
    _keep_fused_groups_whole(chosen, linears, notes)
    text = model.config.get_text_config()
    prompts = prompts or default_calibration_prompts(int(text.vocab_size))
    amax = calibrate_input_amax(model, chosen, prompts)
    quantize: dict[str, float] = {}
    for name in chosen:
        value = amax.get(name)
        if value is None or not math.isfinite(float(value)) or float(value) == 0:
            why = "never ran" if value is None else f"input amax is {float(value)}"
            notes.append(f"{name}: {why} on the calibration prompts, left unquantized")
            continue
        quantize[name] = float(nvfp4.weight_scale_2_from_amax(value))
    _share_group_input_scales(quantize)
    embeddings = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    excluded = sorted((set(linears) - set(quantize)) | set(embeddings))
    del model
    return _Plan(quantize, excluded, notes)


def _quantize_group(source: SafetensorsDir, plan: _Plan, module: str, linears: LinearWriter) -> list[str]:
    """Quantize `module` with its fused siblings under one shared weight_scale_2."""
    group = _fused_siblings(module, plan.quantize)
    weights = {m: source[f"{m}.weight"] for m in group}
    for m, w in weights.items():
        if not bool(torch.isfinite(w).all()):
            raise CheckpointError(f"{source.file_of(f'{m}.weight')}: {m}.weight contains NaN or Inf; cannot quantize it")
    amax = torch.stack([nvfp4.abs_max(w).float() for w in weights.values()]).max()
    if float(amax) == 0:
        plan.zero_weight.extend(group)
        for m, w in weights.items():
            linears.writer.add(f"{m}.weight", w)
        return group
    ws2 = nvfp4.weight_scale_2_from_amax(amax)
    for m, w in weights.items():
        q = nvfp4.quantize(w, ws2)
        linears.add(m, q.packed, q.weight_scale, float(ws2), plan.quantize[m])
    return group


def _fused_siblings(module: str, quantized: dict[str, float]) -> list[str]:
    parent, _, leaf = module.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return [f"{parent}.{g}" for g in group if f"{parent}.{g}" in quantized]
    return [module]


def _keep_fused_groups_whole(chosen: dict[str, nn.Linear], linears: dict[str, nn.Linear], notes: list[str]) -> None:
    """Runtimes fuse q/k/v and gate/up into one GEMM: quantize all members or none."""
    for module in list(chosen):
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), ())
        members = [f"{parent}.{g}" for g in group if f"{parent}.{g}" in linears]
        left_out = [m for m in members if m not in chosen]
        if left_out and module in chosen:
            for m in members:
                chosen.pop(m, None)
            notes.append(f"{', '.join(members)}: fused group with {', '.join(left_out)} unquantized, "
                         "left unquantized as a whole")


def _share_group_input_scales(quantize: dict[str, float]) -> None:
    # Fused Linears read the same input; one scale (the max, as ModelOpt exports) for all.
    for module in list(quantize):
        group = _fused_siblings(module, quantize)
        shared = max(quantize[m] for m in group)
        for m in group:
            quantize[m] = shared


def _stored_dtype(source: SafetensorsDir) -> torch.dtype:
    """Calibrate in the dtype the weights are stored in (what ModelOpt users load)."""
    for name in source:
        if name.endswith(".weight"):
            _, dtype = source.shape_and_dtype(name)
            if dtype in _DTYPES:
                return _DTYPES[dtype]
    raise CheckpointError(f"{source.folder}: no BF16/FP16/FP32 weights found; nothing to quantize")
