"""Routed MoE experts: stored one Linear per expert, held by transformers as fused 3-D parameters.

Published MoE checkpoints (DeepSeek-V3, Kimi K2, Qwen3-MoE, Mixtral; bf16 and NVFP4 alike) store
every routed expert's projections as separate tensors, `mlp.experts.E.{gate,up,down}_proj.weight`
(docs/nvfp4.md#published-nvfp4-moe-targets). transformers 5 holds them fused,
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], and converts on load
with the model's checkpoint conversion mapping (`transformers.conversion_mapping`): a
`MergeModulelist(dim=0)` over the experts, then for gate/up a `Concatenate(dim=1)` in source-pattern
order. `ExpertLayout` reads that same mapping, so every reader here (the NVFP4 loader, the checks,
`quantize`) places a per-expert tensor exactly where transformers' own loader puts it.

`FusedExpertsForward` runs a fused experts module expert by expert, with per-Linear hooks on
each projection's input: NVFP4 fake quantization (W4A4 emulation) and calibration use them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from eagle31_export.errors import CheckpointError


@dataclass(frozen=True)
class ExpertSlot:
    """Where one stored per-expert Linear lives inside a fused parameter."""

    module: str  # the stored Linear, e.g. model.layers.1.mlp.experts.3.gate_proj
    param: str  # the fused parameter, e.g. model.layers.1.mlp.experts.gate_up_proj
    expert: int
    part: int  # index among the Linears concatenated into `param` (gate 0, up 1)
    parts: int  # how many are concatenated

    @property
    def experts_module(self) -> str:
        return self.param.rpartition(".")[0]

    def rows(self, param_shape: tuple[int, ...]) -> slice:
        size = param_shape[1] // self.parts
        return slice(self.part * size, (self.part + 1) * size)


@dataclass(frozen=True)
class _Converter:
    pattern: re.Pattern  # matches a stored weight name's tail; group 1 is the expert index
    target: str  # the fused parameter's tail
    part: int
    parts: int


class ExpertLayout:
    """The per-expert -> fused mapping of one transformers architecture (None where it has none)."""

    def __init__(self, renames: list[tuple[re.Pattern, str]], converters: list[_Converter]):
        self.renames, self.converters = renames, converters

    @classmethod
    def of(cls, model_or_class_name, model_type: str | None = None) -> "ExpertLayout | None":
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        name = model_or_class_name if isinstance(model_or_class_name, str) else type(model_or_class_name).__name__
        if model_type is None and not isinstance(model_or_class_name, str):
            model_type = getattr(model_or_class_name.config, "model_type", None)
        mapping = get_checkpoint_conversion_mapping(name) or (
            get_checkpoint_conversion_mapping(model_type) if model_type else None)
        renames, converters = [], []
        for entry in mapping or ():
            kind = type(entry).__name__
            sources, targets = list(entry.source_patterns), list(entry.target_patterns)
            if kind == "WeightRenaming" and len(sources) == len(targets) == 1:
                renames.append((re.compile(sources[0]), targets[0]))
            elif kind == "WeightConverter" and _merges_experts(entry) and len(targets) == 1:
                for part, source in enumerate(sources):
                    if source.count("*") != 1 or not source.endswith(".weight"):
                        break
                    regex = re.escape(source).replace(r"\*", r"(\d+)") + "$"
                    converters.append(_Converter(re.compile(regex), targets[0], part, len(sources)))
        return cls(renames, converters) if converters else None

    def renamed(self, name: str) -> str:
        """A stored name after the architecture's plain renamings (e.g. Mixtral's block_sparse_moe)."""
        for pattern, target in self.renames:
            name = pattern.sub(target, name)
        return name

    def slot(self, weight_name: str) -> ExpertSlot | None:
        """The slot of a stored per-expert weight (`...experts.3.gate_proj.weight`), None otherwise."""
        name = self.renamed(weight_name)
        for c in self.converters:
            m = c.pattern.search(name)
            if m:
                param = name[: m.start()] + c.target
                module = weight_name[: -len(".weight")]
                return ExpertSlot(module, param, int(m.group(1)), c.part, c.parts)
        return None


def _merges_experts(entry) -> bool:
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in (entry.operations or ())]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def expert_problems(slots: dict[str, ExpertSlot], shapes: dict[str, tuple[int, ...]],
                    stored_shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Per-expert tensors against the fused parameters of the model config.json describes: expert
    numbers past the config's count, experts missing, and (with `stored_shapes`, plain weights) shapes."""
    problems: list[str] = []
    seen: dict[str, set[tuple[int, int]]] = {}
    for name, slot in sorted(slots.items()):
        shape = shapes.get(slot.param)
        if shape is None:
            problems.append(f"{name}: the model config.json describes has no experts at {slot.experts_module}; "
                            "config and weights do not belong together")
            continue
        if slot.expert >= shape[0]:
            problems.append(f"{name}: expert {slot.expert} of {slot.experts_module}, but config.json gives it "
                            f"{shape[0]} routed experts (n_routed_experts / num_experts); config and weights do "
                            "not belong together")
            continue
        seen.setdefault(slot.param, set()).add((slot.expert, slot.part))
        if stored_shapes is not None and name in stored_shapes:
            expected = (slot.rows(shape).stop - slot.rows(shape).start, shape[2])
            if tuple(stored_shapes[name]) != expected:
                problems.append(f"{name}: shape {list(stored_shapes[name])}, the model config.json describes "
                                f"expects {list(expected)} (moe_intermediate_size / hidden_size)")
    parts = {s.param: s.parts for s in slots.values()}
    for param, filled in sorted(seen.items()):
        experts = shapes[param][0]
        if len(filled) < experts * parts[param]:
            have = sorted({e for e, _ in filled})
            missing = sorted(set(range(experts)) - set(have))
            what = (f"expert {missing[0]} is missing ({len(missing)} of {experts} missing)" if missing
                    else "some expert projections are missing")
            problems.append(f"{param.rpartition('.')[0]}: {what}; it would be left randomly initialised: is the "
                            "checkpoint complete, and does config.json give the right expert count?")
    return problems


