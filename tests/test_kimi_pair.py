"""The flagship pair: a Kimi K2.x target (DeepSeek-V3 architecture: MLA, yarn, MoE with a sigmoid
noaux_tc router and shared experts; bf16 and NVFP4) served with an `eagle3.1-mla` drafter.

The committed example (`examples/kimi/models`, made by `examples/kimi/make_pair.py`) carries every
published config key and tensor name at scaled-down sizes; smaller targets are built here where a
test needs another configuration (group-limited routing, fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import assert_ttt_matches_inference, kimi_make_pair_module
from eagle31_export.errors import CheckpointError
from eagle31_export.export.onnx_export import export_onnx
from eagle31_export.demo.pair import EmbeddedPair, pair_folder
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_config, transformers_config
from eagle31_export.reference.target import load_target, tapped_forward

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "kimi" / "models"
DRAFTER, DRAFTER3 = MODELS / "drafter-eagle31", MODELS / "drafter-eagle3"
TARGET, TARGET_NVFP4 = MODELS / "target", MODELS / "target-nvfp4"


MAKE = kimi_make_pair_module()


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- a DeepSeek-V3 / Kimi target with group-limited routing, fp32 ----------------------------

@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """Kimi's published keys, 4 layers, 8 experts in 2 groups (topk_group 1), top-2, fp32 weights
    stored one expert at a time; plus the in-memory transformers model they came from."""
    shape = dict(MAKE.SHAPES["example"], num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2)
    cfg = MAKE.target_config(shape)
    cfg.update(n_group=2, topk_group=1)
    model = MAKE.build_target(cfg, seed=7)
    folder = tmp_path_factory.mktemp("kimi") / "grouped"
    MAKE.save_checkpoint(folder, cfg, MAKE.published_target_tensors(model), dtype=torch.float32)
    return folder, model


def test_reference_target_equals_transformers_deepseek_v3(grouped):
    """Our loader (published per-expert names -> fused experts) and taps against transformers' own
    DeepseekV3 forward with output_hidden_states: hidden_states[i + 1] is the output of layer i,
    except the last entry, which is after the final norm."""
    folder, model = grouped
    ids = torch.tensor([[5, 700, 31, 2, 99, 410, 64, 3, 250, 17]])
    with torch.no_grad():
        theirs = model(input_ids=ids, output_hidden_states=True)
    ours = load_target(folder, (0, 1, 3))
    assert type(ours.model).__name__ == "DeepseekV3ForCausalLM" and ours.num_layers == 4
    ours.reset()
    logits_a, taps_a = ours.forward(ids[:, :6])  # prefill, then one token at a time (KV cache)
    steps = [ours.forward(ids[:, j:j + 1]) for j in range(6, ids.shape[1])]
    logits = torch.cat([logits_a] + [s[0] for s in steps], 1)
    taps = torch.cat([taps_a] + [s[1] for s in steps], 1)
    diff = (logits - theirs.logits).abs().max().item()
    print(f"max abs logit difference, reference (KV cache) vs transformers DeepseekV3 (fp32): {diff:.3g}")
    assert diff < 1e-5
    one_shot, one_shot_taps = tapped_forward(ours, ids)
    print(f"max abs logit difference, reference (one forward) vs transformers: "
          f"{(one_shot - theirs.logits).abs().max().item():.3g}")
    assert torch.equal(one_shot, theirs.logits) and torch.equal(one_shot_taps[..., :64], theirs.hidden_states[1])
    h = 64
    hs = theirs.hidden_states
    torch.testing.assert_close(taps[..., :h], hs[1], rtol=0, atol=1e-5)  # output of layer 0
    torch.testing.assert_close(taps[..., h:2 * h], hs[2], rtol=0, atol=1e-5)  # output of layer 1
    last = taps[..., 2 * h:]  # output of layer 3, the last: hidden_states[4] is norm(it)
    assert (last - hs[4]).abs().max() > 0.1
    torch.testing.assert_close(model.model.norm(last), hs[4], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def grouped_nvfp4(grouped, tmp_path_factory):
    from eagle31_export.formats.target.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("kimi") / "grouped-nvfp4"
    return quantize_checkpoint(grouped[0], out, "modelopt").out  # every Linear with whole blocks, experts too


def test_nvfp4_target_equals_transformers_with_modelopt_dequantized_weights(grouped, grouped_nvfp4):
    """Every quantized weight (attention, dense MLP, shared and routed experts) dequantized by ModelOpt's
    NVFP4QTensor equals what we load; the logits then equal transformers' with those weights."""
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from transformers import AutoModelForCausalLM

    folder, _ = grouped
    stored = load_file(str(grouped_nvfp4 / "model.safetensors"))
    cfg = transformers_config(read_target_config(folder))
    explicit = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    explicit.load_state_dict(load_causal_lm(folder).state_dict())
    params = dict(explicit.named_parameters())
    routed = 0
    with torch.no_grad():
        for name in [n[: -len(".weight_scale")] for n in stored if n.endswith(".weight_scale")]:
            packed = stored[f"{name}.weight"]
            q = NVFP4QTensor(torch.Size((packed.shape[0], packed.shape[1] * 2)), torch.float32, packed)
            w = q.dequantize(scale=stored[f"{name}.weight_scale"], block_sizes={-1: 16},
                             double_scale=stored[f"{name}.weight_scale_2"], dtype=torch.float32)
            if ".experts." in name:  # experts.E.{gate,up,down}_proj -> the fused 3-D parameters
                routed += 1
                base, e, proj = name.rsplit(".", 2)
                e, fused = int(e), params[f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
                rows = slice(None) if proj == "down_proj" else (
                    slice(0, fused.shape[1] // 2) if proj == "gate_proj" else slice(fused.shape[1] // 2, None))
                fused[e, rows].copy_(w)
            else:
                params[f"{name}.weight"].copy_(w)
    assert routed == 3 * 3 * 8  # 3 MoE layers x 8 experts x gate/up/down
    ours = load_causal_lm(grouped_nvfp4)
    state = ours.state_dict()
    assert all(torch.equal(state[n], t) for n, t in explicit.state_dict().items())
    ids = torch.tensor([[5, 700, 31, 2, 99, 410, 64]])
    with torch.no_grad():
        diff = (ours(ids).logits - explicit(ids).logits).abs().max().item()
    print(f"max abs logit difference, NVFP4 reference vs transformers with ModelOpt-dequantized weights: {diff:.3g}")
    assert diff == 0.0


def test_w4a4_experts_run_like_transformers_when_no_input_is_quantized(grouped):
    """The experts module W4A4 emulation swaps in computes transformers' eager experts exactly."""
    from eagle31_export.formats.experts import FusedExpertsForward

    experts = grouped[1].model.layers[1].mlp.experts
    x = torch.randn(9, 64)
    index = torch.tensor([[0, 5], [7, 1], [5, 2], [3, 0], [6, 4], [1, 7], [2, 3], [4, 6], [0, 1]])
    weights = torch.rand(9, 2)
    with torch.no_grad():
        assert torch.equal(FusedExpertsForward(experts, "e", lambda _, v: v)(x, index, weights),
                           experts(x, index, weights))


def test_quantize_is_bit_exact_with_modelopt_on_the_moe_target(tmp_path):
    """`quantize --experts-only` vs ModelOpt's mtq.quantize(NVFP4_EXPERTS_ONLY_CFG) + export_hf_checkpoint:
    every tensor (per-expert packed weights, block scales, weight_scale_2, the input scales ModelOpt
    shares across a layer's experts) and hf_quant_config.json."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from eagle31_export.formats.nvfp4.calibration import default_calibration_prompts
    from eagle31_export.formats.target.quantize import quantize_checkpoint

    config = transformers_config(read_target_config(TARGET))
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(TARGET, config=config, dtype=torch.bfloat16).eval()
    prompts = default_calibration_prompts(config.vocab_size)
    mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, lambda m: [m(input_ids=torch.tensor([p])) for p in prompts])
    export_hf_checkpoint(model, export_dir=tmp_path / "modelopt")
    ours = quantize_checkpoint(TARGET, tmp_path / "ours", "modelopt", experts_only=True).out
    theirs, mine = load_file(tmp_path / "modelopt" / "model.safetensors"), load_file(ours / "model.safetensors")
    assert sorted(theirs) == sorted(mine)
    assert sum(n.endswith(".experts.3.up_proj.input_scale") for n in mine) == 7
    for name in theirs:
        assert theirs[name].dtype == mine[name].dtype and torch.equal(bits(theirs[name]), bits(mine[name])), name
    a, b = (json.loads((d / "hf_quant_config.json").read_text()) for d in (tmp_path / "modelopt", ours))
    a.pop("producer"), b.pop("producer")
    assert a == b
    assert "model.layers.0*" in b["quantization"]["exclude_modules"]


# ---- the committed example through every command ---------------------------------------------

def test_committed_example_has_the_mla_widths_vllm_cpu_runs():
    """vLLM's CPU MLA backends (CPU_MLA, AMX_MLA: vllm/v1/attention/backends/mla/cpu_mla.py, amx_mla.py)
    take only the published latent, kv_lora_rank 512 + qk_rope_head_dim 64 = 576, and AMX_MLA's packed
    bf16 GEMMs want qk_nope_head_dim and v_head_dim in multiples of 32; target and both drafters have
    them, in their configs and in the stored latent projections."""
    for folder, prefix in ((TARGET, "model.layers.1.self_attn."), (TARGET_NVFP4, "model.layers.1.self_attn."),
                           (DRAFTER, "layers.0.self_attn."), (DRAFTER3, "layers.0.self_attn.")):
        cfg = json.loads((folder / "config.json").read_text())
        assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64), folder.name
        assert cfg["qk_nope_head_dim"] % 32 == 0 and cfg["v_head_dim"] % 32 == 0, folder.name
        tensors = load_file(str(folder / "model.safetensors"))
        heads = cfg["num_attention_heads"]
        assert tensors[prefix + "kv_a_proj_with_mqa.weight"].shape[0] == 576, folder.name
        assert tuple(tensors[prefix + "kv_b_proj.weight"].shape) == (
            heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), 512), folder.name
        assert tuple(tensors[prefix + "kv_a_layernorm.weight"].shape) == (512,), folder.name


def test_committed_example_inspects_clean_with_max_positions_from_the_target(cli):
    for folder in (TARGET, TARGET_NVFP4):
        code, out, err = cli("inspect", folder, "--json")
        assert code == 0 and json.loads(out)["problems"] == [], (folder, err)
    for drafter in (DRAFTER, DRAFTER3):  # both drafters' rope (yarn 64 over 4096) is both targets'
        for target in (TARGET, TARGET_NVFP4):
            code, out, err = cli("inspect", drafter, "--target", target, "--json")
            assert code == 0 and json.loads(out)["problems"] == [], (drafter.name, target.name, out, err)
    code, out, _ = cli("inspect", DRAFTER, "--target", TARGET_NVFP4, "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    assert report["config"]["attention"] == "mla" and report["eagle_version"] == "3.1"
    assert report["tapped_layers"]["output_of_layer"] == [1, 3, 4]  # {1, N//2-1, N-4}, as [1, 29, 57] for 61
    assert "max_position_embeddings" not in json.loads((DRAFTER / "config.json").read_text())
    # Kimi-K2-Instruct-0905's context (yarn 4096 x 64), the rope the drafter's config states
    assert report["config"]["max_position_embeddings"] == 262144 == read_target_config(TARGET)["max_position_embeddings"]
    assert report["config"]["max_position_source"] == "target" and "from the target" in report["max_positions"]
    code, out, _ = cli("inspect", DRAFTER, "--json")
    assert json.loads(out)["config"]["max_position_source"] == "rope_scaling"  # 4096 * 64, without a target


def test_committed_example_exports(cli, tmp_path):
    import onnx

    from eagle31_export.export.onnx_plugins import DOMAIN

    for kind in ("onnx", "trtllm", "vllm", "sglang"):
        code, _, err = cli("export", kind, "--drafter", DRAFTER, "--target", TARGET_NVFP4, "--out", tmp_path / kind,
                           *(["--chain-depth", "3"] if kind == "onnx" else []))
        assert code == 0, (kind, err)
    meta = json.loads((tmp_path / "onnx" / "graphs.json").read_text())
    assert "target" not in meta and "kimi_k2" in meta["no_target_graph"]  # an MoE target: drafter graphs only
    assert meta["drafter"]["max_positions"] == 262144  # from the target, not 2048
    for role in ("first", "next", "chain"):
        graph = onnx.load(str(tmp_path / "onnx" / f"drafter_{role}.onnx"), load_external_data=False)
        assert any(n.domain == DOMAIN for n in graph.graph.node), role  # fused fc_norm / post-norm plugin nodes
    for kind in ("trtllm", "vllm", "sglang"):
        cfg = json.loads((tmp_path / kind / "drafter" / "config.json").read_text())
        assert cfg["max_position_embeddings"] == 262144 and cfg["kv_lora_rank"] == 512, kind  # vLLM CPU MLA: 512 + 64
    code, _, err = cli("export", "triton", "--bundle", tmp_path / "trtllm", "--out", tmp_path / "repo", "--flavor", "cpu")
    assert code == 0, err


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "kimi.jsonl"
    prompts = EmbeddedPair.open(MODELS).token_prompts()[:3]
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def all_prompts_file(tmp_path_factory):
    """The pair's 8 prompts. The drafter can lean on the token it is fed (the language is first-order
    Markov), so a tap shifted by one layer moves its first-step logits (by ~0.5-1) but flips a greedy
    draft only now and then: 3 prompts x 12 tokens saw none; these 8 x 32 see several."""
    path = tmp_path_factory.mktemp("prompts") / "kimi-all.jsonl"
    prompts = EmbeddedPair.open(MODELS).token_prompts()
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return path


@pytest.mark.parametrize("target,act_quant", [(TARGET, False), (TARGET_NVFP4, False), (TARGET_NVFP4, True)],
                         ids=["bf16", "nvfp4-w4a16", "nvfp4-w4a4"])
def test_parity_on_onnxruntime_passes(cli, tmp_path, prompts_file, target, act_quant):
    code, _, err = cli("parity", "--drafter", DRAFTER, "--target", target, "--runtime", "onnxruntime",
                       "--prompts", prompts_file, "--depth", "3", "--max-new-tokens", "12", "--out", tmp_path / "r",
                       *(["--act-quant"] if act_quant else []))
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert code == 0 and report["passed"], (err, report["failures"])
    assert report["tau_reference"] > 1.5  # a trained pair: accepted drafts are compared too
    assert max(r["first_logits_max_abs_diff"] for r in report["prompts"]) < 1e-3


def _sabotaged_export(tmp_path, bug):
    import sys

    from eagle31_export.export.onnx_export import export_onnx

    sys.path.insert(0, str(ROOT / "tests" / "parity"))
    from sabotage import drop_fc_norm, pre_norm_feedback, shift_aux_ids

    sabotage = {"shifted_ids": lambda c: shift_aux_ids(c, 8), "pre_norm": pre_norm_feedback,
                "no_fc_norm": drop_fc_norm}[bug]
    drafter = write_drafter(sabotage(read_drafter(DRAFTER)), tmp_path / "drafter", "modelopt")
    return export_onnx(drafter, tmp_path / "onnx", TARGET_NVFP4)


@pytest.mark.parametrize("bug,symptom", [
    ("shifted_ids", "first-step draft logits differ"),
    ("pre_norm", "first-step drafts agree, later drafts differ: fed-back state"),
    ("no_fc_norm", "first-step draft logits differ"),
])
def test_sabotaged_exports_are_caught(cli, tmp_path, prompts_file, all_prompts_file, bug, symptom):
    bundle = _sabotaged_export(tmp_path, bug)
    prompts, tokens = (all_prompts_file, "32") if bug == "shifted_ids" else (prompts_file, "12")
    code, _, _ = cli("parity", bundle, "--drafter", DRAFTER, "--target", TARGET_NVFP4, "--runtime", "onnxruntime",
                     "--prompts", prompts, "--depth", "3", "--max-new-tokens", tokens, "--out", tmp_path / "r")
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert code == 1 and report["passed"] is False
    assert any(symptom in f for f in report["failures"]), report["failures"]


def test_a_target_with_reciprocal_global_scales_is_refused_by_export(tmp_path):
    """compressed-tensors' reciprocal global scale written where ModelOpt's belongs: every routed
    expert then implies weights in the millions, and the export refuses the file before writing."""
    broken = tmp_path / "target-nvfp4-inverted"
    shutil.copytree(TARGET_NVFP4, broken)
    (broken / "manifest.json").unlink()
    tensors = load_file(str(broken / "model.safetensors"))
    save_file({k: (1.0 / v if k.endswith("weight_scale_2") else v) for k, v in tensors.items()},
              str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="336 of 336 NVFP4 Linears .* looks written as its reciprocal"):
        export_onnx(DRAFTER, tmp_path / "onnx", broken)
    assert not (tmp_path / "onnx").exists()


# ---- published layouts and their readings -----------------------------------------------------

def test_published_exclusion_list_without_the_router_is_servable(tmp_path):
    """nvidia/Kimi-K2.6-NVFP4 lists layer 0, each self_attn and shared_experts and lm_head, not the BF16
    router: runtimes build DeepSeek-style routers unquantized, so it is no problem; for an architecture
    whose runtimes quantize an unlisted router (Qwen3-MoE) it is."""
    from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
    from eagle31_export.formats.target.checkpoint import inspect_target

    folder = tmp_path / "published"
    shutil.copytree(TARGET_NVFP4, folder)
    (folder / "manifest.json").unlink()
    quant = json.loads((folder / "hf_quant_config.json").read_text())
    quant["quantization"]["exclude_modules"] = ["lm_head", "model.layers.0*"] + [
        f"model.layers.{i}.{m}*" for i in range(1, 8) for m in ("mlp.shared_experts", "self_attn")]
    (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    assert inspect_target(folder)["problems"] == []
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="qwen3_moe")))
    problems = NVFP4Checkpoint.open(folder).problems
    assert any("model.layers.1.mlp.gate is stored unquantized" in p for p in problems)


def test_torchspec_vllm_export_of_a_kimi_drafter_is_read_back_by_one(tmp_path):
    """TorchSpec's converter adds 1 to a kimi_k2 drafter's ids when it writes `layers.0.*` for vLLM and marks
    the config with `_torchspec_version`; a config without that mark is read as written."""
    for marked, expected in ((True, (1, 3, 4)), (False, (2, 4, 5))):
        folder = tmp_path / str(marked)
        shutil.copytree(DRAFTER, folder)
        config = json.loads((folder / "config.json").read_text())
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
        if marked:
            config["_torchspec_version"] = "0.1.0"
        (folder / "config.json").write_text(json.dumps(config))
        assert read_drafter(folder).config.aux_layer_ids == expected


def test_bad_moe_and_mla_input_is_one_line(cli, tmp_path):
    def variant(src, name, config=None, drop=None):
        folder = tmp_path / name
        shutil.copytree(src, folder)
        (folder / "manifest.json").unlink(missing_ok=True)
        if config:
            (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                            **config}))
        if drop:
            tensors = load_file(str(folder / "model.safetensors"))
            save_file({k: v for k, v in tensors.items() if k != drop}, str(folder / "model.safetensors"))
        return folder

    cases = [
        (DRAFTER, variant(TARGET, "fewer", {"n_routed_experts": 12}), "expert 12 of model.layers.1.mlp.experts"),
        (DRAFTER, variant(TARGET, "more", {"n_routed_experts": 20}), "expert 16 is missing"),
        (DRAFTER, variant(TARGET_NVFP4, "q-fewer", {"n_routed_experts": 12}), "config.json gives it 12 routed experts"),
        (DRAFTER, variant(TARGET_NVFP4, "no-scale", drop="model.layers.2.mlp.experts.5.up_proj.weight_scale"),
         "model.layers.2.mlp.experts.5.up_proj.weight_scale is missing"),
        (DRAFTER, variant(TARGET, "rank", {"kv_lora_rank": 8}), "kv_a_layernorm.weight: shape [512]"),
        (DRAFTER, variant(TARGET, "moe-width", {"moe_intermediate_size": 48}), "(moe_intermediate_size"),
        (variant(DRAFTER, "d-rank", {"kv_lora_rank": 8}), TARGET, "kv_a_proj_with_mqa.weight: shape [576, 128]"),
    ]
    for drafter, target, fragment in cases:
        code, _, err = cli("speculate", "--drafter", drafter, "--target", target, "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "2")
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and fragment in err, (target, err)


def test_demo_pair_by_name_and_its_prompts():
    assert pair_folder("kimi") == Path("examples/kimi/models")
    assert pair_folder("examples/kimi/models") == Path("examples/kimi/models")
    pair = EmbeddedPair.open(MODELS)
    assert not pair.has_text and pair.name == "kimi"
    prompts = pair.prompts()
    assert len(prompts) == 8 and all(16 <= len(p) <= 64 for p in prompts)
    assert pair.mixed_length_prompts() == prompts and pair.agreement_windows(262) == prompts


def test_teacher_forced_mla_chain_matches_inference():
    """The teacher-forced chain (`diagnose`, demo agreement) computes what the MLA drafter runs."""
    from eagle31_export.reference.drafter import build_drafter

    drafter = build_drafter(read_drafter(DRAFTER), dtype=torch.float64)
    t, unroll = 5, 3
    x = torch.randint(0, 768, (1, t + unroll + 1))
    taps = torch.randn(1, t, drafter.cfg.fc_in_features, dtype=torch.float64)
    assert_ttt_matches_inference(drafter, taps, x, unroll)


def test_precompiled_exclusion_matching_equals_the_rule():
    """`is_excluded` (precompiled for lists naming every layer of a 61-layer MoE) against the plain rule
    (exact, substring, fnmatch, "re:", vLLM's fused names) on patterns and modules of every kind."""
    import random

    from eagle31_export.formats.nvfp4.scheme import is_excluded, pattern_matches, unmatched_patterns

    patterns = ["lm_head", "model.layers.0*", "model.layers.1.self_attn*", "*mlp.gate", "qkv_proj", "ab*", "ab?",
                "model.layers.2.mlp.gate_up_proj", r"re:.*experts\.1\d\..*", "embed", "*.experts.*", "x[0-9]y",
                "model.layers.*.self_attn.qkv_proj", "model.layers.5*", "nothing.matches.this"]
    modules = ["lm_head", "model.layers.0.mlp.gate_proj", "model.layers.10.self_attn.q_proj", "model.layers.2.mlp.gate",
               "model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.2.mlp.up_proj", "model.embed_tokens",
               "model.layers.3.mlp.experts.12.up_proj", "model.layers.3.mlp.shared_experts.up_proj", "x5y", "abc",
               "ab", "q_proj", "model.layers.7.self_attn.v_proj", "model.layers.50.mlp.experts.3.down_proj"]
    rng = random.Random(0)
    for _ in range(300):
        chosen = rng.sample(patterns, rng.randint(1, 6))
        for module in modules:
            assert is_excluded(module, chosen) == any(pattern_matches(p, module) for p in chosen), (chosen, module)
    assert unmatched_patterns(patterns, modules) == ["nothing.matches.this"]


def test_speculate_on_a_drafter_only_export_uses_the_target_it_was_exported_for(cli, tmp_path):
    from eagle31_export.export.onnx_export import export_onnx

    export_onnx(DRAFTER, tmp_path / "onnx", TARGET_NVFP4)
    common = ["--prompt-ids", "11,12,13,14,15", "--max-new-tokens", "12", "--depth", "3", "--json"]
    code, ref, _ = cli("speculate", "--drafter", DRAFTER, "--target", TARGET_NVFP4, *common)
    code2, ort, err = cli("speculate", "--runtime", "onnxruntime", "--onnx", tmp_path / "onnx", *common)
    assert code == code2 == 0, err
    assert json.loads(ort)["tokens"] == json.loads(ref)["tokens"] and json.loads(ort)["drafts"] == json.loads(ref)["drafts"]


def test_published_kimi_k2_configs_at_full_size_on_the_meta_device():
    """The published configs themselves (7168 hidden, 61 layers, 384 experts), built without weights:
    the kimi_k2 alias, the experts' slots for the published tensor names, the drafter's taps and its
    max_position_embeddings from the target."""
    from transformers import AutoModelForCausalLM

    from eagle31_export.config import TargetInfo, with_max_positions
    from eagle31_export.formats.drafter.formats import detect_format
    from eagle31_export.formats.experts import ExpertLayout

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(MAKE.PUBLISHED_TARGET))
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and len(model.model.layers) == 61
    slot = ExpertLayout.of(model).slot("model.layers.60.mlp.experts.383.up_proj.weight")
    fused = dict(model.named_parameters())[slot.param]
    assert (slot.param, slot.expert, tuple(fused.shape)) == ("model.layers.60.mlp.experts.gate_up_proj", 383,
                                                             (384, 2 * 2048, 7168))
    assert fused[slot.expert, slot.rows(tuple(fused.shape))].shape == (2048, 7168)
    assert not hasattr(model.model.layers[0].mlp, "experts")  # first_k_dense_replace: 1
    cfg, _ = detect_format(MAKE.PUBLISHED_DRAFTER, ["layers.0.self_attn.q_a_proj.weight"]).read_config(
        MAKE.PUBLISHED_DRAFTER)
    target = TargetInfo.from_hf_config(MAKE.PUBLISHED_TARGET)
    assert cfg.resolved_aux_layer_ids(target.num_hidden_layers) == (1, 29, 57)
    assert cfg.max_position_source == "default"
    assert with_max_positions(cfg, target).max_position_embeddings == 262144
