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
from eagle31_export.formats.nvfp4 import numerics as nvfp4
from eagle31_export.formats.nvfp4.calibration import calibrate_input_amax, default_calibration_prompts
from eagle31_export.formats.nvfp4.convert import convert_checkpoint
from eagle31_export.formats.nvfp4.scheme import (
    FORMATS, FUSED_GROUPS, Format, QuantScheme, detect_scheme, is_excluded, unmatched_patterns, write_declarations,
)
from eagle31_export.formats.nvfp4.writer import (
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
                        inputs: tuple[str | os.PathLike, ...] = (), experts_only: bool = False) -> QuantizeResult:
    """Quantize `model_dir` to NVFP4 in `fmt` at `out` (written atomically). `inputs`: other files
    the caller read (a calibration prompts file): `out` may not touch them either. `experts_only`:
    quantize only the routed MoE experts (ModelOpt's NVFP4_EXPERTS_ONLY_CFG; the layout of the
    published Kimi K2.x NVFP4 checkpoints, docs/nvfp4.md#published-nvfp4-moe-targets).

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
        if exclude or prompts or experts_only:
            raise UserError(f"{model_dir} is already NVFP4: it can only be converted between formats, so "
                            "--exclude, --experts-only and --calib-prompts do not apply")
        convert_checkpoint(model_dir, out, fmt, force=force, progress=progress, max_shard_bytes=max_shard_bytes)
        return QuantizeResult(Path(out), fmt, notes=[f"{model_dir} was already NVFP4: converted to {fmt}"])

    source = SafetensorsDir(model_dir)
    plan = _plan(model_dir, config, source, list(exclude), prompts, experts_only)
    scheme = QuantScheme(fmt, tuple(plan.excluded))
    step = tensor_steps(progress, len(source), "quantize")
    with atomic_output_dir(out, force=force, inputs=[model_dir, *inputs]) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        linears = LinearWriter(writer, scheme)
        done: set[str] = set()
        with _OpenShards(source) as tensors:
            for _shard, names in source.iter_shards():
                for name in names:
                    if name in done:
                        continue
                    module = name.rpartition(".")[0]
                    if name.endswith(".weight") and module in plan.quantize:
                        group = _quantize_group(tensors, plan, module, linears)
                        done |= {f"{m}.weight" for m in group}
                        step(name, len(group))
                    else:
                        writer.add(name, tensors[name])
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
          prompts: list[list[int]] | None, experts_only: bool = False) -> _Plan:
    """Decide which Linears to quantize and calibrate their input scales.

    Routed experts (stored one Linear per expert, fused in the model: formats/experts.py) are
    Linears here under their stored names. Their input scales are shared by all experts of a
    layer, one for gate/up and one for down, as ModelOpt calibrates fused experts (one input
    quantizer per projection for all experts; `_QuantFusedExperts` in
    modelopt/torch/quantization/plugins/huggingface.py)."""
    from eagle31_export.formats.target.checkpoint import load_causal_lm

    dtype = _stored_dtype(source)
    model = load_causal_lm(model_dir, dtype=dtype)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    in_features = {n: m.in_features for n, m in linears.items()}
    slots = _expert_slots(model, source)
    params = dict(model.named_parameters())
    in_features.update({name: int(params[slot.param].shape[2]) for name, slot in slots.items()})
    names = [*linears, *slots]
    stored = set(source)  # names only (a Mapping membership test would read the tensor)
    unmatched = unmatched_patterns(exclude, names)
    if unmatched:
        raise UserError(f"--exclude {unmatched[0]!r} matches no Linear of {model_dir} (names look like "
                        f"{names[0]!r}); check the pattern")
    if experts_only and not slots:
        raise UserError(f"--experts-only: {model_dir} stores no routed experts one by one "
                        "(mlp.experts.E.*_proj.weight); it is not a MoE checkpoint in the published layout")
    notes: list[str] = []
    chosen: dict[str, int] = {}
    for name in names:
        if is_excluded(name, DEFAULT_EXCLUDES) or is_excluded(name, exclude) or (experts_only and name not in slots):
            continue
        if in_features[name] % nvfp4.BLOCK_SIZE:
            notes.append(f"{name}: in_features {in_features[name]} is not a multiple of 16, left unquantized")
        elif f"{name}.weight" not in stored:
            notes.append(f"{name}: its weight is not stored under {name}.weight, left unquantized")
        else:
            chosen[name] = in_features[name]
    _keep_fused_groups_whole(chosen, set(names), notes)
    text = model.config.get_text_config()
    prompts = prompts or default_calibration_prompts(int(text.vocab_size))
    amax = _calibrate(model, {n: linears[n] for n in chosen if n in linears},
                      {n: slots[n] for n in chosen if n in slots}, prompts)
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
    unquantized = sorted((set(names) - set(quantize)) | set(embeddings) | set(_routers(model)))
    excluded = summarize_exclusions(unquantized, quantize)
    del model
    return _Plan(quantize, excluded, notes)


def _expert_slots(model: nn.Module, source: SafetensorsDir) -> dict:
    """Stored per-expert Linear name -> its slot in the model's fused experts."""
    from eagle31_export.formats.experts import ExpertLayout

    layout = ExpertLayout.of(model)
    if layout is None:
        return {}
    params = dict(model.named_parameters())
    return {slot.module: slot for name in source if name.endswith(".weight")
            and (slot := layout.slot(name)) is not None and slot.param in params}


