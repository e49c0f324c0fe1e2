"""What a command reads of this tool's outputs is checked against its manifest first: a changed
byte is refused in one line naming the file, and never copied under a fresh manifest."""

from __future__ import annotations

import shutil

import pytest

from eagle31_export.export.trtllm import export_trtllm
from eagle31_export.export.vllm import export_vllm


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, eagle31_dir, llama_target):
    root = tmp_path_factory.mktemp("consumed")
    return {"trtllm": export_trtllm(eagle31_dir, llama_target, root / "trtllm"),
            "vllm": export_vllm(eagle31_dir, llama_target, root / "vllm")}


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a weight byte of a safetensors file, the last character of a text file
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind, flavor, changed", [
    ("trtllm", "trtllm", "drafter/model.safetensors"),
    ("trtllm", "trtllm", "llm_api.yaml"),
    ("vllm", "cpu", "drafter/model.safetensors"),
])
def test_export_triton_refuses_a_bundle_changed_since_it_was_written(cli, bundles, tmp_path, kind, flavor, changed):
    bundle = tmp_path / kind
    shutil.copytree(bundles[kind], bundle)
    repo = tmp_path / "repo"
    assert cli("export", "triton", "--bundle", bundle, "--out", repo, "--flavor", flavor)[0] == 0  # as written
    flip_last_byte(bundle / changed)
    code, _, err = cli("export", "triton", "--bundle", bundle, "--out", tmp_path / "repo2", "--flavor", flavor)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{changed} changed since it was written" in err and "Traceback" not in err
    assert not (tmp_path / "repo2").exists()
