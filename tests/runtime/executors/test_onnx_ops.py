"""Every op of the torch converter against onnxruntime, one-node models, including the corner cases of the spec."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper

from trtopt.runtime.executors.onnx_to_torch import UnsupportedOpError, onnx_to_torch

NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
              np.dtype(np.bool_): TensorProto.BOOL}


def one_node(op: str, inputs: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None, *,
             n_out: int = 1, opset: int = 18, domain: str = "", **attrs) -> onnx.ModelProto:
    """A model with one node. `inputs` are graph inputs (dims symbolic), then `consts` (initializers)."""
    consts = consts or {}
    node = helper.make_node(op, list(inputs) + list(consts), [f"y{i}" for i in range(n_out)], domain=domain, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, NP_TO_ONNX[a.dtype], [f"{n}_{d}" for d in range(a.ndim)])
                    for n, a in inputs.items()]
    inits = [numpy_helper.from_array(a, n) for n, a in consts.items()]
    outputs = [onnx.ValueInfoProto(name=f"y{i}") for i in range(n_out)]  # untyped: ORT infers them
    graph = helper.make_graph([node], "g", graph_inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run_both(model: onnx.ModelProto, inputs: dict[str, np.ndarray], tmp_path) -> tuple[list, list]:
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)
    converted = onnx_to_torch(path)
    with torch.inference_mode():
        got = converted.module(*[torch.from_numpy(inputs[n]) for n in converted.input_names])
    return expected, [g.numpy() for g in got]


def check(model, inputs, tmp_path, atol=1e-6):
    expected, got = run_both(model, inputs, tmp_path)
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert e.shape == g.shape and e.dtype == g.dtype, (e.shape, g.shape, e.dtype, g.dtype)
        np.testing.assert_allclose(g, e, atol=atol, rtol=1e-5)


rng = np.random.default_rng(0)


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def ints(*values):
    return np.array(values, dtype=np.int64)


# (op, runtime inputs, constant inputs, attributes, opset)
CASES = [
    ("Add", {"a": randn(2, 3), "b": randn(3)}, {}, {}, 18),
    ("Div", {"a": ints(7, -7, 9), "b": ints(2, 2, -4)}, {}, {}, 18),  # integer division truncates
    ("Pow", {"a": randn(4)}, {"b": np.array(2.0, np.float32)}, {}, 18),
    ("Pow", {"a": np.abs(randn(4))}, {"b": np.array(0.5, np.float32)}, {}, 18),
    ("Where", {"c": np.array([True, False, True]), "x": randn(3), "y": randn(2, 3)}, {}, {}, 18),
    ("Max", {"a": randn(2, 3), "b": randn(3), "c": randn(1, 3)}, {}, {}, 18),
    ("Reshape", {"x": randn(2, 3, 4)}, {"s": ints(0, -1)}, {}, 18),
    ("Reshape", {"x": randn(2, 3, 4), "s": ints(4, 0, -1)}, {}, {}, 18),  # runtime shape
    ("Transpose", {"x": randn(2, 3, 4)}, {}, {"perm": [1, 2, 0]}, 18),
    ("Transpose", {"x": randn(2, 3, 4)}, {}, {}, 18),
    ("Flatten", {"x": randn(2, 3, 4)}, {}, {"axis": 2}, 18),
    ("Squeeze", {"x": randn(1, 3, 1)}, {"axes": ints(-1)}, {}, 18),
    ("Squeeze", {"x": randn(1, 3, 1)}, {}, {}, 18),
    ("Unsqueeze", {"x": randn(3, 4)}, {"axes": ints(0, -1)}, {}, 18),
    ("Concat", {"a": randn(2, 3), "b": randn(2, 1)}, {}, {"axis": -1}, 18),
    ("Gather", {"x": randn(5, 3), "i": ints(-1, 0, 4).reshape(3, 1)}, {}, {"axis": 0}, 18),
    ("Gather", {"x": randn(5, 3)}, {"i": np.array(-2, np.int64)}, {"axis": 0}, 18),  # scalar index drops the axis
    ("Gather", {"x": randn(5, 3)}, {"i": ints(2, -3)}, {"axis": 1}, 18),
    ("GatherElements", {"x": randn(3, 4), "i": ints(0, -1, 2, 1, 3, 0).reshape(3, 2)}, {}, {"axis": 1}, 18),
    ("GatherND", {"x": randn(2, 3, 4), "i": ints(1, 2, 0, -1).reshape(2, 2)}, {}, {}, 18),
    ("GatherND", {"x": randn(2, 3, 4), "i": ints(1, 2).reshape(2, 1)}, {}, {"batch_dims": 1}, 18),
    ("ScatterND", {"x": randn(6, 3), "i": ints(4, 1).reshape(2, 1), "u": randn(2, 3)}, {}, {}, 18),
    ("ScatterND", {"x": randn(6, 3), "i": ints(4, 4).reshape(2, 1), "u": randn(2, 3)}, {}, {"reduction": "add"}, 18),
    ("ScatterElements", {"x": randn(3, 3), "i": ints(1, 0, 2).reshape(1, 3), "u": randn(1, 3)}, {}, {"axis": 0}, 18),
    ("Expand", {"x": randn(3, 1)}, {"s": ints(2, 1, 4)}, {}, 18),  # a 1 in the shape keeps the input's dim
    ("Tile", {"x": randn(2, 3)}, {"r": ints(2, 1)}, {}, 18),
    ("ConstantOfShape", {"s": ints(2, 3)}, {}, {"value": numpy_helper.from_array(np.array([7], np.int64))}, 18),
    ("ConstantOfShape", {"s": ints(2, 3)}, {}, {}, 18),
    ("Range", {"a": np.array(2, np.int64), "b": np.array(11, np.int64), "d": np.array(3, np.int64)}, {}, {}, 18),
    ("Range", {"a": np.array(1.0, np.float32), "b": np.array(0.0, np.float32), "d": np.array(-0.25, np.float32)},
     {}, {}, 18),
    ("Trilu", {"x": randn(4, 5)}, {"k": np.array(1, np.int64)}, {"upper": 0}, 18),
    ("Trilu", {"x": randn(4, 5)}, {}, {}, 18),
    ("CumSum", {"x": randn(3, 4)}, {"a": np.array(1, np.int64)}, {"exclusive": 1, "reverse": 1}, 18),
    ("Pad", {"x": randn(2, 3)}, {"p": ints(1, 0, 0, 2), "c": np.array(5.0, np.float32)}, {}, 18),
    ("Softmax", {"x": randn(2, 5)}, {}, {"axis": 0}, 18),
    ("ReduceMean", {"x": randn(2, 3, 4)}, {"axes": ints(-1, 0)}, {"keepdims": 0}, 18),
    ("ReduceMean", {"x": randn(2, 3, 4)}, {}, {"axes": [1], "keepdims": 1}, 17),  # axes as attribute < 18
    ("ReduceSum", {"x": randn(2, 3)}, {}, {"keepdims": 0}, 18),
    ("ReduceMax", {"x": randn(2, 3)}, {"axes": ints(1)}, {}, 18),
    ("ArgMax", {"x": randn(3, 5)}, {}, {"axis": 1, "keepdims": 0}, 18),
    ("Cast", {"x": randn(4) * 10}, {}, {"to": TensorProto.INT64}, 18),
    ("Cast", {"x": ints(1, 0, 3)}, {}, {"to": TensorProto.BOOL}, 18),
    ("CastLike", {"x": ints(1, 2), "t": randn(1, dtype=np.float16)}, {}, {}, 18),
    ("Shape", {"x": randn(2, 3, 4)}, {}, {"start": 1, "end": -1}, 18),
    ("Size", {"x": randn(2, 3, 4)}, {}, {}, 18),
    ("Equal", {"a": ints(1, 2, 3), "b": ints(1, 5, 3)}, {}, {}, 18),
    ("LessOrEqual", {"a": randn(4), "b": randn(4)}, {}, {}, 18),
    ("And", {"a": np.array([True, False]), "b": np.array([True, True])}, {}, {}, 18),
    ("Not", {"a": np.array([True, False])}, {}, {}, 18),
    ("IsNaN", {"a": np.array([1.0, np.nan], np.float32)}, {}, {}, 18),
    ("Erf", {"x": randn(5)}, {}, {}, 18),
    ("Sigmoid", {"x": randn(5)}, {}, {}, 18),
    ("Tanh", {"x": randn(5)}, {}, {}, 18),
    ("Gelu", {"x": randn(5)}, {}, {"approximate": "tanh"}, 20),
    ("Clip", {"x": randn(5)}, {"lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)}, {}, 18),
    ("MatMul", {"a": randn(2, 3, 4), "b": randn(4, 5)}, {}, {}, 18),
    ("Gemm", {"a": randn(3, 4), "b": randn(5, 4), "c": randn(5)}, {}, {"transB": 1, "alpha": 0.5, "beta": 2.0}, 18),
    ("Gemm", {"a": randn(4, 3), "b": randn(4, 5)}, {}, {"transA": 1}, 18),
    ("LayerNormalization", {"x": randn(2, 3, 8), "s": randn(8), "b": randn(8)}, {}, {"epsilon": 1e-3}, 18),
    ("LayerNormalization", {"x": randn(2, 3, 8), "s": randn(3, 8)}, {}, {"axis": -2}, 18),
    ("RMSNormalization", {"x": randn(2, 3, 8), "s": randn(8)}, {}, {"epsilon": 1e-6}, 23),
    ("Einsum", {"a": randn(2, 3), "b": randn(3, 4)}, {}, {"equation": "ij,jk->ik"}, 18),
    ("Identity", {"x": randn(3)}, {}, {}, 18),
]


@pytest.mark.parametrize("op,inputs,consts,attrs,opset", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_op_matches_onnxruntime(op, inputs, consts, attrs, opset, tmp_path):
    check(one_node(op, inputs, consts, opset=opset, **attrs), inputs, tmp_path)


FP16_CASES = [
    ("MatMul", {"a": randn(2, 3, 8, dtype=np.float16), "b": randn(8, 4, dtype=np.float16)}, {}),
    ("Add", {"a": randn(3, 4, dtype=np.float16), "b": randn(4, dtype=np.float16)}, {}),
    ("Softmax", {"x": randn(3, 7, dtype=np.float16)}, {"axis": -1}),
    ("Cast", {"x": randn(5)}, {"to": TensorProto.FLOAT16}),
    ("LayerNormalization", {"x": randn(2, 8, dtype=np.float16), "s": randn(8, dtype=np.float16)}, {}),
    ("Where", {"c": np.array([True, False]), "x": randn(2, dtype=np.float16), "y": randn(2, dtype=np.float16)}, {}),
]


@pytest.mark.parametrize("op,inputs,attrs", FP16_CASES, ids=[c[0] for c in FP16_CASES])
def test_fp16_keeps_dtype(op, inputs, attrs, tmp_path):
    check(one_node(op, inputs, **attrs), inputs, tmp_path, atol=2e-3)


@pytest.mark.parametrize("opset,attrs,consts,outputs", [
    (18, {"num_outputs": 3}, {}, 3),  # uneven: 7 = 3 + 3 + 1
    (18, {"axis": 1}, {"split": ints(1, 6)}, 2),
    (13, {"axis": 1}, {}, 7),  # opset 13: equal parts, as many as outputs
])
def test_split_forms(opset, attrs, consts, outputs, tmp_path):
    inputs = {"x": randn(7, 7)}
    check(one_node("Split", inputs, consts, n_out=outputs, opset=opset, **attrs), inputs, tmp_path)


@settings(max_examples=60, deadline=None)
@given(
    dim=st.integers(1, 7),
    start=st.integers(-10, 10) | st.sampled_from([2**63 - 1, -(2**63)]),
    end=st.integers(-10, 10) | st.sampled_from([2**63 - 1, -(2**63)]),
    step=st.sampled_from([-3, -2, -1, 1, 2, 3]),
    runtime=st.booleans(),
)
def test_slice_matches_onnxruntime(dim, start, end, step, runtime, tmp_path_factory):
    """Slice's clamping rules, negative steps included, with constant and runtime starts/ends."""
    x = randn(3, dim)
    params = {"starts": ints(start), "ends": ints(end), "axes": ints(-1), "steps": ints(step)}
    inputs = {"x": x, **params} if runtime else {"x": x}
    model = one_node("Slice", inputs, {} if runtime else params)
    check(model, inputs, tmp_path_factory.mktemp("slice"))


