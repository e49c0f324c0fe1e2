"""A small ONNX graph builder: named values, scoped node names, one shared external-weights file.

The exporters write their graphs op by op with this builder instead of tracing a torch module:
the graphs stay exact (every op is the one the reference uses) and readable (node and value
names carry the canonical weight path, e.g. `layers.0.self_attn/q_proj`).

Weights go to ONE external-data file per export, shared by every graph that uses them (the
drafter's first-step, next-step and chain graphs reference the same offsets), appended as they
are added so that memory does not grow with model size: each tensor is converted and written in
pieces of `CHUNK_BYTES`, and the graphs hold only offsets. A graph may also point into another
graph's file in the same folder (the drafter reads the target's embeddings from target.onnx.data).

Matrices are stored in their checkpoint dtype when it is narrower than the compute dtype (a bf16
checkpoint's Linear weights stay bf16) and widened by a Cast node where they are used: bf16 ->
fp32 is exact, so the graph computes what it computed from weights widened at export time, from
half the bytes. Each Cast waits for the activation its weight multiplies (`wait_for`), so
that one widened weight at a time exists; one larger than `GraphBuilder.WIDE_BLOCK_BYTES` (a
128k-vocabulary lm_head) is widened and multiplied by column blocks. Large tensors start at
64 KiB-aligned offsets, which lets ONNX Runtime map them from the file instead of reading them
into its own memory.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 23  # FLOAT4E2M1 DequantizeLinear needs >= 23; ONNX Runtime 1.32 runs up to 28
IR_VERSION = 11  # the lowest IR that carries FLOAT4E2M1; newer readers accept it

# torch dtype -> (ONNX element type, dtype to view the storage as for raw bytes)
_TORCH_TO_ONNX = {
    torch.float32: (TensorProto.FLOAT, torch.float32),
    torch.float16: (TensorProto.FLOAT16, torch.float16),
    torch.bfloat16: (TensorProto.BFLOAT16, torch.int16),
    torch.float64: (TensorProto.DOUBLE, torch.float64),
    torch.int64: (TensorProto.INT64, torch.int64),
    torch.int32: (TensorProto.INT32, torch.int32),
    torch.uint8: (TensorProto.UINT8, torch.uint8),
    torch.bool: (TensorProto.BOOL, torch.uint8),
    torch.float8_e4m3fn: (TensorProto.FLOAT8E4M3FN, torch.uint8),
}


def onnx_elem_type(dtype: torch.dtype) -> int:
    return _TORCH_TO_ONNX[dtype][0]


def storage_dtype(stored: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype a weight is written in: its checkpoint dtype when that is a narrower float than
    the compute dtype (widened in the graph, exactly), else the compute dtype (rounded once here,
    as the graphs always did)."""
    if (stored.is_floating_point and stored in _TORCH_TO_ONNX and compute.is_floating_point
            and stored.itemsize < compute.itemsize):
        return stored
    return compute


# A tensor, or a function that reads it (called only when the tensor is not written yet).
TensorSource = Union[torch.Tensor, Callable[[], torch.Tensor]]


