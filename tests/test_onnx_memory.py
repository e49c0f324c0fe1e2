"""`export onnx` stays near the checkpoints' bytes: bf16 matrices stay bf16 in the weight files
(widened by Cast nodes, exactly), a drafter reads the target's embeddings from target.onnx.data
instead of carrying an fp32 copy, and the graphs compute what fp32-stored graphs compute."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from eagle31_export.export.onnx_export import export_onnx
from eagle31_export.export.onnx_graph import ExternalWeights, GraphBuilder, storage_dtype
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_info
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.runtime.onnxruntime import OnnxExport
from factories import drafter_config_for, make_target, random_drafter, without_padding

LAYERS = 4
BF16, FLOAT = TensorProto.BFLOAT16, TensorProto.FLOAT


def _bf16_drafter(info, folder, seed=1):
    """A bf16 EAGLE 3.1 drafter without embed_tokens and lm_head: both come from the target."""
    cfg = drafter_config_for(info, fc_norm=True, norm_output=True, draft_vocab_size=info.vocab_size,
                             torch_dtype="bfloat16")
    ckpt = random_drafter(cfg, seed=seed)
    ckpt.tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
                    for k, v in ckpt.tensors.items() if k != "lm_head.weight"}
    return write_drafter(ckpt, folder, "specforge")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A bf16 target and drafter, the same target re-saved in fp32 (what the graphs computed from
    before), and the exports of both."""
    tmp = tmp_path_factory.mktemp("memory")
    target = make_target(tmp / "target", "llama", seed=2, dtype=torch.bfloat16, num_layers=LAYERS)
    target32 = tmp / "target32"
    load_causal_lm(target, dtype=torch.float32).save_pretrained(target32, safe_serialization=True)
    drafter = _bf16_drafter(read_target_info(target), tmp / "drafter")
    return {"target": target, "target32": target32, "drafter": drafter,
            "onnx": export_onnx(drafter, tmp / "onnx", target),
            "onnx32": export_onnx(drafter, tmp / "onnx32", target32)}


def _initializers(path):
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: t for t in model.graph.initializer}


