"""Speed-up of speculative decoding at C = 1, 4 and 16 requests in flight: output tokens/s with
speculation over the same engine serving the target alone, side by side in one run.

    .venv/bin/python benchmarks/speedup.py [--runtimes vllm,onnxruntime --levels 1,4,16 --repeats 3 --plot speedup.png]
    .venv/bin/python benchmarks/speedup.py --pair smollm2 --runtimes vllm [--drafter drafter-eagle3 --depth 3,5]

Pairs: --pair is a folder with target/ and drafter-eagle31/, or the name of one under examples/
(`smollm2`: examples/smollm2/models, SmolLM2-135M-Instruct with the drafters trained for it; `make
smollm2-target` makes its target); --drafter may name a drafter folder of the pair (`drafter-eagle3`).
The default is the tiny trained pair (examples/tiny/models).

Engines, each with and without the drafter, fp32, greedy, every request making exactly
--max-new-tokens tokens:
- vllm: local vLLM servers over the same target (vLLM's CPU build here: `make setup-vllm`;
  --vllm VENV), one with the EAGLE drafter for each --depth (`export vllm` bundle,
  num_speculative_tokens the depth), one without; `ignore_eos`;
- onnxruntime: the exported graphs batched as the Triton `cpu` repository runs them
  (runtime/batching.py), in process: the speculation loop, and the target graph alone decoding one
  token a forward over the same batching. Each side's batcher counts its backend calls, so each side
  prints the mean batch it really ran at; a ratio compares speculation with the target alone only
  where the two means are within 10 % of each other, and the row says so where they are not.
Prompts: a pair folder with held_out_prompts.jsonl (smollm2: 12 chat prompts, read as `parity
--prompts` reads them) gives its prompts, cycled through where --prompts asks for more requests; the
tiny pair, seeded windows of the held-out files its target never saw (benchmarks/triton_load.py).
For each C the prompts are sent with C requests in flight; the sides take turns, repeat after
repeat, so drift hits all alike. vLLM's prefix cache (on by default) serves the prefill of a prompt
each engine has seen before (the warm-up's, a cycled one, every repeat's), on every engine alike.

Depths: --depth takes one depth or several (`--depth 3,5`, default 3): each depth gets a speculating
engine of its own (vLLM: a server each), all measured against the one target-alone engine in the
same turns, so "depth 3 and the best depth" is one run; every depth costs one more measurement per
repeat and level.

Printed per depth and C: the median output tokens/s of each side with the mean batch it ran at (sequences per
backend call over every call of a measurement, median over the repeats; vLLM: requests advanced per
engine step, from its /metrics counters), their
ratio (and its range over the repeats), a note where the two mean batches differ by more than 10 %,
and the bound the ratio compares with, measured in the same run: tau, the tokens each target
forward made (1 + accepted drafts / rounds; vLLM: from its own /metrics counters), which is the
speed-up a free drafter and a verify step as cheap as a decode step would give; then ratio / tau. Beside them, the
seed's 2.03 / 1.71 / 1.66 (Kimi-K2.6-NVFP4 with its EAGLE 3.1 drafter, vLLM, GB200): another pair and
machine, shown for scale only.

The bandwidth bound at C = 1 (benchmarks/bandwidth_bound.py), measured in the same run: before any
engine starts, this process times a streaming read (torch.sum over a 1 GiB fp32 tensor, best of 5)
at torch's default thread count, printed; that is the vLLM engine's too (its CPU build with the uni
executor and the engine core in process, as LocalServer starts it, leaves torch's default alone).
From the safetensors headers, at the served dtype fp32: the target's bytes per forward (every weight,
the tied embedding once, by the lm_head; the embedding lookup one row) and the drafter's bytes per
draft step (fc, its decoder layer, norms, lm_head over the draft vocabulary, and one row of the
target's embedding). t_target = bytes_target / BW and t_draft = bytes_drafter / BW, and

    bound = tau * t_target / (t_target + depth * t_draft)

the speed-up a bandwidth-bound engine gives once drafting is paid for, assuming the verify forward of
depth + 1 tokens costs what a decode step costs (it reads the same weights); KV-cache reads are not
counted, and the fc is counted in every draft step though vLLM runs it once a round (the bound is
about 1 % low for SmolLM2 at depth 3). Bandwidth cancels out of the bound; it matters for the line
that sets the target alone's measured time per output token at C = 1 (prefill included) beside
t_target: how close the engine is to bandwidth-bound. Each C = 1 row prints the bound and ratio / bound.
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
from bandwidth_bound import (drafter_bytes_per_step, measure_bandwidth, speedup_bound,  # noqa: E402
                             target_bytes_per_forward)
from triton_load import held_out_prompts, pair_parser  # noqa: E402

SEED_SPEEDUP = {1: 2.03, 4: 1.71, 16: 1.66}  # the seed's per-user speed-ups (Kimi-K2.6-NVFP4, vLLM, GB200)
BATCH_TOLERANCE = 0.10  # the two sides' mean batch may differ by this much for their ratio to compare them
BANDWIDTH_GIB = 1.0  # the streaming read's tensor: far beyond any CPU cache (tens of MiB)
BANDWIDTH_READS = 5  # timed reads, the best one taken
CHAT_PROMPTS = "held_out_prompts.jsonl"  # a pair's own prompts, one JSON object a line (`parity --prompts`)
ALONE = "target alone"


def parse_args() -> argparse.Namespace:
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--vllm", default=os.environ.get("EAGLE31_VLLM", str(ROOT / ".venv-vllm")),
                   help="vLLM environment (VENV or its python)")
    p.add_argument("--levels", default="1,4,16", help="requests in flight, comma-separated")
    p.add_argument("--prompts", type=int, default=32,
                   help="requests per measurement (>= the highest level; a pair's own prompts are cycled through)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", "--depths", dest="depths", default="3",
                   help="num_speculative_tokens, comma-separated: each depth speculates in an engine of its own")
    p.add_argument("--repeats", type=int, default=3, help="measurements per engine and level (median)")
    p.add_argument("--runtimes", default="vllm,onnxruntime", help="vllm, onnxruntime (comma-separated)")
    p.add_argument("--plot", type=Path, default=Path("speedup.png"), help="where to draw ratio and tau by C")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    args.pair = resolve_pair(args.pair)
    args.depths = sorted({int(d) for d in args.depths.split(",")})
    return args


def resolve_pair(pair: Path) -> Path:
    """A pair folder as given, or the name of an example pair: `smollm2` is examples/smollm2/models."""
    if pair.is_dir():
        return pair
    named = ROOT / "examples" / str(pair) / "models"
    if named.is_dir():
        return named
    raise SystemExit(f"--pair {pair}: neither a folder nor an example pair (examples/NAME/models)")


def in_pair(pair: Path, folder: Path | None, default: str) -> Path:
    """--drafter / --target: a path, or the name of a folder of the pair (`drafter-eagle3`)."""
    if folder is None:
        return pair / default
    return folder if folder.is_dir() or not (pair / folder).is_dir() else pair / folder


def pair_prompts(pair: Path, target: Path, n: int) -> tuple[list[list[int]], str]:
    """`n` prompts and what they are: the pair's own chat prompts where it has them, cycled through
    where `n` is more; else the held-out windows of triton_load (the tiny pair)."""
    chat = pair / CHAT_PROMPTS
    if not chat.is_file():
        return held_out_prompts(pair, target, n, seed=0), "held-out windows"
    from eagle31_export.formats.prompts import read_prompts
    from eagle31_export.formats.target.checkpoint import read_target_info

    prompts = read_prompts(chat, target, read_target_info(target).vocab_size)
    return [prompts[i % len(prompts)] for i in range(n)], f"the {len(prompts)} prompts of {CHAT_PROMPTS}, cycled"


def speculation(depth: int) -> str:
    return f"speculation, depth {depth}"


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
    records = {d: read_bundle(export_vllm(drafter, target, tmp / f"bundle-{d}", num_speculative_tokens=d))
               for d in args.depths}

    def engine(depth: int, speculative: bool):
        served = engine_args(records[depth], LoadOptions(depth=depth), speculative)
        server = stack.enter_context(LocalServer(install, served, tmp))
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

    return {"label": install.describe(), **{speculation(d): engine(d, True) for d in args.depths},
            ALONE: engine(args.depths[0], False)}


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

    def speculating(depth):
        def measure(prompts, c):
            start = time.perf_counter()
            run = speculator.run_concurrently(prompts, args.max_new_tokens, depth, c)
            seconds, done = time.perf_counter() - start, run.results
            steps = [a for r in done for a in r.accepted_per_step]
            return (seconds, sum(len(r.tokens) for r in done), len(steps), sum(steps), [r.tokens for r in done],
                    run.batching.mean)
        return measure

    def target_alone(prompts, c):
        with batcher.arrivals(min(c, len(prompts))):
            seconds, done = timed(alone, prompts, c)
        figures = batch_figures([call for _, calls in done for call in calls], c)
        return seconds, sum(len(t) for t, _ in done), 0, 0, [t for t, _ in done], figures.mean

    return {"label": "onnxruntime (the Triton cpu repository's engine, in process)",
            **{speculation(d): speculating(d) for d in args.depths}, ALONE: target_alone}


ENGINES = {"vllm": vllm_engines, "onnxruntime": onnxruntime_engines}


def main() -> None:
    args = parse_args()
    levels = sorted({int(c) for c in args.levels.split(",")})
    drafter = in_pair(args.pair, args.drafter, "drafter-eagle31")
    target = in_pair(args.pair, args.target, "target")
    prompts, prompts_what = pair_prompts(args.pair, target, max(args.prompts, max(levels)))
    bandwidth = bandwidth_figures(drafter, target)  # before any engine starts: the machine to itself
    tables = {}
    for runtime in args.runtimes.split(","):
        with tempfile.TemporaryDirectory(prefix="speedup-") as tmp, ExitStack() as stack:
            engines = ENGINES[runtime](args, drafter, target, Path(tmp), stack)
            label = engines.pop("label")
            for measure in engines.values():  # warm-up: first requests compile and allocate
                measure(prompts[:4], 4)
            runs = {(name, c): [] for name in engines for c in levels}
            for _ in range(args.repeats):  # the engines take turns: drift hits all alike
                for c in levels:
                    for name, measure in engines.items():
                        runs[name, c].append(measure(prompts, c))
        rows = [{"depth": d, **summarise(c, runs[speculation(d), c], runs[ALONE, c])}
                for d in args.depths for c in levels]
        for row in rows:
            row.update(bandwidth_row(row, bandwidth))
        tables[runtime] = {"engine": label, "rows": rows}
    if args.json:
        print(json.dumps({"pair": str(args.pair), "drafter": str(drafter), "depths": args.depths,
                          "prompts": len(prompts), "prompts_are": prompts_what, "max_new_tokens": args.max_new_tokens,
                          "repeats": args.repeats, "bandwidth": bandwidth, "runtimes": tables}, indent=2))
    else:
        print(f"pair {args.pair}, drafter {drafter.name}; {len(prompts)} requests: {prompts_what}\n")
        for table in tables.values():
            print_table(table["rows"], table["engine"], args, len(prompts))
        print_bandwidth(bandwidth, tables)
    draw(tables, args.plot)


def bandwidth_figures(drafter: Path, target: Path) -> dict:
    """This machine's streaming-read bandwidth, measured here, and the bytes the pair reads a step:
    the times a bandwidth-bound engine would take (benchmarks/bandwidth_bound.py)."""
    import torch

    bytes_per_s = measure_bandwidth(BANDWIDTH_GIB, BANDWIDTH_READS)
    target_bytes, drafter_bytes = target_bytes_per_forward(target), drafter_bytes_per_step(drafter, target)
    return {"bytes_per_s": bytes_per_s, "torch_threads": torch.get_num_threads(), "tensor_gib": BANDWIDTH_GIB,
            "reads": BANDWIDTH_READS, "target_bytes": target_bytes, "drafter_bytes": drafter_bytes,
            "t_target_s": target_bytes / bytes_per_s, "t_draft_s": drafter_bytes / bytes_per_s}


def bandwidth_row(row: dict, bandwidth: dict) -> dict:
    """A C = 1 row's bandwidth bound (tau from the row) and its ratio over it; None at other levels."""
    if row["concurrency"] != 1:
        return {"bandwidth_bound": None, "ratio_over_bandwidth_bound": None, "alone_s_per_token": None}
    bound = speedup_bound(row["tau_bound"], bandwidth["t_target_s"], bandwidth["t_draft_s"], row["depth"])
    return {"bandwidth_bound": bound, "ratio_over_bandwidth_bound": row["ratio"] / bound,
            "alone_s_per_token": 1 / row["target_alone_tok_s"]}


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
    depths = ", ".join(map(str, args.depths))
    print(f"{engine}, fp32 greedy, depth {depths}, {prompts} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats}")
    print(f"{'depth':>5} {'C':>3} {'spec tok/s':>11} {'spec batch':>11} {'alone tok/s':>12} {'alone batch':>12} "
          f"{'ratio':>6} {'(range)':>13} {'bound tau':>10} {'ratio/tau':>10} {'bw bound':>9} {'ratio/bw':>9} "
          f"{'seed':>6} {'same tokens':>12}  note")
    for r in rows:
        seed = f"{r['seed_ratio']:.2f}" if r["seed_ratio"] else "-"
        low, high = r["ratio_range"]
        same = f"{r['same_tokens']}/{r['prompts']}"
        batch = lambda b: "-" if b is None else f"{b:.1f}"  # noqa: E731
        figure = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"{r['depth']:>5} {r['concurrency']:>3} {r['speculation_tok_s']:>11.1f} "
              f"{batch(r['speculation_mean_batch']):>11} "
              f"{r['target_alone_tok_s']:>12.1f} {batch(r['target_alone_mean_batch']):>12} "
              f"{r['ratio']:>6.2f} {f'{low:.2f}-{high:.2f}':>13} {r['tau_bound']:>10.3f} {r['ratio_over_bound']:>10.2f} "
              f"{figure(r['bandwidth_bound']):>9} {figure(r['ratio_over_bandwidth_bound']):>9} "
              f"{seed:>6} {same:>12}  {r['batch_note']}")
    print("batch: mean sequences per backend call over every call of a measurement (vLLM: requests advanced per "
          "engine step, from its /metrics counters; median of the repeats; '-': not "
          f"measured); a ratio compares speculation with the target alone where the two are within "
          f"{BATCH_TOLERANCE:.0%}, else its note says why not.")
    print("bound: tau, tokens per target forward (this run; vLLM: its /metrics): the speed-up if drafting were free and "
          "a verify step cost one decode step; bw bound (C = 1): tau * t_target / (t_target + depth * t_draft), the "
          "speed-up of a bandwidth-bound engine once drafting is paid for (below); seed: Kimi-K2.6-NVFP4 on GB200, "
          "for scale only\n")