def _routers(model: nn.Module) -> list[str]:
    """MoE routers that are not Linears (transformers 5 routers hold a plain weight): ModelOpt lists
    them as excluded all the same (`_get_unquantized_moe_router_names` in
    modelopt/torch/export/quant_utils.py), and so does this writer."""
    out = []
    for name, module in model.named_modules():
        if not hasattr(module, "experts"):
            continue
        for attr in ("gate", "router", "shared_expert_gate"):
            router = getattr(module, attr, None)
            if isinstance(router, nn.Module) and not isinstance(router, nn.Linear) and \
                    isinstance(getattr(router, "weight", None), torch.Tensor):
                out.append(f"{name}.{attr}" if name else attr)
    return out


def _calibrate(model: nn.Module, linears: dict[str, nn.Linear], experts: dict, prompts: list[list[int]]
               ) -> dict[str, torch.Tensor]:
    """Input amax of every chosen Linear; routed experts share one per layer and projection kind."""
    from eagle31_export.formats.experts import restore_experts, swap_experts

    seen: dict[tuple[str, str], torch.Tensor] = {}  # (experts module, "gate_up" | "down") -> amax

    def hook(name: str, x: torch.Tensor) -> torch.Tensor:
        module, _, rest = name.rpartition(".")
        key = (module.rpartition(".")[0], "down" if rest == "down_proj" else "gate_up")
        value = torch.maximum(x.amax().abs(), x.amin().abs()).float() if x.numel() else None
        if value is not None:
            seen[key] = value if key not in seen else torch.maximum(seen[key], value)
        return x

    swapped = {}
    for prefix in sorted({slot.experts_module for slot in experts.values()}):
        swapped[prefix] = swap_experts(model, prefix, hook)
    try:
        amax = calibrate_input_amax(model, linears, prompts)
    finally:
        for prefix, original in swapped.items():
            restore_experts(model, prefix, original)
    for name, slot in experts.items():
        key = (slot.experts_module, "down" if name.endswith(".down_proj") else "gate_up")
        if key in seen:
            amax[name] = seen[key]
    return amax


def summarize_exclusions(unquantized: list[str], quantized) -> list[str]:
    """The exclusion list as ModelOpt's HF export writes it: each unquantized module under the
    shortest prefix wildcard, cut at a dot, that matches no quantized module (`layers.0*`,
    `layers.1.self_attn*`), else by name. (Our own code for the rule of
    `_prefix_wildcard_summarize_exclude_modules` in modelopt/torch/export/quant_utils.py.)"""
    import bisect

    ordered = sorted(quantized)
    exact = set(ordered)

    def blocked(pattern: str) -> bool:
        if not pattern.endswith("*"):
            return pattern in exact
        head = pattern[:-1]
        i = bisect.bisect_left(ordered, head)
        return i < len(ordered) and ordered[i].startswith(head)

    result: set[str] = set()
    for name in unquantized:
        candidates = [[name[:i] + "*"] if k == 0 else [name[:i], name[:i] + ".*"]
                      for i, ch in enumerate(name) if ch == "." for k in (0, 1)] + [[name]]
        chosen: list[str] = []
        for wildcards in candidates:
            if any(blocked(w) for w in wildcards):
                continue
            if all(w in result for w in wildcards):
                chosen = []
                break
            chosen = wildcards
            break
        result.update(chosen[1:] if len(chosen) == 2 else chosen)  # a pair is written as its ".*" member
    return sorted(result)


class _OpenShards:
    """Tensors of a checkpoint read through one open handle per shard (a MoE checkpoint holds tens of
    thousands of tensors: opening the file for each would parse its header each time)."""

    def __init__(self, source: SafetensorsDir):
        self.source, self.handles = source, {}

    def __enter__(self) -> "_OpenShards":
        return self

    def __exit__(self, *exc) -> None:
        self.handles.clear()

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.source.file_of(name)
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt")
        return self.handles[path].get_tensor(name)

    def file_of(self, name: str) -> Path:
        return self.source.file_of(name)


def _quantize_group(source, plan: _Plan, module: str, linears: LinearWriter) -> list[str]:
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


def _keep_fused_groups_whole(chosen: dict, names: set[str], notes: list[str]) -> None:
    """Runtimes fuse q/k/v and gate/up into one GEMM: quantize all members or none."""
    for module in list(chosen):
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), ())
        members = [f"{parent}.{g}" for g in group if f"{parent}.{g}" in names]
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
