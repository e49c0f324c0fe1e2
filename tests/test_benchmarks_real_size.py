"""benchmarks/real_size.py on a tiny shape: a real run of the CLI commands, measured and tabulated."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_size.py"
TINY = ["--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
        "--draft-vocab", "128", "--target-layers", "3"]


def _module():
    spec = importlib.util.spec_from_file_location("real_size", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_tiny_run_measures_each_command(tmp_path):
    out = tmp_path / "rows.json"
    workdir = tmp_path / "work"
    # A shard limit below one layer's bytes: the target is written as several shards plus the index.
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--shard-gb", "0.00005", "--layout", "speculators",
                           "--commands", "inspect,export-trtllm", "--json", str(out), "--workdir", str(workdir),
                           "--keep"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["command"] for r in rows] == ["inspect", "export-trtllm"]
    for r in rows:
        assert r["exit"] == 0 and r["error"] == ""
        assert r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 and r["checkpoint_bytes"] > 0
        assert r["ratio"] == pytest.approx(r["peak_rss_bytes"] / r["checkpoint_bytes"])
        assert r["meets_target"] == (r["peak_rss_bytes"] <= 1.1 * r["checkpoint_bytes"] + (512 << 20))
    # The table on stdout holds the same rows.
    table = done.stdout.splitlines()
    for r in rows:
        line = next(ln for ln in table if ln.startswith(r["command"] + " "))
        assert line.split()[1] == "0"
    index = json.loads((workdir / "target" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (workdir / "trtllm").is_dir()


def test_long_context_rows_run_both_runtimes(tmp_path):
    """long-reference and long-onnxruntime: one `--context`-token prompt on the reference and on the
    export-onnx folder, measured like the others; they run only when named."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--context", "200", "--commands",
                           "long-onnxruntime,export-onnx,long-reference", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["command"] for r in rows] == ["export-onnx", "long-reference", "long-onnxruntime"]
    for r in rows[1:]:
        assert r["exit"] == 0 and r["peak_rss_bytes"] > 0
        prompt = r["argv"][0][r["argv"][0].index("--prompt-ids") + 1]
        assert len(prompt.split(",")) == 200
        # fp32 keys and values, 204 positions: 3 target layers and 1 drafter layer of 2 KV heads x 16 dims
        assert r["kv_cache_bytes"] == 204 * (3 + 1) * 2 * 2 * 16 * 4
    assert rows[0]["kv_cache_bytes"] == 0 and done.stdout.count("the KV caches of its context") == 2
    assert "long-* at 200 prompt tokens" in done.stdout and "<=1.1x+512MiB" in done.stdout
    rs = _module()
    assert rs.parse_args([*TINY]).commands == list(rs.COMMANDS)


def test_layouts_read_back_as_written(tmp_path):
    """Every drafter layout the script writes is read back in that layout, with valid d2t/t2d,
    and fits its target."""
    from eagle31_export.config import compatibility_problems
    from eagle31_export.formats.drafter.checkpoint import read_drafter
    from eagle31_export.formats.target.checkpoint import check_target, read_target_info

    rs = _module()
    args = rs.parse_args([*TINY, "--eagle31", "--qwen3"])
    tcfg = rs.target_config(args)
    rs.write_target(tmp_path / "target", tcfg, 0, 10_000)
    check_target(tmp_path / "target", values=True)
    info = read_target_info(tmp_path / "target")
    assert info.model_type == "qwen3" and info.num_hidden_layers == 3
    for layout in rs.LAYOUTS:
        rs.write_drafter_folder(tmp_path / layout, rs.drafter_config(args, tcfg), layout, 0)
        ckpt = read_drafter(tmp_path / layout)  # strict: values, d2t and t2d checked
        assert ckpt.format == layout
        assert ckpt.config.fc_norm and ckpt.config.norm_output
        assert ckpt.config.resolved_aux_layer_ids(3) == (0, 1, 2)
        assert compatibility_problems(ckpt.config, info, None) == []


def test_bad_arguments_exit_2_with_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--commands", "inspect,bogus"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "bogus" in done.stderr


def test_full_depth_sizes_and_disk_refusal(tmp_path, capsys):
    """The 32-layer Llama-3.1-8B target is ~16 GB of bf16 (published: 16.06 GB); a folder without
    the room for it is refused in one line before anything is written."""
    rs = _module()
    args = rs.parse_args(["--target-layers", "32"])
    assert rs.specs_bytes(rs.target_specs(rs.target_config(args))) == 16_060_522_496
    assert rs.tapped_layers(32) is None  # EAGLE-3's default taps (1, 15, 28), as published drafters leave them
    with pytest.raises(SystemExit) as exit_info:
        rs.check_disk(tmp_path, 1 << 60)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_a_command_past_the_rss_cap_is_killed(tmp_path):
    rs = _module()
    hog = [sys.executable, "-c", "import time; x = bytearray(400 << 20); time.sleep(30)"]
    row = rs.measure("hog", [hog], 1 << 30, tmp_path, timeout=60, rss_cap=200 << 20)
    assert row.exit != 0 and "killed: RSS passed the cap" in row.error and row.wall_s < 30
    assert not row.meets_target  # a failed command meets no rule
