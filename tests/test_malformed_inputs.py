"""The malformed-input corpus: every command, given broken input the way users give it.

Each case copies small session fixtures, breaks one thing, runs the command in process and
checks the contract: exit 2 (1 for `inspect` and `verify` findings), exactly one line on stderr,
no traceback, no output left behind (neither --out nor a temporary sibling of it), and every
input file byte-for-byte unchanged (sha256 before and after).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle31_export.formats.outputs import MANIFEST, write_manifest
from eagle31_export.formats.drafter.checkpoint import write_drafter

VOCAB = 256  # the session target's vocabulary


# ---- building broken inputs ----------------------------------------------------------------------

class Env:
    """Fresh copies of the session fixtures under this test's tmp_path, and the paths a case uses."""

    def __init__(self, tmp: Path, fixtures: dict[str, Path]):
        self.tmp, self.fixtures = tmp, fixtures
        self.out = tmp / "out" / "result"  # --out of every writing command (its parent exists)
        self.out.parent.mkdir()

    def copy(self, name: str, as_name: str | None = None) -> Path:
        dest = self.tmp / (as_name or name)
        shutil.copytree(self.fixtures[name], dest)
        return dest

    def target(self) -> Path:
        return self.copy("target")

    def drafter(self) -> Path:
        return self.copy("drafter")

    def file(self, name: str, data: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path


def edit_tensors(folder: Path, fn: Callable[[dict], None], file: str = "model.safetensors") -> Path:
    path = folder / file
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, str(path), metadata=metadata)
    return folder


def edit_config(folder: Path, fn: Callable[[dict], object], file: str = "config.json") -> Path:
    path = folder / file
    obj = json.loads(path.read_text())
    new = fn(obj)  # edits in place, or returns a list to store instead
    path.write_text(json.dumps(new if isinstance(new, list) else obj))
    return folder


def as_written(folder: Path) -> Path:
    """The folder's manifest rewritten over its current files: an output that was written broken
    (by a bug, or an older version), which passes the manifest check and must be refused on what it holds."""
    manifest = json.loads((folder / MANIFEST).read_text())
    write_manifest(folder, {role: ref["path"] for role, ref in (manifest.get("references") or {}).items()})
    return folder


def set_tensor(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value(t[name]))


