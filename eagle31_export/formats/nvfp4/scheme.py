"""The two NVFP4 checkpoint conventions: how they are declared, named and excluded.

ModelOpt:            `hf_quant_config.json` and/or config.json `quantization_config`
                     (`quant_method: modelopt`); per Linear `weight` (uint8), `weight_scale`
                     (e4m3), `weight_scale_2` and `input_scale` (fp32 scalars); FP8 KV-cache
                     scales `k_proj.k_scale` / `v_proj.v_scale`.
compressed-tensors:  config.json `quantization_config` (`quant_method: compressed-tensors`,
                     format `nvfp4-pack-quantized`); per Linear `weight_packed`, `weight_scale`,
                     `weight_global_scale` and `input_global_scale`, the global scales being
                     the RECIPROCALS of ModelOpt's; KV-cache scales `self_attn.k_scale`.

Everything else in the package speaks ModelOpt's convention (scale, not reciprocal); this
module is the edge where the compressed-tensors names and reciprocals are translated.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from eagle31_export.errors import CheckpointError
from eagle31_export.formats.nvfp4.numerics import BLOCK_SIZE, reciprocal_f32
from eagle31_export.formats.safetensors_io import read_json

Format = Literal["modelopt", "compressed-tensors"]
FORMATS: tuple[str, ...] = ("modelopt", "compressed-tensors")
HF_QUANT_CONFIG = "hf_quant_config.json"
CT_FORMAT = "nvfp4-pack-quantized"
PRODUCER = "eagle31-export"

# Per-Linear tensor suffixes, by canonical role.
SUFFIXES: dict[str, dict[str, str]] = {
    "modelopt": {"packed": "weight", "scale": "weight_scale", "global": "weight_scale_2", "input": "input_scale"},
    "compressed-tensors": {
        "packed": "weight_packed", "scale": "weight_scale",
        "global": "weight_global_scale", "input": "input_global_scale",
    },
}
# Linears that runtimes fuse into one GEMM and that must therefore share weight_scale_2.
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)
# vLLM's packed-module names, so an exclusion written for a fused module names its parts.
_PACKED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Safetensors header key holding exact source values of reciprocal scales (see exact_inverse).
EXACT_INVERSE_KEY = "nvfp4_exact_inverse"


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint declares about its NVFP4 quantization."""

    format: Format
    excluded: tuple[str, ...] = ()
    kv_cache: str | None = None  # "FP8" or None
    act_quant: bool = True  # inputs quantized too (W4A4); False for weight-only NVFP4
    group_size: int = BLOCK_SIZE
    producer: dict[str, Any] | None = field(default=None, compare=False)

    def suffix(self, role: str) -> str:
        return SUFFIXES[self.format][role]

    def is_reciprocal(self) -> bool:
        """Whether stored global scales are 1/scale (compressed-tensors) rather than scale."""
        return self.format == "compressed-tensors"

    def kv_scale_name(self, attn_module: str, which: str) -> str:
        """Tensor name of the FP8 KV-cache scale `which` ('k' or 'v') of an attention module."""
        if self.format == "modelopt":
            return f"{attn_module}.{which}_proj.{which}_scale"
        return f"{attn_module}.{which}_scale"


# ---------------------------------------------------------------------------------------------
# Detection


def detect_scheme(folder: str | Path, config: dict[str, Any] | None = None) -> QuantScheme | None:
    """The NVFP4 scheme a checkpoint folder declares, None for an unquantized checkpoint."""
    folder = Path(folder)
    config = read_json(folder / "config.json") if config is None else config
    qc = config.get("quantization_config")
    hf_quant = folder / HF_QUANT_CONFIG
    if hf_quant.is_file():
        return _modelopt_from_hf_quant_config(hf_quant, read_json(hf_quant))
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt_from_config_json(folder / "config.json", qc)
    if method == "compressed-tensors":
        return _compressed_tensors_from_config_json(folder / "config.json", qc)
    raise CheckpointError(
        f"{folder / 'config.json'}: quant_method {qc.get('quant_method')!r} is not supported; "
        "only NVFP4 from ModelOpt ('modelopt') or compressed-tensors is"
    )


