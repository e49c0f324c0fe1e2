"""Speed-up of speculative decoding at C = 1, 4 and 16 requests in flight: output tokens/s with
speculation over the same engine serving the target alone, side by side in one run.

    .venv/bin/python benchmarks/speedup.py [--runtimes vllm,onnxruntime --levels 1,4,16 --repeats 3 --plot speedup.png]

Engines, each with and without the drafter, fp32, greedy, every request making exactly
--max-new-tokens tokens:
- vllm: two local vLLM servers over the same target (vLLM's CPU build here: `make setup-vllm`;
  --vllm VENV), one with the EAGLE drafter (`export vllm` bundle, num_speculative_tokens --depth), one
  without; `ignore_eos`;
- onnxruntime: the exported graphs batched as the Triton `cpu` repository runs them
  (runtime/batching.py), in process: the speculation loop, and the target graph alone decoding one
  token a forward over the same batching. Each side's batcher counts its backend calls, so each side
  prints the mean batch it really ran at; a ratio compares speculation with the target alone only
  where the two means are within 10 % of each other, and the row says so where they are not.
Prompts: seeded windows of the held-out files the tiny target never saw (benchmarks/triton_load.py).
For each C the prompts are sent with C requests in flight; the two sides take turns, repeat after
repeat, so drift hits both alike.

Printed per C: the median output tokens/s of each side with the mean batch it ran at (sequences per
backend call over every call of a measurement, median over the repeats; vLLM: requests advanced per
engine step, from its /metrics counters), their
ratio (and its range over the repeats), a note where the two mean batches differ by more than 10 %,
and the bound the ratio compares with, measured in the same run: tau, the tokens each target
forward made (1 + accepted drafts / rounds; vLLM: from its own /metrics counters), which is the
speed-up a free drafter and a verify step as cheap as a decode step would give; then ratio / tau. Beside them, the
seed's 2.03 / 1.71 / 1.66 (Kimi-K2.6-NVFP4 with its EAGLE 3.1 drafter, vLLM, GB200): another pair and
machine, shown for scale only.
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
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_load import held_out_prompts, pair_parser  # noqa: E402

SEED_SPEEDUP = {1: 2.03, 4: 1.71, 16: 1.66}  # the seed's per-user speed-ups (Kimi-K2.6-NVFP4, vLLM, GB200)
BATCH_TOLERANCE = 0.10  # the two sides' mean batch may differ by this much for their ratio to compare them


def parse_args() -> argparse.Namespace:
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--vllm", default=os.environ.get("EAGLE31_VLLM", str(ROOT / ".venv-vllm")),
                   help="vLLM environment (VENV or its python)")
    p.add_argument("--levels", default="1,4,16", help="requests in flight, comma-separated")
    p.add_argument("--prompts", type=int, default=32, help="requests per measurement (>= the highest level)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=3, help="measurements per engine and level (median)")
    p.add_argument("--runtimes", default="vllm,onnxruntime", help="vllm, onnxruntime (comma-separated)")
    p.add_argument("--plot", type=Path, default=Path("speedup.png"), help="where to draw ratio and tau by C")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args()


def timed(run, prompts: list[list[int]], concurrency: int) -> tuple[float, list]:
    """(seconds, results) of `run(prompt)` for every prompt with `concurrency` in flight."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(run, prompts))
    return time.perf_counter() - start, done


def vllm_engines(args, drafter: Path, target: Path, tmp: Path, stack: ExitStack) -> dict:
    """Each engine as `measure(prompts, C) -> (seconds, output tokens, rounds, accepted drafts, every
    prompt's tokens, mean batch or None)`: vLLM with the drafter and without, rounds and accepted
    drafts from its own /metrics counters, the mean batch from its engine steps (`requests_per_step`)."""
    from eagle31_export.export.bundle import read_bundle
    from eagle31_export.export.vllm import export_vllm
    from eagle31_export.runtime.registry import LoadOptions
    from eagle31_export.runtime.vllm_client import VllmClient
    from eagle31_export.runtime.vllm_engine import LocalServer, find_vllm
    from eagle31_export.runtime.vllm_runtime import engine_args

    install = find_vllm(args.vllm)
    record = read_bundle(export_vllm(drafter, target, tmp / "bundle", num_speculative_tokens=args.depth))
    options = LoadOptions(depth=args.depth)

    def engine(speculative: bool):
        server = stack.enter_context(LocalServer(install, engine_args(record, options, speculative), tmp))
        client = VllmClient(server.url)

        def measure(prompts, c):
            before = client.metrics()
            seconds, done = timed(lambda p: client.complete(p, args.max_new_tokens), prompts, c)
            after = client.metrics()
            moved = (after.spec - before.spec) if after.spec is not None else None
            rounds = moved.drafts if moved else 0
            return (seconds, sum(len(d.tokens) for d in done), rounds, moved.accepted_tokens if moved else 0,
                    [d.tokens for d in done], requests_per_step(before, after, rounds, len(prompts)))
        return measure

    return {"label": install.describe(), "speculation": engine(True), "target alone": engine(False)}


