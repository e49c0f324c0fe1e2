"""Peak RSS of loading the PyTorch reference pair (and running a short speculation) against the
checkpoints' bytes, for a random Llama-shaped bf16 target (about 1 GB with the defaults), its
NVFP4 quantization (`--nvfp4`), and an EAGLE 3.1 drafter that takes its embeddings from the target.

    .venv/bin/python benchmarks/reference_memory.py [--work DIR] [--nvfp4] [--src DIR ...]

Each measurement runs in its own process; its peak RSS is the kernel's high-water mark for that
process (VmHWM; `ru_maxrss` would start from the parent's, which made the checkpoints). `--src`
names other source trees of the package (e.g. an earlier commit's, from
`git archive COMMIT eagle31_export | tar -x -C DIR`) to measure side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process: load the pair in fp32 compute, speculate a few tokens, report.
_MEASURE = r"""
import json, sys, torch
torch.set_num_threads(2)
import eagle31_export
from eagle31_export.reference.pair import load_pair
from eagle31_export.reference.speculate import speculate

def hwm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

drafter, target = sys.argv[1], sys.argv[2]
base = hwm_kib()
pair = load_pair(drafter, target, dtype=torch.float32)
loaded = hwm_kib()
out = speculate(pair.target, pair.drafter, list(range(1, 33)), 16, 3)
seen, held = set(), 0
for module in (pair.target.model, pair.drafter.drafter):
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr()); held += t.numel() * t.element_size()
print(json.dumps({"package": eagle31_export.__file__, "base_kib": base, "loaded_kib": loaded,
                  "peak_kib": hwm_kib(), "held": held,
                  "tokens": out.tokens[:8]}))
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "reference-memory")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nvfp4", action="store_true", help="also measure the NVFP4 quantization of the target")
    p.add_argument("--src", type=Path, action="append", default=[], help="another source tree to measure")
    return p.parse_args()


def make_pair(args, work: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mid_pair import make_mid_pair

    return make_mid_pair(work, args.hidden, args.layers, args.intermediate, args.vocab)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def measure(src: Path, drafter: Path, target: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    # run outside any source tree, so that PYTHONPATH decides which package is imported
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(drafter), str(target)], env=env, check=True,
                          capture_output=True, text=True, cwd=target.parent)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target, drafter = make_pair(args, args.work)
    targets = [("bf16", target)]
    if args.nvfp4:
        from eagle31_export.formats.target.quantize import quantize_checkpoint

        nvfp4 = args.work / "target-nvfp4"
        if not (nvfp4 / "config.json").is_file():
            quantize_checkpoint(target, nvfp4, "modelopt")
        targets.append(("nvfp4", nvfp4))
    gb = 1 << 30
    for kind, folder in targets:
        ckpt = folder_bytes(folder) + folder_bytes(drafter)
        print(f"{kind} target: checkpoints {ckpt / gb:.2f} GiB (target {folder_bytes(folder) / gb:.2f}, "
              f"drafter {folder_bytes(drafter) / gb:.2f}); budget 1.1x + 512 MiB = {(1.1 * ckpt + gb / 2) / gb:.2f} GiB")
        for src in [ROOT, *args.src]:
            r = measure(src, drafter, folder)
            peak = r["peak_kib"] * 1024
            print(f"  {Path(r['package']).parent.parent}: held {r['held'] / gb:.2f} GiB, peak RSS after load "
                  f"{r['loaded_kib'] * 1024 / gb:.2f} GiB, after speculating {peak / gb:.2f} GiB "
                  f"({peak / ckpt:.2f}x the checkpoints; interpreter and libraries {r['base_kib'] * 1024 / gb:.2f} "
                  f"GiB); tokens {r['tokens']}")


if __name__ == "__main__":
    main()
