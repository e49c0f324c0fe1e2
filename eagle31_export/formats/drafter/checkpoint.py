"""Read any supported drafter checkpoint into the canonical config and tensor names; write it back.

    ckpt = read_drafter("path/to/drafter")          # format detected, tensors lazy
    ckpt.config.fc_norm, ckpt.tensors["fc.weight"]
    write_drafter(ckpt, "out/dir", "speculators")   # atomic, with manifest.json

`format_drafter` applies every format rule (config keys, tensor names, which buffers a format
stores and in which dtype) and is the one path to a format, for standalone checkpoints and for
the drafters inside serving bundles alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from eagle31_export.config import ConfigError, DrafterConfig
from eagle31_export.errors import CheckpointError
from eagle31_export.formats.drafter.formats import FORMATS, DrafterFormat, detect_format, drafter_origin
from eagle31_export.formats.outputs import check_enclosing_output
from eagle31_export.formats.safetensors_io import (
    SafetensorsDir,
    atomic_output_dir,
    read_json,
    save_tensors,
    write_json,
)

# Tensors a drafter checkpoint may omit: they then come from the target (embeddings, lm_head)
# or are derived (t2d from d2t; d2t is all zeros when the draft vocabulary is the full one).
OPTIONAL_TENSORS = {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}


class RenamedTensors(Mapping[str, torch.Tensor]):
    """Lazy canonical-name view over a checkpoint's tensors."""

    def __init__(self, source: SafetensorsDir, fmt: DrafterFormat, cfg: DrafterConfig,
                 stored: Mapping[str, str] | None = None):
        """`stored`: name the format knows -> name in the files (they differ when the files carry
        a prefix such as NeMo AutoModel's `model.`); default: the same."""
        self.source = source
        self.by_canonical: dict[str, str] = {}
        for name, in_file in (stored or {n: n for n in source}).items():
            try:
                canonical = fmt.to_canonical(name, cfg)
            except (ValueError, IndexError):
                raise CheckpointError(f"{source.file_of(in_file)}: tensor {in_file!r} does not follow the "
                                      f"{fmt.name} naming") from None
            if canonical in self.by_canonical:
                raise CheckpointError(f"{source.folder}: tensors {self.by_canonical[canonical]!r} and {in_file!r} "
                                      f"both hold {canonical!r}; remove one")
            self.by_canonical[canonical] = in_file

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.source[self.by_canonical[name]]
        return t.to(torch.int64) if name == "d2t" else t  # canonical d2t is int64 whatever a format stores

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_canonical)

    def __len__(self) -> int:
        return len(self.by_canonical)

    def shape(self, name: str) -> list[int]:
        return self.source.shape_and_dtype(self.by_canonical[name])[0]

    def where(self, name: str) -> str:
        return f"{self.source.file_of(self.by_canonical[name]).name}:{self.by_canonical[name]}"


