"""Broken copies on purpose: the silent bugs users have reported, applied to a drafter or a serving bundle.

Each class (`SABOTAGES`) has a name, a one-line description and its public report(s), and makes a copy
that differs from its source exactly as described and in nothing else: the copy's config.json keys
and tensors are edited in place, every other byte is copied (docs/silent-bugs.md lists the classes,
what catches each and what it measured).

    eagle31-export sabotage BUNDLE_OR_DRAFTER --bug NAME --out DIR
    write_sabotaged(source, "random_embed_tokens", out)

A bundle's copy keeps `drafter_source` pointing at the faithful drafter it was exported from, so
`parity` compares the faithful reference with the engine serving the broken copy; `bundle.json`
records the class under "sabotage". A drafter's copy gets a `sabotage.json` beside its weights.

The functions on a `DrafterCheckpoint` (`shift_aux_ids`, `pre_norm_feedback`, ...) return the broken
checkpoint for code that writes it itself (tests, benchmarks/verdict_power.py); the NVFP4 target edits at
the end change a checkpoint folder in place. No module of the library imports this one (it sits on
the top layer of the import-linter contract in pyproject.toml).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from eagle31_export.config import DrafterConfig, TargetInfo
from eagle31_export.errors import UserError
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter
from eagle31_export.formats.drafter.formats import FORMATS, DrafterFormat
from eagle31_export.formats.outputs import MANIFEST, atomic_output_dir, check_consumed, read_manifest
from eagle31_export.formats.safetensors_io import INDEX_NAME, read_json, write_json

BUNDLE_FILE = "bundle.json"  # export/bundle.py's; read here as plain JSON
RECORD_FILE = "sabotage.json"  # beside a sabotaged drafter's weights


class Edited(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors with a few replaced, added or removed (the rest read from `base` on access)."""

    def __init__(self, base: Mapping[str, torch.Tensor], changes: Mapping[str, torch.Tensor] | None = None,
                 removed: set[str] | frozenset[str] = frozenset()):
        self.base, self.changes, self.removed = base, dict(changes or {}), frozenset(removed)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.removed:
            raise KeyError(name)
        return self.changes[name] if name in self.changes else self.base[name]

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self.base if n not in self.removed)
        yield from (n for n in self.changes if n not in self.base)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _with(ckpt: DrafterCheckpoint, config: DrafterConfig | None = None, changes=None, removed=frozenset()
          ) -> DrafterCheckpoint:
    tensors = Edited(ckpt.tensors, changes, removed) if changes or removed else ckpt.tensors
    return DrafterCheckpoint(config or ckpt.config, tensors, ckpt.format, ckpt.path)


# ---------------------------------------------------------------- classes on a DrafterCheckpoint

def shift_aux_ids(ckpt: DrafterCheckpoint, target_layers: int) -> DrafterCheckpoint:
    """The off-by-one between "before layer i" and "output of layer i" numbering."""
    ids = ckpt.config.resolved_aux_layer_ids(target_layers)
    return _with(ckpt, ckpt.config.replace(aux_layer_ids=tuple(i + 1 for i in ids)))


