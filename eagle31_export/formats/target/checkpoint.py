"""Target checkpoints: detect, validate and load into a transformers causal LM.

Plain BF16/FP16/FP32 Hugging Face checkpoints load through transformers. NVFP4 checkpoints
(ModelOpt or compressed-tensors) are detected from their declarations, validated while
streamed, and loaded into the plain architecture with dequantized weights (W4A16
emulation), optionally with NVFP4 fake-quantized Linear inputs (W4A4 emulation).

Before any weight is loaded, the checkpoint is held against the model its config.json
describes (built on the meta device: names, shapes and dtypes only, nothing allocated): a
tensor the model needs and the files lack is an error, never a randomly initialised weight; so
is a config whose layer count or sizes disagree with the tensors, and a model type no command
here can run. Weight values (NaN/Inf, all-zero norms) are checked by `formats.weight_checks`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle31_export.config import ConfigError, TargetInfo
from eagle31_export.errors import CheckpointError
from eagle31_export.formats.experts import ExpertLayout, expert_problems
from eagle31_export.formats.layer_names import layer_index, past_layers
from eagle31_export.formats.kv_scales import parse_kv_scale
from eagle31_export.formats.nvfp4.model import MODEL_TYPE_ALIASES
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
from eagle31_export.formats.nvfp4.scheme import detect_scheme
from eagle31_export.formats.outputs import check_enclosing_output
from eagle31_export.formats.safetensors_io import (
    FLOAT_TORCH_DTYPES,
    SafetensorsDir,
    read_json,
    stored_float_dtype,
    upcasts_exactly,
)
from eagle31_export.formats.weight_checks import FLOAT_DTYPES, check_values, role_of, scan_checkpoint, scan_tensors

# Where transformers causal LMs keep their decoder layer stack (reference.target taps these).
DECODER_LAYER_PATHS = ("model.layers", "model.language_model.layers", "transformer.h", "model.decoder.layers")
# Model types whose RMSNorm scales by (1 + weight): an all-zero weight there is the identity, not damage.
OFFSET_NORM_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "qwen3_next")
# Stored tensors transformers derives or ignores on load (rotary tables saved by old exports).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def read_target_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a target folder; every reader of a target starts here. A folder inside an
    output of this tool (a bundle's copied or linked `target/`) is first held against that output's
    manifest, by size and header (`formats.outputs.check_enclosing_output`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such target checkpoint folder")
    check_enclosing_output(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; expected a target (causal LM) checkpoint folder")
    cfg = read_json(path / "config.json")
    from eagle31_export.formats.drafter.formats import looks_like_drafter

    if looks_like_drafter(cfg):
        raise CheckpointError(f"{path} is an EAGLE-3 drafter checkpoint, not a target model; pass it as --drafter "
                              "and the model it drafts for as --target")
    return cfg


def transformers_config(config: dict[str, Any]):
    """The transformers config of a target config.json: built-in classes only (an `auto_map` is never
    executed), published aliases resolved (`kimi_k2` is DeepSeek-V3), `quantization_config` dropped."""
    from eagle31_export.formats.nvfp4.model import plain_config

    return plain_config(config)


def read_target_info(path: str | os.PathLike) -> TargetInfo:
    cfg = read_target_config(path)
    try:
        return TargetInfo.from_hf_config(cfg)
    except ConfigError as err:
        raise CheckpointError(f"{Path(path) / 'config.json'}: {err}") from None


def is_nvfp4(path: str | os.PathLike) -> bool:
    return detect_scheme(path) is not None


# ---- the model config.json describes, without weights ------------------------------------------

@dataclass
class TargetLayout:
    """What the model built from config.json holds: every state-dict tensor's shape, the ones a
    checkpoint must provide (tied copies excluded), and whether stored names must match exactly."""

    shapes: dict[str, tuple[int, ...]]
    needed: set[str]
    float_names: set[str]
    exact_names: bool  # False where transformers renames or fuses stored tensors on load (MoE experts, ...)
    ignore_unexpected: tuple[str, ...]
    num_layers: int
    extra_layers: int  # stored layers past num_hidden_layers that the model ignores (MTP heads)
    zero_norms_ok: bool
    experts: ExpertLayout | None = None  # how stored per-expert Linears map onto fused expert parameters
    packed: bool = False  # NVFP4: quantized Linears are stored packed (other shapes and dtypes)


def target_layout(path: str | os.PathLike, cfg: dict[str, Any] | None = None) -> TargetLayout:
    """The model config.json describes, built on the meta device; refuses a config transformers
    cannot build into a causal LM, or one without a decoder layer stack, by name."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from eagle31_export.formats.nvfp4.model import plain_config

    path = Path(path)
    cfg = read_target_config(path) if cfg is None else cfg
    info = read_target_info(path)
    text = cfg.get("text_config", cfg)
    _check_activation(path, text.get("hidden_act", text.get("hidden_activation")))
    try:
        config = plain_config(cfg)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()
    except Exception as err:  # an untrusted config can fail model construction in many ways
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path / 'config.json'}: transformers cannot build a causal LM from it "
                              f"(model_type {cfg.get('model_type')!r}: {first[:200]}); targets must be decoder-only "
                              "causal LMs such as Llama, Qwen2/3 or Mistral") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not any(_has_path(model, p) for p in DECODER_LAYER_PATHS):
        raise CheckpointError(f"{path}: {type(model).__name__} has no decoder layer stack that can be tapped "
                              f"(looked for {', '.join(DECODER_LAYER_PATHS)}); supported: Llama, Qwen2/3, Mistral")
    state = model.state_dict()
    persistent = set(state)
    needed = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if n in persistent}
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    converted = (get_checkpoint_conversion_mapping(type(model).__name__) is not None
                 or get_checkpoint_conversion_mapping(config.model_type) is not None)
    model_type = str(getattr(config.get_text_config(), "model_type", config.model_type))
    return TargetLayout(
        shapes={n: tuple(t.shape) for n, t in state.items()},
        needed=needed,
        float_names={n for n, t in state.items() if t.is_floating_point()},
        exact_names=not converted,
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        num_layers=info.num_hidden_layers,
        extra_layers=int(text.get("num_nextn_predict_layers") or 0),
        zero_norms_ok=model_type in OFFSET_NORM_MODEL_TYPES,
        experts=ExpertLayout.of(model),
    )