class ExternalWeights:
    """Appends tensors to one external-data file; hands out TensorProtos that point into it.

    Tensors smaller than `inline_below` bytes stay inside the model (external data for a
    handful of bytes only costs a file seek). The same name added twice is stored once.
    """

    ALIGN = 64
    # ONNX Runtime's CPU provider maps an external tensor from the file when its offset is a multiple
    # of the allocation granularity (4 KiB pages; 64 KiB on Windows): onnxruntime's
    # include/onnxruntime/core/graph/model_saving_options.h, which aligns the same way.
    PAGE_ALIGN = 1 << 16
    PAGE_ALIGN_FROM = 1 << 20  # ... which is worth the padding for tensors of 1 MiB and more
    CHUNK_BYTES = 64 << 20  # a tensor is converted and written this many bytes at a time

    def __init__(self, folder: Path, filename: str, inline_below: int = 1024):
        self.folder, self.filename, self.inline_below = Path(folder), filename, inline_below
        self._index: dict[str, tuple[int, list[int], int, int]] = {}
        self._inline: dict[str, TensorProto] = {}
        self._size = 0

    @property
    def path(self) -> Path:
        return self.folder / self.filename

    def stored_elem(self, name: str) -> int | None:
        """The element type `name` was written with, or None when it was not added yet."""
        if name in self._index:
            return self._index[name][0]
        return self._inline[name].data_type if name in self._inline else None

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorProto:
        """`tensor` (converted to `dtype`) under `name`; written piece by piece along its first
        dimension, so a transposed or widened view never exists whole in memory."""
        if name in self._index or name in self._inline:
            return self.ref(name)
        dtype = dtype or tensor.dtype
        elem, view = _TORCH_TO_ONNX[dtype]
        t = tensor.detach()
        nbytes = t.numel() * dtype.itemsize
        if nbytes < self.inline_below:
            return self._keep_inline(name, elem, list(t.shape), _bytes_of(t.to(dtype), view))
        offset = self._start(nbytes)
        rows = t.shape[0] if t.dim() else 1
        step = max(1, self.CHUNK_BYTES // max(nbytes // max(rows, 1), 1))
        with open(self.path, "ab") as f:
            f.write(b"\0" * (offset - self._size))
            if t.dim() == 0:
                f.write(_bytes_of(t.to(dtype), view))
            else:
                for start in range(0, rows, step):
                    piece = t[start:start + step].to(dtype).contiguous()
                    f.write(memoryview(piece.view(view).numpy()).cast("B"))
                    del piece
        return self._record(name, elem, list(t.shape), offset, nbytes)

    def add_raw(self, name: str, elem: int, dims: Sequence[int], data: bytes) -> TensorProto:
        """A tensor from raw bytes (FLOAT4E2M1: two values per byte, even element low nibble)."""
        if name in self._index or name in self._inline:
            return self.ref(name)
        if len(data) < self.inline_below:
            return self._keep_inline(name, elem, list(dims), data)
        offset = self._start(len(data))
        with open(self.path, "ab") as f:
            f.write(b"\0" * (offset - self._size))
            f.write(data)
        return self._record(name, elem, list(dims), offset, len(data))

    def _start(self, nbytes: int) -> int:
        align = self.PAGE_ALIGN if nbytes >= self.PAGE_ALIGN_FROM else self.ALIGN
        return -(-self._size // align) * align

    def _record(self, name: str, elem: int, dims: list[int], offset: int, length: int) -> TensorProto:
        self._size = offset + length
        self._index[name] = (elem, dims, offset, length)
        return self._external(name, elem, dims, offset, length)

    def _keep_inline(self, name: str, elem: int, dims: list[int], data: bytes) -> TensorProto:
        self._inline[name] = helper.make_tensor(name, elem, dims, data, raw=True)
        return self.ref(name)

    def ref(self, name: str) -> TensorProto:
        """The TensorProto of a tensor already added."""
        if name in self._inline:
            t = TensorProto()
            t.CopyFrom(self._inline[name])
            return t
        elem, dims, offset, length = self._index[name]
        return self._external(name, elem, dims, offset, length)

    def _external(self, name: str, elem: int, dims: Sequence[int], offset: int, length: int) -> TensorProto:
        t = TensorProto(name=name, data_type=elem, dims=list(dims))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.filename), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t


def _bytes_of(t: torch.Tensor, view: torch.dtype) -> bytes:
    return t.contiguous().cpu().view(view).numpy().tobytes()


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers of one graph.

    `op()` returns the name(s) of its output value(s). Names are made unique and prefixed with
    the current `scope()`, so a node reads `layers.0.self_attn/MatMul_2` in a graph viewer.
    """

    # Widened weights above this many bytes are multiplied by column blocks (`matmul`): the reference's
    # block too (`reference.upcast.CHUNK_BYTES`). An 8B-class MLP matrix (235 MiB in fp32) is then
    # never widened whole, and an lm_head block with its sliced narrow copy stays under 100 MiB.
    WIDE_BLOCK_BYTES = 64 << 20

    def __init__(self, name: str, weights: ExternalWeights):
        self.name, self.weights = name, weights
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: dict[str, TensorProto] = {}
        self._scope: list[str] = []
        self._used: Counter[str] = Counter()
        self._consts: dict[tuple, str] = {}

    # ---- naming ----------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def fresh(self, hint: str) -> str:
        base = "/".join([*self._scope, hint])
        self._used[base] += 1
        n = self._used[base]
        return base if n == 1 else f"{base}_{n - 1}"

    # ---- graph contents ---------------------------------------------------
    def op(self, op_type: str, *inputs: str, outputs: int | Sequence[str] = 1, domain: str = "",
           name: str | None = None, **attrs) -> str | tuple[str, ...]:
        """Add one node named `name` (default: its op type) in the current scope; its outputs are
        named after it (`node`, or `node:i` for several) unless `outputs` lists explicit names."""
        node_name = self.fresh(name or op_type)
        if isinstance(outputs, int):
            names = [node_name] if outputs == 1 else [f"{node_name}:{i}" for i in range(outputs)]
        else:
            names = list(outputs)
        node = helper.make_node(op_type, list(inputs), names, name=node_name, domain=domain,
                                **{k: v for k, v in attrs.items() if v is not None})
        self.nodes.append(node)
        return names[0] if len(names) == 1 else tuple(names)

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shapes, axes, scalars) as an inline initializer, shared by value."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = f"const/{self._safe(arr)}"
            while name in self.initializers:
                name += "_"
            self.initializers[name] = numpy_helper.from_array(arr, name)
            self._consts[key] = name
        return self._consts[key]

    def tensor(self, name: str, t: torch.Tensor) -> str:
        """A weight: an initializer named `name`, stored externally when large."""
        if name not in self.initializers:
            self.initializers[name] = self.weights.add(name, t)
        return name

    def stored(self, name: str, source: TensorSource, compute: torch.dtype, stored: torch.dtype | None = None,
               store: ExternalWeights | None = None, key: str | None = None) -> tuple[str, bool]:
        """(initializer `name`, whether it needs a Cast to `compute`) for a matrix written in
        `storage_dtype(stored, compute)`; `stored` defaults to the tensor's own dtype.

        `store`/`key`: write it to (or find it in) another graph's weights file under `key`, so
        that two graphs of one export share the bytes. `source` may be a function: it is called
        only when the tensor is not in the file yet."""
        store, key = store or self.weights, key or name
        if name not in self.initializers:
            if store.stored_elem(key) is None:
                t = source() if callable(source) else source
                store.add(key, t, storage_dtype(stored or t.dtype, compute))
            proto = store.ref(key)
            proto.name = name
            self.initializers[name] = proto
        return name, self.initializers[name].data_type != onnx_elem_type(compute)

    def weight(self, name: str, source: TensorSource, compute: torch.dtype, after: str | None = None,
               **where) -> str:
        """A matrix in the compute dtype: the initializer, widened by a Cast of its own when it is
        stored narrower (one Cast per use, so that the wide copy lives only until its consumer).
        `after`: the activation the weight is applied to; the Cast waits for it (`wait_for`)."""
        init, cast = self.stored(name, source, compute, **where)
        if not cast:
            return init
        return self.op("Cast", init if after is None else self.wait_for(init, after), to=onnx_elem_type(compute),
                       name="widen")

    def matmul(self, x: str, name: str, compute: torch.dtype, op_name: str, **where) -> str:
        """`x @ W`, W the [in, out] matrix `name` (arguments as for `weight`); the MatMul is named
        `op_name`, its widening Cast sits in the scope of that name.

        A widened W larger than `WIDE_BLOCK_BYTES` (the lm_head of a 128k vocabulary: 2 GB in fp32)
        is multiplied by blocks of its columns, each sliced, widened and multiplied after the block
        before it, so that one widened block at a time exists; the blocks' products are concatenated.
        """
        init, cast = self.stored(name, compute=compute, **where)
        rows, cols = self.initializers[init].dims
        block = max(1, self.WIDE_BLOCK_BYTES // (rows * compute.itemsize))
        if not cast or cols <= block:
            with self.scope(op_name):
                w = self.weight(name, compute=compute, after=x, **where)
            return self.op("MatMul", x, w, name=op_name)
        products, after = [], x
        with self.scope(op_name):
            for start in range(0, cols, block):
                stop = self.const([min(start + block, cols)])
                part = self.op("Slice", self.wait_for(init, after), self.const([start]), stop, self.const([1]))
                after = self.op("MatMul", x, self.op("Cast", part, to=onnx_elem_type(compute), name="widen"),
                                name="block")
                products.append(after)
        return self.op("Concat", *products, axis=-1, name=op_name)

    def wait_for(self, init: str, value: str) -> str:
        """Initializer `init` unchanged (a Reshape to its own dims, which ONNX Runtime aliases), but
        only once `value` is computed. A node whose inputs are all initializers may run at any time,
        and ONNX Runtime runs them first: every layer's widened (or dequantized) weight would be
        alive at once, a dense copy of the whole model. Depending on the activation, each one is
        made just before its MatMul and freed after it."""
        dims = list(self.initializers[init].dims)
        with self.scope("wait"):
            zero = self.op("Mul", self.op("Shape", value, start=0, end=1), self.const([0]))  # [0], known at run time
            shape = self.op("Add", self.const(dims), zero)
            return self.op("Reshape", init, shape)

    def embedding(self, name: str, source: TensorSource, ids: str, compute: torch.dtype, **where) -> str:
        """Rows of an embedding table for `ids`, in the compute dtype: gathered from the stored
        table, then widened (only the gathered rows, not the table)."""
        init, cast = self.stored(name, source, compute, **where)
        rows = self.op("Gather", init, ids)
        return self.op("Cast", rows, to=onnx_elem_type(compute), name="widen") if cast else rows

    def tensor_raw(self, name: str, elem: int, dims: Sequence[int], data: bytes) -> str:
        if name not in self.initializers:
            self.initializers[name] = self.weights.add_raw(name, elem, dims, data)
        return name

    def input(self, name: str, elem: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def output(self, value: str, name: str, elem: int, shape: Sequence[int | str]) -> None:
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh(f"{name}_out")))
        self.outputs.append(helper.make_tensor_value_info(name, elem, list(shape)))

    def model(self, functions: Sequence[onnx.FunctionProto] = (), doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                  list(self.initializers.values()))
        domains = {f.domain for f in functions}
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, 1) for d in sorted(domains)]
        model = helper.make_model(graph, opset_imports=opsets, functions=list(functions), ir_version=IR_VERSION,
                                  producer_name="eagle31-export", doc_string=doc)
        return model

    @staticmethod
    def _safe(arr: np.ndarray) -> str:
        flat = arr.reshape(-1)
        text = "_".join(str(x) for x in flat[:6]) + ("_etc" if flat.size > 6 else "")
        return f"{arr.dtype.name}_{text}".replace("-", "m").replace(".", "p") or "empty"


def io_description(model: onnx.ModelProto) -> dict:
    """Names, element types and (symbolic) shapes of a graph's inputs and outputs, as JSON."""

    def describe(values) -> list[dict]:
        out = []
        for v in values:
            tt = v.type.tensor_type
            dims = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tt.shape.dim]
            out.append({"name": v.name, "dtype": TensorProto.DataType.Name(tt.elem_type).lower(), "shape": dims})
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}
