#!/usr/bin/env python
"""GPU check of the EAGLE 3.1 CUDA kernels: correctness, then bandwidth at Kimi-K2.6 drafter sizes.

    python benchmarks/plugins_gpu_check.py [--build-dir DIR] [--rows 1,2,4,...,256] [--dtype bf16]

1. Builds the CPU and CUDA kernel libraries with the package's CMake helper (nvcc required).
2. Correctness: the CUDA kernels against the CPU kernels and the PyTorch reference (reference/ops.py)
   over shapes that reach every code path: 1..5 sources, odd hidden sizes and misaligned pointers
   (scalar loads), every row-tile configuration, fp32 / fp16 / bf16, both feedback conventions.
3. Bandwidth at H = Ht = 7168, k = 3 for rows 1..256: each fused kernel's time, its achieved memory
   bandwidth (minimal bytes moved / time) against the device's nominal peak and a measured
   device-to-device copy, and the time of the unfused PyTorch sequence it replaces.

Needs an NVIDIA GPU and a CUDA build of PyTorch; exits 2 with one line otherwise. Takes < 5 minutes
(most of it building the kernels). Exit status 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from eagle31_export.errors import UserError  # noqa: E402
from eagle31_export.kernels import build_plugins, fold_fc_norm_weights, load_cpu_kernels, load_cuda_kernels  # noqa: E402
from eagle31_export.reference import ops as ref  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
UNIT = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
KIMI = {"hidden": 7168, "target_hidden": 7168, "sources": 3, "eps": 1e-6}


# ---- setup ----------------------------------------------------------------------------------------


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def require_gpu() -> torch.device:
    if torch.version.cuda is None:
        fail("this PyTorch build has no CUDA support; run this check with a CUDA build of torch on a GPU machine")
    if not torch.cuda.is_available():
        fail("no NVIDIA GPU visible (torch.cuda.is_available() is False); this check needs one")
    return torch.device("cuda", torch.cuda.current_device())


def build(build_dir: Path | None):
    t0 = time.time()
    print("building the CPU and CUDA kernels with CMake ...", flush=True)
    try:
        result = build_plugins(build_dir, cuda=True)
    except UserError as err:
        fail(str(err))
    print(f"  built in {time.time() - t0:.0f} s: {', '.join(f'{k} {v}' for k, v in result.parts.items())}")
    return load_cpu_kernels(result.cpu_library), load_cuda_kernels(result.cuda_library)


# ---- correctness ----------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    error: float  # max |a - b| / max |b|
    limit: float

    @property
    def ok(self) -> bool:
        return self.error <= self.limit


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual.double().cpu() - expected).abs().max() / scale)


def fc_inputs(k: int, rows: int, ht: int, h: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(rows, ht, generator=gen) * 4.0 ** (i - 1)).to(dtype) for i in range(k)]
    weight = (torch.randn(h, k * ht, generator=gen) / (k * ht) ** 0.5).to(dtype)
    norms = [(1 + 0.3 * torch.randn(ht, generator=gen)).to(dtype) for _ in range(k)]
    return sources, weight, norms


def misaligned(t: torch.Tensor, device) -> torch.Tensor:
    """The same values at an address 2 bytes off 16-byte alignment (forces the scalar-load path)."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=device)
    view = flat[1:1 + t.numel()].view_as(t)
    view.copy_(t)
    return view


def check_fc_norm(cpu, cuda, device) -> list[Check]:
    checks = []
    cases = [  # (k, rows, ht, h): every tile configuration, odd sizes, 1..5 sources
        (1, 1, 64, 40), (3, 1, 64, 48), (3, 16, 128, 96), (3, 17, 128, 96), (2, 64, 256, 64),
        (3, 65, 256, 64), (5, 256, 64, 80), (3, 3, 33, 17), (4, 20, 7, 9),
        # the few-row kernel (1..8 rows): 2, 4 and 8 rows, K not a multiple of its 256-wide step, H odd,
        # and a source staged in two pieces (8 rows x 3000 columns > 40 KB)
        (2, 2, 264, 33), (3, 7, 136, 37), (5, 8, 512, 24), (3, 7, 3000, 37),
    ]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for k, rows, ht, h in cases:
            sources, weight, norms = fc_inputs(k, rows, ht, h, dtype, seed=k * rows + ht)
            folded = fold_fc_norm_weights(weight, norms, k)
            for has_norm in (True, False):
                w = folded if has_norm else weight
                gpu = cuda.fc_norm([s.to(device) for s in sources], w.to(device), KIMI["eps"], has_norm)
                host = cpu.fc_norm(sources, w, KIMI["eps"], has_norm)
                reference = ref.fc_norm_fusion(sources, weight, norms if has_norm else None, KIMI["eps"])
                # fp32 accumulation in a different order; fp16/bf16 outputs differ by output roundings.
                limit = 1e-5 if dtype == torch.float32 else 4 * UNIT[dtype]
                tag = f"fc_norm {str(dtype)[6:]} k={k} rows={rows} Ht={ht} H={h} norm={int(has_norm)}"
                checks.append(Check(f"{tag} vs CPU kernel", rel_error(gpu, host), limit))
                checks.append(Check(f"{tag} vs reference", rel_error(gpu, reference), 2 * limit))
        sources, weight, norms = fc_inputs(3, 5, 64, 32, dtype, seed=7)
        folded = fold_fc_norm_weights(weight, norms, 3)
        gpu = cuda.fc_norm([misaligned(s, device) for s in sources], folded.to(device), KIMI["eps"], True)
        checks.append(Check(f"fc_norm {str(dtype)[6:]} misaligned sources vs CPU kernel",
                            rel_error(gpu, cpu.fc_norm(sources, folded, KIMI["eps"], True)),
                            1e-5 if dtype == torch.float32 else 4 * UNIT[dtype]))
    return checks


