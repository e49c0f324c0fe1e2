"""NVFP4 targets in a real engine: vLLM's CPU build loads the targets `quantize` and `convert` write
with its own loaders (`modelopt_fp4`, compressed-tensors' W4A4 NVFP4 scheme) and computes them with
its own emulation kernel, which our vLLM plugin (plugins/vllm, installed by `make setup-vllm`) lists
for the CPU platform. Parity compares it with the W4A4 reference reading scales as vLLM does
(docs/nvfp4-engines.md), without being told: the engine quantizes activations where the target's
quantization config gives input scales, and the reference follows (runtime/vllm_runtime.py:
served_activations).

- fp32 (compressed-tensors targets; vLLM's `modelopt_fp4` takes bf16/fp16 only): identical but for
  ties an FP4 activation rounding within fp32's error of its boundary explains (docs/runtimes.md, "FP4
  roundings in fp32": one such tie seen on a CI machine, none where the suite was written).
- bf16 (ModelOpt targets): every difference a numerical tie the measured bf16 + FP4-activation error
  explains (parity/numerics.py), and no more of them than it explains.
- One-sided sabotages, patched in the test process only (the reference side; the engine reads the
  file with its own code): parity must fail with the target-side symptom.

One engine per parity run (15-40 s to start on 2 cores).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from eagle31_export.formats.nvfp4 import model as nvfp4_model, reader as nvfp4_reader
from eagle31_export.formats.nvfp4.convert import convert_checkpoint
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.reference import target as reference_target
from eagle31_export.runtime.vllm_engine import find_vllm
from eagle31_export.errors import UserError
from eagle31_export.parity.report import markdown
from test_vllm_engine import (  # noqa: F401  (vllm: a fixture)
    DRAFTER31, TARGET, TINY, assert_faithful_half_precision_pass, assert_not_vacuous, parity, parity_on, served, vllm,
)
from sabotage import reciprocal_global_scales, transpose_block_scales  # noqa: E402  (tests/parity, on the path)

TARGET_SYMPTOM = "the target's own"


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    """The four tiny NVFP4 targets: the ModelOpt example, its compressed-tensors conversion, and
    `quantize` output of the BF16 target in both formats."""
    root = tmp_path_factory.mktemp("nvfp4-targets")
    return {"modelopt": TINY / "target-nvfp4",
            "modelopt-to-ct": convert_checkpoint(TINY / "target-nvfp4", root / "modelopt-to-ct", "compressed-tensors"),
            "quantized-ct": quantize_checkpoint(TARGET, root / "quantized-ct", "compressed-tensors").out,
            "quantized-modelopt": quantize_checkpoint(TARGET, root / "quantized-modelopt", "modelopt").out}


def nvfp4_parity(vllm, target, dtype=None):
    """No --act-quant: the reference learns from the engine that it quantizes activations (the local
    engine this run starts)."""
    return parity(vllm, None, DRAFTER31, target=target, runtime_options={"dtype": dtype} if dtype else {})


def shared_nvfp4_parity(vllm, vllm_servers, target):
    """The suite's shared fp32 server of the NVFP4 target's bundle, reached with --url: the reference follows
    the target's quantization config (the server does not say which kernel it runs)."""
    return parity_on(vllm, served(vllm_servers, DRAFTER31, target), DRAFTER31, target=target)


@pytest.mark.parametrize("name", ["modelopt-to-ct", "quantized-ct"])
def test_compressed_tensors_targets_in_fp32_differ_by_fp4_rounding_ties_only(vllm, vllm_servers, targets, name):
    """Shared servers reached with --url (a local engine parity starts: the bf16 tests below). fp32 with FP4
    activations is not bit-comparable across machines: an activation within fp32's error of an FP4
    rounding boundary may round either way (one did on a 2-core CI machine, moving a token 7 decisions
    later by 0.09 logits), so the float64 measurement takes every such rounding the other way
    (parity/numerics.py: FP4_ROUNDING_BAND) and every difference must be a tie it explains."""
    report = shared_nvfp4_parity(vllm, vllm_servers, targets[name])
    assert report.passed, report.failures
    assert report.activations["fp4"] and report.thresholds.fp4_activations
    assert report.activations["basis"] == "config", report.activations
    assert report.exact and report.ties_judged and all(not r.untied for r in report.rows)
    assert "FP4 roundings within" in report.numerics["precision"], report.numerics
    budget = report.tie_budget
    assert budget is not None and budget.observed <= budget.allowed, budget
    differing = [r for r in report.rows if not (r.tokens_identical and r.accepted_identical)]
    assert all(r.ties for r in differing)  # every differing prompt is explained by its listed ties
    assert_not_vacuous(report)


