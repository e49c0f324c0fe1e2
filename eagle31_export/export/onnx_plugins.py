"""The two EAGLE 3.1 plugin nodes and their model-local function fallbacks.

Each fused op appears in a graph as ONE node in the custom domain `eagle31`, carrying the string
attributes `plugin_namespace` / `plugin_version`
(docs/runtimes.md#tensorrt-onnx-parser-plugin-or-local-function). The same model holds a
FunctionProto of the same domain and name built from standard ops, so:

- TensorRT's ONNX parser maps the node to the registered IPluginV3 plugin whose name equals the
  op_type (and falls back to the function where the plugin is not registered);
- ONNX Runtime, which knows no such op, inlines and runs the function.

The semantics are `reference.ops.fc_norm_fusion` / `post_norm_feedback`; the plugin's C ABI is
`plugins/include/eagle31_kernels.h`; input order and attribute names below are the TensorRT plugins'
(`plugins/src/tensorrt/*_plugin.cpp`): FcNorm takes source_0..source_{k-1}, then the folded weight
[H, k*Ht], fields num_sources / eps / has_norm; PostNormFeedback takes residual, update,
norm_weight, fields eps / norm_output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from onnx import AttributeProto, FunctionProto, TensorProto, helper

from eagle31_export.export.onnx_graph import OPSET, GraphBuilder

DOMAIN = "eagle31"
PLUGIN_NAMESPACE = "eagle31"
PLUGIN_VERSION = "1"


@dataclass(frozen=True)
class PluginSpec:
    name: str
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]  # besides plugin_namespace / plugin_version


FC_NORM = PluginSpec("Eagle31FcNorm", ("output",), ("num_sources", "eps", "has_norm"))
POST_NORM_FEEDBACK = PluginSpec("Eagle31PostNormFeedback", ("normed", "fed_back"), ("eps", "norm_output"))
PLUGINS = {p.name: p for p in (FC_NORM, POST_NORM_FEEDBACK)}


def _plugin_node(g: GraphBuilder, spec: PluginSpec, inputs: Sequence[str], **attrs) -> str | tuple[str, ...]:
    return g.op(spec.name, *inputs, outputs=len(spec.outputs), domain=DOMAIN,
                plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION, **attrs)


def fc_norm(g: GraphBuilder, sources: Sequence[str], folded_weight: str, eps: float, has_norm: bool) -> str:
    """Eagle31FcNorm(source_0, ..., source_{k-1}, weight [H, k*Ht]) -> [.., H]."""
    return _plugin_node(g, FC_NORM, [*sources, folded_weight], num_sources=len(sources), eps=float(eps),
                        has_norm=int(has_norm))


def post_norm_feedback(g: GraphBuilder, residual: str, update: str, norm_weight: str, eps: float,
                       norm_output: bool) -> tuple[str, str]:
    """Eagle31PostNormFeedback(residual, update, norm_weight) -> (normed, fed_back)."""
    return _plugin_node(g, POST_NORM_FEEDBACK, [residual, update, norm_weight], eps=float(eps),
                        norm_output=int(norm_output))


# ---- the model-local functions (standard ops only) ------------------------------------------

def _ref(name: str, attr_name: str, kind: int) -> AttributeProto:
    return helper.make_attribute_ref(name, kind, ref_attr_name=attr_name)


def _const_from_attr(out: str, value_kind: str, attr_name: str, kind: int):
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(_ref(value_kind, attr_name, kind))
    return node


def _inverse_rms(x_f: str, prefix: str) -> list:
    """Nodes computing `{prefix}inv` = 1/sqrt(mean(x_f^2, -1) + eps) in fp32 (eps, axes defined by caller)."""
    return [
        helper.make_node("Mul", [x_f, x_f], [f"{prefix}sq"]),
        helper.make_node("ReduceMean", [f"{prefix}sq", "axes"], [f"{prefix}ms"], keepdims=1),
        helper.make_node("Add", [f"{prefix}ms", "eps"], [f"{prefix}var"]),
        helper.make_node("Sqrt", [f"{prefix}var"], [f"{prefix}rms"]),
        helper.make_node("Reciprocal", [f"{prefix}rms"], [f"{prefix}inv"]),
    ]


def _common_constants() -> list:
    return [
        _const_from_attr("eps", "value_float", "eps", AttributeProto.FLOAT),
        helper.make_node("Constant", [], ["axes"], value_ints=[-1]),
    ]


def fc_norm_function(num_sources: int) -> FunctionProto:
    """Per source: RMSNorm without weight (computed in fp32, rounded back to the input type), then
    concat and one MatMul with the folded weight; `has_norm` 0 makes every scale 1 (plain fc)."""
    nodes = _common_constants() + [
        _const_from_attr("has_norm_i", "value_int", "has_norm", AttributeProto.INT),
        helper.make_node("Cast", ["has_norm_i"], ["has_norm_b"], to=TensorProto.BOOL),
        helper.make_node("Constant", [], ["one"], value_float=1.0),
    ]
    normed = []
    for i in range(num_sources):
        p = f"s{i}_"
        nodes += [helper.make_node("Cast", [f"source_{i}"], [f"{p}f"], to=TensorProto.FLOAT)]
        nodes += _inverse_rms(f"{p}f", p)
        nodes += [
            helper.make_node("Where", ["has_norm_b", f"{p}inv", "one"], [f"{p}scale"]),
            helper.make_node("Mul", [f"{p}f", f"{p}scale"], [f"{p}scaled"]),
            helper.make_node("CastLike", [f"{p}scaled", f"source_{i}"], [f"{p}normed"]),
        ]
        normed.append(f"{p}normed")
    nodes += [
        helper.make_node("Concat", normed, ["concat"], axis=-1),
        helper.make_node("Transpose", ["weight"], ["weight_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["concat", "weight_t"], ["output"]),
    ]
    inputs = [f"source_{i}" for i in range(num_sources)] + ["weight"]
    return helper.make_function(DOMAIN, FC_NORM.name, inputs, list(FC_NORM.outputs), nodes,
                                [helper.make_opsetid("", OPSET)], attributes=list(FC_NORM.attributes),
                                doc_string="Eagle31FcNorm: per-source RMSNorm (weights folded into `weight`), "
                                           "concat, fc. Fallback for the TensorRT plugin of the same name.")


def post_norm_feedback_function() -> FunctionProto:
    """h = residual + update; normed = w * RMSNorm(h); fed_back = normed if norm_output else h."""
    nodes = _common_constants() + [
        _const_from_attr("norm_output_i", "value_int", "norm_output", AttributeProto.INT),
        helper.make_node("Cast", ["norm_output_i"], ["norm_output_b"], to=TensorProto.BOOL),
        helper.make_node("Add", ["residual", "update"], ["hidden"]),
        helper.make_node("Cast", ["hidden"], ["hidden_f"], to=TensorProto.FLOAT),
    ]
    nodes += _inverse_rms("hidden_f", "h_")
    nodes += [
        helper.make_node("Mul", ["hidden_f", "h_inv"], ["scaled"]),
        helper.make_node("CastLike", ["scaled", "hidden"], ["scaled_t"]),
        helper.make_node("Mul", ["norm_weight", "scaled_t"], ["normed"]),
        helper.make_node("Where", ["norm_output_b", "normed", "hidden"], ["fed_back"]),
    ]
    return helper.make_function(DOMAIN, POST_NORM_FEEDBACK.name, ["residual", "update", "norm_weight"],
                                list(POST_NORM_FEEDBACK.outputs), nodes, [helper.make_opsetid("", OPSET)],
                                attributes=list(POST_NORM_FEEDBACK.attributes),
                                doc_string="Eagle31PostNormFeedback: residual add + final RMSNorm; returns "
                                           "(normed, fed-back state). Fallback for the TensorRT plugin.")


def plugin_functions(g: GraphBuilder) -> list[FunctionProto]:
    """The local functions for every plugin node the graph uses (one FunctionProto per op_type)."""
    used = {n.op_type: n for n in g.nodes if n.domain == DOMAIN}
    functions = []
    if FC_NORM.name in used:
        functions.append(fc_norm_function(len(used[FC_NORM.name].input) - 1))
    if POST_NORM_FEEDBACK.name in used:
        functions.append(post_norm_feedback_function())
    return functions
