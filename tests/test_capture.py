"""Captures (`eagle31-export capture`): a target's greedy continuations, taps and top-k logits,
written once (one process, or tensor-parallel under torchrun) and read back by `CaptureTarget`
so that parity runs without the target."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from factories import greedy_decode, make_target
from eagle31_export.demo.pair import DRAFTERS, EmbeddedPair
from eagle31_export.errors import UserError
from eagle31_export.export.onnx_export import export_onnx
from eagle31_export.formats.capture import Capture
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.parity.sides import check_parity
from eagle31_export.reference.capture import CaptureOptions, capture, resolve_aux_layer_ids
from eagle31_export.reference.capture_target import CaptureTarget
from eagle31_export.reference.speculate import speculate
from eagle31_export.reference.target import ReferenceTarget, tapped_forward
from eagle31_export.runtime.registry import PairSource, load_speculator

ROOT = Path(__file__).resolve().parents[1]
PAIR = EmbeddedPair.open(ROOT / "examples" / "tiny" / "models")
EAGLE31 = PAIR.folder / DRAFTERS["EAGLE 3.1"]
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 7], [64] * 9]
MAX_NEW, DEPTH = 12, 3  # captured: 12 + 3 + 1 = 16 greedy tokens per prompt


@pytest.fixture(scope="module")
def llama_capture(tmp_path_factory, llama_target, eagle31_dir) -> Path:
    """The random tiny target in fp64 (so chunked and incremental forwards agree to ~1e-15),
    tapped where the session's EAGLE 3.1 drafter reads."""
    out = tmp_path_factory.mktemp("capture") / "llama"
    ids = resolve_aux_layer_ids(llama_target, eagle31_dir)
    capture(llama_target, PROMPTS, ids, out, CaptureOptions(max_new_tokens=MAX_NEW, depth=DEPTH, top_k=4,
                                                            dtype=torch.float64))
    return out


def test_capture_holds_greedy_continuation_taps_and_topk(llama_capture, fp64_llama, eagle31_ckpt):
    cap = Capture.open(llama_capture)
    ids = cap.aux_layer_ids
    assert ids == (1, 3, 4) and cap.prompts() == PROMPTS and cap.meta["continuation"] == 16
    assert json.loads((llama_capture / "manifest.json").read_text())["files"].keys() >= {
        "capture.json", "embeddings.safetensors", "prompts-00000.safetensors"}
    target = ReferenceTarget(fp64_llama, ids)
    for i, prompt in enumerate(PROMPTS):
        record = cap.load(i)
        assert record.prompt == prompt and record.continuation == greedy_decode(target, prompt, 16)
        logits, taps = tapped_forward(target, record.tokens[:-1].unsqueeze(0))
        torch.testing.assert_close(record.aux, taps[0], rtol=0, atol=1e-9)
        top = logits[0].float().topk(4)
        torch.testing.assert_close(record.topk_values, top.values, rtol=0, atol=1e-5)
        assert torch.equal(record.topk_indices, top.indices)
    assert torch.equal(cap.embeddings(), fp64_llama.get_input_embeddings().weight)


class ScriptedDrafter:
    """A `DrafterBackend` that drafts the target's greedy token at a fixed fraction of positions
    and a wrong one elsewhere, and checks that every tapped state it is given is finite (a NaN
    would mean the loop handed it an off-path row of a capture)."""

    def __init__(self, greedy: list[int], vocab: int, right_percent: int):
        self.greedy, self.vocab, self.right = greedy, vocab, right_percent
        self.length = 0

    def reset(self):
        self.length = 0

    def truncate(self, length):
        self.length = length

    def draft_to_target(self, ids):
        return ids

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        assert torch.isfinite(hidden).all(), "the loop fed an off-path (NaN) tapped state to the drafter"
        t = input_ids.shape[1]
        self.length += t
        logits = torch.zeros(1, t, self.vocab)
        for r in range(t):
            q = int(positions[0, r]) + 2  # a row at position j drafts the token at position j + 2
            right = self.greedy[q] if q < len(self.greedy) else 0
            logits[0, r, right if (q * 37) % 100 < self.right else (right + 1) % self.vocab] = 1.0
        return logits, torch.zeros(1, t, 8)


