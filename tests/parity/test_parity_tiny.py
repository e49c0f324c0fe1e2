"""Acceptance parity on the tiny TRAINED pair (examples/tiny): ONNX Runtime vs the PyTorch
reference for both drafters on bf16 and NVFP4 targets, the pair's quality floor, and the four
export bugs users hit in practice, each caught by `parity` with exit code 1 and its symptom."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from eagle31_export.errors import CheckpointError
from eagle31_export.export.onnx_export import export_onnx
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from pathlib import Path

from eagle31_export.demo.pair import DRAFTERS, TARGET, TARGET_NVFP4, EmbeddedPair
from eagle31_export.parity.acceptance import tau_by_depth
from eagle31_export.runtime.registry import PairSource, load_speculator

from sabotage import drop_fc_norm, pre_norm_feedback, shift_aux_ids

PAIR = EmbeddedPair.open(Path(__file__).resolve().parents[2] / "examples" / "tiny" / "models")
MODELS = PAIR.folder
EAGLE31 = MODELS / DRAFTERS["EAGLE 3.1"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PAIR.held_out_prompts(48)[:4]))
    return path


def _parity(cli, prompts, out, *args):
    code, _, err = cli("parity", *args, "--prompts", prompts, "--depth", "3", "--max-new-tokens", "16", "--out", out)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return code, report, err


def test_quality_floor_eagle31_depth3():
    reference = load_speculator("reference", PairSource.of(EAGLE31, MODELS / TARGET))
    tau = tau_by_depth(reference, PAIR.held_out_prompts(64)[:8], [3], 32)[3]
    assert tau >= 2.2, f"EAGLE 3.1 tiny drafter tau@3 = {tau:.3f} on held-out files"


@pytest.mark.parametrize("target", [TARGET, TARGET_NVFP4])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS.values()))
def test_onnxruntime_matches_reference(cli, tmp_path, prompts_file, target, drafter):
    code, report, err = _parity(cli, prompts_file, tmp_path / "report", "--drafter", MODELS / drafter,
                                "--target", MODELS / target, "--runtime", "onnxruntime")
    assert code == 0 and report["passed"], (err, report and report["failures"])
    assert report["exact_comparison"] is True
    rows = report["prompts"]
    assert all(r["tokens_identical"] and r["drafts_identical"] and r["accepted_identical"] for r in rows)
    assert report["tau_reference"] > 1.5  # a trained pair: the comparison covers accepted drafts
    assert max(r["first_logits_max_abs_diff"] for r in rows) < 1e-3


def test_sampling_parity_is_statistical_and_passes(cli, tmp_path, prompts_file):
    bundle = export_onnx(EAGLE31, tmp_path / "onnx", MODELS / TARGET)
    code, report, err = _parity(cli, prompts_file, tmp_path / "report", bundle, "--runtime", "onnxruntime",
                                "--temperature", "0.8")
    assert code == 0 and report["passed"], (err, report and report["failures"])
    assert report["temperature"] == 0.8


def _broken_bundle(tmp_path, bug):
    ckpt = read_drafter(EAGLE31)
    sabotaged = {"shifted_ids": lambda c: shift_aux_ids(c, 8), "pre_norm": pre_norm_feedback,
                 "no_fc_norm": drop_fc_norm}[bug](ckpt)
    drafter = write_drafter(sabotaged, tmp_path / "broken-drafter", "specforge")
    return export_onnx(drafter, tmp_path / "onnx", MODELS / TARGET)


@pytest.mark.parametrize("bug,symptom", [
    ("shifted_ids", "first-step draft logits differ"),
    ("pre_norm", "first-step drafts agree, later drafts differ: fed-back state"),
    ("no_fc_norm", "first-step draft logits differ"),
])
def test_broken_drafter_export_is_caught(cli, tmp_path, prompts_file, bug, symptom):
    bundle = _broken_bundle(tmp_path, bug)
    code, report, _ = _parity(cli, prompts_file, tmp_path / "report", bundle, "--drafter", EAGLE31,
                              "--target", MODELS / TARGET, "--runtime", "onnxruntime")
    assert code == 1 and report["passed"] is False
    assert report["mode"] == "replay"  # greedy parity's default: one reference target forward per prompt
    assert any(symptom in f for f in report["failures"]), report["failures"]
    assert symptom.split(":")[0] in (tmp_path / "report" / "report.md").read_text()


def test_inverted_nvfp4_global_scale_is_refused_before_export(tmp_path):
    """compressed-tensors stores 1/weight_scale_2; a converter that forgets to invert it writes a target
    that still builds. Both sides of a parity run would read the same file, so the file itself is
    checked: the export refuses it (docs/nvfp4.md, "Global scales stored in the wrong convention").
    A reader that inverts wrongly on one side only fails parity: tests/test_vllm_nvfp4.py."""
    broken = tmp_path / "target-nvfp4-inverted"
    shutil.copytree(MODELS / TARGET_NVFP4, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    inverted = {k: (1.0 / v if k.endswith("weight_scale_2") else v) for k, v in tensors.items()}
    assert sum(k.endswith("weight_scale_2") for k in inverted) > 10
    save_file(inverted, str(broken / "model.safetensors"))
    (broken / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="looks written as its reciprocal"):
        export_onnx(EAGLE31, tmp_path / "onnx", broken)
    assert not (tmp_path / "onnx").exists()


def test_replay_and_autoregressive_parity_agree(tmp_path):
    """Replay (one reference target forward per prompt) and autoregressive parity reach the same verdict;
    the replayed reference drafts equal the reference loop's own, round by round."""
    from eagle31_export.parity.compare import run_parity

    prompts = PAIR.held_out_prompts(48)[:4]
    reference = load_speculator("reference", PairSource.of(EAGLE31, MODELS / TARGET))
    faithful = load_speculator("onnxruntime", PairSource.of(EAGLE31, MODELS / TARGET, export_onnx(
        EAGLE31, tmp_path / "onnx", MODELS / TARGET)))
    broken = load_speculator("onnxruntime", PairSource.of(EAGLE31, MODELS / TARGET, _broken_bundle(
        tmp_path / "broken", "pre_norm")))
    for runtime, passes in ((faithful, True), (broken, False)):
        reports = {mode: run_parity(reference, runtime, prompts, 3, 16, mode=mode)
                   for mode in ("replay", "autoregressive")}
        assert reports["replay"].passed is reports["autoregressive"].passed is passes
        replay, loop = (reports[m].rows for m in ("replay", "autoregressive"))
        assert [r.symptom for r in replay] == [r.symptom for r in loop]
        assert all(r.target_forwards_reference == 1 for r in replay)
        assert all(r.target_forwards_reference == 1 + r.rounds_reference > 2 for r in loop)
    for prompt in prompts:
        run = faithful.run(prompt, 16, 3)
        own = reference.run(prompt, 16, 3)
        replayed = reference.replay(prompt, run)
        assert (replayed.tokens, replayed.drafts, replayed.accepted_per_step) == (own.tokens, own.drafts,
                                                                                  own.accepted_per_step)


