"""Lossless conversion between ModelOpt and compressed-tensors NVFP4 checkpoints.

Packed weights and block scales are copied bit for bit; only names and the per-tensor
scales change (compressed-tensors stores their reciprocals). Converting there and back
reproduces every tensor exactly (see formats.nvfp4.writer.other_convention).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from eagle31_export.errors import UserError
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
from eagle31_export.formats.nvfp4.scheme import FORMATS, Format, QuantScheme, pattern_matches, write_declarations
from eagle31_export.formats.nvfp4.writer import (
    DEFAULT_MAX_SHARD_BYTES, LinearWriter, ProgressCallback, ShardedWriter, check_distinct, copy_side_files,
    tensor_steps,
)
from eagle31_export.formats.outputs import atomic_output_dir


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, to_format: Format, force: bool = False,
                       progress: ProgressCallback | None = None,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the NVFP4 checkpoint `src` to `out` in `to_format`; returns `out`.

    `progress(done, total, description)` is told about every tensor written (see ProgressCallback).
    """
    if to_format not in FORMATS:
        raise UserError(f"unknown NVFP4 format {to_format!r}; use one of {', '.join(FORMATS)}")
    check_distinct(Path(src), Path(out))
    ckpt = NVFP4Checkpoint.open(src)
    if ckpt.scheme.format == to_format:
        raise UserError(f"{src} is already a {to_format} NVFP4 checkpoint; nothing to convert")
    scheme = _target_scheme(ckpt, to_format)
    total = len(ckpt.headers)
    step = tensor_steps(progress, total, f"convert to {to_format}")
    with atomic_output_dir(out, force=force, inputs=[src]) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        linears = LinearWriter(writer, scheme)
        for name, tensor in ckpt.iter_other_tensors():
            writer.add(name, tensor)
            step(name)
        for q in ckpt.iter_linears():
            info = q.info
            linears.add(info.name, q.packed, q.weight_scale, info.weight_scale_2, info.input_scale,
                        records=info.reciprocals)
            step(info.name, len(info.tensor_names))
        for key, value in sorted(ckpt.kv_scales.items()):
            attn, _, leaf = key.rpartition(".")
            linears.add_kv_scale(attn, leaf[0], value)
            step(key)
        writer.close()
        write_declarations(tmp, ckpt.config, scheme)
        copy_side_files(ckpt.folder, tmp)
    return Path(out)


def _target_scheme(ckpt: NVFP4Checkpoint, to_format: Format) -> QuantScheme:
    # The producer named in the output is this tool, not the source's quantizer.
    scheme = replace(ckpt.scheme, format=to_format, producer=None)
    if to_format == "modelopt" and any(p.startswith("re:") for p in scheme.excluded):
        # ModelOpt's exclude_modules has no regex form: name the modules the regex matched.
        modules = sorted({n.rpartition(".")[0] for n in ckpt.headers})
        expanded: list[str] = []
        for p in scheme.excluded:
            expanded += [m for m in modules if pattern_matches(p, m)] if p.startswith("re:") else [p]
        scheme = QuantScheme(to_format, tuple(dict.fromkeys(expanded)), scheme.kv_cache, scheme.act_quant,
                             scheme.group_size)
    return scheme