# its own engines: the local engine parity starts, whose FP4 activations the report takes as set
@pytest.mark.parametrize("name", ["modelopt", "quantized-modelopt"])
def test_modelopt_targets_differ_by_numerical_ties_only_in_bf16(vllm, targets, name):
    """The documented command, no activation flag: vLLM's CPU build feeds FP4 activations to every NVFP4
    Linear, the reference computes the same, and the report says how it learned it."""
    report = nvfp4_parity(vllm, targets[name], torch.bfloat16)
    assert_faithful_half_precision_pass(report)
    assert report.thresholds.fp4_activations and report.numerics["precision"] == "bfloat16 + FP4 activations"
    assert report.activations["fp4"] and report.activations["basis"] == "set", report.activations
    assert "EmulationNvFp4LinearKernel" in report.activations["how"] and "modelopt" in report.activations["how"]
    assert "activations compared: FP4 (NVFP4, W4A4), set: the local engine this run started" in markdown(report)
    differing = [r for r in report.rows if not (r.tokens_identical and r.accepted_identical)]
    assert all(r.ties for r in differing)  # every differing prompt is explained by its listed ties
    # the PASS names what bf16 with FP4 activations cannot exclude; with every draft compared (our plugin's
    # log) not the taps and rope_theta bugs that accepted counts alone may not tell (docs/runtimes.md)
    named = " ".join(report.not_excluded)
    assert report.drafts_reported and all(not r.untied for r in report.rows)
    assert all(bug in named for bug in ("fc scaled by 1.05", "1 / input_scale")) and "rope_theta" not in named, named


def test_an_activation_flag_the_engine_contradicts_is_refused(vllm, targets):
    """The local engine quantizes this target's activations: --no-act-quant is refused before it starts."""
    with pytest.raises(UserError, match="quantizes the target's activations.*drop --no-act-quant"):
        parity(vllm, None, DRAFTER31, target=targets["modelopt"], act_quant=False,
               runtime_options={"dtype": torch.bfloat16})


@pytest.fixture
def fresh_reference(monkeypatch):
    """No reference target loaded before the patch is reused (reference.target caches loaded models)."""
    monkeypatch.setattr(reference_target, "_LOADED", {})
    return monkeypatch


def test_global_scale_read_without_its_reciprocal_fails_on_the_target(vllm, vllm_servers, targets, fresh_reference):
    """Our reader taking compressed-tensors' weight_global_scale as if it were ModelOpt's weight_scale_2
    (the engine is the faithful one the test above shares)."""
    fresh_reference.setattr(nvfp4_reader, "exact_inverse", lambda stored, recorded, semantics: stored)
    report = shared_nvfp4_parity(vllm, vllm_servers, targets["modelopt-to-ct"])
    assert not report.passed
    assert any(TARGET_SYMPTOM in f for f in report.failures), report.failures


def test_w4a4_reference_ignoring_input_scale_fails_on_the_target(vllm, vllm_servers, targets, fresh_reference):
    """Our W4A4 reference quantizing activations with global scale 1 instead of 1 / input_scale (the engine is
    the faithful one shared above)."""
    quantize = nvfp4_model.fake_quant_activation
    fresh_reference.setattr(nvfp4_model, "fake_quant_activation", lambda x, global_scale: quantize(x, 1.0))
    report = shared_nvfp4_parity(vllm, vllm_servers, targets["quantized-ct"])
    assert not report.passed
    assert any(TARGET_SYMPTOM in f for f in report.failures), report.failures


# its own engine: vLLM's offline LLM over damaged checkpoints (one refuses to load)
def test_what_vllm_does_with_a_damaged_checkpoint(vllm, tmp_path):
    """Checkpoint sabotages both sides would read alike (inspect and every loader of ours refuse them:
    tests/test_target_nvfp4_errors.py). vLLM 0.32: global scales written as their reciprocals load and
    decode without a word, other tokens at finite log-probabilities; block scales stored transposed stop
    the engine at its shape check (docs/nvfp4-engines.md)."""
    intact, reciprocal, transposed = (tmp_path / n for n in ("intact", "reciprocal", "transposed"))
    for folder in (intact, reciprocal, transposed):
        shutil.copytree(TINY / "target-nvfp4", folder)
    reciprocal_global_scales(reciprocal)
    transpose_block_scales(transposed)
    python = find_vllm(vllm).python
    done = subprocess.run([str(python), str(Path(__file__).parent / "vllm_generate.py"), "bfloat16",
                           str(intact), str(reciprocal), str(transposed)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 3, done.stderr[-2000:]
    good, silent, refused = results
    assert "tokens" in good and "tokens" in silent, results
    assert silent["tokens"] != good["tokens"] and all(math.isfinite(p) for p in silent["logprobs"])
    assert "AssertionError" in refused["error"] and refused["raised_in"].startswith("model_executor/"), refused
