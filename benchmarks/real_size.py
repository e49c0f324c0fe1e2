"""Real-size memory and time of the CLI commands: peak RSS over checkpoint bytes, and wall time.

Builds, by code, a published-layout pair of random checkpoints and runs the installed CLI on it,
one subprocess per command:

  target   Llama-3.1-8B shaped by default (hidden 4096, 32 heads, 8 KV heads, head_dim 128,
           intermediate 14336, vocab 128256, rope_theta 500000, llama3 rope scaling, bf16) with
           `--target-layers N` decoder layers (default 4, ~3.9 GB; 32 is the full depth, ~16 GB;
           at least 3, the drafter's three taps); `--qwen3` for the Qwen3-8B shape (intermediate
           12288, vocab 151936, q/k norms). The safetensors shards are written tensor by tensor
           (one tensor in memory at a time), with a `model.safetensors.index.json`, so a 16 GB
           target never has to fit in memory.
  drafter  an EAGLE-3 drafter of the same width (draft vocabulary 32000, one decoder layer, 3 taps,
           valid d2t/t2d) in the layout `--layout` names, written by the project's own writer;
           `--eagle31` switches fc_norm and norm_output on.
  --nvfp4  quantizes the target with `quantize` (measured too) and uses the NVFP4 folder as target.

Commands (`--commands`, comma-separated; default all but the long ones): inspect, speculate (two
prompts, one process each), export-onnx, parity (`--runtime onnxruntime --mode replay` over the
export-onnx folder), export-trtllm, export-vllm; and, only when named, long-reference and
long-onnxruntime: `speculate` with one prompt of `--context` tokens (default 16384; Llama-3.1's
rope allows 131072 positions) and 4 new tokens on the reference and on the export-onnx folder; their
rows also give the KV caches that context needs (target + drafter, in the compute dtype, from the
shapes) and whether the peak less those meets the rule. Each runs under a small wrapper process that
times it and reads the peak RSS of the command's processes (`getrusage(RUSAGE_CHILDREN).ru_maxrss`, and the summed RSS of
its process tree sampled with psutil where that is installed; the larger of the two is reported).
A failing command is reported with its exit code and last stderr line; the others still run. A
command whose sampled RSS passes `--rss-cap` (default: 90 % of the memory available at the start)
is killed and reported as such, so that a long-context run cannot take the machine down.

The table gives, per command: exit code, wall seconds, peak RSS (GiB), the bytes on disk of the
checkpoints it reads (drafter + target folders; quantize: the bf16 target), their ratio, and whether
the command succeeded with a peak that meets `peak <= 1.1 x checkpoint + 512 MiB`. `--json PATH` writes the same rows.

    .venv/bin/python benchmarks/real_size.py                         # 8B widths, 4 target layers
    .venv/bin/python benchmarks/real_size.py --target-layers 32 --commands export-onnx,parity
    .venv/bin/python benchmarks/real_size.py --layout speculators --eagle31 --nvfp4 modelopt
    .venv/bin/python benchmarks/real_size.py --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 \\
        --vocab 512 --draft-vocab 128 --target-layers 3 --commands inspect,export-trtllm   # seconds
    .venv/bin/python benchmarks/real_size.py --layout specforge --target-layers 3 \\
        --commands export-onnx,long-reference,long-onnxruntime                  # 16k context

Everything is built in `--workdir` (default: a temporary folder) and removed at the end unless
`--keep` is given; each command's stdout and stderr are in its `logs/` folder. Free disk space is
checked before anything is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 1 << 30
COMMANDS = ("inspect", "speculate", "export-onnx", "parity", "export-trtllm", "export-vllm")
LONG_COMMANDS = ("long-reference", "long-onnxruntime")  # run only when named
# The memory rule every command is held to: peak RSS <= SCALE x checkpoint bytes + SLACK.
SCALE, SLACK = 1.1, 512 << 20
LONG_NEW_TOKENS = 4
LAYOUTS = ("eagle", "specforge", "speculators", "modelopt")

# Published configs (Hugging Face meta-llama/Llama-3.1-8B and Qwen/Qwen3-8B config.json); the
# layer count and, through the size arguments, the widths are overridden (hence an explicit
# head_dim for Llama too, which its published config derives from hidden / heads).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "head_dim": 128, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def fail(message: str) -> None:
    """Bad input or an environment that cannot hold the run: one line, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = p.add_argument_group("target shape (default: Llama-3.1-8B widths)")
    shape.add_argument("--qwen3", action="store_true", help="Qwen3-8B preset (intermediate 12288, vocab 151936, "
                                                            "q/k norms, rope_theta 1e6)")
    shape.add_argument("--target-layers", type=int, default=4, help="decoder layers of the target (32: full depth)")
    shape.add_argument("--hidden", type=int, help="hidden size (default 4096)")
    shape.add_argument("--heads", type=int, help="attention heads (default 32)")
    shape.add_argument("--kv-heads", type=int, help="key/value heads (default 8)")
    shape.add_argument("--head-dim", type=int, help="head dimension (default hidden / heads)")
    shape.add_argument("--intermediate", type=int, help="MLP width (default 14336; Qwen3 12288)")
    shape.add_argument("--vocab", type=int, help="target vocabulary (default 128256; Qwen3 151936)")
    shape.add_argument("--shard-gb", type=float, default=4.0, help="target shard size in GB (default 4)")
    drafter = p.add_argument_group("drafter")
    drafter.add_argument("--layout", choices=LAYOUTS, default="eagle", help="published drafter layout (default eagle)")
    drafter.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (default 32000)")
    drafter.add_argument("--draft-intermediate", type=int, help="drafter MLP width (default: the target's)")
    drafter.add_argument("--eagle31", action="store_true", help="EAGLE 3.1: fc_norm and norm_output on")
    p.add_argument("--nvfp4", choices=("modelopt", "compressed-tensors"),
                   help="quantize the target with `quantize --format` (measured) and use that as the target")
    p.add_argument("--commands", default=",".join(COMMANDS),
                   help=f"comma-separated subset of {','.join(COMMANDS + LONG_COMMANDS)}")
    p.add_argument("--context", type=int, default=16384, help="prompt tokens of the long-* commands (default 16384)")
    p.add_argument("--rss-cap", type=float, help="GiB of RSS at which a command is killed "
                                                 "(default: 90%% of the memory available at the start)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per prompt (speculate, parity)")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default 16)")
    p.add_argument("--dtype", help="pass --dtype to speculate and export onnx (default: the CLI's own default)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a command is killed (default 3600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="build here (default: a temporary folder removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep --workdir's folders afterwards")
    p.add_argument("--json", type=Path, dest="json_path", help="also write the rows as JSON to this file")
    args = p.parse_args(argv)

    base = QWEN3_8B if args.qwen3 else LLAMA31_8B
    args.hidden = args.hidden or base["hidden_size"]
    args.heads = args.heads or base["num_attention_heads"]
    args.kv_heads = args.kv_heads or base["num_key_value_heads"]
    args.head_dim = args.head_dim or args.hidden // args.heads
    args.intermediate = args.intermediate or base["intermediate_size"]
    args.vocab = args.vocab or base["vocab_size"]
    args.draft_intermediate = args.draft_intermediate or args.intermediate
    for name in ("target_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "draft_vocab",
                 "draft_intermediate", "max_new_tokens", "prompt_len", "context"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")
    if args.target_layers < 3:
        fail(f"--target-layers {args.target_layers}: the drafter taps 3 different target layers; give at least 3")
    if args.heads % args.kv_heads:
        fail(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.draft_vocab > args.vocab:
        fail(f"--draft-vocab {args.draft_vocab} exceeds --vocab {args.vocab}")
    if not args.shard_gb > 0 or not math.isfinite(args.shard_gb):
        fail(f"--shard-gb {args.shard_gb}: expected a positive number")
    if not args.timeout > 0:
        fail(f"--timeout {args.timeout}: expected a positive number of seconds")
    chosen = [c.strip() for c in args.commands.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in COMMANDS + LONG_COMMANDS]
    if unknown or not chosen:
        fail(f"--commands {args.commands!r}: {'unknown ' + unknown[0] if unknown else 'empty'}; "
             f"choose from {','.join(COMMANDS + LONG_COMMANDS)}")
    # the order dependencies need (export-onnx before parity and long-onnxruntime)
    args.commands = [c for c in COMMANDS + LONG_COMMANDS if c in chosen]
    positions = (QWEN3_8B if args.qwen3 else LLAMA31_8B)["max_position_embeddings"]
    if any(c in LONG_COMMANDS for c in args.commands) and args.context + LONG_NEW_TOKENS > positions:
        fail(f"--context {args.context}: the target's rope covers {positions} positions, "
             f"{LONG_NEW_TOKENS} of them for the new tokens")
    if args.rss_cap is not None and not args.rss_cap > 0:
        fail(f"--rss-cap {args.rss_cap}: expected a positive number of GiB")
    return args


# --------------------------------------------------------------------------------------------
# The target: a Hugging Face causal LM folder written by hand, tensor by tensor


def target_config(args: argparse.Namespace) -> dict:
    cfg = dict(QWEN3_8B if args.qwen3 else LLAMA31_8B)
    cfg.update(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
               head_dim=args.head_dim, intermediate_size=args.intermediate, vocab_size=args.vocab,
               num_hidden_layers=args.target_layers)
    if args.qwen3:
        cfg["max_window_layers"] = args.target_layers
    for key, fallback in (("bos_token_id", 0), ("eos_token_id", 1)):  # a small --vocab has no room for the ids
        if cfg[key] >= args.vocab:
            cfg[key] = min(fallback, args.vocab - 1)
    return cfg


def target_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in the order Hugging Face checkpoints store them (all bf16)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,)),
                  (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                  (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        if cfg["model_type"] == "qwen3":
            specs += [(p + "self_attn.q_norm.weight", (cfg["head_dim"],)),
                      (p + "self_attn.k_norm.weight", (cfg["head_dim"],))]
        specs += [(p + "post_attention_layernorm.weight", (h,)),
                  (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                  (p + "mlp.down_proj.weight", (h, inter))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return specs


def specs_bytes(specs) -> int:
    return sum(2 * math.prod(shape) for _, shape in specs)


def random_bf16(shape: tuple[int, ...], seed: int):
    """Weights of a sane scale: norms 1, matrices normal * 0.02 (as initializer_range), made in bf16."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.bfloat16).mul_(0.02)


def shard_plan(specs, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        n = 2 * math.prod(spec[1])
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def write_shard(path: Path, specs, seed: int, first_index: int) -> None:
    """One safetensors file: the header from the shapes, then each tensor made, written, released."""
    import torch

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors writer pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (_, shape) in enumerate(specs):
            t = random_bf16(shape, seed * 1_000_003 + first_index + i)
            f.write(memoryview(t.view(dtype=torch.int16).numpy()).cast("B"))  # numpy has no bf16
            del t


def write_target(folder: Path, cfg: dict, seed: int, shard_bytes: int) -> None:
    folder.mkdir(parents=True)
    specs = target_specs(cfg)
    shards = shard_plan(specs, shard_bytes)
    weight_map, index = {}, 0
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        write_shard(folder / name, shard, seed, index)
        index += len(shard)
        weight_map.update({tensor: name for tensor, _ in shard})
    if len(shards) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": specs_bytes(specs)}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}, indent=2))


# --------------------------------------------------------------------------------------------
# The drafter: canonical tensors written in a published layout by the project's writer


def tapped_layers(num_layers: int) -> tuple[int, ...] | None:
    """None (the layout's default, as published drafters leave it) where EAGLE-3's default taps
    (1, N/2-1, N-4) are three different layers of the target; otherwise three spread over it."""
    from eagle31_export.config import default_aux_layer_ids

    ids = default_aux_layer_ids(num_layers)
    if len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids):
        return None
    return (0, num_layers // 2, num_layers - 1)


def drafter_config(args: argparse.Namespace, tcfg: dict):
    from eagle31_export.config import DrafterConfig

    return DrafterConfig(
        hidden_size=args.hidden, intermediate_size=args.draft_intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab,
        draft_vocab_size=args.draft_vocab, rms_norm_eps=tcfg["rms_norm_eps"], rope_theta=tcfg["rope_theta"],
        rope_scaling=tcfg["rope_scaling"], max_position_embeddings=tcfg["max_position_embeddings"],
        aux_layer_ids=tapped_layers(args.target_layers), fc_norm=args.eagle31, norm_output=args.eagle31,
        torch_dtype="bfloat16")


def drafter_bytes(cfg) -> int:
    from eagle31_export.formats.drafter.checkpoint import expected_shapes

    shapes = expected_shapes(cfg)
    floats = sum(math.prod(s) for n, s in shapes.items() if n not in ("d2t", "t2d", "embed_tokens.weight"))
    return 2 * floats + 8 * cfg.draft_vocab_size + cfg.vocab_size


def write_drafter_folder(folder: Path, cfg, layout: str, seed: int) -> None:
    import torch

    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, expected_shapes, t2d_from_d2t, write_drafter

    tensors = {}
    for i, (name, shape) in enumerate(expected_shapes(cfg).items()):
        if name in ("d2t", "t2d", "embed_tokens.weight"):  # embeddings come from the target, as published
            continue
        tensors[name] = random_bf16(shape, seed * 1_000_003 + 500_000 + i)
    gen = torch.Generator().manual_seed(seed + 1)
    chosen = torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values
    tensors["d2t"] = chosen - torch.arange(cfg.draft_vocab_size)  # offsets: draft id d is target id d + d2t[d]
    tensors["t2d"] = t2d_from_d2t(tensors["d2t"], cfg.vocab_size)
    write_drafter(DrafterCheckpoint(cfg, tensors), folder, layout)


# --------------------------------------------------------------------------------------------
# Measuring one command


@dataclass
class Row:
    command: str
    exit: int
    wall_s: float
    peak_rss_gib: float
    checkpoint_gib: float
    ratio: float
    meets_target: bool
    peak_rss_bytes: int = 0
    checkpoint_bytes: int = 0
    error: str = ""
    argv: list[list[str]] = field(default_factory=list)
    # long-* rows: the KV caches their context needs (target and drafter, in the compute dtype)
    kv_cache_bytes: int = 0


# Runs in its own process so that RUSAGE_CHILDREN covers exactly this command's processes.
# argv[1]: a JSON list of command lines run one after another, argv[2]: timeout, argv[3]/[4]: stderr and
# stdout files (kept in the work folder's logs/ for a look at what a command said), argv[5]: the RSS in
# bytes at which the command is killed (0: none; sampled, so it needs psutil).
WRAPPER = r"""
import json, os, resource, signal, subprocess, sys, time
cmds, timeout, err_path, out_path = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
cap = int(sys.argv[5])
try:
    import psutil
except ImportError:
    psutil = None
tree_peak, code, start = 0, 0, time.perf_counter()
with open(err_path, "ab") as err, open(out_path, "ab") as out:
    for cmd in cmds:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if psutil is not None:
                try:
                    root = psutil.Process(proc.pid)
                    tree_peak = max(tree_peak, sum(p.memory_info().rss for p in [root] + root.children(True)))
                except psutil.Error:
                    pass
            if cap and tree_peak > cap:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                err.write(("killed: RSS passed the cap of %.1f GiB\n" % (cap / 2**30)).encode())
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                err.write(("timed out after %g s\n" % timeout).encode())
                break
            time.sleep(0.05)
        code = proc.returncode
        if code:
            break
wall = time.perf_counter() - start
peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, tree_peak)
print(json.dumps({"exit": code, "wall_s": wall, "peak_rss": peak}))
"""


def kv_cache_bytes(tcfg: dict, dcfg, tokens: int, dtype: str | None) -> int:
    """Keys and values of every target layer and the drafter's layer for `tokens` positions, in the
    compute dtype (fp32 unless --dtype says bf16/fp16): data the context itself holds, beside weights."""
    width = 2 if dtype in ("bf16", "fp16") else 4
    per_token = lambda layers, kv_heads, head_dim: layers * 2 * kv_heads * head_dim * width  # noqa: E731
    return tokens * (per_token(tcfg["num_hidden_layers"], tcfg["num_key_value_heads"], tcfg["head_dim"])
                     + per_token(dcfg.num_layers, dcfg.num_key_value_heads, dcfg.head_dim))


def meets_rule(peak: int, ckpt: int) -> bool:
    return peak <= SCALE * ckpt + SLACK


def default_rss_cap() -> int:
    """90 % of MemAvailable (Linux), else no cap."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(0.9 * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return 0


def measure(name: str, cmds: list[list[str]], ckpt_bytes: int, workdir: Path, timeout: float,
            rss_cap: int = 0) -> Row:
    err_path = workdir / "logs" / f"{name}.stderr"
    err_path.parent.mkdir(exist_ok=True)
    out_path = err_path.with_suffix(".stdout")
    done = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(cmds), str(timeout), str(err_path),
                           str(out_path), str(rss_cap)], capture_output=True, text=True, cwd=workdir)
    if done.returncode:
        raise RuntimeError(f"the measuring wrapper failed: {done.stderr.strip().splitlines()[-1:]}")
    m = json.loads(done.stdout)
    lines = [ln.strip() for ln in err_path.read_text(errors="replace").splitlines() if ln.strip()]
    peak, ckpt = m["peak_rss"] / GIB, ckpt_bytes / GIB
    return Row(name, m["exit"], round(m["wall_s"], 3), peak, ckpt, peak / ckpt,
               m["exit"] == 0 and meets_rule(m["peak_rss"], ckpt_bytes), m["peak_rss"], ckpt_bytes,
               lines[-1] if m["exit"] and lines else "", cmds)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------


def check_disk(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free < need:
        fail(f"{where}: {free / GIB:.1f} GiB free, the checkpoints and outputs need about {need / GIB:.1f} GiB; "
             "free space or choose another --workdir")


def run(args: argparse.Namespace, workdir: Path) -> list[Row]:
    tcfg = target_config(args)
    dcfg = drafter_config(args, tcfg)
    t_bytes, d_bytes = specs_bytes(target_specs(tcfg)), drafter_bytes(dcfg)
    # Outputs: export onnx may write fp32 graphs (twice the bf16 bytes), NVFP4 about 0.3x the target,
    # the bundles a drafter copy each.
    need = t_bytes + d_bytes + (2 * (t_bytes + d_bytes) if "export-onnx" in args.commands else 0) \
        + (t_bytes // 3 if args.nvfp4 else 0) + 2 * d_bytes + (64 << 20)
    check_disk(workdir, need)

    target, drafter = workdir / "target", workdir / "drafter"
    start = time.perf_counter()
    print(f"writing target ({t_bytes / GIB:.2f} GiB, {args.target_layers} layers) and {args.layout} drafter "
          f"({d_bytes / GIB:.2f} GiB) into {workdir}", file=sys.stderr)
    write_target(target, tcfg, args.seed, int(args.shard_gb * 1e9))
    write_drafter_folder(drafter, dcfg, args.layout, args.seed)
    print(f"built in {time.perf_counter() - start:.1f} s", file=sys.stderr)

    import random

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(2)]
    long_prompt = ",".join(str(rng.randrange(args.vocab)) for _ in range(args.context))
    if any(c in LONG_COMMANDS for c in args.commands) and len(long_prompt) >= 128 * 1024:
        fail(f"--context {args.context}: the prompt's ids do not fit one command-line argument (128 KiB)")
    rss_cap = int(args.rss_cap * GIB) if args.rss_cap else default_rss_cap()
    (workdir / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))

    cli = [sys.executable, "-m", "eagle31_export.cli.main"]
    rows: list[Row] = []
    if args.nvfp4:
        quantized = workdir / f"target-nvfp4-{args.nvfp4}"
        rows.append(measure("quantize", [cli + ["quantize", str(target), "--out", str(quantized),
                                                "--format", args.nvfp4]], folder_bytes(target), workdir, args.timeout))
        if rows[-1].exit:
            return rows  # nothing else has a target to run on
        target = quantized
    pair = ["--drafter", str(drafter), "--target", str(target)]
    ckpt = folder_bytes(drafter) + folder_bytes(target)
    dtype = ["--dtype", args.dtype] if args.dtype else []
    tokens = ["--max-new-tokens", str(args.max_new_tokens)]
    onnx_dir = workdir / "onnx"
    steps = {
        "inspect": [cli + ["inspect", str(drafter), "--target", str(target), "--json"]],
        "speculate": [cli + ["speculate", *pair, "--prompt-ids", ",".join(map(str, p)), *tokens, *dtype, "--json"]
                      for p in prompts],
        "export-onnx": [cli + ["export", "onnx", *pair, "--out", str(onnx_dir), *dtype, "--force"]],
        "parity": [cli + ["parity", str(onnx_dir), *pair, "--runtime", "onnxruntime", "--mode", "replay",
                          "--prompts", str(workdir / "prompts.jsonl"), *tokens, "--json"]],
        "export-trtllm": [cli + ["export", "trtllm", *pair, "--out", str(workdir / "trtllm"), "--force"]],
        "export-vllm": [cli + ["export", "vllm", *pair, "--out", str(workdir / "vllm"), "--force"]],
    }
    for runtime in ("reference", "onnxruntime"):
        graphs = ["--onnx", str(onnx_dir)] if runtime == "onnxruntime" else []
        steps[f"long-{runtime}"] = [cli + ["speculate", *pair, *graphs, "--runtime", runtime, "--prompt-ids",
                                           long_prompt, "--max-new-tokens", str(LONG_NEW_TOKENS), *dtype, "--json"]]
    for name in args.commands:
        if name in ("parity", "long-onnxruntime") and not (onnx_dir / "graphs.json").is_file():
            rows.append(Row(name, -1, 0.0, 0.0, ckpt / GIB, 0.0, False, 0, ckpt,
                            "no export-onnx folder to check (run export-onnx in the same run)", steps[name]))
            continue
        print(f"running {name} ...", file=sys.stderr)
        rows.append(measure(name, steps[name], ckpt, workdir, args.timeout, rss_cap))
        if name in LONG_COMMANDS:
            rows[-1].kv_cache_bytes = kv_cache_bytes(tcfg, dcfg, args.context + LONG_NEW_TOKENS, args.dtype)
    return rows


def render(rows: list[Row]) -> str:
    head = (f"{'command':<16} {'exit':>4} {'wall s':>8} {'peak GiB':>9} {'ckpt GiB':>9} {'RSS/ckpt':>8}  "
            f"<={SCALE:g}x+{SLACK >> 20}MiB")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.command:<16} {r.exit:>4} {r.wall_s:>8.1f} {r.peak_rss_gib:>9.2f} {r.checkpoint_gib:>9.2f} "
                     f"{r.ratio:>8.2f}  {'yes' if r.meets_target else 'NO'}")
        if r.error:
            lines.append(f"{'':<16} failed: {r.error}")
        if r.kv_cache_bytes:
            kv = r.kv_cache_bytes / GIB
            lines.append(f"{'':<16} the KV caches of its context (target + drafter, from their shapes): "
                         f"{kv:.2f} GiB; peak less them {r.peak_rss_gib - kv:.2f} GiB, "
                         f"{'within' if meets_rule(r.peak_rss_bytes - r.kv_cache_bytes, r.checkpoint_bytes) else 'OVER'}"
                         " the rule")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workdir is not None:
        if args.workdir.exists() and any(args.workdir.iterdir()):
            fail(f"--workdir {args.workdir} is not empty; give an empty or new folder")
        args.workdir.mkdir(parents=True, exist_ok=True)
        workdir = args.workdir.resolve()
    else:
        workdir = Path(tempfile.mkdtemp(prefix="eagle31-real-size-"))
    try:
        rows = run(args, workdir)
    finally:
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    shape = (f"{'qwen3' if args.qwen3 else 'llama'} hidden {args.hidden}, {args.target_layers} target layers, "
             f"vocab {args.vocab}; {args.layout} drafter{' (EAGLE 3.1)' if args.eagle31 else ''}, "
             f"draft vocab {args.draft_vocab}" + (f"; NVFP4 {args.nvfp4}" if args.nvfp4 else "")
             + (f"; long-* at {args.context} prompt tokens" if set(args.commands) & set(LONG_COMMANDS) else ""))
    print(shape)
    print(render(rows))
    if args.json_path is not None:
        args.json_path.write_text(json.dumps({"shape": shape, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0 if all(r.exit == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
