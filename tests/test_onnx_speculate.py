"""The exported graphs in THE speculation loop (ONNX Runtime backends) against the reference:
identical drafts, accepted_per_step and tokens; every forward's logits within 1e-4.

Random-weight drafters accept almost nothing, which would leave the accept / crop paths of both
caches untested. `accepting_pair` builds a pair that accepts often and unevenly, from real
graphs: a "nearly bigram" target (attention and MLP outputs scaled down, so the next token
depends mostly, not only, on the current one) and a drafter wired to predict that bigram
(attention that looks mostly at its own position, the target's norm and lm_head). The fed-back
state then perturbs later drafts, so acceptance varies between rounds and with `norm_output`.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle31_export.export.onnx_export import OnnxExportOptions, export_onnx
from factories import drafter_config_for, make_target, random_drafter
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, write_drafter
from eagle31_export.formats.outputs import MANIFEST, write_manifest
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_info
from eagle31_export.reference.pair import load_pair
from eagle31_export.reference.speculate import LoopObserver, ProgressObserver, speculate
from eagle31_export.runtime.onnxruntime import load_backends

PROMPTS = ([1, 5, 9, 13], [200, 3, 77, 41, 8], [17, 17, 4])


class Recorder:
    """Wraps a backend and keeps every forward's outputs, to compare two runs call by call."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, *args, **kwargs):
        out = self.backend.forward(*args, **kwargs)
        self.calls.append([t.detach().float().clone() for t in out])
        return out


def assert_same_run(ref_target, ref_drafter, ort_target, ort_drafter, prompt, depth, chain=False):
    """Same tokens, drafts and acceptance; every target call's logits and taps, and every drafter
    call's logits and fed-back state, within 1e-4 (the chain only returns last-position logits)."""
    runs = []
    for target, drafter in ((ref_target, ref_drafter), (ort_target, ort_drafter)):
        target, drafter = Recorder(target), Recorder(drafter)
        runs.append((speculate(target, drafter, prompt, 20, depth), target.calls, drafter.calls))
    (want, want_t, want_d), (got, got_t, got_d) = runs
    assert got.drafts == want.drafts
    assert got.accepted_per_step == want.accepted_per_step
    assert got.tokens == want.tokens
    for calls_got, calls_want, is_chain in ((got_t, want_t, False), (got_d, want_d, chain)):
        assert len(calls_got) == len(calls_want)
        for g, w in zip(calls_got, calls_want):
            if is_chain:
                torch.testing.assert_close(g[0][:, -1], w[0][:, -1], atol=1e-4, rtol=0)
                continue
            torch.testing.assert_close(g[0], w[0], atol=1e-4, rtol=0)  # logits
            torch.testing.assert_close(g[1], w[1], atol=1e-4, rtol=0)  # taps / fed-back state
    return want


def nearly_bigram_target(folder, dtype=torch.float32):
    model = load_causal_lm(make_target(folder / "random", "llama", seed=0))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.03)
            layer.mlp.down_proj.weight.mul_(0.03)
    model.to(dtype).save_pretrained(folder / "target", safe_serialization=True)
    return folder / "target", model