def pre_norm_feedback(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """An EAGLE 3.1 drafter run with EAGLE-3's pre-norm feedback (norm_output dropped)."""
    return _with(ckpt, ckpt.config.replace(norm_output=False))


def drop_fc_norm(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """fc_norm weights and flag lost on the way to the exported config."""
    return _with(ckpt, ckpt.config.replace(fc_norm=False),
                 removed={k for k in ckpt.tensors if k.startswith("fc_norm.")})


def fc_norm_unapplied(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """fc_norm weights kept but the flag off: a reader that loads the weights applies no norm."""
    if not ckpt.config.fc_norm:
        raise UserError("the drafter has no fc_norm: nothing to leave unapplied")
    return _with(ckpt, ckpt.config.replace(fc_norm=False))


def shift_d2t(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """The draft-to-target vocabulary map off by one: draft id i lands on the target id of draft id
    i + 1 (the same set of target ids, so t2d still agrees; the last wraps to the first)."""
    if "d2t" not in ckpt.tensors:
        raise UserError("the drafter has no d2t: nothing to shift")
    d2t = ckpt.tensors["d2t"].to(torch.int64)
    target_ids = torch.arange(len(d2t)) + d2t
    return _with(ckpt, changes={"d2t": torch.roll(target_ids, -1) - torch.arange(len(d2t))})


def drop_d2t(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """A smaller draft vocabulary shipped without its d2t (and t2d) map: engines read draft id i as target id i."""
    cfg = ckpt.config
    if cfg.draft_vocab_size == cfg.vocab_size:
        raise UserError(f"the draft vocabulary is the full one ({cfg.vocab_size}): without d2t nothing changes")
    if "d2t" not in ckpt.tensors:
        raise UserError("the drafter already has no d2t")
    return _with(ckpt, removed={k for k in ("d2t", "t2d") if k in ckpt.tensors})


def random_embed_tokens(ckpt: DrafterCheckpoint, seed: int = 0) -> DrafterCheckpoint:
    """The drafter carries an embed_tokens of its own that differs from the target's (random, std 0.02)."""
    cfg = ckpt.config
    gen = torch.Generator().manual_seed(seed)
    dtype = ckpt.tensors["fc.weight"].dtype
    table = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(dtype)
    return _with(ckpt, changes={"embed_tokens.weight": table})


def scale_rope_theta(ckpt: DrafterCheckpoint, factor: float = 4.0) -> DrafterCheckpoint:
    """The drafter's rope_theta written as another model's (x4): positions rotate at other speeds."""
    return _with(ckpt, ckpt.config.replace(rope_theta=ckpt.config.rope_theta * factor))


def scale_fc(ckpt: DrafterCheckpoint, factor: float = 1.05) -> DrafterCheckpoint:
    """fc's weights scaled by 5 %: a converter's rescaling gone slightly wrong; every draft moves a little."""
    weight = ckpt.tensors["fc.weight"]
    return _with(ckpt, changes={"fc.weight": (weight.float() * factor).to(weight.dtype)})


def drop_rope_scaling(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """A converter that forgets the drafter's rope_scaling (vllm-project/speculators PR 574)."""
    if ckpt.config.rope_scaling is None:
        raise UserError("the drafter has no rope_scaling: nothing to drop")
    return _with(ckpt, ckpt.config.replace(rope_scaling=None))


def yarn_as_linear(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """yarn read as another schedule: linear with the same factor (NVIDIA-NeMo/Automodel PR 2399)."""
    scaling = ckpt.config.rope_scaling or {}
    if "factor" not in scaling:
        raise UserError("the drafter has no rope_scaling with a factor: nothing to misread")
    linear = {"rope_type": "linear", "factor": scaling["factor"]}
    return _with(ckpt, ckpt.config.replace(rope_scaling=linear))


def cut_positions(ckpt: DrafterCheckpoint, positions: int = 2048) -> DrafterCheckpoint:
    """A drafter holding fewer positions than its target serves (sgl-project/sglang issue 6783)."""
    return _with(ckpt, ckpt.config.replace(max_position_embeddings=positions, max_position_source="config"))


def sliding_window(ckpt: DrafterCheckpoint, window: int = 16) -> DrafterCheckpoint:
    """A sliding window declared on every drafter layer (layer_types sliding_attention)."""
    cfg = ckpt.config
    extras = {**cfg.extras, "sliding_window": window, "use_sliding_window": True,
              "layer_types": ["sliding_attention"] * cfg.num_layers}
    return _with(ckpt, cfg.replace(extras=extras))


# ---------------------------------------------------------------- a drafter folder, edited in place

class DrafterFiles:
    """A drafter folder (a copy being written) whose config.json keys and tensors are edited in place;
    what no edit names stays byte for byte."""

    def __init__(self, folder: Path, target: TargetInfo | None = None):
        self.folder, self.target = folder, target
        self.raw = read_json(folder / "config.json")
        self.checkpoint = read_drafter(folder)
        self.fmt: DrafterFormat = FORMATS[self.checkpoint.format]
        self.tensor_changes: dict[str, torch.Tensor] = {}  # stored name -> tensor
        self.tensor_removed: set[str] = set()

    # ---- config keys
    def get(self, path: tuple[str, ...]) -> Any:
        node: Any = self.raw
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def set(self, path: tuple[str, ...], value: Any) -> None:
        node = self.raw
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value

    def delete(self, path: tuple[str, ...]) -> bool:
        node = self.get(path[:-1]) if len(path) > 1 else self.raw
        if isinstance(node, dict) and path[-1] in node:
            del node[path[-1]]
            return True
        return False

    # ---- a canonical edit, applied as the differences it makes in this format
    def apply(self, new: DrafterCheckpoint) -> None:
        old = self.checkpoint
        before, after = self.fmt.write_config(old.config), self.fmt.write_config(new.config)
        _apply_difference(self.raw, before, after)
        if new.tensors is old.tensors:
            return
        if isinstance(new.tensors, Edited) and new.tensors.base is old.tensors:
            changes, removed = new.tensors.changes, new.tensors.removed
        else:  # any other mapping: compare every tensor
            changes = {n: t for n, t in new.tensors.items() if n not in old.tensors or not torch.equal(t, old.tensors[n])}
            removed = {n for n in old.tensors if n not in new.tensors}
        stored = getattr(old.tensors, "by_canonical", {})
        for name, tensor in changes.items():
            if name == "d2t":
                tensor = tensor.to(self.fmt.d2t_dtype)
            self.tensor_changes[stored.get(name) or self.fmt.from_canonical(name, new.config)] = tensor
        self.tensor_removed |= {stored.get(name, name) for name in removed}

    def save(self) -> None:
        write_json(self.folder / "config.json", self.raw)
        if not self.tensor_changes and not self.tensor_removed:
            return
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        shards = sorted(self.folder.glob("*.safetensors"))
        index_path = self.folder / INDEX_NAME
        weight_map = read_json(index_path).get("weight_map", {}) if index_path.is_file() else None
        stored: dict[Path, set[str]] = {}
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                stored[shard] = set(f.keys())
        added = set(self.tensor_changes) - set().union(*stored.values())  # new tensors go to the first shard
        for n, shard in enumerate(shards):
            names = stored[shard]
            here = {k for k in self.tensor_changes if k in names} | (added if n == 0 else set())
            if not here and not names & self.tensor_removed:
                continue
            with safe_open(str(shard), "pt") as f:
                metadata = f.metadata()
            tensors = {k: v for k, v in load_file(shard).items() if k not in self.tensor_removed}
            for k in here:
                tensors[k] = self.tensor_changes[k].contiguous()
                if weight_map is not None:
                    weight_map[k] = shard.name
            save_file(tensors, str(shard), metadata=metadata or {"format": "pt"})
        if weight_map is not None:
            for k in self.tensor_removed:
                weight_map.pop(k, None)
            index = read_json(index_path)
            index["weight_map"] = weight_map
            write_json(index_path, index)


def _apply_difference(raw: dict, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """Change `raw` where `after` differs from `before` (the same format's config of the checkpoint
    before and after a canonical edit), nested objects key by key; other keys of `raw` stay."""
    for key in set(before) | set(after):
        if key not in after:
            raw.pop(key, None)
        elif key not in before or before[key] != after[key]:
            if isinstance(before.get(key), dict) and isinstance(after[key], dict) and isinstance(raw.get(key), dict):
                _apply_difference(raw[key], before[key], after[key])
            else:
                raw[key] = after[key]


# ---------------------------------------------------------------- classes on the config.json keys

def nest_flags(files: DrafterFiles) -> None:
    """fc_norm / norm_before_fc moved from the top level into eagle_config (vllm-project/vllm PR #42143)."""
    moved = []
    for flag in ("fc_norm", "norm_before_fc"):
        if files.get((flag,)) is True:
            files.delete((flag,))
            files.set(("eagle_config", flag), True)
            moved.append(flag)
    if not moved:
        raise UserError(f"the drafter's config.json ({files.fmt.name} layout) sets neither fc_norm nor norm_before_fc "
                        "true at the top level: nothing a reader of the top-level key would miss")


def absent_norm_output(files: DrafterFiles) -> None:
    """Every key that says norm_output removed: each engine and trainer reads its own default."""
    found = [path for path in files.fmt.flag_keys["norm_output"] if files.delete(path)]
    if not found:
        raise UserError("the drafter's config.json has no norm_output key: it is already left to the defaults")


@dataclass(frozen=True)
class Sabotage:
    """One class of silent bug: `edit` breaks a drafter folder's copy in place."""

    name: str
    description: str
    reports: tuple[str, ...]
    edit: Callable[[DrafterFiles], None]


def _on_checkpoint(fn: Callable[..., DrafterCheckpoint], **kwargs: Callable[[DrafterFiles], Any]):
    """An edit of the folder from a function on its DrafterCheckpoint (keyword values computed per folder)."""
    def edit(files: DrafterFiles) -> None:
        files.apply(fn(files.checkpoint, **{k: v(files) for k, v in kwargs.items()}))
    return edit


def _target_layers(files: DrafterFiles) -> int:
    if files.checkpoint.config.aux_layer_ids is None and files.target is None:
        raise UserError("the drafter names no tapped layers; sabotage a bundle (its target resolves them)")
    return files.target.num_hidden_layers if files.target else 0


def _fewer_positions(files: DrafterFiles) -> int:
    served = (files.target.max_position_embeddings if files.target and files.target.max_position_embeddings
              else files.checkpoint.config.max_position_embeddings)
    return max(1, min(2048, served // 2))


SABOTAGES: dict[str, Sabotage] = {s.name: s for s in (
    Sabotage("shifted_taps", "tapped layers numbered one off (output of layer i written as before layer i)",
             ("sgl-project/sglang PR #25454", "lightseekorg/TorchSpec commit ec1eeab"),
             _on_checkpoint(shift_aux_ids, target_layers=_target_layers)),
    Sabotage("pre_norm_feedback", "norm_output dropped: an EAGLE 3.1 drafter fed back its pre-norm state",
             ("sgl-project/SpecForge PR #879: Fix eagle3/eagle3.1 hidden states normalisation",),
             _on_checkpoint(pre_norm_feedback)),
    Sabotage("absent_norm_output", "the norm_output key removed: each engine and trainer reads its own default",
             ("sgl-project/SpecForge PR #879: Fix eagle3/eagle3.1 hidden states normalisation",
              "vllm-project/vllm PR #46488: Propagate norm_output and fc_norm config for Eagle3 speculators"),
             absent_norm_output),
    Sabotage("drop_fc_norm", "fc_norm weights and flag lost on the way to the exported config",
             ("vllm-project/vllm PR #46488: Propagate norm_output and fc_norm config for Eagle3 speculators",
              "NVIDIA-NeMo/Automodel PR #2897: plumb EAGLE-3.1 fc_norm/norm_output into the draft config"),
             _on_checkpoint(drop_fc_norm)),
    Sabotage("fc_norm_unapplied", "fc_norm weights kept, flag off: loaded and never applied",
             ("vllm-project/vllm PR #43482: Apply fc_norm in Eagle3DeepseekV2 combine_hidden_states",),
             _on_checkpoint(fc_norm_unapplied)),
    Sabotage("nested_flags", "fc_norm / norm_before_fc moved from the top level into eagle_config",
             ("vllm-project/vllm PR #42143: read norm_before_fc from eagle_config for NVIDIA checkpoint",
              "vllm-project/vllm PR #38111: Propagate norm_before_fc from Eagle3 speculator"),
             nest_flags),
    Sabotage("random_embed_tokens", "the drafter carries its own embed_tokens, random, unlike the target's",
             ("vllm-project/vllm PR #27732: Prevent overwriting drafter's lm_head and embed_tokens",
              "vllm-project/vllm issue #50158: EAGLE embed_tokens sharing decision is made per-rank"),
             _on_checkpoint(random_embed_tokens)),
    Sabotage("drop_d2t", "a smaller draft vocabulary without its d2t map: draft id i read as target id i",
             ("verl-project/verl-SpeCo PR #67: default d2t to the offset identity instead of arange",),
             _on_checkpoint(drop_d2t)),
    Sabotage("shift_d2t", "the draft-to-target map off by one (each draft id lands on its neighbour's target id)",
             ("sgl-project/SpecForge PR #534: Preserve drafter vocab mapping when fine-tuning from a checkpoint",),
             _on_checkpoint(shift_d2t)),
    Sabotage("cut_positions", "max_position_embeddings below the served context (half the target's, at most 2048)",
             ("sgl-project/SpecForge PR #271: fix qwen3-8b-eagle3 max_position_embeddings",
              "sgl-project/sglang issue #6783: EAGLE3 perform worse with sequence length larger than the draft "
              "model context window",
              "vllm-project/vllm issue #48894: EAGLE-3 + prompts >2048 tokens: device-side assert"),
             _on_checkpoint(cut_positions, positions=_fewer_positions)),
    Sabotage("drop_rope_scaling", "the drafter's rope_scaling dropped by a converter",
             ("vllm-project/speculators PR #574: Preserve rope_scaling when building Eagle3 transformer config",),
             _on_checkpoint(drop_rope_scaling)),
    Sabotage("yarn_as_linear", "yarn rope_scaling read as another schedule (linear, same factor)",
             ("NVIDIA-NeMo/Automodel PR #2399: add gpt-oss EAGLE-3 draft model (yarn fell back to llama3)",),
             _on_checkpoint(yarn_as_linear)),
    Sabotage("scale_rope_theta", "rope_theta written as another model's (x4)", (),
             _on_checkpoint(scale_rope_theta)),
    Sabotage("sliding_window", "a sliding window of 16 tokens declared on every drafter layer",
             ("vllm-project/speculators PR #684: Added sliding window attention for p-eagle and eagle3 models",),
             _on_checkpoint(sliding_window)),
    Sabotage("scale_fc", "fc's weights scaled by 5 %: a converter's rescaling gone slightly wrong", (),
             _on_checkpoint(scale_fc)),
)}


def sabotage_named(name: str) -> Sabotage:
    try:
        return SABOTAGES[name]
    except KeyError:
        raise UserError(f"unknown sabotage {name!r}; `eagle31-export sabotage --list` names them all") from None


def write_sabotaged(source: str | os.PathLike, name: str, out: str | os.PathLike, force: bool = False) -> Path:
    """Copy `source` (a serving bundle or a drafter folder) to `out` broken as class `name` (atomic, with
    its own manifest; an --out touching `source` is refused)."""
    sabotage = sabotage_named(name)
    source = Path(source)
    if (source / BUNDLE_FILE).is_file():
        return _sabotage_bundle(source, sabotage, Path(out), force)
    if not (source / "config.json").is_file():
        raise UserError(f"{source}: neither a serving bundle (bundle.json) nor a drafter folder (config.json)")
    with atomic_output_dir(out, force=force, inputs=[source]) as tmp:
        _copy(source, tmp)
        files = DrafterFiles(tmp)
        sabotage.edit(files)
        files.save()
        write_json(tmp / RECORD_FILE, _record(sabotage, str(source.resolve())))
    return Path(out)


def _sabotage_bundle(source: Path, sabotage: Sabotage, out: Path, force: bool) -> Path:
    from eagle31_export.formats.target.checkpoint import read_target_info

    check_consumed(source)  # a changed bundle is refused before anything is copied
    record = read_json(source / BUNDLE_FILE)
    references = {role: ref["path"] for role, ref in (read_manifest(source).get("references") or {}).items()}
    drafter = record.get("drafter")
    if not isinstance(drafter, str) or not (source / drafter / "config.json").is_file():
        raise UserError(f"{source / BUNDLE_FILE}: drafter is {drafter!r}, not a drafter folder of the bundle")
    target = source / record["target"] if isinstance(record.get("target"), str) else None
    info = read_target_info(target) if target is not None and (target / "config.json").is_file() else None
    with atomic_output_dir(out, force=force, inputs=[source], references=references) as tmp:
        _copy(source, tmp)
        files = DrafterFiles(tmp / drafter, info)
        sabotage.edit(files)
        files.save()
        record["sabotage"] = _record(sabotage, str(source.resolve()))
        write_json(tmp / BUNDLE_FILE, record)
    return out


def _copy(source: Path, dest: Path) -> None:
    """Every file of `source` but its manifest (links to folders stay links: a referenced target)."""
    for item in sorted(source.iterdir()):
        if item.name == MANIFEST:
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, dest / item.name, symlinks=True)
        else:
            shutil.copy2(item, dest / item.name, follow_symlinks=False)


def _record(sabotage: Sabotage, source: str) -> dict[str, Any]:
    return {"name": sabotage.name, "description": sabotage.description, "reports": list(sabotage.reports),
            "source": source, "note": "a broken copy on purpose: never serve it"}


def catalogue() -> list[dict[str, Any]]:
    """Every class with its description and reports (`sabotage --list`)."""
    return [{"name": s.name, "description": s.description, "reports": list(s.reports)} for s in SABOTAGES.values()]


# ---------------------------------------------------------------- NVFP4 target checkpoints, edited in place
# (both sides of a comparison then read the same file)

def edit_safetensors(folder, edit) -> None:
    """Apply `edit(tensors)` to every shard of the checkpoint in `folder`."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, str(shard), metadata={"format": "pt"})


def reciprocal_global_scales(folder, suffix: str = ".weight_scale_2") -> None:
    """Every weight global scale written in the other format's convention (1 / value)."""
    def edit(tensors):
        for name in [n for n in tensors if n.endswith(suffix)]:
            tensors[name] = 1.0 / tensors[name]
    edit_safetensors(folder, edit)


def transpose_block_scales(folder, names=None) -> None:
    """Block scales stored [in/16, out] instead of [out, in/16] (all of them, or those in `names`)."""
    def edit(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale") and tensors[n].dim() == 2]:
            if names is None or name in names:
                tensors[name] = tensors[name].t().contiguous()
    edit_safetensors(folder, edit)

