"""Make the scaled-down Kimi-shaped pair in `examples/kimi/models` (or a published-shape one).

    python examples/kimi/make_pair.py --out examples/kimi/models            # the committed example
    python examples/kimi/make_pair.py --out out/kimi-published --shape published

Every config key and tensor name is the published one (docs/drafter-formats.md#mla-drafter,
docs/nvfp4.md#published-nvfp4-moe-targets); only sizes are scaled down:

- `target/`: a Kimi K2 target as moonshotai publishes it (Kimi-K2-Instruct-0905's config):
  `model_type: kimi_k2`, architecture `DeepseekV3ForCausalLM` (with its `auto_map`, never executed),
  MLA attention, yarn rope (factor 64 over 4096 positions, the drafters' own), layer 0
  dense (`first_k_dense_replace: 1`), then MoE layers with a sigmoid `noaux_tc` router
  (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`), routed experts stored one by one
  (`mlp.experts.E.{gate,up,down}_proj`) and a shared expert; bf16.
- `target-nvfp4/`: that target quantized by `eagle31-export quantize` (ModelOpt layout) with the
  exclusions of nvidia/Kimi-K2.6-NVFP4: layer 0, every attention, the shared experts and lm_head
  stay BF16; the routers are not listed (runtimes never quantize them).
- `drafter-eagle31/` and `drafter-eagle3/`: the `eagle3.1-mla` / `eagle3-mla` drafters in the
  layout SGLang's `kimi_k25_eagle3.py` loads (`layers.0.*`, `fc`, `fc_norm.{i}`, `norm`,
  `embed_tokens`, `lm_head`), config keys as TorchSpec's `kimi_k25_eagle3_mla.json` (no
  `max_position_embeddings`: it comes from the target), tapped layers EAGLE-3's default
  {1, N//2-1, N-4} (= [1, 29, 57] for Kimi's 61 layers).
- `prompts.json`: seeded token-id prompts (the pair has no tokenizer), what `demo --pair kimi` runs.

Weights start random (seeded). With `--train-steps N` (default 300; 0 keeps them random) the
target is trained briefly on a synthetic Markov-chain language (each token is followed by a fixed
successor, 10% of the time by a random token), and each drafter's first step is then fitted to
the target's own predictions on that language (through `fc` from the tapped states), so that
acceptance lengths mean something. `prompts.json` holds prompts from the same language.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# moonshotai/Kimi-K2-Instruct-0905 config.json: moonshotai/Kimi-K2-Instruct's (ai-dynamo/aiconfigurator
# aic-core/src/aiconfigurator_core/model_configs/moonshotai--Kimi-K2-Instruct_config.json) with the
# 0905 release's 256K context, yarn factor 64 over 4096 positions = max_position_embeddings 262144
# (its rope_scaling as ParagEkbote/hf-model-inspector model_inspection_report.md reads it from the
# Hub: beta_fast 1.0, beta_slow 1.0, factor 64.0, mscale 1.0, mscale_all_dim 1.0,
# original_max_position_embeddings 4096, yarn), the rope the drafter below was trained with; without
# the FP8 `quantization_config` of that release: the bf16 copy here is unquantized. The K2.5/K2.6
# text_config (aiconfigurator nvidia--Kimi-K2.6-NVFP4_config.json) has the same factor and 262144
# positions but yarn beta_fast 32.0, which TorchSpec's drafter config does not state (1.0).
PUBLISHED_TARGET = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 262144, "model_type": "kimi_k2", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.48.3", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840,
}
# lightseekorg/TorchSpec configs/draft_models/kimi_k25_eagle3_mla.json, plus the two EAGLE 3.1
# flags of the eagle3.1-mla checkpoint (sgl-project/sglang python/sglang/srt/models/kimi_k25_eagle3.py)
# and draft_vocab_size as TorchSpec's converter writes it.
PUBLISHED_DRAFTER = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "vocab_size": 163840, "draft_vocab_size": 163840,
    "torch_dtype": "bfloat16", "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True,
                     "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                     "use_mtp_layernorm": False},
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 0,
}

# Sizes of the two shapes; every other key keeps its published value.
SHAPES = {
    # the committed example: a few MB. The MLA latent keeps its published width, kv_lora_rank 512 +
    # qk_rope_head_dim 64 = 576, the only one vLLM's CPU MLA backends take (CPU_MLA and AMX_MLA:
    # get_supported_head_sizes() == [576], vllm/v1/attention/backends/mla/cpu_mla.py, amx_mla.py);
    # qk_nope_head_dim and v_head_dim are multiples of 32, as AMX_MLA's packed bf16 GEMMs need them
    # (convert_weight_packed: "invalid weight input features 16"; bmm_cpu: "tinygemm requires N to be
    # 32x"). Two heads keep the latent projections (kv_b_proj: heads * 64 x 512) small.
    "example": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
                    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4,
                    q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                    vocab_size=1024, drafter_intermediate_size=128),
    # every published dimension that fits one small machine: 61 layers (taps [1, 29, 57]), 384 experts,
    # top-8, the MLA ranks and head dims, the vocabulary; hidden sizes and head count scaled down
    "published": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=32, num_hidden_layers=61,
                      num_attention_heads=2, num_key_value_heads=2, n_routed_experts=384, num_experts_per_tok=8,
                      q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, vocab_size=163840, drafter_intermediate_size=512),
}


def target_config(shape: dict) -> dict:
    cfg = json.loads(json.dumps(PUBLISHED_TARGET))
    cfg.update({k: v for k, v in shape.items() if k in cfg})
    scale = shape["vocab_size"] - PUBLISHED_TARGET["vocab_size"]  # special ids keep their distance to the end
    cfg["bos_token_id"] += scale
    cfg["eos_token_id"] += scale
    return cfg


def drafter_config(shape: dict, target: dict, eagle31: bool) -> dict:
    from eagle31_export.config import default_aux_layer_ids

    cfg = json.loads(json.dumps(PUBLISHED_DRAFTER))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size"):
        cfg[key] = shape[key]
    cfg["intermediate_size"] = shape["drafter_intermediate_size"]
    cfg["draft_vocab_size"] = shape["vocab_size"]
    cfg["bos_token_id"], cfg["eos_token_id"] = target["bos_token_id"], target["eos_token_id"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(default_aux_layer_ids(target["num_hidden_layers"]))
    if eagle31:
        cfg["fc_norm"], cfg["norm_output"] = True, True
    return cfg


# ---- the target ------------------------------------------------------------------------------

def build_target(cfg: dict, seed: int):
    """A transformers DeepseekV3ForCausalLM with seeded O(1)-scaled random weights (fp32)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from eagle31_export.formats.target.checkpoint import transformers_config

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(transformers_config(cfg), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms: around 1
                p.copy_(1.0 + 0.2 * torch.rand(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def published_target_tensors(model) -> dict[str, torch.Tensor]:
    """The state dict under the published names: routed experts one by one."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{base}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def save_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor], dtype=torch.bfloat16) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # the router's correction bias stays fp32, as the published checkpoints store it
    cast = {n: (t.to(dtype) if t.is_floating_point() and not n.endswith("e_score_correction_bias") else t).contiguous()
            for n, t in tensors.items()}
    save_file(cast, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ---- the drafters ----------------------------------------------------------------------------

def random_drafter(cfg_json: dict, target_model, seed: int):
    """A canonical drafter with seeded random weights, embeddings and head copied from the target."""
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, expected_shapes
    from eagle31_export.formats.drafter.formats import detect_format

    fmt = detect_format(cfg_json, ["layers.0.self_attn.q_a_proj.weight"])
    cfg, _ = fmt.read_config(cfg_json)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name in ("d2t", "t2d"):
            continue
        if name == "embed_tokens.weight":
            tensors[name] = target_model.get_input_embeddings().weight.detach().clone()
        elif name == "lm_head.weight":
            tensors[name] = target_model.get_output_embeddings().weight.detach().clone()
        elif len(shape) == 1:
            tensors[name] = 1.0 + 0.2 * torch.rand(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    return DrafterCheckpoint(cfg, tensors)


class MarkovLanguage:
    """Token t is followed by successor[t], or with probability `noise` by a random token."""

    def __init__(self, vocab: int, seed: int, noise: float = 0.1):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.noise = vocab, noise
        self.successor = torch.randperm(vocab, generator=self.gen)

    def sample(self, n: int, length: int) -> torch.Tensor:
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.vocab, (n,), generator=self.gen)
        for j in range(1, length):
            noise = torch.rand(n, generator=self.gen) < self.noise
            x[:, j] = torch.where(noise, torch.randint(0, self.vocab, (n,), generator=self.gen),
                                  self.successor[x[:, j - 1]])
        return x


def train_target(model, language: MarkovLanguage, steps: int, log) -> None:
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        x = language.sample(16, 64)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"  target step {step}: loss {loss.item():.3f}")
    model.eval()


def train_drafter(ckpt, target, language: MarkovLanguage, steps: int, log) -> None:
    """Fit the drafter's first step (taps of position j and token j+1 in) to the target's own prediction
    for token j+2, teacher-forced over whole sequences; embeddings and lm_head stay the target's."""
    from eagle31_export.reference.attention import KVCache
    from eagle31_export.reference.drafter import build_drafter
    from eagle31_export.reference.target import tapped_forward

    drafter = build_drafter(ckpt, dtype=torch.float32)
    frozen = ("embed_tokens.weight", "lm_head.weight")
    for n, p in drafter.named_parameters():
        p.requires_grad_(n not in frozen)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        x = language.sample(16, 64)
        logits, taps = tapped_forward(target, x)
        t = x.shape[1] - 1
        positions = torch.arange(t).unsqueeze(0).expand(x.shape[0], -1)
        out = drafter(x[:, 1:], positions, taps[:, :t], KVCache(), hidden_is_aux=True)
        labels = logits[:, 1:].argmax(-1)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"  drafter step {step}: loss {loss.item():.3f}")
    state = drafter.state_dict()
    for name in list(ckpt.tensors):
        if name in state and name not in frozen:
            ckpt.tensors[name] = state[name].detach().clone()


def write_sglang_drafter(folder: Path, cfg_json: dict, ckpt) -> None:
    """SGLang's kimi_k25_eagle3 layout: canonical names (`layers.0.*`), full vocabulary, no d2t/t2d."""
    tensors = {n: t for n, t in ckpt.tensors.items() if n not in ("d2t", "t2d")}
    save_checkpoint(folder, cfg_json, tensors)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=300, help="0: random weights")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from eagle31_export.formats.target.quantize import quantize_checkpoint
    from eagle31_export.reference.target import ReferenceTarget

    out: Path = args.out
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; remove it first")
    out.mkdir(parents=True, exist_ok=True)
    logfile = (out / "make_log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logfile.write(msg + "\n")

    shape = SHAPES[args.shape]
    start = time.time()
    tcfg = target_config(shape)
    model = build_target(tcfg, args.seed)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    language = MarkovLanguage(tcfg["vocab_size"] - 256, args.seed + 1)  # the last 256 ids are special
    if args.train_steps:
        train_target(model, language, args.train_steps, log)
    save_checkpoint(out / "target", tcfg, published_target_tensors(model))
    log(f"target written ({time.time() - start:.0f} s)")

    lengths = torch.randint(16, 65, (args.prompts,), generator=language.gen).tolist()
    prompts = [language.sample(1, n)[0].tolist() for n in lengths]
    (out / "prompts.json").write_text(json.dumps({"prompt_ids": prompts}) + "\n")

    model = model.to(torch.bfloat16).to(torch.float32)  # what the saved bf16 target computes
    aux = drafter_config(shape, tcfg, True)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    target = ReferenceTarget(model, tuple(aux))
    for name, eagle31 in (("drafter-eagle31", True), ("drafter-eagle3", False)):
        dcfg = drafter_config(shape, tcfg, eagle31)
        ckpt = random_drafter(dcfg, model, args.seed + (2 if eagle31 else 3))
        if args.train_steps:
            log(f"{name}: fitting its first step to the target")
            train_drafter(ckpt, target, language, args.train_steps, log)
        write_sglang_drafter(out / name, dcfg, ckpt)
    log(f"drafters written ({time.time() - start:.0f} s)")

    # experts only, as nvidia/Kimi-K2.6-NVFP4 (its exclude_modules: layer 0, every self_attn, the shared
    # experts, lm_head); calibrated on the pair's language
    quantize_checkpoint(out / "target", out / "target-nvfp4", "modelopt", experts_only=True,
                        prompts=language.sample(8, 64).tolist())
    log(f"target-nvfp4 written ({time.time() - start:.0f} s)")
    logfile.close()


if __name__ == "__main__":
    main()
