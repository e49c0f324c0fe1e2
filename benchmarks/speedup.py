"""Speed-up of speculative decoding on a real vLLM engine at C = 1, 4 and 16 requests in flight:
output tokens/s with speculation over the same engine serving the target alone, side by side in one run.

    .venv/bin/python benchmarks/speedup.py [--vllm .venv-vllm --levels 1,4,16 --repeats 3 --plot speedup.png]

Two local vLLM servers (vLLM's CPU build here: `make setup-vllm`) over the same target, fp32, eager,
greedy, `ignore_eos` (every request makes exactly --max-new-tokens tokens): one with the EAGLE drafter
(`export vllm` bundle, num_speculative_tokens --depth), one without. Prompts: seeded windows of the
held-out files the tiny target never saw (benchmarks/triton_load.py). For each C the prompts are sent
with C requests in flight; the two servers take turns, repeat after repeat, so drift hits both alike.

Printed per C: the median output tokens/s of each, their ratio, and the bound it compares with,
measured in the same run: tau, the tokens each target forward made (1 + accepted / rounds from vLLM's
own /metrics counters), which is the speed-up a free drafter and a verify step as cheap as a decode
step would give; then ratio / tau. Beside them, the seed's 2.03 / 1.71 / 1.66 (Kimi-K2.6-NVFP4 with its
EAGLE 3.1 drafter, vLLM, GB200): another pair and machine, shown for scale only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_load import held_out_prompts, pair_parser  # noqa: E402

SEED_SPEEDUP = {1: 2.03, 4: 1.71, 16: 1.66}  # the seed's per-user speed-ups (Kimi-K2.6-NVFP4, vLLM, GB200)


def parse_args() -> argparse.Namespace:
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--vllm", default=os.environ.get("EAGLE31_VLLM", str(ROOT / ".venv-vllm")),
                   help="vLLM environment (VENV or its python)")
    p.add_argument("--levels", default="1,4,16", help="requests in flight, comma-separated")
    p.add_argument("--prompts", type=int, default=32, help="requests per measurement (>= the highest level)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=3, help="measurements per engine and level (median)")
    p.add_argument("--plot", type=Path, default=Path("speedup.png"), help="where to draw ratio and tau by C")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args()


def measure(client, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> tuple[float, int, object]:
    """(seconds, output tokens, the spec-decode counters' change or None) for every prompt, C in flight."""
    before = client.spec_counters()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(lambda p: client.complete(p, max_new_tokens), prompts))
    seconds = time.perf_counter() - start
    after = client.spec_counters()
    return seconds, sum(len(d.tokens) for d in done), (after - before) if after is not None else None


def main() -> None:
    args = parse_args()
    from eagle31_export.export.vllm import export_vllm
    from eagle31_export.export.bundle import read_bundle
    from eagle31_export.runtime.registry import LoadOptions
    from eagle31_export.runtime.vllm_client import VllmClient
    from eagle31_export.runtime.vllm_engine import LocalServer, find_vllm
    from eagle31_export.runtime.vllm_runtime import engine_args

    levels = sorted({int(c) for c in args.levels.split(",")})
    drafter = args.drafter or args.pair / "drafter-eagle31"
    target = args.target or args.pair / "target"
    prompts = held_out_prompts(args.pair, target, max(args.prompts, max(levels)), seed=0)
    install = find_vllm(args.vllm)
    with tempfile.TemporaryDirectory(prefix="speedup-") as tmp:
        bundle = export_vllm(drafter, target, Path(tmp) / "bundle", num_speculative_tokens=args.depth)
        record = read_bundle(bundle)  # its paths resolved
        options = LoadOptions(depth=args.depth)
        with LocalServer(install, engine_args(record, options), Path(tmp)) as spec_server, \
                LocalServer(install, engine_args(record, options, speculative=False), Path(tmp)) as plain_server:
            engines = {"speculation": VllmClient(spec_server.url), "target alone": VllmClient(plain_server.url)}
            for client in engines.values():  # warm-up: first requests compile and allocate
                measure(client, prompts[:4], 8, 4)
            runs = {(name, c): [] for name in engines for c in levels}
            for _ in range(args.repeats):
                for c in levels:
                    for name, client in engines.items():
                        runs[name, c].append(measure(client, prompts, args.max_new_tokens, c))
    rows = [summarise(c, runs["speculation", c], runs["target alone", c]) for c in levels]
    if args.json:
        print(json.dumps({"install": install.describe(), "depth": args.depth, "prompts": len(prompts),
                          "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}, indent=2))
    else:
        print_table(rows, install.describe(), args, len(prompts))
    draw(rows, args.plot)


def summarise(c: int, spec: list, plain: list) -> dict:
    spec_tps = [tokens / seconds for seconds, tokens, _ in spec]
    plain_tps = [tokens / seconds for seconds, tokens, _ in plain]
    drafts = sum(counters.drafts for *_, counters in spec)
    accepted = sum(counters.accepted_tokens for *_, counters in spec)
    tau = 1 + accepted / drafts if drafts else 1.0
    ratio = statistics.median(spec_tps) / statistics.median(plain_tps)
    return {"concurrency": c, "speculation_tok_s": statistics.median(spec_tps),
            "target_alone_tok_s": statistics.median(plain_tps), "ratio": ratio,
            "ratio_range": [min(spec_tps) / max(plain_tps), max(spec_tps) / min(plain_tps)],
            "tau_bound": tau, "ratio_over_bound": ratio / tau, "seed_ratio": SEED_SPEEDUP.get(c)}


def print_table(rows: list[dict], install: str, args, prompts: int) -> None:
    print(f"{install}, fp32 greedy, depth {args.depth}, {prompts} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats}")
    print(f"{'C':>3} {'spec tok/s':>11} {'alone tok/s':>12} {'ratio':>6} {'(range)':>13} {'bound tau':>10} "
          f"{'ratio/tau':>10} {'seed':>6}")
    for r in rows:
        seed = f"{r['seed_ratio']:.2f}" if r["seed_ratio"] else "-"
        low, high = r["ratio_range"]
        print(f"{r['concurrency']:>3} {r['speculation_tok_s']:>11.1f} {r['target_alone_tok_s']:>12.1f} "
              f"{r['ratio']:>6.2f} {f'{low:.2f}-{high:.2f}':>13} {r['tau_bound']:>10.3f} {r['ratio_over_bound']:>10.2f} "
              f"{seed:>6}")
    print("bound: tau, tokens per target forward (vLLM's /metrics, this run): the speed-up if drafting were free and a "
          "verify step cost one decode step; seed: Kimi-K2.6-NVFP4 on GB200, for scale only")


def draw(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [r["ratio"] for r in rows], "o-", label="measured: speculation / target alone")
    ax.plot(levels, [r["tau_bound"] for r in rows], "x:", color="grey", label="bound: tau (this run)")
    seeded = [r for r in rows if r["seed_ratio"]]
    ax.plot([r["concurrency"] for r in seeded], [r["seed_ratio"] for r in seeded], "s--", color="tab:green",
            label="seed: Kimi-K2.6-NVFP4, GB200")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set(xscale="log", xticks=levels, xlabel="requests in flight (C)", ylabel="output tokens/s ratio",
           title="Speculative decoding speed-up by load (vLLM)",
           ylim=(0, max(max(r["tau_bound"] for r in rows), 2.1) * 1.15))
    ax.set_xticklabels([str(c) for c in levels])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