def print_bandwidth(bandwidth: dict, tables: dict) -> None:
    """The bandwidth bound's figures, and how close each engine's target alone came to it at C = 1."""
    gb = 1e9
    print(f"memory bandwidth: {bandwidth['bytes_per_s'] / gb:.1f} GB/s (torch.sum over a {bandwidth['tensor_gib']:g} "
          f"GiB fp32 tensor, best of {bandwidth['reads']}, {bandwidth['torch_threads']} torch threads: this process's "
          "default, which the vLLM engine keeps; measured before any engine started)")
    print(f"target: {bandwidth['target_bytes'] / gb:.3f} GB a forward (fp32, tied embedding once, lookup one row) -> "
          f"t_target {bandwidth['t_target_s'] * 1e3:.2f} ms")
    print(f"drafter: {bandwidth['drafter_bytes'] / gb:.4f} GB a draft step (fp32: fc, decoder layer, norms, lm_head "
          f"over the draft vocabulary, one target embedding row) -> t_draft {bandwidth['t_draft_s'] * 1e3:.2f} ms")
    for runtime, table in tables.items():
        alone = next((r["alone_s_per_token"] for r in table["rows"] if r["alone_s_per_token"] is not None), None)
        if alone is not None:
            print(f"{runtime}: target alone at C = 1: {alone * 1e3:.2f} ms per output token (prefill included) = "
                  f"{alone / bandwidth['t_target_s']:.2f} x t_target (1.00: bandwidth-bound)")
    print("bw bound assumes the verify forward (depth + 1 tokens) costs a decode step; KV-cache reads not counted\n")


def draw(tables: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    levels, top = [], 2.1
    for (runtime, table), marker in zip(tables.items(), "o^"):
        depths = sorted({r["depth"] for r in table["rows"]})
        for depth in depths:
            rows = [r for r in table["rows"] if r["depth"] == depth]
            name = f"{runtime}, depth {depth}" if len(depths) > 1 else runtime
            levels = [r["concurrency"] for r in rows]
            line, = ax.plot(levels, [r["ratio"] for r in rows], f"{marker}-",
                            label=f"{name}: speculation / target alone")
            ax.plot(levels, [r["tau_bound"] for r in rows], f"{marker}:", color=line.get_color(), alpha=0.6,
                    label=f"{name}: bound tau (this run)")
            bounds = [(r["concurrency"], r["bandwidth_bound"]) for r in rows if r["bandwidth_bound"] is not None]
            if bounds:
                ax.plot(*zip(*bounds), "x", color=line.get_color(), markersize=9,
                        label=f"{name}: bandwidth bound at C = 1")
            top = max(top, *(max(r["tau_bound"], r["ratio"]) for r in rows))  # a noisy ratio may pass tau
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