def test_replay_in_turn_holds_one_side_at_a_time(tmp_path):
    """`parity`'s greedy default releases the runtime before the reference loads (a target that fits once
    is enough), and reaches the same rows as running both sides side by side, faithful or sabotaged."""
    import gc
    import weakref

    from eagle31_export.parity.compare import run_parity, run_parity_in_turn

    prompts = PAIR.held_out_prompts(48)[:3]
    bundles = {True: export_onnx(EAGLE31, tmp_path / "onnx", MODELS / TARGET),
               False: _broken_bundle(tmp_path / "broken", "pre_norm")}
    for passes, bundle in bundles.items():
        alive = []

        def load_runtime():
            runtime = load_speculator("onnxruntime", PairSource.of(EAGLE31, MODELS / TARGET, bundle))
            alive.append(weakref.ref(runtime.drafter))
            return runtime

        def load_reference():
            gc.collect()
            assert alive[0]() is None, "the runtime is still held while the reference loads"
            return load_speculator("reference", PairSource.of(EAGLE31, MODELS / TARGET))

        in_turn = run_parity_in_turn(load_runtime, load_reference, prompts, 3, 16)
        together = run_parity(load_reference(), load_runtime(), prompts, 3, 16, mode="replay",
                              per_depth_positions=0)
        assert in_turn.passed is together.passed is passes
        assert [r.__dict__ for r in in_turn.rows] == [r.__dict__ for r in together.rows]
        assert set(in_turn.per_depth) == {"positions_per_prompt", "reference", "runtime"}
        assert list(in_turn.timings)[:2] == ["load_runtime", "runtime"]
