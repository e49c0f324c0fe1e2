"""A small ONNX graph builder: named values, scoped node names, one shared external-weights file.

The exporters write their graphs op by op with this builder instead of tracing a torch module:
the graphs stay exact (every op is the one the reference uses) and readable (node and value
names carry the canonical weight path, e.g. `layers.0.self_attn/q_proj`).

Weights go to ONE external-data file per export, shared by every graph that uses them (the
drafter's first-step, next-step and chain graphs reference the same offsets), appended as they
are added so that memory does not grow with model size.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

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


def raw_bytes(t: torch.Tensor) -> tuple[int, list[int], bytes]:
    """(ONNX element type, dims, little-endian raw data) of a CPU tensor."""
    elem, view = _TORCH_TO_ONNX[t.dtype]
    data = t.detach().contiguous().cpu().view(view).numpy().tobytes()
    return elem, list(t.shape), data


class ExternalWeights:
    """Appends tensors to one external-data file; hands out TensorProtos that point into it.

    Tensors smaller than `inline_below` bytes stay inside the model (external data for a
    handful of bytes only costs a file seek). The same name added twice is stored once.
    """

    ALIGN = 64

    def __init__(self, folder: Path, filename: str, inline_below: int = 1024):
        self.folder, self.filename, self.inline_below = Path(folder), filename, inline_below
        self._index: dict[str, tuple[int, list[int], int, int]] = {}
        self._size = 0

    @property
    def path(self) -> Path:
        return self.folder / self.filename

    def add(self, name: str, tensor: torch.Tensor) -> TensorProto:
        elem, dims, data = raw_bytes(tensor)
        return self.add_raw(name, elem, dims, data)

    def add_raw(self, name: str, elem: int, dims: Sequence[int], data: bytes) -> TensorProto:
        """A tensor from raw bytes (FLOAT4E2M1: two values per byte, even element low nibble)."""
        if name in self._index:
            elem, dims, offset, length = self._index[name]
            return self._external(name, elem, dims, offset, length)
        if len(data) < self.inline_below:
            return helper.make_tensor(name, elem, list(dims), data, raw=True)
        offset = -(-self._size // self.ALIGN) * self.ALIGN
        with open(self.path, "ab") as f:
            f.write(b"\0" * (offset - self._size))
            f.write(data)
        self._size = offset + len(data)
        self._index[name] = (elem, list(dims), offset, len(data))
        return self._external(name, elem, dims, offset, len(data))

    def _external(self, name: str, elem: int, dims: Sequence[int], offset: int, length: int) -> TensorProto:
        t = TensorProto(name=name, data_type=elem, dims=list(dims))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.filename), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers of one graph.

    `op()` returns the name(s) of its output value(s). Names are made unique and prefixed with
    the current `scope()`, so a node reads `layers.0.self_attn/MatMul_2` in a graph viewer.
    """

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
