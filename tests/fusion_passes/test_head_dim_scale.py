"""An attention scale computed from a shape (SDPA's 1/√q.size(-1) as optimum's Falcon/StableLM/GPT-2 exports trace
it) is fused with its value for the proven head dim; a factor that reads another shape or another dim is refused."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, const, model, op_types, run
from onnx import TensorProto, helper

from trtopt.fusion_passes.context import PassContext
from trtopt.fusion_passes.flash_attention import fuse_flash_attention
from trtopt.fusion_passes.trace import Trace

HEAD_DIM = 8


def _sdpa(shape_of: str = "q", start: int = -1) -> object:
    """softmax((q·√s)(kᵀ·√s))·v with √s = Sqrt(1 / Sqrt(Cast(Slice(Shape(shape_of), start, start + 1))))."""
    dims = ["B", 2, "S", HEAD_DIM]
    nodes = [
        helper.make_node("Shape", [shape_of], ["shp"]),
        const("start", [start]), const("end", [start + 1 if start != -1 else 2**62]),
        helper.make_node("Slice", ["shp", "start", "end"], ["d"]),
        helper.make_node("Cast", ["d"], ["df"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["df"], ["sd"]),
        const("one", np.array([1.0], np.float32)),
        helper.make_node("Div", ["one", "sd"], ["inv"]),
        helper.make_node("Sqrt", ["inv"], ["root"]),
        helper.make_node("Mul", ["q", "root"], ["qs"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["kt", "root"], ["kts"]),
        helper.make_node("MatMul", ["qs", "kts"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"]),
    ]
    inputs = [helper.make_tensor_value_info(n, FLOAT, dims) for n in ("q", "k", "v")]
    return model(nodes, inputs, [helper.make_tensor_value_info("out", FLOAT, dims)])


def _fuse(proto) -> tuple[int, object, Trace]:
    m = ir.from_proto(proto)
    trace = Trace()
    count = fuse_flash_attention(m, PassContext(trace=trace))
    return count, ir.to_proto(m), trace


def test_scale_from_the_shape_of_q_is_evaluated():
    proto = _sdpa()
    count, fused, _ = _fuse(proto)
    assert count == 1 and "FlashAttention" in op_types(fused)
    node = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    scale = next(a.f for a in node.attribute if a.name == "scale")
    assert scale == pytest.approx(HEAD_DIM**-0.5)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 2, 5, HEAD_DIM)).astype(np.float32) for n in ("q", "k", "v")}
    np.testing.assert_allclose(run(fused, feeds)[0], run(proto, feeds)[0], atol=1e-5)


@pytest.mark.parametrize("shape_of,start,reason", [
    ("v", -1, "reads the shape of v, not of q or k"),  # v's last dim is not the contraction dim
    ("q", 2, "not one scalar that depends only on the head dim"),  # the sequence length, not the head dim
])
def test_other_shape_factors_are_refused(shape_of, start, reason):
    count, fused, trace = _fuse(_sdpa(shape_of, start))
    assert count == 0 and "FlashAttention" not in op_types(fused)
    assert any(reason in f.reason for f in trace.failures), trace.summary()
