"""Drafter step latency on CPU: ONNX Runtime (exported graphs) vs PyTorch eager (reference drafter),
the chain graph (one `draft_chain` call per round) vs n single-step calls, and each against the time
the bytes it must read take at the read bandwidth measured in the same run.

    .venv/bin/python benchmarks/onnx_drafter_latency.py [--hidden 1024 --past 256 --depth 4 --threads 1]

A random-weight EAGLE 3.1 drafter (fc_norm + norm_output, fp32) is made by code and exported with
`export_onnx`; both sides run the same speculation-loop calls on a cache of `--past` positions:
- first step: 1 new position with the target's tapped states (fc + plugin nodes),
- next step: 1 position with the fed-back state,
- a round: first + (depth - 1) next steps, or one chain-graph call (`draft_chain`, what the loop calls).
Every measurement restores the cache length afterwards (truncate), so all iterations see the
same past. Times are medians over `--iters` runs, in milliseconds.

The bound: a drafter step at batch 1 is a chain of matrix-vector products, so it cannot be faster
than reading its weights (every weight but the embedding table, of which one row; fc and fc_norm
in the first step only) and its KV cache once. `bound_ms` is those bytes over the read bandwidth of
this run (the faster of `torch.mv` and `torch.sum` over a buffer far larger than the caches, same
thread count, median; measured beside each backend's latencies and the highest taken), and `x_bound`
each time over its bound: 1.00x reads at the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--past", type=int, default=256, help="cached positions before the measured step")
    p.add_argument("--depth", type=int, default=4, help="draft tokens per round (chain depth)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for both runtimes")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer read to measure the read bandwidth")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args()


def median_ms(fn, iters: int) -> float:
    fn()  # warm-up (ORT allocations, torch dispatch caches)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    args = parse_args()
    from eagle31_export.config import DrafterConfig
    from eagle31_export.export.onnx_export import OnnxExportOptions, export_onnx
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test factories
    from factories import random_drafter
    from eagle31_export.formats.drafter.checkpoint import write_drafter
    from eagle31_export.reference.drafter import build_drafter
    from eagle31_export.reference.speculate import ReferenceDrafterBackend
    from eagle31_export.runtime.onnxruntime import OnnxExport, OrtChainDrafterBackend, OrtDrafterBackend

    torch.set_num_threads(args.threads)
    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                        head_dim=args.hidden // args.heads, vocab_size=args.vocab, draft_vocab_size=args.draft_vocab,
                        aux_layer_ids=(1, 15, 28), num_aux_hidden_states=3, fc_norm=True, norm_output=True,
                        torch_dtype="float32", max_position_embeddings=args.past + args.depth + 16)
    ckpt = random_drafter(cfg, seed=0, with_embeddings=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_drafter(ckpt, Path(tmp) / "drafter", "specforge")
        out = export_onnx(folder, Path(tmp) / "onnx", options=OnnxExportOptions(chain_depth=args.depth))
        export = OnnxExport.open(out)
        eager = ReferenceDrafterBackend(build_drafter(ckpt, dtype=torch.float32))
        ort_step = OrtDrafterBackend(export, threads=args.threads)
        ort_chain = OrtChainDrafterBackend(export, threads=args.threads)
        bandwidths: list[float] = []  # measured beside each backend's latencies: the machine may be shared
        results = measure(args, cfg, {"pytorch_eager": eager, "onnxruntime": ort_step}, ort_chain,
                          probe=lambda: bandwidths.append(read_bandwidth(args)))
        results["bound"] = read_bound(args, cfg, ckpt.tensors, bandwidths)
    add_bound_ratios(results)
    results["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        render(results)


def measure(args, cfg, backends: dict, chain, probe) -> dict:
    gen = torch.Generator().manual_seed(0)
    past_ids = torch.randint(0, cfg.vocab_size, (1, args.past), generator=gen)
    past_aux = torch.randn(1, args.past, cfg.fc_in_features, generator=gen)
    aux = torch.randn(1, 1, cfg.fc_in_features, generator=gen)
    token, pos = torch.tensor([[7]]), torch.tensor([[args.past]])
    out: dict = {}
    for name, b in backends.items():
        probe()
        b.reset()
        _, fed = b.forward(past_ids, torch.arange(args.past).unsqueeze(0), past_aux, True)
        hidden = fed[:, -1:]

        def first(b=b):
            b.forward(token, pos, aux, True)
            b.truncate(args.past)

        def step(b=b, hidden=hidden):
            b.forward(token, pos, hidden, False)
            b.truncate(args.past)

        def round_(b=b):
            logits, fed = b.forward(token, pos, aux, True)
            for i in range(1, args.depth):
                nxt = torch.tensor([[int(b.draft_to_target(logits[0, -1].argmax().reshape(1))[0])]])
                logits, fed = b.forward(nxt, pos + i, fed[:, -1:], False)
            b.truncate(args.past)

        out[name] = {"first_step_ms": median_ms(first, args.iters), "next_step_ms": median_ms(step, args.iters),
                     "round_ms": median_ms(round_, args.iters)}
    chain.reset()
    chain.forward(past_ids, torch.arange(args.past).unsqueeze(0), past_aux, True)
    chain.truncate(args.past)

    def chain_round():  # the round as the speculation loop runs it: one chain-graph call
        logits = chain.draft_chain(token, pos, aux, args.depth)
        assert logits.shape[1] == args.depth
        chain.truncate(args.past)

    probe()
    out["onnxruntime_chain"] = {"round_ms": median_ms(chain_round, args.iters)}
    probe()
    e, o = out["pytorch_eager"], out["onnxruntime"]
    out["ratios"] = {
        "ort_over_eager_first_step": o["first_step_ms"] / e["first_step_ms"],
        "ort_over_eager_next_step": o["next_step_ms"] / e["next_step_ms"],
        "chain_over_ort_single_steps_round": out["onnxruntime_chain"]["round_ms"] / o["round_ms"],
        "chain_over_eager_round": out["onnxruntime_chain"]["round_ms"] / e["round_ms"],
    }
    return out


def read_bandwidth(args) -> float:
    """Bytes per second read from a buffer far larger than the caches: the best median of two
    kernels that do little else (`torch.mv`, a GEMV as the drafter's layers are, and `torch.sum`)."""
    buf = torch.ones((args.bandwidth_mib << 20) // 4, dtype=torch.float32)
    matrix, vector = buf.view(4096, -1), torch.ones(buf.numel() // 4096)
    runs = max(5, args.iters // 3)
    best_ms = min(median_ms(lambda: torch.mv(matrix, vector), runs), median_ms(lambda: buf.sum(), runs))
    return buf.numel() * 4 / (best_ms / 1e3)


def read_bound(args, cfg, tensors, bandwidths: list[float]) -> dict:
    """The bytes each step must read and the time they take at this run's read bandwidth: the highest
    of the measurements taken beside the latencies (the least disturbed), so the tightest bound."""
    first_only = ("fc.", "fc_norm.", "input_norm.")
    weights = {n: t.numel() * t.element_size() for n, t in tensors.items() if n not in ("d2t", "t2d")}
    row = cfg.hidden_size * 4  # the one embedding row a step reads
    first = sum(b for n, b in weights.items() if n != "embed_tokens.weight") + row
    nxt = sum(b for n, b in weights.items() if n != "embed_tokens.weight" and not n.startswith(first_only)) + row
    kv_per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, fp32, one layer

    def kv(i):  # the cache a step at past + i attends to, its own position included
        return (args.past + i + 1) * kv_per_position

    step_bytes = [first + kv(0)] + [nxt + kv(i) for i in range(1, args.depth)]
    bandwidth = max(bandwidths)
    ms = [1e3 * b / bandwidth for b in step_bytes]
    return {"read_bandwidth_gb_s": bandwidth / 1e9, "read_bandwidths_gb_s": [x / 1e9 for x in bandwidths],
            "first_step_bytes": step_bytes[0],
            "next_step_bytes": step_bytes[1] if args.depth > 1 else nxt + kv(1),
            "first_step_ms": ms[0], "next_step_ms": 1e3 * (nxt + kv(1)) / bandwidth, "round_ms": sum(ms)}


def add_bound_ratios(r: dict) -> None:
    b = r["bound"]
    for name in ("pytorch_eager", "onnxruntime", "onnxruntime_chain"):
        r[name]["x_bound"] = {k: r[name][k] / b[k] for k in ("first_step_ms", "next_step_ms", "round_ms")
                              if k in r[name]}


def render(r: dict) -> None:
    c, b = r["config"], r["bound"]
    print(f"EAGLE 3.1 drafter H={c['hidden']} heads={c['heads']}/{c['kv_heads']} I={c['intermediate']} "
          f"V={c['vocab']} Vd={c['draft_vocab']}, fp32, past={c['past']}, depth={c['depth']}, threads={c['threads']}")
    print(f"read bandwidth (best of torch.mv / torch.sum over {c['bandwidth_mib']} MiB, {c['threads']} thread(s)): "
          f"{b['read_bandwidth_gb_s']:.2f} GB/s (highest of " + ", ".join(f"{x:.1f}" for x in b["read_bandwidths_gb_s"])
          + f"); bytes a step reads: first {b['first_step_bytes'] / 1e6:.1f} MB, "
          f"next {b['next_step_bytes'] / 1e6:.1f} MB")
    print(f"{'':34}{'first step':>12}{'next step':>12}{'round':>12}   (median ms; x bound)")
    print(f"{'bound (bytes / read bandwidth)':34}{b['first_step_ms']:12.3f}{b['next_step_ms']:12.3f}{b['round_ms']:12.3f}")
    rows = (("pytorch_eager", "pytorch eager"), ("onnxruntime", "onnxruntime (single steps)"),
            ("onnxruntime_chain", "onnxruntime chain (draft_chain)"))
    for key, label in rows:
        m = r[key]
        cells = [f"{m[k]:7.3f} {m['x_bound'][k]:4.2f}x" if k in m else "" for k in ("first_step_ms", "next_step_ms",
                                                                                   "round_ms")]
        print(f"{label:34}" + "".join(f"{cell:>12}" if not cell else f"{cell:>13}" for cell in cells))
    for k, v in r["ratios"].items():
        print(f"{k}: {v:.2f}")


if __name__ == "__main__":
    main()
