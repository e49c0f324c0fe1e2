"""The canonical vocabulary: one drafter config, one tapped-layer convention.

Every reader produces a `DrafterConfig`; every writer consumes one. Format-specific
conventions (key names, tapped-layer numbering, nesting) are converted at the edges,
in `eagle31_export.formats`.

Tapped-layer convention used everywhere inside this package: **output of layer i**
(as TensorRT-LLM, ModelOpt and SpecForge count). `aux_layer_ids = (1, 15, 28)` taps the
outputs of decoder layers 1, 15 and 28 of the target, which vLLM and the original EAGLE
code call "before layers 2, 16, 29".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from eagle31_export.errors import UserError

AttentionKind = Literal["gqa", "mla"]


# speculators' EAGLE 3.1: one RMSNorm over fc's whole input and post-norm feedback (docs/eagle31.md).
SPECULATORS_31 = "3.1, speculators layout: norm_before_fc + norm_output"


class ConfigError(UserError):
    """A configuration that cannot describe a valid drafter or target."""


# The activations the reference drafter implements (reference/drafter.py: ACTIVATIONS).
HIDDEN_ACTS = ("silu", "gelu", "relu")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive_ints(owner: str, **values: Any) -> None:
    for key, value in values.items():
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{owner} {key} is {value!r}; expected a positive integer")


def _require_positive_finite(owner: str, **values: Any) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{owner} {key} is {value!r}; expected a finite positive number")


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek-V2 multi-head latent attention ranks (the Kimi K2.x `eagle3.1-mla` drafter)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DrafterConfig:
    """Every architectural fact of an EAGLE-3 / EAGLE 3.1 drafter.

    `aux_layer_ids` is None when the checkpoint does not name its tapped layers; the
    format's default then applies and is resolved against the target with
    `resolved_aux_layer_ids(target_num_layers)`.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int | None = None  # None: same as hidden_size
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    num_aux_hidden_states: int = 3
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    attention: AttentionKind = "gqa"
    mla: MlaConfig | None = None
    torch_dtype: str = "bfloat16"
    # Where max_position_embeddings came from: "config" (the drafter's own), "target" (the drafter's
    # config names none: its target's, see `with_max_positions`), "rope_scaling" (none and no target:
    # yarn's original_max_position_embeddings * factor) or "default" (none at all: 2048 assumed).
    max_position_source: str = field(default="config", compare=False)
    # Informational extras a format carried that have no architectural meaning here
    # (e.g. the verifier name). Kept so that writers can round-trip them.
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived facts -------------------------------------------------
    @property
    def eagle_version(self) -> str:
        return "3.1" if (self.fc_norm or self.norm_output) else "3"

    @property
    def eagle_variant(self) -> str:
        """The variant exactly: "3", "3 + post-norm" (norm_output only), "3 + fc_norm" (fc_norm only),
        "3 + norm_before_fc", "3.1" (fc_norm + norm_output), or speculators' own "3.1" (norm_before_fc +
        norm_output: what speculators 0.9.0 trains when neither flag is set; docs/eagle31.md#two-eagle-31-layouts).
        `eagle_version` calls either fc_norm or norm_output "3.1" (the runtimes' 3.1 code path)."""
        if self.fc_norm and self.norm_output:
            return "3.1"
        if self.norm_before_fc and self.norm_output:
            return SPECULATORS_31
        if self.norm_output:
            return "3 + post-norm"
        if self.norm_before_fc:
            return "3 + norm_before_fc"
        return "3 + fc_norm" if self.fc_norm else "3"

    @property
    def effective_target_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_hidden_states * self.effective_target_hidden_size

    def resolved_aux_layer_ids(self, target_num_layers: int) -> tuple[int, ...]:
        """Tapped layers (output-of-layer numbering) for a target of `target_num_layers` layers."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        if self.num_aux_hidden_states != 3:
            raise ConfigError(
                f"the drafter taps {self.num_aux_hidden_states} layers but names none; "
                "set eagle_aux_hidden_state_layer_ids in its config.json"
            )
        return default_aux_layer_ids(target_num_layers)

    def validate(self) -> None:
        self._validate_values()
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(
                "config enables both fc_norm (one RMSNorm per tapped layer) and norm_before_fc "
                "(one RMSNorm over the concatenation); EAGLE 3.1 uses fc_norm only: drop norm_before_fc"
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux_hidden_states:
            raise ConfigError(
                f"aux_layer_ids {list(self.aux_layer_ids)} name {len(self.aux_layer_ids)} layers "
                f"but num_aux_hidden_states is {self.num_aux_hidden_states}"
            )
        if self.num_aux_hidden_states < 1:
            raise ConfigError("num_aux_hidden_states must be >= 1")
        if self.attention == "mla" and self.mla is None:
            raise ConfigError("attention 'mla' needs the MLA ranks (kv_lora_rank, qk_*_head_dim, ...)")
        if self.attention == "gqa" and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab_size {self.vocab_size}"
            )

    def _validate_values(self) -> None:
        """Types and ranges of every field, so nothing later divides by zero or indexes past an end."""
        _require_positive_ints(
            "drafter", hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, vocab_size=self.vocab_size, draft_vocab_size=self.draft_vocab_size,
            num_hidden_layers=self.num_layers, max_position_embeddings=self.max_position_embeddings,
            num_aux_hidden_states=self.num_aux_hidden_states)
        if self.target_hidden_size is not None:
            _require_positive_ints("drafter", target_hidden_size=self.target_hidden_size)
        _require_positive_finite("drafter", rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"drafter hidden_act {self.hidden_act!r} is not supported; "
                              f"supported: {', '.join(HIDDEN_ACTS)}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"drafter rope_scaling is {self.rope_scaling!r}; expected an object or null")
        if self.max_position_source not in MAX_POSITIONS_SOURCES:
            raise ConfigError(f"drafter max_position_source {self.max_position_source!r} is not one of "
                              f"{', '.join(MAX_POSITIONS_SOURCES)}")
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"drafter attention {self.attention!r} is not 'gqa' or 'mla'")
        if self.aux_layer_ids is not None:
            bad = [i for i in self.aux_layer_ids if not _is_int(i) or i < 0]
            if bad:
                raise ConfigError(f"tapped layer ids {list(self.aux_layer_ids)} include {bad[0]!r}; expected "
                                  "layer numbers >= 0 (output of layer i; vLLM's before-layer ids start at 1)")
        if self.mla is not None:
            m = self.mla
            _require_positive_ints("drafter", kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                                   qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim)
            if m.q_lora_rank is not None:
                _require_positive_ints("drafter", q_lora_rank=m.q_lora_rank)

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Canonical fields as plain JSON (used by `inspect --json`)."""
        out = dataclasses.asdict(self)
        out.pop("extras")
        out["aux_layer_ids"] = list(self.aux_layer_ids) if self.aux_layer_ids is not None else None
        return out