@pytest.mark.parametrize("right_percent", [0, 60, 100])
def test_the_loop_reads_only_the_greedy_path(llama_capture, fp64_llama, right_percent):
    """A capture answers only on the greedy path, NaN elsewhere; the loop over it gives the same
    result as over the target itself, whatever the drafter drafts."""
    cap = Capture.open(llama_capture)
    from_capture, reference = CaptureTarget(cap), ReferenceTarget(fp64_llama, cap.aux_layer_ids)
    for i, prompt in enumerate(PROMPTS):
        greedy = cap.load(i).tokens.tolist()
        runs = [speculate(t, ScriptedDrafter(greedy, cap.vocab_size, right_percent), prompt, MAX_NEW, DEPTH)
                for t in (from_capture, reference)]
        assert runs[0].tokens == greedy[len(prompt): len(prompt) + MAX_NEW]
        assert (runs[0].tokens, runs[0].drafts, runs[0].accepted_per_step) == \
            (runs[1].tokens, runs[1].drafts, runs[1].accepted_per_step)
        if right_percent == 0:
            assert set(runs[0].accepted_per_step) == {0}
        if right_percent == 100:
            assert set(runs[0].accepted_per_step[:-1]) == {DEPTH}


def test_off_path_rows_are_nan_and_too_short_is_refused(llama_capture):
    cap = Capture.open(llama_capture)
    prompt, target = PROMPTS[0], CaptureTarget(cap)
    p, greedy = len(prompt), cap.load(0).tokens.tolist()
    target.reset()
    logits, taps = target.forward(torch.tensor([prompt]))
    assert torch.isfinite(taps).all() and int(logits[0, -1].argmax()) == greedy[p]
    wrong = (greedy[p + 1] + 1) % cap.vocab_size
    logits, taps = target.forward(torch.tensor([[greedy[p], wrong, greedy[p + 2]]]))
    assert int(logits[0, 0].argmax()) == greedy[p + 1] and torch.isfinite(taps[0, 0]).all()
    assert torch.isnan(logits[0, 1:]).all() and torch.isnan(taps[0, 1:]).all()  # after a wrong token
    target.truncate(p + 1)
    logits, _ = target.forward(torch.tensor([[greedy[p + 1]]]))  # back on the path after the cut
    assert int(logits[0, 0].argmax()) == greedy[p + 2]
    # a run longer than captured reads on-path rows past the end: one line, what to re-capture
    with pytest.raises(UserError, match=r"re-capture with --max-new-tokens >= \d+"):
        speculate(target, ScriptedDrafter(greedy, cap.vocab_size, 100), prompt, MAX_NEW + 4, DEPTH)


@pytest.fixture(scope="module")
def tiny_capture(tmp_path_factory):
    """The tiny trained pair (its drafter accepts: the comparison covers accepted drafts)."""
    prompts = PAIR.held_out_prompts(24)[:3]
    out = tmp_path_factory.mktemp("tiny") / "capture"
    capture(PAIR.target, prompts, resolve_aux_layer_ids(PAIR.target, EAGLE31), out,
            CaptureOptions(max_new_tokens=16, depth=DEPTH))
    return out, prompts


