"""`diagnose`: per-depth agreement, fed-back RMS, attention mass and entropy, teacher-forced on the
target's own continuation. Each quantity is checked against a direct computation or an exact property:
post-norm feedback has the final norm weight's RMS at every depth, the recorded attention probabilities
are the ones the attention output applies, agreement equals the training-time-test chain's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from factories import drafter_config_for, greedy_decode, random_drafter
from parity.sabotage import pre_norm_feedback
from eagle31_export.demo.pair import DRAFTERS, EmbeddedPair
from eagle31_export.errors import UserError
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, write_drafter
from eagle31_export.parity.acceptance import teacher_forced_agreement
from eagle31_export.parity.diagnose import (DepthRow, DiagnoseReport, FcInput, diagnose, diagnose_speculator,
                                            verdict)
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.pair import load_pair
from eagle31_export.reference.target import tapped_forward
from eagle31_export.runtime.reference_runtime import ReferenceSpeculator

TINY = EmbeddedPair.open(Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models")
NORM_SCALE = 2.5
PROMPTS = [[5, 17, 3, 99, 42, 7], [200, 1, 64, 9, 31]]
DEPTH, POSITIONS = 4, 6


def with_constant_final_norm(ckpt: DrafterCheckpoint, scale: float = NORM_SCALE) -> DrafterCheckpoint:
    tensors = dict(ckpt.tensors)
    tensors["norm.weight"] = torch.full_like(tensors["norm.weight"], scale)
    return DrafterCheckpoint(ckpt.config, tensors)


def speculator(ckpt, target, dtype=torch.float32) -> ReferenceSpeculator:
    return ReferenceSpeculator(load_pair(ckpt, target, dtype=dtype), exact=True)


def run(ckpt, target, prompts=PROMPTS, depth=DEPTH, positions=POSITIONS, **kw) -> DiagnoseReport:
    return diagnose_speculator(speculator(ckpt, target), prompts, depth, positions, **kw)


@pytest.fixture(scope="module")
def faithful(eagle31_ckpt):
    return with_constant_final_norm(eagle31_ckpt)


@pytest.fixture(scope="module")
def faithful_report(faithful, llama_target):
    return run(faithful, llama_target)


def test_post_norm_feedback_stays_at_the_norm_scale_while_pre_norm_feedback_grows(faithful, faithful_report,
                                                                                    llama_target):
    # RMS(c * x / rms(x)) == |c| (up to eps) for every token: a property of norm_output, exact at every depth
    for row in faithful_report.rows:
        assert row.post_norm_rms == pytest.approx(NORM_SCALE, rel=1e-5)
        assert row.fed_back_rms == row.post_norm_rms
        assert row.fed_back_rms_rel == pytest.approx(1.0, rel=1e-5)
    assert not any("fed-back" in s for s in faithful_report.symptoms)
    assert "fed-back state RMS stays flat (1.00x from depth 1 to 4, post-norm feedback)" in faithful_report.verdict

    sabotaged = run(pre_norm_feedback(faithful), llama_target)
    fed = sabotaged.column("fed_back_rms")
    assert sabotaged.column("pre_norm_rms") == fed  # what is fed back is the pre-norm h
    assert all(b > a for a, b in zip(fed, fed[1:])), fed  # the residual path accumulates, depth after depth
    assert fed[-1] / fed[0] > 1.25
    assert [r.post_norm_rms for r in sabotaged.rows] == pytest.approx([NORM_SCALE] * DEPTH, rel=1e-5)
    assert sabotaged.drifts and sabotaged.verdict[0].startswith("drift: fed-back state RMS grows")
    # depth 1 reads the same taps on both sides: identical up to the first feedback
    assert sabotaged.rows[0].agreement == faithful_report.rows[0].agreement
    assert sabotaged.rows[0].pre_norm_rms == pytest.approx(faithful_report.rows[0].pre_norm_rms, rel=1e-6)


def test_per_source_fc_input_rms_is_the_rms_of_the_tapped_states(faithful, faithful_report, llama_target):
    pair = load_pair(faithful, llama_target)
    ht = faithful.config.effective_target_hidden_size
    sums, into, count = [0.0] * 3, [0.0] * 3, 0
    for prompt in PROMPTS:
        seq = prompt + greedy_decode(pair.target, prompt, POSITIONS + DEPTH - 1)
        _, taps = tapped_forward(pair.target, torch.tensor([seq]))
        anchors = taps[0, len(prompt) - 1:len(prompt) - 1 + POSITIONS]
        for i in range(3):
            source = anchors[:, i * ht:(i + 1) * ht].double()
            sums[i] += float(source.pow(2).mean(-1).sqrt().sum())
            w = faithful.tensors[f"fc_norm.{i}.weight"].double()
            normed = w * source / source.pow(2).mean(-1, keepdim=True).add(faithful.config.rms_norm_eps).sqrt()
            into[i] += float(normed.pow(2).mean(-1).sqrt().sum())
        count += POSITIONS
    fc = faithful_report.fc_input
    assert fc.aux_layer_ids == list(pair.aux_layer_ids)
    assert fc.rms == pytest.approx([s / count for s in sums], rel=1e-5)
    assert fc.rms_into_fc == pytest.approx([s / count for s in into], rel=1e-5)
    assert fc.normalised_by == "fc_norm"
    assert fc.imbalance == pytest.approx(max(fc.rms) / min(fc.rms))


def test_attention_masses_partition_the_keys(faithful_report, faithful, llama_target):
    for row in faithful_report.rows:
        masses = (row.attention_sink, row.attention_prompt, row.attention_continuation, row.attention_drafted)
        assert all(0.0 <= m <= 1.0 for m in masses)
        assert row.attention_sink <= row.attention_prompt  # 4 sinks, prompts of >= 5 tokens
        assert row.attention_prompt + row.attention_continuation + row.attention_drafted == pytest.approx(1.0,
                                                                                                          abs=1e-9)
    assert faithful_report.rows[0].attention_drafted == 0.0  # depth 1 has drafted nothing yet
    assert all(r.attention_drafted > 0 for r in faithful_report.rows[1:])
    # every key a sink: sink mass is everything but nothing; no sinks: none
    everything = run(faithful, llama_target, num_sinks=10_000)
    for row in everything.rows:
        assert row.attention_sink == pytest.approx(1.0, abs=1e-9)
    assert all(r.attention_sink == 0.0 for r in run(faithful, llama_target, num_sinks=0).rows)


@pytest.mark.parametrize("mla", [False, True])
def test_recorded_probabilities_are_the_ones_attention_applies(llama_info, mla):
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, mla=mla)
    attn = build_drafter(random_drafter(cfg, seed=2, with_embeddings=True)).layers[0].self_attn
    x = torch.randn(1, 5, 2 * cfg.hidden_size)
    cache, seen = KVCache(), {}
    with torch.no_grad():
        attn(x[:, :3], torch.arange(3).unsqueeze(0), cache)
        plain = attn(x[:, 3:], torch.arange(3, 5).unsqueeze(0), _copy(cache))
        cache.recorder = lambda layer, probs: seen.setdefault(layer, probs)
        out = attn(x[:, 3:], torch.arange(3, 5).unsqueeze(0), cache)
    assert torch.equal(out, plain)  # recording changes nothing
    probs = seen[0]
    assert probs.shape == (1, cfg.num_attention_heads, 2, 5)
    assert probs[0, :, 0, 4].abs().max() == 0  # causal: the 4th position does not see the 5th
    values = cache.values[0].double()
    if values.shape[1] != probs.shape[1]:
        values = values.repeat_interleave(probs.shape[1] // values.shape[1], dim=1)
    mixed = (probs @ values).transpose(1, 2).reshape(1, 2, -1)
    torch.testing.assert_close(attn.o_proj(mixed.float()), out, rtol=1e-5, atol=1e-5)


def _copy(cache: KVCache) -> KVCache:
    other = KVCache()
    other.keys, other.values = list(cache.keys), list(cache.values)
    return other


@pytest.mark.parametrize("drafter", sorted(DRAFTERS.values()))
def test_agreement_per_depth_equals_the_teacher_forced_chain(drafter):
    """On the tiny trained pair (agreement far from 0 and 1, and position-sensitive). One-token prompts
    put the first anchor at position 0, where `teacher_forced_agreement` starts."""
    tokenizer = TINY.tokenizer()
    prompts, depth, positions = [tokenizer("def")["input_ids"][:1], tokenizer("import")["input_ids"][:1]], 4, 12
    spec = ReferenceSpeculator(load_pair(TINY.folder / drafter, TINY.target, dtype=torch.float64), exact=True)
    report = diagnose_speculator(spec, prompts, depth, positions)
    sequences = [p + greedy_decode(spec.pair.target, p, positions + depth - 1) + [0] for p in prompts]
    want = teacher_forced_agreement(spec.pair, sequences, depth)
    assert want.positions == report.positions == len(prompts) * positions
    assert report.column("agreement") == want.per_position
    assert all(0.2 < a < 1 for a in want.per_position[1:]), want.per_position  # a check with teeth
    acceptance = report.column("acceptance")
    assert acceptance[0] == want.per_position[0]
    assert all(b <= a for a, b in zip(acceptance, acceptance[1:]))
    assert report.tau_estimate == pytest.approx(1 + sum(acceptance))


def test_entropy_is_that_of_the_draft_distribution(faithful, llama_target):
    spec = speculator(faithful, llama_target)
    report = diagnose_speculator(spec, [PROMPTS[0]], 1, 3)
    seq = PROMPTS[0] + greedy_decode(spec.pair.target, PROMPTS[0], 3)
    _, taps = tapped_forward(spec.pair.target, torch.tensor([seq]))
    p = len(PROMPTS[0])
    with torch.no_grad():
        step = spec.pair.drafter.drafter(torch.tensor([seq[1:p + 3]]), torch.arange(p + 2).unsqueeze(0),
                                         taps[:, :p + 2], KVCache(), True)
    logp = torch.log_softmax(step.logits[0, p - 1:].double(), -1)
    assert report.rows[0].entropy == pytest.approx(float(-(logp.exp() * logp).sum(-1).mean()), rel=1e-6)


def test_mla_and_two_layer_drafters(llama_info, llama_target):
    mla = with_constant_final_norm(random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True,
                                                                     mla=True), seed=6))
    report = run(mla, llama_target)
    assert report.attention == "mla"
    assert [r.post_norm_rms for r in report.rows] == pytest.approx([NORM_SCALE] * DEPTH, rel=1e-5)
    for row in report.rows:
        assert row.attention_prompt + row.attention_continuation + row.attention_drafted == pytest.approx(1, abs=1e-9)
    two = run(random_drafter(drafter_config_for(llama_info, num_layers=2), seed=7), llama_target)
    for row in two.rows:
        assert len(row.attention_by_layer) == 2
        for layer in row.attention_by_layer:
            assert layer["prompt"] + layer["continuation"] + layer["drafted"] == pytest.approx(1, abs=1e-9)
        assert row.attention_drafted == pytest.approx(sum(la["drafted"] for la in row.attention_by_layer) / 2)


def test_every_format_reads_into_the_same_diagnosis(tmp_path, eagle31_ckpt, llama_target):
    reports = [diagnose(write_drafter(eagle31_ckpt, tmp_path / fmt, fmt), llama_target, prompts=PROMPTS,
                        depth=3, positions=4) for fmt in ("eagle", "specforge", "speculators")]
    first = reports[0].to_json()
    for other in reports[1:]:
        assert {k: v for k, v in other.to_json().items() if k != "drafter"} == {
            k: v for k, v in first.items() if k != "drafter"}


def test_onnx_export_shows_what_its_graphs_expose(tmp_path, eagle31_dir, llama_target):
    from eagle31_export.export.onnx_export import export_onnx

    onnx = export_onnx(eagle31_dir, tmp_path / "onnx", llama_target)
    exported = diagnose(onnx, None, prompts=PROMPTS, depth=3, positions=4)  # the target from graphs.json
    reference = diagnose(eagle31_dir, llama_target, prompts=PROMPTS, depth=3, positions=4)
    assert exported.runtime == "onnxruntime" and reference.runtime == "reference"
    assert set(exported.unavailable) == {"attention", "pre_norm_rms", "fc_input.rms_into_fc"}
    assert reference.unavailable == {}
    for got, want in zip(exported.rows, reference.rows):
        assert got.attention_sink is None and got.attention_by_layer is None and got.pre_norm_rms is None
        assert got.agreement == want.agreement
        assert got.fed_back_rms == pytest.approx(want.fed_back_rms, rel=1e-4)
        assert got.post_norm_rms == pytest.approx(want.post_norm_rms, rel=1e-4)
        assert got.entropy == pytest.approx(want.entropy, rel=1e-4)
    assert exported.fc_input.rms == pytest.approx(reference.fc_input.rms, rel=1e-4)
    assert exported.fc_input.rms_into_fc is None
    assert exported.verdict[-1] == "not visible on onnxruntime: attention, pre_norm_rms, fc_input.rms_into_fc"
    data = exported.to_json()
    assert data["per_depth"][0]["attention_sink"] is None and "attention" in data["unavailable"]


def test_verdict_names_the_symptoms():
    def row(depth, sink, fed, agree):
        return DepthRow(depth, agree, agree, fed, fed, fed, fed, 1.0, 1.0, sink, 0.5, 0.3, 0.2, None, 2.0)

    report = DiagnoseReport("d", "t", "reference", "3", "gqa", False, False, 6, 4, 1, [8], 10,
                            [row(1, 0.41, 1.0, 0.8), row(6, 0.12, 3.4, 0.8)],
                            FcInput([1, 3, 4], [1.0, 2.0, 8.0], [1.0, 2.0, 8.0], None))
    symptoms, sentences = verdict(report)
    assert symptoms == [
        "fed-back state RMS grows 3.4x from depth 1 to 6 (pre-norm feedback)",
        "sink attention falls from 0.41 to 0.12",
        "tapped states enter fc at RMS 1/2/8 (8.0x apart) and nothing normalises them (no fc_norm): "
        "the largest dominates the fused input",
    ]
    assert sentences[0] == "drift: " + "; ".join(symptoms)
    report.rows = [row(1, 0.41, 1.0, 0.8), row(6, 0.40, 1.02, 0.79)]
    report.fc_input = FcInput([1, 3, 4], [1.0, 1.1, 1.2], None, "fc_norm")
    symptoms, sentences = verdict(report)
    assert symptoms == [] and sentences[0] == "no drift: the drafter holds up to depth 6"
    assert "fed-back state RMS stays flat (1.02x from depth 1 to 6, pre-norm feedback)" in sentences


@pytest.mark.parametrize("kwargs, message", [
    (dict(depth=0), "--depth must be >= 1"),
    (dict(positions=0), "--positions must be >= 1"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1], []]), "empty prompt"),
])
def test_bad_settings_are_user_errors(eagle31_dir, llama_target, kwargs, message):
    with pytest.raises(UserError, match=message):
        diagnose(eagle31_dir, llama_target, **{"prompts": PROMPTS, **kwargs})


def test_missing_inputs_are_user_errors(tmp_path, eagle31_dir, llama_target):
    with pytest.raises(UserError, match="no such drafter folder"):
        diagnose(tmp_path / "nope", llama_target, prompts=PROMPTS)
    with pytest.raises(UserError, match="no such target folder"):
        diagnose(eagle31_dir, tmp_path / "nope", prompts=PROMPTS)
    with pytest.raises(UserError, match="needs the target"):
        diagnose(eagle31_dir, None, prompts=PROMPTS)
    with pytest.raises(UserError, match="no such prompts file"):
        diagnose(eagle31_dir, llama_target, prompts_file=tmp_path / "nope.jsonl")


def test_command_draws_the_table_and_writes_json_and_plots(tmp_path, eagle3_dir, llama_target):
    from eagle31_export.cli import diagnose_cmd

    app = typer.Typer()
    app.callback()(lambda: None)
    diagnose_cmd.register(app)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    args = ["diagnose", "--drafter", str(eagle3_dir), "--target", str(llama_target), "--prompts", str(prompts),
            "--depth", "3", "--positions", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args, terminal_width=120)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "diagnose.json").read_text())
    assert [r["depth"] for r in data["per_depth"]] == [1, 2, 3] and data["positions"] == 8
    printed = " ".join(result.output.split())  # rich wraps long lines
    assert " ".join(data["verdict"][0].split()) in printed
    assert "agree" in printed and "attn" in printed and f"{data['tau_estimate']:.3f}" in printed
    for name in ("agreement_by_depth", "fed_back_rms_by_depth", "attention_by_depth", "entropy_by_depth",
                 "fc_input_rms", "diagnose"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert math.isclose(data["tau_estimate"], 1 + sum(r["acceptance"] for r in data["per_depth"]))
    assert (out / "manifest.json").is_file()  # written like every output: complete, or not at all
    again = CliRunner().invoke(app, args)
    assert isinstance(again.exception, UserError) and "--force" in str(again.exception)  # refused before the run
    bad = CliRunner().invoke(app, args[:-2] + ["--depth", "0"])
    assert isinstance(bad.exception, UserError) and "--depth must be >= 1" in str(bad.exception)


def test_parity_reports_both_sides_per_depth(tmp_path, faithful, llama_target):
    """A runtime feeding back the pre-norm state draws a growing RMS curve next to the reference's flat one."""
    from eagle31_export.parity.compare import run_parity
    from eagle31_export.parity.report import markdown, write_report

    reference, broken = speculator(faithful, llama_target), speculator(pre_norm_feedback(faithful), llama_target)
    report = run_parity(reference, broken, PROMPTS, 3, 8, per_depth_positions=POSITIONS)
    ref, run = report.per_depth["reference"], report.per_depth["runtime"]
    assert ref["fed_back_rms"] == pytest.approx([NORM_SCALE] * 3, rel=1e-5)
    assert all(b > a for a, b in zip(run["fed_back_rms"], run["fed_back_rms"][1:]))
    assert ref["agreement"][0] == run["agreement"][0]  # depth 1 does not read a fed-back state
    # the same measurement as `diagnose` (which generates the continuation step by step; parity forwards it whole)
    alone = diagnose_speculator(reference, PROMPTS, 3, POSITIONS)
    assert ref["agreement"] == alone.column("agreement")
    assert ref["fed_back_rms"] == pytest.approx(alone.column("fed_back_rms"), rel=1e-5)
    data = report.to_json()
    assert data["per_depth"]["runtime"]["fed_back_rms"] == run["fed_back_rms"] and "prompts" in data
    assert "## Per draft depth" in markdown(report)
    written = write_report(report, tmp_path / "report")
    assert tmp_path / "report" / "per_depth.png" in written
    assert run_parity(reference, broken, PROMPTS, 3, 8, per_depth_positions=0).per_depth is None


