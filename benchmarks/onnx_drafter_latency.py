"""Drafter step latency on CPU: ONNX Runtime (exported graphs) vs PyTorch eager (reference drafter),
and the chain graph (one call per round) vs n single-step calls.

    .venv/bin/python benchmarks/onnx_drafter_latency.py [--hidden 1024 --past 256 --depth 4 --threads 2]

A random-weight EAGLE 3.1 drafter (fc_norm + norm_output) is made by code and exported with
`export_onnx`; both sides run the same speculation-loop calls on a cache of `--past` positions:
- first step: 1 new position with the target's tapped states (fc + plugin nodes),
- next step: 1 position with the fed-back state,
- a round: first + (depth - 1) next steps, or one chain-graph call.
Every measurement restores the cache length afterwards (truncate), so all iterations see the
same past. Times are medians over `--iters` runs, in milliseconds.
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
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for both runtimes")
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
    from eagle31_export.formats.drafter import write_drafter
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
        results = measure(args, cfg, {"pytorch_eager": eager, "onnxruntime": ort_step}, ort_chain)
    results["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        render(results)


def measure(args, cfg, backends: dict, chain) -> dict:
    gen = torch.Generator().manual_seed(0)
    past_ids = torch.randint(0, cfg.vocab_size, (1, args.past), generator=gen)
    past_aux = torch.randn(1, args.past, cfg.fc_in_features, generator=gen)
    aux = torch.randn(1, 1, cfg.fc_in_features, generator=gen)
    token, pos = torch.tensor([[7]]), torch.tensor([[args.past]])
    out: dict = {}
    for name, b in backends.items():
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

    def chain_round():
        chain.forward(token, pos, aux, True)
        chain.truncate(args.past)

    out["onnxruntime_chain"] = {"round_ms": median_ms(chain_round, args.iters)}
    e, o = out["pytorch_eager"], out["onnxruntime"]
    out["ratios"] = {
        "ort_over_eager_first_step": o["first_step_ms"] / e["first_step_ms"],
        "ort_over_eager_next_step": o["next_step_ms"] / e["next_step_ms"],
        "chain_over_ort_single_steps_round": out["onnxruntime_chain"]["round_ms"] / o["round_ms"],
        "chain_over_eager_round": out["onnxruntime_chain"]["round_ms"] / e["round_ms"],
    }
    return out


def render(r: dict) -> None:
    c = r["config"]
    print(f"EAGLE 3.1 drafter H={c['hidden']} heads={c['heads']}/{c['kv_heads']} I={c['intermediate']} "
          f"V={c['vocab']} Vd={c['draft_vocab']}, past={c['past']}, depth={c['depth']}, threads={c['threads']}")
    print(f"{'':24}{'first step':>12}{'next step':>12}{'round':>12}   (median ms)")
    for name in ("pytorch_eager", "onnxruntime"):
        m = r[name]
        print(f"{name:24}{m['first_step_ms']:12.3f}{m['next_step_ms']:12.3f}{m['round_ms']:12.3f}")
    print(f"{'onnxruntime_chain':24}{'':12}{'':12}{r['onnxruntime_chain']['round_ms']:12.3f}")
    for k, v in r["ratios"].items():
        print(f"{k}: {v:.2f}")


if __name__ == "__main__":
    main()
