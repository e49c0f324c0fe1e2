"""Peak RSS of `export onnx` and of an ONNX Runtime parity run on a random Llama-shaped bf16 pair.

    .venv/bin/python benchmarks/onnx_export_memory.py [--work DIR] [--hidden 2048 --layers 8 --vocab 32000]

The pair (a bf16 target of about 1 GB with the defaults and an EAGLE 3.1 drafter that takes its
embeddings from the target) is made by code into `--work` once and reused by later runs. Each
command runs in its own process; its peak RSS is the kernel's high-water mark for that process
(`ru_maxrss`), printed next to the checkpoints' bytes and the bytes the export wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "onnx-export-memory")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--skip-parity", action="store_true")
    return p.parse_args()


def make_pair(args, work: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mid_pair import make_mid_pair

    return make_mid_pair(work, args.hidden, args.layers, args.intermediate, args.vocab)


def folder_bytes(folder: Path, suffix: str = "") -> int:
    return sum(p.stat().st_size for p in folder.rglob(f"*{suffix}") if p.is_file())


def run(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in GB, seconds) of one command in a child process."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: exec the command so that its RSS is its own; its reports are not needed
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.execv(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    return usage.ru_maxrss / 2**20, time.perf_counter() - start  # ru_maxrss is in KiB on Linux


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target, drafter = make_pair(args, args.work)
    ckpt_bytes = folder_bytes(target, ".safetensors") + folder_bytes(drafter, ".safetensors")
    out = args.work / "onnx"
    cli = [sys.executable, "-m", "eagle31_export.cli.main"]
    shutil.rmtree(out, ignore_errors=True)
    export_rss, export_s = run(cli + ["export", "onnx", "--drafter", str(drafter), "--target", str(target), "--out", str(out)])
    result = {"checkpoint_gb": ckpt_bytes / 1e9, "budget_gb": (1.1 * ckpt_bytes + 2**29) / 2**30,
              "export_peak_rss_gb": export_rss, "export_s": export_s,
              "written_gb": folder_bytes(out) / 1e9,
              "files_gb": {p.name: p.stat().st_size / 1e9 for p in sorted(out.iterdir()) if p.suffix == ".data"}}
    if not args.skip_parity:
        prompts = args.work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt_ids": [1 + i, 7 + 3 * i, 11, 5]}) + "\n" for i in range(2)))
        parity_rss, parity_s = run(cli + ["parity", str(out), "--drafter", str(drafter), "--target", str(target),
                                          "--runtime", "onnxruntime", "--prompts", str(prompts),
                                          "--max-new-tokens", str(args.max_new_tokens), "--json"])
        result.update({"parity_peak_rss_gb": parity_rss, "parity_s": parity_s})
    print(json.dumps(result, indent=2))
    print(f"(peak RSS in GiB; budget = 1.1 x checkpoint bytes + 512 MiB; self {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB)")


if __name__ == "__main__":
    main()