def _external(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def test_bf16_checkpoints_keep_bf16_matrices(pair):
    target = _initializers(pair["onnx"] / "target.onnx")
    linears = [n for n in target if n.endswith(".weight_t")]
    assert linears and all(target[n].data_type == BF16 for n in linears)
    assert target["model.embed_tokens.weight"].data_type == BF16
    # norms stay in the compute dtype (a Cast for a few KiB is not worth it)
    assert target["model.norm.weight"].data_type == FLOAT
    for role in ("first", "next"):
        drafter = _initializers(pair["onnx"] / f"drafter_{role}.onnx")
        assert all(drafter[n].data_type == BF16 for n in drafter if n.endswith(".weight_t")), role
    # The fp32 checkpoint's graphs hold fp32 matrices and no Cast, as always.
    assert _initializers(pair["onnx32"] / "target.onnx")["lm_head.weight_t"].data_type == FLOAT
    assert not [n for n in onnx.load(str(pair["onnx32"] / "target.onnx"), load_external_data=False).graph.node
                if n.op_type == "Cast" and n.input[0].endswith(".weight_t")]
    # half the bytes of the fp32-stored export, give or take alignment padding
    bf16, fp32 = ((pair[k] / "target.onnx.data").stat().st_size for k in ("onnx", "onnx32"))
    assert bf16 < 0.6 * fp32


def test_the_drafter_reads_the_targets_embedding_and_lm_head(pair):
    out = pair["onnx"]
    target = _initializers(out / "target.onnx")
    info = read_target_info(pair["target"])
    for role in ("first", "next"):
        drafter = _initializers(out / f"drafter_{role}.onnx")
        for mine, theirs in (("embed_tokens.weight", "model.embed_tokens.weight"),
                             ("lm_head.weight_t", "lm_head.weight_t")):
            assert _external(drafter[mine]) == _external(target[theirs]), (role, mine)
            assert _external(drafter[mine])["location"] == "target.onnx.data"
            assert drafter[mine].data_type == BF16
        # no vocabulary-sized matrix of its own, in any dtype
        vocab_sized = [n for n, t in drafter.items() if info.vocab_size in t.dims and t.data_type != TensorProto.INT64
                       and _external(t).get("location") != "target.onnx.data"]
        assert vocab_sized == [], role
    # the drafter's own file holds what its graphs place there, and nothing vocabulary-sized
    own = {n: _external(t) for role in ("first", "next") for n, t in _initializers(out / f"drafter_{role}.onnx").items()
           if _external(t).get("location") == "drafter.onnx.data"}
    end = max(int(e["offset"]) + int(e["length"]) for e in own.values())
    assert (out / "drafter.onnx.data").stat().st_size == end
    assert end - sum(int(e["length"]) for e in own.values()) < 64 * len(own)  # alignment padding only


def _feeds(cfg, ids, positions, aux):
    past = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    return without_padding({"input_ids": ids.numpy(), "position_ids": positions.numpy(), "aux_hidden_states": aux.numpy(),
                            **{f"past_{kv}_{i}": past for i in range(cfg.num_layers) for kv in ("key", "value")}})


def _run(export_dir, file, feeds):
    session = OnnxExport.open(export_dir).session(file)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def test_outputs_equal_the_fp32_stored_graphs_and_the_reference(pair):
    ckpt = read_drafter(pair["drafter"])
    cfg = ckpt.config
    gen = torch.Generator().manual_seed(4)
    ids, positions = torch.randint(0, cfg.vocab_size, (1, 5), generator=gen), torch.arange(5).unsqueeze(0)
    aux = torch.randn(1, 5, cfg.fc_in_features, generator=gen)
    feeds = _feeds(cfg, ids, positions, aux)
    got, was = _run(pair["onnx"], "drafter_first.onnx", feeds), _run(pair["onnx32"], "drafter_first.onnx", feeds)
    for name in ("logits", "fed_back_hidden", "new_key_0"):  # bf16 -> fp32 is exact: the same numbers
        np.testing.assert_allclose(got[name], was[name], atol=1e-6, rtol=0)
    target_model = load_causal_lm(pair["target"], dtype=torch.float32)
    ref = build_drafter(ckpt, target_model=target_model)
    with torch.no_grad():
        want = ref(ids, positions, aux, KVCache(), True)
    np.testing.assert_allclose(got["logits"], want.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["fed_back_hidden"], want.fed_back.numpy(), atol=1e-4, rtol=0)
    kv = {f"past_{k}_{i}": np.zeros((1, 2, 0, 16), np.float32) for i in range(LAYERS) for k in ("key", "value")}
    target_feeds = without_padding({"input_ids": ids.numpy(), "position_ids": positions.numpy(), **kv})
    got, was = _run(pair["onnx"], "target.onnx", target_feeds), _run(pair["onnx32"], "target.onnx", target_feeds)
    for name in ("logits", "aux_hidden_states", "new_value_3"):
        np.testing.assert_allclose(got[name], was[name], atol=1e-6, rtol=0)
    with torch.no_grad():
        logits = target_model(ids).logits
    np.testing.assert_allclose(got["logits"], logits.numpy(), atol=1e-4, rtol=0)


def test_onnxruntime_parity_over_the_export(pair, cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 17, 40 + i, 9]}) + "\n" for i in range(2)))
    code, _, err = cli("parity", pair["onnx"], "--runtime", "onnxruntime", "--prompts", prompts, "--depth", "3",
                       "--max-new-tokens", "8", "--out", tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert code == 0 and report["passed"], (err, report["failures"])
    assert report["exact_comparison"] is True


def test_weights_are_written_in_pieces_and_page_aligned(tmp_path, monkeypatch):
    monkeypatch.setattr(ExternalWeights, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(ExternalWeights, "PAGE_ALIGN_FROM", 1 << 12)
    w = ExternalWeights(tmp_path, "w.data")
    small = torch.randn(300, dtype=torch.float32)
    big = torch.randn(256, 96, dtype=torch.float32)
    w.add("small", small)
    proto = w.add("big_t", big.t(), torch.bfloat16)  # a transposed view, narrowed while written
    where = _external(proto)
    assert int(where["offset"]) % ExternalWeights.PAGE_ALIGN == 0 and proto.data_type == BF16
    raw = (tmp_path / "w.data").read_bytes()[int(where["offset"]):int(where["offset"]) + int(where["length"])]
    want = big.t().contiguous().to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert raw == want
    assert w.add("big_t", torch.zeros(1)).external_data == proto.external_data  # stored once
    assert storage_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert storage_dtype(torch.float32, torch.bfloat16) == torch.bfloat16  # narrower compute: rounded once
    assert storage_dtype(torch.bfloat16, torch.float16) == torch.float16


def test_sessions_do_not_fold_widened_weights_into_fp32_copies(pair, tmp_path, monkeypatch):
    """The optimized graph ONNX Runtime runs keeps the bf16 initializers and their Cast nodes."""
    seen = {}
    real = ort.InferenceSession

    def spy(path, opts, **kwargs):
        opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        seen.update(kwargs)
        return real(path, opts, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    OnnxExport.open(pair["onnx"]).session("target.onnx")
    optimized = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in optimized.graph.initializer}
    assert types["lm_head.weight_t"] == BF16
    waits = {n.output[0] for n in optimized.graph.node if n.op_type == "Reshape" and n.input[0] == "lm_head.weight_t"}
    assert any(n.op_type == "Cast" and n.input[0] in waits for n in optimized.graph.node)
    assert "ConstantFolding" in seen.get("disabled_optimizers", [])


def test_each_weight_is_widened_just_before_its_matmul(pair, tmp_path):
    """ONNX Runtime runs a node whose inputs are all initializers whenever it likes (first, in
    practice): the widening Casts wait for their activation, so one fp32 weight at a time exists."""
    opts = ort.SessionOptions()
    opts.enable_profiling, opts.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(str(pair["onnx"] / "target.onnx"), opts, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=["ConstantFolding"])
    kv = {f"past_{k}_{i}": np.zeros((1, 2, 0, 16), np.float32) for i in range(LAYERS) for k in ("key", "value")}
    session.run(None, without_padding({"input_ids": np.array([[1, 2, 3]]), "position_ids": np.array([[0, 1, 2]]), **kv}))
    events = json.loads(open(session.end_profiling()).read())
    order = [e["name"][:-len("_kernel_time")] for e in events
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    at = {name: i for i, name in enumerate(order)}
    widened = [n for n in order if n.endswith("_proj/widen") or n == "lm_head/lm_head/widen"]
    assert len(widened) == LAYERS * 7 + 1
    for name in widened:  # the node after the Cast is the MatMul it feeds
        assert at[name.rsplit("/", 1)[0]] == at[name] + 1, name


def test_large_widened_weights_are_multiplied_by_column_blocks(pair, tmp_path, monkeypatch):
    """A widened matrix over WIDE_BLOCK_BYTES (a 128k-vocabulary lm_head: 2 GB in fp32) is sliced,
    widened and multiplied block after block: the same logits, one widened block alive at a time."""
    monkeypatch.setattr(GraphBuilder, "WIDE_BLOCK_BYTES", 64 * 32 * 4)  # 64 input rows here: 32 columns a block
    blocked = export_onnx(pair["drafter"], tmp_path / "onnx", pair["target"])
    nodes = onnx.load(str(blocked / "target.onnx"), load_external_data=False).graph.node
    vocab = read_target_info(pair["target"]).vocab_size
    blocks = [n for n in nodes if n.op_type == "MatMul" and n.name.startswith("lm_head/lm_head/block")]
    assert len(blocks) == -(-vocab // 32)
    kv = {f"past_{k}_{i}": np.zeros((1, 2, 0, 16), np.float32) for i in range(LAYERS) for k in ("key", "value")}
    feeds = without_padding({"input_ids": np.array([[1, 2, 3]]), "position_ids": np.array([[0, 1, 2]]), **kv})
    got, want = _run(blocked, "target.onnx", feeds), _run(pair["onnx"], "target.onnx", feeds)
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-6, rtol=0)
    # each block's Slice waits for the block before it (Reshape on that product), so ONNX Runtime
    # cannot widen them all up front
    waits = [n for n in nodes if n.op_type == "Slice" and n.name.startswith("lm_head/lm_head/")]
    assert len(waits) == len(blocks)


def _mapped_kib(path) -> int:
    """KiB of `path` resident in this process, summed over its mappings (a page mapped twice counts twice)."""
    total, current = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if parts and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else None
            elif parts and parts[0] == "Rss:" and current == str(path):
                total += int(parts[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_sessions_share_one_mapping_of_the_weight_files(pair):
    """drafter_first.onnx and drafter_next.onnx read the same drafter.onnx.data: mapped once, it is resident
    at most once (ONNX Runtime's own loading maps it per session, and the pages both graphs read count twice)."""
    from eagle31_export.runtime.onnxruntime import OrtDrafterBackend, OrtTargetBackend

    export = OnnxExport.open(pair["onnx"])
    target, drafter = OrtTargetBackend(export), OrtDrafterBackend(export)
    data = pair["onnx"] / "drafter.onnx.data"
    _, taps = target.forward(torch.tensor([[3, 5, 7, 9]]))
    positions = torch.arange(4).unsqueeze(0)
    _, fed_back = drafter.forward(torch.tensor([[5, 7, 9, 11]]), positions, taps, True)
    drafter.forward(torch.tensor([[2]]), torch.tensor([[4]]), fed_back[:, -1:], False)
    assert _mapped_kib(data) > 0  # the weights are read from the mapped file, not copied
    assert _mapped_kib(data) <= data.stat().st_size // 1024 + 4


def test_a_cropped_cache_is_held_as_contiguous_arrays_of_its_own(pair):
    """Rejected drafts crop the cache. What is kept must be contiguous, or ONNX Runtime copies every
    layer at the next call while the cropped views still hold the old arrays: three copies of the
    cache at once, at a long context's peak."""
    from eagle31_export.runtime.onnxruntime import load_backends

    target, _ = load_backends(pair["onnx"])
    target.forward(torch.tensor([[3, 5, 7, 9, 11, 13]]))
    old_keys, old_values = list(target.cache.keys), list(target.cache.values)
    assert old_keys[0].shape[1] > 1  # several KV heads: a cropped view would not be contiguous
    target.truncate(4)
    assert target.length == 4
    for kept, old in zip(target.cache.keys + target.cache.values, old_keys + old_values):
        assert kept.flags.c_contiguous and not np.shares_memory(kept, old)
        np.testing.assert_array_equal(kept, old[:, :, :4])
    kept = list(target.cache.keys)
    target.truncate(4)  # nothing to drop: the arrays stay as they are
    assert all(a is b for a, b in zip(target.cache.keys, kept))


def _present_pages(view: np.ndarray) -> tuple[int, int]:
    """(pages of `view`'s bytes present in this process's page tables, pages in all), from
    /proc/self/pagemap (bit 63: present)."""
    import struct

    page = os.sysconf("SC_PAGE_SIZE")
    start, stop = view.ctypes.data // page, (view.ctypes.data + view.nbytes - 1) // page + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = struct.unpack(f"{stop - start}Q", f.read((stop - start) * 8))
    return sum(e >> 63 for e in entries), stop - start


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc/self/pagemap")
def test_runs_give_the_pages_of_tables_read_by_rows_back(tmp_path, monkeypatch):
    """The embedding table (a Gather's data) is mapped read-only from target.onnx.data; after each
    run its pages are unmapped again, where left alone a long prompt over a large vocabulary maps
    most of it. The logits do not change."""
    import eagle31_export.runtime.onnxruntime as ort_runtime

    target = make_target(tmp_path / "target", "llama", seed=5, num_layers=LAYERS, dtype=torch.bfloat16, vocab=16384)
    drafter = _bf16_drafter(read_target_info(target), tmp_path / "drafter")
    export = OnnxExport.open(export_onnx(drafter, tmp_path / "onnx", target))
    ids = torch.randint(0, 16384, (1, 500), generator=torch.Generator().manual_seed(0))  # the rope holds 512
    backend = ort_runtime.OrtTargetBackend(export)
    table = next(t for t in backend.session.tables if t.shape[0] == 16384)
    released = backend.forward(ids, logits_to_keep=4)[0]
    present, pages = _present_pages(table)
    assert pages > 100 and present <= 2, (present, pages)

    monkeypatch.setattr(ort_runtime, "release_tables", lambda session: None)
    backend.reset()
    kept = backend.forward(ids, logits_to_keep=4)[0]
    present, pages = _present_pages(table)
    assert present > pages // 2, (present, pages)
    assert torch.equal(released, kept)