def bigram_drafter(folder, info, model, eagle31: bool):
    h = info.hidden_size
    cfg = drafter_config_for(info, fc_norm=eagle31, norm_output=eagle31, draft_vocab_size=info.vocab_size,
                             num_key_value_heads=info.num_attention_heads, attention_bias=True)
    t = dict(random_drafter(cfg, seed=1).tensors)
    attn = "layers.0.self_attn."
    t["fc.weight"] = 0.01 * t["fc.weight"]
    for proj in ("q_proj", "k_proj"):  # constant queries/keys: rope makes each position prefer itself
        t[attn + proj + ".weight"] = torch.zeros_like(t[attn + proj + ".weight"])
        t[attn + proj + ".bias"] = torch.full_like(t[attn + proj + ".bias"], 5.0)
    t[attn + "v_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)  # the token embedding half
    t[attn + "v_proj.bias"] = torch.zeros(h)
    t[attn + "o_proj.weight"] = torch.eye(h)
    t["layers.0.input_layernorm.weight"] = torch.ones(h)
    t["layers.0.mlp.down_proj.weight"] = torch.zeros_like(t["layers.0.mlp.down_proj.weight"])
    t["norm.weight"] = model.model.norm.weight.detach().float().clone()
    del t["lm_head.weight"], t["t2d"]  # lm_head from the target (full draft vocabulary)
    t["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    return write_drafter(DrafterCheckpoint(cfg, t), folder / f"drafter-{'31' if eagle31 else '3'}", "specforge")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{(target kind, eagle31): (drafter dir, target dir, onnx dir)} for fp32, bf16 and NVFP4 targets."""
    tmp = tmp_path_factory.mktemp("accepting")
    fp32, model = nearly_bigram_target(tmp / "fp32")
    targets = {"fp32": fp32, "bf16": nearly_bigram_target(tmp / "bf16", torch.bfloat16)[0]}
    try:
        from eagle31_export.formats.target.quantize import quantize_checkpoint
    except ImportError:  # NVFP4 support not in this build: those cases skip
        quantize_checkpoint = None
    if quantize_checkpoint is not None:
        targets["nvfp4"] = quantize_checkpoint(fp32, tmp / "nvfp4", "modelopt").out
    info = read_target_info(fp32)
    out = {}
    for eagle31 in (False, True):
        drafter = bigram_drafter(tmp, info, model, eagle31)
        for kind, target in targets.items():
            onnx_dir = export_onnx(drafter, tmp / f"onnx-{kind}-{eagle31}", target, OnnxExportOptions(chain_depth=4))
            out[kind, eagle31] = (drafter, target, onnx_dir)
    return out


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "nvfp4"])
def test_onnxruntime_loop_matches_the_reference(pairs, kind, eagle31):
    """bf16: the checkpoint is stored in bf16 and both sides compute in fp32 (the export upcasts).
    NVFP4: the reference runs the dequantized weights, ONNX Runtime unpacks the packed ones."""
    if (kind, eagle31) not in pairs:
        pytest.skip(f"no {kind} target in this build")
    drafter, target, onnx_dir = pairs[kind, eagle31]
    pair = load_pair(drafter, target, dtype=torch.float32)
    ort_target, ort_drafter = load_backends(onnx_dir)
    accepted = []
    for prompt, depth in ((PROMPTS[0], 4), (PROMPTS[1], 4), (PROMPTS[2], 1)):
        result = assert_same_run(pair.target, pair.drafter, ort_target, ort_drafter, prompt, depth)
        accepted += result.accepted_per_step
    assert sum(accepted) > 0 and 0 in accepted and max(accepted) >= 2  # the accept paths did run


class FirstLogits(LoopObserver):
    wants_draft_logits = True

    def __init__(self):
        self.per_round = []

    def on_round(self, round):
        self.per_round.append(round.first_draft_logits)


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
def test_chain_graph_gives_the_same_rounds(pairs, eagle31):
    """The loop drafts each round with ONE chain-graph call: same rounds as the reference, and the
    same step-1 draft logits every round."""
    drafter, target, onnx_dir = pairs["fp32", eagle31]
    pair = load_pair(drafter, target, dtype=torch.float32)
    ort_target, chain = load_backends(onnx_dir, chain=True)
    assert chain.chain_depth == 4
    for prompt, depth in ((PROMPTS[0], 4), (PROMPTS[1], 2)):
        calls = Recorder(chain)  # single-step calls would be recorded here; the chain makes none
        runs = []
        for t, d in ((pair.target, pair.drafter), (ort_target, calls)):
            seen = FirstLogits()
            runs.append((speculate(t, d, prompt, 20, depth, observer=seen), seen.per_round))
        (want, want_logits), (got, got_logits) = runs
        assert (got.tokens, got.drafts, got.accepted_per_step) == (want.tokens, want.drafts, want.accepted_per_step)
        assert calls.calls == []
        for g, w in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_chain_backend_falls_back_to_single_steps_for_sampling_and_deeper_rounds(pairs):
    """Sampling and depths beyond the chain graph run on the single-step graphs, and still match."""
    drafter, target, onnx_dir = pairs["fp32", True]
    pair = load_pair(drafter, target, dtype=torch.float32)
    ort_target, chain = load_backends(onnx_dir, chain=True)
    for depth, temperature in ((5, 0.0), (4, 1.0)):
        want = speculate(pair.target, pair.drafter, PROMPTS[0], 24, depth, temperature, seed=3)
        got = speculate(ort_target, chain, PROMPTS[0], 24, depth, temperature, seed=3)
        assert (got.tokens, got.drafts, got.accepted_per_step) == (want.tokens, want.drafts, want.accepted_per_step)


