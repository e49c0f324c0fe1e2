"""The reference holds weights as stored (bf16 as bf16, NVFP4 packed) and computes in the requested
dtype per operation: the same numbers as weights loaded in that dtype, at about the checkpoint's bytes."""

import pytest
import torch
from torch import nn

from factories import drafter_config_for, make_target, random_drafter
from eagle31_export.formats.nvfp4 import model as nvfp4_model
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
from eagle31_export.formats.nvfp4.model import NVFP4Linear
from eagle31_export.formats.target.quantize import quantize_checkpoint
from eagle31_export.formats.safetensors_io import SafetensorsDir
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_info
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.pair import load_pair
from eagle31_export.reference.speculate import ReferenceDrafterBackend, speculate
from eagle31_export.reference.target import ReferenceTarget, load_target
from eagle31_export.reference.upcast import UpcastEmbedding, UpcastLinear, chunked_linear, compute_in, stored_bytes

IDS = torch.tensor([[11, 42, 7, 199, 3, 64, 128, 5, 17, 90]])
AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A bf16 target and a bf16 drafter without its own embeddings (it takes the target's)."""
    root = tmp_path_factory.mktemp("memory")
    target = make_target(root / "target", "llama", seed=3, num_layers=3, dtype=torch.bfloat16)
    cfg = drafter_config_for(read_target_info(target), fc_norm=True, norm_output=True, aux_layer_ids=AUX)
    ckpt = random_drafter(cfg, seed=4)
    bf16 = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in ckpt.tensors.items()}
    drafter = write_drafter(DrafterCheckpoint(cfg, bf16), root / "drafter", "speculators")
    return target, drafter


def fp32_reference(target_dir, drafter_dir):
    """What the reference held before: every weight loaded in fp32, the drafter's embeddings a copy."""
    model = load_causal_lm(target_dir, dtype=torch.float32)
    ckpt = read_drafter(drafter_dir)
    tensors = {n: (t.float() if t.is_floating_point() else t) for n, t in ckpt.tensors.items()}
    tensors["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    drafter = build_drafter(DrafterCheckpoint(ckpt.config, tensors), torch.float32)
    return ReferenceTarget(model, AUX), drafter


def drafts(target: ReferenceTarget, drafter: nn.Module):
    """Target logits and taps over IDS, then two chained drafter steps (logits and fed-back states)."""
    target.reset()
    logits, taps = target.forward(IDS)
    cache, t = KVCache(), IDS.shape[1]
    positions = torch.arange(t).unsqueeze(0)
    step = drafter(IDS, positions, taps, cache, True)
    nxt = step.logits[:, -1:].argmax(-1)
    step2 = drafter(drafter.draft_to_target(nxt), torch.tensor([[t]]), step.fed_back[:, -1:], cache, False)
    return logits, taps, step.logits, step.fed_back, step2.logits


def test_bf16_pair_stays_bf16_and_computes_as_fp32(bf16_pair):
    target_dir, drafter_dir = bf16_pair
    pair = load_pair(drafter_dir, target_dir, dtype=torch.float32)
    model, drafter = pair.target.model, pair.drafter.drafter
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is UpcastLinear and m.weight.dtype == torch.bfloat16 for m in linears)
    assert type(model.get_input_embeddings()) is UpcastEmbedding
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    # held: the checkpoint's bytes plus the norms cast once to fp32 (a few hidden-size vectors)
    checkpoint = SafetensorsDir(target_dir).nbytes()
    assert checkpoint <= stored_bytes(model) < 1.05 * checkpoint
    for name in ("lm_head", "layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"):
        assert drafter.get_submodule(name).weight.dtype == torch.bfloat16, name
    assert drafter.fc.weight.dtype == torch.float32  # the fused fc_norm takes it as a tensor; also the compute dtype

    old_target, old_drafter = fp32_reference(target_dir, drafter_dir)
    assert next(old_target.model.parameters()).dtype == torch.float32
    with torch.no_grad():
        for new, old in zip(drafts(pair.target, drafter), drafts(old_target, old_drafter)):
            assert new.dtype == torch.float32 and torch.equal(new, old)
    spec = lambda t, d: speculate(t, ReferenceDrafterBackend(d), IDS[0].tolist(), 12, 3)  # noqa: E731
    new, old = spec(pair.target, drafter), spec(old_target, old_drafter)
    assert (new.tokens, new.drafts) == (old.tokens, old.drafts)


