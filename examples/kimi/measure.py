"""Run every command on a Kimi-shaped pair (bf16 and NVFP4 targets) and print the table of
`examples/kimi/README.md`: exit code, wall time and peak RSS of each, measured by GNU time.

    python examples/kimi/measure.py --pair examples/kimi/models --work out/kimi-measure

Needs /usr/bin/time (GNU time, for `-v`). Each command is a separate `eagle31-export` process, as a
user runs it; the work folder is replaced.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path


def run(argv: list[str], log: Path) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in MiB) of one command."""
    proc = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    log.write_text(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}")
    rss = float(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    return proc.returncode, seconds, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--parity-mode", choices=("replay", "autoregressive"), default="replay",
                        help="autoregressive: both sides run the target incrementally, as the runtime does (random "
                             "MoE weights have near-tied router scores, which a one-shot forward may route apart)")
    args = parser.parse_args()
    exe = str(Path(sys.executable).with_name("eagle31-export"))
    pair, work = args.pair, args.work
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    prompts = json.loads((pair / "prompts.json").read_text())["prompt_ids"]
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    drafter = pair / "drafter-eagle31"
    rows = []
    steps = [("quantize (bf16 -> NVFP4, experts only)", "-",
              ["quantize", pair / "target", "--out", work / "target-nvfp4", "--experts-only"])]
    for tname in ("target", "target-nvfp4"):
        target = pair / tname
        out = work / tname
        steps += [
            ("inspect drafter --target", tname, ["inspect", drafter, "--target", target]),
            ("inspect target", tname, ["inspect", target]),
            ("speculate", tname, ["speculate", "--drafter", drafter, "--target", target, "--prompt-ids",
                                  ",".join(map(str, prompts[0])), "--max-new-tokens", str(args.new_tokens),
                                  "--depth", "3"]),
            ("export onnx", tname, ["export", "onnx", "--drafter", drafter, "--target", target, "--out",
                                    out / "onnx", "--chain-depth", "3"]),
            ("export trtllm", tname, ["export", "trtllm", "--drafter", drafter, "--target", target, "--out",
                                      out / "trtllm"]),
            ("export vllm", tname, ["export", "vllm", "--drafter", drafter, "--target", target, "--out",
                                    out / "vllm"]),
            ("export sglang", tname, ["export", "sglang", "--drafter", drafter, "--target", target, "--out",
                                      out / "sglang"]),
            ("export triton --flavor cpu", tname, ["export", "triton", "--bundle", out / "trtllm", "--out",
                                                   out / "triton-cpu", "--flavor", "cpu"]),
            ("parity --runtime onnxruntime", tname, ["parity", "--drafter", drafter, "--target", target,
                                                     "--runtime", "onnxruntime", "--prompts", work / "prompts.jsonl",
                                                     "--max-new-tokens", str(args.new_tokens), "--out",
                                                     out / "parity", "--mode", args.parity_mode]),
        ]
    steps.append(("parity --runtime onnxruntime --act-quant (W4A4)", "target-nvfp4",
                  ["parity", "--drafter", drafter, "--target", pair / "target-nvfp4", "--runtime", "onnxruntime",
                   "--act-quant", "--prompts", work / "prompts.jsonl", "--max-new-tokens", str(args.new_tokens),
                   "--out", work / "parity-w4a4", "--mode", args.parity_mode]))
    for i, (what, tname, argv) in enumerate(steps):
        code, seconds, rss = run([exe, *map(str, argv)], work / "logs" / f"{i:02d}.log")
        verdict = "ok" if code == 0 else f"exit {code}"
        rows.append((what, tname, verdict, seconds, rss))
        print(f"| {what} | {tname} | {verdict} | {seconds:.1f} | {rss:.0f} |", flush=True)
    for report in sorted(work.rglob("parity*/report.json")):
        r = json.loads(report.read_text())
        print(f"{report.parent.relative_to(work)}: passed={r['passed']} mode={r['mode']} "
              f"tau reference {r['tau_reference']:.3f} runtime {r['tau_runtime']:.3f}")


if __name__ == "__main__":
    main()