def test_a_side_without_visible_steps_says_so(faithful, llama_target):
    from eagle31_export.parity.diagnose import per_depth_sides
    from eagle31_export.runtime.registry import Speculator

    class Remote(Speculator):
        name = "triton"

    sides = per_depth_sides(speculator(faithful, llama_target), Remote(), PROMPTS[:1], 2, 2)
    assert "fed_back_rms" in sides["reference"]
    assert sides["runtime"] == {"unavailable": "the triton runtime runs whole generations; its per-step states are "
                                               "not visible"}
    with pytest.raises(UserError, match="runs whole generations"):
        diagnose_speculator(Remote(), PROMPTS, 2, 2)


def test_diagnose_from_a_capture_equals_diagnose_from_the_target(cli, tmp_path, eagle31_dir, llama_target):
    """A capture (the target's greedy continuations and taps, read instead of computed) gives the same
    diagnosis as the target folder: the path for targets larger than one machine."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    code, _, err = cli("capture", "--target", llama_target, "--drafter", eagle31_dir, "--prompts", prompts,
                       "--max-new-tokens", str(POSITIONS + DEPTH), "--depth", "1", "--out", tmp_path / "capture")
    assert code == 0, err
    from_target = diagnose(eagle31_dir, llama_target, prompts_file=prompts, depth=DEPTH, positions=POSITIONS)
    from_capture = diagnose(eagle31_dir, None, prompts_file=prompts, depth=DEPTH, positions=POSITIONS,
                            capture=tmp_path / "capture")
    assert from_capture.positions == from_target.positions > 0
    for got, want in zip(from_capture.rows, from_target.rows, strict=True):
        assert got.agreement == want.agreement and got.acceptance == want.acceptance
        assert math.isclose(got.fed_back_rms, want.fed_back_rms, rel_tol=1e-4)
        assert math.isclose(got.attention_prompt, want.attention_prompt, rel_tol=1e-4, abs_tol=1e-6)
    assert from_capture.verdict == from_target.verdict
    with pytest.raises(UserError, match="re-capture"):
        diagnose(eagle31_dir, None, prompts_file=prompts, depth=DEPTH, positions=POSITIONS + 50,
                 capture=tmp_path / "capture")