@dataclass
class DrafterCheckpoint:
    config: DrafterConfig
    tensors: Mapping[str, torch.Tensor]  # canonical names
    format: str = "canonical"
    path: Path | None = None
    unknown_config_keys: list[str] = field(default_factory=list)
    # What is wrong with the values (dtypes, NaN/Inf, all-zero norms, d2t/t2d): empty unless read
    # with strict=False (`inspect`), which reports them instead of refusing the checkpoint.
    problems: list[str] = field(default_factory=list)
    tensor_prefix: str = ""  # a prefix every stored name carried and reading removed (e.g. "model.")
    origin: str = ""  # the project that wrote it (`formats.drafter.formats.drafter_origin`); "" when not read from disk

    def d2t(self) -> torch.Tensor:
        if "d2t" in self.tensors:
            return self.tensors["d2t"].to(torch.int64)
        return torch.zeros(self.config.draft_vocab_size, dtype=torch.int64)


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a drafter with config `cfg` has, plus `t2d`.

    The reference module's state_dict (`reference.drafter.Eagle3Drafter`), names and order
    alike, computed from the config alone (tests check the two agree).
    """
    h, ht, k = cfg.hidden_size, cfg.effective_target_hidden_size, cfg.num_aux_hidden_states
    shapes: dict[str, tuple[int, ...]] = {"d2t": (cfg.draft_vocab_size,),  # the module's own buffer comes first
                                          "embed_tokens.weight": (cfg.vocab_size, h), "fc.weight": (h, k * ht)}
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (ht,) for i in range(k)})
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (k * ht,)
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        if layer == 0:
            shapes[p + "hidden_norm.weight"] = (h,)
        shapes[p + "input_layernorm.weight"] = (h,)
        # EAGLE-3's first layer attends over cat(input_layernorm(embed), hidden_norm(g)): 2H inputs.
        for name, shape in _attention_shapes(cfg, 2 * h if layer == 0 else h).items():
            shapes[p + "self_attn." + name] = shape
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    shapes["norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.draft_vocab_size, h)
    shapes["t2d"] = (cfg.vocab_size,)
    return shapes


def _attention_shapes(cfg: DrafterConfig, d_in: int) -> dict[str, tuple[int, ...]]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.attention == "mla":
        m = cfg.mla
        out: dict[str, tuple[int, ...]] = {}
        if m.q_lora_rank:
            out["q_a_proj.weight"] = (m.q_lora_rank, d_in)
            out["q_a_layernorm.weight"] = (m.q_lora_rank,)
            out["q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
        else:
            out["q_proj.weight"] = (heads * m.qk_head_dim, d_in)
        out["kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, d_in)
        out["kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        out["kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        out["o_proj.weight"] = (h, heads * m.v_head_dim)
        return out
    q, kv = heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {}
    for proj, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out[f"{proj}.weight"] = (width, d_in)
        if cfg.attention_bias:
            out[f"{proj}.bias"] = (width,)
    out["o_proj.weight"] = (h, q)
    return out


def read_drafter(path: str | os.PathLike, strict: bool = True) -> DrafterCheckpoint:
    """Read a drafter folder in any supported format into canonical names (tensors stay lazy).

    Structure (config, tensor names, shapes) is always checked; so are the values, in one
    streaming pass (`formats.weight_checks`): dtypes, NaN/Inf, all-zero norms, d2t/t2d. A value
    problem refuses the checkpoint, or with `strict=False` is listed in `problems` (`inspect`).
    A folder inside an output of this tool (a bundle's `drafter/`) is first held against that
    output's manifest (`formats.outputs.check_enclosing_output`).
    """
    path = Path(path)
    check_enclosing_output(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; expected a drafter checkpoint folder")
    raw = read_json(path / "config.json")
    source = SafetensorsDir(path)
    stored, prefix = _strip_prefix(list(source))
    try:
        fmt = detect_format(raw, list(stored))
    except CheckpointError as err:
        if not prefix and any(n.startswith(p) for n in source for p in _WRAPPER_PREFIXES):
            raise CheckpointError(f"{path}: {err} (its tensor names carry a wrapper prefix such as 'model.' but not "
                                  "for every drafter tensor; re-save the drafter with plain names)") from None
        raise CheckpointError(f"{path}: {err}") from None
    try:
        cfg, unknown = fmt.read_config(raw)
    except CheckpointError as err:
        raise CheckpointError(f"{path / 'config.json'}: {err}") from None
    except ConfigError as err:
        raise CheckpointError(f"{path / 'config.json'}: {err}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path / 'config.json'}: malformed {fmt.name} config ({err!r})") from None
    tensors = RenamedTensors(source, fmt, cfg, stored)
    _check_tensors(cfg, tensors, path)
    problems = missing_d2t_problems(cfg, tensors, path) + value_problems(cfg, tensors)
    if problems and strict:
        more = f" ({len(problems) - 1} more problem(s): run `eagle31-export inspect {path}`)" if len(problems) > 1 else ""
        raise CheckpointError(f"drafter {path}: {problems[0]}{more}")
    return DrafterCheckpoint(cfg, tensors, fmt.name, path, unknown, problems, prefix, drafter_origin(raw, fmt.name))


# Prefixes training frameworks wrap a drafter's own names in (NeMo AutoModel saves `model.` + name).
_WRAPPER_PREFIXES = ("model.",)
_DRAFTER_HEADS = ("midlayer.", "layers.", "fc.", "fc_norm.", "input_norm.", "norm.", "embed_tokens.", "lm_head.",
                  "d2t", "t2d")


def _strip_prefix(names: list[str]) -> tuple[dict[str, str], str]:
    """(name without a wrapper prefix -> stored name, the prefix removed or "").

    A prefix is removed only when every drafter tensor carries it (buffers `d2t`/`t2d` and
    `lm_head` may sit outside the wrapper) and removing it leaves drafter names."""
    for prefix in _WRAPPER_PREFIXES:
        wrapped = [n for n in names if n.startswith(prefix)]
        if not wrapped:
            continue
        inner = {n[len(prefix):]: n for n in wrapped}
        outside = [n for n in names if not n.startswith(prefix)]
        if all(n in ("d2t", "t2d", "lm_head.weight") for n in outside) and \
                all(k.startswith(_DRAFTER_HEADS) for k in inner) and not set(inner) & set(outside):
            return {**inner, **{n: n for n in outside}}, prefix
    return {n: n for n in names}, ""


def _check_tensors(cfg: DrafterConfig, tensors: RenamedTensors, path: Path) -> None:
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            if name in OPTIONAL_TENSORS:
                continue
            raise CheckpointError(f"{path}: tensor {name!r} missing (expected shape {list(shape)}); "
                                  "the checkpoint is incomplete or its config does not match its weights")
        found = tensors.shape(name)
        if tuple(found) != shape:
            raise CheckpointError(f"{tensors.where(name)}: shape {found}, expected {list(shape)} from config.json")
    extra = sorted(set(tensors) - set(expected))
    if extra and all(n.startswith("fc_norm.") for n in extra):
        raise CheckpointError(f"{path}: unexpected tensors {extra[:3]}: fc_norm weights, but fc_norm is off in "
                              "config.json; a reader that loads them applies no norm (vllm-project/vllm PR #43482): "
                              "set fc_norm or drop the weights")
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:5]} for this config "
                              f"(fc_norm={cfg.fc_norm}, norm_before_fc={cfg.norm_before_fc}, layers={cfg.num_layers}); "
                              "the config flags likely do not match the weights")


def missing_d2t_problems(cfg: DrafterConfig, tensors: Mapping[str, Any], path: Path) -> list[str]:
    """A smaller draft vocabulary without its d2t map: refused when read strictly, listed by `inspect`
    with what the engines then do (formats/drafter/engine_defaults.py)."""
    from eagle31_export.formats.drafter.engine_defaults import SGLANG_NO_D2T, VLLM_NO_D2T

    if "d2t" in tensors or cfg.draft_vocab_size == cfg.vocab_size:
        return []
    return [f"tensor 'd2t' missing, needed because draft_vocab_size {cfg.draft_vocab_size} != vocab_size "
            f"{cfg.vocab_size}; {VLLM_NO_D2T}; {SGLANG_NO_D2T}"]


def value_problems(cfg: DrafterConfig, tensors: RenamedTensors) -> list[str]:
    """dtypes, NaN/Inf, all-zero norms (one streaming pass), then the vocabulary maps."""
    from eagle31_export.formats.weight_checks import role_of, scan_checkpoint

    roles, where = {}, {}
    for name in tensors:
        stored = tensors.by_canonical[name]
        roles[stored] = ("index" if name == "d2t" else "mask" if name == "t2d"
                         else role_of(name, len(tensors.shape(name))))
        where[stored] = tensors.where(name)
    problems = scan_checkpoint(tensors.source, roles, where).problems
    if problems:
        return problems  # the maps are read only when their dtypes are right
    return _vocab_map_problems(cfg, tensors)


def _vocab_map_problems(cfg: DrafterConfig, tensors: RenamedTensors) -> list[str]:
    problems = []
    d2t = None
    if "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.int64)
        targets = torch.arange(d2t.numel()) + d2t
        low, high = int(targets.min()), int(targets.max())
        if high >= cfg.vocab_size or low < 0:
            bad = high if high >= cfg.vocab_size else low
            problems.append(f"{tensors.where('d2t')}: maps a draft token to target id {bad}, "
                            f"outside the vocabulary of {cfg.vocab_size}")
            d2t = None
        elif int(targets.unique().numel()) != targets.numel():
            problems.append(f"{tensors.where('d2t')}: maps several draft tokens to the same target id; "
                            "each draft token must stand for a different target token")
            d2t = None
    if "t2d" in tensors:
        t2d = tensors["t2d"]
        if t2d.dtype != torch.bool and bool(((t2d != 0) & (t2d != 1)).any()):
            problems.append(f"{tensors.where('t2d')}: holds values other than 0 and 1; t2d marks target ids")
        elif not bool(t2d.any()):
            problems.append(f"{tensors.where('t2d')}: marks no target id; t2d must mark the "
                            f"{cfg.draft_vocab_size} target ids the draft vocabulary covers")
        elif d2t is not None and not torch.equal(t2d.to(torch.bool), t2d_from_d2t(d2t, cfg.vocab_size)):
            count = int(t2d.to(torch.bool).sum())
            problems.append(f"{tensors.where('t2d')}: marks {count} target ids that differ from those d2t maps to "
                            f"({cfg.draft_vocab_size}); d2t and t2d do not belong together")
    return problems


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d marks the target ids reachable from the draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.to(torch.int64)] = True
    return t2d


def format_named(fmt_name: str) -> DrafterFormat:
    """The format called `fmt_name`, or one clear error naming the known ones."""
    try:
        return FORMATS[fmt_name]
    except KeyError:
        raise CheckpointError(f"unknown drafter format {fmt_name!r}; choose one of {sorted(FORMATS)}") from None


def format_drafter(ckpt: DrafterCheckpoint, fmt_name: str, config_patch: Mapping[str, Any] | None = None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors by stored name) of the checkpoint in format `fmt_name`.

    Every format rule lives in the format class; this applies them. `config_patch` overrides
    top-level config keys a runtime needs (e.g. its architecture name). Refuses, before anything
    is written, a drafter the format cannot hold.
    """
    fmt = format_named(fmt_name)
    cfg = ckpt.config
    problems = fmt.limits(cfg)
    if problems:
        raise CheckpointError(problems[0])
    config = {**fmt.write_config(cfg), **(config_patch or {})}
    tensors: dict[str, torch.Tensor] = {}
    for name in ckpt.tensors:
        if name == "t2d" and not fmt.stores_t2d:
            continue
        t = ckpt.tensors[name]
        if name == "d2t":
            if cfg.draft_vocab_size == cfg.vocab_size and not fmt.stores_full_vocab_d2t:
                if bool(t.any()):
                    raise CheckpointError(f"the {fmt.name} format stores no d2t for a full-size draft vocabulary, "
                                          "and this d2t permutes it")
                continue
            t = t.to(fmt.d2t_dtype)
        tensors[fmt.from_canonical(name, cfg)] = t
    if fmt.stores_t2d and "t2d" not in ckpt.tensors and "d2t" in ckpt.tensors:
        tensors["t2d"] = t2d_from_d2t(ckpt.tensors["d2t"], cfg.vocab_size)
    return config, tensors


def write_drafter(ckpt: DrafterCheckpoint, out: str | os.PathLike, fmt_name: str, force: bool = False,
                  max_shard_bytes: int | None = None) -> Path:
    """Write the checkpoint in `fmt_name` atomically (temp folder, manifest, rename)."""
    config, tensors = format_drafter(ckpt, fmt_name)
    with atomic_output_dir(out, force=force) as tmp:
        save_tensors(tensors, tmp, max_shard_bytes)
        write_json(tmp / "config.json", config)
    return Path(out)
