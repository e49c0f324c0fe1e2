"""Reference EAGLE-3 / EAGLE 3.1 drafter: the PyTorch source of truth.

One step (docs/drafter-formats.md#architecture, docs/eagle31.md), for the first drafter layer:

    g        = fc(cat(fc_norm_i(a_i)))          first step only; later steps: g = fed-back state
    residual = hidden_norm(g) if norm_before_residual else g
    h1       = residual + attn(cat(input_layernorm(embed(x)), hidden_norm(g)))
    h        = h1 + mlp(post_attention_layernorm(h1))
    logits   = lm_head(norm(h))                 over the draft vocabulary
    fed back = norm(h) if norm_output else h

The module's parameter names ARE the canonical tensor names of this package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from eagle31_export.config import DrafterConfig
from eagle31_export.reference.attention import GqaAttention, KVCache, MlaAttention
from eagle31_export.reference.ops import DrafterKernels, RMSNorm, TorchKernels

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class Mlp(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Layer 0 is EAGLE-3's midlayer (2H attention input); later layers are plain decoder layers."""

    def __init__(self, cfg: DrafterConfig, layer_id: int):
        super().__init__()
        self.first = layer_id == 0
        self.norm_before_residual = cfg.norm_before_residual
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if self.first:
            self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        attention = MlaAttention if cfg.attention == "mla" else GqaAttention
        self.self_attn = attention(cfg, layer_id, 2 * h if self.first else h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = Mlp(cfg)

    def forward(self, x: torch.Tensor, g: torch.Tensor | None, positions: torch.Tensor,
                cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (h1, mlp update); the caller adds them (fused with the final norm when last)."""
        if self.first:
            normed_g = self.hidden_norm(g)
            residual = normed_g if self.norm_before_residual else g
            attn_in = torch.cat([self.input_layernorm(x), normed_g], dim=-1)
        else:
            residual, attn_in = x, self.input_layernorm(x)
        h1 = residual + self.self_attn(attn_in, positions, cache)
        return h1, self.mlp(self.post_attention_layernorm(h1))


@dataclass
class DraftStep:
    logits: torch.Tensor  # [B, T, draft_vocab]
    normed: torch.Tensor  # [B, T, H], the lm_head input
    fed_back: torch.Tensor  # [B, T, H], the state the next step consumes
    residual: torch.Tensor | None = None  # the last layer's h1 and MLP update, kept so that
    update: torch.Tensor | None = None  # `pre_norm` costs nothing unless asked for

    @property
    def pre_norm(self) -> torch.Tensor:
        """h = residual + update [B, T, H], before the final norm (what EAGLE-3 feeds back)."""
        return self.residual + self.update


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, kernels: DrafterKernels | None = None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels or TorchKernels()
        h, ht, k, eps = cfg.hidden_size, cfg.effective_target_hidden_size, cfg.num_aux_hidden_states, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(k * ht, h, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(ht, eps) for _ in range(k)])
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(k * ht, eps)
        self.layers = nn.ModuleList([DrafterLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def fuse_taps(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the k tapped states [.., k*Ht] (with fc_norm or norm_before_fc as configured)."""
        cfg = self.cfg
        if cfg.norm_before_fc:
            return self.kernels.fc_norm([self.input_norm(aux)], self.fc.weight, None, cfg.rms_norm_eps)
        sources = aux.split(cfg.effective_target_hidden_size, dim=-1)
        norms = [n.weight for n in self.fc_norm] if cfg.fc_norm else None
        return self.kernels.fc_norm(sources, self.fc.weight, norms, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                cache: KVCache, hidden_is_aux: bool) -> DraftStep:
        """One drafter call over T positions.

        `hidden` is the concatenated tapped target states [B, T, k*Ht] when `hidden_is_aux`,
        otherwise the drafter's own fed-back state [B, T, H].
        """
        dtype = self.fc.weight.dtype
        hidden = hidden.to(dtype)
        g = self.fuse_taps(hidden) if hidden_is_aux else hidden
        x = self.embed_tokens(input_ids)
        for layer in self.layers[:-1]:
            h1, update = layer(x, g, positions, cache)
            x, g = h1 + update, None
        h1, update = self.layers[-1](x, g, positions, cache)
        normed, fed_back = self.kernels.post_norm_feedback(h1, update, self.norm.weight, self.cfg.rms_norm_eps,
                                                           self.cfg.norm_output)
        return DraftStep(self.lm_head(normed), normed, fed_back, h1, update)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """d2t is an offset table: target_id = d + d2t[d]."""
        return draft_ids + self.d2t[draft_ids]


def build_drafter(ckpt, dtype: torch.dtype = torch.float32, target_model: nn.Module | None = None,
                  kernels: DrafterKernels | None = None) -> Eagle3Drafter:
    """The reference drafter filled from a `DrafterCheckpoint` (canonical names), computing in `dtype`.

    Embeddings, and lm_head when absent, come from the target model, as every runtime does: the
    very tensors the target holds (or its packed NVFP4 lm_head module), never a second copy.
    Weights stay as stored wherever `dtype` widens them exactly and are cast per operation
    (`reference.upcast`); `fc` and the norms, which the fused operations take as tensors, are
    held in `dtype` (`fc.weight.dtype` is the drafter's compute dtype).
    """
    from eagle31_export.errors import CheckpointError
    from eagle31_export.formats.safetensors_io import upcasts_exactly
    from eagle31_export.reference.upcast import compute_in

    cfg = ckpt.config
    state = {name: ckpt.tensors[name] for name in ckpt.tensors if name != "t2d"}
    shared_head = None
    if "embed_tokens.weight" not in state:
        if target_model is None:
            raise CheckpointError("the drafter has no embed_tokens; load it together with its target")
        state["embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach()
    if "lm_head.weight" not in state:
        if target_model is None or cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError("the drafter has no lm_head; it needs the target's, with draft_vocab_size == vocab_size")
        head = target_model.get_output_embeddings()
        if isinstance(getattr(head, "weight", None), torch.Tensor):
            state["lm_head.weight"] = head.weight.detach()
        else:  # an NVFP4 lm_head kept packed: share its storage, without the target's input quantization
            shared_head = _shared_packed_head(head)
            state["lm_head.weight"] = torch.empty((cfg.draft_vocab_size, cfg.hidden_size), device="meta")
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    state["d2t"] = state["d2t"].to(torch.int64)

    def held(name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        directly_used = name == "fc.weight" or name.startswith("fc_norm.") or name.endswith("norm.weight")
        return t if upcasts_exactly(t.dtype, dtype) and not directly_used else t.to(dtype)

    state = {k: held(k, v) for k, v in state.items()}
    module = _unfilled_drafter(cfg, kernels)
    # assign: the module takes the tensors themselves (the target's embeddings included), not copies
    module.load_state_dict(state, strict=True, assign=True)
    for sub in module.modules():  # buffers computed from the config (rotary tables) in `dtype`, as before
        for name, buf in sub.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(sub, name, buf.to(dtype))
    if shared_head is not None:
        module.lm_head = shared_head
    return compute_in(module, dtype).eval()


def _unfilled_drafter(cfg: DrafterConfig, kernels: DrafterKernels | None) -> Eagle3Drafter:
    """An Eagle3Drafter whose parameters are allocated but never written (every one is replaced by
    `load_state_dict(assign=True)`): untouched pages cost no memory. Buffers computed from the
    config (rotary tables) are real."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        import contextlib

        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        return Eagle3Drafter(cfg, kernels)


def _shared_packed_head(head: nn.Module) -> nn.Module:
    from eagle31_export.errors import CheckpointError
    from eagle31_export.formats.nvfp4.model import NVFP4Linear

    if not isinstance(head, NVFP4Linear):
        raise CheckpointError(f"the target's lm_head is a {type(head).__name__} without a weight; the drafter "
                              "cannot share it")
    # the same codes and scales; no input quantization (the drafter's lm_head runs unquantized inputs)
    return NVFP4Linear(head, head.weight_packed, head.weight_scale, head.weight_scale_2)
