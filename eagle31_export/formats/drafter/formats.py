"""One class per drafter checkpoint format: config keys and tensor names, in and out.

Each format converts ITS conventions (nesting, tapped-layer numbering, tensor prefixes) to
and from the canonical `DrafterConfig` and canonical tensor names (the parameter names of
`reference.drafter.Eagle3Drafter`). Nothing outside this module knows a format's keys.

Tapped-layer numbering per format (docs/tapped-layers.md#per-format-numbering):
- eagle (original EAGLE) and speculators: "before layer i" (vLLM's numbering), top-level
  `eagle_aux_hidden_state_layer_ids`.
- specforge / TorchSpec, modelopt and trtllm (TensorRT-LLM's own drafter layout): "output of
  layer i", `eagle_config.eagle_aux_hidden_state_layer_ids`.

`consumer_layout` says which of these layouts each serving runtime reads.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle31_export.config import (
    DrafterConfig,
    MlaConfig,
    before_layer_to_output,
    full_attention_rope,
    output_to_before_layer,
    scaling_from_parameters,
)
from eagle31_export.errors import CheckpointError

# Keys of a transformers LlamaConfig / DeepseekV3Config that carry no architectural meaning
# for the drafter: accepted silently.
HF_BOOKKEEPING = {
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "transformers_version", "use_cache", "tie_word_embeddings", "pretraining_tp", "mlp_bias",
    "attention_dropout", "_name_or_path", "dtype", "torch_dtype", "rope_parameters", "rope_interleave",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
    "moe_layer_freq", "routed_scaling_factor", "topk_group", "n_group", "topk_method", "norm_topk_prob",
    "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "layer_types",
    "use_sliding_window", "sliding_window", "max_window_layers", "output_router_logits", "router_aux_loss_coef",
    "auto_map",
}
# Bookkeeping keys a serving runtime still reads (transformers' attention-window settings): kept in
# `DrafterConfig.extras` on read and written back by every writer, never dropped.
RUNTIME_KEYS = ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers")
# What TorchSpec (lightseekorg/TorchSpec) adds to the configs it writes.
TORCHSPEC_KEYS = {"_torchspec_version"}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


_REQUIRED = object()


def _int(c: dict[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """An integer config value; a string, a bool or a fractional number is refused by name."""
    value = c.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"lacks {key!r}, which every drafter config needs")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{key} is {value!r}; expected an integer")
    return value


def _float(c: dict[str, Any], key: str, default: float) -> float:
    value = c.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{key} is {value!r}; expected a number")
    return float(value)


def _str(c: dict[str, Any], key: str, default: str) -> str:
    value = c.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise CheckpointError(f"{key} is {value!r}; expected a string")
    return value


def _object(c: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested config object (e.g. `eagle_config`); absent or null is empty."""
    value = c.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{key} is a JSON {type(value).__name__}; expected an object")
    return value