def check_fc_norm_kimi(cpu, cuda, device, dtype) -> list[Check]:
    k, ht, h = KIMI["sources"], KIMI["target_hidden"], KIMI["hidden"]
    checks = []
    for rows in (1, 4, 8, 16):  # both kernels, sources staged in one, two and three pieces
        sources, weight, norms = fc_inputs(k, rows, ht, h, dtype, seed=11 + rows)
        folded = fold_fc_norm_weights(weight, norms, k)
        gpu = cuda.fc_norm([s.to(device) for s in sources], folded.to(device), KIMI["eps"], True)
        host = cpu.fc_norm(sources, folded, KIMI["eps"], True)
        checks.append(Check(f"fc_norm {str(dtype)[6:]} Kimi size (rows={rows}, H=Ht=7168, k=3) vs CPU kernel",
                            rel_error(gpu, host), 1e-5 if dtype == torch.float32 else 4 * UNIT[dtype]))
    return checks


def check_post_norm_feedback(cpu, cuda, device) -> list[Check]:
    checks = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, hidden in ((1, 7168), (256, 7168), (3, 33), (2, 4096), (5, 7)):
            gen = torch.Generator().manual_seed(rows + hidden)
            residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
            update = torch.randn(rows, hidden, generator=gen).to(dtype)
            weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
            for norm_output in (False, True):
                gpu = cuda.post_norm_feedback(residual.to(device), update.to(device), weight.to(device),
                                              KIMI["eps"], norm_output)
                host = cpu.post_norm_feedback(residual, update, weight, KIMI["eps"], norm_output)
                reference = ref.post_norm_feedback(residual, update, weight, KIMI["eps"], norm_output)
                tag = f"post_norm_feedback {str(dtype)[6:]} rows={rows} H={hidden} norm_output={int(norm_output)}"
                # Same roundings as the reference: at most one unit in the last place apart.
                limit = 2 * UNIT[dtype] if dtype != torch.float32 else 1e-6
                for name, g, h_, r in (("normed", gpu[0], host[0], reference[0]), ("fed_back", gpu[1], host[1], reference[1])):
                    checks.append(Check(f"{tag} {name} vs CPU kernel", rel_error(g, h_), limit))
                    checks.append(Check(f"{tag} {name} vs reference", rel_error(g, r), limit))
    return checks


# ---- timing ---------------------------------------------------------------------------------------


