"""`export trtllm|vllm|sglang --runtime-version`: a version that would silently drop a feature the drafter
uses is refused (exit 2, the feature and the version it needs named); a new enough one exports, and
the bundle records the minimum versions (docs/runtime-capabilities.md)."""

import json

import pytest

from factories import drafter_config_for, random_drafter
from eagle31_export.export import capabilities as caps
from eagle31_export.formats.drafter.checkpoint import write_drafter


@pytest.fixture(autouse=True)
def no_installed_runtime(monkeypatch):
    """The machine's own runtimes (if any) must not decide these cases."""
    monkeypatch.setattr(caps, "installed_version", lambda runtime: None)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, llama_info):
    root = tmp_path_factory.mktemp("runtime-version")
    made = {}
    for name, overrides in {"fc_norm": dict(fc_norm=True), "norm_output": dict(norm_output=True),
                            "taps": dict(aux_layer_ids=(1, 2, 3, 4)), "mla": dict(mla=True),
                            "eagle3": {}}.items():
        cfg = drafter_config_for(llama_info, **overrides)
        made[name] = write_drafter(random_drafter(cfg, seed=7), root / name, "specforge")
    return made


# (command, drafter, too old, needed text, new enough)
CASES = [
    ("vllm", "fc_norm", "0.21.0", "0.22.0", "0.22.0"),
    ("vllm", "norm_output", "0.21.0", "0.22.0", "0.22.0"),
    ("vllm", "taps", "0.21.0", "0.22.0", "0.22.0"),
    ("vllm", "mla", "0.31.0", "0.32.0 verified", "0.32.0"),
    ("sglang", "fc_norm", "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", "norm_output", "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", "taps", "0.5.11", "0.5.12", "0.5.12"),
    ("sglang", "mla", "0.5.11", "0.5.12", "0.5.12"),
    ("trtllm", "fc_norm", "1.2.0rc2", "newer than 1.2.0rc2", "1.3.0"),
    ("trtllm", "norm_output", "1.2.0rc2", "newer than 1.2.0rc2", "1.3.0"),
    ("trtllm", "taps", "1.2.0rc1", "1.2.0rc2", "1.2.0rc2"),
]


@pytest.mark.parametrize("kind,drafter,too_old,needs,new_enough", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_too_old_is_refused_and_new_enough_exports(cli, tmp_path, llama_target, drafters, kind, drafter, too_old,
                                                   needs, new_enough):
    args = ["export", kind, "--drafter", drafters[drafter], "--target", llama_target]
    code, _, err = cli(*args, "--out", tmp_path / "old", "--runtime-version", too_old)
    assert code == 2, err
    assert too_old in err and needs in err
    assert not (tmp_path / "old").exists()
    code, _, err = cli(*args, "--out", tmp_path / "new", "--runtime-version", new_enough)
    assert code == 0, err
    record = json.loads((tmp_path / "new" / "bundle.json").read_text())["runtime_requirements"]
    assert record["checked_version"] == new_enough and record["features"]
    assert "minimum" in (tmp_path / "new" / "README.md").read_text()


@pytest.mark.parametrize("kind,old", [("vllm", "0.1.0"), ("sglang", "0.1.0"), ("trtllm", "0.9.0")])
def test_eagle3_passes_the_oldest_versions(cli, tmp_path, llama_target, drafters, kind, old):
    code, _, err = cli("export", kind, "--drafter", drafters["eagle3"], "--target", llama_target,
                       "--out", tmp_path / "b", "--runtime-version", old)
    assert code == 0, err
    record = json.loads((tmp_path / "b" / "bundle.json").read_text())["runtime_requirements"]
    assert record["features"] == [] and record["minimum_versions"] == {}


def test_the_installed_runtime_is_checked_when_no_version_is_given(cli, tmp_path, llama_target, drafters,
                                                                   monkeypatch):
    monkeypatch.setattr(caps, "installed_version", lambda runtime: "0.5.11" if runtime == "sglang" else None)
    code, _, err = cli("export", "sglang", "--drafter", drafters["fc_norm"], "--target", llama_target,
                       "--out", tmp_path / "b")
    assert code == 2 and "0.5.11 (installed)" in err and "0.5.12" in err


def test_vllm_speculators_layout_has_its_own_thresholds(cli, tmp_path, llama_target, drafters):
    args = ["export", "vllm", "--drafter", drafters["fc_norm"], "--target", llama_target, "--layout", "speculators"]
    code, _, err = cli(*args, "--out", tmp_path / "a", "--runtime-version", "0.24.0")  # llama_eagle3 reads it, algos.py does not
    assert code == 2 and "0.25.0" in err
    code, _, err = cli(*args, "--out", tmp_path / "b", "--runtime-version", "0.25.0")
    assert code == 0, err
    drafter_config = json.loads((tmp_path / "b" / "drafter" / "config.json").read_text())
    assert drafter_config["speculators_model_type"] == "eagle3" and drafter_config["fc_norm"] is True
    assert drafter_config["speculators_config"]["verifier"]["name_or_path"] == str(llama_target.resolve())
    assert "speculators convert" in (tmp_path / "b" / "README.md").read_text()
    # the default layout is unchanged
    code, _, err = cli("export", "vllm", "--drafter", drafters["fc_norm"], "--target", llama_target,
                       "--out", tmp_path / "c")
    assert code == 0, err
    assert "speculators_model_type" not in json.loads((tmp_path / "c" / "drafter" / "config.json").read_text())


def test_an_mla_drafter_in_the_speculators_layout_is_refused_without_a_version(cli, tmp_path, llama_target,
                                                                               drafters):
    code, _, err = cli("export", "vllm", "--drafter", drafters["mla"], "--target", llama_target,
                       "--out", tmp_path / "a", "--layout", "speculators")
    assert code == 2 and "MLA" in err


def test_speculators_31_is_refused_by_a_vllm_that_drops_norm_before_fc(cli, tmp_path, llama_target, llama_info):
    """speculators' own EAGLE 3.1 (norm_before_fc + norm_output) goes to vLLM in the speculators layout:
    vLLM 0.18.1's algos.py does not copy norm_before_fc (0.19.0 does), 0.24.0's not norm_output (0.25.0 does)."""
    cfg = drafter_config_for(llama_info, norm_before_fc=True, norm_output=True)
    src = write_drafter(random_drafter(cfg, seed=7), tmp_path / "src", "speculators")
    args = ["export", "vllm", "--drafter", src, "--target", llama_target]
    code, _, err = cli(*args, "--out", tmp_path / "a", "--runtime-version", "0.18.1")
    assert code == 2 and "norm_before_fc" in err and "0.19.0" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(*args, "--out", tmp_path / "b", "--runtime-version", "0.24.0")
    assert code == 2 and "post-norm feedback" in err and "0.25.0" in err
    code, _, err = cli(*args, "--out", tmp_path / "c", "--runtime-version", "0.33.0")
    assert code == 0, err
    drafter = json.loads((tmp_path / "c" / "drafter" / "config.json").read_text())
    assert (drafter["norm_before_fc"], drafter["norm_output"], drafter["fc_norm"]) == (True, True, False)
    record = json.loads((tmp_path / "c" / "bundle.json").read_text())["runtime_requirements"]
    assert record["checked_version"] == "0.33.0" and "norm_before_fc" in record["features"]
