"""Which target layers each serving engine taps for a drafter, and in which numbering it reads them.

A drafter whose config names no tapped layers is served with the ENGINE's default, whatever the drafter
was trained with (docs/tapped-layers.md#a-drafter-that-names-none); `inspect` lists that as a problem
with each engine's choice, and every export writes the ids explicitly in the numbering of its engine.

Read in (file and version in docs/tapped-layers.md):
- vLLM 0.33.0: `get_eagle3_default_aux_hidden_state_layers` -> (2, n // 2, n - 3), captured as the
  residual stream enters layer i (before layer i);
- TensorRT-LLM: `eagle3_layers_to_capture` defaults to {1, n // 2 - 1, n - 4}, outputs of layers;
- SGLang 0.5.23: `set_eagle3_layers_to_capture(None)` -> [2, n // 2, n - 3] entering layer i; given ids
  (eagle_config's) are read as outputs of layers (+1), except on DeepSeek-V2/V3-family targets
  (deepseek_v2.py, glm4_moe_lite.py), which add one only when the first id is 1 and otherwise take the
  ids as before-layer numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle31_export.config import ConfigError, default_aux_layer_ids, output_to_before_layer

BEFORE, OUTPUT = "before layer i", "output of layer i"
# Target model types whose SGLang model guesses the numbering from the first id (deepseek_v2.py:
# `if layer_ids and layer_ids[0] == 1`, DeepseekV3 and Kimi K2 inherit it; glm4_moe_lite.py the same).
SGLANG_FIRST_ID_GUESS = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite"})


@dataclass(frozen=True)
class EngineTaps:
    """An engine's tapped layers: as it states them (`ids`, in `numbering`) and as outputs of layers."""

    engine: str
    ids: tuple[int, ...]
    numbering: str
    output_of_layer: tuple[int, ...]

    def describe(self) -> str:
        shown = f"{list(self.ids)} ({self.numbering})"
        if self.numbering == BEFORE:
            shown += f" = outputs of layers {list(self.output_of_layer)}"
        return f"{self.engine} {shown}"


def engine_defaults(num_layers: int) -> list[EngineTaps]:
    """What vLLM, TensorRT-LLM and SGLang tap for a drafter that names no layers, on an n-layer target."""
    n = num_layers
    before = (2, n // 2, n - 3)
    canonical = default_aux_layer_ids(n)
    return [EngineTaps("vLLM", before, BEFORE, tuple(i - 1 for i in before)),
            EngineTaps("TensorRT-LLM", canonical, OUTPUT, canonical),
            EngineTaps("SGLang", before, BEFORE, tuple(i - 1 for i in before))]


def missing_taps_problem(num_layers: int | None) -> str:
    """The `inspect` problem for a drafter whose config names no tapped layers."""
    if num_layers is None:
        picks = ("vLLM (2, N//2, N-3) before layer i, TensorRT-LLM {1, N//2-1, N-4} outputs of layers, SGLang "
                 "[2, N//2, N-3] before layer i (pass --target for this target's numbers)")
    else:
        picks = ", ".join(t.describe() for t in engine_defaults(num_layers)) + f" on this {num_layers}-layer target"
    return ("the drafter names no tapped layers (eagle_aux_hidden_state_layer_ids), so each engine taps its own "
            f"default: {picks}; a drafter trained on other layers runs without an error and accepts little. "
            "Write the ids it was trained with into its config.json (our exports write them explicitly)")


def sglang_ids(output_ids: tuple[int, ...], target_model_type: str) -> tuple[int, ...]:
    """The `eagle_config.eagle_aux_hidden_state_layer_ids` SGLang must read to tap `output_ids` (output of layer).

    Most targets: the output-of-layer ids (SGLang adds one). DeepSeek-V2/V3-family targets guess from the
    first id: a list starting at 1 is read as outputs of layers, any other as before-layer ids, so ids not
    starting at 1 are written before-layer; the output of layer 0 cannot be said there at all."""
    if target_model_type not in SGLANG_FIRST_ID_GUESS or output_ids[0] == 1:
        return tuple(output_ids)
    if output_ids[0] == 0:
        raise ConfigError(f"the drafter taps the output of layer 0 ({list(output_ids)}); SGLang's {target_model_type} "
                          "model reads a list starting at 1 as outputs of layers and any other as before-layer ids, so "
                          "no list taps layer 0's output there: serve it with vLLM or TensorRT-LLM")
    return output_to_before_layer(tuple(output_ids))