def time_gpu(fn: Callable[[], object], iters: int = 20) -> tuple[float, str]:
    """Seconds per call. CUDA-graph replay first, so that launch overhead (ctypes, Python) is not
    measured; plain back-to-back launches where capture is not possible."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        return _median_of(lambda: graph.replay()) / iters, "graph"
    except Exception:  # capture unsupported for this call: fall back to eager launches
        torch.cuda.synchronize()
        return _median_of(lambda: [fn() for _ in range(iters)]) / iters, "eager"


def _median_of(run: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def nominal_peak_bandwidth(device) -> float | None:
    """Bytes/s from the memory clock and bus width (double data rate), when the driver reports them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def copy_bandwidth(device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = time_gpu(lambda: dst.copy_(src), iters=5)
    return 2 * src.numel() / seconds  # read + write


@dataclass
class Row:
    rows: int
    fused_s: float
    fused_bytes: int
    torch_s: float
    mode: str


def bench_fc_norm(cuda, device, dtype, row_counts) -> list[Row]:
    k, ht, h = KIMI["sources"], KIMI["target_hidden"], KIMI["hidden"]
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(h, k * ht, device=device, dtype=dtype, generator=gen) / (k * ht) ** 0.5
    norms = [1 + 0.1 * torch.randn(ht, device=device, dtype=dtype, generator=gen) for _ in range(k)]
    folded = fold_fc_norm_weights(weight, norms, k)
    size = torch.finfo(dtype).bits // 8
    out = []
    for rows in row_counts:
        sources = [torch.randn(rows, ht, device=device, dtype=dtype, generator=gen) for _ in range(k)]
        fused, mode = time_gpu(lambda: cuda.fc_norm(sources, folded, KIMI["eps"], True))
        unfused, _ = time_gpu(lambda: ref.fc_norm_fusion(sources, weight, norms, KIMI["eps"]))
        moved = size * (h * k * ht + rows * k * ht + rows * h)  # weight once + activations + output
        out.append(Row(rows, fused, moved, unfused, mode))
    del weight, folded
    return out


def bench_post_norm_feedback(cuda, device, dtype, row_counts) -> list[Row]:
    h = KIMI["hidden"]
    size = torch.finfo(dtype).bits // 8
    out = []
    for rows in row_counts:
        residual, update = (torch.randn(rows, h, device=device, dtype=dtype) for _ in range(2))
        weight = torch.ones(h, device=device, dtype=dtype)
        fused, mode = time_gpu(lambda: cuda.post_norm_feedback(residual, update, weight, KIMI["eps"], True))
        unfused, _ = time_gpu(lambda: ref.post_norm_feedback(residual, update, weight, KIMI["eps"], True))
        moved = size * (4 * rows * h + h)  # read residual, update; write normed, fed_back; weight
        out.append(Row(rows, fused, moved, unfused, mode))
    return out


def print_table(title: str, rows: list[Row], peak: float | None, copy: float) -> None:
    print(f"\n{title}")
    header = f"{'rows':>5} {'fused us':>9} {'GB/s':>7} {'%peak':>6} {'%copy':>6} {'torch us':>9} {'speedup':>8}  timing"
    print(header)
    print("-" * len(header))
    for r in rows:
        bandwidth = r.fused_bytes / r.fused_s
        pct_peak = f"{100 * bandwidth / peak:6.1f}" if peak else f"{'n/a':>6}"
        print(f"{r.rows:>5} {r.fused_s * 1e6:>9.1f} {bandwidth / 1e9:>7.0f} {pct_peak} {100 * bandwidth / copy:>6.1f} "
              f"{r.torch_s * 1e6:>9.1f} {r.torch_s / r.fused_s:>7.2f}x  {r.mode}")


# ---- main -----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=None, help="CMake build folder (default: plugins/build)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="row counts to time")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the bandwidth runs")
    args = parser.parse_args()
    device = require_gpu()
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB)")
    cpu, cuda = build(args.build_dir)

    t0 = time.time()
    checks = check_fc_norm(cpu, cuda, device) + check_post_norm_feedback(cpu, cuda, device)
    checks += check_fc_norm_kimi(cpu, cuda, device, torch.bfloat16)
    failed = [c for c in checks if not c.ok]
    worst = max(checks, key=lambda c: c.error / c.limit)
    print(f"\ncorrectness: {len(checks) - len(failed)}/{len(checks)} checks passed in {time.time() - t0:.0f} s "
          f"(closest to its limit: {worst.name}: {worst.error:.2e} <= {worst.limit:.1e})")
    for c in failed:
        print(f"  FAIL {c.name}: error {c.error:.3e} > limit {c.limit:.1e}")

    dtype = DTYPES[args.dtype]
    row_counts = [int(r) for r in args.rows.split(",") if r.strip()]
    peak, copy = nominal_peak_bandwidth(device), copy_bandwidth(device)
    print(f"\nmemory bandwidth: nominal peak {peak / 1e9:.0f} GB/s, " if peak else "\nmemory bandwidth: nominal peak n/a, ",
          end="")
    print(f"measured device copy {copy / 1e9:.0f} GB/s")
    print_table(f"Eagle31FcNorm {args.dtype}, H={KIMI['hidden']}, Ht={KIMI['target_hidden']}, k={KIMI['sources']} "
                "(bytes = weight once + activations + output; torch = per-source RMSNorm, cat, linear; "
                "rows <= 8: the matrix-vector kernel, more: the tensor-core kernel)",
                bench_fc_norm(cuda, device, dtype, row_counts), peak, copy)
    print_table(f"Eagle31PostNormFeedback {args.dtype}, H={KIMI['hidden']} "
                "(bytes = 2 reads + 2 writes; small row counts are launch/latency-bound, not bandwidth-bound)",
                bench_post_norm_feedback(cuda, device, dtype, row_counts), peak, copy)
    if failed:
        print(f"\n{len(failed)} correctness check(s) FAILED")
        return 1
    print("\nall correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