def _check_activation(path: Path, act: Any) -> None:
    if act is None:
        return
    from transformers.activations import ACT2FN

    if not isinstance(act, str) or act not in ACT2FN:
        raise CheckpointError(f"{path / 'config.json'}: hidden_act {act!r} is not an activation transformers knows "
                              "(e.g. silu, gelu); fix config.json")


def _has_path(model, dotted: str) -> bool:
    mod = model
    for part in dotted.split("."):
        mod = getattr(mod, part, None)
        if mod is None:
            return False
    return isinstance(mod, torch.nn.ModuleList)


def structure_problems(names_shapes: dict[str, tuple[list[int], str]], layout: TargetLayout,
                       where: dict[str, str]) -> list[str]:
    """Stored tensors (name -> (shape, dtype)) against the model: layer count, missing and
    unexpected tensors, shapes, dtypes. Names are compared exactly only where transformers
    loads them as stored (no conversion mapping); the layer count always."""
    problems: list[str] = []
    ignored = [re.compile(p) for p in layout.ignore_unexpected]
    relevant = [n for n in names_shapes if not _IGNORED.search(n) and not any(p.search(n) for p in ignored)]
    layers = {i for n in relevant if (i := layer_index(n)) is not None}
    limit = layout.num_layers + layout.extra_layers
    if layers and (max(layers) >= limit or len(layers & set(range(layout.num_layers))) != layout.num_layers):
        problems.append(f"config.json says num_hidden_layers {layout.num_layers}, but the checkpoint stores "
                        f"{len(layers)} layers (numbered {min(layers)}..{max(layers)}); config and weights "
                        "do not belong together")
    if layout.experts is not None:  # routed experts stored one by one: their count and (plain) shapes
        slots = {n: slot for n in relevant if n not in layout.shapes and (slot := layout.experts.slot(n)) is not None
                 and not past_layers(n, layout.num_layers)}  # stored layers past the config's (MTP) are ignored
        stored = None if layout.packed else {n: tuple(names_shapes[n][0]) for n in slots}
        problems += expert_problems(slots, layout.shapes, stored)
    if layout.exact_names:
        missing = sorted(layout.needed - set(names_shapes))
        if missing:
            problems.append(f"tensor {missing[0]} is missing from the checkpoint ({len(missing)} missing in all); "
                            "it would be left randomly initialised: is the checkpoint complete?")
        unexpected = sorted(n for n in relevant if n not in layout.shapes)
        if unexpected:
            problems.append(f"{where.get(unexpected[0], unexpected[0])}: the model config.json describes has no "
                            f"tensor of this name ({len(unexpected)} such tensors); config and weights do not "
                            "belong together")
    # tensors stored under the model's own names (converted layouts too: the attention of an MoE model)
    for name in sorted(set(names_shapes) & set(layout.shapes)):
        shape, dtype = names_shapes[name]
        if layout.packed and dtype not in FLOAT_DTYPES:
            continue  # an NVFP4 Linear's packed weight: `formats.nvfp4.model.build_model` matches it
        if tuple(shape) != layout.shapes[name]:
            problems.append(f"{where.get(name, name)}: shape {list(shape)}, the model config.json describes "
                            f"expects {list(layout.shapes[name])}")
        elif name in layout.float_names and dtype not in FLOAT_DTYPES:
            problems.append(f"{where.get(name, name)}: stored as {dtype}, expected a floating-point weight "
                            f"({', '.join(FLOAT_DTYPES)})")
    return problems


