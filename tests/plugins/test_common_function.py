"""make_node and attach_functions: validation, defaults and the errors a user sees."""

from __future__ import annotations

import pytest
from onnx import AttributeProto, TensorProto, helper

from trtopt.errors import BuildError
from trtopt.plugins import FUNCTION_BUILDERS, OP_SCHEMAS, attach_functions, make_node

PAGED_INPUTS = ["q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping"]
PAGED_ATTRS = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.5)


def model_with(node, *, opset: int = 18, input_shapes: dict | None = None):
    vi = helper.make_tensor_value_info
    shapes = input_shapes or {}
    names = [n for n in node.input if n]
    graph = helper.make_graph([node], "g", [vi(n, TensorProto.FLOAT, shapes.get(n)) for n in names],
                              [vi(o, TensorProto.FLOAT, None) for o in node.output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def raw_node(op_type="PagedAttention", inputs=PAGED_INPUTS, outputs=("out", "kv_out"), **attrs):
    """A node built by hand (as a foreign tool would), bypassing make_node's checks."""
    return helper.make_node(op_type, list(inputs), list(outputs), name="n", domain="trtopt", **attrs)


def test_registries_agree():
    assert set(OP_SCHEMAS) == set(FUNCTION_BUILDERS) >= {"PagedAttention", "FlashAttention"}
    for op_type, schema in OP_SCHEMAS.items():
        assert schema.op_type == op_type
        for opset in (17, 23):
            function = FUNCTION_BUILDERS[op_type](opset)
            assert (function.domain, function.name) == ("trtopt", op_type), "one function per op, named after it"
            assert list(function.input) == list(schema.inputs) and list(function.output) == list(schema.outputs)


def test_make_node_fills_defaults_coerces_types_and_sets_namespace():
    node = make_node("PagedAttention", PAGED_INPUTS, ["out", "kv_out"], name="attn", num_heads=4, num_kv_heads=2,
                     head_dim=8, scale=1)  # an int scale must still become a FLOAT attribute
    attrs = {a.name: a for a in node.attribute}
    assert node.domain == "trtopt" and node.name == "attn"
    assert attrs["scale"].type == AttributeProto.FLOAT and attrs["scale"].f == 1.0
    assert attrs["causal"].i == 1 and attrs["sliding_window"].i == 0
    assert attrs["plugin_namespace"].s == b"trtopt"


def test_make_node_rejects_unknown_attributes():
    with pytest.raises(BuildError, match="no attribute"):
        make_node("PagedAttention", PAGED_INPUTS, ["out", "kv_out"], window=3, **PAGED_ATTRS)


def test_attach_fills_what_a_foreign_node_lacks():
    node = raw_node(**PAGED_ATTRS)  # no causal, sliding_window, plugin_namespace; alibi left off
    model = attach_functions(model_with(node))
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    assert attrs["causal"] == 1 and attrs["sliding_window"] == 0 and attrs["plugin_namespace"] == b"trtopt"
    assert len(model.graph.node[0].input) == 9


def test_attach_rejects_old_opsets():
    with pytest.raises(BuildError, match="opset 16.*version_converter"):
        attach_functions(model_with(raw_node(**PAGED_ATTRS), opset=16))


def test_attach_rejects_unknown_ops_and_missing_attributes():
    with pytest.raises(BuildError, match="unknown trtopt op 'RotaryEmbedding'"):
        attach_functions(model_with(raw_node("RotaryEmbedding", ["x"], ["y"])))
    with pytest.raises(BuildError, match="needs attribute 'scale'"):
        attach_functions(model_with(raw_node(num_heads=4, num_kv_heads=2, head_dim=8)))
    with pytest.raises(BuildError, match="input 'k' is required|takes inputs"):
        attach_functions(model_with(raw_node(inputs=["q", ""] + PAGED_INPUTS[2:], **PAGED_ATTRS)))


def test_attach_checks_declared_shapes_against_attributes():
    shapes = {"q": [1, 4, "T", 8], "k": [1, 2, "T", 8], "v": [1, 2, "T", 8], "kv_cache": ["N", 2, 2, 16, 8],
              "block_tables": ["S", "M"], "seq_lens": ["S"], "query_start_loc": ["S1"], "slot_mapping": ["T"]}
    attach_functions(model_with(raw_node(**PAGED_ATTRS), input_shapes=shapes))  # consistent: fine
    bad = dict(shapes, kv_cache=["N", 2, 3, 16, 8])
    with pytest.raises(BuildError, match="kv_cache's head count is 3 but should be 2"):
        attach_functions(model_with(raw_node(**PAGED_ATTRS), input_shapes=bad))


def test_shape_inference_is_symbolic():
    infer = OP_SCHEMAS["PagedAttention"].infer_shapes
    q, kv = (1, 4, "T", 8), ("N", 2, 2, 16, 8)
    shapes = [q, (1, 2, "T", 8), (1, 2, "T", 8), kv, ("S", "M"), ("S",), ("S1",), ("T",), (4,)]
    assert infer(shapes, {**PAGED_ATTRS}) == [q, kv]
    flash = OP_SCHEMAS["FlashAttention"].infer_shapes
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=8)
    assert flash([("B", 4, "S", 8), ("B", 2, "Sk", 8), ("B", 2, "Sk", 8), ("B", 1, 1, "Sk")], attrs) == [
        ("B", 4, "S", 8)]
    with pytest.raises(BuildError, match="attn_bias dim 1"):
        flash([(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), (2, 3, 1, 7)], attrs)
    with pytest.raises(BuildError, match="multiple of num_kv_heads"):
        flash([(2, 6, 5, 8)] * 3 + [None], dict(num_heads=6, num_kv_heads=4, head_dim=8))