def test_parity_from_a_capture_equals_parity_from_the_target(tiny_capture, tmp_path):
    cap, prompts = tiny_capture
    bundle = export_onnx(EAGLE31, tmp_path / "onnx", PAIR.target)  # the folder side's graphs, target included
    sides = {
        "reference": (load_speculator("reference", PairSource.of(EAGLE31, PAIR.target)),
                      load_speculator("reference", PairSource.of(EAGLE31, capture=cap))),
        # from the capture: the drafter alone is exported (with the captured embeddings it borrows)
        "onnxruntime": (load_speculator("onnxruntime", PairSource.of(EAGLE31, PAIR.target, bundle)),
                        load_speculator("onnxruntime", PairSource.of(EAGLE31, capture=cap), workdir=tmp_path / "w")),
    }
    for name, (folder, captured) in sides.items():
        accepted = 0
        for prompt in prompts:
            a, b = folder.run(prompt, 16, DEPTH), captured.run(prompt, 16, DEPTH)
            assert (a.tokens, a.drafts, a.accepted_per_step) == (b.tokens, b.drafts, b.accepted_per_step), name
            accepted += sum(a.accepted_per_step)
            if name == "onnxruntime":  # replay mode: one read of the capture instead of one target forward
                r1, r2 = sides["reference"][0].replay(prompt, a), sides["reference"][1].replay(prompt, b)
                assert (r1.tokens, r1.drafts, r1.accepted_per_step) == (r2.tokens, r2.drafts, r2.accepted_per_step)
        assert accepted > len(prompts) * 4, name
    assert not (tmp_path / "w" / "onnx" / "target.onnx").exists()
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    for runtime, artifacts in (("reference", None), ("onnxruntime", bundle)):
        want = check_parity(runtime, artifacts, EAGLE31, PAIR.target, None, prompts_file, DEPTH, 16)
        got = check_parity(runtime, None, EAGLE31, None, None, None, DEPTH, 16, capture=cap)
        assert got.passed and want.passed and got.mode == want.mode == "replay"
        keys = ("tokens_identical", "drafts_identical", "accepted_identical", "tau_reference", "tau_runtime",
                "per_position_reference", "per_position_runtime", "rounds_runtime")
        assert [[getattr(r, k) for k in keys] for r in got.rows] == [[getattr(r, k) for k in keys] for r in want.rows]
    # and it still catches a broken drafter: EAGLE 3.1 exported with EAGLE-3's pre-norm feedback
    ckpt = read_drafter(EAGLE31)
    broken = write_drafter(DrafterCheckpoint(ckpt.config.replace(norm_output=False), ckpt.tensors),
                           tmp_path / "broken", "specforge")
    report = check_parity("reference", broken, EAGLE31, None, None, None, DEPTH, 16, capture=cap)
    assert not report.passed and "later drafts differ: fed-back state" in report.failures[0]


def test_parity_refuses_a_capture_changed_since_it_was_written(tiny_capture, tmp_path):
    import shutil

    from eagle31_export.errors import UserError

    cap, _ = tiny_capture
    copy = tmp_path / "capture"
    shutil.copytree(cap, copy)
    data = max((p for p in copy.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=data.name):
        check_parity("reference", None, EAGLE31, None, None, None, DEPTH, 16, capture=copy)


@pytest.fixture(scope="module")
def tp_targets(tmp_path_factory):
    """A bf16 checkpoint and its NVFP4 (ModelOpt) quantization, small enough for two CPU processes."""
    folder = tmp_path_factory.mktemp("tp")
    bf16 = make_target(folder / "bf16", "llama", seed=3, dtype=torch.bfloat16, num_layers=4)
    nvfp4 = quantize_checkpoint(bf16, folder / "nvfp4", "modelopt").out
    prompts = folder / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3, 4, 5, 6]}\n{"prompt_ids": [90, 80, 70]}\n')
    return {"bf16": bf16, "nvfp4": nvfp4}, prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_torchrun_two_processes_capture_equals_one_process(cli, tp_targets, tmp_path, kind):
    targets, prompts = tp_targets
    args = ["capture", "--target", targets[kind], "--aux-layer-ids", "0,1,2", "--prompts", prompts,
            "--max-new-tokens", "8", "--depth", "2"]
    code, _, err = cli(*args, "--out", tmp_path / "one")
    assert code == 0, err
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()),
                           "-m", "eagle31_export.cli.main", *map(str, args), "--out", str(tmp_path / "two")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 2 processes (tensor-parallel)" in proc.stderr
    one, two = Capture.open(tmp_path / "one"), Capture.open(tmp_path / "two")
    assert (one.meta["world_size"], two.meta["world_size"]) == (1, 2)
    assert two.meta["rank0_parameters"] < 0.7 * one.meta["rank0_parameters"]  # rank 0 held shards, not the model
    assert two.meta["target"]["quantization"] == ("NVFP4" if kind == "nvfp4" else None)
    assert torch.equal(one.embeddings(), two.embeddings())
    for i in range(len(one)):
        a, b = one.load(i), two.load(i)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(b.aux, a.aux, rtol=0, atol=1e-4)
        torch.testing.assert_close(b.topk_values, a.topk_values, rtol=0, atol=1e-4)
        gaps = a.topk_values[:, :-1] - a.topk_values[:, 1:]  # descending; a tie makes the order arbitrary
        untied = torch.cat([gaps > 1e-4, torch.ones(len(gaps), 1, dtype=torch.bool)], 1)
        untied[:, 1:] &= gaps > 1e-4
        assert torch.equal(a.topk_indices[untied], b.topk_indices[untied])


