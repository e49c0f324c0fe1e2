"""The drafter in the speculators layout, complete enough that speculators itself loads it.

`export vllm --layout speculators` writes the drafter with `formats.drafter.formats.
SpeculatorsFormat` for any drafter (the default layout choice stays `consumer_layout`'s). Two
things make that folder loadable by vllm-project/speculators 0.9.0 as well
(docs/runtime-capabilities.md#the-speculators-library-as-a-consumer):

- `speculators_config.verifier.name_or_path` names the target: speculators' `from_pretrained`
  reads the verifier's config.json and fails on null (there is no placeholder it accepts
  offline);
- `embed_tokens.weight` is written from the target: speculators does not take it from the
  verifier unless the tensor holds a NaN, so a drafter without its own embeddings would load
  with random ones.

It also says, for the bundle README, which third-party conversion would lose EAGLE 3.1 weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch

from eagle31_export.errors import CheckpointError
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint
from eagle31_export.formats.drafter.formats import SpeculatorsFormat, consumer_layout
from eagle31_export.formats.safetensors_io import SafetensorsDir, read_json

LAYOUTS = ("auto", "speculators")  # `export vllm --layout`: auto is consumer_layout's choice
EMBED = "embed_tokens.weight"


def vllm_layout(layout: str, cfg) -> str:
    """The drafter format `export vllm --layout LAYOUT` writes."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"--layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return SpeculatorsFormat.name if layout == "speculators" else consumer_layout("vllm", cfg)[0]


def vllm_runtime_key(fmt: str) -> str:
    """The row set of `export.capabilities` that applies to vLLM reading format `fmt`."""
    return "vllm-speculators" if fmt == SpeculatorsFormat.name else "vllm"


def target_embedding_name(target: Path) -> str:
    """The stored name of the target's input embeddings (`model.embed_tokens.weight` for Llama)."""
    names = [n for n in SafetensorsDir(target) if n.endswith("embed_tokens.weight")]
    if not names:
        raise CheckpointError(f"{target}: no *embed_tokens.weight tensor; cannot give the drafter its embeddings")
    return min(names, key=len)  # the language model's, not a vision tower's


class _WithTensor(Mapping[str, torch.Tensor]):
    """The drafter's tensors plus one read lazily from another folder."""

    def __init__(self, base: Mapping[str, torch.Tensor], name: str, folder: Path, stored: str):
        self.base, self.name, self.folder, self.stored = base, name, folder, stored

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == self.name and name not in self.base:
            return SafetensorsDir(self.folder)[self.stored]
        return self.base[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.base
        if self.name not in self.base:
            yield self.name

    def __len__(self) -> int:
        return len(self.base) + (self.name not in self.base)


def speculators_checkpoint(ckpt: DrafterCheckpoint, target: str | Path) -> DrafterCheckpoint:
    """`ckpt` with the target as speculators' verifier and, unless it has its own, the target's embeddings."""
    target = Path(target).resolve()
    config = read_json(target / "config.json")
    architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    cfg = ckpt.config
    extras = {**cfg.extras, "verifier": {"name_or_path": str(target), "architectures": list(architectures)}}
    cfg = cfg.replace(extras=extras)
    tensors: Mapping[str, torch.Tensor] = ckpt.tensors
    if EMBED not in tensors:
        stored = target_embedding_name(target)
        shape = SafetensorsDir(target).shape_and_dtype(stored)[0]
        if list(shape) != [cfg.vocab_size, cfg.hidden_size]:
            raise CheckpointError(f"{target}: {stored} is {shape}, the drafter needs [{cfg.vocab_size}, "
                                  f"{cfg.hidden_size}]; a drafter narrower than its target stores its own embed_tokens")
        tensors = _WithTensor(tensors, EMBED, target, stored)
    return DrafterCheckpoint(cfg, tensors, ckpt.format, ckpt.path, ckpt.unknown_config_keys, ckpt.problems,
                             ckpt.tensor_prefix)


def speculators_library_problems(cfg) -> list[str]:
    """Why speculators 0.9.0's own Eagle3DraftModel cannot load this drafter (vLLM still can)."""
    problems = []
    if cfg.attention == "mla":
        problems.append("speculators 0.9.0 has no MLA Eagle3 layer (model_definitions: llama, qwen3)")
    if cfg.effective_target_hidden_size != cfg.hidden_size:
        problems.append("speculators 0.9.0 sizes fc by the drafter's hidden size, so a drafter narrower than its "
                        "target does not load there")
    return problems


def converter_note(cfg, drafter_arg: str, target_arg: str) -> str:
    """README lines: which third-party conversion drops this drafter's EAGLE 3.1 weights, and what to run."""
    if not cfg.fc_norm:
        return ""
    return ("- do not convert this drafter with speculators' own EAGLE-3 converter (`speculators convert`, or "
            "speculators' `from_pretrained` on a non-speculators folder; speculators 0.9.0): it loads the "
            "weights into a model without `fc_norm` (non-strict, a log warning only), so the `fc_norm.{i}` "
            "weights are dropped while the config keeps `fc_norm: true`. For the speculators layout run\n"
            f"  `eagle31-export export vllm --drafter {drafter_arg} --target {target_arg} --out DIR --layout speculators`\n")
