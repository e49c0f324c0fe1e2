"""The serving-bundle contract: what `export trtllm|vllm|sglang` write and `export triton` reads.

Every serving bundle is a folder with the drafter rewritten for one runtime (`drafter/`), the
runtime's own configuration, a README with the exact server command, and `bundle.json`:

    {"kind": "trtllm", "target": "/abs/target" | "target", "drafter": "drafter",
     "max_draft_len": 3, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
     "aux_layer_ids": {"output_of_layer": [1, 3, 4], "before_layer": [2, 4, 5]},
     "kv_cache": null | {"algo": "FP8", "scales": {name as the runtime reads it: value}, ...},
     "warnings": [what the runtime serves with a default the target may not mean], ...}

The pair is checked here once for every runtime: the target must pass `inspect_target`, the
drafter must fit the target, and the tensor/pipeline split must divide the models evenly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from eagle31_export.config import DrafterConfig, TargetInfo, output_to_before_layer
from eagle31_export.errors import UserError
from eagle31_export.export.kv_cache import BundleKvCache, TargetKvCache, bundle_kv_cache, target_kv_cache
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, format_drafter, read_drafter
from eagle31_export.formats.pair import read_pair
from eagle31_export.formats.safetensors_io import read_json, save_tensors, write_json

BUNDLE_FILE = "bundle.json"
BUNDLE_VERSION = 1
BUNDLE_KINDS = ("trtllm", "vllm", "sglang")  # what `export trtllm|vllm|sglang` write


@dataclass
class CheckedPair:
    """A drafter whose tapped layers are resolved against its (validated) target."""

    checkpoint: DrafterCheckpoint  # config carries explicit aux_layer_ids (output-of-layer)
    target: Path  # absolute
    target_info: TargetInfo
    # What the runtimes serve with a default the target may not mean (`inspect_target` warnings).
    warnings: list[str] = field(default_factory=list)
    kv_cache: TargetKvCache | None = None  # the target's FP8 KV cache, when it declares or stores one

    @property
    def config(self) -> DrafterConfig:
        return self.checkpoint.config

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.checkpoint.config.aux_layer_ids  # type: ignore[return-value]


def checked_pair(drafter: str | os.PathLike, target: str | os.PathLike) -> CheckedPair:
    """Read both checkpoints and refuse, in one line, anything a server would run wrongly."""
    from eagle31_export.formats.target.checkpoint import inspect_target

    target = Path(target).resolve()
    report = inspect_target(target)
    if report["problems"]:
        raise UserError(f"target {target} is not servable: {report['problems'][0]}")
    spec = read_pair(drafter, target)
    # Servers must not fall back to THEIR default taps: write the resolved ids explicitly.
    ids = spec.aux_layer_ids
    if len(set(ids)) != len(ids):
        raise UserError(f"drafter {drafter} taps layers {list(ids)}, repeating one; servers keep tapped layers "
                        "as a set, so they cannot run it")
    ckpt = spec.checkpoint
    cfg = ckpt.config.replace(aux_layer_ids=ids, num_aux_hidden_states=len(ids))
    return CheckedPair(ascending_taps(DrafterCheckpoint(cfg, ckpt.tensors, ckpt.format, ckpt.path)), target,
                       spec.target_info, list(report["warnings"]), target_kv_cache(target))


class _Overridden(Mapping[str, Any]):
    """A lazy tensor mapping with a few tensors replaced (the rest are read on access)."""

    def __init__(self, base: Mapping[str, Any], changes: dict[str, Any]):
        self.base, self.changes = base, changes

    def __getitem__(self, name: str):
        return self.changes[name] if name in self.changes else self.base[name]

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def ascending_taps(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """The same drafter with its tapped layers listed in ascending order.

    vLLM, SGLang and TensorRT-LLM all concatenate the captured states in LAYER order, whatever
    order the config lists them in; the reference concatenates in list order. Reordering fc's
    input blocks (and fc_norm / input_norm with them) makes both agree.
    """
    cfg = ckpt.config
    ids = cfg.aux_layer_ids or ()
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    if order == list(range(len(ids))):
        return ckpt
    k, ht = cfg.num_aux_hidden_states, cfg.effective_target_hidden_size
    changes = {}
    for name in ("fc.weight", "input_norm.weight"):
        if name in ckpt.tensors:
            t = ckpt.tensors[name]
            changes[name] = t.reshape(*t.shape[:-1], k, ht)[..., order, :].reshape(t.shape).contiguous()
    if cfg.fc_norm:
        for new, old in enumerate(order):
            changes[f"fc_norm.{new}.weight"] = ckpt.tensors[f"fc_norm.{old}.weight"]
    cfg = cfg.replace(aux_layer_ids=tuple(sorted(ids)))
    return DrafterCheckpoint(cfg, _Overridden(ckpt.tensors, changes), ckpt.format, ckpt.path)


def parallel_problems(info: TargetInfo, cfg: DrafterConfig, tp: int, pp: int) -> list[str]:
    """Why a tensor-parallel size `tp` / pipeline size `pp` cannot split this pair evenly."""
    if tp < 1 or pp < 1:
        return [f"tensor and pipeline parallel sizes must be >= 1 (got tp={tp}, pp={pp})"]
    problems = []
    sizes = {
        "target num_attention_heads": info.num_attention_heads,
        "target intermediate_size": info.intermediate_size,
        "target vocab_size": info.vocab_size,
        "drafter num_attention_heads": cfg.num_attention_heads,
        "drafter intermediate_size": cfg.intermediate_size,
        "drafter draft_vocab_size": cfg.draft_vocab_size,
    }
    for what, n in sizes.items():
        if n and n % tp:
            problems.append(f"{what} {n} is not divisible by --tp {tp}")
    # KV heads may also be replicated when tp is a multiple of them (runtimes duplicate them).
    for what, n in (("target num_key_value_heads", info.num_key_value_heads),
                    ("drafter num_key_value_heads", cfg.num_key_value_heads)):
        if cfg.attention == "mla" and what.startswith("drafter"):
            continue
        if n % tp and tp % n:
            problems.append(f"{what} {n} neither divides nor is divisible by --tp {tp}")
    if info.num_hidden_layers % pp:
        problems.append(f"target num_hidden_layers {info.num_hidden_layers} is not divisible by --pp {pp}")
    return problems


def check_parallel(info: TargetInfo, cfg: DrafterConfig, tp: int, pp: int) -> None:
    problems = parallel_problems(info, cfg, tp, pp)
    if problems:
        raise UserError(f"{problems[0]}; choose a --tp/--pp that divides the model evenly")


def write_drafter_files(ckpt: DrafterCheckpoint, folder: Path, fmt_name: str,
                        config_patch: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the drafter into `folder` (inside the caller's atomic output) in a known format.

    Unlike `write_drafter`, no nested atomic folder or manifest: the bundle has one manifest.
    `config_patch` overrides top-level config keys a runtime needs (e.g. its architecture name).
    """
    config, tensors = format_drafter(ckpt, fmt_name, config_patch)  # the same rules as write_drafter
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors, folder)
    write_json(folder / "config.json", config)
    return config


