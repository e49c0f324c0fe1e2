"""`eagle31-export verify DIR` against manifest.json: a flipped byte in any file of a bundle, a
Triton repository or a quantized target is named; missing and extra files too; a target referenced
by path is checked by size and safetensors header. `serve` and `parity` refuse what changed before
loading it, in one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle31_export.errors import UserError
from eagle31_export.export.trtllm import export_trtllm
from eagle31_export.formats.outputs import check_artifacts, verify_output


def flip_byte(path: Path) -> bytes:
    data = path.read_bytes()
    i = len(data) // 2
    path.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    return data


def touch_header(path: Path) -> None:
    """The same size, another safetensors header (its metadata says "PT" instead of "pt")."""
    data = path.read_bytes()
    assert data.count(b'"format":"pt"') == 1
    path.write_bytes(data.replace(b'"format":"pt"', b'"format":"PT"'))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, eagle31_dir, llama_target):
    from eagle31_export.formats.target.quantize import quantize_checkpoint
    from eagle31_export.runtime.triton_repo import export_triton

    root = tmp_path_factory.mktemp("verify")
    bundle = export_trtllm(eagle31_dir, llama_target, root / "bundle", copy=True)
    return {"bundle": bundle,
            "triton-cpu": export_triton(bundle, root / "repo", "cpu", copy_target=True),
            "triton-trtllm": export_triton(bundle, root / "trt", "trtllm", copy_target=True),
            "quantized": quantize_checkpoint(llama_target, root / "nvfp4", prompts=[[1, 2, 3, 4, 5]]).out}


@pytest.mark.parametrize("kind", ["bundle", "triton-cpu", "triton-trtllm", "quantized"])
def test_a_flipped_byte_in_any_file_is_named(outputs, kind):
    out = outputs[kind]
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert len(files) >= 4
    for rel in files:
        original = flip_byte(out / rel)
        try:
            found = verify_output(out)
        finally:
            (out / rel).write_bytes(original)
        assert [(d.path, d.kind, d.detail) for d in found] == [(rel, "changed", "sha256 differs")]
    assert verify_output(out) == []


def test_the_command_names_each_difference_and_exits_1(cli, outputs, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(outputs["triton-cpu"], repo, symlinks=True)
    assert cli("verify", repo)[0] == 0
    drafter = repo / "eagle31_speculate" / "1" / "pair" / "drafter" / "model.safetensors"
    flip_byte(drafter)
    (repo / "eagle31_generate" / "config.pbtxt").unlink()
    (repo / "eagle31_generate" / "1" / "notes.txt").write_text("added")
    code, out, err = cli("verify", repo)
    assert code == 1
    assert out.splitlines() == [
        "missing eagle31_generate/config.pbtxt",
        "changed eagle31_speculate/1/pair/drafter/model.safetensors  (sha256 differs)",
        "extra   eagle31_generate/1/notes.txt",
    ]
    assert "3 difference(s)" in err
    code, out, _ = cli("verify", repo, "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and len(report["differences"]) == 3
    code, _, err = cli("verify", tmp_path)  # not an output
    assert code == 2 and "no manifest.json" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def private_target(tmp_path, llama_target):
    return Path(shutil.copytree(llama_target, tmp_path / "target"))


def test_a_target_referenced_by_path_is_checked_by_size_and_header(tmp_path, eagle31_dir, private_target):
    bundle = export_trtllm(eagle31_dir, private_target, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["references"]["target"]["path"] == str(private_target.resolve())
    weights = private_target / "model.safetensors"
    # a flipped weight byte is not looked for: that would mean hashing the whole target
    original = flip_byte(weights)
    assert verify_output(bundle) == []
    weights.write_bytes(original)
    touch_header(weights)
    found = verify_output(bundle)
    assert [(d.path, d.kind) for d in found] == [(f"{private_target.resolve()}/model.safetensors", "changed")]
    assert "header" in found[0].detail
    with pytest.raises(UserError, match="model.safetensors changed since it was written"):
        check_artifacts(bundle)
    weights.write_bytes(original[:-4])
    assert "bytes" in verify_output(bundle)[0].detail
    shutil.rmtree(private_target)
    assert [d.kind for d in verify_output(bundle)] == ["missing"]


def test_serve_refuses_a_changed_repository_before_starting(cli, tmp_path, eagle31_dir, private_target):
    from eagle31_export.runtime.triton_repo import export_triton

    bundle = export_trtllm(eagle31_dir, private_target, tmp_path / "bundle")
    repo = export_triton(bundle, tmp_path / "repo", "trtllm")  # the target is linked
    touch_header(private_target / "model.safetensors")
    code, _, err = cli("serve", repo, "--port", "1", "--grpc-port", "2")  # refused before any port is used
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "tensorrt_llm/1/target/model.safetensors changed since it was written" in err
    flip_byte(repo / "tensorrt_llm" / "1" / "model.yaml")
    code, _, err = cli("serve", repo, "--port", "1", "--grpc-port", "2")
    assert code == 2 and "tensorrt_llm/1/model.yaml changed since it was written (sha256 differs)" in err


def test_parity_refuses_changed_graphs_and_a_changed_source_target(cli, tmp_path, eagle31_dir, private_target):
    from eagle31_export.export.onnx_export import export_onnx

    onnx = export_onnx(eagle31_dir, tmp_path / "onnx", private_target)
    original = flip_byte(onnx / "drafter_first.onnx")
    code, _, err = cli("parity", onnx, "--runtime", "onnxruntime")
    assert code == 2 and "drafter_first.onnx changed since it was written" in err
    assert len(err.strip().splitlines()) == 1
    (onnx / "drafter_first.onnx").write_bytes(original)
    touch_header(private_target / "model.safetensors")  # parity takes the reference target from graphs.json
    code, _, err = cli("parity", onnx, "--runtime", "onnxruntime")
    assert code == 2 and f"{private_target.resolve()}/model.safetensors changed since it was written" in err
