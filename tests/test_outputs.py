"""Where commands may write: inputs are never touched (an --out equal to, inside or containing an
input is refused, with or without --force), --force replaces only an output of this tool and only
once the new one is complete, leftovers of killed runs are cleaned, and no file of any output names
the path it was written under."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from eagle31_export.errors import UserError
from eagle31_export.export.trtllm import export_trtllm
from eagle31_export.formats.outputs import atomic_output_dir, check_output, verify_output, write_manifest


def snapshot(*paths: Path) -> dict[str, str]:
    """sha256 of every file under `paths` (and the listing itself): any change to an input shows."""
    found = {}
    for root in paths:
        for p in sorted(Path(root).rglob("*")):
            found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return found


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, eagle31_dir, llama_target):
    return export_trtllm(eagle31_dir, llama_target, tmp_path_factory.mktemp("b") / "trtllm")


def _inputs_in(tmp_path: Path, eagle31_dir: Path, llama_target: Path, bundle: Path) -> dict[str, Path]:
    """Private copies of the inputs inside one folder that also looks like an output of this tool
    (it holds a manifest.json), so that only the input rule can refuse an --out around them."""
    home = tmp_path / "inputs"
    home.mkdir()
    (home / "manifest.json").write_text(json.dumps({"format": "eagle31-export/manifest", "files": {}}))
    paths = {"drafter": home / "drafter", "target": home / "target", "bundle": home / "bundle",
             "prompts": home / "prompts.jsonl"}
    shutil.copytree(eagle31_dir, paths["drafter"])
    shutil.copytree(llama_target, paths["target"])
    shutil.copytree(bundle, paths["bundle"])
    record = json.loads((paths["bundle"] / "bundle.json").read_text())
    record["target"] = str(paths["target"])
    (paths["bundle"] / "bundle.json").write_text(json.dumps(record))
    write_manifest(paths["bundle"], {"target": paths["target"]})  # a bundle written for this target
    paths["prompts"].write_text('{"prompt_ids": [1, 2, 3]}\n')
    return paths


# command -> (argv with {drafter} {target} {bundle} {prompts} {out}, the inputs it names)
COMMANDS = {
    "export trtllm": ("export trtllm --drafter {drafter} --target {target} --out {out}", ("drafter", "target")),
    "export vllm": ("export vllm --drafter {drafter} --target {target} --out {out}", ("drafter", "target")),
    "export sglang": ("export sglang --drafter {drafter} --target {target} --out {out}", ("drafter", "target")),
    "export onnx": ("export onnx --drafter {drafter} --target {target} --out {out}", ("drafter", "target")),
    "export triton": ("export triton --bundle {bundle} --flavor cpu --out {out}", ("bundle", "target")),
    "quantize": ("quantize {target} --calib-prompts {prompts} --out {out}", ("target", "prompts")),
    "parity": ("parity --drafter {drafter} --target {target} --prompts {prompts} --runtime reference "
               "--max-new-tokens 2 --out {out}", ("drafter", "target", "prompts")),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_out_that_touches_an_input_is_refused_with_or_without_force(cli, tmp_path, eagle31_dir, llama_target,
                                                                        bundle, command):
    paths = _inputs_in(tmp_path, eagle31_dir, llama_target, bundle)
    argv, named = COMMANDS[command]
    home = paths["drafter"].parent
    before = snapshot(home)
    for role in named:
        given = paths[role]
        cases = [(given, "is the input"), (home, "contains the input")]
        if given.is_dir():
            cases.append((given / "sub", "is inside the input"))
        for out, message in cases:
            for force in ([], ["--force"]):
                args = argv.format(**paths, out=out).split() + force
                code, _, err = cli(*args)
                assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
                assert "Traceback" not in err
    assert snapshot(home) == before  # no input touched, nothing written among them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]


def test_demo_and_engine_refuse_an_out_around_their_inputs(cli, tmp_path, eagle31_dir, llama_target):
    from eagle31_export.export.onnx_export import export_onnx

    onnx = export_onnx(eagle31_dir, tmp_path / "onnx", llama_target)
    before = snapshot(onnx)
    for out, message in ((onnx, "is the input"), (onnx / "e", "is inside the input"), (tmp_path, "contains")):
        code, _, err = cli("export", "engine", "--onnx", onnx, "--out", out, "--force")
        assert code == 2 and message in err, err
    pair = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"
    code, _, err = cli("demo", "--pair", pair, "--out", pair / "target", "--force")
    assert code == 2 and "is inside the input" in err, err
    assert snapshot(onnx) == before


def test_force_replaces_only_an_output_of_this_tool(cli, tmp_path, bundle):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    code, _, err = cli("export", "triton", "--bundle", bundle, "--flavor", "trtllm", "--out", mine, "--force")
    assert code == 2 and err.strip() == (f"error: {mine} is not an eagle31-export output (no manifest.json); "
                                         "remove it yourself or choose another --out")
    assert (mine / "notes.txt").read_text() == "keep" and sorted(os.listdir(mine)) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_a_failed_force_run_leaves_the_earlier_output_complete(tmp_path, bundle, monkeypatch):
    from eagle31_export.runtime import triton_repo

    repo = triton_repo.export_triton(bundle, tmp_path / "repo", "trtllm")
    before = snapshot(repo)

    def half_then_fail(record, bundle, repo):
        (repo / "tensorrt_llm" / "1").mkdir(parents=True, exist_ok=True)
        (repo / "tensorrt_llm" / "1" / "model.yaml").write_text("half: written\n")
        raise RuntimeError("disk full")

    monkeypatch.setattr(triton_repo, "write_trtllm_repo", half_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        triton_repo.export_triton(bundle, repo, "trtllm", force=True)
    assert snapshot(repo) == before and verify_output(repo) == []
    assert sorted(os.listdir(tmp_path)) == ["repo"]  # the temporary sibling is gone


def test_force_swaps_the_new_output_in_whole(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
        (tmp / "only-old.txt").write_text("old")
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "a.txt").write_text("new")
        # while the new output is being written, the old one is still whole at the final path
        assert (out / "a.txt").read_text() == "old" and verify_output(out) == []
    assert (out / "a.txt").read_text() == "new" and not (out / "only-old.txt").exists()
    assert verify_output(out) == [] and sorted(os.listdir(tmp_path)) == ["out"]


def test_leftovers_of_killed_runs_are_cleaned_but_not_those_of_a_live_run(tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / ".out.tmp-dead1234"
    dead.mkdir()
    (dead / "half.bin").write_bytes(b"x" * 100)
    live = tmp_path / ".out.tmp-live5678"
    live.mkdir()
    other = tmp_path / ".other.tmp-abcd"  # another output's: not ours to judge
    other.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the process writing it holds it
    try:
        with atomic_output_dir(out) as tmp:
            (tmp / "a.txt").write_text("a")
        assert sorted(os.listdir(tmp_path)) == [".other.tmp-abcd", ".out.tmp-live5678", "out"]
    finally:
        os.close(fd)
    check_output(out, force=True)  # the next run of `out`: the lock is gone, so is the leftover
    assert sorted(os.listdir(tmp_path)) == [".other.tmp-abcd", "out"]


def test_an_output_moved_aside_by_an_interrupted_swap_is_put_back(tmp_path):
    """Where the filesystem has no atomic exchange, --force moves the earlier output aside first;
    a kill before the new one is moved in leaves it at `.NAME.old-*`, and the next run restores it."""
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("earlier")
    os.rename(out, tmp_path / ".out.old-1a2b3c4d")
    with pytest.raises(UserError, match="already exists"):
        check_output(out)
    assert (out / "a.txt").read_text() == "earlier" and verify_output(out) == []
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _names_its_own_path(out: Path) -> list[str]:
    """Files of `out` containing the absolute path it was written under (or its temporary sibling's)."""
    needles = {str(out).encode(), str(out.resolve()).encode(), f"/.{out.name}.tmp-".encode()}
    return [str(p.relative_to(out)) for p in out.rglob("*")
            if p.is_file() and not p.is_symlink() and any(n in p.read_bytes() for n in needles)]


def test_no_file_of_any_bundle_or_repository_names_the_path_it_was_written_under(tmp_path, eagle31_dir,
                                                                                    llama_target):
    from eagle31_export.export.onnx_export import export_onnx
    from eagle31_export.export.sglang import export_sglang
    from eagle31_export.export.vllm import export_vllm
    from eagle31_export.runtime.triton_repo import export_triton

    outputs = []
    for copy in (False, True):
        bundles = {name: export(eagle31_dir, llama_target, tmp_path / f"{name}-{copy}", copy=copy)
                   for name, export in (("trtllm", export_trtllm), ("vllm", export_vllm), ("sglang", export_sglang))}
        outputs += bundles.values()
        outputs += [export_triton(bundles["trtllm"], tmp_path / f"triton-trtllm-{copy}", "trtllm", copy_target=copy),
                    export_triton(bundles["vllm" if copy else "sglang"], tmp_path / f"triton-cpu-{copy}", "cpu",
                                  copy_target=copy)]
    outputs.append(export_onnx(eagle31_dir, tmp_path / "onnx", llama_target))
    for out in outputs:
        assert _names_its_own_path(out) == [], out
        assert verify_output(out) == [], out
    # the repositories' checkpoints: inside, named relative to the file that names them
    pair = json.loads((tmp_path / "triton-cpu-True" / "eagle31_speculate" / "1" / "pair" / "pair.json").read_text())
    assert (pair["target"], pair["drafter"]) == ("target", "drafter")
    assert (tmp_path / "triton-cpu-False" / "eagle31_speculate" / "1" / "pair" / "target").is_symlink()
    assert not (tmp_path / "triton-cpu-True" / "eagle31_speculate" / "1" / "pair" / "target").is_symlink()


def _kill_while(tmp_path: Path, out: Path, pause: str, exchange: bool = True) -> None:
    """Run `atomic_output_dir(out, force=True)` in a forked child that stops at `pause` (one step of
    moving the new output into place) and SIGKILL it there."""
    import signal
    import time

    from eagle31_export.formats import outputs

    marker = tmp_path / f"paused-{pause}"
    pid = os.fork()
    if pid == 0:  # the child: the real code, stopped at one step
        try:
            def stop(real):
                def stopped(*args, **kwargs):
                    marker.write_text("")
                    time.sleep(60)
                    return real(*args, **kwargs)
                return stopped

            if not exchange:
                outputs._renameat2 = lambda src, dst, flags: False
            if pause == "before the manifest":
                outputs.write_manifest = stop(outputs.write_manifest)
            elif pause == "before the swap" and exchange:
                outputs._renameat2 = stop(outputs._renameat2)
            elif pause == "before the swap":  # between the two renames: the earlier output is aside
                renames, real_rename = [], os.rename

                def second_stops(src, dst):
                    renames.append(dst)
                    return (stop(real_rename) if len(renames) == 2 else real_rename)(src, dst)
                os.rename = second_stops
            elif pause == "after the swap":
                outputs._remove = stop(outputs._remove)
            elif pause == "while removing the earlier output":
                real_rmtree = shutil.rmtree

                def half(path, *args, **kwargs):
                    if Path(path).name.startswith(".out."):
                        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
                        stop(real_rmtree)(path, *args, **kwargs)
                    return real_rmtree(path, *args, **kwargs)
                outputs.shutil.rmtree = half
            with outputs.atomic_output_dir(out, force=True) as tmp:
                for i in range(3):
                    (tmp / f"{i}.txt").write_text("new")
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0), f"never paused {pause}"
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    marker.unlink()


@pytest.mark.parametrize("pause", ["before the manifest", "before the swap", "after the swap",
                                   "while removing the earlier output"])
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_kill_at_each_step_of_a_force_replacement(tmp_path, pause, exchange):
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        for i in range(3):
            (tmp / f"{i}.txt").write_text("earlier")
    _kill_while(tmp_path, out, pause, exchange)
    if exchange or pause != "before the swap":
        # at the final path: a complete output, the earlier one or the new one, never a mix
        assert verify_output(out) == [] and len({(out / f"{i}.txt").read_text() for i in range(3)}) == 1
    else:  # no atomic exchange: nothing at the final path, the earlier output whole beside it ...
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
        assert not out.exists() and len(aside) == 1 and verify_output(aside[0]) == []
        with pytest.raises(UserError, match="already exists"):  # ... and back at the next run
            check_output(out)
        assert (out / "0.txt").read_text() == "earlier"
    # the next run cleans what the kill left (and puts back an earlier output moved aside), then succeeds
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "0.txt").write_text("rerun")
    assert verify_output(out) == [] and (out / "0.txt").read_text() == "rerun"
    assert sorted(os.listdir(tmp_path)) == ["out"]