def bundle_target(pair: CheckedPair, kind: str, copy: bool, tmp: Path) -> BundleKvCache:
    """The target's side of a bundle of `kind`: copied into `tmp / "target"` with `--copy-target` (its
    KV-cache scales under the names the runtime reads), and what bundle.json records about it."""
    kv = bundle_kv_cache(pair.kv_cache, kind, copy)
    if copy:
        copy_target(pair.target, tmp / "target", kv.renames)
    return kv


def bundle_record(kind: str, pair: CheckedPair, target_ref: str, max_draft_len: int,
                  tp: int, pp: int, kv: BundleKvCache | None = None, **extra: Any) -> dict[str, Any]:
    ids = list(pair.aux_layer_ids)
    kv = kv or BundleKvCache(None, {}, [])
    return {
        "kind": kind,
        "bundle_version": BUNDLE_VERSION,
        "target": target_ref,
        "drafter": "drafter",
        "eagle_version": pair.config.eagle_version,
        "max_draft_len": max_draft_len,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "aux_layer_ids": {"output_of_layer": ids, "before_layer": list(output_to_before_layer(tuple(ids)))},
        "drafter_source": {"path": str(pair.checkpoint.path.resolve()) if pair.checkpoint.path else None,
                           "format": pair.checkpoint.format},
        "kv_cache": kv.record,
        # What the runtime serves with a default the target may not mean; the export prints each line.
        "warnings": pair.warnings + kv.warnings,
        **extra,
    }


def copy_target(target: Path, dest: Path, renames: Mapping[str, str] | None = None) -> None:
    """Copy the target checkpoint file by file (large shards are streamed by the OS copy), with the
    tensors of `renames` under their new names. A target written by this tool keeps its manifest only
    when copied unchanged (the bundle's own manifest covers the copy either way)."""
    from eagle31_export.formats.outputs import MANIFEST
    from eagle31_export.formats.drafter.renames import copy_folder_renaming

    if copy_folder_renaming(target, dest, renames or {}) and (dest / MANIFEST).is_file():
        (dest / MANIFEST).unlink()


def read_bundle(bundle: str | os.PathLike) -> dict[str, Any]:
    """bundle.json with `target` and `drafter` resolved to absolute paths."""
    bundle = Path(bundle).resolve()
    if not (bundle / BUNDLE_FILE).is_file():
        raise UserError(f"{bundle}: no {BUNDLE_FILE}; pass a folder written by `eagle31-export export trtllm|vllm|sglang`")
    record = read_json(bundle / BUNDLE_FILE)
    for key in ("kind", "target", "drafter", "max_draft_len"):
        if key not in record:
            raise UserError(f"{bundle / BUNDLE_FILE}: lacks {key!r}; re-export the bundle")
    if record["kind"] not in BUNDLE_KINDS:
        raise UserError(f"{bundle / BUNDLE_FILE}: unknown bundle kind {record['kind']!r}; this version writes and "
                        f"reads {', '.join(BUNDLE_KINDS)} bundles: re-export it")
    for key in ("target", "drafter"):
        if not isinstance(record[key], str) or not record[key]:
            raise UserError(f"{bundle / BUNDLE_FILE}: {key} is {record[key]!r}; expected a folder path")
    depth = record["max_draft_len"]
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise UserError(f"{bundle / BUNDLE_FILE}: max_draft_len is {depth!r}; expected a positive integer")
    record["target"] = str((bundle / record["target"]).resolve())  # absolute paths survive the join
    record["drafter"] = str((bundle / record["drafter"]).resolve())
    if not Path(record["target"], "config.json").is_file():
        raise UserError(f"bundle target {record['target']} is missing; re-export with --copy-target or restore it")
    return record


def read_bundle_drafter(record: Mapping[str, Any]) -> DrafterCheckpoint:
    """The bundle's drafter in canonical names, whatever runtime layout it was written in."""
    return read_drafter(record["drafter"])