def _modelopt_from_hf_quant_config(path: Path, doc: dict[str, Any]) -> QuantScheme:
    q = doc.get("quantization")
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: missing the 'quantization' object")
    for key in ("quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules"):
        if key not in q:  # vLLM refuses such files too
            raise CheckpointError(f"{path}: 'quantization' lacks {key!r}; ModelOpt writes quant_algo, "
                                  "kv_cache_quant_algo, group_size and exclude_modules")
    return _modelopt_scheme(path, q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"],
                            q["exclude_modules"], doc.get("producer"))


def _modelopt_from_config_json(path: Path, qc: dict[str, Any]) -> QuantScheme:
    if isinstance(qc.get("quantization"), dict):  # hf_quant_config.json copied in verbatim
        return _modelopt_from_hf_quant_config(path, qc)
    weights = (qc.get("config_groups") or {}).get("group_0", {}).get("weights", {})
    group_size = qc.get("group_size", weights.get("group_size"))
    kv = qc.get("kv_cache_quant_algo")
    if kv is None and isinstance(qc.get("kv_cache_scheme"), dict):
        kv = "FP8" if qc["kv_cache_scheme"].get("num_bits") == 8 else str(qc["kv_cache_scheme"])
    return _modelopt_scheme(path, qc.get("quant_algo"), group_size, kv, qc.get("ignore", []), qc.get("producer"))


def _modelopt_scheme(path: Path, algo, group_size, kv, excluded, producer) -> QuantScheme:
    algo_name = str(algo or "").upper()
    if algo_name not in ("NVFP4", "W4A16_NVFP4"):
        raise CheckpointError(f"{path}: quant_algo {algo!r} is not supported; expected 'NVFP4'")
    _check_group_size(path, group_size)
    if kv is not None and str(kv).upper() != "FP8":
        raise CheckpointError(f"{path}: kv_cache_quant_algo {kv!r} is not supported; expected 'FP8' or null")
    return QuantScheme("modelopt", _exclusions(path, excluded), "FP8" if kv else None,
                       act_quant=algo_name == "NVFP4", producer=producer)


def _compressed_tensors_from_config_json(path: Path, qc: dict[str, Any]) -> QuantScheme:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{path}: compressed-tensors config has {len(groups)} config_groups; "
                              "only a single NVFP4 group (targets: Linear) is supported")
    (group,) = groups.values()
    weights = group.get("weights") or {}
    fmt = group.get("format") or qc.get("format")
    if fmt != CT_FORMAT or weights.get("num_bits") != 4 or weights.get("type") != "float":
        raise CheckpointError(f"{path}: compressed-tensors scheme is not NVFP4 (format {fmt!r}, weights "
                              f"{weights.get('num_bits')}-bit {weights.get('type')}); expected {CT_FORMAT!r}")
    _check_group_size(path, weights.get("group_size"))
    acts = group.get("input_activations")
    if acts is not None:
        _check_group_size(path, acts.get("group_size"), what="input_activations group_size")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not (kv.get("num_bits") == 8 and kv.get("type") == "float"):
        raise CheckpointError(f"{path}: kv_cache_scheme {kv} is not supported; expected 8-bit float (FP8)")
    return QuantScheme("compressed-tensors", _exclusions(path, qc.get("ignore", [])),
                       "FP8" if kv else None, act_quant=acts is not None)


def _check_group_size(path: Path, group_size, what: str = "group_size") -> None:
    if group_size != BLOCK_SIZE:
        raise CheckpointError(f"{path}: {what} is {group_size!r}; NVFP4 uses blocks of {BLOCK_SIZE}")


def _exclusions(path: Path, excluded) -> tuple[str, ...]:
    if not isinstance(excluded, list) or not all(isinstance(e, str) for e in excluded):
        raise CheckpointError(f"{path}: the exclusion list must be a list of module names or patterns")
    return tuple(excluded)