def test_bad_input_is_one_line(cli, llama_capture, llama_target, eagle31_dir, tmp_path):
    other_prompts = tmp_path / "other.jsonl"
    other_prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    parity = ["parity", "--drafter", eagle31_dir, "--runtime", "reference", "--max-new-tokens", str(MAX_NEW)]
    cases = [
        ([*parity, "--capture", tmp_path / "missing"], "no such capture folder"),
        ([*parity, "--capture", llama_target], "no capture.json"),
        (["speculate", "--drafter", eagle31_dir, "--capture", llama_capture, "--prompt-ids", "7,7,7",
          "--max-new-tokens", str(MAX_NEW)],
         "is not in the capture"),
        ([*parity, "--capture", llama_capture, "--prompts", other_prompts], "prompt 1 [1,2,3] (3 tokens) is not in"),
        ([*parity[:-2], "--capture", llama_capture, "--max-new-tokens", "40"],
         "re-capture with --max-new-tokens >= 40"),
        ([*parity, "--capture", llama_capture, "--temperature", "0.7"], "greedy continuations only"),
        (["speculate", "--drafter", eagle31_dir, "--capture", llama_capture, "--prompt-ids", "200,1,7",
          "--temperature", "0.7"], "greedy continuations only"),
        ([*parity, "--capture", llama_capture, "--target", llama_target], "not both"),
        (["capture", "--target", llama_target, "--out", tmp_path / "c"], "--drafter D (its own) or --aux-layer-ids"),
        (["capture", "--target", llama_target, "--aux-layer-ids", "1,99", "--out", tmp_path / "c"],
         "layer 99 is not a layer of the target"),
        (["capture", "--target", llama_target, "--aux-layer-ids", "1", "--out", llama_capture], "already exists"),
    ]
    for args, message in cases:
        code, _, err = cli(*args)
        assert code == 2 and message in err and err.strip().count("\n") == 0, (args, err)
    assert not (tmp_path / "c").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    meta = json.loads((llama_capture / "capture.json").read_text())
    for name in ("embeddings.safetensors", "prompts-00000.safetensors"):
        (broken / name).symlink_to(llama_capture / name)
    (broken / "capture.json").write_text(json.dumps({**meta, "depth": 5}))  # lengths no longer add up
    from eagle31_export.formats.outputs import write_manifest

    write_manifest(broken)  # a capture written broken: its manifest agrees, what it holds does not
    code, _, err = cli(*parity, "--capture", broken)
    assert code == 2 and "length = prompt_len + 18" in err
