"""NVFP4 readers reject bad input with one line naming file, tensor, expected and found;
soft issues (fused Linears with different scales) are reported as problems instead."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle31_export.errors import CheckpointError
from factories import make_target
from eagle31_export.formats.nvfp4.convert import convert_checkpoint
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.target.checkpoint import inspect_target, load_causal_lm

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from sabotage import reciprocal_global_scales, transpose_block_scales  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    src = make_target(root / "src", "llama", seed=3, num_layers=2)
    return quantize_checkpoint(src, root / "nvfp4", "modelopt").out


@pytest.fixture
def ckpt(good, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    return folder


def edit_tensors(folder, fn):
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def edit_json(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def assert_rejected(folder, *fragments, tmp_path=None):
    for action in (inspect_target, lambda p: load_causal_lm(p, torch.float32)):
        with pytest.raises(CheckpointError) as err:
            action(folder)
        message = str(err.value)
        assert "\n" not in message
        for fragment in fragments:
            assert fragment in message, message
    if tmp_path is not None:  # a conversion of bad input leaves nothing behind
        with pytest.raises(CheckpointError):
            convert_checkpoint(folder, tmp_path / "out", "compressed-tensors")
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_good_checkpoint_passes(good):
    report = inspect_target(good)
    assert report["problems"] == [] and report["quantization"]["quantized_linears"] == 14


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert_rejected(ckpt, "model.safetensors: truncated", "bytes of tensor data", tmp_path=tmp_path)


def test_truncated_shard_of_an_indexed_checkpoint(good, tmp_path):
    sharded = convert_checkpoint(good, tmp_path / "ct", "compressed-tensors", max_shard_bytes=30_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].write_bytes(shards[1].read_bytes()[:-8])
    assert_rejected(sharded, f"{shards[1].name}: truncated", "bytes of tensor data")


def test_block_scale_with_wrong_dtype(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].float()}))
    assert_rejected(ckpt, f"{Q}.weight_scale", "F32", "float8_e4m3fn [64, 4]", tmp_path=tmp_path)


def test_block_scale_with_wrong_shape_names_the_group_size(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale": torch.ones(64, 2).to(torch.float8_e4m3fn)}))
    assert_rejected(ckpt, f"{Q}.weight_scale", "[64, 2]", "group size 32")


def test_packed_weight_with_partial_block(ckpt):
    def bad(t):
        t[f"{Q}.weight"] = t[f"{Q}.weight"][:, :12].contiguous()
    edit_tensors(ckpt, bad)
    assert_rejected(ckpt, Q, "in_features 24", "multiple of 16")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_global_scale(ckpt, value):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": torch.tensor(value)}))
    assert_rejected(ckpt, f"{Q}.weight_scale_2", "finite and positive")


def test_zero_input_scale(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.input_scale": torch.tensor(0.0)}))
    assert_rejected(ckpt, f"{Q}.input_scale", "finite and positive")


@pytest.mark.parametrize("byte,word", [(0x7F, "NaN"), (0x00, "zero"), (0xB8, "negative")])
def test_bad_block_scales(ckpt, tmp_path, byte, word):
    def bad(t):
        raw = t[f"{Q}.weight_scale"].view(torch.uint8).clone()
        raw[3, 1] = byte
        t[f"{Q}.weight_scale"] = raw.view(torch.float8_e4m3fn)
    edit_tensors(ckpt, bad)
    assert_rejected(ckpt, f"{Q}.weight_scale", word, tmp_path=tmp_path)


def test_missing_weight_scale_2(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.pop(f"{Q}.weight_scale_2"))
    assert_rejected(ckpt, f"{Q}.weight_scale_2 is missing", "model.safetensors", tmp_path=tmp_path)


def test_scalar_scale_with_wrong_dtype(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": t[f"{Q}.weight_scale_2"].to(torch.bfloat16)}))
    assert_rejected(ckpt, f"{Q}.weight_scale_2", "BF16", "float32 scalar")


def test_group_size_other_than_16(ckpt, tmp_path):
    edit_json(ckpt / "hf_quant_config.json", lambda d: d["quantization"].update(group_size=32))
    assert_rejected(ckpt, "hf_quant_config.json", "group_size is 32", tmp_path=tmp_path)


def test_compressed_tensors_group_size_other_than_16(good, tmp_path):
    ct = convert_checkpoint(good, tmp_path / "ct", "compressed-tensors")
    edit_json(ct / "config.json",
              lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32))
    assert_rejected(ct, "config.json", "group_size is 32")


def test_missing_required_hf_quant_config_key(ckpt):
    edit_json(ckpt / "hf_quant_config.json", lambda d: d["quantization"].pop("exclude_modules"))
    assert_rejected(ckpt, "hf_quant_config.json", "exclude_modules")


def test_exclusion_list_that_names_nothing(ckpt, tmp_path):
    edit_json(ckpt / "hf_quant_config.json",
              lambda d: d["quantization"]["exclude_modules"].append("model.language_model.layers.*.mlp"))
    assert_rejected(ckpt, "model.language_model.layers.*.mlp", "name no module", tmp_path=tmp_path)


def test_unsupported_quant_method(ckpt):
    (ckpt / "hf_quant_config.json").unlink()
    edit_json(ckpt / "config.json", lambda d: d["quantization_config"].update(quant_method="gptq"))
    assert_rejected(ckpt, "config.json", "'gptq'")


def test_fused_group_with_different_global_scales_is_a_problem_not_a_crash(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.1.mlp.up_proj.weight_scale_2": torch.tensor(1e-3)}))
    problems = inspect_target(ckpt)["problems"]
    assert len(problems) == 1 and "model.layers.1.mlp.{gate_proj/up_proj}" in problems[0]
    assert "weight_scale_2" in problems[0]
    load_causal_lm(ckpt, torch.float32)  # still loads: the reference shows what the checkpoint says


def test_unquantized_linear_that_is_not_excluded_is_a_problem(ckpt):
    edit_json(ckpt / "hf_quant_config.json", lambda d: d["quantization"].update(exclude_modules=["model.embed_tokens"]))
    problems = inspect_target(ckpt)["problems"]
    assert any(p.startswith("lm_head is stored unquantized") for p in problems)


def test_act_quant_on_plain_checkpoint_is_refused(tmp_path):
    plain = make_target(tmp_path / "plain", "llama", seed=1, num_layers=2)
    with pytest.raises(CheckpointError, match="needs an NVFP4 checkpoint"):
        load_causal_lm(plain, act_quant=True)


def test_packed_weight_stored_as_int8_names_the_dtype_not_a_missing_tensor(ckpt, tmp_path):
    """A packed weight in another integer dtype is there: the message says what it is and what NVFP4 needs."""
    edit_tensors(ckpt, lambda t: t.__setitem__(f"{Q}.weight", t[f"{Q}.weight"].view(torch.int8)))
    assert_rejected(ckpt, f"{Q}.weight is I8 [", "stores it as uint8 [out, in/2]", tmp_path=tmp_path)
    with pytest.raises(CheckpointError) as err:
        inspect_target(ckpt)
    assert "is missing" not in str(err.value)


@pytest.mark.parametrize("fmt, suffix", [("modelopt", ".weight_scale_2"),
                                         ("compressed-tensors", ".weight_global_scale")])
def test_global_scale_written_as_its_reciprocal_is_flagged_and_refused(good, tmp_path, fmt, suffix):
    """Both sides of a comparison would read the same wrong file, so parity cannot see this: the
    implied weights (6 x 448 x weight_scale_2, millions here) give it away, to inspect and every loader."""
    folder = tmp_path / "ckpt"
    if fmt == "modelopt":
        shutil.copytree(good, folder)
    else:
        convert_checkpoint(good, folder, "compressed-tensors")
    assert inspect_target(folder)["problems"] == []  # the intact file has no such problem
    reciprocal_global_scales(folder, suffix)
    problems = inspect_target(folder)["problems"]
    assert len(problems) == 1 and "14 of 14 NVFP4 Linears" in problems[0] and "reciprocal" in problems[0], problems
    with pytest.raises(CheckpointError, match="looks written as its reciprocal"):
        load_causal_lm(folder, torch.float32)


def test_one_linear_with_a_reciprocal_global_scale_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": 1.0 / t[f"{Q}.weight_scale_2"]}))
    problems = inspect_target(ckpt)["problems"]
    assert problems[0].startswith("1 of 14") and f"{Q}.weight_scale_2" in problems[0], problems
    assert "have different weight_scale_2" in problems[1]  # q/k/v, fused by runtimes, no longer agree


def test_transposed_block_scales_are_refused_by_shape(ckpt):
    """[in/16, out] where [out, in/16] belongs: every Linear here has out != in/16, so the shape tells
    (a Linear with out == in/16 would keep its shape; docs/nvfp4-engines.md)."""
    transpose_block_scales(ckpt, {f"{Q}.weight_scale"})
    assert_rejected(ckpt, f"{Q}.weight_scale", "expected float8_e4m3fn")