def test_unknown_op_names_op_domain_opset_and_node(tmp_path):
    inputs = {"x": randn(3)}
    model = one_node("Frobnicate", inputs, domain="acme")
    model.graph.node[0].name = "the_node"
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpError, match=r"the_node.*acme::Frobnicate.*opset 1.*onnxruntime"):
        onnx_to_torch(tmp_path / "m.onnx")


def test_unknown_attribute_is_refused(tmp_path):
    model = one_node("Softmax", {"x": randn(3)}, axis=0, bogus=1)
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpError, match="bogus"):
        onnx_to_torch(tmp_path / "m.onnx")


def test_local_function_is_inlined_with_attribute_references(tmp_path):
    """A custom-domain op without a torch implementation runs from its function body (attrs by reference)."""
    scaled = helper.make_node("Constant", [], ["s"], value_float=1.0)
    scaled.attribute[0].ref_attr_name = "alpha"
    body = [scaled, helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Tanh", ["xs"], ["y"])]
    function = helper.make_function("acme", "ScaledTanh", ["x"], ["y"], body, [helper.make_opsetid("", 18)],
                                    attributes=["alpha"])
    model = one_node("ScaledTanh", {"x": randn(4)}, domain="acme", alpha=3.0)
    model.functions.append(function)
    check(model, {"x": randn(4)}, tmp_path)


def test_static_shape_arithmetic_is_folded(tmp_path):
    """Shape → Gather → Concat → Reshape on a static input is computed at conversion time, not per call."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [numpy_helper.from_array(ints(0), "zero"), numpy_helper.from_array(ints(-1), "minus_one")]
    graph = helper.make_graph(nodes, "g", [x], [onnx.ValueInfoProto(name="y")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    check(model, {"x": randn(2, 3, 4)}, tmp_path)
    converted = onnx_to_torch(tmp_path / "m.onnx")
    calls = [n.target.__name__ for n in converted.module.graph.nodes if n.op == "call_function"]
    assert calls == ["reshape"]
    reshape = next(n for n in converted.module.graph.nodes if n.op == "call_function")
    assert reshape.args[1] == [2, -1]


def test_old_opset_is_refused(tmp_path):
    model = one_node("Relu", {"x": randn(3)}, opset=11)
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpError, match="opset 11"):
        onnx_to_torch(tmp_path / "m.onnx")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int32, np.bool_])
def test_initializers_keep_their_dtype(dtype):
    import ml_dtypes
    import onnx_ir as ir

    from trtopt.runtime.executors.onnx_to_torch import ir_tensor_to_torch

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    values = np.arange(-3, 3).reshape(2, 3).astype(np_dtype)
    converted = ir_tensor_to_torch(ir.tensor(values))
    want = {np.float32: torch.float32, np.float16: torch.float16, "bfloat16": torch.bfloat16, np.int32: torch.int32,
            np.bool_: torch.bool}[dtype]
    assert converted.dtype == want and tuple(converted.shape) == (2, 3)
    assert converted.float().tolist() == values.astype(np.float32).tolist()
    scalar = ir_tensor_to_torch(ir.tensor(np.array(7, dtype=np_dtype)))
    assert scalar.dim() == 0  # 0-d stays 0-d (a Gather index must drop its axis)
