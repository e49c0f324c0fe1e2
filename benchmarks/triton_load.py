"""Load on a real Triton server (the `cpu` repository): concurrent streaming gRPC clients, every
output compared with the PyTorch reference loop's.

    .venv/bin/python benchmarks/triton_load.py [--clients 32 --requests 10 --max-tokens 32 --depth 3]

The pair (default: the tiny trained pair in examples/tiny/models, EAGLE 3.1 drafter) is bundled
for TensorRT-LLM and exported as a `cpu` Triton repository into a temporary folder; nvidia-pytriton's
tritonserver serves it on 127.0.0.1. Prompts are seeded windows of 8..48 tokens from the standard
library files the tiny target never saw in training (`held_out_files.json`). Each client sends its
requests one after another (gRPC stream, `eagle31_speculate`); all clients run at once. A request
is a mismatch unless its tokens and accepted-per-round counts equal the reference loop's.
Prints errors, mismatches, wall time, requests/s, tokens/s, latency percentiles and tau.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pair_parser(description: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser with the pair it serves: --pair, or --drafter / --target."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--pair", type=Path, default=ROOT / "examples" / "tiny" / "models",
                   help="folder with target/ and drafter-eagle31/ (or give --drafter / --target)")
    p.add_argument("--drafter", type=Path)
    p.add_argument("--target", type=Path)
    return p


def parse_args() -> argparse.Namespace:
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=10, help="requests per client, sent one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--depth", type=int, default=3, help="num_draft_tokens")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return p.parse_args()


def held_out_prompts(pair: Path, target: Path, n: int, seed: int) -> list[list[int]]:
    """`n` token windows from the standard-library files the tiny target was not trained on."""
    import sysconfig

    from eagle31_export.formats.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target, needed_for="the benchmark's prompts")
    names = json.loads((pair / "held_out_files.json").read_text()) if (pair / "held_out_files.json").is_file() else []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(errors="replace") for name in names if (stdlib / name).is_file()]
    if not texts:
        raise SystemExit("no held-out text found: pass a pair folder with held_out_files.json")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        doc = rng.choice([d for d in ids if len(d) > 64])
        length = rng.randint(8, 48)
        start = rng.randrange(len(doc) - length)
        prompts.append(doc[start:start + length])
    return prompts


def main() -> None:
    args = parse_args()
    from eagle31_export.export.trtllm import export_trtllm
    from eagle31_export.reference.pair import load_pair
    from eagle31_export.reference.speculate import speculate
    from eagle31_export.runtime.triton_repo import export_triton
    from eagle31_export.runtime.triton_server import TritonServer, free_ports

    drafter = args.drafter or args.pair / "drafter-eagle31"
    target = args.target or args.pair / "target"
    total = args.clients * args.requests
    prompts = held_out_prompts(args.pair, target, total, args.seed)
    jobs = [[(prompts[c * args.requests + r], args.max_tokens) for r in range(args.requests)]
            for c in range(args.clients)]

    with tempfile.TemporaryDirectory(prefix="triton-load-") as tmp:
        bundle = export_trtllm(drafter, target, Path(tmp) / "bundle", max_draft_len=args.depth)
        repo = export_triton(bundle, Path(tmp) / "repo", "cpu")
        http, grpc = free_ports(2)
        with TritonServer([repo], http_port=http, grpc_port=grpc, env={"OMP_NUM_THREADS": str(args.threads)}) as srv:
            # the reference first, alone (it would compete with the server for the cores)
            ref_pair = load_pair(drafter, target)
            start = time.perf_counter()
            expected = [speculate(ref_pair.target, ref_pair.drafter, p, n, args.depth) for job in jobs for p, n in job]
            reference_s = time.perf_counter() - start
            results = run_load(srv.grpc_url, jobs, args.depth)
    outcomes = [o for client in results for o in client]
    mismatches = sum(1 for (kind, got, _), ref in zip(outcomes, expected)
                     if kind == "ok" and (got.tokens, got.accepted_per_step) != (ref.tokens, ref.accepted_per_step))
    errors = [got for kind, got, _ in outcomes if kind == "error"]
    wall = max(end for _, _, (_, end) in outcomes) - min(begin for _, _, (begin, _) in outcomes)
    latencies = sorted(end - begin for _, _, (begin, end) in outcomes)
    tokens = sum(len(got.tokens) for kind, got, _ in outcomes if kind == "ok")
    taus = [got.acceptance_length for kind, got, _ in outcomes if kind == "ok"]
    report = {
        "clients": args.clients, "requests_per_client": args.requests, "requests": total,
        "max_tokens": args.max_tokens, "depth": args.depth, "server_threads": args.threads,
        "errors": len(errors), "mismatches": mismatches, "wall_s": wall, "requests_per_s": total / wall,
        "tokens_per_s": tokens / wall, "latency_p50_s": latencies[len(latencies) // 2],
        "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        "tau_mean": statistics.fmean(taus) if taus else 0.0,
        "reference_s": reference_s, "first_errors": [str(e) for e in errors[:3]],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.clients} streaming clients x {args.requests} requests (max_tokens {args.max_tokens}, "
          f"depth {args.depth}, server OMP_NUM_THREADS={args.threads})")
    print(f"errors      {report['errors']}")
    print(f"mismatches  {report['mismatches']}  (tokens and accepted_per_step vs the reference loop)")
    print(f"wall        {wall:.1f} s   {report['requests_per_s']:.1f} requests/s   "
          f"{report['tokens_per_s']:.0f} tokens/s")
    print(f"latency     p50 {report['latency_p50_s']:.2f} s   p95 {report['latency_p95_s']:.2f} s")
    print(f"tau         {report['tau_mean']:.2f} (mean over requests)")
    print(f"reference   {reference_s:.1f} s for the {total} requests (PyTorch loop, in process, before the load)")
    for e in report["first_errors"]:
        print(f"error: {e}")
    sys.exit(1 if errors or mismatches else 0)


def run_load(grpc_url: str, jobs: list[list[tuple[list[int], int]]], depth: int):
    """Every client's [(\"ok\"|\"error\", Generation|exception, (start, end))], clients in parallel."""
    from eagle31_export.runtime.triton_client import stream

    def client(job):
        out = []
        for prompt, max_tokens in job:
            begin = time.perf_counter()
            try:
                *_, (_, got) = stream(grpc_url, prompt, max_tokens=max_tokens, depth=depth)
                out.append(("ok", got, (begin, time.perf_counter())))
            except Exception as err:  # counted and shown
                out.append(("error", err, (begin, time.perf_counter())))
        return out

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(client, jobs))


if __name__ == "__main__":
    main()
