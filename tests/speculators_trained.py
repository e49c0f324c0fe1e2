"""A drafter in speculators' own EAGLE 3.1 layout (norm_before_fc + norm_output, what speculators 0.9.0
trains when neither flag is set), written by speculators' own classes.

Its weights come from the tiny pair's trained EAGLE 3.1 drafter, so that it drafts well enough for parity
to see accepted drafts at every position: the per-tap norms (fc_norm) become one norm over fc's whole input
(norm_before_fc), each tap's block of that norm's weight scaled by how the tap's RMS compares with the
whole input's on held-out text (the two norms then agree on average, not exactly). The drafter is a
drafter of its own; the reference runs it as written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31_export.demo.pair import EmbeddedPair
from eagle31_export.formats.drafter.checkpoint import read_drafter
from eagle31_export.formats.safetensors_io import SafetensorsDir
from eagle31_export.reference.target import load_target, tapped_forward


def fc_input_norm_weight(pair_dir: Path, drafter: Path) -> torch.Tensor:
    """norm_before_fc's weight [k * H_t] standing in for the drafter's k fc_norm weights [H_t] each."""
    ckpt = read_drafter(drafter)
    cfg, pair = ckpt.config, EmbeddedPair.open(pair_dir)
    ids = cfg.resolved_aux_layer_ids(8)
    target = load_target(pair.target, ids)
    windows = torch.tensor(pair.agreement_windows(128, 4))
    _, taps = tapped_forward(target, windows)  # [B, T, k * H_t]
    chunks = taps.float().chunk(cfg.num_aux_hidden_states, dim=-1)
    whole = taps.float().pow(2).mean(-1).sqrt()
    blocks = []
    for i, chunk in enumerate(chunks):
        ratio = (whole / chunk.pow(2).mean(-1).sqrt()).median()  # RMSNorm(whole) x ratio ~ RMSNorm(chunk)
        blocks.append(ckpt.tensors[f"fc_norm.{i}.weight"].float() * ratio)
    return torch.cat(blocks)


def write_speculators_31(pair_dir: Path, drafter: Path, target: Path, out: Path) -> Path:
    """`drafter` (fc_norm + norm_output) as speculators' EAGLE 3.1 (norm_before_fc + norm_output), saved by
    speculators' Eagle3DraftModel.save_pretrained with `target` as its verifier."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    ckpt = read_drafter(drafter)
    cfg = ckpt.config
    layer = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_layers,
                        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                        max_position_embeddings=cfg.max_position_embeddings, hidden_act=cfg.hidden_act)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg.draft_vocab_size, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in cfg.resolved_aux_layer_ids(8)],  # before layer i
        norm_before_fc=True, norm_output=True,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config)
    state = {n: t.float() for n, t in ckpt.tensors.items() if not n.startswith("fc_norm.")}
    state["input_norm.weight"] = fc_input_norm_weight(pair_dir, drafter)
    state["embed_tokens.weight"] = SafetensorsDir(target)["model.embed_tokens.weight"].float()  # speculators keeps its own
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"verifier_norm.weight", "verifier_lm_head.weight"}, missing
    model.save_pretrained(str(out))
    return out