def test_drafter_shares_the_targets_embedding_tensor(bf16_pair):
    target_dir, drafter_dir = bf16_pair
    pair = load_pair(drafter_dir, target_dir, dtype=torch.float32)
    mine = pair.drafter.drafter.embed_tokens.weight
    theirs = pair.target.model.get_input_embeddings().weight
    assert mine.data_ptr() == theirs.data_ptr() and mine.dtype == torch.bfloat16
    # a target loaded dense in the compute dtype (export) is shared as well
    model = load_causal_lm(target_dir, dtype=torch.float32)
    drafter = build_drafter(read_drafter(drafter_dir), torch.float32, target_model=model)
    assert drafter.embed_tokens.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_fp32_checkpoint_with_bf16_compute_is_cast_once(tmp_path):
    target_dir = make_target(tmp_path / "t", "llama", seed=1, num_layers=2)
    ref = load_target(target_dir, (0, 1), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ref.model.parameters())
    assert not any(isinstance(m, (UpcastLinear, UpcastEmbedding)) for m in ref.model.modules())
    old = ReferenceTarget(load_causal_lm(target_dir, dtype=torch.bfloat16), (0, 1))
    for new, was in zip(ref.forward(IDS), old.forward(IDS)):
        assert torch.equal(new, was)


def test_chunked_linear_matches_one_gemm():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=gen)
    w, b = torch.randn(100, 48, generator=gen).bfloat16(), torch.randn(100, generator=gen).bfloat16()
    whole = nn.functional.linear(x, w.float(), b.float())
    blocks = chunked_linear(x, w, b, torch.float32, chunk_bytes=48 * 4 * 7)  # 7 rows a block, 15 blocks
    assert blocks.shape == whole.shape and (blocks - whole).abs().max() <= 1e-6 * whole.abs().max()


def test_large_module_parameters_are_cast_around_each_call_only():
    class Experts(nn.Module):  # stands for a fused MoE experts module: its own large 3-D parameter
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 600, 512).bfloat16())

        def forward(self, x):
            assert self.w.dtype == torch.float32
            return torch.einsum("eoi,ti->teo", self.w, x)

    module = compute_in(Experts(), torch.float32)
    x = torch.randn(3, 512)
    expected = torch.einsum("eoi,ti->teo", module.w.float(), x)
    assert torch.equal(module(x), expected) and module.w.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def nvfp4_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4-memory")
    src = make_target(root / "src", "qwen3", seed=5, num_layers=3, dtype=torch.bfloat16)
    return quantize_checkpoint(src, root / "nvfp4", "modelopt").out


