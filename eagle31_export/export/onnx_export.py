"""`export onnx`: a drafter (and optionally its target) as ONNX graphs in one folder.

    out/
      drafter_first.onnx   step 1 of a round (tapped target states in)
      drafter_next.onnx    steps 2..n (fed-back state in)
      drafter_chain.onnx   with chain_depth: the whole greedy chain in one call
      drafter.onnx.data    the drafter weights, shared by the graphs above (external data)
      drafter_d2t.safetensors  draft -> target vocabulary offsets, for runtimes that sample
      target.onnx, target.onnx.data   with a target
      graphs.json          inputs/outputs of every graph, KV layout, tapped layers, source checkpoints
      manifest.json        sha256 of every file; size and header hash of the source checkpoints

`source` records the checkpoints the graphs came from (parity loads them as the reference pair):
absolute paths of the inputs, or, with `relative_sources` (an export that is part of a larger
output, e.g. the Triton `cpu` repository's `pair/onnx` next to `pair/drafter`), paths relative to
this folder, so that no file names the path it was written under.

Written atomically (temporary sibling folder, renamed when complete); every graph passes
`onnx.checker.check_model(full_check=True)` before the folder is renamed into place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from safetensors.torch import save_file

from eagle31_export.errors import UserError
from eagle31_export.export import onnx_nvfp4 as Q
from eagle31_export.export import onnx_plugins as P
from eagle31_export.export.onnx_drafter import DrafterGraphWriter
from eagle31_export.export.onnx_graph import IR_VERSION, OPSET, ExternalWeights, io_description
from eagle31_export.export.onnx_target import TargetGraphWriter
from eagle31_export.config import with_max_positions
from eagle31_export.formats.pair import read_pair
from eagle31_export.formats.outputs import atomic_output_dir, check_output
from eagle31_export.formats.safetensors_io import write_json

FORMAT = "eagle31-export/onnx"
FORMAT_VERSION = 1
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
GRAPHS_JSON = "graphs.json"
D2T_FILE = "drafter_d2t.safetensors"


@dataclass(frozen=True)
class OnnxExportOptions:
    flavor: str = "onnxruntime"  # how NVFP4 target weights are written (see onnx_nvfp4)
    chain_depth: int | None = None
    dtype: torch.dtype = torch.float32
    max_positions: int | None = None  # rope table rows; default: the config's max_position_embeddings

    def validate(self) -> None:
        if self.flavor not in Q.FLAVORS:
            raise UserError(f"unknown --flavor {self.flavor!r}; choose one of {', '.join(Q.FLAVORS)}")
        if self.dtype not in DTYPE_NAMES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPE_NAMES.values())}")
        if self.chain_depth is not None and self.chain_depth < 1:
            raise UserError(f"--chain-depth must be >= 1, got {self.chain_depth}")
        if self.max_positions is not None and self.max_positions < 1:
            raise UserError(f"--max-positions must be >= 1, got {self.max_positions}")


def export_onnx(drafter_path: str | os.PathLike, out: str | os.PathLike, target_path: str | os.PathLike | None = None,
                options: OnnxExportOptions = OnnxExportOptions(), force: bool = False,
                relative_sources: bool = False) -> Path:
    """Export the drafter (and the target when given) to `out`; returns `out`."""
    from eagle31_export.formats.drafter import read_drafter
    from eagle31_export.reference.drafter import build_drafter

    options.validate()
    ckpt = read_drafter(drafter_path)
    check_output(out, force, [drafter_path, target_path])  # before the slow part
    target_model, aux_ids, nvfp4, no_graph = None, None, {}, None
    own_embeddings = "embed_tokens.weight" in ckpt.tensors and "lm_head.weight" in ckpt.tensors
    if target_path is not None:
        target_model, aux_ids, nvfp4, no_graph = _load_target(ckpt, target_path, own_embeddings)
    elif not own_embeddings:
        raise UserError(f"{drafter_path}: the drafter takes embed_tokens/lm_head from its target; pass --target")
    else:
        ckpt.config = with_max_positions(ckpt.config, None)  # no target: yarn's context, when it has one
    # The reference module gathers every weight under its canonical name (embeddings and lm_head
    # from the target where the drafter has none); fp32 here, rounded once to the export dtype.
    drafter = build_drafter(ckpt, dtype=torch.float32, target_model=target_model)

    sources = {"drafter": _source(drafter_path, out, relative_sources),
               "target": _source(target_path, out, relative_sources)}
    with atomic_output_dir(out, force=force, inputs=[drafter_path, target_path], references=sources) as tmp:
        writer = DrafterGraphWriter(drafter, ExternalWeights(tmp, "drafter.onnx.data"), options.dtype,
                                    options.max_positions)
        graphs = {"first": writer.step_graph(True), "next": writer.step_graph(False)}
        if options.chain_depth:
            graphs["chain"] = writer.chain_graph(options.chain_depth)
        drafter_meta = {
            "eagle_version": ckpt.config.eagle_version,
            "config": ckpt.config.to_dict(),
            "aux_layer_ids": list(aux_ids) if aux_ids is not None else ckpt.config.aux_layer_ids,
            "kv_cache": _kv_meta(*writer.kv_dims(), ckpt.config.num_layers),
            "d2t": D2T_FILE,
            "max_positions": writer.max_positions,
            "graphs": {},
        }
        for role, model in graphs.items():
            drafter_meta["graphs"][role] = _save(model, tmp / f"drafter_{role}.onnx")
        if options.chain_depth:
            drafter_meta["graphs"]["chain"]["depth"] = options.chain_depth
        save_file({"d2t": drafter.d2t.to(torch.int64).contiguous()}, str(tmp / D2T_FILE))
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "opset": OPSET, "ir_version": IR_VERSION,
            "dtype": DTYPE_NAMES[options.dtype], "flavor": options.flavor,
            "plugins": {"domain": P.DOMAIN, "plugin_namespace": P.PLUGIN_NAMESPACE,
                        "plugin_version": P.PLUGIN_VERSION, "ops": sorted(P.PLUGINS)},
            "drafter": drafter_meta,
            # where the graphs came from, so that parity tools can load the reference pair
            "source": sources,
        }
        if no_graph is not None:
            meta["no_target_graph"] = no_graph  # runtimes verify with the reference target (source.target)
        elif target_model is not None:
            meta["target"] = _export_target(target_model, aux_ids, nvfp4, options, tmp)
        write_json(tmp / GRAPHS_JSON, meta)
    return Path(out)


def target_graph_problem(target_path: str | os.PathLike) -> str | None:
    """Why the target gets no ONNX graph here (None: it gets one), from its config.json alone."""
    from eagle31_export.export.onnx_target import graph_problem
    from eagle31_export.formats.target import read_target_config

    return graph_problem(read_target_config(target_path))


def _source(path: str | os.PathLike | None, out: str | os.PathLike, relative: bool) -> str | None:
    if path is None:
        return None
    if relative:
        return Path(os.path.relpath(Path(path).absolute(), Path(out).absolute())).as_posix()
    return str(Path(path).resolve())


def _load_target(ckpt, target_path, own_embeddings: bool):
    """(target model or None, tapped ids, NVFP4 weights, why the target gets no graph or None).

    A target the graph writer does not model (MoE targets: DeepSeek-V3 / Kimi K2, ...) gets none: the
    drafter graphs are exported alone and runtimes verify with the reference target. It is then loaded
    only when the drafter takes its embeddings or lm_head from it."""
    from eagle31_export.formats.target import check_target, load_causal_lm

    aux_ids = read_pair(ckpt, target_path).aux_layer_ids  # resolves max_position_embeddings too
    no_graph = target_graph_problem(target_path)  # before loading anything
    if no_graph is not None:
        if own_embeddings:
            check_target(target_path)  # structure only: the reference target loads it later
            return None, aux_ids, {}, no_graph
        return load_causal_lm(target_path, dtype=torch.float32), aux_ids, {}, no_graph
    # NVFP4 targets load dequantized (for norms, embeddings, rope); their packed weights are
    # read separately and go into the graph as they are.
    return (load_causal_lm(target_path, dtype=torch.float32), aux_ids, Q.read_nvfp4_weights(target_path), None)


def _export_target(model, aux_ids, nvfp4, options: OnnxExportOptions, tmp: Path) -> dict:
    writer = TargetGraphWriter(model, aux_ids, ExternalWeights(tmp, "target.onnx.data"), options.dtype,
                               nvfp4, options.flavor, options.max_positions)
    entry = _save(writer.graph(), tmp / "target.onnx")
    entry.update({
        "model_type": writer.config.model_type,
        "num_layers": len(writer.layers),
        "aux_layer_ids": list(aux_ids),
        "vocab_size": int(writer.config.vocab_size),
        "quantization": {"algo": "NVFP4", "modules": len(nvfp4), "flavor": options.flavor} if nvfp4 else None,
        "kv_cache": _kv_meta(writer.kv_heads, writer.head_dim, writer.head_dim, len(writer.layers)),
        "max_positions": writer.max_positions,
    })
    return entry


def _kv_meta(heads: int, key_dim: int, value_dim: int, layers: int) -> dict:
    return {"layers": layers, "heads": heads, "key_dim": key_dim, "value_dim": value_dim,
            "layout": "[batch, heads, sequence, dim]", "inputs": "past_key_{i}, past_value_{i}",
            "outputs": "present_key_{i}, present_value_{i} (past + this call)"}


def _save(model: onnx.ModelProto, path: Path) -> dict:
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return {"file": path.name, **io_description(model)}
