"""Every command that writes, SIGKILLed at 10 moments spread over its run: the final path never
holds a half-written folder, an earlier output is never lost, and the rerun succeeds and leaves
nothing beside the output.

Per command: its run time D is measured first (the shorter of two runs); then
  - 5 fresh runs (nothing at --out), killed at 5%, 25%, 45%, 65%, 85% of D;
  - a rerun to completion (--force only where the last kill came after the output was in place);
  - 5 --force runs over that complete output, killed at 10%, 30%, 50%, 70%, 90% of D;
  - a rerun to completion with --force.
Every run after the first is a rerun of the same command on whatever the previous kill left (its
temporary sibling included), and must be running when its own kill comes, or have exited 0; a run
that finished before its kill shortens D and the kill point is tried again, so that all 10 kills
land in a running command.
After every kill the final path is absent or complete (`verify_output` finds no difference);
after a --force run it is present (the earlier output, or the new one). After each completed rerun
nothing but the output is left beside it.

Runs are children forked from a warm process (tests/cli_forker.py) running the console script's
entry point: a real process, a real SIGKILL, without paying the interpreter start-up each time.
`export engine` (needs TensorRT) and `demo` (a minute per run) are not run here; both write through
the same `atomic_output_dir` as the commands below.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from factories import drafter_config_for, make_target, random_drafter
from eagle31_export.export.trtllm import export_trtllm
from eagle31_export.formats.drafter.checkpoint import write_drafter
from eagle31_export.formats.outputs import verify_output
from eagle31_export.formats.target.checkpoint import read_target_info

FRESH = (0.05, 0.25, 0.45, 0.65, 0.85)
FORCED = (0.1, 0.3, 0.5, 0.7, 0.9)


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


class Forker:
    def __init__(self, log: Path):
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_forker.py")), str(log)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.log = log

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the forker died: {self.log.read_text()[-2000:]}"
        return json.loads(line)

    def close(self) -> None:
        self.process.kill()  # nothing of its own to clean up; its children have all been reaped
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 4-layer target, its EAGLE 3.1 drafter, a TensorRT-LLM bundle, prompts: runs of ~0.1-0.5 s."""
    root = tmp_path_factory.mktemp("kill-inputs")
    target = make_target(root / "target", "llama", seed=0, num_layers=4, hidden=32, vocab=128, heads=2, kv_heads=1,
                         intermediate=64)
    cfg = drafter_config_for(read_target_info(target), fc_norm=True, norm_output=True, aux_layer_ids=(0, 1, 2))
    drafter = write_drafter(random_drafter(cfg, seed=1), root / "drafter", "specforge")
    bundle = export_trtllm(drafter, target, root / "bundle")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3, 4, 5, 6]}\n')
    pickled = root / "pickled"  # the original EAGLE release's layout: config.json + pytorch_model.bin
    pickled.mkdir()
    shutil.copy(target / "config.json", pickled / "config.json")
    from safetensors.torch import load_file
    import torch

    torch.save(load_file(str(target / "model.safetensors")), pickled / "pytorch_model.bin")
    return {"target": target, "drafter": drafter, "bundle": bundle, "prompts": prompts, "pickled": pickled}


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    f = Forker(tmp_path_factory.mktemp("forker") / "forker.log")
    try:
        yield f
    finally:
        f.close()


def commands(s) -> dict[str, list[str]]:
    d, t, b = str(s["drafter"]), str(s["target"]), str(s["bundle"])
    return {
        "export-trtllm": ["export", "trtllm", "--drafter", d, "--target", t],
        "export-vllm": ["export", "vllm", "--drafter", d, "--target", t],
        "export-sglang": ["export", "sglang", "--drafter", d, "--target", t],
        "export-onnx": ["export", "onnx", "--drafter", d, "--target", t],
        "export-triton-trtllm": ["export", "triton", "--bundle", b, "--flavor", "trtllm"],
        "export-triton-cpu": ["export", "triton", "--bundle", b, "--flavor", "cpu"],
        "quantize": ["quantize", t, "--calib-prompts", str(s["prompts"])],
        "parity": ["parity", "--drafter", d, "--target", t, "--runtime", "reference", "--prompts", str(s["prompts"]),
                   "--depth", "2", "--max-new-tokens", "4"],
        "capture": ["capture", "--target", t, "--drafter", d, "--prompts", str(s["prompts"]), "--max-new-tokens", "4",
                    "--depth", "2"],
        "diagnose": ["diagnose", "--drafter", d, "--target", t, "--prompts", str(s["prompts"]), "--depth", "2",
                     "--positions", "2"],
        "convert": ["convert", str(s["pickled"])],
    }


def beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def complete(out: Path) -> bool:
    """A folder at the final path is complete when it matches its manifest exactly."""
    return (out / "manifest.json").is_file() and verify_output(out) == []


@pytest.mark.parametrize("name", list(commands({"drafter": "", "target": "", "bundle": "", "prompts": "", "pickled": ""})))
def test_killed_runs_leave_nothing_half_written_and_reruns_succeed(tmp_path, small, forker, name):
    argv = commands(small)[name]
    log = str(tmp_path / "run.log")
    warm = forker.ask(op="warm", argv=[*argv, "--out", str(tmp_path / "warm")])  # imports what it needs
    assert warm["code"] == 0, Path(forker.log).read_text()[-3000:]
    timed = [forker.ask(op="run", argv=[*argv, "--out", str(tmp_path / "timed"), *force], log=log, kill_after=None)
             for force in ([], ["--force"])]
    assert [t["code"] for t in timed] == [0, 0], Path(log).read_text()[-3000:]
    duration = min(t["seconds"] for t in timed)  # a child's run time; the first fork runs a little slower
    out = tmp_path / "out"
    stats = {"kill_points": 0, "runs_outpaced_their_kill": 0, "half_written": 0, "earlier_output_lost": 0,
             "failed_runs": 0, "completed_reruns": 0}

    def run(force: bool, kill_at: float | None) -> dict:
        existed = out.exists()
        answer = forker.ask(op="run", argv=[*argv, "--out", str(out), *(["--force"] if force else [])], log=log,
                            kill_after=None if kill_at is None else kill_at * duration)
        when = "" if kill_at is None else f" (kill at {kill_at:.0%} of {duration:.2f}s)"
        if not answer["killed"] and answer["code"] != 0:
            stats["failed_runs"] += 1
            pytest.fail(f"{name}: a rerun exited {answer['code']}{when}: {Path(log).read_text()[-2000:]}")
        if out.exists() and not complete(out):
            stats["half_written"] += 1
            what = verify_output(out)[:3] if (out / "manifest.json").is_file() else "no manifest.json"
            pytest.fail(f"{name}: half-written folder at the final path{when}: {what}")
        if existed and not out.exists():
            stats["earlier_output_lost"] += 1
            pytest.fail(f"{name}: the earlier output is gone{when}")
        return answer

    def kill_point(at: float, fresh: bool) -> None:
        """Kill a run at `at` of D; a run that finishes first shortens D and is run again."""
        nonlocal duration
        for _ in range(6):
            if fresh and out.exists():
                shutil.rmtree(out)  # a run finished before its kill: start fresh again
            answer = run(force=out.exists(), kill_at=at)
            if answer["killed"]:
                stats["kill_points"] += 1
                return
            stats["runs_outpaced_their_kill"] += 1
            duration = 0.95 * min(duration, answer["seconds"])  # its time includes the exit, after the work
        pytest.fail(f"{name}: every run finished before {at:.0%} of its run time")

    def rerun(force: bool) -> None:
        answer = run(force=force, kill_at=None)
        assert answer["code"] == 0 and complete(out) and beside(out) == [], beside(out)
        stats["completed_reruns"] += 1

    for at in FRESH:
        kill_point(at, fresh=True)
    rerun(force=out.exists())  # present (and complete) only if the last kill came after the final rename
    for at in FORCED:
        kill_point(at, fresh=False)
    rerun(force=True)
    assert stats["kill_points"] == 10 and stats["half_written"] == stats["earlier_output_lost"] == 0
    print(f"{name}: D={duration:.2f}s {stats}")