# ---------------------------------------------------------------------------------------------
# Exclusions: matched as vLLM does (exact name, substring, fnmatch wildcard; "re:" regex for
# compressed-tensors), with vLLM's fused names (qkv_proj, gate_up_proj) naming their parts.


def pattern_matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if pattern == module or pattern in module or fnmatch.fnmatchcase(module, pattern):
        return True
    head, _, last = pattern.rpartition(".")
    for part in _PACKED_NAMES.get(last, ()):
        if pattern_matches(f"{head}.{part}" if head else part, module):
            return True
    return False


def is_excluded(module: str, patterns: Iterable[str]) -> bool:
    return _compiled(tuple(patterns))(module)


def _expanded(pattern: str) -> list[str]:
    """The pattern and, for a vLLM fused name (qkv_proj, gate_up_proj), the names of its parts."""
    head, _, last = pattern.rpartition(".")
    return [pattern] + [q for part in _PACKED_NAMES.get(last, ()) for q in _expanded(f"{head}.{part}" if head else part)]


@functools.lru_cache(maxsize=32)
def _compiled(patterns: tuple[str, ...]):
    """`is_excluded` for one pattern list, precompiled: an MoE checkpoint matches tens of thousands of
    modules against a list naming every layer."""
    return _compile_list(patterns)


def _compile_list(patterns: tuple[str, ...]):
    """A matcher equal to `any(pattern_matches(p, module) for p in patterns)`: every pattern (and fused-name
    expansion) as a substring (exact names included); wildcards ending in one `*` as prefixes, other
    wildcards as one fnmatch regex; "re:" patterns on their own."""
    regexes = [re.compile(p[3:]) for p in patterns if p.startswith("re:")]
    plain = [q for p in patterns if not p.startswith("re:") for q in _expanded(p)]
    def wildcard(q: str) -> bool:
        return any(c in q for c in "*?[")

    prefixes = tuple(q[:-1] for q in plain if q.endswith("*") and not wildcard(q[:-1]))
    wild = [q for q in plain if wildcard(q) and not (q.endswith("*") and not wildcard(q[:-1]))]
    union = re.compile("|".join(f"(?:{fnmatch.translate(q)})" for q in wild)) if wild else None

    def matches(module: str) -> bool:
        return (module.startswith(prefixes) or any(q in module for q in plain)
                or (union is not None and union.match(module) is not None) or any(r.match(module) for r in regexes))

    return matches


# MoE routers that runtimes build unquantized whatever the exclusion list says, so that a BF16 router
# missing from it is served as stored (docs/nvfp4.md#moe-routers-and-the-exclusion-list): vLLM's
# DeepseekV2MoE (DeepSeek-V2/V3, Kimi K2) makes its gate a GateLinear with quant_config=None, and
# TensorRT-LLM's DeepseekV3Gate holds a plain weight parameter. Routers of other architectures
# (Qwen3-MoE, ...) are built with the checkpoint's quant config and must be listed.
UNQUANTIZED_ROUTER_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def unlisted_router_ok(config: dict[str, Any]) -> bool:
    """Whether runtimes serve this architecture's MoE routers unquantized without an exclusion entry."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("model_type", config.get("model_type")) in UNQUANTIZED_ROUTER_MODEL_TYPES


def is_router(module: str) -> bool:
    """A MoE router (`...mlp.gate`), as DeepSeek-style and Qwen/Mixtral-style checkpoints name it."""
    return module.endswith((".mlp.gate", ".block_sparse_moe.gate"))


def unmatched_patterns(patterns: Iterable[str], modules: Iterable[str]) -> list[str]:
    modules = list(modules)
    matchers = {p: _compile_list((p,)) for p in dict.fromkeys(patterns)}
    remaining = list(matchers)
    for module in modules:  # every pattern leaves the list at its first match
        remaining = [p for p in remaining if not matchers[p](module)]
        if not remaining:
            break
    return [p for p in patterns if p in remaining]


# ---------------------------------------------------------------------------------------------
# Writing the declarations


def modelopt_hf_quant_config(scheme: QuantScheme) -> dict[str, Any]:
    return {
        "producer": scheme.producer or _producer(),
        "quantization": {
            "quant_algo": "NVFP4" if scheme.act_quant else "W4A16_NVFP4",
            "kv_cache_quant_algo": scheme.kv_cache,
            "group_size": scheme.group_size,
            "exclude_modules": list(scheme.excluded),
        },
    }


def modelopt_quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    """config.json `quantization_config`, laid out as ModelOpt's export writes it."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": scheme.group_size}
    group: dict[str, Any] = {"weights": dict(fp4), "targets": ["Linear"]}
    if scheme.act_quant:
        group = {"input_activations": dict(fp4), **group}
    out: dict[str, Any] = {"config_groups": {"group_0": group}, "ignore": list(scheme.excluded),
                           "quant_algo": "NVFP4" if scheme.act_quant else "W4A16_NVFP4"}
    if scheme.kv_cache:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = scheme.producer or _producer()
    out["quant_method"] = "modelopt"
    return out


