"""Streaming reader and validator for NVFP4 checkpoints (ModelOpt and compressed-tensors).

`NVFP4Checkpoint.open` reads every shard header once, plus the scalar scales, and checks
the structure of every quantized Linear without touching weight data. `iter_linears` then
streams the Linears one at a time (weights, block scales checked as they are read), so
memory stays at one Linear regardless of model size.

Values are returned in ModelOpt's convention: `weight_scale_2` and `input_scale` are scales
(dequantized = code * block_scale * weight_scale_2); compressed-tensors' reciprocals are
converted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from eagle31_export.errors import CheckpointError
from eagle31_export.formats.kv_scales import parse_kv_scale
from eagle31_export.formats.nvfp4.numerics import BLOCK_SIZE, reciprocal_f32
from eagle31_export.formats.nvfp4.scheme import (
    FUSED_GROUPS, NVFP4_SEMANTICS, QuantScheme, detect_scheme, exact_inverse, is_excluded, is_router,
    parse_exact_inverse, unlisted_router_ok, unmatched_patterns,
)
from eagle31_export.formats.nvfp4.stream import (
    TensorEntry, TensorStream, read_f32_scalars, read_shard_header, shard_files,
)
from eagle31_export.formats.safetensors_io import SafetensorsDir, read_json

SCALAR_SHAPES = ([], [1])
# The largest magnitude an NVFP4 Linear dequantizes to is 6 (FP4's largest code) x 448 (the largest
# E4M3 block scale) x its global scale, and quantizers choose the global scale so that this is the
# weight's own amax (ModelOpt: weight_scale_2 = amax / (6 * 448); compressed-tensors stores the
# reciprocal). Trained transformer weights stay orders of magnitude below this ceiling; a global scale
# stored in the other convention implies weights near (6 * 448)^2 / amax, millions for any real amax.
FP4_E4M3_MAX = 6.0 * 448.0
WEIGHT_AMAX_CEILING = 1e3


@dataclass(frozen=True)
class LinearInfo:
    """One NVFP4 Linear as declared by the headers; scales in ModelOpt's convention."""

    name: str
    out_features: int
    in_features: int
    weight_scale_2: float
    input_scale: float | None  # None for weight-only checkpoints
    input_global_scale: float | None  # what the runtime multiplies inputs by: 1 / input_scale
    tensor_names: dict[str, str]  # role -> tensor name in the checkpoint
    # Exact compressed-tensors values (reciprocals) of 'global' / 'input' where known: stored
    # in a compressed-tensors checkpoint, or recorded by a converter. Used to convert losslessly.
    reciprocals: dict[str, float | None] = field(default_factory=dict)


@dataclass
class QuantizedLinear:
    """One NVFP4 Linear with its data (ModelOpt's convention)."""

    info: LinearInfo
    packed: torch.Tensor | None  # uint8 [out, in/2]; None when not requested
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def weight_scale_2(self) -> torch.Tensor:
        return torch.tensor(self.info.weight_scale_2, dtype=torch.float32)


