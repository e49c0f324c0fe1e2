"""Read + validate throughput of the NVFP4 checkpoint reader, against plain file reading.

Writes a synthetic ModelOpt NVFP4 checkpoint of Llama-shaped layers (default 8 GB, in
2 GiB shards) into a temporary folder, then measures, each in a fresh process:

  raw     sequential read of every shard file into one reused buffer (the I/O ceiling)
  reader  NVFP4Checkpoint.open + every Linear (packed weights and block scales, validated)
          + every other tensor; every byte is then used once (copied into a reused buffer)

both with the page cache dropped for those files (cold, disk-bound) and warm (memory-bound).
Reports throughput, the reader/raw ratio (target >= 0.5) and the reader's peak RSS
(target < 1 GB, i.e. independent of checkpoint size). The folder is deleted afterwards.

    python benchmarks/nvfp4_read_throughput.py --size-gb 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_BYTES = 2 << 30
_BYTES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


# --------------------------------------------------------------------------------------------
# Synthetic checkpoint (written by hand so that generating 8 GB needs only a few MB of memory)


def layer_specs(layer: int, hidden: int, inter: int, kv: int) -> list[tuple[str, str, list[int]]]:
    p = f"model.layers.{layer}"
    specs = [(f"{p}.input_layernorm.weight", "BF16", [hidden]), (f"{p}.post_attention_layernorm.weight", "BF16", [hidden])]
    for name, out_f, in_f in [("self_attn.q_proj", hidden, hidden), ("self_attn.k_proj", kv, hidden),
                              ("self_attn.v_proj", kv, hidden), ("self_attn.o_proj", hidden, hidden),
                              ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
                              ("mlp.down_proj", hidden, inter)]:
        specs += [(f"{p}.{name}.weight", "U8", [out_f, in_f // 2]),
                  (f"{p}.{name}.weight_scale", "F8_E4M3", [out_f, in_f // 16]),
                  (f"{p}.{name}.weight_scale_2", "F32", []), (f"{p}.{name}.input_scale", "F32", [])]
    return specs


def nbytes(spec) -> int:
    n = _BYTES[spec[1]]
    for s in spec[2]:
        n *= s
    return n


def write_checkpoint(folder: Path, size_bytes: int, hidden: int, vocab: int) -> int:
    import torch

    inter, kv = hidden * 7 // 2, hidden // 4
    specs = [("model.embed_tokens.weight", "BF16", [vocab, hidden]), ("lm_head.weight", "BF16", [vocab, hidden]),
             ("model.norm.weight", "BF16", [hidden])]
    layers = 0
    while sum(map(nbytes, specs)) < size_bytes:
        specs += layer_specs(layers, hidden, inter, kv)
        layers += 1
    shards, current, size = [], [], 0
    for spec in specs:
        if current and size + nbytes(spec) > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes(spec)
    shards.append(current)

    gen = torch.Generator().manual_seed(0)
    pool = {  # 16 MB of bytes to slice from; block scales: positive, finite, non-zero FP8
        "U8": torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=gen).numpy().tobytes(),
        "F8_E4M3": torch.randint(0x20, 0x48, (16 << 20,), dtype=torch.uint8, generator=gen).numpy().tobytes(),
        "BF16": torch.full((8 << 20,), 0.02, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes(),
        "F32": struct.pack("<f", 1e-3) * (4 << 20),
    }
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, shard, pool)
        weight_map.update({s[0]: fname for s in shard})
    total = sum(map(nbytes, specs))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
              "num_key_value_heads": kv // 128, "vocab_size": vocab, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "synthetic", "version": "0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head", "model.embed_tokens"]}}))
    return layers


def write_safetensors(path: Path, specs, pool) -> None:
    header, offset = {}, 0
    for name, dtype, shape in specs:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes((name, dtype, shape))]}
        offset += nbytes((name, dtype, shape))
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            left, src = nbytes(spec), pool[spec[1]]
            while left:
                chunk = min(left, len(src))
                f.write(src[:chunk])
                left -= chunk


# --------------------------------------------------------------------------------------------
# Measured phases (run in child processes so each has its own peak RSS)


def phase_raw(folder: Path) -> int:
    buf = bytearray(16 << 20)
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def phase_reader(folder: Path) -> int:
    """The reader hands out validated, memory-mapped tensors; the bytes are read when used.
    Using them here = copying every byte into one reused 16 MB buffer, as `raw` does. One
    thread: page faults on a mapping serialise on the process's memory-map lock, so more
    copying threads only contend (measured: 2-3x slower with torch's default threads)."""
    import torch

    from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint

    torch.set_num_threads(1)
    buf = torch.empty(16 << 20, dtype=torch.uint8)

    def use(t: torch.Tensor) -> int:
        flat = t.reshape(-1).view(torch.uint8)
        for chunk in flat.split(buf.numel()):
            buf[: chunk.numel()].copy_(chunk)
        return flat.numel()

    ckpt = NVFP4Checkpoint.open(folder)
    total = 0
    for q in ckpt.iter_linears():
        total += use(q.packed) + use(q.weight_scale) + 8
    for _, tensor in ckpt.iter_other_tensors():
        total += use(tensor)
    return total


def peak_rss() -> int:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: Linux carries that over from the
    parent across fork + exec, so a child would report the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_phase(phase: str, folder: Path, cold: bool) -> dict:
    if cold:
        drop_page_cache(folder)
    out = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", str(folder)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_page_cache(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size to write (GB, 1e9 bytes)")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size of the synthetic Llama layers")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tmp", type=Path, default=None, help="where to create the temporary folder")
    ap.add_argument("--phase", choices=["raw", "reader"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.phase:  # child process: one measured pass
        if args.phase == "reader":  # imports and torch's first-op set-up are not part of reading
            import torch

            import eagle31_export.formats.nvfp4.reader  # noqa: F401

            torch.empty(16 << 20, dtype=torch.uint8).fill_(0).sum()
        start = time.perf_counter()
        total = (phase_raw if args.phase == "raw" else phase_reader)(args.dir)
        seconds = time.perf_counter() - start
        print(json.dumps({"bytes": total, "seconds": seconds, "peak_rss": peak_rss()}))
        return

    folder = Path(tempfile.mkdtemp(prefix="nvfp4-bench-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        layers = write_checkpoint(folder, int(args.size_gb * 1e9), args.hidden, args.vocab)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        print(f"wrote {size / 1e9:.2f} GB ({layers} layers, hidden {args.hidden}, "
              f"{len(list(folder.glob('*.safetensors')))} shards) in {time.perf_counter() - t0:.1f} s")
        results = {}
        for mode in ("cold", "warm"):
            if mode == "warm":
                phase_raw(folder)  # bring the files into the page cache
            for phase in ("raw", "reader"):
                results[mode, phase] = r = run_phase(phase, folder, cold=mode == "cold")
                print(f"{mode:4s} {phase:6s}: {r['bytes'] / r['seconds'] / 1e9:6.2f} GB/s "
                      f"({r['seconds']:.2f} s), peak RSS {r['peak_rss'] / 2**20:.0f} MiB")
        for mode in ("cold", "warm"):
            raw, reader = results[mode, "raw"], results[mode, "reader"]
            ratio = (reader["bytes"] / reader["seconds"]) / (raw["bytes"] / raw["seconds"])
            print(f"{mode}: reader/raw throughput ratio {ratio:.2f} (target >= 0.5)")
        peak = max(results[m, "reader"]["peak_rss"] for m in ("cold", "warm"))
        print(f"reader peak RSS {peak / 2**20:.0f} MiB for a {size / 1e9:.2f} GB checkpoint (target < 1024 MiB)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