def compressed_tensors_quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": scheme.group_size,
           "strategy": "tensor_group", "block_structure": None, "actorder": None, "observer": "minmax",
           "observer_kwargs": {}}
    group: dict[str, Any] = {
        "targets": ["Linear"],
        "weights": {**fp4, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None},
        "input_activations": {**fp4, "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
        if scheme.act_quant else None,
        "output_activations": None,
        "format": CT_FORMAT,
    }
    kv = None
    if scheme.kv_cache:
        kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(scheme.excluded),
        "kv_cache_scheme": kv,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def write_declarations(folder: Path, config: dict[str, Any], scheme: QuantScheme) -> None:
    """config.json with `quantization_config`, plus hf_quant_config.json for ModelOpt."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if scheme.format == "modelopt":
        config["quantization_config"] = modelopt_quantization_config(scheme)
        _dump(folder / HF_QUANT_CONFIG, modelopt_hf_quant_config(scheme))
    else:
        config["quantization_config"] = compressed_tensors_quantization_config(scheme)
    _dump(folder / "config.json", config)


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=4) + "\n")


def _producer() -> dict[str, str]:
    from eagle31_export import __version__

    return {"name": PRODUCER, "version": __version__}


# ---------------------------------------------------------------------------------------------
# Reciprocal scales across the two conventions.

# How a reader turns stored scales into the values it computes with:
# - "exact": what the checkpoint means; a compressed-tensors global scale is inverted back to the
#   exact ModelOpt value where the converter recorded it (EXACT_INVERSE_KEY), else in FP32;
# - "vllm": as vLLM 0.32's loaders compute (compressed_tensors_w4a4_nvfp4.py:
#   process_weights_after_loading): `1.0 / weight_global_scale` in FP32, any record ignored.
#   ModelOpt scales are read as stored under both. (Per-tensor scales of fused q/k/v and gate/up
#   Linears, which vLLM merges by their max, must agree already: the reader lists a problem otherwise.)
NVFP4_SEMANTICS = ("exact", "vllm")


def exact_inverse(stored: float, recorded: float | None, semantics: str = "exact") -> float:
    """The other convention's value of a stored global scale.

    FP32 reciprocals do not round-trip for about one value in seven, so a converter that
    writes reciprocals records the source value in the shard's header (EXACT_INVERSE_KEY).
    A record is used only while it is still consistent with the stored value, and only under the
    "exact" semantics (NVFP4_SEMANTICS): an engine that inverts in FP32 never reads it.
    """
    if semantics == "exact" and recorded is not None and reciprocal_f32(recorded) == stored:
        return recorded
    return reciprocal_f32(stored)


def parse_exact_inverse(metadata: dict[str, str] | None) -> dict[str, float]:
    raw = (metadata or {}).get(EXACT_INVERSE_KEY)
    if not raw:
        return {}
    try:
        return {name: float.fromhex(value) for name, value in json.loads(raw).items()}
    except (ValueError, AttributeError, TypeError):
        return {}  # a damaged record is ignored: plain reciprocals are still correct to 1 ulp
