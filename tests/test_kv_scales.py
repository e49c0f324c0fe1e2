"""FP8 KV-cache scales of NVFP4 targets: declared without scales (the published Kimi K2.6 NVFP4 layout)
is a warning, not a refusal; every naming the runtimes use is read; a bundle names them as its
runtime reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle31_export.formats.kv_scales import parse_kv_scale, runtime_renames
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "kimi" / "models"
DRAFTER = MODELS / "drafter-eagle31"


def declare_fp8_kv(folder: Path) -> None:
    """What nvidia/Kimi-K2.6-NVFP4 declares (docs/nvfp4.md#published-nvfp4-moe-targets)."""
    hf = json.loads((folder / "hf_quant_config.json").read_text())
    hf["quantization"]["kv_cache_quant_algo"] = "FP8"
    (folder / "hf_quant_config.json").write_text(json.dumps(hf))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_kv_target(tmp_path_factory) -> Path:
    """The committed Kimi NVFP4 target declaring an FP8 KV cache and storing no scales."""
    folder = tmp_path_factory.mktemp("kv") / "kimi-fp8kv"
    shutil.copytree(MODELS / "target-nvfp4", folder, ignore=shutil.ignore_patterns("manifest.json"))
    declare_fp8_kv(folder)
    return folder


@pytest.fixture(scope="module")
def mla_scaled_target(fp8_kv_target, tmp_path_factory) -> tuple[Path, dict[str, float]]:
    """The same with per-layer MLA scales on the latent projection (`kv_a_proj_with_mqa.{k,v}_scale`)."""
    folder = tmp_path_factory.mktemp("kv") / "kimi-mla-scales"
    shutil.copytree(fp8_kv_target, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    values = {}
    for layer in range(8):
        for which, value in (("k", 0.011 * (layer + 1)), ("v", 0.017 * (layer + 1))):
            name = f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.{which}_scale"
            tensors[name] = torch.tensor(value)
            values[f"model.layers.{layer}.self_attn.{which}_scale"] = torch.tensor(value).item()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, values


def test_every_naming_parses_to_its_attention_module():
    attn = "model.layers.3.self_attn"
    assert parse_kv_scale(f"{attn}.k_proj.k_scale") == (attn, "k", "modelopt")
    assert parse_kv_scale(f"{attn}.v_proj.v_scale") == (attn, "v", "modelopt")
    assert parse_kv_scale(f"{attn}.kv_a_proj_with_mqa.k_scale") == (attn, "k", "mla-kv-a")
    assert parse_kv_scale(f"{attn}.v_scale") == (attn, "v", "compressed-tensors")
    assert parse_kv_scale(f"{attn}.k_proj.weight_scale") is None
    # vLLM 0.32 reads compressed-tensors' names for a GQA attention, not for MLA
    stored = {f"{attn}.k_scale": f"{attn}.k_scale"}
    assert runtime_renames(stored, "vllm", "gqa") == {}
    assert runtime_renames(stored, "vllm", "mla") == {f"{attn}.k_scale": f"{attn}.k_proj.k_scale"}


@pytest.mark.parametrize("kind", ["trtllm", "vllm", "sglang"])
def test_fp8_kv_declared_without_scales_exports_with_one_warning(cli, fp8_kv_target, tmp_path, kind):
    code, out, err = cli("export", kind, "--drafter", DRAFTER, "--target", fp8_kv_target, "--out", tmp_path / kind)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "FP8 KV cache" in lines[0] and "1.0" in lines[0]
    record = json.loads((tmp_path / kind / "bundle.json").read_text())
    assert record["warnings"] == [lines[0].removeprefix("warning: ")]
    assert record["kv_cache"]["algo"] == "FP8" and record["kv_cache"]["scales"] == {}


def test_inspect_shows_the_warning_and_exits_0(cli, fp8_kv_target):
    code, out, err = cli("inspect", fp8_kv_target, "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    assert len(report["warnings"]) == 1 and "stores no k_scale/v_scale" in report["warnings"][0]


def test_mla_scales_under_the_latent_projection_reach_the_bundle_as_vllm_reads_them(cli, mla_scaled_target, tmp_path):
    folder, values = mla_scaled_target
    ckpt = NVFP4Checkpoint.open(folder)
    assert ckpt.kv_scales == values and ckpt.warnings == []

    # referenced by path: the target cannot change, so the export says vLLM will not see them
    code, _, err = cli("export", "vllm", "--drafter", DRAFTER, "--target", folder, "--out", tmp_path / "by-path")
    assert code == 0, err
    assert err.count("warning:") == 1 and "kv_a_proj_with_mqa.k_scale" in err and "--copy-target" in err

    # copied: the bundle's target stores them under ModelOpt's names, which vLLM 0.32 maps onto its MLA layer
    code, _, err = cli("export", "vllm", "--drafter", DRAFTER, "--target", folder, "--out", tmp_path / "copy",
                       "--copy-target")
    assert code == 0 and "warning" not in err, err
    copied = tmp_path / "copy" / "target"
    with safe_open(str(copied / "model.safetensors"), "pt") as f:
        names = {n for n in f.keys() if n.endswith(("k_scale", "v_scale"))}
        assert names == {f"model.layers.{i}.self_attn.{w}_proj.{w}_scale" for i in range(8) for w in "kv"}
        assert f.get_tensor("model.layers.4.self_attn.v_proj.v_scale").item() == values["model.layers.4.self_attn.v_scale"]
    assert NVFP4Checkpoint.open(copied).kv_scales == values
    record = json.loads((tmp_path / "copy" / "bundle.json").read_text())["kv_cache"]
    assert record["scales"] == {f"{k.rpartition('.')[0]}.{k[-7]}_proj.{k[-7:]}": v for k, v in values.items()}
    assert record["stored_naming"] == ["mla-kv-a"] and record["renamed_in_copy"] == 16
    assert cli("verify", tmp_path / "copy")[0] == 0  # the bundle's manifest holds the rewritten shard


def test_two_names_for_one_scale_are_refused(cli, mla_scaled_target, tmp_path):
    folder = tmp_path / "both"
    shutil.copytree(mla_scaled_target[0], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.2.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = cli("inspect", folder)
    assert code == 2 and "both the K scale of model.layers.2.self_attn" in err and len(err.strip().splitlines()) == 1