def with_value(value: float, index: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    def put(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[index] = value
        return t
    return put


def rewrite_header(folder: Path, change: Callable[[dict], object] | None = None, length: int | None = None,
                   cut: int | None = None, append: bytes = b"", file: str = "model.safetensors") -> Path:
    """Rewrite a shard's raw header (JSON edited by `change`, or its declared length replaced),
    optionally cutting the file to `cut` bytes or appending bytes."""
    path = folder / file
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = raw[8:8 + n], raw[8 + n:]
    if change is not None:
        obj = json.loads(header)
        new = change(obj)
        header = json.dumps(obj if new is None else new).encode()
        header += b" " * (-len(header) % 8)
    out = struct.pack("<Q", len(header) if length is None else length) + header + data + append
    path.write_bytes(out if cut is None else out[:cut])
    return folder


def shard_drafter(env: Env) -> Path:
    """The drafter written as two shards plus an index."""
    from eagle31_export.formats.drafter.checkpoint import read_drafter

    return write_drafter(read_drafter(env.fixtures["drafter"]), env.tmp / "sharded", "specforge",
                         max_shard_bytes=60_000)


def pickle_only(folder: Path) -> Path:
    """The checkpoint with its weights saved by torch.save (a legitimate pickle) instead."""
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


class _Evil:
    """Unpickling this runs code: what `convert` must never do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---- the corpus ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    id: str
    category: str
    build: Callable[[Env], tuple[list, list[Path]]]  # -> (argv, inputs whose files must stay unchanged)
    fragment: str  # in the one stderr line
    code: int = 2


def case(category: str, id: str, fragment: str, code: int = 2):
    def register(build):
        CASES.append(Case(id, category, build, fragment, code))
        return build
    return register


CASES: list[Case] = []


def _spec(env: Env, *extra, drafter=None, target=None):
    d, t = drafter or env.fixtures["drafter"], target or env.fixtures["target"]
    return ["speculate", "--drafter", d, "--target", t, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", *extra], [d, t]


def _usage(id, fragment, make):
    case("usage", id, fragment)(make)


# -- usage errors of the CLI framework: one line naming the command and the option --
_usage("depth-negative", "speculate: --depth -1: input should be greater than or equal to 1",
       lambda e: _spec(e, "--depth", "-1"))
_usage("depth-zero", "--depth 0", lambda e: _spec(e, "--depth", "0"))
_usage("max-new-tokens-zero", "--max-new-tokens 0", lambda e: _spec(e, "--max-new-tokens", "0"))
_usage("max-new-tokens-not-int", "--max-new-tokens abc: input should be a valid integer",
       lambda e: _spec(e, "--max-new-tokens", "abc"))
_usage("temperature-nan", "--temperature nan", lambda e: _spec(e, "--temperature", "nan"))
_usage("temperature-inf", "inf is not a finite number", lambda e: _spec(e, "--temperature", "inf"))
_usage("temperature-negative", "--temperature -1", lambda e: _spec(e, "--temperature", "-1"))
_usage("seed-negative", "--seed -1", lambda e: _spec(e, "--seed", "-1"))
_usage("seed-too-large", "--seed 99999999999999999999", lambda e: _spec(e, "--seed", "99999999999999999999"))
_usage("unknown-flag", "No such option: --bogus", lambda e: _spec(e, "--bogus"))
_usage("unknown-command", "No such command 'nosuch'", lambda e: (["nosuch"], []))
_usage("inspect-missing-path", "Missing argument", lambda e: (["inspect"], []))
_usage("trtllm-missing-target", "Missing option '--target'",
       lambda e: (["export", "trtllm", "--drafter", e.fixtures["drafter"], "--out", e.out], [e.fixtures["drafter"]]))
_usage("trtllm-tp-zero", "--tp 0", lambda e: (["export", "trtllm", "--drafter", e.fixtures["drafter"], "--target",
                                               e.fixtures["target"], "--out", e.out, "--tp", "0"], []))
_usage("trtllm-max-draft-len-zero", "--max-draft-len 0",
       lambda e: (["export", "trtllm", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"],
                   "--out", e.out, "--max-draft-len", "0"], []))
_usage("vllm-k-zero", "--num-speculative-tokens 0",
       lambda e: (["export", "vllm", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"],
                   "--out", e.out, "--num-speculative-tokens", "0"], []))
_usage("sglang-steps-negative", "--num-steps -2",
       lambda e: (["export", "sglang", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"],
                   "--out", e.out, "--num-steps", "-2"], []))
_usage("onnx-chain-depth-zero", "--chain-depth 0",
       lambda e: (["export", "onnx", "--drafter", e.fixtures["drafter"], "--out", e.out, "--chain-depth", "0"], []))
_usage("onnx-max-positions-zero", "--max-positions 0",
       lambda e: (["export", "onnx", "--drafter", e.fixtures["drafter"], "--out", e.out, "--max-positions", "0"], []))
_usage("engine-max-batch-zero", "--max-batch 0",
       lambda e: (["export", "engine", "--onnx", e.tmp, "--out", e.out, "--max-batch", "0"], []))
_usage("serve-port-out-of-range", "--port 70000", lambda e: (["serve", e.tmp, "--port", "70000"], []))
_usage("serve-timeout-nan", "--timeout nan", lambda e: (["serve", e.tmp, "--timeout", "nan"], []))
_usage("parity-depth-zero", "--depth 0", lambda e: (["parity", "--depth", "0"], []))
_usage("parity-temperature-inf", "inf is not a finite number", lambda e: (["parity", "--temperature", "inf"], []))
_usage("plugins-jobs-zero", "--jobs 0", lambda e: (["plugins", "build", "--jobs", "0"], []))
_usage("quantize-missing-out", "Missing option '--out'", lambda e: (["quantize", e.fixtures["target"]], []))
_usage("convert-missing-out", "Missing option '--out'", lambda e: (["convert", e.tmp], []))
_usage("demo-unknown-flag", "No such option: --bogus", lambda e: (["demo", "--bogus"], []))


# -- flag values the library checks --
@case("flags", "dtype-unknown", "unknown dtype 'fp7'")
def _(e): return _spec(e, "--dtype", "fp7")
@case("flags", "runtime-unknown", "unknown --runtime 'nosuch'")
def _(e): return _spec(e, "--runtime", "nosuch")
@case("flags", "parity-runtime-unknown", "unknown --runtime 'nosuch'")
def _(e): return ["parity", "--runtime", "nosuch"], []
@case("flags", "kernels-unknown", "unknown --kernels 'nope'")
def _(e): return _spec(e, "--kernels", "nope")
@case("flags", "quantize-format-unknown", "--format 'nope'")
def _(e): return ["quantize", e.fixtures["target"], "--out", e.out, "--format", "nope"], [e.fixtures["target"]]
@case("flags", "triton-flavor-unknown", "unknown --flavor 'nope'")
def _(e): return ["export", "triton", "--bundle", e.tmp, "--out", e.out, "--flavor", "nope"], []
@case("flags", "onnx-dtype-unknown", "unknown dtype 'fp7'")
def _(e): return ["export", "onnx", "--drafter", e.fixtures["drafter"], "--out", e.out, "--dtype", "fp7"], []
@case("flags", "engine-two-precisions", "at most one of --fp16, --bf16, --fp8")
def _(e): return ["export", "engine", "--onnx", e.tmp, "--out", e.out, "--fp16", "--bf16"], []
@case("flags", "chain-with-sampling", "--chain drafts greedily")
def _(e): return _spec(e, "--chain", "--temperature", "0.5")


# -- prompt ids --
@case("prompts", "prompt-ids-not-integers", "expected comma-separated integers")
def _(e): return _spec(e)[0][:-4] + ["--prompt-ids", "1,x"], _spec(e)[1]
@case("prompts", "prompt-ids-empty", "--prompt-ids is empty")
def _(e): return _spec(e)[0][:-4] + ["--prompt-ids", ","], _spec(e)[1]
@case("prompts", "prompt-id-negative", "token id -1 is negative")
def _(e): return _spec(e)[0][:-4] + ["--prompt-ids", "-1,2"], _spec(e)[1]
@case("prompts", "prompt-id-past-vocabulary", "token id 256 is outside the target's vocabulary (0..255)")
def _(e): return _spec(e)[0][:-4] + ["--prompt-ids", "5,256"], _spec(e)[1]
@case("prompts", "prompt-id-huge", "is outside the target's vocabulary")
def _(e): return _spec(e)[0][:-4] + ["--prompt-ids", "99999999999999999999999"], _spec(e)[1]


def _parity_prompts(e: Env, text: str | bytes):
    prompts = e.file("prompts.jsonl", text)
    d, t = e.fixtures["drafter"], e.fixtures["target"]
    return ["parity", "--drafter", d, "--target", t, "--runtime", "reference", "--prompts", prompts,
            "--out", e.out], [d, t, prompts]


@case("prompt files", "prompts-not-json", "prompts.jsonl:2: not JSON")
def _(e): return _parity_prompts(e, '{"prompt_ids": [1, 2]}\n{prompt_ids: [3]}\n')
@case("prompt files", "prompts-not-utf8", "not UTF-8 text")
def _(e): return _parity_prompts(e, b'{"prompt_ids": [1]}\n\xff\xfe\n')
@case("prompt files", "prompts-id-past-vocabulary", "token id 300 is outside the model's vocabulary")
def _(e): return _parity_prompts(e, '{"prompt_ids": [1, 300]}\n')
@case("prompt files", "prompts-id-negative", "token id -4 is outside the model's vocabulary")
def _(e): return _parity_prompts(e, '{"prompt_ids": [-4]}\n')
@case("prompt files", "prompts-ids-booleans", "'prompt_ids' must be a non-empty list of integers")
def _(e): return _parity_prompts(e, '{"prompt_ids": [true, false]}\n')
@case("prompt files", "prompts-ids-empty-list", "'prompt_ids' must be a non-empty list of integers")
def _(e): return _parity_prompts(e, '{"prompt_ids": []}\n')
@case("prompt files", "prompts-line-is-list", "expected an object with 'prompt_ids'")
def _(e): return _parity_prompts(e, '[1, 2, 3]\n')
@case("prompt files", "prompts-empty-file", "no prompts")
def _(e): return _parity_prompts(e, "\n\n")
@case("prompt files", "prompts-text-without-tokenizer", "has no tokenizer")
def _(e): return _parity_prompts(e, '{"text": "hello"}\n')
@case("prompt files", "prompts-file-missing", "no such prompts file")
def _(e):
    argv, inputs = _parity_prompts(e, "")
    (e.tmp / "prompts.jsonl").unlink()
    return argv, inputs[:2]
@case("prompt files", "calib-prompts-past-vocabulary", "token id 999 is outside the model's vocabulary")
def _(e):
    prompts = e.file("calib.jsonl", '{"prompt_ids": [999]}\n')
    return ["quantize", e.fixtures["target"], "--out", e.out, "--calib-prompts", prompts], [e.fixtures["target"], prompts]


# -- safetensors headers (a drafter copy) --
def _inspect(folder: Path):
    return ["inspect", folder], [folder]


@case("headers", "header-length-2^40", "header length 1099511627776 bytes, but the file holds")
def _(e): return _inspect(rewrite_header(e.drafter(), length=1 << 40))
@case("headers", "header-length-past-end", "but the file holds")
def _(e): return _inspect(rewrite_header(e.drafter(), length=10_000_000))
@case("headers", "file-shorter-than-8-bytes", "shorter than the 8-byte header length")
def _(e):
    d = e.drafter()
    (d / "model.safetensors").write_bytes(b"\x01\x02")
    return _inspect(d)
@case("headers", "header-not-json", "header is not JSON")
def _(e):
    d = e.drafter()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"{not js}")
    return _inspect(d)
@case("headers", "header-is-a-list", "header is a JSON list, not an object")
def _(e): return _inspect(rewrite_header(e.drafter(), lambda h: [h]))
@case("headers", "unknown-dtype", "has unknown dtype 'F128'")
def _(e): return _inspect(rewrite_header(e.drafter(), lambda h: h["fc.weight"].update(dtype="F128")))
@case("headers", "negative-shape", "expected a list of non-negative integers")
def _(e): return _inspect(rewrite_header(e.drafter(), lambda h: h["norm.weight"].update(shape=[-64])))
@case("headers", "shape-disagrees-with-bytes", "but occupies")
def _(e): return _inspect(rewrite_header(e.drafter(), lambda h: h["norm.weight"].update(shape=[65])))
@case("headers", "overlapping-offsets", "tensor data overlaps or leaves a gap")
def _(e):
    def overlap(h):
        b, _ = h["norm.weight"]["data_offsets"]
        h["norm.weight"]["data_offsets"] = [b - 4, b - 4 + 256]
    return _inspect(rewrite_header(e.drafter(), overlap))
@case("headers", "truncated-drafter", "truncated (")
def _(e):
    d = e.drafter()
    size = (d / "model.safetensors").stat().st_size
    return _inspect(rewrite_header(d, cut=size - 100))
@case("headers", "trailing-bytes", "bytes after the last tensor")
def _(e): return _inspect(rewrite_header(e.drafter(), append=b"\0" * 16))
@case("headers", "metadata-not-strings", "__metadata__ is not an object of strings")
def _(e): return _inspect(rewrite_header(e.drafter(), lambda h: h.update(__metadata__={"format": 1})))
@case("headers", "index-weight-map-a-list", "malformed index")
def _(e):
    d = shard_drafter(e)
    return _inspect(edit_config(d, lambda c: c.update(weight_map=[]), "model.safetensors.index.json"))
@case("headers", "index-names-missing-shard", "which is missing from")
def _(e):
    d = shard_drafter(e)
    next(iter(sorted(d.glob("model-*.safetensors")))).unlink()
    return _inspect(d)
@case("headers", "index-misplaces-tensor", "which does not contain it")
def _(e):
    d = shard_drafter(e)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    return _inspect(edit_config(d, lambda c: c["weight_map"].update({"fc.weight": shards[-1] if c["weight_map"][
        "fc.weight"] == shards[0] else shards[0]}), "model.safetensors.index.json"))
@case("headers", "index-shard-outside-folder", "is not a file name in")
def _(e):
    d = shard_drafter(e)
    return _inspect(edit_config(d, lambda c: c["weight_map"].update({"fc.weight": "../model.safetensors"}),
                                "model.safetensors.index.json"))
@case("headers", "tensor-in-two-shards", "is stored twice")
def _(e):
    d = e.drafter()
    save_file({"norm.weight": torch.ones(64)}, str(d / "extra.safetensors"))
    return _inspect(d)
@case("headers", "no-weights", "no *.safetensors weights found")
def _(e):
    d = e.drafter()
    (d / "model.safetensors").unlink()
    return _inspect(d)


# -- drafter configs --
@case("drafter config", "config-is-a-list", "a JSON list; expected an object")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: [c]))
@case("drafter config", "config-not-json", "not valid JSON")
def _(e):
    d = e.drafter()
    (d / "config.json").write_text("{'hidden_size': 64}")
    return _inspect(d)
@case("drafter config", "config-not-utf8", "not valid JSON (not UTF-8 text)")
def _(e):
    d = e.drafter()
    (d / "config.json").write_bytes(b"\xff\xfe{}")
    return _inspect(d)
@case("drafter config", "hidden-act-unknown", "hidden_act 'swishy' is not supported")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(hidden_act="swishy")))
@case("drafter config", "eagle-config-wrong-type", "eagle_config is a JSON list; expected an object")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(eagle_config=[1, 2, 3])))
@case("drafter config", "hidden-size-a-string", "hidden_size is '64'; expected an integer")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(hidden_size="64")))
@case("drafter config", "heads-zero", "num_attention_heads is 0; expected a positive integer")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(num_attention_heads=0)))
@case("drafter config", "rms-norm-eps-negative", "rms_norm_eps is -1e-06; expected a finite positive number")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(rms_norm_eps=-1e-6)))
@case("drafter config", "draft-vocab-larger-than-vocab", "draft_vocab_size 300 exceeds the target vocab_size 256")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(draft_vocab_size=300)))
@case("drafter config", "num-hidden-layers-lies", "'layers.1.input_layernorm.weight' missing")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(num_hidden_layers=2)))
@case("drafter config", "tapped-ids-not-a-list", "eagle_aux_hidden_state_layer_ids is 3; expected a list")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": 3})))
@case("drafter config", "tapped-ids-negative", "include -2")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(
    eagle_config={"eagle_aux_hidden_state_layer_ids": [1, -2, 4]})))
@case("drafter config", "flag-not-boolean", "fc_norm is 'yes'; expected true or false")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.update(fc_norm="yes")))
@case("drafter config", "missing-hidden-size", "lacks 'hidden_size'")
def _(e): return _inspect(edit_config(e.drafter(), lambda c: c.pop("hidden_size")))
@case("drafter config", "not-a-drafter", "cannot tell the drafter format")
def _(e): return _spec(e, drafter=e.fixtures["target"])
@case("drafter config", "drafter-as-target", "is an EAGLE-3 drafter checkpoint, not a target model")
def _(e): return _spec(e, target=e.fixtures["drafter"])
@case("drafter config", "partial-model-prefix", "wrapper prefix such as 'model.'")
def _(e):
    d = edit_tensors(e.drafter(), lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t) if k.startswith("midlayer.")}))
    return _inspect(d)


# -- drafter weights: refused by commands that compute or export, problems in `inspect` --
@case("drafter weights", "nan-in-fc", "model.safetensors:fc.weight: contains NaN or Inf")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("fc.weight", with_value(float("nan")))))
@case("drafter weights", "inf-in-lm-head-inspect", "lm_head.weight: contains NaN or Inf", code=1)
def _(e): return _inspect(edit_tensors(e.drafter(), set_tensor("lm_head.weight", with_value(float("inf"), 7))))
@case("drafter weights", "nan-norm-export", "midlayer.hidden_norm.weight: contains NaN or Inf")
def _(e):
    d = edit_tensors(e.drafter(), set_tensor("midlayer.hidden_norm.weight", with_value(float("nan"), 3)))
    return ["export", "vllm", "--drafter", d, "--target", e.fixtures["target"], "--out", e.out], [d, e.fixtures["target"]]
@case("drafter weights", "zero-fc-norm-inspect", "fc_norm.1.weight: norm weight is all zeros", code=1)
def _(e): return _inspect(edit_tensors(e.drafter(), set_tensor("fc_norm.1.weight", torch.zeros_like)))
@case("drafter weights", "zero-norm-speculate", "norm.weight: norm weight is all zeros")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("norm.weight", torch.zeros_like)))
@case("drafter weights", "int16-fc", "fc.weight: stored as I16, expected a floating-point weight")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("fc.weight", lambda t: (t * 100).to(torch.int16))))
@case("drafter weights", "f64-d2t", "d2t: stored as F64, expected an integer index map")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("d2t", lambda t: t.double())))
@case("drafter weights", "t2d-marks-nothing", "t2d: marks no target id")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("t2d", torch.zeros_like)))
@case("drafter weights", "t2d-not-matching-d2t", "d2t and t2d do not belong together", code=1)
def _(e): return _inspect(edit_tensors(e.drafter(), set_tensor("t2d", lambda t: t.roll(1))))
@case("drafter weights", "d2t-past-vocabulary", "outside the vocabulary of 256")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("d2t", with_value(10_000, -1))))
@case("drafter weights", "d2t-below-zero", "to target id -5")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("d2t", with_value(-5, 0))))
@case("drafter weights", "d2t-duplicates", "maps several draft tokens to the same target id")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("d2t", lambda t: -torch.arange(t.numel()))))
@case("drafter weights", "missing-tensor", "'layers.0.mlp.up_proj.weight' missing")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), lambda t: t.pop("midlayer.mlp.up_proj.weight")))
@case("drafter weights", "wrong-shape", "model.safetensors:fc.weight: shape [64, 190], expected [64, 192]")
def _(e): return _spec(e, drafter=edit_tensors(e.drafter(), set_tensor("fc.weight", lambda t: t[:, :190].contiguous())))
@case("drafter weights", "pickle-only-drafter", "convert the checkpoint to safetensors with `eagle31-export convert")
def _(e): return _spec(e, drafter=pickle_only(e.drafter()))


# -- target configs --
@case("target config", "target-config-is-a-list", "a JSON list; expected an object")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: [c]))
@case("target config", "target-hidden-act-unknown", "hidden_act 'swishy' is not an activation transformers knows")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: c.update(hidden_act="swishy")))
@case("target config", "target-layers-fewer-than-stored", "config.json says num_hidden_layers 6, but the checkpoint stores 8")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: c.update(num_hidden_layers=6)))
@case("target config", "target-layers-more-than-stored", "says num_hidden_layers 10, but the checkpoint stores 8 layers",
      code=1)
def _(e): return ["inspect", edit_config(e.target(), lambda c: c.update(num_hidden_layers=10))], []
@case("target config", "target-vocab-a-string", "target vocab_size is '256'; expected a positive integer")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: c.update(vocab_size="256")))
@case("target config", "target-lacks-hidden-size", "target config.json lacks 'hidden_size'")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: c.pop("hidden_size")))
@case("target config", "target-kv-heads-not-dividing", "is not a multiple of num_key_value_heads 3")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: c.update(num_key_value_heads=3)))
@case("target config", "target-model-type-unknown", "is not a transformers architecture")
def _(e): return _spec(e, target=edit_config(e.target(), lambda c: c.update(model_type="nosuch")))
# A family without a target graph exports the drafter graphs alone (an MoE target: tests/test_kimi_pair.py);
# this one (Llama weights under a GPT-2 config) is refused first, as every command refuses it.
@case("target config", "target-onnx-unsupported-family", "tensor transformer.h.0.attn.c_attn.bias is missing")
def _(e):
    t = edit_config(e.target(), lambda c: c.update(model_type="gpt2"))
    return ["export", "onnx", "--drafter", e.fixtures["drafter"], "--target", t, "--out", e.out], [t]


# -- target weights --
def _corrupt_target(e: Env, fn) -> Path:
    return edit_tensors(e.target(), fn)


@case("target weights", "truncated-target-speculate", "truncated (")
def _(e):
    t = e.target()
    return _spec(e, target=rewrite_header(t, cut=(t / "model.safetensors").stat().st_size // 2))
@case("target weights", "truncated-target-inspect", "truncated (")
def _(e):
    t = e.target()
    return _inspect(rewrite_header(t, cut=(t / "model.safetensors").stat().st_size - 8))
@case("target weights", "truncated-target-export-trtllm", "truncated (")
def _(e):
    t = e.target()
    rewrite_header(t, cut=(t / "model.safetensors").stat().st_size - 1000)
    return ["export", "trtllm", "--drafter", e.fixtures["drafter"], "--target", t, "--out", e.out], [t]
@case("target weights", "invalid-target-file", "not a valid safetensors file")
def _(e):
    t = e.target()
    (t / "model.safetensors").write_bytes(b"\x00" * 64)
    return _spec(e, target=t)
@case("target weights", "wrong-shaped-target-tensor", "shape [100, 64], the model config.json describes expects [128, 64]")
def _(e): return _spec(e, target=_corrupt_target(e, set_tensor("model.layers.0.mlp.up_proj.weight",
                                                                  lambda t: torch.zeros(100, 64))))
@case("target weights", "target-missing-tensor", "tensor model.layers.3.mlp.down_proj.weight is missing")
def _(e): return _spec(e, target=_corrupt_target(e, lambda t: t.pop("model.layers.3.mlp.down_proj.weight")))
@case("target weights", "target-missing-tensor-inspect", "model.layers.3.mlp.down_proj.weight is missing", code=1)
def _(e): return _inspect(_corrupt_target(e, lambda t: t.pop("model.layers.3.mlp.down_proj.weight")))
@case("target weights", "target-int16-weight", "stored as I16, expected a floating-point weight")
def _(e): return _spec(e, target=_corrupt_target(e, set_tensor("model.layers.0.self_attn.o_proj.weight",
                                                                  lambda t: t.to(torch.int16))))
@case("target weights", "nan-in-target-embeddings", "model.embed_tokens.weight: contains NaN or Inf")
def _(e): return _spec(e, target=_corrupt_target(e, set_tensor("model.embed_tokens.weight", with_value(float("nan"), 77))))
@case("target weights", "nan-in-target-embeddings-inspect", "model.embed_tokens.weight: contains NaN or Inf", code=1)
def _(e): return _inspect(_corrupt_target(e, set_tensor("model.embed_tokens.weight", with_value(float("nan"), 77))))
@case("target weights", "inf-in-target-weight-export", "model.layers.5.mlp.gate_proj.weight: contains NaN or Inf")
def _(e):
    t = _corrupt_target(e, set_tensor("model.layers.5.mlp.gate_proj.weight", with_value(float("-inf"), 5)))
    return ["export", "sglang", "--drafter", e.fixtures["drafter"], "--target", t, "--out", e.out], [t]
@case("target weights", "target-zero-norm-inspect", "model.layers.2.input_layernorm.weight: norm weight is all zeros", code=1)
def _(e): return _inspect(_corrupt_target(e, set_tensor("model.layers.2.input_layernorm.weight", torch.zeros_like)))
@case("target weights", "target-unexpected-tensor", "model.layers.0.self_attn.q_proj.bias: the model config.json describes "
                                                     "has no tensor of this name")
def _(e): return _spec(e, target=_corrupt_target(e, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})))
@case("target weights", "pickle-only-target", "only pickle weights (pytorch_model.bin)")
def _(e): return _spec(e, target=pickle_only(e.target()))
@case("target weights", "pickle-only-target-inspect", "eagle31-export convert")
def _(e): return _inspect(pickle_only(e.target()))
@case("target weights", "quantize-nan-target", "contains NaN or Inf")
def _(e):
    t = _corrupt_target(e, set_tensor("model.layers.1.mlp.up_proj.weight", with_value(float("nan"))))
    return ["quantize", t, "--out", e.out], [t]


# -- outputs --
@case("outputs", "out-parent-is-a-file", "a file is in the way")
def _(e):
    blocker = e.file("blocker", "x")
    return ["export", "vllm", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"],
            "--out", blocker / "out"], [blocker]
@case("outputs", "out-unwritable", "Operation not permitted" if os.geteuid() == 0 else "Permission denied")
def _(e):
    if os.geteuid() == 0:  # root writes anywhere but /sys
        out = Path("/sys/eagle31-export-test/out")
    else:
        locked = e.tmp / "locked"
        locked.mkdir(mode=0o555)
        out = locked / "out"
    return ["export", "vllm", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"], "--out", out], []
@case("outputs", "out-exists", "already exists; choose another --out or pass --force")
def _(e):
    e.out.mkdir()
    (e.out / "keep.txt").write_text("mine")
    return ["export", "vllm", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"],
            "--out", e.out], [e.out]
@case("outputs", "out-is-the-input", "is the input")
def _(e):
    d = e.drafter()
    return ["export", "onnx", "--drafter", d, "--out", d, "--force"], [d]


# -- exported artifacts: ONNX folders and serving bundles --
@case("artifacts", "onnx-external-data-truncated", "ONNX Runtime cannot load it")
def _(e):
    o = e.copy("onnx")
    data = o / "drafter.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return ["speculate", "--runtime", "onnxruntime", "--onnx", as_written(o), "--target", e.fixtures["target"],
            "--prompt-ids", "1,2", "--max-new-tokens", "3"], [o]
@case("artifacts", "onnx-graph-changed-byte", "drafter_next.onnx changed since it was written")
def _(e):
    o = e.copy("onnx")
    data = bytearray((o / "drafter_next.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (o / "drafter_next.onnx").write_bytes(bytes(data))
    return ["speculate", "--runtime", "onnxruntime", "--onnx", o, "--target", e.fixtures["target"],
            "--prompt-ids", "1,2", "--max-new-tokens", "3"], [o]
@case("artifacts", "onnx-graph-garbage", "Protobuf parsing failed")
def _(e):
    o = e.copy("onnx")
    (o / "drafter_next.onnx").write_bytes(b"garbage")
    return ["speculate", "--runtime", "onnxruntime", "--onnx", as_written(o), "--target", e.fixtures["target"],
            "--prompt-ids", "1,2", "--max-new-tokens", "3"], [o]
@case("artifacts", "graphs-json-lacks-field", "field drafter.kv_cache.heads is None")
def _(e):
    o = as_written(edit_config(e.copy("onnx"), lambda m: m["drafter"]["kv_cache"].pop("heads"), "graphs.json"))
    return ["speculate", "--runtime", "onnxruntime", "--onnx", o, "--target", e.fixtures["target"],
            "--prompt-ids", "1,2"], [o]
@case("artifacts", "onnx-export-of-an-older-version", "re-run `eagle31-export export onnx`")
def _(e):  # graphs that returned past + new KV (present_*): the runtime appends new entries itself now
    o = as_written(edit_config(e.copy("onnx"), lambda m: m["drafter"]["kv_cache"].update(returns="present"),
                               "graphs.json"))
    return ["speculate", "--runtime", "onnxruntime", "--onnx", o, "--target", e.fixtures["target"],
            "--prompt-ids", "1,2"], [o]
@case("artifacts", "graphs-json-is-a-list", "a JSON list; expected an object")
def _(e):
    o = as_written(edit_config(e.copy("onnx"), lambda m: [m], "graphs.json"))
    return ["speculate", "--runtime", "onnxruntime", "--onnx", o, "--prompt-ids", "1,2"], [o]
@case("artifacts", "onnx-prompt-id-past-vocabulary", "outside the target's vocabulary")
def _(e):
    o = e.copy("onnx")
    return ["speculate", "--runtime", "onnxruntime", "--onnx", o, "--target", e.fixtures["target"],
            "--prompt-ids", "1,4096"], [o]
@case("artifacts", "bundle-kind-unknown", "unknown bundle kind 'tensorflow'")
def _(e):
    b = e.tmp / "bundle"
    b.mkdir()
    (b / "bundle.json").write_text(json.dumps({"kind": "tensorflow", "target": str(e.fixtures["target"]),
                                               "drafter": str(e.fixtures["drafter"]), "max_draft_len": 3}))
    return ["export", "triton", "--bundle", b, "--out", e.out, "--flavor", "cpu"], [b]
@case("artifacts", "bundle-max-draft-len-string", "max_draft_len is '3'; expected a positive integer")
def _(e):
    b = e.tmp / "bundle"
    b.mkdir()
    (b / "bundle.json").write_text(json.dumps({"kind": "vllm", "target": str(e.fixtures["target"]),
                                               "drafter": str(e.fixtures["drafter"]), "max_draft_len": "3"}))
    return ["export", "triton", "--bundle", b, "--out", e.out, "--flavor", "cpu"], [b]
@case("artifacts", "bundle-without-record", "no bundle.json")
def _(e): return ["export", "triton", "--bundle", e.drafter(), "--out", e.out, "--flavor", "cpu"], []
@case("artifacts", "parity-bundle-missing", "no such bundle folder")
def _(e): return ["parity", e.tmp / "nope", "--drafter", e.fixtures["drafter"], "--target", e.fixtures["target"]], []
@case("artifacts", "demo-pair-missing", "not a demo pair")
def _(e): return ["demo", "--pair", e.tmp / "nope", "--out", e.out], []
@case("artifacts", "serve-repo-missing", "no such model repository")
def _(e): return ["serve", e.tmp / "nope"], []
@case("artifacts", "engine-onnx-folder-not-an-export", "export onnx")
def _(e): return ["export", "engine", "--onnx", e.drafter(), "--out", e.out], []


# -- convert: pickle is read with the weights-only unpickler, never a full one --
@case("convert", "convert-code-in-pickle", "not a tensors-only PyTorch file")
def _(e):
    d = e.drafter()
    (d / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(2), "payload": _Evil(e.tmp / "pwned")}, d / "pytorch_model.bin")
    return ["convert", d, "--out", e.out], [d]
@case("convert", "convert-not-a-state-dict", "holds a list, not a flat mapping")
def _(e):
    d = e.drafter()
    (d / "model.safetensors").unlink()
    torch.save([torch.zeros(2)], d / "pytorch_model.bin")
    return ["convert", d, "--out", e.out], [d]
@case("convert", "convert-truncated-pickle", "not a tensors-only PyTorch file")
def _(e):
    d = pickle_only(e.drafter())
    raw = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(raw[: len(raw) // 3])
    return ["convert", d, "--out", e.out], [d]
@case("convert", "convert-nothing-to-convert", "no pickle weights to convert")
def _(e):
    d = e.drafter()
    (d / "model.safetensors").unlink()
    return ["convert", d, "--out", e.out], [d]
@case("convert", "convert-already-safetensors", "already holds safetensors weights")
def _(e): return ["convert", e.drafter(), "--out", e.out], []
@case("convert", "convert-index-mismatch", "the index and the shards do not belong together")
def _(e):
    d = pickle_only(e.drafter())
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "pytorch_model.bin"}}))
    return ["convert", d, "--out", e.out], [d]


# -- verify and inspect findings: exit 1 --
@case("findings", "verify-changed-file", "difference(s) from manifest.json", code=1)
def _(e):
    o = e.copy("onnx")
    (o / "graphs.json").write_text((o / "graphs.json").read_text() + " ")
    return ["verify", o], [o]
@case("findings", "verify-not-an-output", "manifest.json")
def _(e): return ["verify", e.target()], []
@case("findings", "inspect-pair-misfit", "out of range", code=1)
def _(e):
    d = edit_config(e.drafter(), lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 12]}))
    return ["inspect", d, "--target", e.fixtures["target"]], [d]


# ---- running the corpus -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus_fixtures(tmp_path_factory, eagle31_dir, llama_target, llama_info) -> dict[str, Path]:
    """The session pair, and an ONNX export of a drafter with its own embeddings (no target graph:
    exporting one would cost more than the whole corpus)."""
    from eagle31_export.export.onnx_export import export_onnx
    from factories import drafter_config_for, random_drafter

    root = tmp_path_factory.mktemp("corpus")
    full = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True), seed=2, with_embeddings=True)
    full_dir = write_drafter(full, root / "full-drafter", "specforge")
    return {"drafter": eagle31_dir, "target": llama_target, "onnx": export_onnx(full_dir, root / "onnx")}


def _hashes(paths: list[Path]) -> dict[str, str]:
    out = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input(case: Case, cli, tmp_path, corpus_fixtures):
    env = Env(tmp_path, corpus_fixtures)
    argv, inputs = case.build(env)
    watched = [*inputs, *corpus_fixtures.values()]
    before = _hashes(watched)
    assert before, "a case must watch some input files"
    out_listing = sorted(p.name for p in env.out.parent.iterdir())
    code, _stdout, stderr = cli(*argv)
    lines = stderr.strip().splitlines()
    assert code == case.code, stderr
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert case.fragment in lines[0], lines[0]
    assert sorted(p.name for p in env.out.parent.iterdir()) == out_listing  # no --out, no temporary sibling
    assert _hashes(watched) == before
    assert not (tmp_path / "pwned").exists()  # no pickle ever ran code


def test_corpus_covers_every_command(tmp_path, corpus_fixtures):
    """At least 80 cases, each category with several, and every registered command exercised."""
    import typer.main

    from eagle31_export.cli.main import app

    group = typer.main.get_command(app)
    registered = set()
    for name, cmd in group.commands.items():
        subs = getattr(cmd, "commands", None)
        registered |= {f"{name} {sub}" for sub in subs} if subs else {name}
    commands = {"inspect", "speculate", "demo", "quantize", "plugins build", "export onnx", "export trtllm",
                "export vllm", "export sglang", "export engine", "export triton", "serve", "parity", "verify",
                "convert"}
    assert commands <= registered
    used = set()
    for i, c in enumerate(CASES):
        (tmp_path / str(i)).mkdir()
        argv = [str(a) for a in c.build(Env(tmp_path / str(i), corpus_fixtures))[0]]
        used |= {" ".join(argv[:2]), argv[0]}
    by_category: dict[str, int] = {}
    for c in CASES:
        by_category[c.category] = by_category.get(c.category, 0) + 1
    assert len(CASES) >= 80 and len({c.id for c in CASES}) == len(CASES)
    assert all(n >= 3 for n in by_category.values()), by_category
    assert commands <= used, sorted(commands - used)


def test_drafter_with_model_prefix_is_read(tmp_path, eagle31_dir):
    """NeMo AutoModel saves drafter tensors under `model.`: read as the same drafter."""
    from eagle31_export.formats.drafter.checkpoint import read_drafter

    folder = tmp_path / "nemo"
    shutil.copytree(eagle31_dir, folder)
    edit_tensors(folder, lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t) if k not in ("d2t", "t2d")}))
    plain, prefixed = read_drafter(eagle31_dir), read_drafter(folder)
    assert prefixed.tensor_prefix == "model." and prefixed.format == plain.format == "specforge"
    assert sorted(prefixed.tensors) == sorted(plain.tensors)
    assert all(torch.equal(prefixed.tensors[n], plain.tensors[n]) for n in plain.tensors)


def test_convert_reads_a_legitimate_pickle_into_the_same_drafter(cli, tmp_path, eagle31_dir):
    from eagle31_export.formats.drafter.checkpoint import read_drafter

    folder = tmp_path / "eagle-release"
    shutil.copytree(eagle31_dir, folder)
    pickle_only(folder)
    code, out, err = cli("convert", folder, "--out", tmp_path / "converted")
    assert code == 0, err
    original, converted = read_drafter(eagle31_dir), read_drafter(tmp_path / "converted")
    assert converted.config == original.config and sorted(converted.tensors) == sorted(original.tensors)
    assert all(torch.equal(converted.tensors[n], original.tensors[n]) for n in original.tensors)
    assert not (tmp_path / "converted" / "pytorch_model.bin").exists()