MAX_POSITIONS_SOURCES = ("config", "target", "rope_scaling", "default")


def with_max_positions(cfg: DrafterConfig, target: "TargetInfo | None") -> DrafterConfig:
    """The drafter config with max_position_embeddings resolved where its checkpoint names none.

    The Kimi K2.x MLA drafter's config has no max_position_embeddings
    (docs/drafter-formats.md#mla-drafter): it serves the target's context, so the target's value
    applies; without a target, a yarn rope's original_max_position_embeddings * factor (the context
    the scaling was made for), else 2048 stays assumed. A drafter that states its own keeps it.
    """
    if cfg.max_position_source not in ("default", "rope_scaling"):
        return cfg
    if target is not None and target.max_position_embeddings:
        return cfg.replace(max_position_embeddings=target.max_position_embeddings, max_position_source="target")
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    original, factor = scaling.get("original_max_position_embeddings"), scaling.get("factor")
    if kind == "yarn" and _is_int(original) and original > 0 and isinstance(factor, (int, float)) and factor >= 1:
        return cfg.replace(max_position_embeddings=int(original * factor), max_position_source="rope_scaling")
    return cfg


def default_aux_layer_ids(target_num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps in output-of-layer numbering: {1, N//2-1, N-4}.

    The same tensors as vLLM's (2, N//2, N-3) in its before-layer numbering.
    """
    n = target_num_layers
    return (1, n // 2 - 1, n - 4)


def output_to_before_layer(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Output of layer i is the input of layer i+1 (vLLM / original EAGLE numbering)."""
    return tuple(i + 1 for i in ids)


def before_layer_to_output(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i - 1 for i in ids)


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter needs to know about its target model."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    rope_theta: float | None = None  # None: the config names none
    rope_scaling: dict[str, Any] | None = None  # None: the default schedule

    @property
    def rope(self) -> "Rope":
        return Rope.of(self.rope_theta, self.rope_scaling)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "TargetInfo":
        if not isinstance(cfg, dict):
            raise ConfigError(f"target config.json is a JSON {type(cfg).__name__}; expected an object")
        text = cfg.get("text_config", cfg)  # multimodal wrappers nest the language model
        if not isinstance(text, dict):
            raise ConfigError(f"target config.json text_config is {type(text).__name__}; expected an object")
        try:
            heads = text["num_attention_heads"]
            sizes = dict(hidden_size=text["hidden_size"], num_hidden_layers=text["num_hidden_layers"],
                         vocab_size=text["vocab_size"], num_attention_heads=heads,
                         num_key_value_heads=text.get("num_key_value_heads") or heads)
        except KeyError as missing:
            raise ConfigError(f"target config.json lacks {missing}; is this a causal LM checkpoint?") from None
        _require_positive_ints("target", **sizes)
        intermediate = text.get("intermediate_size") or 0
        if not _is_int(intermediate) or intermediate < 0:
            raise ConfigError(f"target intermediate_size is {intermediate!r}; expected a positive integer")
        if heads % sizes["num_key_value_heads"]:
            raise ConfigError(f"target num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {sizes['num_key_value_heads']}")
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if not isinstance(tie, bool) and tie is not None:
            raise ConfigError(f"target tie_word_embeddings is {tie!r}; expected true or false")
        model_type = text.get("model_type", cfg.get("model_type", "unknown"))
        if not isinstance(model_type, str):
            raise ConfigError(f"target model_type is {model_type!r}; expected a string")
        max_positions = text.get("max_position_embeddings")
        if max_positions is not None:
            _require_positive_ints("target", max_position_embeddings=max_positions)
        theta, scaling = _target_rope(text)
        return cls(model_type=model_type, intermediate_size=intermediate, tie_word_embeddings=bool(tie),
                   max_position_embeddings=max_positions, rope_theta=theta, rope_scaling=scaling, **sizes)


def full_attention_rope(params: Any) -> Any:
    """v5's per-layer-type `rope_parameters` ({"full_attention": {...}, ...}): the full-attention one,
    which is what an EAGLE drafter's layer and a Llama target use; anything else unchanged."""
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return params["full_attention"]
    return params


def scaling_from_parameters(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """v5's `rope_parameters` as a v4 `rope_scaling`: theta taken out; a "default" or unstated
    schedule is no scaling (None)."""
    if not params:
        return None
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return scaling if Rope.of(None, scaling).kind != "default" else None


def _target_rope(text: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """rope_theta and rope_scaling from either spelling: transformers v4's top-level `rope_theta` +
    `rope_scaling`, or v5's `rope_parameters` (theta, type and scaling fields in one object)."""
    params = full_attention_rope(text.get("rope_parameters"))
    scaling = text.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"target {key} is {value!r}; expected an object or null")
    theta = text.get("rope_theta")
    theta = (params or {}).get("rope_theta") if theta is None else theta
    if theta is not None:
        _require_positive_finite("target", rope_theta=theta)
        theta = float(theta)
    if scaling is None:
        return theta, scaling_from_parameters(params)
    return theta, (scaling if Rope.of(theta, scaling).kind != "default" else None)


# The rope_scaling fields each schedule's frequencies depend on (transformers' ROPE_INIT_FUNCTIONS;
# reference/rope.py implements default, linear, llama3 and yarn). Other keys (a v5 config's
# partial_rotary_factor, bookkeeping) do not make two ropes differ.
ROPE_PARAMETERS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor"),
}
# What transformers and reference/rope.py use where a yarn config leaves these out, so that a config
# spelling them out equals one that does not.
ROPE_DEFAULTS = {"yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}}


def _canonical_value(value: Any) -> Any:
    """Numbers as floats (4096 == 4096.0), lists as tuples, so values compare and hash."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list):
        return tuple(_canonical_value(v) for v in value)
    return value


def _show(value: Any) -> str:
    if value is None:
        return "absent"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(_show, value)) + "]"
    return str(value)


@dataclass(frozen=True)
class Rope:
    """A rope in one comparable form, whichever spelling its config used.

    `kind` "default" stands for a missing, null or `"default"` rope_scaling alike; `params` holds the
    fields `ROPE_PARAMETERS` names for the kind (every field for a kind not listed there), absent
    ones left out; `theta` None: the config names no rope_theta.
    """

    kind: str
    theta: float | None
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, theta: float | None, scaling: dict[str, Any] | None) -> "Rope":
        scaling = scaling or {}
        kind = str(scaling.get("rope_type", scaling.get("type")) or "default")
        names = ROPE_PARAMETERS.get(kind, sorted(k for k in scaling if k not in ("rope_type", "type", "rope_theta")))
        values = {**ROPE_DEFAULTS.get(kind, {}), **{k: v for k, v in scaling.items() if v is not None}}
        params = tuple((k, _canonical_value(values[k])) for k in names if k in values)
        return cls(kind, None if theta is None else float(theta), params)

    def param(self, name: str) -> Any:
        return dict(self.params).get(name)

    def describe(self) -> str:
        """"none" for the default schedule, else e.g. "yarn (factor 32, original_max_position_embeddings 4096)"."""
        if self.kind == "default":
            return "none"
        shown = [f"{k} {_show(v)}" for k, v in self.params if ROPE_DEFAULTS.get(self.kind, {}).get(k) != v]
        return f"{self.kind} ({', '.join(shown)})" if shown else self.kind


def rope_differences(drafter: Rope, target: Rope) -> list[str]:
    """Each way the drafter's rope differs from its target's, as user-facing lines.

    EAGLE trainers (SpecForge, speculators, ModelOpt) give the drafter its target's rope, so a
    difference is almost always a converter that dropped or misread it: the runtime then rotates the
    drafter's positions unlike in training and acceptance falls at long context, silently.
    """
    problems = []
    if target.theta is not None and drafter.theta is not None and not math.isclose(drafter.theta, target.theta):
        problems.append(f"drafter rope_theta is {_show(drafter.theta)} but the target's is {_show(target.theta)}: "
                        f"{_rotated_differently(None)}")
    beyond = min((r.param("original_max_position_embeddings") for r in (drafter, target)
                  if r.param("original_max_position_embeddings")), default=None)
    if drafter.kind != target.kind:
        problems.append(f"drafter rope_scaling is {drafter.describe()} but the target's is {target.describe()}: "
                        f"{_rotated_differently(beyond)}")
    elif drafter.params != target.params:
        names = [k for k in dict.fromkeys(k for k, _ in target.params + drafter.params)  # in the kind's order
                 if drafter.param(k) != target.param(k)]
        fields = " and ".join(f"{k} (drafter {_show(drafter.param(k))}, target {_show(target.param(k))})"
                              for k in names)
        problems.append(f"drafter {drafter.kind} rope_scaling differs from the target's in {fields}: "
                        f"{_rotated_differently(beyond)}")
    return problems


def _rotated_differently(beyond: float | None) -> str:
    where = f"positions beyond {_show(beyond)} are" if beyond else "every position is"
    return (f"{where} rotated differently from what the target's hidden states were trained with, "
            "which lowers acceptance at long context")


def long_context_problems(cfg: DrafterConfig, target: TargetInfo) -> list[str]:
    """What makes the drafter fall behind its target at long context (docs/drafter-formats.md#rope-and-positions).

    Only `inspect` lists these: the pair still runs, and an export of a drafter that was trained with
    a rope of its own (or fewer positions) on purpose should not be refused.
    """
    problems = rope_differences(Rope.of(cfg.rope_theta, cfg.rope_scaling), target.rope)
    resolved = with_max_positions(cfg, target)
    mine, theirs = resolved.max_position_embeddings, target.max_position_embeddings
    # "target": the drafter's config names none and serves the target's context, so nothing to flag.
    if resolved.max_position_source != "target" and theirs is not None and mine < theirs:
        problems.append(f"drafter holds {mine} positions, target {theirs}: a runtime serving the target's context "
                        "runs the drafter past its positions")
    return problems


def compatibility_problems(cfg: DrafterConfig, target: TargetInfo, d2t_max_target_id: int | None) -> list[str]:
    """Every reason this drafter cannot run on this target, as user-facing lines."""
    problems = []
    if cfg.effective_target_hidden_size != target.hidden_size:
        problems.append(
            f"drafter expects target hidden size {cfg.effective_target_hidden_size}, target has {target.hidden_size}"
        )
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    try:
        ids = cfg.resolved_aux_layer_ids(target.num_hidden_layers)
    except ConfigError as err:
        problems.append(str(err))
        ids = ()
    bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(
            f"tapped layer ids {bad} (output-of-layer numbering) out of range for a target of "
            f"{target.num_hidden_layers} layers (valid 0..{target.num_hidden_layers - 1})"
        )
    if d2t_max_target_id is not None and d2t_max_target_id >= target.vocab_size:
        problems.append(
            f"d2t maps a draft token to target id {d2t_max_target_id}, outside the target vocab of {target.vocab_size}"
        )
    return problems