def test_sampling_with_onnxruntime_matches_the_reference(pairs):
    drafter, target, onnx_dir = pairs["fp32", True]
    pair = load_pair(drafter, target, dtype=torch.float32)
    ort_target, ort_drafter = load_backends(onnx_dir)
    want = speculate(pair.target, pair.drafter, PROMPTS[1], 24, 3, temperature=0.8, seed=7)
    got = speculate(ort_target, ort_drafter, PROMPTS[1], 24, 3, temperature=0.8, seed=7)
    assert got.drafts == want.drafts and got.accepted_per_step == want.accepted_per_step


# ---- CLI ---------------------------------------------------------------------------------------

def _without_timings(printed: str) -> dict:
    """`speculate --json` output less its phase timings (seconds differ from run to run)."""
    return {k: v for k, v in json.loads(printed).items() if k != "timings"}


def test_cli_export_then_speculate_with_onnxruntime(cli, tmp_path, pairs):
    drafter, target, _ = pairs["fp32", True]
    out = tmp_path / "onnx"
    code, stdout, _ = cli("export", "onnx", "--drafter", drafter, "--target", target,
                          "--out", out, "--chain-depth", "3")
    assert code == 0 and (out / "drafter_chain.onnx").is_file() and (out / "manifest.json").is_file()
    common = ["--prompt-ids", "200,3,77,41,8", "--depth", "3", "--max-new-tokens", "16", "--json"]
    code, ref_out, _ = cli("speculate", "--drafter", drafter, "--target", target, *common)
    assert code == 0
    for extra in ([], ["--chain"]):
        code, ort_out, err = cli("speculate", "--runtime", "onnxruntime", "--onnx", out, *extra, *common)
        assert code == 0, err
        assert _without_timings(ort_out) == _without_timings(ref_out)


def test_cli_drafter_only_export_verifies_with_the_reference_target(cli, tmp_path, pairs):
    drafter, target, _ = pairs["fp32", False]
    out = tmp_path / "drafter-only"
    export_onnx(drafter, out, target)  # the target supplies embeddings and lm_head ...
    (out / "target.onnx").unlink()  # ... but a drafter-only folder has no target graph
    meta = json.loads((out / "graphs.json").read_text())
    del meta["target"]
    (out / "graphs.json").write_text(json.dumps(meta))
    references = json.loads((out / MANIFEST).read_text()).get("references") or {}
    write_manifest(out, {role: ref["path"] for role, ref in references.items()})  # as if written so
    common = ["--prompt-ids", "1,5,9,13", "--depth", "2", "--max-new-tokens", "10", "--json"]
    code, ref_out, _ = cli("speculate", "--drafter", drafter, "--target", target, *common)
    code2, ort_out, err = cli("speculate", "--runtime", "onnxruntime", "--onnx", out, "--target", target, *common)
    assert code == code2 == 0, err
    assert _without_timings(ort_out) == _without_timings(ref_out)


