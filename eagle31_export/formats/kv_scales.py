"""FP8 KV-cache scales: the tensor namings checkpoints use, and which of them each runtime reads.

A checkpoint with an FP8 KV cache stores per attention module a K and a V scale (fp32 scalars)
under one of three namings (docs/nvfp4.md#fp8-kv-cache-scales):

- `modelopt`:           `<attn>.k_proj.k_scale`, `<attn>.v_proj.v_scale`; ModelOpt's HF export writes
                        it for every attention, MLA included (where no `k_proj` module exists);
- `mla-kv-a`:           `<attn>.kv_a_proj_with_mqa.k_scale` / `.v_scale`, on the MLA latent projection;
- `compressed-tensors`: `<attn>.k_scale`, `<attn>.v_scale`.

The runtimes map them onto their own attention parameters, not all of them for every attention
kind; a scale under a naming a runtime does not read is dropped by it (with a log line) and the
runtime uses 1.0, as it does when a checkpoint declares an FP8 KV cache and stores no scales.
"""

from __future__ import annotations

from typing import Literal

Naming = Literal["modelopt", "mla-kv-a", "compressed-tensors"]

# (naming, K suffix, V suffix), the longest suffixes first: a name parses to its most specific
# naming (`x.k_proj.k_scale` is ModelOpt's scale of `x`, not compressed-tensors' of `x.k_proj`).
NAMINGS: tuple[tuple[Naming, str, str], ...] = (
    ("mla-kv-a", "kv_a_proj_with_mqa.k_scale", "kv_a_proj_with_mqa.v_scale"),
    ("modelopt", "k_proj.k_scale", "v_proj.v_scale"),
    ("compressed-tensors", "k_scale", "v_scale"),
)

# The namings each runtime's loader maps onto its KV-cache scales, per attention kind; every one
# reads ModelOpt's. Sources and versions: docs/nvfp4.md#fp8-kv-cache-scales.
RUNTIME_READS: dict[str, dict[str, tuple[Naming, ...]]] = {
    "vllm": {"gqa": ("modelopt", "compressed-tensors"), "mla": ("modelopt",)},
    "sglang": {"gqa": ("modelopt",), "mla": ("modelopt",)},
    "trtllm": {"gqa": ("modelopt",), "mla": ("modelopt",)},
}
RUNTIME_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


def parse_kv_scale(name: str) -> tuple[str, str, Naming] | None:
    """(attention module, 'k' or 'v', naming) of a KV-cache scale tensor name; None for any other."""
    for naming, k_suffix, v_suffix in NAMINGS:
        for which, suffix in (("k", k_suffix), ("v", v_suffix)):
            if name.endswith("." + suffix):
                return name[: -len(suffix) - 1], which, naming
    return None


def kv_scale_name(attn_module: str, which: str, naming: Naming) -> str:
    """The tensor name of the `which` ('k' or 'v') scale of `attn_module` under `naming`."""
    for candidate, k_suffix, v_suffix in NAMINGS:
        if candidate == naming:
            return f"{attn_module}.{k_suffix if which == 'k' else v_suffix}"
    raise ValueError(f"unknown KV-scale naming {naming!r}")


def runtime_renames(stored: dict[str, str], runtime: str, attention: str) -> dict[str, str]:
    """Stored name -> the name `runtime` reads, for every scale stored under a naming it does not read.

    `stored`: canonical key (`<attn>.k_scale`) -> stored tensor name; `attention`: 'gqa' or 'mla'."""
    reads = RUNTIME_READS[runtime][attention]
    renames = {}
    for name in stored.values():
        parsed = parse_kv_scale(name)
        if parsed is not None and parsed[2] not in reads:
            attn, which, _ = parsed
            renames[name] = kv_scale_name(attn, which, "modelopt")
    return renames
