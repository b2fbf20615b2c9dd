"""PagedAttention, face 1 of docs/architecture.md §4: inputs, outputs, attributes and shape inference.

Inputs (node order):
    q               [1, Hq, T, D]                          model dtype
    k, v            [1, Hkv, T, D]                         model dtype
    kv_cache        [num_blocks, 2, Hkv, block_size, D]    model dtype, or float8_e4m3fn when kv_cache_dtype="fp8"
                                                           (block 0 is the reserved null block)
    block_tables    [S, max_blocks]                        int32, padded with 0 (the null block)
    seq_lens        [S]                                    int32, context length of each sequence after this step
    query_start_loc [S + 1]                                int32, sequence s owns rows qsl[s]..qsl[s+1] of the T
    slot_mapping    [T]                                    int64, block·block_size + offset; −1 = do not write
    alibi_slopes    [Hq]                                   float32, OPTIONAL when the node is made: "" (or left off)
                                                           when the model has no ALiBi.
The ALiBi decision: zero slopes are exactly "no ALiBi", so ``attach_functions`` wires a shared float32 zero [Hq]
initializer into nodes that have none, and in a built plan the input is always present. The ONNX body, the
reference (alibi_slopes=zeros) and the TensorRT plugin (fixed input list) therefore never see a missing input;
an executor may recognise the zero initializer by its name prefix (common.ZERO_INPUT_PREFIX) and skip ALiBi.
Outputs:
    out             [1, Hq, T, D]                          q's dtype
    kv_cache_out    as kv_cache: the pool after the write (executors alias it to kv_cache)
Attributes: num_heads, num_kv_heads, head_dim (ints), scale (float), causal (int, default 1),
sliding_window (int, default 0 = none); plus plugin_namespace="trtopt" on every node.
FP8 KV cache (`trtopt build --kv-cache-dtype fp8`, docs/architecture.md §3): kv_cache_dtype="fp8" and the layer's
float32 k_scale and v_scale, written only on such nodes (omittable: other plans' nodes do not carry them). The
write stores saturate(x / scale) rounded to the nearest float8_e4m3fn, the read computes in fp32 with value × scale.
An FP8 pool keeps the declared shape but stores each block's values transposed: kv_cache[b, 1, h] holds value d of
the key at offset o at d·block_size + o of its (block_size, D) plane, which must be contiguous (vLLM's value-cache
layout; reference.pool_values reads it in key order, and attention.py `_fp8_value_tile` says why).
Scales are attributes, not inputs: they are per-layer build-time constants, as ``scale`` is (TensorRT AOT bakes them
into the kernel like it; an input would be a device load per program and an extra entry in the plugin's fixed input
list), and an optional input would get attach_functions' zero initializer in every plan, where zero is no scale.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from trtopt.errors import BuildError
from trtopt.plugins.common import AttrSpec, OpSchema, Shape, expect_dim, expect_rank
from trtopt.signature import KV_CACHE_DTYPES

OP_TYPE = "PagedAttention"
INPUTS = ("q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping", "alibi_slopes")
OUTPUTS = ("out", "kv_cache_out")


def infer_shapes(input_shapes: Sequence[Shape | None], attrs: Mapping[str, Any]) -> list[Shape]:
    """out has q's shape, kv_cache_out has kv_cache's; checks every shape against the attributes on the way."""
    shapes = dict(zip(INPUTS, input_shapes))
    num_heads, num_kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise BuildError(f"{OP_TYPE}: num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}.")
    q = expect_rank(OP_TYPE, "q", shapes.get("q"), 4)
    kv_cache = expect_rank(OP_TYPE, "kv_cache", shapes.get("kv_cache"), 5)
    for name, heads in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
        x = expect_rank(OP_TYPE, name, shapes.get(name), 4)
        expect_dim(OP_TYPE, f"{name}'s batch dim", x[0], 1)
        expect_dim(OP_TYPE, f"{name}'s head count", x[1], heads)
        expect_dim(OP_TYPE, f"{name}'s token count", x[2], q[2])
        expect_dim(OP_TYPE, f"{name}'s head_dim", x[3], head_dim)
    expect_dim(OP_TYPE, "kv_cache dim 1 (K and V)", kv_cache[1], 2)
    expect_dim(OP_TYPE, "kv_cache's head count", kv_cache[2], num_kv_heads)
    expect_dim(OP_TYPE, "kv_cache's head_dim", kv_cache[4], head_dim)
    block_tables = expect_rank(OP_TYPE, "block_tables", shapes.get("block_tables"), 2)
    seq_lens = expect_rank(OP_TYPE, "seq_lens", shapes.get("seq_lens"), 1)
    qsl = expect_rank(OP_TYPE, "query_start_loc", shapes.get("query_start_loc"), 1)
    slot_mapping = expect_rank(OP_TYPE, "slot_mapping", shapes.get("slot_mapping"), 1)
    expect_dim(OP_TYPE, "seq_lens' length", seq_lens[0], block_tables[0])
    if isinstance(seq_lens[0], int):
        expect_dim(OP_TYPE, "query_start_loc's length", qsl[0], seq_lens[0] + 1)
    expect_dim(OP_TYPE, "slot_mapping's length", slot_mapping[0], q[2])
    if attrs.get("kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        raise BuildError(f"{OP_TYPE}: kv_cache_dtype={attrs['kv_cache_dtype']!r}; choose one of {KV_CACHE_DTYPES}.")
    for name in ("k_scale", "v_scale"):
        if not attrs.get(name, 1.0) > 0:
            raise BuildError(f"{OP_TYPE}: {name}={attrs[name]} must be a positive float.")
    if shapes.get("alibi_slopes") is not None:
        alibi = expect_rank(OP_TYPE, "alibi_slopes", shapes["alibi_slopes"], 1)
        expect_dim(OP_TYPE, "alibi_slopes' length", alibi[0], num_heads)
    return [tuple(q), tuple(kv_cache)]


SCHEMA = OpSchema(
    op_type=OP_TYPE,
    inputs=INPUTS,
    optional_inputs={"alibi_slopes": lambda attrs: (attrs["num_heads"],)},
    outputs=OUTPUTS,
    attributes=(
        AttrSpec("num_heads", int, doc="query heads Hq"),
        AttrSpec("num_kv_heads", int, doc="KV heads Hkv; query head h reads kv head h // (Hq / Hkv)"),
        AttrSpec("head_dim", int, doc="D"),
        AttrSpec("scale", float, doc="score scale, usually 1/sqrt(D); baked into TensorRT kernels at build time"),
        AttrSpec("causal", int, 1, doc="1: token at position p sees keys 0..p; 0: the whole context"),
        AttrSpec("sliding_window", int, 0, doc="W > 0 keeps only keys at positions > p − W; 0 = no window"),
        AttrSpec("kv_cache_dtype", str, "auto", omittable=True,
                 doc='"fp8": kv_cache is float8_e4m3fn (quantized with k_scale/v_scale); "auto": q\'s dtype'),
        AttrSpec("k_scale", float, 1.0, omittable=True, doc="FP8 pools: K is stored as K / k_scale"),
        AttrSpec("v_scale", float, 1.0, omittable=True, doc="FP8 pools: V is stored as V / v_scale"),
    ),
    infer_shapes=infer_shapes,
)
