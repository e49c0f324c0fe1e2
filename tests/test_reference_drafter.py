"""The reference drafter against a hand computation, and EAGLE-3 vs EAGLE 3.1 behaviour."""

import pytest
import torch

from factories import drafter_config_for, random_drafter
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import build_drafter

torch.set_default_dtype(torch.float32)


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _hand_step(t, cfg, token, hidden, is_aux):
    """One drafter step at a single position with an empty cache, written out by hand.

    With one key, attention returns its value, so attn(u) = o_proj(v_proj(u)).
    """
    eps, ht = cfg.rms_norm_eps, cfg.effective_target_hidden_size
    if is_aux:
        parts = hidden.split(ht)
        if cfg.fc_norm:
            parts = [_rms(a, t[f"fc_norm.{i}.weight"], eps) for i, a in enumerate(parts)]
        g = t["fc.weight"] @ torch.cat(parts)
    else:
        g = hidden
    gn = _rms(g, t["layers.0.hidden_norm.weight"], eps)
    residual = gn if cfg.norm_before_residual else g
    u = torch.cat([_rms(t["embed_tokens.weight"][token], t["layers.0.input_layernorm.weight"], eps), gn])
    reps = cfg.num_attention_heads // cfg.num_key_value_heads
    v = (t["layers.0.self_attn.v_proj.weight"] @ u).view(cfg.num_key_value_heads, -1)
    h1 = residual + t["layers.0.self_attn.o_proj.weight"] @ v.repeat_interleave(reps, 0).flatten()
    x = _rms(h1, t["layers.0.post_attention_layernorm.weight"], eps)
    gate, up = t["layers.0.mlp.gate_proj.weight"] @ x, t["layers.0.mlp.up_proj.weight"] @ x
    h = h1 + t["layers.0.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
    normed = _rms(h, t["norm.weight"], eps)
    return t["lm_head.weight"] @ normed, (normed if cfg.norm_output else h)


@pytest.mark.parametrize("fc_norm,norm_output,norm_before_residual",
                         [(False, False, False), (True, True, False), (True, False, False), (False, True, True)])
def test_matches_hand_computation(llama_info, fc_norm, norm_output, norm_before_residual):
    cfg = drafter_config_for(llama_info, fc_norm=fc_norm, norm_output=norm_output,
                             norm_before_residual=norm_before_residual)
    ckpt = random_drafter(cfg, seed=5, with_embeddings=True)
    tensors = {k: v.double() if v.is_floating_point() else v for k, v in ckpt.tensors.items()}
    drafter = build_drafter(ckpt, dtype=torch.float64)
    aux = torch.randn(cfg.fc_in_features, dtype=torch.float64) * 3
    token = 17

    step = drafter(torch.tensor([[token]]), torch.tensor([[0]]), aux.view(1, 1, -1), KVCache(), True)
    logits, fed_back = _hand_step(tensors, cfg, token, aux, True)
    torch.testing.assert_close(step.logits[0, 0], logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(step.fed_back[0, 0], fed_back, rtol=1e-10, atol=1e-10)

    # a later step consumes the fed-back state directly (no fc)
    step2 = drafter(torch.tensor([[token + 1]]), torch.tensor([[0]]), fed_back.view(1, 1, -1), KVCache(), False)
    logits2, _ = _hand_step(tensors, cfg, token + 1, fed_back, False)
    torch.testing.assert_close(step2.logits[0, 0], logits2, rtol=1e-10, atol=1e-10)


def _chain(drafter, aux, tokens):
    """Draft greedily from one tapped state, feeding the drafter's own state back."""
    cache, drafts = KVCache(), []
    step = drafter(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0), aux, cache, True)
    for i in range(5):
        d = int(step.logits[0, -1].argmax())
        drafts.append(int(drafter.draft_to_target(torch.tensor([d]))[0]))
        step = drafter(torch.tensor([[drafts[-1]]]), torch.tensor([[len(tokens) + i]]),
                       step.fed_back[:, -1:], cache, False)
    return drafts


def test_same_weights_with_flags_on_and_off_draft_differently(llama_info, eagle31_ckpt):
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint

    torch.manual_seed(0)
    aux = torch.randn(1, 6, eagle31_ckpt.config.fc_in_features, dtype=torch.float64) * 4
    tokens = [5, 6, 7, 8, 9, 10]
    with_embed = dict(eagle31_ckpt.tensors, **{"embed_tokens.weight": torch.randn(256, 64)})
    drafts = {}
    for fc_norm in (False, True):
        for norm_output in (False, True):
            cfg = eagle31_ckpt.config.replace(fc_norm=fc_norm, norm_output=norm_output)
            tensors = {k: v for k, v in with_embed.items() if fc_norm or not k.startswith("fc_norm.")}
            drafter = build_drafter(DrafterCheckpoint(cfg, tensors), dtype=torch.float64)
            drafts[(fc_norm, norm_output)] = _chain(drafter, aux, tokens)
    assert drafts[(True, True)] != drafts[(False, False)]
    # fc_norm changes the first draft; norm_output only what is fed back (drafts 2..n)
    assert drafts[(True, False)] != drafts[(False, False)]
    assert drafts[(False, True)][0] == drafts[(False, False)][0]
    assert drafts[(False, True)][1:] != drafts[(False, False)][1:]


def test_cached_incremental_steps_equal_one_chunk(eagle31_ckpt):
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint

    ckpt = DrafterCheckpoint(eagle31_ckpt.config, dict(eagle31_ckpt.tensors, **{
        "embed_tokens.weight": torch.randn(256, 64)}))
    drafter = build_drafter(ckpt, dtype=torch.float64)
    aux = torch.randn(1, 7, ckpt.config.fc_in_features, dtype=torch.float64)
    ids = torch.randint(0, 256, (1, 7))
    whole = drafter(ids, torch.arange(7).unsqueeze(0), aux, KVCache(), True)
    cache, parts = KVCache(), []
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        parts.append(drafter(ids[:, lo:hi], torch.arange(lo, hi).unsqueeze(0), aux[:, lo:hi], cache, True).logits)
    torch.testing.assert_close(torch.cat(parts, 1), whole.logits, rtol=1e-10, atol=1e-10)
    cache.crop(4)
    again = drafter(ids[:, 4:], torch.arange(4, 7).unsqueeze(0), aux[:, 4:], cache, True).logits
    torch.testing.assert_close(again, whole.logits[:, 4:], rtol=1e-10, atol=1e-10)


def _assert_two_cached_chunks_equal_one(cfg, split):
    """A random drafter over 5 positions: one chunk, and two chunks split at `split` through one
    cache, give the same logits. Returns the one-chunk logits."""
    drafter = build_drafter(random_drafter(cfg, with_embeddings=True), dtype=torch.float64)
    aux = torch.randn(1, 5, cfg.fc_in_features, dtype=torch.float64)
    ids = torch.randint(0, 256, (1, 5))
    whole = drafter(ids, torch.arange(5).unsqueeze(0), aux, KVCache(), True)
    cache = KVCache()
    first = drafter(ids[:, :split], torch.arange(split).unsqueeze(0), aux[:, :split], cache, True).logits
    rest = drafter(ids[:, split:], torch.arange(split, 5).unsqueeze(0), aux[:, split:], cache, True).logits
    torch.testing.assert_close(torch.cat([first, rest], 1), whole.logits, rtol=1e-10, atol=1e-10)
    return whole.logits


def test_mla_drafter_runs_and_caches_consistently(llama_info):
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, mla=True)
    logits = _assert_two_cached_chunks_equal_one(cfg, split=2)
    assert torch.isfinite(logits).all()


def test_two_layer_drafter_caches_consistently(llama_info):
    # Later layers must see the same past length as layer 0 (not layer 0's freshly appended keys).
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, num_layers=2)
    _assert_two_cached_chunks_equal_one(cfg, split=3)
