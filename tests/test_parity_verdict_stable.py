"""The verdict under load does not depend on thread timing: parity at C = 16 on the batched ONNX Runtime
runtime, five times in a row over the same loaded pair, gives the same verdict, the same rows and the same
per-prompt results each time (batch composition varies with timing; batched logits differ from
single-sequence ones in their last bits, which the tie-aware comparison tells from bugs)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31_export.formats.target.checkpoint import read_target_info
from eagle31_export.parity.compare import run_parity
from eagle31_export.parity.prompts import default_prompts
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator

PAIR = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"
RUNS = 5


def test_parity_at_c16_five_times_in_a_row_gives_one_verdict(tmp_path):
    source = PairSource.of(PAIR / "drafter-eagle31", PAIR / "target")
    reference = load_speculator("reference", source, LoadOptions(dtype=torch.float32))
    runtime = load_speculator("onnxruntime", source, LoadOptions(dtype=torch.float32), workdir=tmp_path)
    prompts = default_prompts(read_target_info(PAIR / "target").vocab_size, 16)
    seen = []
    for _ in range(RUNS):
        report = run_parity(reference, runtime, prompts, depth=3, max_new_tokens=16, per_depth_positions=0,
                            concurrency=(1, 16))
        level = report.concurrency[1]
        seen.append((report.verdict, tuple(report.failures), level.tied_prompts, level.differing_prompts,
                     level.accepted_per_position))
        assert level.batching is not None and level.batching["largest"] == 16, level.batching
    assert seen[0][0] == "PASS", seen[0]
    assert seen == [seen[0]] * RUNS
