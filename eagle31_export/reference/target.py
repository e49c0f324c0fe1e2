"""Reference target: any transformers causal LM, returning logits plus tapped hidden states."""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path

import torch
from torch import nn

from eagle31_export.errors import UserError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer stack of a transformers causal LM (Llama, Qwen2/3, Mistral, ...)."""
    from eagle31_export.formats.target.checkpoint import DECODER_LAYER_PATHS

    for path in DECODER_LAYER_PATHS:
        mod = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, nn.ModuleList):
            return mod
    raise UserError(f"cannot find the decoder layers of {type(model).__name__}; supported: Llama, Qwen2/3, Mistral")


class ReferenceTarget:
    """Runs the target with a KV cache and taps the OUTPUT of each layer in `aux_layer_ids`.

    Taps use forward hooks on the decoder layers rather than `output_hidden_states`, whose
    last entry is post-final-norm in transformers and would silently mis-tap layer N-1.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: tuple[int, ...]):
        self.model = model
        self.layers = decoder_layers(model)
        n = len(self.layers)
        bad = [i for i in aux_layer_ids if not 0 <= i < n]
        if bad:
            raise UserError(f"tapped layer ids {bad} out of range for a target with {n} layers (0..{n - 1})")
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.num_layers = n
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.cache = None
        self._length = 0

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (weights may be held narrower, as stored: reference/upcast.py)."""
        return getattr(self.model, "compute_dtype", None) or next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self._length = 0

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `input_ids` [1, T] to the cache; return logits [1, T, V] (the last `logits_to_keep`
        positions only, when given: the lm_head then runs on those alone) and taps [1, T, k*H].

        The model computes on its own device (ids, positions and the cache live there); the results
        come back on the device the ids came from, so callers on the CPU never see a GPU tensor."""
        if self.cache is None:
            self.reset()
        t, back, device = input_ids.shape[1], input_ids.device, self.device
        positions = torch.arange(self._length, self._length + t, device=device).unsqueeze(0)
        keep = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}  # any causal LM takes the default
        with self.tapping() as taps:
            out = self.model(input_ids=input_ids.to(device), position_ids=positions, past_key_values=self.cache,
                             use_cache=True, **keep)
        self.cache = out.past_key_values
        self._length += t
        return out.logits.to(back), taps().to(back)

    @contextlib.contextmanager
    def tapping(self):
        """Hooks on the tapped layers for one model call; yields a function returning the taps
        concatenated in `aux_layer_ids` order [.., k*H]."""
        store: dict[int, torch.Tensor] = {}
        handles = [self.layers[i].register_forward_hook(_tap_into(store, i)) for i in self.aux_layer_ids]
        try:
            yield lambda: torch.cat([store[i] for i in self.aux_layer_ids], dim=-1)
        finally:
            for h in handles:
                h.remove()

    def truncate(self, length: int) -> None:
        """Drop cache entries past `length` (rejected draft tokens)."""
        self.cache.crop(length)
        self._length = length


def _tap_into(store: dict[int, torch.Tensor], layer_id: int):
    def hook(_module, _inputs, output):
        store[layer_id] = output[0] if isinstance(output, tuple) else output

    return hook


# Loaded models by (folder, dtype, act_quant, NVFP4 semantics, file sizes and times): two targets of one run over the same
# checkpoint (parity's reference side and a runtime verifying with the reference target) share its
# weights; each ReferenceTarget keeps its own cache. Held only while some ReferenceTarget uses it.
_LOADED: "weakref.WeakValueDictionary[tuple, nn.Module]" = weakref.WeakValueDictionary()


def _checkpoint_key(path: str | os.PathLike, dtype: torch.dtype, act_quant: bool, semantics: str) -> tuple:
    folder = Path(path).resolve()
    files = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file()))
    return str(folder), str(dtype), act_quant, semantics, files


def load_target(path: str | os.PathLike, aux_layer_ids: tuple[int, ...], dtype: torch.dtype = torch.float32,
                act_quant: bool = False, nvfp4_semantics: str = "exact") -> ReferenceTarget:
    """The reference target over the checkpoint at `path`, computing in `dtype`.

    Weights stay in memory as stored (bf16 as bf16, NVFP4 packed) and are cast per operation
    (`reference.upcast`): the same results as weights loaded in `dtype`, at about the
    checkpoint's bytes."""
    from eagle31_export.formats.target.checkpoint import load_causal_lm
    from eagle31_export.reference.grouped_sdpa import use_grouped_sdpa
    from eagle31_export.reference.upcast import compute_in

    key = _checkpoint_key(path, dtype, act_quant, nvfp4_semantics) if Path(path).is_dir() else None
    model = _LOADED.get(key) if key is not None else None
    if model is None:
        model = compute_in(load_causal_lm(path, dtype=dtype, act_quant=act_quant, stored_weights=True,
                                          nvfp4_semantics=nvfp4_semantics), dtype)
        use_grouped_sdpa(model)
        if key is not None:
            _LOADED[key] = model
    return ReferenceTarget(model, aux_layer_ids)


@torch.no_grad()
def tapped_forward(target: ReferenceTarget, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache-free forward over a batch [B, T]: logits and the same taps as `forward`."""
    with target.tapping() as taps:
        logits = target.model(input_ids=input_ids.to(target.device), use_cache=False).logits
    return logits.to(input_ids.device), taps().to(input_ids.device)
