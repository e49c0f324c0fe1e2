"""`export onnx`: a drafter (and optionally its target) as ONNX graphs in one folder.

    out/
      drafter_first.onnx   step 1 of a round (tapped target states in)
      drafter_next.onnx    steps 2..n (fed-back state in)
      drafter_chain.onnx   with chain_depth: the whole greedy chain in one call
      drafter.onnx.data    the drafter weights, shared by the graphs above (external data); embeddings
                           (and lm_head) the drafter takes from the target are read from target.onnx.data
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

from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.export import onnx_nvfp4 as Q
from eagle31_export.export import onnx_plugins as P
from eagle31_export.export.onnx_drafter import DrafterGraphWriter, SharedWeight
from eagle31_export.export.onnx_graph import IR_VERSION, OPSET, ExternalWeights, io_description
from eagle31_export.export.onnx_target import TargetGraphWriter
from eagle31_export.export.onnx_w4a4 import W4A4, quantize_activations
from eagle31_export.config import with_max_positions
from eagle31_export.formats.pair import read_pair
from eagle31_export.formats.outputs import atomic_output_dir, check_output
from eagle31_export.formats.safetensors_io import write_json
from eagle31_export.progress import Phases

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
                relative_sources: bool = False, progress=None) -> Path:
    """Export the drafter (and the target when given) to `out`; returns `out`. `progress(phase, done,
    total)` hears of load_target, export_drafter (graphs written) and export_target; a `Phases`
    passed as `progress` gets their seconds (eagle31_export/progress.py).

    Memory stays near the checkpoints' bytes: the target model is held as its loader keeps it, the
    drafter's tensors are read from its checkpoint one at a time, and every tensor is converted
    and written piece by piece (onnx_graph.ExternalWeights). A drafter that takes its embeddings
    (or lm_head) from the target reads them from target.onnx.data when the target gets a graph.
    """
    from eagle31_export.formats.drafter.checkpoint import read_drafter

    options.validate()
    phases = Phases.of(progress)
    ckpt = read_drafter(drafter_path)
    check_output(out, force, [drafter_path, target_path])  # before the slow part
    target_model, aux_ids, nvfp4, no_graph, stored = None, None, {}, None, {}
    own_embeddings = "embed_tokens.weight" in ckpt.tensors and "lm_head.weight" in ckpt.tensors
    if target_path is not None:
        with phases.phase("load_target"):
            target_model, aux_ids, nvfp4, no_graph = _load_target(ckpt, target_path, own_embeddings)
        if target_model is not None:
            stored = _stored_dtypes(target_path, target_model)
    elif not own_embeddings:
        raise UserError(f"{drafter_path}: the drafter takes embed_tokens/lm_head from its target; pass --target")
    else:
        ckpt.config = with_max_positions(ckpt.config, None)  # no target: yarn's context, when it has one
    draft_lm_head = "lm_head.weight" not in ckpt.tensors
    if draft_lm_head and ckpt.config.draft_vocab_size != ckpt.config.vocab_size:
        raise CheckpointError("the drafter has no lm_head; it needs the target's, with draft_vocab_size == vocab_size")

    # W4A4 graphs quantize activations with the checkpoint's input scales (onnx_w4a4): read them first.
    input_scales = Q.read_input_scales(target_path) if nvfp4 and options.flavor == W4A4 and no_graph is None else {}
    sources = {"drafter": _source(drafter_path, out, relative_sources),
               "target": _source(target_path, out, relative_sources)}
    with atomic_output_dir(out, force=force, inputs=[drafter_path, target_path], references=sources) as tmp:
        target_writer = None
        if target_model is not None and no_graph is None:
            target_writer = TargetGraphWriter(target_model, aux_ids, ExternalWeights(tmp, "target.onnx.data"),
                                              options.dtype, nvfp4, options.flavor, options.max_positions, stored)
        shared = {}
        if target_writer is not None:
            shared = target_writer.shared_weights(draft_lm_head)
        elif target_model is not None:  # no target graph: the drafter's file holds them, as stored
            shared = {"embed_tokens.weight": _shared(target_model, target_model.get_input_embeddings().weight, stored)}
            if draft_lm_head:
                shared["lm_head.weight"] = _shared(target_model, target_model.get_output_embeddings().weight, stored)
        shared = {name: w for name, w in shared.items() if name not in ckpt.tensors}
        writer = DrafterGraphWriter(ckpt.config, ckpt.tensors, ExternalWeights(tmp, "drafter.onnx.data"),
                                    options.dtype, options.max_positions, shared=shared, d2t=ckpt.d2t())
        drafter_meta = {
            "eagle_version": ckpt.config.eagle_version,
            "config": ckpt.config.to_dict(),
            "aux_layer_ids": list(aux_ids) if aux_ids is not None else ckpt.config.aux_layer_ids,
            "kv_cache": _kv_meta(*writer.kv_dims(), ckpt.config.num_layers, ckpt.config.num_attention_heads),
            "d2t": D2T_FILE,
            "max_positions": writer.max_positions,
            "graphs": {},
        }
        # One graph at a time: each is saved and checked before the next is built.
        roles = {"first": lambda: writer.step_graph(True), "next": lambda: writer.step_graph(False)}
        if options.chain_depth:
            roles["chain"] = lambda: writer.chain_graph(options.chain_depth)
        with phases.phase("export_drafter", total=len(roles)):
            for n, (role, build) in enumerate(roles.items(), 1):
                drafter_meta["graphs"][role] = _save(build(), tmp / f"drafter_{role}.onnx")
                phases("export_drafter", n, len(roles))
        if options.chain_depth:
            drafter_meta["graphs"]["chain"]["depth"] = options.chain_depth
        save_file({"d2t": writer.d2t.contiguous()}, str(tmp / D2T_FILE))
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
        elif target_writer is not None:
            with phases.phase("export_target"):
                meta["target"] = _export_target(target_writer, aux_ids, nvfp4, options, tmp, input_scales)
        write_json(tmp / GRAPHS_JSON, meta)
    return Path(out)


def _stored_dtypes(target_path, model) -> dict[str, torch.dtype]:
    """Each float tensor's dtype in the target checkpoint, under the model's parameter names
    (a tied lm_head, absent from the files, takes its embedding's). The graphs keep these dtypes
    for their matrices whatever dtype the loader gives the model."""
    from eagle31_export.formats.safetensors_io import FLOAT_TORCH_DTYPES, SafetensorsDir

    headers = SafetensorsDir(target_path).headers
    stored = {name: FLOAT_TORCH_DTYPES[e.dtype] for name, e in headers.items() if e.dtype in FLOAT_TORCH_DTYPES}
    by_storage: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        by_storage.setdefault(t.data_ptr(), []).append(name)
    for names in by_storage.values():  # tied parameters share one storage
        known = [stored[n] for n in names if n in stored]
        for n in names:
            if known and n not in stored:
                stored[n] = known[0]
    return stored


def _shared(model, param: torch.Tensor, stored: dict[str, torch.dtype]) -> SharedWeight:
    name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is param), None)
    return SharedWeight(param.detach(), stored.get(name, param.dtype))


def target_graph_problem(target_path: str | os.PathLike) -> str | None:
    """Why the target gets no ONNX graph here (None: it gets one), from its config.json alone."""
    from eagle31_export.export.onnx_target import graph_problem
    from eagle31_export.formats.target.checkpoint import read_target_config

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
    from eagle31_export.formats.target.checkpoint import check_target, load_causal_lm

    aux_ids = read_pair(ckpt, target_path).aux_layer_ids  # resolves max_position_embeddings too
    no_graph = target_graph_problem(target_path)  # before loading anything
    if no_graph is not None:
        if own_embeddings:
            check_target(target_path)  # structure only: the reference target loads it later
            return None, aux_ids, {}, no_graph
        return _load_stored(load_causal_lm, target_path), aux_ids, {}, no_graph
    # NVFP4 Linears go into the graph packed, as stored: taken from the model when it keeps them
    # packed, else read from the checkpoint (zero-copy views of the files).
    model = _load_stored(load_causal_lm, target_path)
    return model, aux_ids, _packed_linears(model) or Q.read_nvfp4_weights(target_path), None


def _load_stored(load_causal_lm, target_path):
    """The target with its weights as stored (bf16 stays bf16, NVFP4 stays packed): the graphs only
    read the weights, each converted as it is written."""
    return load_causal_lm(target_path, dtype=torch.float32, stored_weights=True)


def _packed_linears(model) -> dict[str, Q.Nvfp4Weight]:
    """The NVFP4 Linears a model keeps packed (codes, block scales, global scale, ModelOpt's convention)."""
    return {name: Q.Nvfp4Weight(m.weight_packed, m.weight_scale, m.weight_scale_2.reshape(()))
            for name, m in model.named_modules()
            if all(isinstance(getattr(m, a, None), torch.Tensor) for a in ("weight_packed", "weight_scale", "weight_scale_2"))}


def _export_target(writer: TargetGraphWriter, aux_ids, nvfp4, options: OnnxExportOptions, tmp: Path,
                   input_scales: dict[str, float]) -> dict:
    graph = writer.graph()
    if nvfp4 and options.flavor == W4A4:
        graph = quantize_activations(graph, input_scales)
    entry = _save(graph, tmp / "target.onnx")
    entry.update({
        "model_type": writer.config.model_type,
        "num_layers": len(writer.layers),
        "aux_layer_ids": list(aux_ids),
        "vocab_size": int(writer.config.vocab_size),
        "quantization": {"algo": "NVFP4", "modules": len(nvfp4), "flavor": options.flavor,
                         "activations": "nvfp4" if options.flavor == W4A4 else None} if nvfp4 else None,
        "kv_cache": _kv_meta(writer.kv_heads, writer.head_dim, writer.head_dim, len(writer.layers), writer.heads),
        "max_positions": writer.max_positions,
    })
    return entry


def _kv_meta(heads: int, key_dim: int, value_dim: int, layers: int, query_heads: int) -> dict:
    # query_heads: what a call's attention scores scale with (the runtime sizes long forwards by it)
    return {"layers": layers, "heads": heads, "key_dim": key_dim, "value_dim": value_dim, "query_heads": query_heads,
            "layout": "[batch, heads, sequence, dim]", "inputs": "past_key_{i}, past_value_{i}",
            "outputs": "new_key_{i}, new_value_{i} (this call's entries; the caller appends them)",
            "returns": "new"}


def _save(model: onnx.ModelProto, path: Path) -> dict:
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return {"file": path.name, **io_description(model)}