def _rope_scaling(c: dict[str, Any], rope_parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The drafter's rope_scaling from either spelling: transformers v4's `rope_scaling`, or v5's
    `rope_parameters` (theta, `rope_type` and the scaling fields in one object; a `rope_type` of
    "default" or none is no scaling). Both given: `rope_scaling`, as transformers v4 reads it.

    Reading only `rope_theta` from `rope_parameters` would drop a yarn / llama3 schedule silently and
    every writer would then write the drafter without it (vllm-project/speculators PR 574)."""
    rope_scaling = c.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise CheckpointError(f"rope_scaling is {rope_scaling!r}; expected an object or null")
    if rope_scaling is not None:
        return rope_scaling
    kind = rope_parameters.get("rope_type", rope_parameters.get("type"))
    if kind is not None and not isinstance(kind, str):
        raise CheckpointError(f"rope_parameters.rope_type is {kind!r}; expected a string")
    return scaling_from_parameters(rope_parameters)


def llama_fields(c: dict[str, Any]) -> dict[str, Any]:
    """Canonical fields from a Llama/DeepSeek-style flat config."""
    heads = _int(c, "num_attention_heads")
    hidden = _int(c, "hidden_size")
    rope_parameters = _object(c, "rope_parameters")
    rope_parameters = full_attention_rope(rope_parameters)
    rope_scaling = _rope_scaling(c, rope_parameters)
    out = dict(
        hidden_size=hidden,
        intermediate_size=_int(c, "intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=_int(c, "num_key_value_heads", heads),
        head_dim=_int(c, "head_dim", hidden // heads if heads > 0 else 0),
        vocab_size=_int(c, "vocab_size"),
        num_layers=_int(c, "num_hidden_layers", 1),
        rms_norm_eps=_float(c, "rms_norm_eps", 1e-6),
        rope_theta=_float(c, "rope_theta", _float(rope_parameters, "rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(c, "max_position_embeddings", 2048),
        max_position_source="config" if c.get("max_position_embeddings") is not None else "default",
        hidden_act=_str(c, "hidden_act", "silu"),
        attention_bias=_flag(c, "attention_bias"),
        torch_dtype=_str(c, "torch_dtype", _str(c, "dtype", "bfloat16")),
    )
    if c.get("kv_lora_rank"):
        out["attention"] = "mla"
        out["mla"] = MlaConfig(**{k: (_int(c, k) if c.get(k) is not None else None) for k in MLA_KEYS})
    return out


def llama_keys(cfg: DrafterConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": cfg.torch_dtype,
        "tie_word_embeddings": False,
    }
    if cfg.attention == "mla":
        out.update({k: getattr(cfg.mla, k) for k in MLA_KEYS})
    out.update({k: cfg.extras[k] for k in RUNTIME_KEYS if k in cfg.extras})
    if cfg.max_position_source == "default":  # never stated: do not bake in the 2048 assumed here
        del out["max_position_embeddings"]
    return out


def runtime_extras(c: dict[str, Any]) -> dict[str, Any]:
    """The `RUNTIME_KEYS` a config carries, for `DrafterConfig.extras`."""
    return {k: c[k] for k in RUNTIME_KEYS if k in c}


LLAMA_KEYS = {
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act",
    "attention_bias", *MLA_KEYS,
}


def _flag(c: dict[str, Any], *names: str) -> bool:
    """A boolean config flag (true/false, 0/1, or absent/null for false)."""
    for n in names:
        value = c.get(n)
        if value is not None and value not in (True, False):  # 0 and 1 compare equal to the bools
            raise CheckpointError(f"{n} is {value!r}; expected true or false")
    return any(bool(c.get(n, False)) for n in names)


# The EAGLE 3.1 flags a flat config may also carry inside `eagle_config` (NVIDIA checkpoints nest
# norm_before_fc there: vllm-project/vllm PR #42143). Read as a fallback, as vLLM 0.32 reads
# norm_before_fc; `inspect` names every engine that reads only the top-level key
# (formats/drafter/engine_defaults.py).
NESTABLE_FLAGS = ("fc_norm", "norm_before_fc")


def _nested_flag(c: dict[str, Any], name: str) -> bool:
    return _flag(_object(c, "eagle_config"), name)


def _num_aux(c: dict[str, Any], ids: tuple[int, ...] | None) -> int:
    # vLLM's rule: num_aux_hidden_states, else the number of tapped ids, else 3.
    if c.get("num_aux_hidden_states") is not None:
        return _int(c, "num_aux_hidden_states")
    return len(ids) if ids else 3


def _flat_config(c: dict[str, Any], ids: tuple[int, ...] | None, **flags: bool) -> DrafterConfig:
    """A DrafterConfig from a flat (Llama-style) drafter config, tapped ids already canonical."""
    flags.setdefault("norm_output", _flag(c, "norm_output"))
    return DrafterConfig(
        **llama_fields(c),
        draft_vocab_size=_int(c, "draft_vocab_size", _int(c, "vocab_size")),
        target_hidden_size=_int(c, "target_hidden_size", None),
        aux_layer_ids=ids,
        num_aux_hidden_states=_num_aux(c, ids),
        norm_before_residual=_flag(c, "norm_before_residual"),
        extras=runtime_extras(c),
        **flags,
    )


def _flat_keys(cfg: DrafterConfig, architecture: str, model_type: str) -> dict[str, Any]:
    """The flat config keys SpecForge and ModelOpt share (both write the 3.1 flags explicitly)."""
    out = {"architectures": [architecture], "model_type": model_type, **llama_keys(cfg),
           "draft_vocab_size": cfg.draft_vocab_size, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}
    if cfg.target_hidden_size is not None:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.norm_before_residual:
        out["norm_before_residual"] = True
    if cfg.num_aux_hidden_states != 3:
        out["num_aux_hidden_states"] = cfg.num_aux_hidden_states
    return out


def _refuse(fmt: DrafterFormat, cfg: DrafterConfig) -> None:
    problems = fmt.limits(cfg)
    if problems:
        raise CheckpointError(problems[0])


def _nested_eagle_config(fmt, flat: dict[str, Any], c: dict[str, Any], e: dict[str, Any],
                         ids: tuple[int, ...] | None) -> tuple[DrafterConfig, list[str]]:
    """ModelOpt and TensorRT-LLM: flat keys plus flags nested in `eagle_config`. TensorRT-LLM reads the
    feedback flag as eagle_config.return_hidden_post_norm (docs/runtimes.md#eagle-31-across-tensorrt-llm-versions)."""
    cfg = _flat_config(flat, ids, fc_norm=_flag(c, "fc_norm"),
                       norm_output=_flag(c, "norm_output") or _flag(e, "return_hidden_post_norm"),
                       norm_before_fc=_flag(e, "norm_before_fc"))
    return cfg, _unknown(c, fmt.known) + [f"eagle_config.{k}" for k in _unknown(e, fmt.eagle_known)]


def _ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise CheckpointError(f"eagle_aux_hidden_state_layer_ids is {value!r}; expected a list of "
                              "layer numbers")
    return tuple(value)


class DrafterFormat:
    """Base: a format that stores the first layer under `layer_prefix` and the rest as given.

    The class attributes are the format's special cases; `formats.drafter.format_drafter` applies
    them, so every writer (standalone checkpoint or serving bundle) follows the same rules.
    """

    name = ""
    layer_prefix = "layers."  # how the format names canonical `layers.`
    max_layers: int | None = None  # drafter layers the format can hold (None: any number)
    has_norm_before_fc = True  # whether the config can say norm_before_fc (input_norm over the concatenation)
    stores_t2d = True  # writes the t2d buffer (derived from d2t when the checkpoint lacks it)
    d2t_dtype = torch.int64  # dtype d2t is stored in (read back as canonical int64)
    stores_full_vocab_d2t = True  # writes d2t even when draft_vocab_size == vocab_size
    # Where this format's config.json holds each EAGLE 3.1 flag: the key paths its reader takes the
    # flag from (the first is the one its writer sets). `inspect`'s default lints and the sabotage
    # library (eagle31_export/sabotage.py) use these instead of spelling a format's keys themselves.
    flag_keys: dict[str, tuple[tuple[str, ...], ...]] = {
        "fc_norm": (("fc_norm",), ("eagle_config", "fc_norm")),
        "norm_output": (("norm_output",),),
        "norm_before_fc": (("eagle_config", "norm_before_fc"),),
    }

    # ---- what the format can hold -----------------------------------------
    def limits(self, cfg: DrafterConfig) -> list[str]:
        """Why this format cannot hold a drafter with config `cfg` (empty: it can)."""
        problems = []
        if self.max_layers is not None and cfg.num_layers > self.max_layers:
            problems.append(f"format {self.name!r} holds {self.max_layers} drafter layer(s); "
                            f"this drafter has {cfg.num_layers}")
        if cfg.norm_before_fc and not self.has_norm_before_fc:
            problems.append(f"the {self.name} format has no norm_before_fc; write speculators or modelopt")
        return problems

    def holds(self, cfg: DrafterConfig) -> bool:
        return not self.limits(cfg)

    def key_path(self, key: str) -> tuple[str, ...]:
        """Where a Llama-style key (`max_position_embeddings`, `rope_scaling`, `sliding_window`, ...)
        lives in this format's config.json."""
        return (key,)

    # ---- tensor names ----------------------------------------------------
    def to_canonical(self, name: str, cfg: DrafterConfig) -> str:
        if self.layer_prefix != "layers." and name.startswith(self.layer_prefix):
            return "layers.0." + name[len(self.layer_prefix):]
        return name

    def from_canonical(self, name: str, cfg: DrafterConfig) -> str:
        if self.layer_prefix != "layers." and name.startswith("layers."):
            if cfg.num_layers != 1:
                raise CheckpointError(f"format {self.name!r} holds one drafter layer; this drafter has {cfg.num_layers}")
            return self.layer_prefix + name[len("layers.0."):]
        return name

    # ---- config ----------------------------------------------------------
    def read_config(self, c: dict[str, Any]) -> tuple[DrafterConfig, list[str]]:
        raise NotImplementedError

    def write_config(self, cfg: DrafterConfig) -> dict[str, Any]:
        raise NotImplementedError


class EagleFormat(DrafterFormat):
    """SafeAILab/EAGLE `traineagle3`: a LlamaConfig plus `draft_vocab_size`; `midlayer.*` names."""

    name = "eagle"
    layer_prefix = "midlayer."
    max_layers = 1
    has_norm_before_fc = False
    architecture = "LlamaForCausalLM"
    known = LLAMA_KEYS | {"draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                          "num_aux_hidden_states", "fc_norm", "norm_output", "norm_before_residual"}

    def read_config(self, c):
        ids = _ids(c.get("eagle_aux_hidden_state_layer_ids"))
        ids = before_layer_to_output(ids) if ids is not None else None
        return (_flat_config(c, ids, fc_norm=_flag(c, "fc_norm") or _nested_flag(c, "fc_norm"),
                             norm_before_fc=_nested_flag(c, "norm_before_fc")),
                _unknown(c, self.known))

    def write_config(self, cfg):
        out = {"architectures": [self.architecture], "model_type": "llama", **llama_keys(cfg),
               "draft_vocab_size": cfg.draft_vocab_size}
        if cfg.target_hidden_size is not None:
            out["target_hidden_size"] = cfg.target_hidden_size
        if cfg.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(output_to_before_layer(cfg.aux_layer_ids))
        if cfg.num_aux_hidden_states != 3:
            out["num_aux_hidden_states"] = cfg.num_aux_hidden_states
        # EAGLE 3.1 / variant flags only when set, so EAGLE-3 configs stay byte-for-byte classic.
        for flag in ("fc_norm", "norm_output", "norm_before_residual"):
            if getattr(cfg, flag):
                out[flag] = True
        _refuse(self, cfg)
        return out


class SpecForgeFormat(EagleFormat):
    """SpecForge / TorchSpec: `LlamaForCausalLMEagle3`, `midlayer.*`, `fc_norm.{i}`, output-of-layer ids."""

    name = "specforge"
    architecture = "LlamaForCausalLMEagle3"
    flag_keys = {**EagleFormat.flag_keys,
                 "fc_norm": (("fc_norm",), ("use_aux_norm",), ("eagle_config", "fc_norm"))}
    known = EagleFormat.known | {"eagle_config", "use_aux_norm"} | TORCHSPEC_KEYS

    def read_config(self, c):
        eagle_cfg = _object(c, "eagle_config")
        ids = _ids(eagle_cfg.get("eagle_aux_hidden_state_layer_ids", c.get("eagle_aux_hidden_state_layer_ids")))
        cfg = _flat_config(c, ids, fc_norm=_flag(c, "fc_norm", "use_aux_norm") or _nested_flag(c, "fc_norm"),
                           norm_before_fc=_nested_flag(c, "norm_before_fc"))  # use_aux_norm: sglang's alias
        unknown = _unknown(c, self.known) + [f"eagle_config.{k}" for k in eagle_cfg
                                             if k not in ("eagle_aux_hidden_state_layer_ids", *NESTABLE_FLAGS)]
        return cfg, unknown

    def write_config(self, cfg):
        out = _flat_keys(cfg, self.architecture, "llama")
        if cfg.aux_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
        _refuse(self, cfg)
        return out


class SpeculatorsFormat(DrafterFormat):
    """vllm-project/speculators `eagle3`: the layer config nested in `transformer_layer_config`."""

    name = "speculators"
    flag_keys = {"fc_norm": (("fc_norm",), ("eagle_config", "fc_norm")), "norm_output": (("norm_output",),),
                 "norm_before_fc": (("norm_before_fc",), ("eagle_config", "norm_before_fc"))}

    def key_path(self, key):
        return ("transformer_layer_config", key) if key in LLAMA_KEYS or key in RUNTIME_KEYS else (key,)
    known = {"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
             "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
             "fc_norm", "norm_output", "speculators_config", "speculators_version", "enable_sp_ulysses",
             "embed_requires_grad", "num_aux_hidden_states", "has_no_defaults_at_init", "torch_dtype", "dtype",
             "transformers_version"}

    def read_config(self, c):
        layer = c.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise CheckpointError("speculators config.json lacks the transformer_layer_config object")
        ids = _ids(c.get("eagle_aux_hidden_state_layer_ids"))
        ids = before_layer_to_output(ids) if ids is not None else None
        fields = llama_fields(layer)
        if layer.get("num_aux_hidden_states") is not None:
            if c.get("num_aux_hidden_states") is None:
                c = {**c, "num_aux_hidden_states": layer["num_aux_hidden_states"]}
            elif _int(c, "num_aux_hidden_states") != _int(layer, "num_aux_hidden_states"):
                raise CheckpointError(f"num_aux_hidden_states is {c['num_aux_hidden_states']} but "
                                      f"transformer_layer_config.num_aux_hidden_states (what vLLM reads) is "
                                      f"{layer['num_aux_hidden_states']}")
        if c.get("torch_dtype") or c.get("dtype"):
            fields["torch_dtype"] = _str(c, "torch_dtype", _str(c, "dtype", "bfloat16"))
        cfg = DrafterConfig(
            **fields,
            draft_vocab_size=_int(c, "draft_vocab_size", fields["vocab_size"]),
            target_hidden_size=_int(c, "target_hidden_size", None),
            aux_layer_ids=ids,
            num_aux_hidden_states=_num_aux(c, ids),
            fc_norm=_flag(c, "fc_norm") or _nested_flag(c, "fc_norm"),
            norm_output=_flag(c, "norm_output"),
            norm_before_fc=_flag(c, "norm_before_fc") or _nested_flag(c, "norm_before_fc"),
            norm_before_residual=_flag(c, "norm_before_residual"),
            extras={"speculators_config": c.get("speculators_config"), **runtime_extras(layer)},
        )
        unknown = _unknown(c, self.known) + [f"transformer_layer_config.{k}"
                                             for k in _unknown(layer, LLAMA_KEYS | {"num_aux_hidden_states"})]
        return cfg, unknown

    def write_config(self, cfg):
        layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **llama_keys(cfg)}
        layer.pop("torch_dtype")
        # vLLM builds the drafter's model config from transformer_layer_config and copies only named
        # top-level keys into it, not num_aux_hidden_states, which sizes fc: written here as well
        # (docs/drafter-formats.md#speculators).
        layer["num_aux_hidden_states"] = cfg.num_aux_hidden_states
        out = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": cfg.norm_before_residual,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": (list(output_to_before_layer(cfg.aux_layer_ids))
                                                 if cfg.aux_layer_ids is not None else None),
            "norm_before_fc": cfg.norm_before_fc,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "torch_dtype": cfg.torch_dtype,
            "speculators_config": dict(cfg.extras.get("speculators_config") or {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": []},
            }),
        }
        # speculators' from_pretrained reads the verifier's config.json (a folder or hub id) and
        # fails on null: the target the drafter is exported with, when known, is the verifier
        # (docs/runtime-capabilities.md#the-speculators-library-as-a-consumer).
        if cfg.extras.get("verifier"):
            out["speculators_config"]["verifier"] = dict(cfg.extras["verifier"])
        if cfg.num_aux_hidden_states != 3:
            out["num_aux_hidden_states"] = cfg.num_aux_hidden_states
        return out


class ModelOptFormat(DrafterFormat):
    """NVIDIA ModelOpt HF export: nested `eagle_config`, `layers.N.*` names, no `t2d`."""

    name = "modelopt"
    flag_keys = {"fc_norm": (("fc_norm",),),
                 "norm_output": (("norm_output",), ("eagle_config", "return_hidden_post_norm")),
                 "norm_before_fc": (("eagle_config", "norm_before_fc"),)}
    stores_t2d = False  # ModelOpt exports carry no t2d
    known = LLAMA_KEYS | {"eagle_config", "draft_vocab_size", "target_hidden_size", "fc_norm", "norm_output",
                          "num_aux_hidden_states", "norm_before_residual"} | TORCHSPEC_KEYS  # TorchSpec's MLA export
    eagle_known = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "use_input_layernorm_in_first_layer",
                   "use_last_layernorm", "next_layer_regular", "use_mtp_layernorm", "parallel_draft_step",
                   "parallel_draft_heads_num_layers", "norm_before_fc", "return_hidden_post_norm",
                   "eh_proj_before_attn", "eh_proj_bias"}

    def read_config(self, c):
        e = _object(c, "eagle_config")
        ids = _ids(e.get("eagle_aux_hidden_state_layer_ids"))
        if e.get("use_aux_hidden_state") is False:
            raise CheckpointError("eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 drafter, not EAGLE-3")
        if ids is not None and torchspec_shifted_ids(c):
            ids = before_layer_to_output(ids)
        return _nested_eagle_config(self, c, c, e, ids)

    def write_config(self, cfg):
        arch = "Eagle3DeepseekV2ForCausalLM" if cfg.attention == "mla" else "LlamaForCausalLMEagle3"
        out = _flat_keys(cfg, arch, "deepseek_v3" if cfg.attention == "mla" else "llama")
        e: dict[str, Any] = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                             "use_last_layernorm": True, "next_layer_regular": True,
                             "norm_before_fc": cfg.norm_before_fc,
                             "return_hidden_post_norm": cfg.norm_output}
        if cfg.aux_layer_ids is not None:
            e["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
        out["eagle_config"] = e
        return out


class TrtllmFormat(DrafterFormat):
    """The drafter layout TensorRT-LLM's PyTorch backend reads for Eagle3 (`_torch/models/modeling_speculative.py`).

    - detection (TensorRT-LLM's): any config with `draft_vocab_size`; the architecture becomes
      "EAGLE3" + the name with "Eagle3" stripped, so `LlamaForCausalLMEagle3` resolves to the
      registered `EAGLE3LlamaForCausalLM`, which switches to MLA attention by itself when the config
      has `kv_lora_rank` (`model_type` deepseek_v3: DeepseekV3Config carries the MLA ranks). An
      "Eagle3DeepseekV3..." name would resolve to a class the releases read here do not register;
    - `fc_norm` at the top level, `eagle_config.norm_before_fc` (`input_norm`), post-norm feedback
      from `eagle_config.return_hidden_post_norm` (older releases) or top-level `norm_output`
      (newest): BOTH are written so no release runs an EAGLE 3.1 drafter with pre-norm feedback;
    - `target_hidden_size` read with hasattr(): always written as a number, never null;
    - tapped layers in `eagle_config.eagle_aux_hidden_state_layer_ids`, output-of-layer numbering
      (as `eagle3_layers_to_capture`);
    - weights `midlayer.*` (one layer) or `midlayer.N.*`; later layers are "regular" and normalise
      their input with `hidden_norm` (canonical `layers.N.input_layernorm`); `d2t` exists only when
      draft_vocab_size != vocab_size and is int32; `t2d` is not read; `lm_head` present means the
      drafter's own, absent means the target's.

    What TensorRT-LLM would run differently from the reference is not a layout question: see
    `export.trtllm_drafter.trtllm_problems`.
    """

    name = "trtllm"
    flag_keys = ModelOptFormat.flag_keys
    layer_prefix = "midlayer."
    architecture = "LlamaForCausalLMEagle3"
    stores_t2d = False
    d2t_dtype = torch.int32
    stores_full_vocab_d2t = False
    known = LLAMA_KEYS | {"eagle_config", "draft_vocab_size", "target_hidden_size", "fc_norm", "norm_output",
                          "num_aux_hidden_states", "norm_before_residual", "bias"}
    eagle_known = ModelOptFormat.eagle_known
    # eagle_config keys that only the TensorRT-LLM layout writes next to `midlayer.*` tensors
    # (a SpecForge eagle_config carries just the tapped ids).
    markers = eagle_known - {"eagle_aux_hidden_state_layer_ids"}

    @staticmethod
    def _split(name: str, num_layers: int) -> tuple[int, str]:
        rest = name[len("midlayer."):]
        if num_layers == 1:
            return 0, rest
        head, rest = rest.split(".", 1)
        return int(head), rest

    def to_canonical(self, name, cfg):
        if not name.startswith(self.layer_prefix):
            return name
        layer, rest = self._split(name, cfg.num_layers)
        if layer > 0 and rest == "hidden_norm.weight":
            rest = "input_layernorm.weight"
        return f"layers.{layer}.{rest}"

    def from_canonical(self, name, cfg):
        if not name.startswith("layers."):
            return name
        head, rest = name[len("layers."):].split(".", 1)
        layer = int(head)
        if layer > 0 and rest == "input_layernorm.weight":
            rest = "hidden_norm.weight"  # TensorRT-LLM's regular layers normalise with hidden_norm
        return f"midlayer.{rest}" if cfg.num_layers == 1 else f"midlayer.{layer}.{rest}"

    def read_config(self, c):
        e = _object(c, "eagle_config")
        if e.get("use_aux_hidden_state") is False:
            raise CheckpointError("eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 drafter, not EAGLE-3")
        ids = _ids(e.get("eagle_aux_hidden_state_layer_ids"))
        flat = dict(c)
        if flat.get("target_hidden_size") == flat.get("hidden_size"):
            flat["target_hidden_size"] = None  # always written; equal means "the drafter's own"
        return _nested_eagle_config(self, flat, c, e, ids)

    def write_config(self, cfg):
        e: dict[str, Any] = {}
        if cfg.aux_layer_ids is not None:
            e["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)  # output-of-layer
        e.update({"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                  "use_last_layernorm": True, "next_layer_regular": True, "eh_proj_before_attn": False,
                  "norm_before_fc": cfg.norm_before_fc, "return_hidden_post_norm": cfg.norm_output})
        out = {
            "architectures": [self.architecture],
            "model_type": "deepseek_v3" if cfg.attention == "mla" else "llama",
            **llama_keys(cfg),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.effective_target_hidden_size,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "bias": False,
            "num_aux_hidden_states": cfg.num_aux_hidden_states,
        }
        if cfg.norm_before_residual:  # held for a lossless round trip; TensorRT-LLM does not implement it
            out["norm_before_residual"] = True
        out["eagle_config"] = e
        return out


FORMATS: dict[str, DrafterFormat] = {f.name: f for f in (EagleFormat(), SpecForgeFormat(), SpeculatorsFormat(),
                                                          ModelOptFormat(), TrtllmFormat())}

# Architectures only EAGLE-3 drafters declare (SpecForge / ModelOpt / TensorRT-LLM; vLLM's MLA drafter).
DRAFTER_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"}


def _architectures(c: dict[str, Any]) -> set[str]:
    archs = c.get("architectures")
    return {a for a in archs if isinstance(a, str)} if isinstance(archs, list) else set()


def looks_like_drafter(c: dict[str, Any]) -> bool:
    """Whether a config.json is an EAGLE-3 drafter's (in any format here) rather than a target's.

    The markers `detect_format` then tells the formats apart by.
    """
    archs = _architectures(c)
    return bool(c.get("speculators_model_type") or "draft_vocab_size" in c or archs & DRAFTER_ARCHITECTURES
                or "eagle_config" in c)


def detect_format(c: dict[str, Any], tensor_names: list[str]) -> DrafterFormat:
    """Pick the format from config markers, with tensor prefixes breaking ties."""
    archs = _architectures(c)
    midlayer = any(n.startswith("midlayer.") for n in tensor_names)
    layers = any(n.startswith("layers.") for n in tensor_names)
    eagle_config = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    if looks_like_drafter(c):
        if c.get("speculators_model_type"):
            if c["speculators_model_type"] != "eagle3":
                raise CheckpointError(f"speculators model type {c['speculators_model_type']!r} is not EAGLE-3")
            return FORMATS["speculators"]
        if layers and not midlayer and (archs & DRAFTER_ARCHITECTURES or "eagle_config" in c):
            return FORMATS["modelopt"]
        if midlayer and TrtllmFormat.markers & set(eagle_config):
            return FORMATS["trtllm"]
        if midlayer and "LlamaForCausalLMEagle3" in archs:
            return FORMATS["specforge"]
        if midlayer and "draft_vocab_size" in c:
            return FORMATS["eagle"]
        if not (midlayer or layers):
            example = sorted(tensor_names)[0] if tensor_names else "none"
            raise CheckpointError(
                f"cannot tell the drafter format: config.json declares an EAGLE-3 drafter, but no tensor is named "
                f"midlayer.* or layers.* (first tensor: {example!r}); the weights do not belong to this config")
    raise CheckpointError(
        "cannot tell the drafter format: expected an EAGLE-3 config (draft_vocab_size with midlayer.* tensors, "
        "LlamaForCausalLMEagle3, speculators_model_type eagle3, a ModelOpt eagle_config, or a TensorRT-LLM "
        "eagle_config with midlayer.* tensors); is this a drafter?"
    )


def torchspec_shifted_ids(c: dict[str, Any]) -> bool:
    """Whether the tapped ids of a `layers.N.*` (ModelOpt-layout) config are TorchSpec's vLLM export of a
    `kimi_k2` drafter: its converter adds 1 to every id for vLLM's before-layer reading, and only then
    (docs/tapped-layers.md#torchspec-and-kimi_k2). Told by the `_torchspec_version` key it writes; a
    `midlayer.*` TorchSpec checkpoint (SpecForge layout) is never shifted."""
    return bool(TORCHSPEC_KEYS & set(c)) and c.get("model_type") == "kimi_k2"


def drafter_origin(c: dict[str, Any], fmt_name: str) -> str:
    """The project that wrote a drafter read in layout `fmt_name`: the layout's own name, except
    for TorchSpec, which writes the SpecForge layout (`midlayer.*`) and, for vLLM and its MLA
    drafters, the ModelOpt one (`layers.0.*`, `eagle_config`). TorchSpec is told by its
    `_torchspec_version` key, or for `Eagle3DeepseekV2ForCausalLM` configs by an `eagle_config`
    without the `next_layer_regular` that ModelOpt's export always writes."""
    if TORCHSPEC_KEYS & set(c):
        return "torchspec"
    eagle_config = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else None
    if (fmt_name == ModelOptFormat.name and "Eagle3DeepseekV2ForCausalLM" in _architectures(c)
            and eagle_config is not None and "next_layer_regular" not in eagle_config):
        return "torchspec"
    return fmt_name


# ---- which layout each serving runtime reads ------------------------------------------------

# vLLM and SGLang name DeepSeek-style (MLA) Eagle3 drafters with this architecture.
MLA_ARCHITECTURE_PATCH: dict[str, Any] = {"architectures": ["Eagle3DeepseekV2ForCausalLM"],
                                          "model_type": "deepseek_v3"}
# vLLM (0.32.0) turns every draft config of model_type deepseek_v3 into its DeepSeek-MTP drafter
# and then refuses the Eagle3 architecture; kimi_k2 maps to the same DeepseekV3Config there and is
# left alone (docs/drafter-formats.md#mla-drafters-in-vllm).
VLLM_MLA_ARCHITECTURE_PATCH: dict[str, Any] = {**MLA_ARCHITECTURE_PATCH, "model_type": "kimi_k2"}
CONSUMERS = ("vllm", "sglang", "trtllm")


def consumer_layout(consumer: str, cfg: DrafterConfig) -> tuple[str, dict[str, Any] | None]:
    """(format name, top-level config keys to override) for the drafter a serving runtime reads.

    - vLLM: the original EAGLE layout (`midlayer.*`, top-level `fc_norm` / `norm_output` that its
      llama_eagle3 reads); drafters it cannot hold (several layers, norm_before_fc) go in the
      speculators layout;
    - SGLang: the SpecForge layout;
    - TensorRT-LLM: its own layout (architecture and MLA model_type already in it).
    MLA drafters get `VLLM_MLA_ARCHITECTURE_PATCH` (vLLM) or `MLA_ARCHITECTURE_PATCH` (SGLang).
    """
    mla_patch = dict(MLA_ARCHITECTURE_PATCH) if cfg.attention == "mla" else None
    if consumer == "vllm":
        eagle = FORMATS[EagleFormat.name]
        return ((eagle.name if eagle.holds(cfg) else SpeculatorsFormat.name),
                dict(VLLM_MLA_ARCHITECTURE_PATCH) if cfg.attention == "mla" else None)
    if consumer == "sglang":
        return SpecForgeFormat.name, mla_patch
    if consumer == "trtllm":
        return TrtllmFormat.name, None
    raise CheckpointError(f"unknown serving runtime {consumer!r}; choose one of {list(CONSUMERS)}")


def _unknown(c: dict[str, Any], known: set[str]) -> list[str]:
    return sorted(k for k in c if k not in known and k not in HF_BOOKKEEPING)