def requests_per_step(before, after, rounds: int, prompts: int) -> float | None:
    """vLLM's mean batch, from its exact counters: requests advanced per engine step. A step advances a
    request by one token without speculation (its generation_tokens) and by one round with it, plus
    the step that prefills each request and makes its first token (rounds + prompts)."""
    steps = None if after.steps is None or before.steps is None else after.steps - before.steps
    if not steps:
        return None
    if rounds:
        return (rounds + prompts) / steps
    if after.generated is None or before.generated is None:
        return None
    return (after.generated - before.generated) / steps


def onnxruntime_engines(args, drafter: Path, target: Path, tmp: Path, stack: ExitStack) -> dict:
    """The exported graphs on ONNX Runtime, batched as the Triton `cpu` repository runs them
    (runtime/batching.py), in process: the speculation loop, and the target graph alone decoding one
    token a forward over the same batching. Both sides start their first C requests together (the
    batcher's start-up barrier) and measure their mean batch over their own backend calls."""
    import torch

    from eagle31_export.export.onnx_export import export_onnx
    from eagle31_export.runtime.batching import Batcher, BatchedTarget, BatchingSpeculator, batch_figures
    from eagle31_export.runtime.onnxruntime import load_backends

    target_backend, drafter_backend = load_backends(export_onnx(drafter, tmp / "onnx", target))
    speculator = BatchingSpeculator("onnxruntime", target_backend, drafter_backend)
    batcher = Batcher()

    def alone(prompt):
        with batcher.member() as sequence:
            seq = BatchedTarget(target_backend.fork(), batcher, sequence)
            logits, _ = seq.forward(torch.tensor([prompt]))
            tokens = [int(logits[0, -1].argmax())]
            while len(tokens) < args.max_new_tokens:
                logits, _ = seq.forward(torch.tensor([tokens[-1:]]))
                tokens.append(int(logits[0, -1].argmax()))
        return tokens, sequence.calls

    def speculation(prompts, c):
        start = time.perf_counter()
        run = speculator.run_concurrently(prompts, args.max_new_tokens, args.depth, c)
        seconds, done = time.perf_counter() - start, run.results
        steps = [a for r in done for a in r.accepted_per_step]
        return (seconds, sum(len(r.tokens) for r in done), len(steps), sum(steps), [r.tokens for r in done],
                run.batching.mean)

    def target_alone(prompts, c):
        with batcher.arrivals(min(c, len(prompts))):
            seconds, done = timed(alone, prompts, c)
        figures = batch_figures([call for _, calls in done for call in calls], c)
        return seconds, sum(len(t) for t, _ in done), 0, 0, [t for t, _ in done], figures.mean

    return {"label": "onnxruntime (the Triton cpu repository's engine, in process)", "speculation": speculation,
            "target alone": target_alone}


ENGINES = {"vllm": vllm_engines, "onnxruntime": onnxruntime_engines}


def main() -> None:
    args = parse_args()
    levels = sorted({int(c) for c in args.levels.split(",")})
    drafter = args.drafter or args.pair / "drafter-eagle31"
    target = args.target or args.pair / "target"
    prompts = held_out_prompts(args.pair, target, max(args.prompts, max(levels)), seed=0)
    tables = {}
    for runtime in args.runtimes.split(","):
        with tempfile.TemporaryDirectory(prefix="speedup-") as tmp, ExitStack() as stack:
            engines = ENGINES[runtime](args, drafter, target, Path(tmp), stack)
            label = engines.pop("label")
            for measure in engines.values():  # warm-up: first requests compile and allocate
                measure(prompts[:4], 4)
            runs = {(name, c): [] for name in engines for c in levels}
            for _ in range(args.repeats):  # the two engines take turns: drift hits both alike
                for c in levels:
                    for name, measure in engines.items():
                        runs[name, c].append(measure(prompts, c))
        tables[runtime] = {"engine": label,
                           "rows": [summarise(c, runs["speculation", c], runs["target alone", c]) for c in levels]}
    if args.json:
        print(json.dumps({"depth": args.depth, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                          "repeats": args.repeats, "runtimes": tables}, indent=2))
    else:
        for table in tables.values():
            print_table(table["rows"], table["engine"], args, len(prompts))
    draw(tables, args.plot)


