"""The drafter layout TensorRT-LLM's PyTorch backend reads for Eagle3, both ways.

What its Eagle3 draft model (`_torch/models/modeling_speculative.py`) reads, and so writes here:
- detection: any config with `draft_vocab_size`; the architecture becomes "EAGLE3" + the name
  with "Eagle3" stripped, so `LlamaForCausalLMEagle3` resolves to `EAGLE3LlamaForCausalLM`;
- `fc_norm` at the top level (one RMSNorm per tapped layer), `eagle_config.norm_before_fc`
  (`input_norm`), post-norm feedback from `eagle_config.return_hidden_post_norm` (older
  releases) or top-level `norm_output` (newest): BOTH are written so no release runs an
  EAGLE 3.1 drafter with pre-norm feedback;
- `target_hidden_size` read with hasattr(): always written as a number, never null;
- weights `midlayer.*` (one layer) or `midlayer.N.*`; later layers are "regular" and normalise
  their input with `hidden_norm` (our `layers.N.input_layernorm`); `d2t` exists only when
  draft_vocab_size != vocab_size and is int32; `t2d` is not read; `lm_head` present means the
  drafter's own, absent means the target's; `embed_tokens` is needed only when hidden sizes differ.

Tapped layers arrive in ascending order (`triton_bundle.ascending_taps`): TensorRT-LLM concatenates
the captured states in layer order. Drafters it would run differently from the reference are
refused, never written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from eagle31_export.config import DrafterConfig
from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.formats.drafter import DrafterCheckpoint
from eagle31_export.formats.drafter_formats import llama_fields, llama_keys
from eagle31_export.formats.safetensors_io import SafetensorsDir, read_json, save_tensors, write_json

# Resolves to the registered `EAGLE3LlamaForCausalLM` (Eagle3ForCausalLM), which switches to MLA
# attention by itself when the config has `kv_lora_rank`. An "Eagle3DeepseekV3..." name would
# resolve to "EAGLE3DeepseekV3ForCausalLM", which the releases read here do not register.
ARCHITECTURE = "LlamaForCausalLMEagle3"


def trtllm_problems(ckpt: DrafterCheckpoint) -> list[str]:
    """Why TensorRT-LLM would run this drafter differently from the reference (silently)."""
    cfg, names = ckpt.config, set(ckpt.tensors)
    problems = []
    if cfg.norm_before_residual:
        problems.append("the drafter uses norm_before_residual, which TensorRT-LLM's Eagle3 layer does not "
                        "implement (it would add the un-normed state); serve it with vLLM or SGLang")
    if cfg.num_aux_hidden_states < 2:
        problems.append("the drafter taps one layer; TensorRT-LLM skips fc for a single tapped layer, "
                        "so it cannot run this drafter")
    ids = list(cfg.aux_layer_ids or ())
    if ids != sorted(set(ids)):
        problems.append(f"tapped layers {ids} are not strictly ascending; TensorRT-LLM concatenates them in "
                        "layer order (export through checked_pair, which reorders fc)")
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" in names and bool(ckpt.tensors["d2t"].any()):
        problems.append("d2t permutes a full-size draft vocabulary; TensorRT-LLM ignores d2t when "
                        "draft_vocab_size == vocab_size")
    if cfg.effective_target_hidden_size != cfg.hidden_size and "embed_tokens.weight" not in names:
        problems.append("hidden sizes differ from the target's, so TensorRT-LLM needs the drafter's own "
                        "embed_tokens, which this checkpoint lacks")
    if cfg.draft_vocab_size != cfg.vocab_size and "lm_head.weight" not in names:
        problems.append("the drafter has a reduced vocabulary but no lm_head")
    return problems


def trtllm_config(cfg: DrafterConfig) -> dict[str, Any]:
    ids = list(cfg.aux_layer_ids or ())
    mla = cfg.attention == "mla"
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3" if mla else "llama",  # DeepseekV3Config carries the MLA ranks
        **llama_keys(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.effective_target_hidden_size,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "bias": False,
        "num_aux_hidden_states": cfg.num_aux_hidden_states,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids,  # output-of-layer, as eagle3_layers_to_capture
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "next_layer_regular": True,
            "eh_proj_before_attn": False,
            "norm_before_fc": cfg.norm_before_fc,
            "return_hidden_post_norm": cfg.norm_output,
        },
    }


def to_trtllm_name(name: str, num_layers: int) -> str:
    match = re.match(r"layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    layer, rest = int(match[1]), match[2]
    if layer > 0 and rest == "input_layernorm.weight":
        rest = "hidden_norm.weight"  # TensorRT-LLM's regular layers normalise with hidden_norm
    return f"midlayer.{rest}" if num_layers == 1 else f"midlayer.{layer}.{rest}"


def from_trtllm_name(name: str, num_layers: int) -> str:
    if not name.startswith("midlayer."):
        return name
    rest = name[len("midlayer."):]
    layer = 0
    if num_layers > 1:
        head, rest = rest.split(".", 1)
        layer = int(head)
    if layer > 0 and rest == "hidden_norm.weight":
        rest = "input_layernorm.weight"
    return f"layers.{layer}.{rest}"


def trtllm_tensors(ckpt: DrafterCheckpoint) -> dict[str, torch.Tensor]:
    """Canonical tensors renamed for TensorRT-LLM (taps already in ascending order)."""
    cfg = ckpt.config
    out: dict[str, torch.Tensor] = {}
    for name in ckpt.tensors:
        t = ckpt.tensors[name]
        if name == "t2d":
            continue
        if name == "d2t":
            if cfg.draft_vocab_size == cfg.vocab_size:
                continue
            t = t.to(torch.int32)
        out[to_trtllm_name(name, cfg.num_layers)] = t.contiguous()
    return out


def write_trtllm_drafter(ckpt: DrafterCheckpoint, folder: Path) -> dict[str, Any]:
    """Write config.json + model.safetensors into `folder` (inside the caller's atomic output)."""
    problems = trtllm_problems(ckpt)
    if problems:
        raise UserError(f"cannot export for TensorRT-LLM: {problems[0]}")
    folder.mkdir(parents=True, exist_ok=True)
    config = trtllm_config(ckpt.config)
    save_tensors(trtllm_tensors(ckpt), folder)
    write_json(folder / "config.json", config)
    return config


def read_trtllm_drafter(path: str | os.PathLike) -> DrafterCheckpoint:
    """Read a drafter written by `write_trtllm_drafter` back into canonical config and names."""
    path = Path(path)
    c = read_json(path / "config.json")
    e = c.get("eagle_config") or {}
    try:
        ids = tuple(int(i) for i in e["eagle_aux_hidden_state_layer_ids"])
        cfg = DrafterConfig(
            **llama_fields(c),
            draft_vocab_size=int(c["draft_vocab_size"]),
            target_hidden_size=int(c["target_hidden_size"]) if c["target_hidden_size"] != c["hidden_size"] else None,
            aux_layer_ids=ids,
            num_aux_hidden_states=len(ids),
            fc_norm=bool(c.get("fc_norm")),
            norm_output=bool(c.get("norm_output") or e.get("return_hidden_post_norm")),
            norm_before_fc=bool(e.get("norm_before_fc")),
        )
    except KeyError as missing:
        raise CheckpointError(f"{path / 'config.json'}: lacks {missing}; not a TensorRT-LLM drafter bundle") from None
    source = SafetensorsDir(path)
    tensors = {from_trtllm_name(n, cfg.num_layers): source[n] for n in source}
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].to(torch.int64)
    return DrafterCheckpoint(cfg, tensors, "trtllm", path)
