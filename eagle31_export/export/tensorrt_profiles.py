"""Optimization profiles for TensorRT engines, sized from the export and the user's serving limits,
and the activation memory each profile needs at its largest shape.

Every dynamic input dimension of our graphs is named (`onnx_graph` writes `dim_param`s):

    batch             sequences served together (1 .. --max-batch)
    sequence          new tokens of one call
    past_sequence     cached positions before the call; 0 for an empty cache (the first call)
    present_sequence  past_sequence + sequence (the cache after the call, an attention mask over it)

A name may also be a sum of these (`past_sequence + sequence`). A graph with an input dimension
of any other name is refused: the profile could not be sized from the model.

Each graph gets the profiles the speculation loop needs (reference/speculate.py):

- `prefill` (target, drafter_first, drafter_chain): a whole prompt on an empty cache,
  sequence 1 .. --max-seq-len, past_sequence 0;
- `decode`: the calls of a round on a filled cache: the target verifies depth + 1 tokens,
  drafter_first / drafter_chain take the accepted tokens (at most depth + 1), drafter_next one
  token; past_sequence 0 .. --max-seq-len - 1.

Two profiles instead of one: TensorRT sizes an execution context for the largest shape of its
profile, and a single profile allowing a whole prompt on a full cache would size every
attention for `max_seq_len x 2 max_seq_len` scores.

The activation estimate runs ONNX shape inference with the profile's largest dims and walks the
graph in order, holding each value from the node that makes it to its last consumer, like an
executor without fusion; values computed from initializers alone count as weights (TensorRT folds
them at build time). TensorRT fuses and reuses memory, so its own figure is usually lower (fused
attention never writes the scores); the estimate is a bound to refuse on, not a prediction.

Values shape inference does not size fully are counted as follows, and the plan says which case holds:

- a value it gives no shape (a custom op's output, and what is computed from it) counts 0 bytes, so
  the estimate is then a LOWER bound; values with unresolved dimensions then count 0 bytes too, so
  that the figure stays a lower bound. If no computed value is sized at all there is no estimate,
  and `export engine` refuses the build;
- where every value has a shape but some dimensions are unresolved (a length computed at run time),
  those dimensions are taken as the profile's longest cache (past_sequence + sequence at their
  largest): an estimate, not a bound in either direction (nothing here proves such a length stays
  within the cache), and the plan says how many values were sized that way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, shape_inference

from eagle31_export.errors import UserError

BATCH, SEQUENCE, PAST, PRESENT = "batch", "sequence", "past_sequence", "present_sequence"
KNOWN_DIMS = (BATCH, SEQUENCE, PAST, PRESENT)
GIB = float(1 << 30)

# Bytes per element of the ONNX types our graphs hold (FLOAT4E2M1: two per byte).
_ELEM_BYTES = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.DOUBLE: 8,
               TensorProto.INT64: 8, TensorProto.INT32: 4, TensorProto.INT8: 1, TensorProto.UINT8: 1,
               TensorProto.BOOL: 1, TensorProto.FLOAT8E4M3FN: 1, TensorProto.FLOAT4E2M1: 0.5}


DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_DRAFT_DEPTH = 4


@dataclass(frozen=True)
class ServingLimits:
    max_batch: int = 1
    max_seq_len: int | None = None  # prompt plus generated tokens, per sequence (None: `for_export`)
    draft_depth: int | None = None  # drafted tokens per round (None: `for_export`)

    def for_export(self, max_positions: int | None, chain_depth: int | None) -> "ServingLimits":
        """The limits with what was left out taken from the export: --max-seq-len 4096, or the rope
        tables' rows when fewer; --draft-depth the chain graph's depth, else 4."""
        seq = self.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, max_positions or DEFAULT_MAX_SEQ_LEN)
        return replace(self, max_seq_len=seq, draft_depth=self.draft_depth or chain_depth or DEFAULT_DRAFT_DEPTH)

    def validate(self, max_positions: int | None) -> None:
        for name, value in (("--max-batch", self.max_batch), ("--max-seq-len", self.max_seq_len),
                            ("--draft-depth", self.draft_depth)):
            if value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        if self.draft_depth + 1 > self.max_seq_len:
            raise UserError(f"--draft-depth {self.draft_depth} needs --max-seq-len >= {self.draft_depth + 1}")
        if max_positions is not None and self.max_seq_len > max_positions:
            raise UserError(f"--max-seq-len {self.max_seq_len} exceeds the {max_positions} positions the graphs' "
                            "rope tables hold; lower it, or re-export with `export onnx --max-positions`")


@dataclass(frozen=True)
class DimRange:
    min: int
    opt: int
    max: int

    def __add__(self, other: "DimRange") -> "DimRange":
        return DimRange(self.min + other.min, self.opt + other.opt, self.max + other.max)

    def text(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}..{self.opt}..{self.max}"


@dataclass
class Profile:
    name: str
    dims: dict[str, DimRange]  # batch / sequence / past_sequence
    shapes: dict[str, tuple[list[int], list[int], list[int]]] = field(default_factory=dict)  # input -> min/opt/max
    activation_bytes: float = 0.0
    largest: str = ""  # the largest single value at the max shape, in words
    shapeless: int = 0  # computed values shape inference gave no shape (counted 0 bytes)
    unresolved: int = 0  # computed values with dimensions it left unresolved (module docstring)
    unknown_dim: int = 0  # what an unresolved dimension is taken as when no value is shapeless
    counted: int = 0  # computed values whose bytes the estimate counts
    first_unsized: str = ""  # the first value counted 0 bytes, in words

    def summary(self) -> str:
        dims = ", ".join(f"{k} {v.text()}" for k, v in self.dims.items())
        return f"{self.name} ({dims})"

    @property
    def lower_bound(self) -> bool:
        """Some values count 0 bytes: the true figure is at least the estimate."""
        return self.shapeless > 0

    @property
    def unsized(self) -> int:
        """Values the estimate counts as 0 bytes."""
        return self.shapeless + self.unresolved if self.shapeless else 0

    @property
    def sizeless(self) -> bool:
        """No value the graph computes could be sized: there is no estimate."""
        return self.unsized > 0 and self.counted == 0

    def bound(self) -> str:
        """What kind of figure `activation_bytes` is, in words ("" when every value is sized)."""
        if self.lower_bound:
            detail = (f"{self.shapeless} without a shape from shape inference, {self.unresolved} with "
                      "dimensions it left unresolved; " if self.unresolved else "no shape from shape inference; ")
            return (f"lower bound: {values(self.unsized)} unsized, counted as 0 bytes ({detail}"
                    f"first {self.first_unsized})")
        if self.unresolved:
            return (f"an estimate, not a bound: {values(self.unresolved)} with dimensions shape inference left "
                    f"unresolved, sized at {self.unknown_dim} positions, the longest cache")
        return ""


def values(count: int) -> str:
    return f"{count} value" + ("" if count == 1 else "s")


@dataclass
class GraphPlan:
    file: str
    role: str  # target | drafter_first | drafter_next | drafter_chain
    profiles: list[Profile]
    weight_bytes: float

    @property
    def activation_bytes(self) -> float:
        return max((p.activation_bytes for p in self.profiles), default=0.0)

    @property
    def worst(self) -> Profile | None:
        """The profile with the largest activation estimate."""
        return max(self.profiles, key=lambda p: p.activation_bytes, default=None)


def role_dims(role: str, limits: ServingLimits) -> list[tuple[str, dict[str, DimRange]]]:
    """The named profiles of one graph role (module docstring)."""
    s, d, b = limits.max_seq_len, limits.draft_depth, limits.max_batch
    batch = DimRange(1, b, b)
    decode_tokens = DimRange(1, 1, 1) if role == "drafter_next" else DimRange(1, min(d + 1, s), min(d + 1, s))
    decode = ("decode", {BATCH: batch, SEQUENCE: decode_tokens, PAST: DimRange(0, s // 2, s - 1)})
    if role == "drafter_next":
        return [decode]
    prefill = ("prefill", {BATCH: DimRange(1, 1, b), SEQUENCE: DimRange(1, min(s, 512), s), PAST: DimRange(0, 0, 0)})
    return [prefill, decode]


def dim_range(dim_name: str, dims: dict[str, DimRange], graph: str, tensor: str) -> DimRange:
    """The range of a named dimension: a known name, or a sum of known names."""
    terms = [t.strip() for t in re.split(r"\+", dim_name)]
    ranges = []
    for term in terms:
        if term == PRESENT:
            ranges.append(dims[PAST] + dims[SEQUENCE])
        elif term in dims:
            ranges.append(dims[term])
        else:
            raise UserError(f"{graph}: input {tensor} has a dimension named {dim_name!r}; the engine profile knows "
                            f"{', '.join(KNOWN_DIMS)} (or sums of them): re-export with `eagle31-export export onnx`")
    total = ranges[0]
    for r in ranges[1:]:
        total = total + r
    return total


def input_shapes(model: onnx.ModelProto, dims: dict[str, DimRange], graph: str) -> dict[str, tuple[list, list, list]]:
    """min/opt/max shape of every dynamic input of `model` under `dims`."""
    initializers = {t.name for t in model.graph.initializer}
    shapes = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        fixed, ranges = [], []
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                ranges.append(DimRange(d.dim_value, d.dim_value, d.dim_value))
            elif d.dim_param:
                ranges.append(dim_range(d.dim_param, dims, graph, value.name))
            else:
                raise UserError(f"{graph}: input {value.name} has an unnamed dynamic dimension; re-export with "
                                "`eagle31-export export onnx`")
            fixed.append(d.HasField("dim_value"))
        if not all(fixed):
            shapes[value.name] = ([r.min for r in ranges], [r.opt for r in ranges], [r.max for r in ranges])
    return shapes


def weight_bytes(model: onnx.ModelProto) -> float:
    total = 0.0
    for t in model.graph.initializer:
        length = next((int(e.value) for e in t.external_data if e.key == "length"), None)
        total += length if length is not None else len(t.raw_data) or _count(t.dims) * _ELEM_BYTES.get(t.data_type, 4)
    return total


class Estimate(NamedTuple):
    peak: float  # bytes of live values at the worst point of the graph
    largest: str  # the largest value, in words
    shapeless: int  # computed values without an inferred shape (counted 0 bytes)
    unresolved: int  # computed values with unresolved dimensions
    counted: int  # computed values whose bytes are counted
    first_unsized: str  # the first value counted 0 bytes, in words


def activation_estimate(model: onnx.ModelProto, shapes: dict[str, list[int]], unknown_dim: int) -> Estimate:
    """The peak bytes of live values with the graph inputs at `shapes`, and how fully they were sized
    (module docstring): a value shape inference gives no shape counts 0 bytes; a dimension it leaves
    unresolved counts as `unknown_dim` (in our graphs only cache lengths computed at run time are),
    unless some value has no shape, when those values count 0 bytes too (the peak is then a lower
    bound)."""
    concrete = onnx.ModelProto()
    concrete.CopyFrom(model)
    _standard_stand_ins(concrete.graph)
    for value in concrete.graph.input:
        if value.name in shapes:
            for d, n in zip(value.type.tensor_type.shape.dim, shapes[value.name]):
                d.Clear()
                d.dim_value = n
    inferred = shape_inference.infer_shapes(concrete, data_prop=True)
    g = inferred.graph
    sizes: dict[str, float] = {}
    described: dict[str, str] = {}
    guessed: set[str] = set()
    for value in [*g.input, *g.value_info, *g.output]:
        t = value.type.tensor_type
        if not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else unknown_dim for d in t.shape.dim]
        if not all(d.HasField("dim_value") for d in t.shape.dim):
            guessed.add(value.name)
        sizes[value.name] = _count(dims) * _ELEM_BYTES.get(t.elem_type, 4)
        described[value.name] = f"{value.name} {dims} {TensorProto.DataType.Name(t.elem_type).lower()}"
    constant = {t.name for t in g.initializer}
    for node in g.node:
        if all(not i or i in constant for i in node.input):
            constant.update(node.output)
    made_by = {name: (f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type)
               for node in g.node for name in node.output if name}
    computed = [v.name for v in g.input if v.name not in constant]
    computed += [name for node in g.node for name in node.output if name and name not in constant]
    shapeless = [name for name in computed if name not in sizes]
    unresolved = [name for name in computed if name in guessed]
    if shapeless:  # a lower bound: values sized with a guessed dimension count 0 bytes too
        for name in unresolved:
            sizes.pop(name, None)
    last_use = {}
    for index, node in enumerate(g.node):
        for name in node.input:
            last_use[name] = index
    for value in g.output:
        last_use[value.name] = len(g.node)
    live = {v.name: sizes.get(v.name, 0.0) for v in g.input if v.name not in constant}
    peak = sum(live.values())
    for index, node in enumerate(g.node):
        for name in node.output:
            if name and name not in constant:
                live[name] = sizes.get(name, 0.0)
        peak = max(peak, sum(live.values()))
        for name in [*node.input, *node.output]:
            if last_use.get(name, index) == index:  # consumed for the last time here, or never consumed
                live.pop(name, None)
    activations = {n: sizes[n] for n in computed if n in sizes}
    biggest = max(activations, key=activations.get) if activations else ""
    first = next((n for n in computed if n not in sizes), "")
    first_words = f"{first}, made by {made_by[first]}" if first in made_by else first
    made = sum(1 for n in activations if n in made_by)  # graph inputs are sized by the profile, not computed
    return Estimate(peak, f"{described[biggest]} = {gib(activations[biggest])}" if biggest else "",
                    len(shapeless), len(unresolved), made, first_words)


def _standard_stand_ins(g: onnx.GraphProto) -> None:
    """Shape inference knows no `trt::TRT_FP4DynamicQuantize` (onnx_w4a4): for the estimate only, its
    outputs become standard ops of the same shapes and types: a Cast of its input to FP4, and every
    16th element along the blocked axis cast to FP8 for the block scales."""
    if not any(n.op_type == "TRT_FP4DynamicQuantize" for n in g.node):
        return
    helper = onnx.helper
    for name, value in (("estimate/start", 0), ("estimate/end", 2**62), ("estimate/axis", -1), ("estimate/step", 16)):
        g.initializer.append(onnx.numpy_helper.from_array(np.array([value], np.int64), name))
    nodes = []
    for node in g.node:  # a new list in graph order: each stand-in stays where its node was
        if node.op_type != "TRT_FP4DynamicQuantize":
            nodes.append(node)
            continue
        x, (values, scales) = node.input[0], node.output
        nodes += [helper.make_node("Cast", [x], [values], to=TensorProto.FLOAT4E2M1),
                  helper.make_node("Slice", [x, "estimate/start", "estimate/end", "estimate/axis", "estimate/step"],
                                   [f"{scales}/every_16th"]),
                  helper.make_node("Cast", [f"{scales}/every_16th"], [scales], to=TensorProto.FLOAT8E4M3FN)]
    del g.node[:]
    g.node.extend(nodes)


def plan_graph(path: Path, role: str, limits: ServingLimits) -> GraphPlan:
    model = onnx.load(str(path), load_external_data=False)
    profiles = []
    for name, dims in role_dims(role, limits):
        shapes = input_shapes(model, dims, path.name)
        profile = Profile(name, dims, shapes)
        largest = {n: s[2] for n, s in shapes.items()}
        unknown = dims[PAST].max + dims[SEQUENCE].max
        estimate = activation_estimate(model, largest, unknown)
        profile.activation_bytes, profile.largest = estimate.peak, estimate.largest
        profile.shapeless, profile.unresolved, profile.counted = estimate.shapeless, estimate.unresolved, estimate.counted
        profile.unknown_dim, profile.first_unsized = unknown, estimate.first_unsized
        profiles.append(profile)
    return GraphPlan(path.name, role, profiles, weight_bytes(model))


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / (1 << 20):.2f} MiB"


def _count(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n