class FusedExpertsForward(nn.Module):
    """A transformers fused experts module (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
    `act_fn`) run expert by expert, as transformers' eager implementation does, with `hook(name, x)`
    applied to the input of every projection (`name` the stored per-expert Linear). Shares the
    wrapped module's parameters, so the model's state dict is unchanged."""

    def __init__(self, experts: nn.Module, prefix: str, hook: Callable[[str, torch.Tensor], torch.Tensor]):
        super().__init__()
        if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(experts, "act_fn")):
            raise CheckpointError(f"{prefix} is a {type(experts).__name__}; only gated fused experts "
                                  "(gate_up_proj, down_proj) are supported")
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.act_fn, self.num_experts = experts.act_fn, int(experts.gate_up_proj.shape[0])
        self.prefix, self.hook = prefix, hook

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        half = self.gate_up_proj.shape[1] // 2
        with torch.no_grad():  # the same token order as transformers' eager loop
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            slot, token = torch.where(mask[e])
            x = hidden_states[token]
            w = self.gate_up_proj[e]
            xg = self.hook(f"{self.prefix}.{e}.gate_proj", x)
            xu = self.hook(f"{self.prefix}.{e}.up_proj", x)
            if xg is xu or torch.equal(xg, xu):  # one GEMM over gate and up, as transformers runs it
                gate, up = F.linear(xg, w).chunk(2, dim=-1)
            else:
                gate, up = F.linear(xg, w[:half]), F.linear(xu, w[half:])
            h = self.act_fn(gate) * up
            y = F.linear(self.hook(f"{self.prefix}.{e}.down_proj", h), self.down_proj[e])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def fused_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> fused experts module (3-D gate_up_proj / down_proj parameters) of a model."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and getattr(m, "gate_up_proj").dim() == 3
            and isinstance(getattr(m, "down_proj", None), torch.Tensor)}


def swap_experts(model: nn.Module, prefix: str, hook: Callable[[str, torch.Tensor], torch.Tensor]) -> nn.Module:
    """Replace the fused experts module at `prefix` by a `FusedExpertsForward`; returns the original."""
    parent_name, _, child = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    original = getattr(parent, child)
    setattr(parent, child, FusedExpertsForward(original, prefix, hook))
    return original


def restore_experts(model: nn.Module, prefix: str, original: nn.Module) -> None:
    parent_name, _, child = prefix.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, original)
