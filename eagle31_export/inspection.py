"""What `inspect` reports about a drafter or target folder, as one JSON-able dict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from eagle31_export.config import ConfigError, long_context_problems, output_to_before_layer, with_max_positions
from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, t2d_from_d2t
from eagle31_export.formats.drafter.engine_taps import missing_taps_problem
from eagle31_export.formats.outputs import check_enclosing_output
from eagle31_export.formats.pair import pair_problems
from eagle31_export.formats.safetensors_io import read_json
from eagle31_export.formats.target.checkpoint import inspect_target, read_target_info
from eagle31_export.formats.trtllm_options import read_options, speculation_switch_warnings


def is_drafter(path: Path) -> bool:
    from eagle31_export.formats.drafter.formats import looks_like_drafter  # the markers detect_format uses

    return looks_like_drafter(read_json(path / "config.json"))


def inspect_path(path: str | os.PathLike, target: str | os.PathLike | None = None) -> dict[str, Any]:
    path = Path(path)
    if (path.is_file() and path.suffix in (".yaml", ".yml")) or (path / LLM_API_FILE).is_file():
        if target is not None:
            raise CheckpointError(f"{path} is TensorRT-LLM options; --target only applies to drafters")
        return inspect_llm_api(path / LLM_API_FILE if path.is_dir() else path)
    check_enclosing_output(path)  # before config.json is read to tell a drafter from a target
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; pass a drafter or target checkpoint folder, or TensorRT-LLM's "
                              "LLM-API YAML")
    if not is_drafter(path):
        if target is not None:
            raise CheckpointError(f"{path} is a target checkpoint; --target only applies to drafters")
        return inspect_target(path)
    return inspect_drafter(path, target)


LLM_API_FILE = "llm_api.yaml"  # what `export trtllm` writes beside the drafter


def inspect_llm_api(path: Path) -> dict[str, Any]:
    """TensorRT-LLM LLM-API options: their speculative_config, and the switches that turn speculation off."""
    options = read_options(path)
    spec = options.get("speculative_config")
    return {"kind": "trtllm-options", "config": spec if isinstance(spec, dict) else {}, "problems": [],
            "warnings": speculation_switch_warnings(options, path.name)}


def inspect_drafter(path: Path, target: str | os.PathLike | None) -> dict[str, Any]:
    ckpt = read_drafter(path, strict=False)  # value problems are reported, not raised
    cfg = ckpt.config
    problems: list[str] = list(ckpt.problems)
    warnings: list[str] = []
    ids = cfg.aux_layer_ids
    source = "config" if ids is not None else "default"
    if target is not None:
        info = read_target_info(target)
        problems += pair_problems(ckpt, info) if not ckpt.problems else []
        problems += long_context_problems(cfg, info)  # a problem here, but no export refuses the pair for it
        if ids is None and not any("tapped" in p for p in problems):
            try:
                ids, source = cfg.resolved_aux_layer_ids(info.num_hidden_layers), "default for the target"
            except ConfigError:
                pass  # pair_problems already says why the default does not apply
        # What blocks exporting the target blocks exporting the pair (export.bundle.checked_pair).
        target_report = inspect_target(target)
        problems += [f"target: {p}" for p in target_report["problems"]]
        warnings += [f"target: {w}" for w in target_report["warnings"]]
    resolved = with_max_positions(cfg, info if target is not None else None)
    config = resolved.to_dict()
    config["aux_layer_ids"] = list(ids) if ids is not None else None
    if cfg.aux_layer_ids is None:  # every engine then taps its own default (formats/drafter/engine_taps.py)
        problems.append(missing_taps_problem(info.num_hidden_layers if target is not None else None))
    report = {
        "kind": "drafter",
        "format": ckpt.format,
        "origin": ckpt.origin or ckpt.format,
        "eagle_version": cfg.eagle_version,
        "eagle_variant": cfg.eagle_variant,
        "config": config,
        "tapped_layers": {
            "output_of_layer": list(ids) if ids is not None else None,
            "before_layer": list(output_to_before_layer(ids)) if ids is not None else None,
            "source": source,
        },
        "vocabulary": vocabulary_summary(ckpt),
        "tensors": sorted(ckpt.tensors),
        "unknown_config_keys": ckpt.unknown_config_keys,
        "problems": problems,
        "warnings": warnings,
    }
    lint_problems, lint_warnings, report["engine_defaults"] = drafter_lints(ckpt, path, target)
    problems += lint_problems
    warnings += lint_warnings
    if ids is None:
        report["taps"] = DEFAULT_TAPS_NOTE
    report["max_positions"] = MAX_POSITIONS_NOTES[resolved.max_position_source].format(
        n=resolved.max_position_embeddings)
    return report


def drafter_lints(ckpt: DrafterCheckpoint, path: Path, target: str | os.PathLike | None
                  ) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(problems, warnings, per-flag table) of what the engines would run differently from this package's
    reading: EAGLE 3.1 flags left to defaults or nested where an engine does not look, a drafter's own
    embed_tokens, a declared sliding window (formats/drafter/engine_defaults.py; docs/silent-bugs.md)."""
    from eagle31_export.formats.drafter.engine_defaults import SGLANG_EMBED, VLLM_EMBED, flag_lints, window_lint
    from eagle31_export.formats.drafter.formats import FORMATS

    cfg = ckpt.config
    raw = read_json(path / "config.json")
    ours = {"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "norm_before_fc": cfg.norm_before_fc}
    problems, warnings, table = flag_lints(raw, ckpt.format, FORMATS[ckpt.format].flag_keys, ours)
    window = window_lint(cfg.extras)
    if window:
        warnings.append(window)
    if "embed_tokens.weight" in ckpt.tensors:
        same = None if target is None else _same_embeddings(ckpt, Path(target))
        if same is False:
            problems.append(f"the drafter carries embed_tokens that differ from the target's: {VLLM_EMBED}; "
                            f"{SGLANG_EMBED}; the two engines run different drafters (the reference here uses "
                            "the drafter's own)")
        elif same is None:
            warnings.append(f"the drafter carries its own embed_tokens: {VLLM_EMBED}; {SGLANG_EMBED}; pass --target "
                            "to compare them with the target's")
    return problems, warnings, table


def bundle_lints(folder: str | os.PathLike) -> list[str]:
    """What `verify` warns about a serving bundle's drafter: `drafter_lints` on the drafter the engine
    will read, against the bundle's target, and a copy broken on purpose (`sabotage`) named as such."""
    folder = Path(folder)
    record = read_json(folder / "bundle.json")
    drafter, target = folder / str(record.get("drafter")), folder / str(record.get("target"))
    lines = []
    if isinstance(record.get("sabotage"), dict):
        lines.append(f"this bundle is a broken copy on purpose ({record['sabotage'].get('name')}): never serve it")
    try:
        ckpt = read_drafter(drafter, strict=False)
        problems, warnings, _ = drafter_lints(ckpt, drafter, target if (target / "config.json").is_file() else None)
    except UserError as err:  # a changed drafter: verify's own differences say what changed
        return lines + [f"bundle drafter: {err}"]
    return lines + [f"bundle drafter: {line}" for line in ckpt.problems + problems + warnings]


def _same_embeddings(ckpt: DrafterCheckpoint, target: Path) -> bool | None:
    """Whether the drafter's embed_tokens equal the target's (None: the target's table was not found)."""
    from eagle31_export.formats.safetensors_io import SafetensorsDir

    source = SafetensorsDir(target)
    names = [n for n in source if n.endswith("embed_tokens.weight")]
    if len(names) != 1:
        return None
    mine, theirs = ckpt.tensors["embed_tokens.weight"], source[names[0]]
    return mine.shape == theirs.shape and bool(torch.equal(mine.to(theirs.dtype), theirs))


# What `inspect` says about the drafter's max_position_embeddings (config.with_max_positions).
MAX_POSITIONS_NOTES = {
    "config": "{n} (the drafter's config)",
    "target": "{n}, from the target (the drafter's config names no max_position_embeddings)",
    "rope_scaling": "{n}, from rope_scaling (original_max_position_embeddings * factor: the drafter's config "
                    "names no max_position_embeddings; pass --target to take the target's)",
    "default": "{n} assumed: the drafter's config names no max_position_embeddings; pass --target to take the "
               "target's",
}


DEFAULT_TAPS_NOTE = "default ({1, N//2-1, N-4} for an N-layer target; pass --target to resolve)"


def vocabulary_summary(ckpt: DrafterCheckpoint) -> dict[str, Any]:
    """The draft vocabulary: its size, the target ids it covers, and what d2t and t2d hold.

    `d2t`: "identity" (all offsets zero), "offsets", or "absent" (draft id = target id);
    `t2d`: "agrees with d2t", "differs from d2t" or "absent"; `target_ids` is None when d2t
    points outside the target vocabulary (a problem `inspect` lists)."""
    cfg = ckpt.config
    out: dict[str, Any] = {"vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size}
    has_d2t = "d2t" in ckpt.tensors
    d2t = ckpt.d2t()  # zeros when absent
    ids = torch.arange(d2t.numel()) + d2t
    in_range = bool(ids.numel()) and int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size
    out["target_ids"] = {"min": int(ids.min()), "max": int(ids.max())} if in_range else None
    out["d2t"] = ("offsets" if bool(d2t.any()) else "identity") if has_d2t else "absent"
    if "t2d" not in ckpt.tensors:
        out["t2d"] = "absent"
    elif not in_range:
        out["t2d"] = "differs from d2t"
    else:
        same = torch.equal(ckpt.tensors["t2d"].to(torch.bool), t2d_from_d2t(d2t, cfg.vocab_size))
        out["t2d"] = "agrees with d2t" if same else "differs from d2t"
    return out
