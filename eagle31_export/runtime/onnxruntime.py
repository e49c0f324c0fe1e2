"""ONNX Runtime (CPU) sessions over an `export onnx` folder, as speculation-loop backends.

`OrtTargetBackend`, `OrtDrafterBackend` and `OrtChainDrafterBackend` implement the
`TargetBackend` / `DrafterBackend` protocols of `reference.speculate`, so the ONE speculation loop
runs the exported graphs exactly as it runs the reference: same drafts, same verification.

Each backend keeps one sequence's KV cache as numpy arrays [1, heads, S, dim], feeds it as `past_*`,
appends the call's `new_*` entries to it, and crops it on `truncate` (rejected drafts). `fork()` gives another
sequence over the same sessions, and `*_batch` runs several sequences in one call, padded and masked
(`run_batch`): `runtime/batching.py` serves the requests in flight that way.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from eagle31_export.errors import CheckpointError, MissingRuntimeError, UserError
from eagle31_export.formats.safetensors_io import read_json
from eagle31_export.process_memory import release_read_only_pages

_NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}

# ONNX element type -> the numpy dtype that holds its bytes (bf16 and fp8 as raw integers; the OrtValue
# carries the ONNX type). Packed 4-bit types are left to ONNX Runtime's own loading.
_STORAGE_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
                   9: np.bool_, 10: np.float16, 11: np.float64, 16: np.uint16, 17: np.uint8}


class SharedWeights:
    """The export's weight files mapped once, their tensors handed to every session as initializers.

    Left to itself ONNX Runtime maps a graph's external data once per session: drafter_first.onnx and
    drafter_next.onnx then each map drafter.onnx.data, and the pages both read count twice in the
    process's RSS (1.59 GiB for a 1.01 GiB file on the 8B-class layout). The views are not copied:
    ONNX Runtime computes from the caller's buffers (`SessionOptions.add_initializer`)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._files: dict[str, np.memmap] = {}
        self._values: dict[tuple, object] = {}
        self._views: dict[int, np.ndarray] = {}  # id(OrtValue) -> the mapped view it wraps

    def add_to(self, opts, graph_file: str) -> tuple[list, list[np.ndarray]]:
        """Register `graph_file`'s external initializers on `opts`. Returns the OrtValues (keep them
        alive as long as the session) and the mapped views of those read by rows (the data of a
        Gather: embeddings, rope tables), whose pages `release_tables` gives back after each run."""
        import onnx
        import onnxruntime as ort

        held, tables = [], []
        try:
            model = onnx.load(str(self.folder / graph_file), load_external_data=False)
        except Exception:  # missing or damaged: ONNX Runtime's own loading says so, in our one line
            return held, tables
        gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input}
        for tensor in model.graph.initializer:
            value = self._value(ort, tensor)
            if value is not None:
                opts.add_initializer(tensor.name, value)
                held.append(value)
                if tensor.name in gathered:
                    tables.append(self._views[id(value)])
        return held, tables

    def _value(self, ort, tensor):
        where = {e.key: e.value for e in tensor.external_data}
        storage = _STORAGE_DTYPES.get(tensor.data_type)
        if not where or storage is None or Path(where.get("location", "")).name != where.get("location"):
            return None
        offset, length = int(where.get("offset", 0)), int(where.get("length", -1))
        key = (where["location"], offset, length, tensor.data_type, tuple(tensor.dims))
        if key not in self._values:
            if where["location"] not in self._files:
                try:
                    self._files[where["location"]] = np.memmap(self.folder / where["location"], np.uint8, mode="r")
                except (OSError, ValueError):  # missing or empty: left to ONNX Runtime's loading, as above
                    return None
            data = self._files[where["location"]]
            if length < 0 or offset + length > data.size or length != np.dtype(storage).itemsize * int(
                    np.prod(tensor.dims, dtype=np.int64)):
                return None  # not what it says: ONNX Runtime's own loading reports it
            view = data[offset:offset + length].view(storage).reshape(tuple(tensor.dims))
            self._values[key] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(view, tensor.data_type)
            self._views[id(self._values[key])] = view
        return self._values[key]


def release_tables(session) -> None:
    """Give back the pages a run mapped of the session's tables read by rows: a Gather touches a few
    rows, the kernel maps the pages around each (`process_memory`, "tables read by rows"). The
    weight files are mapped read-only (`SharedWeights`), so nothing held can be lost."""
    for table in getattr(session, "tables", ()):
        release_read_only_pages(table.ctypes.data, table.nbytes)