def target_problems(path: str | os.PathLike, values: bool = True, layout: TargetLayout | None = None,
                    serving: bool = True) -> list[str]:
    """Everything wrong with a target checkpoint that still lets it be read, as user-facing lines.

    Raises CheckpointError for what prevents reading it at all (no config, damaged headers,
    pickle-only weights, a config transformers cannot build). `values`: also read every
    weight once (streaming) for NaN/Inf and all-zero norms. `serving`: also what an NVFP4
    checkpoint declares that runtimes would serve differently from the reference (fused Linears
    with different scales, ...); those do not stop the reference from loading it.
    """
    path = Path(path)
    cfg = read_target_config(path)
    layout = layout or target_layout(path, cfg)
    if detect_scheme(path, cfg) is not None:
        ckpt = NVFP4Checkpoint.open(path)
        if values:
            ckpt.validate()  # every block scale; loading validates them as it reads them
        source = ckpt.tensors
        problems = list(ckpt.damage) + (list(ckpt.problems) if serving else [])
        headers = {n: (list(shape), dtype) for n, (dtype, shape) in ckpt.headers.items()}
        problems += structure_problems(headers, _nvfp4_view(layout), {})
        plain = ckpt.other_tensor_names()
    else:
        source = SafetensorsDir(path)
        headers = {n: source.shape_and_dtype(n) for n in source}
        where = {n: f"{source.file_of(n).name}:{n}" for n in source}
        problems = structure_problems(headers, layout, where)
        plain = list(source)
    if values:
        roles = {n: role_of(n, len(headers[n][0])) for n in plain if headers[n][1] in FLOAT_DTYPES}
        where = {n: f"{source.file_of(n).name}:{n}" for n in roles}
        problems += scan_checkpoint(source, roles, where, zero_norms_ok=layout.zero_norms_ok).problems
    return problems


def _nvfp4_view(layout: TargetLayout) -> TargetLayout:
    # NVFP4 Linears store `weight` packed (another shape and dtype) plus scales: `build_model`
    # matches those tensor by tensor; here the layer count, the routed experts' count and the
    # tensors stored unquantized under the model's own names are compared.
    return TargetLayout(layout.shapes, layout.needed, layout.float_names, False, layout.ignore_unexpected,
                        layout.num_layers, layout.extra_layers, layout.zero_norms_ok, layout.experts, packed=True)


