"""FlashAttention, face 1 of docs/architecture.md §4: inputs, outputs, attributes and shape inference.

Inputs (node order):
    q          [B, Hq, S, D]
    k, v       [B, Hkv, Sk, D]
    attn_bias  additive, float32 or q's dtype, broadcastable to [B, Hq, S, Sk] (e.g. the [B, 1, 1, Sk] key-padding
               mask of BERT/MiniLM exports); OPTIONAL when the node is made: "" (or left off) when absent.
               ``attach_functions`` wires a shared float32 zero [1, 1, 1, 1] initializer into nodes without one (a
               zero bias is exactly "no bias"; see common._fill_absent_inputs for why "" cannot stay), so in a
               built plan the input is always present.
Output:
    out        [B, Hq, S, D] in q's dtype
Attributes: num_heads, num_kv_heads, head_dim (ints), scale (float), causal (int, default 0; query i sees keys
j <= i + (Sk − S), i.e. the queries are the last S of the Sk positions); plus plugin_namespace="trtopt".
Rows that see no key at all (causal with S > Sk, or a bias that hides every key) have no defined value.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape, expect_dim, expect_rank

OP_TYPE = "FlashAttention"
INPUTS = ("q", "k", "v", "attn_bias")
OUTPUTS = ("out",)


def infer_shapes(input_shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    """out has q's shape; checks q/k/v and the bias against the attributes and each other."""
    shapes = dict(zip(INPUTS, input_shapes))
    num_heads, num_kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise BuildError(f"{OP_TYPE}: num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}.")
    q = expect_rank(OP_TYPE, "q", shapes.get("q"), 4)
    k = expect_rank(OP_TYPE, "k", shapes.get("k"), 4)
    v = expect_rank(OP_TYPE, "v", shapes.get("v"), 4)
    expect_dim(OP_TYPE, "q's head count", q[1], num_heads)
    expect_dim(OP_TYPE, "q's head_dim", q[3], head_dim)
    for name, x in (("k", k), ("v", v)):
        expect_dim(OP_TYPE, f"{name}'s batch", x[0], q[0])
        expect_dim(OP_TYPE, f"{name}'s head count", x[1], num_kv_heads)
        expect_dim(OP_TYPE, f"{name}'s head_dim", x[3], head_dim)
    expect_dim(OP_TYPE, "v's key count", v[2], k[2])
    bias = shapes.get("attn_bias")
    if bias is not None:
        if len(bias) > 4:
            raise BuildError(f"{OP_TYPE}: attn_bias {bias} must broadcast to [B, Hq, S, Sk] (rank <= 4).")
        full = (q[0], num_heads, q[2], k[2])
        for axis, (b, f) in enumerate(zip(bias[::-1], full[::-1])):
            if b != 1:
                expect_dim(OP_TYPE, f"attn_bias dim {len(bias) - 1 - axis} (broadcast to {full})", b, f)
    return [tuple(q)]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={"attn_bias": lambda attrs: (1, 1, 1, 1)},
    outputs=OUTPUTS,
    attributes=(
        AttrSpec("num_heads", int, doc="query heads Hq"),
        AttrSpec("num_kv_heads", int, doc="KV heads Hkv; query head h reads kv head h // (Hq / Hkv)"),
        AttrSpec("head_dim", int, doc="D"),
        AttrSpec("scale", float, doc="score scale, usually 1/sqrt(D)"),
        AttrSpec("causal", int, 0, doc="1: query i sees keys j <= i + (Sk − S)"),
    ),
    infer_shapes=infer_shapes,
)
