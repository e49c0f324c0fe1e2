"""ONNX Runtime (CPU) sessions over an `export onnx` folder, as speculation-loop backends.

`OrtTargetBackend`, `OrtDrafterBackend` and `OrtChainDrafterBackend` implement the
`TargetBackend` / `DrafterBackend` protocols of `reference.speculate`, so the ONE speculation loop
runs the exported graphs exactly as it runs the reference: same drafts, same verification.

Each backend keeps its KV cache as numpy arrays [B, heads, S, dim], feeds them as `past_*`,
stores the returned `present_*`, and crops them on `truncate` (rejected drafts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle31_export.errors import CheckpointError, MissingRuntimeError, UserError
from eagle31_export.formats.safetensors_io import read_json

_NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}


@dataclass
class OnnxExport:
    """An `export onnx` output folder and its graphs.json."""

    folder: Path
    meta: dict

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "OnnxExport":
        folder = Path(folder)
        if not (folder / "graphs.json").is_file():
            raise UserError(f"{folder}: no graphs.json; pass a folder written by `eagle31-export export onnx`")
        meta = read_json(folder / "graphs.json")
        if meta.get("format") != "eagle31-export/onnx":
            raise UserError(f"{folder}/graphs.json: not an eagle31-export ONNX export")
        _check_meta(folder / "graphs.json", meta)
        return cls(folder, meta)

    @property
    def has_target(self) -> bool:
        return "target" in self.meta

    @property
    def np_dtype(self):
        try:
            return _NUMPY_DTYPES[self.meta["dtype"]]
        except KeyError:
            raise UserError(f"{self.folder}: {self.meta['dtype']} graphs do not run on ONNX Runtime's CPU provider "
                            "(no bf16 kernels); export with --dtype fp32 or fp16 for it") from None

    def session(self, file: str, threads: int | None = None):
        try:
            import onnxruntime as ort
        except ModuleNotFoundError:
            raise MissingRuntimeError("onnxruntime is not installed; pip install onnxruntime") from None
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3  # warnings about unused initializers etc. are noise here
        # Memory stays near the weights' bytes: matrices are stored narrow (bf16) and widened by a
        # Cast just before their MatMul, and NVFP4 weights are packed; constant folding would replace
        # each by a dense fp32 copy made at session start. Pre-packing would keep a second, packed
        # copy of every fp32 MatMul weight. No arena: each session's arena would keep its largest
        # widened weight (the target's lm_head: 2 GB at 8B widths) for good, once per session.
        opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.enable_cpu_mem_arena = False
        try:
            return ort.InferenceSession(str(self.folder / file), opts, providers=["CPUExecutionProvider"],
                                        disabled_optimizers=["ConstantFolding"])
        except Exception as err:  # ONNX Runtime's own error types (Fail, InvalidProtobuf, NoSuchFile, ...)
            if not type(err).__module__.startswith("onnxruntime"):
                raise
            reason = " ".join(str(err).split())[:300]
            raise CheckpointError(f"{self.folder / file}: ONNX Runtime cannot load it ({reason}); the export is "
                                  "damaged or incomplete: re-run `eagle31-export export onnx`") from None


# graphs.json fields the runtime reads: dotted path -> accepted types (drafter; target when present)
_DRAFTER_FIELDS = {"dtype": str, "drafter.graphs.first.file": str, "drafter.graphs.next.file": str,
                   "drafter.d2t": str, "drafter.max_positions": int, "drafter.kv_cache.layers": int,
                   "drafter.kv_cache.heads": int, "drafter.kv_cache.key_dim": int, "drafter.kv_cache.value_dim": int}
_TARGET_FIELDS = {"target.file": str, "target.vocab_size": int, "target.max_positions": int,
                  "target.aux_layer_ids": list, "target.kv_cache.layers": int, "target.kv_cache.heads": int,
                  "target.kv_cache.key_dim": int, "target.kv_cache.value_dim": int}


def _check_meta(path: Path, meta: dict) -> None:
    """Every graphs.json field the backends read, with its type; named files inside the folder."""
    fields = dict(_DRAFTER_FIELDS)
    if "target" in meta:
        fields.update(_TARGET_FIELDS)
    drafter = meta.get("drafter") if isinstance(meta.get("drafter"), dict) else {}
    graphs = drafter.get("graphs") if isinstance(drafter.get("graphs"), dict) else {}
    if "chain" in graphs:
        fields.update({"drafter.graphs.chain.file": str, "drafter.graphs.chain.depth": int})
    for dotted, kind in fields.items():
        value: object = meta
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{path}: field {dotted} is {value!r}; expected a {kind.__name__}: the export "
                                  "is damaged or from another version; re-run `eagle31-export export onnx`")
        if dotted.endswith(("file", "d2t")) and Path(value).name != value:
            raise CheckpointError(f"{path}: {dotted} {value!r} is not a file name inside the export folder")
        if kind is int and value < 1:
            raise CheckpointError(f"{path}: field {dotted} is {value}; expected a positive integer")


class _Cache:
    """Per-layer KV arrays [B, heads, S, dim]."""

    def __init__(self, kv: dict, dtype):
        self.kv, self.dtype = kv, dtype
        self.reset()

    def reset(self) -> None:
        empty = lambda dim: np.zeros((1, self.kv["heads"], 0, dim), self.dtype)  # noqa: E731
        self.keys = [empty(self.kv["key_dim"]) for _ in range(self.kv["layers"])]
        self.values = [empty(self.kv["value_dim"]) for _ in range(self.kv["layers"])]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def feeds(self) -> dict[str, np.ndarray]:
        out = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"past_key_{i}"], out[f"past_value_{i}"] = k, v
        return out

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        self.keys = [outputs[f"present_key_{i}"] for i in range(len(self.keys))]
        self.values = [outputs[f"present_value_{i}"] for i in range(len(self.values))]

    def crop(self, length: int) -> None:
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


def _run(session, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def _ids(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.int64).numpy()


def _check_positions(positions: np.ndarray, limit: int, what: str) -> np.ndarray:
    # Rope tables are precomputed up to `limit` rows; past them Gather fails with an opaque error.
    if positions.size and int(positions.max()) >= limit:
        raise UserError(f"position {int(positions.max())} is past the {what} graph's rope table ({limit} rows); "
                        "re-export with a larger --max-positions")
    return positions


class OrtTargetBackend:
    """`TargetBackend` over target.onnx: logits and tapped states per forward, KV cache kept here."""

    def __init__(self, export: OnnxExport, threads: int | None = None):
        if not export.has_target:
            raise UserError(f"{export.folder}: no target graph; export with --target or run the reference target")
        meta = export.meta["target"]
        self.session = export.session(meta["file"], threads)
        self.cache = _Cache(meta["kv_cache"], export.np_dtype)
        self.aux_layer_ids = tuple(meta["aux_layer_ids"])
        self.vocab_size, self.max_positions = meta["vocab_size"], meta["max_positions"]

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, t = self.cache.length, input_ids.shape[1]
        positions = np.arange(start, start + t, dtype=np.int64)[None].repeat(input_ids.shape[0], 0)
        _check_positions(positions, self.max_positions, "target")
        out = _run(self.session, {"input_ids": _ids(input_ids), "position_ids": positions, **self.cache.feeds()})
        self.cache.update(out)
        return torch.from_numpy(out["logits"]), torch.from_numpy(out["aux_hidden_states"])

    def truncate(self, length: int) -> None:
        self.cache.crop(length)


class OrtDrafterBackend:
    """`DrafterBackend` over drafter_first.onnx (tapped states in) and drafter_next.onnx (fed-back state in)."""

    def __init__(self, export: OnnxExport, threads: int | None = None):
        from safetensors.torch import load_file

        meta = export.meta["drafter"]
        self.export, self.dtype = export, export.np_dtype
        self.first = export.session(meta["graphs"]["first"]["file"], threads)
        self.next = export.session(meta["graphs"]["next"]["file"], threads)
        self.cache = _Cache(meta["kv_cache"], self.dtype)
        try:
            self.d2t = load_file(str(export.folder / meta["d2t"]))["d2t"]
        except Exception as err:  # safetensors' own error types, a missing file, a missing tensor
            raise CheckpointError(f"{export.folder / meta['d2t']}: cannot read its d2t tensor ({err}); "
                                  "re-run `eagle31-export export onnx`") from None
        self.max_positions = meta["max_positions"]

    def _feeds(self, input_ids, positions, name: str, hidden) -> dict[str, np.ndarray]:
        return {"input_ids": _ids(input_ids),
                "position_ids": _check_positions(_ids(positions), self.max_positions, "drafter"),
                name: hidden.detach().float().numpy().astype(self.dtype), **self.cache.feeds()}

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        session, name = (self.first, "aux_hidden_states") if hidden_is_aux else (self.next, "hidden_states")
        out = _run(session, self._feeds(input_ids, positions, name, hidden))
        self.cache.update(out)
        return torch.from_numpy(out["logits"]), torch.from_numpy(out["fed_back_hidden"])

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def truncate(self, length: int) -> None:
        self.cache.crop(length)


class OrtChainDrafterBackend(OrtDrafterBackend):
    """`DrafterBackend` that also drafts whole greedy chains with drafter_chain.onnx (one call a round).

    The loop calls `draft_chain` at temperature 0 for depths up to the graph's; sampling and
    deeper chains run on the single-step graphs it inherits. The chain graph returns the cache
    after its first step only, which is what the loop keeps (it crops to the committed positions).
    """

    def __init__(self, export: OnnxExport, threads: int | None = None):
        super().__init__(export, threads)
        chain = export.meta["drafter"]["graphs"].get("chain")
        if chain is None:
            raise UserError(f"{export.folder}: no chain graph; export with --chain-depth N")
        self.chain, self.chain_depth = export.session(chain["file"], threads), int(chain["depth"])

    def draft_chain(self, input_ids, positions, hidden, depth: int) -> torch.Tensor:
        # the chain's later steps run at positions up to last + chain_depth - 1
        _check_positions(_ids(positions)[:, -1:] + self.chain_depth - 1, self.max_positions, "drafter chain")
        out = _run(self.chain, self._feeds(input_ids, positions, "aux_hidden_states", hidden))
        self.cache.update(out)
        return torch.from_numpy(out["draft_logits"])[:, :depth]


def load_backends(folder: str | os.PathLike, chain: bool = False, threads: int | None = None):
    """(target backend or None when the export has no target graph, drafter backend)."""
    export = OnnxExport.open(folder)
    drafter = (OrtChainDrafterBackend if chain else OrtDrafterBackend)(export, threads)
    target = OrtTargetBackend(export, threads) if export.has_target else None
    return target, drafter


def load(source, options, workdir: Path | None = None):
    """The registry's `onnxruntime` entry: graphs from `source.artifacts` (an `export onnx` folder),
    exported into `workdir` on the fly when only checkpoints are given. Without a target graph
    the reference target verifies (MoE targets have none)."""
    from eagle31_export.runtime.registry import LoopSpeculator

    if options.kernels != "torch":
        raise UserError("--kernels applies to --runtime reference")
    if source.capture is not None:  # the drafter graphs over a capture: no target graph, no target
        from eagle31_export.runtime.on_capture import load_onnxruntime

        return load_onnxruntime(source, options, workdir)
    folder = source.artifacts
    if folder is None:
        if source.drafter is None or source.target is None or workdir is None:
            raise UserError("--runtime onnxruntime needs --onnx DIR (the output of `eagle31-export export onnx`)")
        from eagle31_export.export.onnx_export import export_onnx

        folder = export_onnx(source.drafter, workdir / "onnx", source.target)
    target, drafter = load_backends(folder, chain=options.chain, threads=options.threads)
    if target is None:
        target_path = _verifying_target(drafter.export, source)
        from eagle31_export.reference.target import load_target

        ids = drafter.export.meta["drafter"]["aux_layer_ids"]
        if ids is None:  # exported without a target: the drafter's default taps for this target
            from eagle31_export.config import default_aux_layer_ids
            from eagle31_export.formats.target import read_target_info

            ids = default_aux_layer_ids(read_target_info(target_path).num_hidden_layers)
        target = load_target(target_path, tuple(ids), dtype=options.dtype, act_quant=options.act_quant)
    return LoopSpeculator("onnxruntime", target, drafter, exact=drafter.export.meta.get("dtype") == "fp32")


def _verifying_target(export: OnnxExport, source) -> Path:
    """The reference target that verifies an export without a target graph: the one it was exported for
    (graphs.json `source.target`, a MoE target the graph writer does not model), else the one given."""
    recorded = (export.meta.get("source") or {}).get("target") if "no_target_graph" in export.meta else None
    if recorded:
        path = export.folder / recorded  # absolute, or relative to the export folder
        if (path / "config.json").is_file():
            return path
    if source.target is None:
        raise UserError(f"{export.folder} has no target graph; pass --target for the reference target")
    return Path(source.target)


def prepare_servable(pair_dir: Path, target: Path) -> Path:
    """The Triton `cpu` model runs the graphs exported next to the drafter, in `pair_dir/onnx`
    (which records its sources relative to itself: the repository can move)."""
    from eagle31_export.export.onnx_export import export_onnx

    return export_onnx(pair_dir / "drafter", pair_dir / "onnx", target, relative_sources=True)
