#!/usr/bin/env python
"""GPU check of the PyTorch reference: the same pair on CUDA and on CPU, in fp32, must speculate alike.

    python benchmarks/gpu_check.py [--layers 4] [--new-tokens 16] [--skip-plugins] [--plugins-timeout 300]

1. The tiny trained pair (examples/tiny/models: the EAGLE 3.1 and EAGLE-3 drafters over the plain
   target, and the EAGLE 3.1 drafter over the NVFP4 target).
2. A pair at real widths built by code: a Llama-3.1-8B-shaped target (hidden 4096, 32 heads, 8 kv
   heads, intermediate 14336, vocab 128256) with only `--layers` layers and random weights, and an
   EAGLE 3.1 drafter (draft vocab 32000) tapping layers within them.

For each: greedy speculation on CPU, then the same modules moved to CUDA (`runtime/reference_runtime.py:
place`, what `--device cuda` does) and run again; reports whether tokens, drafts and accepted counts are
identical, the largest target-logit difference (one forward over prompt + generated tokens) and the
largest step-1 draft-logit difference. fp32 everywhere, TF32 off. Then runs
benchmarks/plugins_gpu_check.py (the CUDA kernels) as a subprocess and prints its output.

Needs a CUDA build of torch and a visible GPU; exits 2 with one line otherwise. Exit 1 when a pair
differs. Took 71-75 s on one H200, 14 s of it building the CUDA kernels.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from eagle31_export.reference.speculate import LoopObserver, Round  # noqa: E402

TINY = ROOT / "examples" / "tiny" / "models"
LLAMA_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                vocab_size=128256, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5)
DRAFT_VOCAB = 32000
PROMPTS = ([1, 5, 9, 14, 3, 7, 2, 11], [4, 8, 15, 16, 23, 42, 6, 1, 2, 3, 5, 8, 13, 21, 34, 55])


def cuda_problem() -> str | None:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build; run this check with a CUDA build on a GPU machine"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (torch.cuda.is_available() is False); this check needs one"
    return None


def exact_fp32() -> None:
    """CUDA fp32 matmuls may use TF32 unless told not to; the comparison is fp32 against fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class DraftLogits(LoopObserver):
    """Every round's step-1 draft logits, on the CPU."""

    wants_draft_logits = True

    def __init__(self):
        self.logits: list[torch.Tensor] = []

    def on_round(self, round: Round) -> None:
        self.logits.append(round.first_draft_logits.float().cpu())


def run_side(speculator, new_tokens: int, depth: int) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        observer = DraftLogits()
        result = speculator.run(prompt, new_tokens, depth, observer=observer)
        with torch.no_grad():
            speculator.target.reset()
            logits, taps = speculator.target.forward(torch.tensor([prompt + result.tokens]))
            speculator.target.reset()
        out.append({"result": result, "draft_logits": observer.logits, "target_logits": logits.float().cpu(),
                    "taps": taps.float().cpu()})
    return out