@dataclass
class NVFP4Checkpoint:
    folder: Path
    config: dict[str, Any]
    scheme: QuantScheme
    tensors: SafetensorsDir
    headers: dict[str, tuple[str, list[int]]]  # name -> (safetensors dtype, shape)
    linears: dict[str, LinearInfo]
    kv_scales: dict[str, float]  # "<attention module>.k_scale" / ".v_scale" -> value
    problems: list[str] = field(default_factory=list)
    # What runtimes serve as declared but with a default the checkpoint may not mean (scale 1.0, ...).
    warnings: list[str] = field(default_factory=list)
    kv_scale_names: dict[str, str] = field(default_factory=dict)  # kv_scales key -> stored tensor name
    # Stored global scales whose exact source value a converter recorded (see formats.nvfp4.scheme).
    recorded_inverses: dict[str, float] = field(default_factory=dict)
    entries: dict[str, TensorEntry] = field(default_factory=dict)  # name -> file and byte range
    semantics: str = "exact"  # how stored scales become computed values (formats.nvfp4.scheme.NVFP4_SEMANTICS)
    # What no reader should compute with (global scales that imply implausible weights), unlike
    # `problems`, which runtimes serve differently from the reference but the reference can read.
    damage: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------------------------------
    @classmethod
    def open(cls, folder: str | Path, scheme: QuantScheme | None = None,
             semantics: str = "exact") -> "NVFP4Checkpoint":
        """`semantics`: how stored scales become computed values (formats.nvfp4.scheme.NVFP4_SEMANTICS)."""
        if semantics not in NVFP4_SEMANTICS:
            raise ValueError(f"unknown NVFP4 semantics {semantics!r}; one of {', '.join(NVFP4_SEMANTICS)}")
        folder = Path(folder)
        config = read_json(folder / "config.json")
        scheme = scheme or detect_scheme(folder, config)
        if scheme is None:
            raise CheckpointError(f"{folder}: not an NVFP4 checkpoint (no hf_quant_config.json or quantization_config)")
        entries: dict[str, TensorEntry] = {}
        recorded: dict[str, float] = {}
        for shard in shard_files(folder):  # before SafetensorsDir, for precise damage reports
            found, metadata = read_shard_header(shard)
            entries.update(found)
            recorded.update(parse_exact_inverse(metadata))
        tensors = SafetensorsDir(folder)
        headers, scalars = _scan(tensors, entries)
        ckpt = cls(folder, config, scheme, tensors, headers, {}, {}, [], [], {}, recorded, entries, semantics)
        ckpt._build_linears(scalars)
        ckpt._build_kv_scales(scalars)
        ckpt._check_exclusions()
        ckpt._check_fused_groups()
        ckpt._check_weight_magnitudes()
        return ckpt

    def owned_tensor_names(self) -> set[str]:
        """Tensors that belong to quantized Linears or are KV-cache scales."""
        owned = {t for info in self.linears.values() for t in info.tensor_names.values()}
        return owned | set(self._kv_tensor_names)

    def other_tensor_names(self) -> list[str]:
        """Tensors stored as they are (norms, embeddings, excluded Linears, biases)."""
        owned = self.owned_tensor_names()
        return [n for n in self.headers if n not in owned]

    def iter_linears(self, with_packed: bool = True) -> Iterator[QuantizedLinear]:
        """Every NVFP4 Linear in file order, its block scales validated as they are read.

        Tensors are zero-copy views of the file (see formats.nvfp4.stream): read when first used.
        """
        order = sorted(self.linears.values(), key=lambda i: self._position(i.tensor_names["packed"]))
        with TensorStream(self.entries) as stream:
            for info in order:
                names = sorted([info.tensor_names["scale"]] + ([info.tensor_names["packed"]] if with_packed else []),
                               key=self._position)
                got = {n: stream.get(n) for n in names}
                scale = got[info.tensor_names["scale"]]
                self._check_block_scales(info, scale)
                yield QuantizedLinear(info, got.get(info.tensor_names["packed"]), scale)

    def iter_other_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors stored as they are, in file order, as zero-copy views."""
        with TensorStream(self.entries) as stream:
            for name in sorted(self.other_tensor_names(), key=self._position):
                yield name, stream.get(name)

    def _position(self, name: str) -> tuple[str, int]:
        entry = self.entries[name]
        return str(entry.path), entry.begin

    def validate(self) -> None:
        """Read and check every block scale (weights are not read)."""
        for _ in self.iter_linears(with_packed=False):
            pass

    # ---------------------------------------------------------------------------------------
    def _where(self, name: str) -> str:
        return str(self.tensors.file_of(name))

    def _build_linears(self, scalars: dict[str, float]) -> None:
        s = self.scheme
        roles = {"packed": s.suffix("packed"), "scale": s.suffix("scale"), "global": s.suffix("global"),
                 "input": s.suffix("input")}
        by_module: dict[str, dict[str, str]] = {}
        for name, (dtype, _) in self.headers.items():
            module, _, leaf = name.rpartition(".")
            for role, suffix in roles.items():
                if leaf != suffix:
                    continue
                # A ModelOpt `weight` is only NVFP4 when packed (uint8); others are plain weights.
                if role == "packed" and s.format == "modelopt" and dtype != "U8":
                    continue
                by_module.setdefault(module, {})[role] = name
        required = ["packed", "scale", "global"] + (["input"] if s.act_quant else [])
        for module, found in sorted(by_module.items()):
            for role in required:
                stored = f"{module}.{roles[role]}"
                if role not in found and stored in self.headers:  # present, but not as NVFP4 stores it
                    dtype, shape = self.headers[stored]
                    raise CheckpointError(f"{self._where(stored)}: {stored} is {dtype} {shape}; an NVFP4 Linear "
                                          "stores it as uint8 [out, in/2] (two 4-bit values per byte): re-export "
                                          "the checkpoint, or exclude the module from quantization")
                if role not in found:
                    present = ", ".join(sorted(n.rpartition(".")[2] for n in found.values()))
                    anchor = self._where(next(iter(found.values())))
                    raise CheckpointError(
                        f"{anchor}: tensor {module}.{roles[role]} is missing (the NVFP4 Linear {module} has "
                        f"{present}); every quantized Linear needs {', '.join(roles[r] for r in required)}"
                    )
            self.linears[module] = self._linear_info(module, found, scalars)

    def _linear_info(self, module: str, names: dict[str, str], scalars: dict[str, float]) -> LinearInfo:
        p_dtype, p_shape = self.headers[names["packed"]]
        s_dtype, s_shape = self.headers[names["scale"]]
        where = self._where(names["packed"])
        if p_dtype != "U8" or len(p_shape) != 2:
            raise CheckpointError(f"{where}: {names['packed']} is {p_dtype} {p_shape}; expected uint8 [out, in/2]")
        out_f, in_f = p_shape[0], 2 * p_shape[1]
        if in_f % BLOCK_SIZE:
            raise CheckpointError(f"{where}: {module} has in_features {in_f}, not a multiple of {BLOCK_SIZE}; "
                                  "NVFP4 needs whole blocks of 16: exclude this Linear from quantization")
        expected = [out_f, in_f // BLOCK_SIZE]
        where_s = self._where(names["scale"])
        if s_dtype != "F8_E4M3" or s_shape != expected:
            hint = ""
            if s_dtype == "F8_E4M3" and len(s_shape) == 2 and s_shape[0] == out_f and s_shape[1] and in_f % s_shape[1] == 0:
                hint = f" (that is group size {in_f // s_shape[1]}; NVFP4 uses {BLOCK_SIZE})"
            raise CheckpointError(f"{where_s}: {names['scale']} is {s_dtype} {s_shape}; expected "
                                  f"float8_e4m3fn {expected}{hint}")
        reciprocals: dict[str, float | None] = {}
        values: dict[str, float] = {}
        for role in ("global", "input"):
            if role not in names:
                continue
            stored = self._scalar(names[role], scalars)
            recorded = self.recorded_inverses.get(names[role])
            if self.scheme.is_reciprocal():
                values[role], reciprocals[role] = exact_inverse(stored, recorded, self.semantics), stored
            else:
                values[role], reciprocals[role] = stored, recorded
        input_scale = values.get("input")
        # The runtime's input global scale: as stored (compressed-tensors) or 1 / input_scale.
        input_gs = None
        if input_scale is not None:
            input_gs = reciprocals["input"] if self.scheme.is_reciprocal() else reciprocal_f32(input_scale)
        return LinearInfo(module, out_f, in_f, values["global"], input_scale, input_gs, dict(names), reciprocals)

    def _scalar(self, name: str, scalars: dict[str, float]) -> float:
        dtype, shape = self.headers[name]
        if dtype != "F32" or shape not in SCALAR_SHAPES:
            raise CheckpointError(f"{self._where(name)}: {name} is {dtype} {shape}; expected a float32 scalar")
        value = scalars[name]
        if not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{self._where(name)}: {name} is {value}; scales must be finite and positive "
                                  "(re-export or re-quantize the checkpoint)")
        return value

    @property
    def _kv_tensor_names(self) -> list[str]:
        return [n for n in self.headers if parse_kv_scale(n) is not None]

    def _build_kv_scales(self, scalars: dict[str, float]) -> None:
        # Every naming the runtimes read (formats/kv_scales.py), keyed by attention module.
        for name in self._kv_tensor_names:
            attn, which, _ = parse_kv_scale(name)
            key = f"{attn}.{which}_scale"
            if key in self.kv_scales:
                raise CheckpointError(f"{self._where(name)}: {name} and {self.kv_scale_names[key]} are both the "
                                      f"{which.upper()} scale of {attn}; keep one of them")
            self.kv_scales[key] = self._scalar(name, scalars)
            self.kv_scale_names[key] = name
        if self.scheme.kv_cache and not self.kv_scales:
            # The runtimes load such a checkpoint and use 1.0 (docs/nvfp4.md#fp8-kv-cache-scales).
            self.warnings.append("the checkpoint declares an FP8 KV cache but stores no k_scale/v_scale tensors; "
                                 "runtimes will use KV-cache scale 1.0 (calibrate the KV cache for other scales)")
        if self.kv_scales and not self.scheme.kv_cache:
            self.problems.append(f"{len(self.kv_scales)} KV-cache scales are stored but no FP8 KV cache is declared; "
                                 "runtimes will ignore them")

    def _check_exclusions(self) -> None:
        modules = {n.rpartition(".")[0] for n in self.headers}
        if self.config.get("tie_word_embeddings"):
            modules.add("lm_head")  # tied: declared excluded, never stored
        unmatched = unmatched_patterns(self.scheme.excluded, modules)
        if unmatched:
            example = sorted(self.linears)[0] if self.linears else sorted(modules)[0]
            raise CheckpointError(
                f"{self.folder}: exclusion entries {unmatched} name no module of this checkpoint (module names "
                f"look like {example!r}); fix the exclusion list so it names the modules kept unquantized"
            )
        for module in sorted(self.linears):
            if is_excluded(module, self.scheme.excluded):
                self.problems.append(f"{module} is stored as NVFP4 but matches the exclusion list; "
                                     "runtimes will expect an unquantized weight there")
        routers_ok = unlisted_router_ok(self.config)
        for name, (dtype, shape) in sorted(self.headers.items()):
            module, _, leaf = name.rpartition(".")
            if (leaf == "weight" and len(shape) == 2 and dtype in ("BF16", "F16", "F32") and module not in self.linears
                    and not any(k in module for k in ("embed", "norm", "wte", "wpe"))
                    and not is_excluded(module, self.scheme.excluded)
                    and not (routers_ok and is_router(module))):
                self.problems.append(f"{module} is stored unquantized ({dtype}) but not excluded; "
                                     "runtimes will expect NVFP4 tensors for it")

    def _check_fused_groups(self) -> None:
        for group in FUSED_GROUPS:
            parents: dict[str, list[LinearInfo]] = {}
            for info in self.linears.values():
                parent, _, leaf = info.name.rpartition(".")
                if leaf in group:
                    parents.setdefault(parent, []).append(info)
            for parent, members in sorted(parents.items()):
                if len(members) < 2:
                    continue
                names = "/".join(m.name.rpartition(".")[2] for m in members)
                if len({m.weight_scale_2 for m in members}) > 1:
                    values = ", ".join(f"{m.weight_scale_2:.6g}" for m in members)
                    self.problems.append(f"{parent}.{{{names}}} have different weight_scale_2 ({values}); runtimes "
                                         "fuse them into one GEMM with one scale, so all but one are dequantized wrongly")
                inputs = {m.input_scale for m in members}
                if len(inputs) > 1:
                    self.problems.append(f"{parent}.{{{names}}} have different input_scale; the fused GEMM "
                                         "uses one (TensorRT-LLM takes the max)")

    def _check_weight_magnitudes(self) -> None:
        # From the stored values and the format's own convention, not from what the reader made of
        # them: a check of the file, whatever semantics this reader was opened with.
        implied = {name: self._implied_amax(info) for name, info in self.linears.items()}
        wild = [name for name, amax in implied.items() if amax > WEIGHT_AMAX_CEILING]
        if not wild:
            return
        name = max(wild, key=implied.get)
        stored = self.scheme.suffix("global")
        convention = ("(6 x 448) / amax" if self.scheme.is_reciprocal() else "amax / (6 x 448)")
        self.damage.append(
            f"{len(wild)} of {len(self.linears)} NVFP4 Linears have a global scale that implies weights up to "
            f"{implied[name]:.3g} ({name}.{stored}; {self.scheme.format} stores {convention}, and trained weights "
            f"stay below {WEIGHT_AMAX_CEILING:g}): the scale looks written as its reciprocal; re-export the "
            "checkpoint with its quantizer")

    def _implied_amax(self, info: LinearInfo) -> float:
        if self.scheme.is_reciprocal():
            return FP4_E4M3_MAX / info.reciprocals["global"]
        return FP4_E4M3_MAX * info.weight_scale_2

    def _check_block_scales(self, info: LinearInfo, scale: torch.Tensor) -> None:
        # Valid E4M3 scales are the bytes 0x01..0x7E (positive, non-zero, not NaN): one
        # min/max pass decides; the slow diagnosis runs only when something is wrong.
        if scale.numel() == 0:
            return
        low, high = torch.aminmax(scale.view(torch.uint8))
        if int(low) >= 0x01 and int(high) <= 0x7E:
            return
        bits = scale.view(torch.uint8)
        magnitude = bits & 0x7F
        bad = "NaN" if bool((magnitude == 0x7F).any()) else "zero" if bool((magnitude == 0).any()) else "negative"
        name = info.tensor_names["scale"]
        raise CheckpointError(f"{self._where(name)}: {name} contains {bad} block scales; block scales must be "
                              "finite and positive (re-export or re-quantize the checkpoint)")


def _scan(tensors: SafetensorsDir, entries: dict[str, TensorEntry]):
    """(name -> (dtype, shape)) for every tensor, and the values of all float32 scalars."""
    headers: dict[str, tuple[str, list[int]]] = {}
    for shard, names in tensors.iter_shards():
        for name in names:
            entry = entries.get(name)
            if entry is None or entry.path != shard:
                raise CheckpointError(f"{shard}: the index places {name} in this shard, but the file does not "
                                      "contain it; the index and the shards do not belong together")
            headers[name] = (entry.dtype, entry.shape)
    scalar_names = [n for n, (dtype, shape) in headers.items() if dtype == "F32" and shape in SCALAR_SHAPES]
    values = read_f32_scalars([entries[n] for n in scalar_names])
    return headers, dict(zip(scalar_names, values))