@pytest.mark.parametrize("act_quant", [False, True])
def test_nvfp4_stays_packed_and_is_bit_identical_to_dense(nvfp4_target, act_quant, monkeypatch):
    ref = load_target(nvfp4_target, AUX, dtype=torch.float32, act_quant=act_quant)
    packed = {n: m for n, m in ref.model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(packed) == 3 * 7
    for m in packed.values():
        assert m.weight_packed.dtype == torch.uint8 and m.weight_scale.dtype == torch.float8_e4m3fn
        assert (m.input_global_scale is not None) == act_quant
    dense = ReferenceTarget(load_causal_lm(nvfp4_target, dtype=torch.float32, act_quant=act_quant), AUX)
    dense_bytes = stored_bytes(dense.model)
    assert stored_bytes(ref.model) < 0.5 * dense_bytes  # mostly embeddings here; Linears alone are ~1/7
    for name, m in packed.items():
        assert torch.equal(m.dense_weight(torch.float32), dense.model.get_submodule(name).weight)
    expected = dense.forward(IDS)
    for new, old in zip(ref.forward(IDS), expected):
        assert torch.equal(new, old)
    # dequantized by blocks of output rows (a large Linear): the same to fp32 rounding
    monkeypatch.setattr(nvfp4_model, "DEQUANT_CHUNK_BYTES", 64 * 4 * 5)
    ref.reset()
    for new, old in zip(ref.forward(IDS), expected):
        assert (new - old).abs().max() <= 1e-5 * old.abs().max()


@pytest.fixture(scope="module")
def deepseek_bf16(tmp_path_factory):
    """A DeepSeek-V3 (Kimi K2 keys) target stored as published: bf16, the routing bias in fp32."""
    from factories import kimi_make_pair_module

    make = kimi_make_pair_module()
    cfg = make.target_config(dict(make.SHAPES["example"], num_hidden_layers=3, n_routed_experts=8,
                                  num_experts_per_tok=2))
    model = make.build_target(cfg, seed=2)
    folder = tmp_path_factory.mktemp("dsv3") / "bf16"
    make.save_checkpoint(folder, cfg, make.published_target_tensors(model))
    return folder


def test_deepseek_v3_target_stays_bf16_and_computes_as_fp32(deepseek_bf16, monkeypatch):
    from eagle31_export.reference import upcast

    # as at full size, the fused expert parameters are cast around each call, not once
    monkeypatch.setattr(upcast, "SMALL_NUMEL", 1000)
    ref = load_target(deepseek_bf16, (0, 2), dtype=torch.float32)
    experts = [m for n, m in ref.model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(m.gate_up_proj.dtype == torch.bfloat16 and hasattr(m, "_stored_forward") for m in experts)
    bias = [b for n, b in ref.model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert bias and all(b.dtype == torch.float32 for b in bias)
    old = ReferenceTarget(load_causal_lm(deepseek_bf16, dtype=torch.float32), (0, 2))
    for new, was in zip(ref.forward(IDS), old.forward(IDS)):
        assert torch.equal(new, was)
    assert all(m.gate_up_proj.dtype == torch.bfloat16 for m in experts)  # restored after the call


def test_qwen3_bf16_target_computes_as_fp32(tmp_path):
    target_dir = make_target(tmp_path / "q", "qwen3", seed=2, num_layers=2, dtype=torch.bfloat16)
    ref = load_target(target_dir, (0, 1), dtype=torch.float32)
    assert ref.model.get_submodule("model.layers.0.self_attn.q_proj").weight.dtype == torch.bfloat16
    old = ReferenceTarget(load_causal_lm(target_dir, dtype=torch.float32), (0, 1))
    for new, was in zip(ref.forward(IDS), old.forward(IDS)):
        assert torch.equal(new, was)


def test_tensors_stored_wider_than_most_keep_their_values(tmp_path):
    """bf16 Linears with fp32 norms whose values bf16 cannot hold: the norms are not rounded."""
    from safetensors.torch import load_file, save_file

    folder = make_target(tmp_path / "mixed", "llama", seed=6, num_layers=2)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        tensors[name] = 1 + 0.01 * torch.randn(t.shape, generator=gen) if t.dim() == 1 else t.to(torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ref = load_target(folder, (0, 1), dtype=torch.float32)
    assert ref.model.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.bfloat16
    assert torch.equal(ref.model.get_submodule("model.norm").weight, tensors["model.norm.weight"])
    old = ReferenceTarget(load_causal_lm(folder, dtype=torch.float32), (0, 1))
    for new, was in zip(ref.forward(IDS), old.forward(IDS)):
        assert torch.equal(new, was)


def test_grouped_keys_are_read_in_place_with_transformers_own_numbers(bf16_pair, monkeypatch):
    """Over a cache (a chunked prefill, a verification) transformers' `sdpa` attention repeats a GQA
    layer's keys and values per query head; the reference target hands them to SDPA grouped
    (reference/grouped_sdpa.py): no repeat at all, and bit for bit transformers' logits."""
    import transformers.integrations.sdpa_attention as hf_sdpa
    from transformers import DynamicCache

    target_dir, _ = bf16_pair
    plain = load_causal_lm(target_dir, dtype=torch.float32)
    assert plain.config.num_key_value_heads < plain.config.num_attention_heads
    ids = torch.randint(0, plain.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    cache, want = DynamicCache(), []
    for piece in (ids[:, :24], ids[:, 24:36], ids[:, 36:]):  # a prompt in pieces, then a 4-token verify
        want.append(plain(input_ids=piece, past_key_values=cache, use_cache=True).logits)
    target = load_target(target_dir, AUX)
    repeat = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: pytest.fail("keys repeated per query head") or repeat(*a))
    target.reset()
    for piece, logits in zip((ids[:, :24], ids[:, 24:36], ids[:, 36:]), want):
        assert torch.equal(target.forward(piece)[0], logits)


def _pages_mapped(t: torch.Tensor) -> tuple[int, int]:
    """(pages of `t`'s bytes present in this process's page tables, pages in all), from
    /proc/self/pagemap (bit 63: present; readable by the process itself on Linux)."""
    import os
    import struct

    page = os.sysconf("SC_PAGE_SIZE")
    start, stop = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = struct.unpack(f"{stop - start}Q", f.read((stop - start) * 8))
    return sum(e >> 63 for e in entries), stop - start


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="needs Linux /proc/self/pagemap")
def test_the_embedding_table_is_checked_from_the_file_and_only_seen_rows_are_read(tmp_path):
    """Loading checks every value (a NaN anywhere in the table refuses the checkpoint), yet the
    table's file mapping holds only the pages of the rows a forward read: its values are checked
    through the files in pieces, not through the model (a 1 GB table at 8B widths)."""
    from eagle31_export.formats.target.checkpoint import _tables_read_sparsely

    target = make_target(tmp_path / "t", "llama", seed=5, num_layers=1, dtype=torch.bfloat16, vocab=16384)
    model = load_causal_lm(target, dtype=torch.float32, stored_weights=True)
    table = model.get_input_embeddings().weight
    assert _tables_read_sparsely(model, SafetensorsDir(target)) == {"model.embed_tokens.weight"}
    ref = ReferenceTarget(compute_in(model, torch.float32), (0,))
    ref.forward(IDS)
    present, pages = _pages_mapped(table)
    row_pages = -(-table.shape[1] * table.element_size() // 4096) + 1  # a row may straddle two pages
    assert pages > 100 and present <= IDS.numel() * row_pages, (present, pages)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="needs Linux /proc/self/pagemap")
def test_embedding_lookups_give_the_tables_pages_back(tmp_path):
    """A lookup reads its rows through a read-only mapping of the checkpoint and unmaps the table's
    pages after it: a long prompt over a large vocabulary (16k tokens over 128k rows at 8B widths)
    would otherwise leave most of the table mapped, the pages around each row included. The rows
    are those of the loaded table, bit for bit."""
    target = make_target(tmp_path / "t", "llama", seed=5, num_layers=1, dtype=torch.bfloat16, vocab=16384)
    model = compute_in(load_causal_lm(target, dtype=torch.float32, stored_weights=True), torch.float32)
    embedding = model.get_input_embeddings()
    table, of = embedding.file_table
    assert table is not None and of == embedding.weight.data_ptr()
    ids = torch.randint(0, 16384, (1, 4096), generator=torch.Generator().manual_seed(0))
    rows = embedding(ids)
    assert torch.equal(rows, embedding.weight[ids].float())
    present, pages = _pages_mapped(table)
    assert pages > 100 and present <= 2, (present, pages)  # the two it shares with its neighbours may stay
    # the same lookup through the loaded tensor maps most of the table
    embedding.file_table = (None, None)
    embedding(ids)
    present, pages = _pages_mapped(embedding.weight)
    assert present > pages // 2, (present, pages)


def test_a_table_not_mapped_from_a_file_is_looked_up_as_before():
    embedding = compute_in(nn.Embedding(64, 8, dtype=torch.bfloat16), torch.float32)
    assert embedding.file_table[0] is None
    ids = torch.tensor([[1, 5, 63]])
    assert torch.equal(embedding(ids), embedding.weight[ids].float())
