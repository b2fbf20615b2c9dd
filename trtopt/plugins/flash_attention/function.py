"""FlashAttention, face 2 of docs/architecture.md §4: the op as an ONNX function in standard ops (the executable spec).

Plain attention in fp32: GQA by viewing the Hq query heads as [Hkv, G] against keys broadcast over G, the optional
additive bias, then the causal mask (query i sees keys j <= i + (Sk − S)). Head counts and sizes come from the
input shapes; scale and causal from the node's attributes. Runs on ORT CPU for opsets 17..23, fp32 and fp16.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from trtopt.plugins.common import LOWEST_FLOAT32, BodyBuilder
from trtopt.plugins.flash_attention.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA


def make_function(opset: int) -> onnx.FunctionProto:
    """The trtopt::FlashAttention FunctionProto for a model whose standard opset is ``opset`` (17 or newer)."""
    b = BodyBuilder(opset)
    batch, num_heads, seq_q, head_dim = (b.dim("q", axis) for axis in range(4))  # each [1]
    num_kv_heads, seq_k = b.dim("k", 1), b.dim("k", 2)
    zero, one = b.int_scalar(0), b.int_scalar(1)

    grouped = b.op("Concat", batch, num_kv_heads, b.ints(-1), seq_q, head_dim, axis=0)
    q = b.op("Reshape", b.op("Cast", "q", to=TensorProto.FLOAT), grouped)  # [B, Hkv, G, S, D]
    k = b.op("Unsqueeze", b.op("Cast", "k", to=TensorProto.FLOAT), b.ints(2))  # [B, Hkv, 1, Sk, D]
    v = b.op("Unsqueeze", b.op("Cast", "v", to=TensorProto.FLOAT), b.ints(2))  # [B, Hkv, 1, Sk, D]
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 2, 4, 3]))  # [B, Hkv, G, S, Sk]
    scores_shape = b.op("Concat", batch, num_heads, seq_q, seq_k, axis=0)
    scores = b.op("Mul", b.op("Reshape", scores, scores_shape), b.attr("scale", float))  # [B, Hq, S, Sk]

    # attn_bias broadcasts to [B, Hq, S, Sk]; a model without one gets a zero [1, 1, 1, 1] (attach_functions).
    scores = b.op("Add", scores, b.op("Cast", "attn_bias", to=TensorProto.FLOAT))

    # Causal: query i is at position i + (Sk − S) among the keys.
    query_pos = b.op("Add", b.op("Range", zero, b.scalar(seq_q), one), b.scalar(b.op("Sub", seq_k, seq_q)))
    key_pos = b.op("Range", zero, b.scalar(seq_k), one)  # [Sk]
    hidden = b.op("Greater", key_pos, b.op("Unsqueeze", query_pos, b.ints(1)))  # [S, Sk]
    is_causal = b.op("Not", b.op("Equal", b.attr("causal", int), zero))
    scores = b.op("Where", b.op("And", is_causal, hidden), b.float_scalar(LOWEST_FLOAT32), scores)

    probs = b.op("Reshape", b.op("Softmax", scores, axis=-1), b.op("Concat", batch, num_kv_heads, b.ints(-1),
                                                                  seq_q, seq_k, axis=0))  # [B, Hkv, G, S, Sk]
    out = b.op("MatMul", probs, v)  # [B, Hkv, G, S, D]
    out = b.op("Reshape", out, b.op("Concat", batch, num_heads, seq_q, head_dim, axis=0))  # [B, Hq, S, D]
    b.op("CastLike", out, "q", name="out")
    return b.function(
        OP_TYPE, INPUTS, OUTPUTS, [a.name for a in SCHEMA.attributes],
        doc="Cache-free scaled dot-product attention; see trtopt/plugins/flash_attention/schema.py.",
    )
