"""Progress reports, phase timings in --json, and --device cpu|cuda|auto (CPU-only machines)."""

from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from eagle31_export.errors import UserError
from eagle31_export.progress import Phases

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")


def _check_timings(timings: dict, keys: set[str], wall: float) -> None:
    assert keys <= set(timings), timings
    assert all(isinstance(v, float) and v >= 0 and math.isfinite(v) for v in timings.values()), timings
    assert sum(timings.values()) <= wall, (timings, wall)


def _prompts(tmp_path: Path, *prompts: list[int]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return path


# ------------------------------------------------------------------ the library side


def test_phases_time_each_phase_and_report_it():
    heard = []
    start = time.perf_counter()
    phases = Phases(lambda phase, done, total: heard.append((phase, done, total)))
    with phases.phase("load"):
        time.sleep(0.01)
    with phases.phase("generate", total=3):
        for n in (1, 2, 3):
            phases("generate", n, 3)
    with phases.phase("load"):  # a phase run twice adds up
        pass
    wall = time.perf_counter() - start
    _check_timings(phases.as_json(), {"load", "generate"}, wall)
    assert phases.timings["load"] >= 0.01
    assert heard[:2] == [("load", 0, None), ("load", 1, 1)]
    assert [h for h in heard if h[0] == "generate"] == [("generate", 0, 3), ("generate", 1, 3), ("generate", 2, 3),
                                                         ("generate", 3, 3), ("generate", 3, 3)]
    assert Phases.of(phases) is phases and Phases.of(None).progress is None
    Phases()("anything", 1, 2)  # no callback: nothing to report to, nothing fails


def test_loop_reports_tokens_generated(llama_target, eagle31_dir):
    from eagle31_export.reference.speculate import ProgressObserver
    from eagle31_export.runtime.registry import PairSource, load_speculator

    heard = []
    speculator = load_speculator("reference", PairSource.of(eagle31_dir, llama_target))
    result = speculator.run([1, 2, 3], 10, 3, observer=ProgressObserver(lambda *r: heard.append(r), 10))
    done = [d for phase, d, total in heard if phase == "generate" and total == 10]
    assert done[0] == 1 and done == sorted(done) and done[-1] == len(result.tokens) == 10
    assert len(heard) == 1 + len(result.accepted_per_step)


# ------------------------------------------------------------------ the display


def test_display_is_silent_off_a_terminal_and_draws_on_one():
    from eagle31_export.cli.progress import ProgressDisplay, working

    piped = io.StringIO()
    with ProgressDisplay("x", Console(file=piped, force_terminal=False)) as display:
        phases = display.phases()
        with phases.phase("load"):
            display("generate", 1, 4)
        display.tensor_steps()(1, 2, "tensor a")
    assert piped.getvalue() == "" and set(phases.timings) == {"load"}
    with working("convert", console=Console(file=piped, force_terminal=False)) as timed:
        pass
    assert piped.getvalue() == "" and set(timed.timings) == {"write"}

    tty = io.StringIO()
    with ProgressDisplay("speculate", Console(file=tty, force_terminal=True, width=100)) as display:
        display("generate", 1, 4)
        display.update("tensors", 1, 2, label="layers.0.q_proj")
    drawn = tty.getvalue()
    assert "\x1b" in drawn and "speculate: generating" in drawn and "layers.0.q_proj" in drawn


# ------------------------------------------------------------------ --device


@NO_CUDA
@pytest.mark.parametrize("command", [
    ["speculate", "--prompt-ids", "1,2,3"],
    ["parity", "--runtime", "reference"],
    ["diagnose"],
    ["capture", "--out", "{tmp}/capture"],
])
def test_device_cuda_without_cuda_is_one_line_exit_2(cli, tmp_path, llama_target, eagle31_dir, command):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command]
    code, out, err = cli(*argv, "--drafter", eagle31_dir, "--target", llama_target, "--device", "cuda")
    assert code == 2 and out == ""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert err.strip().splitlines() == [f"error: --device cuda: no CUDA device is visible to torch (torch {version}, "
                                        "CUDA build: no); use --device cpu"]
    assert not (tmp_path / "capture").exists()


def test_device_names_are_checked(cli, llama_target, eagle31_dir):
    code, out, err = cli("speculate", "--drafter", eagle31_dir, "--target", llama_target, "--prompt-ids", "1,2",
                         "--device", "gpu")
    assert code == 2 and err.strip() == "error: unknown --device 'gpu'; choose one of cpu, cuda, auto"


def test_resolve_device_where_cuda_is_visible(monkeypatch):
    from eagle31_export.runtime.registry import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", "reference") == "cuda" and resolve_device("cuda", "reference") == "cuda"
    assert resolve_device("auto", "onnxruntime") == "cpu"  # ONNX Runtime runs on CPU here
    with pytest.raises(UserError, match=r"--device cuda: --runtime onnxruntime computes on cpu only in this "
                                        r"process; use --device cpu, or --runtime reference"):
        resolve_device("cuda", "onnxruntime")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", "reference") == "cpu" and resolve_device(None) == "cpu"