@dataclass
class OnnxExport:
    """An `export onnx` output folder and its graphs.json."""

    folder: Path
    meta: dict

    @cached_property
    def weights(self) -> SharedWeights:
        return SharedWeights(self.folder)

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
            held, tables = self.weights.add_to(opts, file)
            session = ort.InferenceSession(str(self.folder / file), opts, providers=["CPUExecutionProvider"],
                                           disabled_optimizers=["ConstantFolding"])
            session.shared_weights = held  # the buffers it computes from live as long as it does
            session.tables = tables
            return session
        except Exception as err:  # ONNX Runtime's own error types (Fail, InvalidProtobuf, NoSuchFile, ...)
            if not type(err).__module__.startswith("onnxruntime"):
                raise
            reason = " ".join(str(err).split())[:300]
            raise CheckpointError(f"{self.folder / file}: ONNX Runtime cannot load it ({reason}); the export is "
                                  "damaged or incomplete: re-run `eagle31-export export onnx`") from None


# graphs.json fields the runtime reads: dotted path -> accepted types (drafter; target when present)
_DRAFTER_FIELDS = {"dtype": str, "drafter.graphs.first.file": str, "drafter.graphs.next.file": str,
                   "drafter.d2t": str, "drafter.max_positions": int, "drafter.kv_cache.layers": int,
                   "drafter.kv_cache.heads": int, "drafter.kv_cache.key_dim": int, "drafter.kv_cache.value_dim": int,
                   "drafter.kv_cache.returns": str}
_TARGET_FIELDS = {"target.file": str, "target.vocab_size": int, "target.max_positions": int,
                  "target.aux_layer_ids": list, "target.kv_cache.layers": int, "target.kv_cache.heads": int,
                  "target.kv_cache.key_dim": int, "target.kv_cache.value_dim": int, "target.kv_cache.returns": str}


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
        if dotted.endswith("kv_cache.returns") and value != "new":
            raise CheckpointError(f"{path}: the graphs return {value!r} KV entries; this version appends the "
                                  "new ones itself: re-run `eagle31-export export onnx`")


