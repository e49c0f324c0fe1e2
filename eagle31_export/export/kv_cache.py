"""The target's FP8 KV-cache scales in a serving bundle, named as the bundle's runtime reads them.

A scale stored under a naming the runtime does not read (formats/kv_scales.py: RUNTIME_READS)
would be dropped by it and replaced by 1.0. With `--copy-target` the bundle's copy of the target
stores such scales under ModelOpt's naming, which every runtime reads; a target referenced by path
cannot be changed, so the export says which scales the runtime will not see. `bundle.json` records
the scales under the names the runtime will read them by (`kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle31_export.formats.kv_scales import RUNTIME_NAMES, parse_kv_scale, runtime_renames


@dataclass(frozen=True)
class TargetKvCache:
    algo: str | None  # "FP8" when declared
    attention: str  # "mla" or "gqa": the runtimes read MLA scales under fewer namings
    values: dict[str, float]  # "<attn>.k_scale" / ".v_scale" -> value
    stored_names: dict[str, str]  # the same keys -> the tensor name in the checkpoint


def target_kv_cache(target: Path) -> TargetKvCache | None:
    """The FP8 KV cache an NVFP4 target declares or stores scales for; None otherwise."""
    from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
    from eagle31_export.formats.nvfp4.scheme import detect_scheme
    from eagle31_export.formats.target.checkpoint import read_target_config

    config = read_target_config(target)
    if detect_scheme(target, config) is None:
        return None
    ckpt = NVFP4Checkpoint.open(target)
    if not ckpt.scheme.kv_cache and not ckpt.kv_scales:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    attention = "mla" if text.get("kv_lora_rank") else "gqa"
    return TargetKvCache(ckpt.scheme.kv_cache, attention, dict(ckpt.kv_scales), dict(ckpt.kv_scale_names))


@dataclass(frozen=True)
class BundleKvCache:
    record: dict[str, Any] | None  # bundle.json `kv_cache`
    renames: dict[str, str]  # stored name -> name in the bundle's copy of the target
    warnings: list[str]


def bundle_kv_cache(kv: TargetKvCache | None, runtime: str, copy: bool) -> BundleKvCache:
    if kv is None:
        return BundleKvCache(None, {}, [])
    unread = runtime_renames(kv.stored_names, runtime, kv.attention)
    renames = unread if copy else {}
    warnings = []
    if unread and not copy:
        name = next(iter(unread))
        warnings.append(f"{RUNTIME_NAMES[runtime]} does not read KV-cache scales named like {name} ({len(unread)} "
                        f"scales) and will use 1.0 for them; pass --copy-target to have the bundle's copy of the "
                        f"target store them as it reads them ({unread[name]})")
    scales = {renames.get(stored, stored): kv.values[key] for key, stored in sorted(kv.stored_names.items())
              if stored not in unread or copy}
    stored_as = sorted({parse_kv_scale(n)[2] for n in kv.stored_names.values()})
    record = {"algo": kv.algo, "attention": kv.attention, "stored_naming": stored_as,
              "renamed_in_copy": len(renames), "scales": scales,
              "unread_scales": 0 if copy else len(unread)}
    return BundleKvCache(record, renames, warnings)