def summarise(c: int, spec: list, plain: list) -> dict:
    spec_tps = [tokens / seconds for seconds, tokens, *_ in spec]
    plain_tps = [tokens / seconds for seconds, tokens, *_ in plain]
    spec_batch, plain_batch = median_batch(spec), median_batch(plain)
    rounds = sum(run[2] for run in spec)
    accepted = sum(run[3] for run in spec)
    # speculation is lossless: both sides must have made the same tokens (the last repeat's)
    same = sum(a == b for a, b in zip(spec[-1][4], plain[-1][4]))
    tau = 1 + accepted / rounds if rounds else 1.0
    ratio = statistics.median(spec_tps) / statistics.median(plain_tps)
    return {"concurrency": c, "speculation_tok_s": statistics.median(spec_tps),
            "target_alone_tok_s": statistics.median(plain_tps), "ratio": ratio,
            "ratio_range": [min(spec_tps) / max(plain_tps), max(spec_tps) / min(plain_tps)],
            "tau_bound": tau, "ratio_over_bound": ratio / tau, "seed_ratio": SEED_SPEEDUP.get(c),
            "same_tokens": same, "prompts": len(spec[-1][4]), "speculation_mean_batch": spec_batch,
            "target_alone_mean_batch": plain_batch, "batch_note": batch_note(spec_batch, plain_batch)}


def median_batch(runs: list) -> float | None:
    """The median over the repeats of each measurement's mean batch (None: the engine does not say)."""
    means = [run[5] for run in runs]
    return None if any(m is None for m in means) else statistics.median(means)


def batch_note(spec: float | None, plain: float | None) -> str:
    """Empty where the ratio compares the two sides at the same batch; else why it does not."""
    if spec is None or plain is None:
        return "batch sizes not measured: the ratio may compare different batches"
    if abs(spec - plain) > BATCH_TOLERANCE * plain:
        return (f"mean batch {spec:.1f} vs {plain:.1f} ({spec / plain - 1:+.0%}, beyond {BATCH_TOLERANCE:.0%}): "
                "the ratio compares different batches, not speculation alone")
    return ""


def print_table(rows: list[dict], engine: str, args, prompts: int) -> None:
    print(f"{engine}, fp32 greedy, depth {args.depth}, {prompts} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats}")
    print(f"{'C':>3} {'spec tok/s':>11} {'spec batch':>11} {'alone tok/s':>12} {'alone batch':>12} {'ratio':>6} "
          f"{'(range)':>13} {'bound tau':>10} {'ratio/tau':>10} {'seed':>6} {'same tokens':>12}  note")
    for r in rows:
        seed = f"{r['seed_ratio']:.2f}" if r["seed_ratio"] else "-"
        low, high = r["ratio_range"]
        same = f"{r['same_tokens']}/{r['prompts']}"
        batch = lambda b: "-" if b is None else f"{b:.1f}"  # noqa: E731
        print(f"{r['concurrency']:>3} {r['speculation_tok_s']:>11.1f} {batch(r['speculation_mean_batch']):>11} "
              f"{r['target_alone_tok_s']:>12.1f} {batch(r['target_alone_mean_batch']):>12} "
              f"{r['ratio']:>6.2f} {f'{low:.2f}-{high:.2f}':>13} {r['tau_bound']:>10.3f} {r['ratio_over_bound']:>10.2f} "
              f"{seed:>6} {same:>12}  {r['batch_note']}")
    print("batch: mean sequences per backend call over every call of a measurement (vLLM: requests advanced per "
          "engine step, from its /metrics counters; median of the repeats; '-': not "
          f"measured); a ratio compares speculation with the target alone where the two are within "
          f"{BATCH_TOLERANCE:.0%}, else its note says why not.")
    print("bound: tau, tokens per target forward (this run; vLLM: its /metrics): the speed-up if drafting were free and "
          "a verify step cost one decode step; seed: Kimi-K2.6-NVFP4 on GB200, for scale only\n")


def draw(tables: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    levels, top = [], 2.1
    for (runtime, table), marker in zip(tables.items(), "o^"):
        rows = table["rows"]
        levels = [r["concurrency"] for r in rows]
        line, = ax.plot(levels, [r["ratio"] for r in rows], f"{marker}-", label=f"{runtime}: speculation / target alone")
        ax.plot(levels, [r["tau_bound"] for r in rows], f"{marker}:", color=line.get_color(), alpha=0.6,
                label=f"{runtime}: bound tau (this run)")
        top = max(top, *(r["tau_bound"] for r in rows))
    seed = sorted(SEED_SPEEDUP.items())
    ax.plot([c for c, _ in seed], [r for _, r in seed], "s--", color="tab:green", label="seed: Kimi-K2.6-NVFP4, vLLM, GB200")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set(xscale="log", xticks=levels, xlabel="requests in flight (C)", ylabel="output tokens/s ratio",
           title="Speculative decoding speed-up by load", ylim=(0, top * 1.15))
    ax.set_xticklabels([str(c) for c in levels])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
