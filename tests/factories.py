"""Tiny random-weight targets and matching drafters, made by code (tests and benchmarks).

No downloads: targets are transformers models built from small configs; drafters are
canonical checkpoints that can be written in any supported format.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from eagle31_export.config import DrafterConfig, MlaConfig, TargetInfo, default_aux_layer_ids
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, expected_shapes, t2d_from_d2t

TARGET_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_target_config(family: str = "llama", num_layers: int = 8, hidden: int = 64, vocab: int = 256,
                       heads: int = 4, kv_heads: int = 2, intermediate: int = 128):
    from transformers import AutoConfig

    if family not in TARGET_FAMILIES:
        raise ValueError(f"family must be one of {TARGET_FAMILIES}")
    return AutoConfig.for_model(
        family, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=512,
        head_dim=hidden // heads, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
        architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "mistral": "MistralForCausalLM"}[family]],
    )


def make_target(folder: str | os.PathLike, family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                **sizes) -> Path:
    """Save a random transformers causal LM (safetensors) and return its folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_target_config(family, **sizes)).to(dtype)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def drafter_config_for(target: TargetInfo, fc_norm: bool = False, norm_output: bool = False,
                       draft_vocab_size: int | None = None, aux_layer_ids: tuple[int, ...] | None | str = "default",
                       num_aux: int = 3, mla: bool = False, **overrides) -> DrafterConfig:
    """aux_layer_ids "default": the target's EAGLE-3 default, written out as trainers write it (3 taps);
    None: a config that names no tapped layers."""
    if aux_layer_ids == "default":
        aux_layer_ids = default_aux_layer_ids(target.num_hidden_layers) if num_aux == 3 else None
    heads = target.num_attention_heads
    fields = dict(
        hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size, num_attention_heads=heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.hidden_size // heads,
        vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size or target.vocab_size // 2,
        aux_layer_ids=aux_layer_ids, num_aux_hidden_states=len(aux_layer_ids) if aux_layer_ids else num_aux,
        fc_norm=fc_norm, norm_output=norm_output, torch_dtype="float32", max_position_embeddings=512,
    )
    if mla:
        fields.update(attention="mla", mla=MlaConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                                     qk_rope_head_dim=4, v_head_dim=8))
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_drafter(cfg: DrafterConfig, seed: int = 0, with_embeddings: bool = False) -> DrafterCheckpoint:
    """Canonical tensors with O(1)-scaled random weights (so logits are far from ties)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "embed_tokens.weight" and not with_embeddings:
            continue
        if name in ("d2t", "t2d"):
            continue
        if len(shape) == 1:  # norm weights: around 1, different per channel
            tensors[name] = 1.0 + 0.5 * torch.rand(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    chosen = torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values
    tensors["d2t"] = chosen - torch.arange(cfg.draft_vocab_size)
    tensors["t2d"] = t2d_from_d2t(tensors["d2t"], cfg.vocab_size)
    return DrafterCheckpoint(cfg, tensors)


@torch.no_grad()
def greedy_decode(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy decoding, one token per forward: what speculation must reproduce."""
    target.reset()
    logits, _ = target.forward(torch.tensor([prompt_ids]))
    out = [int(torch.argmax(logits[0, -1]))]
    while len(out) < max_new_tokens:
        logits, _ = target.forward(torch.tensor([[out[-1]]]))
        out.append(int(torch.argmax(logits[0, -1])))
    return out


def kimi_make_pair_module():
    """`examples/kimi/make_pair.py` as a module: the published Kimi K2.x configs live there once."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "kimi" / "make_pair.py"
    spec = importlib.util.spec_from_file_location("kimi_make_pair", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_ttt_matches_inference(drafter, taps: torch.Tensor, x: torch.Tensor, unroll: int) -> None:
    """The teacher-forced chain (`ttt_forward`) equals the drafter run step by step as inference runs it,
    from every anchor position: step 1 from the taps, later steps from the fed-back state."""
    from eagle31_export.reference.attention import KVCache
    from eagle31_export.reference.ttt import ttt_forward

    with torch.no_grad():
        ttt = ttt_forward(drafter, taps, x, unroll)
        for anchor in range(taps.shape[1]):
            cache = KVCache()
            step = drafter(x[:, 1:anchor + 2], torch.arange(anchor + 1).unsqueeze(0), taps[:, :anchor + 1], cache, True)
            torch.testing.assert_close(step.logits[0, -1], ttt[0][0, anchor], rtol=1e-9, atol=1e-9)
            for k in range(1, unroll):
                step = drafter(x[:, anchor + 1 + k:anchor + 2 + k], torch.tensor([[anchor + k]]),
                               step.fed_back[:, -1:], cache, False)
                torch.testing.assert_close(step.logits[0, -1], ttt[k][0, anchor], rtol=1e-9, atol=1e-9)


def without_padding(feeds: dict) -> dict:
    """A graph call's feeds with the `attention_mask` of a call without padding: every cached and new
    key of every row is real (batched calls with padding: runtime/onnxruntime.py `run_batch`)."""
    ids, past = feeds["input_ids"], feeds["past_key_0"].shape[2]
    return {**feeds, "attention_mask": np.ones((ids.shape[0], past + ids.shape[1]), np.int64)}