class _Cache:
    """One sequence's per-layer KV arrays [1, heads, S, dim]."""

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

    def append(self, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        """This call's entries [1, heads, T, dim] appended, one layer at a time (so that one layer's
        old and new arrays are alive together, not the whole cache twice)."""
        for arrays, new in ((self.keys, keys), (self.values, values)):
            for i, entries in enumerate(new):
                arrays[i] = np.concatenate([arrays[i], entries], axis=2)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions, as contiguous arrays made one layer at a time. A cropped
        view of [1, heads, S, dim] is not contiguous: ONNX Runtime would copy every layer's at the
        next call, while the views still held the old arrays (three copies of the cache at once)."""
        if length >= self.length:
            return
        for arrays in (self.keys, self.values):
            for i, array in enumerate(arrays):
                arrays[i] = np.ascontiguousarray(array[:, :, :length])


def _run(session, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    try:
        return dict(zip(names, session.run(names, feeds)))
    finally:
        release_tables(session)


def _pad(array: np.ndarray, length: int, axis: int, left: bool) -> np.ndarray:
    missing = length - array.shape[axis]
    if not missing:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (missing, 0) if left else (0, missing)
    return np.pad(array, widths)


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    # one sequence (the common case) is fed as it is: no copy of its whole cache every call
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _fork(backend):
    """Another sequence over `backend`'s sessions: a shallow copy with a cache of its own."""
    other = copy.copy(backend)
    other.cache = _Cache(backend.cache.kv, backend.cache.dtype)
    return other


def run_batch(session, caches: list[_Cache], feeds: list[dict[str, np.ndarray]],
              per_token: tuple[str, ...]) -> list[dict[str, np.ndarray]]:
    """One session call for several sequences; `feeds[b]`: sequence b's [1, T_b, ...] inputs.

    Caches are left-padded to the longest and new tokens right-padded to the longest, with
    `attention_mask` marking each sequence's real keys (`onnx_layers.attention_bias`). Outputs come
    back per sequence: those named in `per_token` cut to its T_b tokens, and its cache gets its T_b
    entries of `new_*` appended.
    """
    past = max(c.length for c in caches)
    new = [f["input_ids"].shape[1] for f in feeds]
    width = max(new)
    batch = {name: _stack([_pad(f[name], width, 1, left=False) for f in feeds]) for name in feeds[0]}
    mask = np.zeros((len(caches), past + width), np.int64)
    for b, (cache, t) in enumerate(zip(caches, new)):
        mask[b, past - cache.length: past + t] = 1
    batch["attention_mask"] = mask
    for i in range(len(caches[0].keys)):
        batch[f"past_key_{i}"] = _stack([_pad(c.keys[i], past, 2, left=True) for c in caches])
        batch[f"past_value_{i}"] = _stack([_pad(c.values[i], past, 2, left=True) for c in caches])
    out = _run(session, batch)
    del batch  # padded copies of the caches (several sequences) go before the caches grow
    layers = range(len(caches[0].keys))
    results = []
    for b, (cache, t) in enumerate(zip(caches, new)):
        cache.append([out[f"new_key_{i}"][b:b + 1, :, :t] for i in layers],
                     [out[f"new_value_{i}"][b:b + 1, :, :t] for i in layers])
        results.append({name: out[name][b:b + 1, :t] if name in per_token else out[name][b:b + 1]
                        for name in out if not name.startswith("new_")})
    return results


# Bytes of fp32 attention scores, [sequences, query heads, T, S] per layer, one graph call may make: the
# graphs materialise them (and hold them a few times over: mask, sum, softmax), so a longer forward
# runs as calls over pieces of its tokens. Each query row attends to the same keys either way.
SCORE_BYTES = 128 << 20


def in_pieces(call_once, calls: list, widths: list[int], caches: list["_Cache"], cut,
              keep: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`call_once(calls)` -> [(logits [1, T_b, V], states [1, T_b, ...])], run over pieces of the
    sequences' new tokens (`widths`) small enough for `SCORE_BYTES` against their `caches`;
    `cut(call, a, b)`: a call restricted to its tokens a..b. A sequence takes part in the pieces its
    tokens reach. `keep[b]`, when not 0: sequence b's last `keep[b]` logits only (no [T, V] block
    of a long prompt's piece is ever held)."""
    heads = caches[0].kv.get("query_heads", caches[0].kv["heads"])
    width = max(widths)
    rows = max(1, SCORE_BYTES // (len(calls) * heads * (max(c.length for c in caches) + width) * 4))
    keep = keep or [0] * len(calls)
    logits: list = [None] * len(calls)
    states: list[list] = [[] for _ in calls]
    for a in range(0, width, rows):
        live = [b for b, w in enumerate(widths) if w > a]
        got = call_once([calls[b] if rows >= width else cut(calls[b], a, a + rows) for b in live])
        for b, (piece_logits, piece_states) in zip(live, got):
            joined = piece_logits if logits[b] is None else torch.cat([logits[b], piece_logits], dim=1)
            logits[b] = joined[:, -keep[b]:] if keep[b] else joined
            states[b].append(piece_states)
    return [(lg, st[0] if len(st) == 1 else torch.cat(st, dim=1)) for lg, st in zip(logits, states)]


def _ids(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.int64).numpy()


def _check_positions(positions: np.ndarray, limit: int, what: str) -> np.ndarray:
    # Rope tables are precomputed up to `limit` rows; past them Gather fails with an opaque error.
    if positions.size and int(positions.max()) >= limit:
        raise UserError(f"position {int(positions.max())} is past the {what} graph's rope table ({limit} rows); "
                        "re-export with a larger --max-positions")
    return positions


class OrtTargetBackend:
    """`TargetBackend` over target.onnx: logits and tapped states per forward, one sequence's KV cache
    kept here. `fork()` gives another sequence over the same session; `forward_batch` runs several
    sequences' forwards in one session call."""

    def __init__(self, export: OnnxExport, threads: int | None = None):
        if not export.has_target:
            raise UserError(f"{export.folder}: no target graph; export with --target or run the reference target")
        meta = export.meta["target"]
        self.session = export.session(meta["file"], threads)
        self.cache = _Cache(meta["kv_cache"], export.np_dtype)
        self.aux_layer_ids = tuple(meta["aux_layer_ids"])
        self.vocab_size, self.max_positions = meta["vocab_size"], meta["max_positions"]

    def fork(self) -> "OrtTargetBackend":
        return _fork(self)

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_batch([(self, input_ids, logits_to_keep)])[0]

    @staticmethod
    def forward_batch(calls: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`forward` of several sequences, [(backend, input_ids[, logits_to_keep])], in as few session
        calls as `SCORE_BYTES` allows (one, but for long prompts' pieces)."""
        return in_pieces(OrtTargetBackend._forward_once, [c[:2] for c in calls], [c[1].shape[1] for c in calls],
                         [c[0].cache for c in calls], lambda c, a, b: (c[0], c[1][:, a:b]),
                         [c[2] if len(c) > 2 else 0 for c in calls])

    @staticmethod
    def _forward_once(calls: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        feeds = []
        for backend, input_ids in calls:
            start, t = backend.cache.length, input_ids.shape[1]
            positions = np.arange(start, start + t, dtype=np.int64)[None]
            _check_positions(positions, backend.max_positions, "target")
            feeds.append({"input_ids": _ids(input_ids), "position_ids": positions})
        outs = run_batch(calls[0][0].session, [b.cache for b, _ in calls], feeds, ("logits", "aux_hidden_states"))
        return [(torch.from_numpy(o["logits"]), torch.from_numpy(o["aux_hidden_states"])) for o in outs]

    def truncate(self, length: int) -> None:
        self.cache.crop(length)


class OrtDrafterBackend:
    """`DrafterBackend` over drafter_first.onnx (tapped states in) and drafter_next.onnx (fed-back state in);
    `fork()` and `forward_batch` as for the target."""

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

    def fork(self) -> "OrtDrafterBackend":
        return _fork(self)

    def _feeds(self, input_ids, positions, name: str, hidden) -> dict[str, np.ndarray]:
        return {"input_ids": _ids(input_ids),
                "position_ids": _check_positions(_ids(positions), self.max_positions, "drafter"),
                name: hidden.detach().float().numpy().astype(self.dtype)}

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        return self.forward_batch([(self, (input_ids, positions, hidden, hidden_is_aux))])[0]

    @staticmethod
    def forward_batch(calls: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`forward` of several sequences, [(backend, (input_ids, positions, hidden, hidden_is_aux))], all
        with the same `hidden_is_aux` (one graph), in as few session calls as `SCORE_BYTES` allows."""
        def cut(call, a: int, b: int):
            backend, (ids, positions, hidden, is_aux) = call
            return backend, (ids[:, a:b], positions[:, a:b], hidden[:, a:b], is_aux)

        return in_pieces(OrtDrafterBackend._forward_once, calls, [c[1][0].shape[1] for c in calls],
                         [c[0].cache for c in calls], cut)

    @staticmethod
    def _forward_once(calls: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        first, (_, (_, _, _, hidden_is_aux)) = calls[0][0], calls[0]
        session, name = (first.first, "aux_hidden_states") if hidden_is_aux else (first.next, "hidden_states")
        feeds = [backend._feeds(ids, positions, name, hidden) for backend, (ids, positions, hidden, _) in calls]
        outs = run_batch(session, [b.cache for b, _ in calls], feeds, ("logits", "target_token_ids", "fed_back_hidden"))
        return [(torch.from_numpy(o["logits"]), torch.from_numpy(o["fed_back_hidden"])) for o in outs]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def truncate(self, length: int) -> None:
        self.cache.crop(length)


class OrtChainDrafterBackend(OrtDrafterBackend):
    """`DrafterBackend` that also drafts whole greedy chains with drafter_chain.onnx (one call a round).

    The loop calls `draft_chain` at temperature 0 for depths up to the graph's; sampling and
    deeper chains run on the single-step graphs it inherits. The chain graph returns its first step's
    cache entries only, which is what the loop keeps (it crops to the committed positions).
    """

    def __init__(self, export: OnnxExport, threads: int | None = None):
        super().__init__(export, threads)
        chain = export.meta["drafter"]["graphs"].get("chain")
        if chain is None:
            raise UserError(f"{export.folder}: no chain graph; export with --chain-depth N")
        self.chain, self.chain_depth = export.session(chain["file"], threads), int(chain["depth"])

    def draft_chain(self, input_ids, positions, hidden, depth: int) -> torch.Tensor:
        return self.draft_chain_batch([(self, (input_ids, positions, hidden, depth))])[0]

    @staticmethod
    def draft_chain_batch(calls: list) -> list[torch.Tensor]:
        """`draft_chain` of several sequences, [(backend, (input_ids, positions, hidden, depth))], all with
        the same number of new tokens (the chain continues from each one's last position)."""
        feeds = []
        for backend, (ids, positions, hidden, _) in calls:
            # the chain's later steps run at positions up to last + chain_depth - 1
            _check_positions(_ids(positions)[:, -1:] + backend.chain_depth - 1, backend.max_positions,
                             "drafter chain")
            feeds.append(backend._feeds(ids, positions, "aux_hidden_states", hidden))
        if len({f["input_ids"].shape[1] for f in feeds}) > 1:
            raise ValueError("one chain call takes sequences with the same number of new tokens")
        outs = run_batch(calls[0][0].chain, [b.cache for b, _ in calls], feeds, ())
        return [torch.from_numpy(o["draft_logits"])[:, :depth] for o, (_, (*_, depth)) in zip(outs, calls)]


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
    from eagle31_export.runtime.contract import LoopSpeculator

    if options.kernels != "torch":
        raise UserError("--kernels applies to --runtime reference")
    if source.capture is not None:  # the drafter graphs over a capture: no target graph, no target
        return _load_on_capture(source, options, workdir)
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
            from eagle31_export.formats.target.checkpoint import read_target_info

            ids = default_aux_layer_ids(read_target_info(target_path).num_hidden_layers)
        target = load_target(target_path, tuple(ids), dtype=options.dtype, act_quant=options.act_quant,
                             nvfp4_semantics=options.nvfp4_semantics)
    exact = drafter.export.meta.get("dtype") == "fp32"
    if isinstance(target, OrtTargetBackend):  # both sides are graphs: requests in flight run batched
        from eagle31_export.runtime.batching import BatchingSpeculator

        speculator = BatchingSpeculator("onnxruntime", target, drafter, exact)
    else:
        speculator = LoopSpeculator("onnxruntime", target, drafter, exact)
    speculator.compute_dtype = torch.float32 if exact else torch.float16  # the graphs' dtype: fp32 or fp16
    return speculator


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


def _load_on_capture(source, options, workdir: Path | None):
    """The exported drafter graphs (`source.artifacts`, or exported from `source.drafter` into
    `workdir`, with the target's input embeddings from the capture where the drafter has none);
    an export's target graph, if any, is not used: the capture stands in for the target."""
    from eagle31_export.formats.capture import Capture
    from eagle31_export.reference.capture_target import CaptureTarget
    from eagle31_export.runtime.on_capture import CaptureSpeculator, refuse_act_quant

    refuse_act_quant(options)
    capture = Capture.open(source.capture)
    folder = source.artifacts
    if folder is None:
        if source.drafter is None or workdir is None:
            raise UserError("--runtime onnxruntime with --capture needs --onnx DIR or --drafter D (exported here)")
        from eagle31_export.export.onnx_export import export_onnx
        from eagle31_export.formats.capture import drafter_with_embeddings
        from eagle31_export.formats.drafter.checkpoint import read_drafter
        from eagle31_export.reference.capture_target import fit_drafter

        fit_drafter(read_drafter(source.drafter), capture, source.drafter)
        drafter = drafter_with_embeddings(source.drafter, capture, workdir / "drafter")
        folder = export_onnx(drafter, workdir / "onnx")
    export = OnnxExport.open(folder)
    drafter_backend = (OrtChainDrafterBackend if options.chain else OrtDrafterBackend)(export, options.threads)
    meta = export.meta["drafter"]
    ids = meta.get("aux_layer_ids")
    if ids is None:  # exported without a target: the drafter's default taps for the captured target
        from eagle31_export.config import default_aux_layer_ids

        ids = default_aux_layer_ids(capture.target_info.num_hidden_layers)
    if tuple(ids) != capture.aux_layer_ids:
        raise UserError(f"the drafter graphs in {folder} read the outputs of layers {list(ids)}, the capture "
                        f"{capture.folder} holds layers {list(capture.aux_layer_ids)}: if the drafter reads the "
                        "latter, the export has its tapped layers wrong; to run this export, re-capture with "
                        f"--aux-layer-ids {','.join(map(str, ids))}")
    vocab = meta["config"].get("vocab_size")
    if vocab is not None and vocab != capture.vocab_size:
        raise UserError(f"the drafter in {folder} has vocab_size {vocab}, the captured target {capture.vocab_size}")
    return CaptureSpeculator("onnxruntime", CaptureTarget(capture), drafter_backend,
                             exact=export.meta.get("dtype") == "fp32")
