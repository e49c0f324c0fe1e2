"""Read any supported drafter checkpoint into the canonical config and tensor names; write it back.

    ckpt = read_drafter("path/to/drafter")          # format detected, tensors lazy
    ckpt.config.fc_norm, ckpt.tensors["fc.weight"]
    write_drafter(ckpt, "out/dir", "speculators")   # atomic, with manifest.json
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import torch

from eagle31_export.config import ConfigError, DrafterConfig
from eagle31_export.errors import CheckpointError
from eagle31_export.formats.drafter_formats import FORMATS, DrafterFormat, detect_format
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

    def __init__(self, source: SafetensorsDir, fmt: DrafterFormat):
        self.source = source
        self.by_canonical = {fmt.to_canonical(n): n for n in source}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.source[self.by_canonical[name]]

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

    def d2t(self) -> torch.Tensor:
        if "d2t" in self.tensors:
            return self.tensors["d2t"].to(torch.int64)
        return torch.zeros(self.config.draft_vocab_size, dtype=torch.int64)


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape, from the reference module built on the meta device."""
    from eagle31_export.reference.drafter import Eagle3Drafter

    with torch.device("meta"):
        module = Eagle3Drafter(cfg)
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    shapes["t2d"] = (cfg.vocab_size,)
    return shapes


def read_drafter(path: str | os.PathLike) -> DrafterCheckpoint:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; expected a drafter checkpoint folder")
    raw = read_json(path / "config.json")
    source = SafetensorsDir(path)
    fmt = detect_format(raw, list(source))
    try:
        cfg, unknown = fmt.read_config(raw)
    except CheckpointError:
        raise
    except ConfigError as err:
        raise CheckpointError(f"{path / 'config.json'}: {err}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / 'config.json'}: malformed {fmt.name} config ({err!r})") from None
    tensors = RenamedTensors(source, fmt)
    _check_tensors(cfg, tensors, path)
    return DrafterCheckpoint(cfg, tensors, fmt.name, path, unknown)


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
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:5]} for this config "
                              f"(fc_norm={cfg.fc_norm}, norm_before_fc={cfg.norm_before_fc}, layers={cfg.num_layers}); "
                              "the config flags likely do not match the weights")
    if "d2t" not in tensors and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{path}: tensor 'd2t' missing, needed because draft_vocab_size "
                              f"{cfg.draft_vocab_size} != vocab_size {cfg.vocab_size}")
    if "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.int64)
        top = int((torch.arange(d2t.numel()) + d2t).max())
        if top >= cfg.vocab_size or int((torch.arange(d2t.numel()) + d2t).min()) < 0:
            raise CheckpointError(f"{tensors.where('d2t')}: maps a draft token to target id {top}, "
                                  f"outside the vocabulary of {cfg.vocab_size}")


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d marks the target ids reachable from the draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.to(torch.int64)] = True
    return t2d


def write_drafter(ckpt: DrafterCheckpoint, out: str | os.PathLike, fmt_name: str, force: bool = False,
                  max_shard_bytes: int | None = None) -> Path:
    """Write the checkpoint in `fmt_name` atomically (temp folder, manifest, rename)."""
    try:
        fmt = FORMATS[fmt_name]
    except KeyError:
        raise CheckpointError(f"unknown drafter format {fmt_name!r}; choose one of {sorted(FORMATS)}") from None
    cfg = ckpt.config
    config_json = fmt.write_config(cfg)
    with atomic_output_dir(out, force=force) as tmp:
        tensors = {fmt.from_canonical(name, cfg): ckpt.tensors[name] for name in ckpt.tensors
                   if not (name == "t2d" and fmt_name == "modelopt")}  # ModelOpt exports carry no t2d
        if fmt_name != "modelopt" and "t2d" not in ckpt.tensors and "d2t" in ckpt.tensors:
            tensors["t2d"] = t2d_from_d2t(ckpt.tensors["d2t"], cfg.vocab_size)
        save_tensors(tensors, tmp, max_shard_bytes)
        write_json(tmp / "config.json", config_json)
    return Path(out)