@pytest.mark.parametrize("args, message", [
    (["export", "onnx", "--drafter", "{d}", "--target", "{t}", "--out", "{o}", "--flavor", "trt"], "unknown --flavor"),
    (["export", "onnx", "--drafter", "{d}", "--target", "{t}", "--out", "{o}", "--dtype", "fp64"], "--dtype must be"),
    (["export", "onnx", "--drafter", "{d}", "--out", "{o}"], "pass --target"),
    (["export", "onnx", "--drafter", "{t}", "--target", "{t}", "--out", "{o}"], "drafter format"),
    (["export", "onnx", "--drafter", "{d}", "--target", "{t}", "--out", "{d}"], "already exists"),
    (["speculate", "--runtime", "onnxruntime", "--prompt-ids", "1"], "needs --onnx"),
    (["speculate", "--runtime", "onnxruntime", "--onnx", "{d}", "--prompt-ids", "1"], "no graphs.json"),
    (["speculate", "--runtime", "tensorrt", "--onnx", "{d}", "--prompt-ids", "1"], "unknown --runtime"),
    (["speculate", "--runtime", "onnxruntime", "--onnx", "{d}", "--chain", "--temperature", "1",
      "--prompt-ids", "1"], "drafts greedily"),
])
def test_cli_bad_input_is_one_line_and_exit_2(cli, tmp_path, pairs, args, message):
    drafter, target, _ = pairs["fp32", False]
    filled = [a.format(d=drafter, t=target, o=tmp_path / "out") for a in args]
    code, _, err = cli(*filled)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ---- batching: several sequences in one call -----------------------------------------------------

def _prefilled(backend, ids):
    seq = backend.fork()
    seq.forward(torch.tensor([ids]))
    return seq