def check_target(path: str | os.PathLike, values: bool = False, layout: TargetLayout | None = None) -> None:
    """Refuse, in one line, a target checkpoint with any problem (`target_problems`)."""
    problems = target_problems(path, values=values, layout=layout, serving=False)
    if problems:
        raise CheckpointError(_first_of(Path(path), problems))


def _first_of(path: Path, problems: list[str]) -> str:
    more = f" ({len(problems) - 1} more problem(s): run `eagle31-export inspect {path}`)" if len(problems) > 1 else ""
    return f"target {path}: {problems[0]}{more}"


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype = torch.float32, act_quant: bool = False,
                   stored_weights: bool = False, nvfp4_semantics: str = "exact"):
    """A transformers causal LM with the checkpoint's weights, in `dtype`, in eval mode.

    The checkpoint is checked against its config before any weight is loaded, and the loaded
    weights for NaN/Inf and all-zero norms (in memory: no second read of the files).
    NVFP4 checkpoints get dequantized weights; with `act_quant` every quantized Linear also
    fake-quantizes its input to NVFP4, as the runtime's W4A4 GEMMs do. `nvfp4_semantics`: how stored
    scales become computed values, "exact" or an engine's (formats.nvfp4.scheme.NVFP4_SEMANTICS).

    `stored_weights`: keep the weights in memory as stored wherever `dtype` widens them exactly
    (a bf16 checkpoint stays bf16; NVFP4 Linears stay packed, `formats.nvfp4.model.NVFP4Linear`), for a
    caller that then computes in `dtype` per operation (`reference.upcast.compute_in`): about the
    checkpoint's bytes instead of 2x (bf16 in fp32) or ~7x (NVFP4 dequantized to fp32).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    cfg = read_target_config(path)
    nvfp4 = detect_scheme(path, cfg) is not None
    if act_quant and not nvfp4:
        raise CheckpointError(f"{path}: --act-quant needs an NVFP4 checkpoint; this one is not quantized")
    layout = target_layout(path, cfg)
    check_target(path, values=False, layout=layout)
    if nvfp4:
        from eagle31_export.formats.nvfp4.model import build_model

        model = build_model(NVFP4Checkpoint.open(path, semantics=nvfp4_semantics), dtype=dtype, act_quant=act_quant,
                            packed=stored_weights)
    else:
        model = _load_stored(path, dtype, layout) if stored_weights else _load_plain(path, dtype)
    params = list(model.named_parameters())
    roles = {n: role_of(n, p.dim()) for n, p in params}
    tables = _tables_read_sparsely(model, SafetensorsDir(path)) if stored_weights else set()
    scan = scan_tensors([(n, p) for n, p in params if n not in tables], roles, zero_norms_ok=layout.zero_norms_ok)
    scan.problems += check_values(SafetensorsDir(path).iter_chunks(sorted(tables)), roles).problems
    if scan.problems:
        raise CheckpointError(_first_of(path, scan.problems))
    return model


def _tables_read_sparsely(model: torch.nn.Module, source: SafetensorsDir) -> set[str]:
    """Embedding tables held as the checkpoint stores them (views of its file mapping), whose values
    are checked from the files in pieces instead of through the model: a forward reads only the
    rows of the tokens it sees, so the rest of a 128k-row table (1 GB at 8B widths, bf16) stays out
    of the process's memory. Tables under another name, dtype or shape are checked in memory."""
    names = {f"{prefix}.weight" if prefix else "weight" for prefix, module in model.named_modules()
             if isinstance(module, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = set()
    for name, param in model.named_parameters():
        if name not in names or name not in source or (head is not None and head.weight is param):
            continue  # a table the lm_head shares is read whole at every step anyway
        shape, dtype = source.shape_and_dtype(name)
        if tuple(shape) == tuple(param.shape) and FLOAT_TORCH_DTYPES.get(dtype) == param.dtype:
            out.add(name)
    return out


def _load_stored(path: Path, dtype: torch.dtype, layout: TargetLayout):
    """A plain checkpoint with its weights held as stored, for computing in `dtype` per operation.

    The model is loaded in the dtype most of its bytes are stored in, when `dtype` widens that
    exactly; tensors stored in a dtype that one does not hold exactly (DeepSeek-V3's fp32 routing
    bias among bf16 weights) then get their stored values back, so that nothing is rounded that a
    load in `dtype` keeps. Otherwise (a `dtype` no wider than the stored one, or such tensors under
    names the model renames) the weights are loaded in `dtype`, cast once, as `_load_plain` does."""
    source = SafetensorsDir(path)
    storage = stored_float_dtype(source)
    if storage is None or not upcasts_exactly(storage, dtype):
        return _load_plain(path, dtype)
    unheld = [n for n in source if (d := FLOAT_TORCH_DTYPES.get(source.headers[n].dtype)) is not None
              and d != storage and not upcasts_exactly(d, storage) and not _IGNORED.search(n)]
    if any(n not in layout.shapes for n in unheld):
        return _load_plain(path, dtype)
    model = _load_plain(path, storage)
    state = model.state_dict(keep_vars=True)
    for name in unheld:
        value = source[name].clone()  # not a view of the file mapping: the file may change later
        keep = value.dtype == dtype or upcasts_exactly(value.dtype, dtype)
        if state[name].dtype != value.dtype:
            state[name].data = value if keep else value.to(dtype)
    return model


def _load_plain(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    raw = read_target_config(path)
    try:
        if raw.get("model_type") in MODEL_TYPE_ALIASES:  # e.g. Kimi K2: the built-in DeepSeek-V3 class
            config = transformers_config(raw)
        else:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the target config ({err})") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # missing weights are reported below, as an error
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, dtype=dtype, local_files_only=True, trust_remote_code=False,
            use_safetensors=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: transformers cannot load the checkpoint ({first[:300]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    for key, what in (("missing_keys", "is missing from the checkpoint (it would be left randomly initialised)"),
                      ("mismatched_keys", "has a shape the model does not expect")):
        found = sorted(str(k if isinstance(k, str) else k[0]) for k in (info.get(key) or ()))
        if found:
            raise CheckpointError(f"{path}: tensor {found[0]} {what}; {len(found)} such tensor(s)")
    return model.eval()


def inspect_target(path: str | os.PathLike) -> dict[str, Any]:
    """Architecture, quantization (None when unquantized) and problems of a target folder.

    Every header is read and checked, the tensors are held against the model config.json
    describes, and every weight value is read once (streaming) for NaN/Inf and all-zero norms;
    for NVFP4 every block scale too. What prevents reading the checkpoint raises CheckpointError.
    """
    cfg = read_target_config(path)
    info = read_target_info(path)
    problems = target_problems(path, values=True)
    if detect_scheme(path, cfg) is None:
        return {"kind": "target", "quantization": None, "config": info.__dict__, "problems": problems,
                "warnings": []}
    ckpt = NVFP4Checkpoint.open(path)
    scheme = ckpt.scheme
    kv = None
    if scheme.kv_cache or ckpt.kv_scales:
        namings = sorted({parse_kv_scale(n)[2] for n in ckpt.kv_scale_names.values()})
        kv = {"algo": scheme.kv_cache, "scales": len(ckpt.kv_scales), "naming": namings}
    quantization = {
        "algo": "NVFP4",
        "format": scheme.format,
        "group_size": scheme.group_size,
        "activations": "nvfp4" if scheme.act_quant else None,
        "quantized_linears": len(ckpt.linears),
        "excluded": list(scheme.excluded),
        "kv_cache": kv,
    }
    return {"kind": "target", "quantization": quantization, "config": info.__dict__, "problems": problems,
            "warnings": list(ckpt.warnings)}
