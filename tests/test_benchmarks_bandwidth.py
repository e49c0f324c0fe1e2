"""benchmarks/bandwidth_bound.py: the bytes a step reads, counted from safetensors headers written
here (known shapes, so known bytes), and the bound speedup.py prints; speedup.py's pair and prompts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
FP32 = 4


def _module(name: str):
    sys.path.insert(0, str(BENCHMARKS))  # speedup.py imports its neighbours by name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bound = _module("bandwidth_bound")


def _write(folder: Path, tensors: dict, name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name))
    return folder


def _target(folder: Path, tied: bool = True) -> Path:
    """A 10-token vocabulary, hidden 4: one layer's weight stored bf16 (served fp32), a norm, a
    non-weight integer tensor."""
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 4),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(4),
               "model.rotary.positions": torch.zeros(7, dtype=torch.int64)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(10, 4)
    return _write(folder, tensors)


LAYER_AND_NORM = (6 * 4 + 4) * FP32
ROW = 4 * FP32


def test_tied_target_reads_the_embedding_once_as_lm_head_and_one_row(tmp_path):
    target = _target(tmp_path / "target")
    assert bound.target_bytes_per_forward(target) == 10 * 4 * FP32 + ROW + LAYER_AND_NORM


def test_untied_target_reads_its_lm_head_and_one_embedding_row(tmp_path):
    target = _target(tmp_path / "target", tied=False)
    assert bound.target_bytes_per_forward(target) == 10 * 4 * FP32 + ROW + LAYER_AND_NORM


def test_weights_are_counted_at_the_served_width(tmp_path):
    target = _target(tmp_path / "target")
    half = 10 * 4 * 2 + 4 * 2 + (6 * 4 + 4) * 2
    assert bound.target_bytes_per_forward(target, served_bytes=2) == half


def test_every_shard_is_counted(tmp_path):
    folder = tmp_path / "sharded"
    _write(folder, {"model.embed_tokens.weight": torch.zeros(10, 4)}, "model-00001-of-00002.safetensors")
    _write(folder, {"model.norm.weight": torch.zeros(4)}, "model-00002-of-00002.safetensors")
    assert bound.target_bytes_per_forward(folder) == 10 * 4 * FP32 + ROW + 4 * FP32


def test_a_draft_step_reads_the_drafter_and_one_target_embedding_row(tmp_path):
    target = _target(tmp_path / "target")
    drafter = _write(tmp_path / "drafter", {
        "fc.weight": torch.zeros(4, 12, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
        "norm.weight": torch.zeros(4, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(3, 4, dtype=torch.bfloat16),  # the draft vocabulary: 3 tokens
        "d2t": torch.zeros(3, dtype=torch.int64),  # index maps: looked up, not streamed
        "t2d": torch.zeros(10, dtype=torch.bool)})
    own = (4 * 12 + 4 * 8 + 4 + 3 * 4) * FP32
    assert bound.drafter_bytes_per_step(drafter, target) == own + ROW


def test_a_folder_without_safetensors_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        bound.target_bytes_per_forward(tmp_path)


def test_the_bound_is_tau_for_a_free_drafter_and_falls_as_drafting_costs():
    assert bound.speedup_bound(2.5, t_target=0.02, t_draft=0.0, depth=3) == pytest.approx(2.5)
    assert bound.speedup_bound(2.0, t_target=1.0, t_draft=0.1, depth=5) == pytest.approx(2.0 / 1.5)
    deeper = [bound.speedup_bound(2.0, 1.0, 0.1, d) for d in (1, 3, 5)]
    assert deeper == sorted(deeper, reverse=True)


def test_the_measured_bandwidth_is_the_bytes_read_over_the_best_time(monkeypatch):
    """Three timed reads of 1/64 GiB taking 0.5, 0.25 and 0.4 s (a clock that says so): the rate is the
    tensor's bytes over the fastest, 2^24 / 0.25 B/s, not the slowest, the mean, or the bytes of a
    wrongly sized tensor."""
    clock = iter([0.0, 0.5, 10.0, 10.25, 20.0, 20.4])
    monkeypatch.setattr(bound.time, "perf_counter", lambda: next(clock))
    assert bound.measure_bandwidth(gib=1 / 64, repeats=3) == pytest.approx((1 << 30) / 64 / 0.25)


def test_speedup_names_an_example_pair_and_its_drafters():
    speedup = _module("speedup")
    models = ROOT / "examples" / "smollm2" / "models"
    assert speedup.resolve_pair(Path("smollm2")) == models
    assert speedup.resolve_pair(models) == models
    assert speedup.in_pair(models, Path("drafter-eagle3"), "drafter-eagle31") == models / "drafter-eagle3"
    assert speedup.in_pair(models, None, "drafter-eagle31") == models / "drafter-eagle31"
    with pytest.raises(SystemExit):
        speedup.resolve_pair(Path("no-such-pair"))


def test_a_pairs_own_prompts_are_cycled_through(tmp_path):
    speedup = _module("speedup")
    pair = tmp_path / "pair"
    pair.mkdir()
    prompts = [[1, 2, 3], [4, 5], [6]]
    (pair / "held_out_prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    got, what = speedup.pair_prompts(pair, ROOT / "examples" / "tiny" / "models" / "target", 7)
    assert got == [prompts[0], prompts[1], prompts[2], prompts[0], prompts[1], prompts[2], prompts[0]]
    assert "3 prompts" in what
