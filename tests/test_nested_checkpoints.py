"""A checkpoint folder read directly from inside an output of this tool (a vLLM bundle's `drafter/`,
a Triton repository's `pair/drafter/`, a bundle's copied `target/`) is held against the enclosing
output's manifest first: a changed byte there is refused in one line naming the file, exit 2. An
untouched nested folder, and a plain checkpoint folder inside no output, load as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eagle31_export.errors import UserError
from eagle31_export.export.vllm import export_vllm
from eagle31_export.formats.drafter.checkpoint import read_drafter
from eagle31_export.formats.outputs import enclosing_output
from eagle31_export.formats.target.checkpoint import read_target_info

PAIR = Path("eagle31_speculate") / "1" / "pair"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, eagle31_dir, llama_target):
    from eagle31_export.runtime.triton_repo import export_triton

    root = tmp_path_factory.mktemp("nested")
    bundle = export_vllm(eagle31_dir, llama_target, root / "bundle", copy=True)
    return {"bundle": bundle, "repo": export_triton(bundle, root / "repo", "cpu")}


@pytest.fixture
def copies(outputs, tmp_path):
    """Copies of the outputs each test may change (links kept: the repository's target is one)."""
    return {name: Path(shutil.copytree(out, tmp_path / name, symlinks=True)) for name, out in outputs.items()}


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # the same size: only the hash tells
    path.write_bytes(bytes(data))


def speculate(cli, drafter, target):
    return cli("speculate", "--drafter", drafter, "--target", target, "--prompt-ids", "5,6,7",
               "--max-new-tokens", "4", "--depth", "2")


def assert_refused(result, changed: str) -> None:
    code, _, err = result
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{changed} changed since it was written" in err and "export it again" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_changed_file_of_a_bundles_drafter_is_refused(cli, copies, llama_target, name):
    drafter = copies["bundle"] / "drafter"
    flip_byte(drafter / name)
    assert_refused(speculate(cli, drafter, llama_target), f"bundle/drafter/{name}")
    assert_refused(cli("inspect", drafter), f"bundle/drafter/{name}")
    with pytest.raises(UserError, match=f"drafter/{name} changed since it was written"):
        read_drafter(drafter)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_changed_file_of_a_triton_repositorys_drafter_is_refused(cli, copies, llama_target, name):
    drafter = copies["repo"] / PAIR / "drafter"
    flip_byte(drafter / name)
    changed = f"{(PAIR / 'drafter' / name).as_posix()}"
    assert_refused(speculate(cli, drafter, llama_target), changed)
    assert_refused(cli("inspect", drafter), changed)
    assert_refused(cli("parity", "--drafter", drafter, "--target", llama_target, "--runtime", "onnxruntime",
                       "--max-new-tokens", "4"), changed)


def test_a_changed_file_of_a_copied_target_is_refused(cli, copies, eagle31_dir):
    target = copies["bundle"] / "target"
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data.replace(b'"format":"pt"', b'"format":"PT"', 1))  # another header, the same size
    assert_refused(speculate(cli, eagle31_dir, target), "bundle/target/model.safetensors")
    assert_refused(cli("inspect", target), "bundle/target/model.safetensors")
    weights.write_bytes(data)
    flip_byte(target / "config.json")  # small files by sha256
    with pytest.raises(UserError, match="bundle/target/config.json changed since it was written"):
        read_target_info(target)


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory, eagle31_dir, llama_target):
    """Every output that holds checkpoint folders: the three bundles and both Triton flavours, with
    copied targets; (output, the folder holding its drafter/ and target/)."""
    from eagle31_export.export.sglang import export_sglang
    from eagle31_export.export.trtllm import export_trtllm
    from eagle31_export.runtime.triton_repo import export_triton

    root = tmp_path_factory.mktemp("kinds")
    made = {kind: export(eagle31_dir, llama_target, root / kind, copy=True)
            for kind, export in (("vllm", export_vllm), ("trtllm", export_trtllm), ("sglang", export_sglang))}
    kinds = {kind: (out, ".") for kind, out in made.items()}
    kinds["triton-cpu"] = (export_triton(made["vllm"], root / "triton-cpu", "cpu", copy_target=True), PAIR.as_posix())
    kinds["triton-trtllm"] = (export_triton(made["trtllm"], root / "triton-trtllm", "trtllm", copy_target=True),
                              "tensorrt_llm/1")
    return kinds


KINDS = ["vllm", "trtllm", "sglang", "triton-cpu", "triton-trtllm"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role, name", [("drafter", "model.safetensors"), ("drafter", "config.json"),
                                        ("target", "config.json"), ("target", "model.safetensors")])
def test_every_nested_checkpoint_folder_is_checked(every_kind, tmp_path, kind, role, name):
    out, inner = every_kind[kind]
    out = Path(shutil.copytree(out, tmp_path / kind, symlinks=True))
    folder = out / inner / role
    read = read_drafter if role == "drafter" else read_target_info
    read(folder)  # as written
    path = folder / name
    data = path.read_bytes()
    if role == "target" and name == "model.safetensors":  # a copied target: by size and header
        path.write_bytes(data.replace(b'"format":"pt"', b'"format":"PT"', 1))
    else:
        flip_byte(path)
    changed = (Path(kind) / inner / role / name).as_posix()
    with pytest.raises(UserError, match=f"{changed} changed since it was written"):
        read(folder)
    path.write_bytes(data)
    read(folder)


def test_a_missing_file_is_named(cli, copies):
    drafter = copies["bundle"] / "drafter"
    (drafter / "model.safetensors").unlink()
    code, _, err = cli("inspect", drafter)
    assert code == 2 and "bundle/drafter/model.safetensors is missing" in err and len(err.strip().splitlines()) == 1


def test_untouched_nested_folders_load(cli, outputs, llama_target):
    for drafter in (outputs["bundle"] / "drafter", outputs["repo"] / PAIR / "drafter"):
        assert enclosing_output(drafter) is not None
        assert cli("inspect", drafter)[0] == 0
        assert speculate(cli, drafter, llama_target)[0] == 0
    assert cli("inspect", outputs["bundle"] / "target")[0] == 0
    assert cli("inspect", outputs["repo"] / PAIR / "target")[0] == 0  # a link to the source target


def test_only_the_folder_read_is_checked(cli, copies, llama_target):
    """A changed file elsewhere in the output is for `verify` and the commands that read the output;
    reading the drafter hashes the drafter's files only."""
    flip_byte(copies["bundle"] / "README.md")
    assert speculate(cli, copies["bundle"] / "drafter", llama_target)[0] == 0
    code, out, _ = cli("verify", copies["bundle"])
    assert code == 1 and "README.md" in out


def test_a_plain_checkpoint_outside_any_output_loads(cli, tmp_path, eagle31_dir, llama_target):
    drafter = Path(shutil.copytree(eagle31_dir, tmp_path / "plain" / "drafter"))
    assert enclosing_output(drafter) is None
    flip_byte(drafter / "model.safetensors")  # a weight byte: nothing to hold it against, and the values pass
    assert cli("inspect", drafter)[0] == 0
    assert speculate(cli, drafter, llama_target)[0] == 0