def test_a_padded_batch_gives_each_sequence_its_own_outputs(pairs):
    """Two sequences with different cache lengths (5, 2) and new-token counts (3, 1) in one target call,
    padded and masked, give what each gives alone, and each cache keeps only its own entries."""
    _, _, onnx_dir = pairs["fp32", True]
    target, _ = load_backends(onnx_dir)
    histories, new = ([1, 5, 9, 13, 2], [200, 3]), ([7, 8, 9], [4])
    alone = []
    for history, ids in zip(histories, new):
        seq = _prefilled(target, history)
        alone.append((seq.forward(torch.tensor([ids])), seq.cache))
    batch = [_prefilled(target, history) for history in histories]
    together = target.forward_batch([(seq, torch.tensor([ids])) for seq, ids in zip(batch, new)])
    for seq, ids, got, ((want_logits, want_taps), want_cache) in zip(batch, new, together, alone):
        assert got[0].shape == want_logits.shape == (1, len(ids), 256)
        torch.testing.assert_close(got[0], want_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], want_taps, atol=1e-5, rtol=0)
        assert seq.length == want_cache.length
        for k, want_k in zip(seq.cache.keys, want_cache.keys):
            torch.testing.assert_close(torch.from_numpy(k), torch.from_numpy(want_k), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chain", [False, True], ids=["steps", "chain"])
def test_concurrent_requests_are_batched_and_give_the_one_at_a_time_results(pairs, chain):
    """Six prompts of different lengths, four in flight at a time (greedy, then sampling with a seed
    per prompt): every backend call of the batched run served several sequences at once somewhere,
    and every prompt's tokens, drafts and rounds equal its run alone."""
    from eagle31_export.runtime.batching import BatchingSpeculator

    _, _, onnx_dir = pairs["fp32", True]
    speculator = BatchingSpeculator("onnxruntime", *load_backends(onnx_dir, chain=chain))
    prompts = [list(PROMPTS[i % 3][: 2 + i % 3]) + [i] for i in range(6)]
    for temperature in (0.0, 0.8):
        speculator.batcher.batch_sizes.clear()
        alone = speculator.run_concurrently(prompts, 20, 4, 1, temperature, seed=5).results
        assert max(speculator.batcher.batch_sizes) == 1
        speculator.batcher.batch_sizes.clear()
        together = speculator.run_concurrently(prompts, 20, 4, 4, temperature, seed=5).results
        assert max(speculator.batcher.batch_sizes) > 1
        for a, b in zip(alone, together, strict=True):
            assert (b.tokens, b.drafts, b.accepted_per_step) == (a.tokens, a.drafts, a.accepted_per_step)
        assert sum(sum(r.accepted_per_step) for r in alone) > 0


# ---- long prompts: prefilled in pieces -----------------------------------------------------------

LONG_PROMPT = [(7 * i + 3) % 250 for i in range(45)]


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle31"])
def test_a_long_prompt_is_prefilled_in_pieces_with_the_same_rounds(pairs, monkeypatch, eagle31):
    """A prompt over PREFILL_CHUNK tokens goes to the target in pieces that keep their last logits only,
    the drafter reading each piece's taps as it comes (ONNX Runtime further splits calls whose scores
    would pass SCORE_BYTES): the rounds are those of the one-forward prefill, on both backends."""
    import eagle31_export.reference.speculate as spec
    import eagle31_export.runtime.onnxruntime as ort

    drafter, target, onnx_dir = pairs["fp32", eagle31]
    pair = load_pair(drafter, target, dtype=torch.float32)
    whole = speculate(pair.target, pair.drafter, LONG_PROMPT, 20, 3)
    monkeypatch.setattr(spec, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(ort, "SCORE_BYTES", 2400)  # fp32 scores of 4 heads x 6 queries x 25 keys
    ref_target, ref_drafter = Recorder(pair.target), Recorder(pair.drafter)
    reports = []
    pieces = speculate(ref_target, ref_drafter, LONG_PROMPT, 20, 3,
                       observer=ProgressObserver(lambda *report: reports.append(report), 20))
    assert [r for r in reports if r[0] == "prefill"] == [("prefill", n, 45) for n in (8, 16, 24, 32, 40, 45)]
    ort_target, ort_drafter = load_backends(onnx_dir)
    session_calls = []
    run = ort._run
    monkeypatch.setattr(ort, "_run", lambda session, feeds: session_calls.append(feeds["input_ids"].shape[1])
                        or run(session, feeds))
    ort_result = speculate(ort_target, ort_drafter, LONG_PROMPT, 20, 3)
    for got in (pieces, ort_result):
        assert (got.tokens, got.drafts, got.accepted_per_step) == (whole.tokens, whole.drafts, whole.accepted_per_step)
    assert sum(whole.accepted_per_step) > 0
    prefill = ref_target.calls[:6]  # 45 tokens in pieces of 8: 6 forwards, one logits row each
    assert [c[0].shape[1] for c in prefill] == [1] * 6 and [c[1].shape[1] for c in prefill] == [8] * 5 + [5]
    assert [c[0].shape[1] for c in ref_drafter.calls[:6]] == [8] * 5 + [4]  # the last tap waits for round 1
    # target and drafter alternate; the third piece (24 keys: 6 query rows of 4 heads fit) runs as 6 + 2 on each
    assert session_calls[:8] == [8, 8, 8, 8, 6, 2, 6, 2]


@pytest.mark.parametrize("chain", [False, True], ids=["steps", "chain"])
def test_batched_requests_split_long_calls_too(pairs, monkeypatch, chain):
    """The runtime the CLI loads batches the requests in flight (`BatchingSpeculator`); its calls keep
    scores within SCORE_BYTES as the one-sequence calls do (a 16k prompt's 512-token pieces made 1 GiB
    of scores a layer there), with the rounds of the one-forward prefill."""
    import eagle31_export.reference.speculate as spec
    import eagle31_export.runtime.onnxruntime as ort
    from eagle31_export.runtime.batching import BatchingSpeculator

    drafter, target, onnx_dir = pairs["fp32", True]
    pair = load_pair(drafter, target, dtype=torch.float32)
    whole = speculate(pair.target, pair.drafter, LONG_PROMPT, 20, 3)
    monkeypatch.setattr(spec, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(ort, "SCORE_BYTES", 2400)  # fp32 scores of 4 heads x 6 queries x 25 keys
    ort_target, ort_drafter = load_backends(onnx_dir, chain=chain)
    session_calls = []
    run = ort._run
    monkeypatch.setattr(ort, "_run", lambda session, feeds: session_calls.append(feeds["input_ids"].shape)
                        or run(session, feeds))
    got = BatchingSpeculator("onnxruntime", ort_target, ort_drafter).run(LONG_PROMPT, 20, 3)
    assert (got.tokens, got.drafts, got.accepted_per_step) == (whole.tokens, whole.drafts, whole.accepted_per_step)
    # the third 8-token piece (16 cached keys + 8 new: 6 query rows of 4 heads fit) runs as 6 + 2
    assert [shape[1] for shape in session_calls[:8]] == [8, 8, 8, 8, 6, 2, 6, 2]