def test_plugin_kernels_on_cuda_need_the_cuda_library(monkeypatch):
    from eagle31_export.kernels import torch_ops
    from eagle31_export.runtime.reference_runtime import _kernel_provider

    monkeypatch.setattr(torch_ops, "loaded_library", lambda device_type: None)
    assert torch_ops.device_problem("cpu") is None
    with pytest.raises(UserError) as err:
        _kernel_provider("plugins", "cuda")
    assert str(err.value).startswith("--kernels plugins --device cuda: only the CPU plugin kernels are available")
    assert "\n" not in str(err.value)


def test_device_auto_gives_the_cpu_results_and_json_has_timings(cli, llama_target, eagle31_dir):
    runs = {}
    for device in ("cpu", "auto"):
        start = time.perf_counter()
        code, out, err = cli("speculate", "--drafter", eagle31_dir, "--target", llama_target, "--prompt-ids",
                             "3,1,4,1,5", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "7", "--json",
                             "--device", device)
        wall = time.perf_counter() - start
        assert code == 0, err
        assert "\x1b" not in err  # captured stderr is no terminal: no progress drawn
        runs[device] = json.loads(out)
        _check_timings(runs[device]["timings"], {"load", "generate"}, wall)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert runs["auto"]["device"] == expected
    if expected == "cpu":
        strip = lambda r: {k: v for k, v in r.items() if k != "timings"}  # noqa: E731
        assert strip(runs["auto"]) == strip(runs["cpu"])


# ------------------------------------------------------------------ timings of the other commands


def test_parity_timings_in_json_and_report(cli, tmp_path, llama_target, eagle31_dir):
    prompts = _prompts(tmp_path, [1, 2, 3], [7, 8])
    start = time.perf_counter()
    code, out, err = cli("parity", "--runtime", "reference", "--drafter", eagle31_dir, "--target", llama_target,
                         "--prompts", prompts, "--max-new-tokens", "6", "--out", tmp_path / "report", "--json",
                         "--device", "auto")
    wall = time.perf_counter() - start
    assert code == 0, err
    printed = json.loads(out)
    phases = {"load_reference", "load_runtime", "compare", "per_depth"}
    _check_timings(printed["timings"], phases | {"write"}, wall)
    written = json.loads((tmp_path / "report" / "report.json").read_text())
    _check_timings(written["timings"], phases, wall)
    assert {k: v for k, v in written["timings"].items()} == {k: printed["timings"][k] for k in written["timings"]}


def test_diagnose_and_capture_timings(cli, tmp_path, llama_target, eagle31_dir):
    prompts = _prompts(tmp_path, [5, 6, 7, 8])
    start = time.perf_counter()
    code, out, err = cli("diagnose", "--drafter", eagle31_dir, "--target", llama_target, "--prompts", prompts,
                         "--depth", "2", "--positions", "3", "--json", "--device", "cpu")
    assert code == 0, err
    _check_timings(json.loads(out)["timings"], {"load", "measure"}, time.perf_counter() - start)

    start = time.perf_counter()
    code, out, err = cli("capture", "--target", llama_target, "--drafter", eagle31_dir, "--prompts", prompts,
                         "--out", tmp_path / "cap", "--max-new-tokens", "4", "--json", "--device", "auto")
    assert code == 0, err
    printed = json.loads(out)
    _check_timings(printed["timings"], {"load_target", "capture", "write"}, time.perf_counter() - start)
    assert printed["prompts"] == 1 and Path(printed["out"]) == tmp_path / "cap" and (tmp_path / "cap").is_dir()


def test_export_onnx_json_timings(cli, tmp_path, llama_target, eagle31_dir):
    pytest.importorskip("onnx")
    start = time.perf_counter()
    code, out, err = cli("export", "onnx", "--drafter", eagle31_dir, "--target", llama_target, "--out",
                         tmp_path / "onnx", "--json")
    assert code == 0, err
    printed = json.loads(out)
    _check_timings(printed["timings"], {"load_target", "export_drafter", "export_target"},
                   time.perf_counter() - start)
    assert printed["graphs"]["drafter_first"] == "drafter_first.onnx"
    assert all((tmp_path / "onnx" / f).is_file() for f in printed["graphs"].values())


# ------------------------------------------------------------------ benchmarks/gpu_check.py


@NO_CUDA
def test_gpu_check_says_in_one_line_that_it_needs_cuda(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu_check.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "CUDA" in captured.err


def test_gpu_check_builds_the_real_layout_pair_at_test_sizes():
    """The code that builds the 8B-layout pair, at small widths on the CPU: it speculates and taps."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    widths = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  vocab_size=512, head_dim=16, rope_theta=500000.0, rms_norm_eps=1e-5)
    speculator = gpu_check.real_layout(3, widths=widths, draft_vocab=100, init_device="cpu")()
    runs = gpu_check.run_side(speculator, 6, 3)
    assert len(runs) == len(gpu_check.PROMPTS)
    for run, prompt in zip(runs, gpu_check.PROMPTS):
        assert len(run["result"].tokens) == 6 and run["draft_logits"][0].shape == (100,)
        assert run["taps"].shape == (1, len(prompt) + 6, 3 * 64)