def compare(name: str, build, new_tokens: int, depth: int) -> dict:
    """`build()` -> a speculator on the CPU; run it, move it to CUDA, run again."""
    from eagle31_export.runtime.reference_runtime import place

    start = time.perf_counter()
    try:
        speculator = build()
        t_build = time.perf_counter() - start
        t0 = time.perf_counter()
        cpu = run_side(speculator, new_tokens, depth)
        t_cpu = time.perf_counter() - t0
        place(speculator, "cuda")
        t0 = time.perf_counter()
        gpu = run_side(speculator, new_tokens, depth)
        torch.cuda.synchronize()
        t_gpu = time.perf_counter() - t0
    except Exception as err:  # one pair failing is a result; the others still run
        return {"name": name, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    same = all(a["result"].tokens == b["result"].tokens and a["result"].drafts == b["result"].drafts
               and a["result"].accepted_per_step == b["result"].accepted_per_step for a, b in zip(cpu, gpu))
    target_diff = max(_diff(a["target_logits"], b["target_logits"]) for a, b in zip(cpu, gpu))
    taps_diff = max(_diff(a["taps"], b["taps"]) for a, b in zip(cpu, gpu))
    draft_diff = max((_diff(x, y) for a, b in zip(cpu, gpu) for x, y in zip(a["draft_logits"], b["draft_logits"])),
                     default=float("nan"))
    return {"name": name, "identical": same, "target_logits_max_diff": target_diff, "taps_max_diff": taps_diff,
            "draft_logits_max_diff": draft_diff, "tokens": sum(len(a["result"].tokens) for a in cpu),
            "rounds": sum(len(a["result"].accepted_per_step) for a in cpu),
            "seconds": {"build": t_build, "cpu": t_cpu, "cuda": t_gpu}}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def tiny(drafter: str, target: str):
    def build():
        from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator

        return load_speculator("reference", PairSource.of(TINY / drafter, TINY / target), LoadOptions(device="cpu"))

    return build


def real_layout(layers: int, seed: int = 0, widths: dict = LLAMA_8B, draft_vocab: int = DRAFT_VOCAB,
                init_device: str = "cuda"):
    """A Llama-3.1-8B-shaped target with `layers` layers (random weights, drawn on `init_device` for
    speed, then kept on the CPU) and an EAGLE 3.1 drafter with a 32000-token draft vocabulary tapping
    layers in it. `widths` / `draft_vocab` smaller: the same code at test sizes."""

    def build():
        sys.path.insert(0, str(ROOT / "tests"))
        from factories import drafter_config_for, random_drafter
        from transformers import LlamaConfig, LlamaForCausalLM

        from eagle31_export.config import TargetInfo
        from eagle31_export.reference.drafter import build_drafter
        from eagle31_export.reference.speculate import ReferenceDrafterBackend
        from eagle31_export.reference.target import ReferenceTarget
        from eagle31_export.runtime.registry import LoopSpeculator

        config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=8192, tie_word_embeddings=False,
                             initializer_range=0.02, **widths)
        torch.manual_seed(seed)
        with torch.device(init_device):
            model = LlamaForCausalLM(config).float().eval()
        model.to("cpu")
        if init_device == "cuda":
            torch.cuda.empty_cache()
        aux = (0, layers // 2, layers - 1) if layers >= 3 else (0, 1, 1)
        info = TargetInfo(model_type="llama", hidden_size=widths["hidden_size"], num_hidden_layers=layers,
                          vocab_size=widths["vocab_size"], num_attention_heads=widths["num_attention_heads"],
                          num_key_value_heads=widths["num_key_value_heads"],
                          intermediate_size=widths["intermediate_size"])
        cfg = drafter_config_for(info, fc_norm=True, norm_output=True, draft_vocab_size=draft_vocab,
                                 aux_layer_ids=aux, intermediate_size=widths["intermediate_size"],
                                 head_dim=widths["head_dim"], rope_theta=widths["rope_theta"])
        ckpt = random_drafter(cfg, seed)
        drafter = build_drafter(ckpt, dtype=torch.float32, target_model=model)
        return LoopSpeculator("reference", ReferenceTarget(model, aux), ReferenceDrafterBackend(drafter))

    return build


def plugins(timeout: int) -> int:
    print(f"\n--- benchmarks/plugins_gpu_check.py (timeout {timeout} s) ---", flush=True)
    try:
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plugins_gpu_check.py")], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        print((err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""))
        print(f"plugins_gpu_check.py: still running after {timeout} s; stopped")
        return 124
    print(done.stdout, end="")
    if done.stderr.strip():
        print(done.stderr, end="")
    print(f"plugins_gpu_check.py: exit {done.returncode}")
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="Target layers of the real-layout pair (2..4).")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--skip-plugins", action="store_true", help="Do not run plugins_gpu_check.py.")
    parser.add_argument("--skip-real", action="store_true", help="Only the tiny pair.")
    parser.add_argument("--plugins-timeout", type=int, default=300)
    args = parser.parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not 2 <= args.layers <= 4:
        print("error: --layers must be 2..4", file=sys.stderr)
        return 2
    exact_fp32()
    torch.set_num_threads(max(1, min(16, torch.get_num_threads())))
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}; fp32, TF32 off; "
          f"{len(PROMPTS)} prompts x {args.new_tokens} tokens, depth {args.depth}", flush=True)
    cases = [("tiny eagle31 / target", tiny("drafter-eagle31", "target")),
             ("tiny eagle3 / target", tiny("drafter-eagle3", "target")),
             ("tiny eagle31 / target-nvfp4", tiny("drafter-eagle31", "target-nvfp4"))]
    if not args.skip_real:
        cases.append((f"llama-8B widths, {args.layers} layers / eagle31 dv{DRAFT_VOCAB}", real_layout(args.layers)))
    failed = False
    for name, build in cases:
        row = compare(name, build, args.new_tokens, args.depth)
        if "error" in row:
            failed = True
            print(f"FAIL  {name}: {row['error']}", flush=True)
            continue
        failed |= not row["identical"]
        s = row["seconds"]
        print(f"{'ok   ' if row['identical'] else 'DIFF '} {name}: tokens/drafts/accepted "
              f"{'identical' if row['identical'] else 'DIFFER'} ({row['tokens']} tokens, {row['rounds']} rounds); "
              f"max |diff| target logits {row['target_logits_max_diff']:.3g}, taps {row['taps_max_diff']:.3g}, "
              f"draft logits {row['draft_logits_max_diff']:.3g}; build {s['build']:.1f} s, cpu {s['cpu']:.1f} s, "
              f"cuda {s['cuda']:.1f} s", flush=True)
    code = 0 if args.skip_plugins else plugins(args.plugins_timeout)
    print(f"\nsummary: reference CUDA vs CPU {'FAILED' if failed else 'identical'}; plugins check exit {code}")
    return 1 if failed or code not in (0,) else 0


if __name__ == "__main__":
    sys.exit(main())
