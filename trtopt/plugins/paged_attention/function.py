"""PagedAttention, face 2 of docs/architecture.md §4: the op as an ONNX function in standard ops (the executable spec).

The body runs on any ONNX runtime (tested on ORT CPU, opsets 17..23, fp32 and fp16). It reads head counts and sizes
from the input shapes and scale/causal/sliding_window from the node's attributes, so one function serves every
layer and model. Everything is sized from shapes or from values (a Range up to the longest query), never from a
host sync, which ONNX has no notion of anyway.

How it works:
1. Write: view the pool as rows [num_blocks·2·Hkv·block_size, D] and ScatterND every token's K and V into row
   ((block·2 + kv)·Hkv + h)·block_size + offset. ScatterND has no conditional write, so slot −1 is redirected into
   the null block 0, which nobody reads (several such writes may land on one row; their order does not matter).
2. Attend, padded per sequence: queries are gathered into [S, max_n] (max_n = the longest query of the step),
   each sequence's keys into [S, max_blocks·block_size] through its block table, scores are masked (context length,
   causal, sliding window) and ALiBi-biased in fp32, and each token's row is gathered back out.

FP8 pools (kv_cache_dtype="fp8", opset >= 19 for float8 Cast; make_function(opset, kv_cache_dtype="fp8"), attached by
attach_fp8_kv_function): k / k_scale and v / v_scale are cast to float8_e4m3fn (saturating, round to nearest even),
and the keys and values read are × scale in fp32. ONNX Runtime's CPU ScatterND and Gather take no float8 tensors, so
this body widens the pool to float16 (exact: every float8_e4m3fn value is a float16) to write and read it, and
narrows the written pool back (exact again): two casts of the pool per layer and step, a price only the portable
ORT path pays. It also moves the values between their stored [D, block_size] per block and key order on the way
(`value_layout`).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from trtopt.plugins.common import DOMAIN, LOWEST_FLOAT32, BodyBuilder, default_opset
from trtopt.plugins.paged_attention.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA

FP8_MIN_OPSET = 19  # Cast to and from float8 types came with opset 19


def value_layout(b: BodyBuilder, pool: str, *, to_key_order: bool) -> str:
    """An FP8 pool's values between how they are stored, [D, block_size] per block (reference.pool_values), and
    key order, [block_size, D]; ``pool`` is the pool's float16 widening [NB, 2, Hkv, bs, D], keys unchanged."""
    shape = b.op("Shape", pool)  # [5]
    keys = b.op("Slice", pool, b.ints(0), b.ints(1), b.ints(1))  # [NB, 1, Hkv, bs, D]
    values = b.op("Slice", pool, b.ints(1), b.ints(2), b.ints(1))
    lead = b.op("Concat", b.op("Slice", shape, b.ints(0), b.ints(1)), b.ints(1),
                b.op("Slice", shape, b.ints(2), b.ints(3)), axis=0)  # [NB, 1, Hkv]
    block_size, head_dim = b.op("Slice", shape, b.ints(3), b.ints(4)), b.op("Slice", shape, b.ints(4), b.ints(5))
    if to_key_order:  # the stored [bs, D] plane read as [D, bs], then transposed
        values = b.op("Transpose", b.op("Reshape", values, b.op("Concat", lead, head_dim, block_size, axis=0)),
                      perm=[0, 1, 2, 4, 3])
    else:
        values = b.op("Reshape", b.op("Transpose", values, perm=[0, 1, 2, 4, 3]),
                      b.op("Concat", lead, block_size, head_dim, axis=0))
    return b.op("Concat", keys, values, axis=1)


def write_kv(b: BodyBuilder, *, fp8: bool = False) -> tuple[str, str]:
    """Step 1: scatter k and v into the pool at slot_mapping. Returns (kv_cache_out, the written pool as step 2
    reads it): the same tensor, or for an FP8 pool its float16 widening with the values in key order."""
    # An FP8 pool is read through its float16 widening (ORT's CPU Shape takes no float8 either), values in key order.
    pool = (value_layout(b, b.op("Cast", "kv_cache", to=TensorProto.FLOAT16), to_key_order=True) if fp8
            else "kv_cache")
    num_kv_heads = b.dim("k", 1)  # [1]
    block_size = b.dim(pool, 3)  # [1]
    head_dim = b.dim(pool, 4)  # [1]

    zero = b.int_scalar(0)
    slot = b.op("Where", b.op("Less", "slot_mapping", zero), zero, "slot_mapping")  # [T]: −1 → null block 0
    block = b.op("Unsqueeze", b.op("Div", slot, block_size), b.ints(0, 1))  # [1, 1, T]
    offset = b.op("Unsqueeze", b.op("Mod", slot, block_size), b.ints(0, 1))  # [1, 1, T]
    kv_index = b.ints(0, 1)
    kv_index = b.op("Reshape", kv_index, b.ints(2, 1, 1))  # [2, 1, 1]: 0 = K, 1 = V
    head = b.op("Range", zero, b.scalar(num_kv_heads), b.int_scalar(1))
    head = b.op("Unsqueeze", head, b.ints(0, 2))  # [1, Hkv, 1]

    two = b.ints(2)
    row = b.op("Add", b.op("Mul", block, two), kv_index)  # [2, 1, T]
    row = b.op("Add", b.op("Mul", row, num_kv_heads), head)  # [2, Hkv, T]
    row = b.op("Add", b.op("Mul", row, block_size), offset)  # [2, Hkv, T]
    indices = b.op("Unsqueeze", row, b.ints(-1))  # [2, Hkv, T, 1]

    if fp8:
        # x / scale rounded to float8 (saturating), then widened like the pool (Concat takes no float8 either)
        k16, v16 = (b.op("Cast", b.op("Cast", b.op("Div", b.op("Cast", x, to=TensorProto.FLOAT), b.attr(scale, float)),
                                      to=TensorProto.FLOAT8E4M3FN, saturate=1), to=TensorProto.FLOAT16)
                    for x, scale in (("k", "k_scale"), ("v", "v_scale")))
        updates = b.op("Concat", k16, v16, axis=0)  # [2, Hkv, T, D]
    else:
        updates = b.op("CastLike", b.op("Concat", "k", "v", axis=0), "kv_cache")  # [2, Hkv, T, D]
    rows = b.op("Reshape", pool, b.op("Concat", b.ints(-1), head_dim, axis=0))  # [NB·2·Hkv·bs, D]
    rows = b.op("ScatterND", rows, indices, updates)
    if fp8:
        written = b.op("Reshape", rows, b.op("Shape", pool))
        stored = value_layout(b, written, to_key_order=False)
        return b.op("Cast", stored, to=TensorProto.FLOAT8E4M3FN, saturate=1, name="kv_cache_out"), written
    out = b.op("Reshape", rows, b.op("Shape", "kv_cache"), name="kv_cache_out")
    return out, out


def attend(b: BodyBuilder, kv_cache: str, *, fp8: bool = False) -> str:
    """Step 2: every new token attends over its sequence's cached keys (the pool AFTER the write; for an FP8 pool
    its float16 widening, whose values are × k_scale / v_scale in fp32). Returns out."""
    num_kv_heads = b.dim("k", 1)  # [1]
    num_seqs = b.dim("seq_lens", 0)  # [1]
    head_dim = b.dim("q", 3)  # [1]
    zero, one = b.int_scalar(0), b.int_scalar(1)

    # Per-sequence bookkeeping, int64.
    qsl = b.op("Cast", "query_start_loc", to=TensorProto.INT64)  # [S+1]
    starts = b.op("Slice", qsl, b.ints(0), b.ints(-1))  # [S]
    ends = b.op("Slice", qsl, b.ints(1), b.ints(2**62))  # [S]
    n_new = b.op("Sub", ends, starts)  # [S]
    seq_lens = b.op("Cast", "seq_lens", to=TensorProto.INT64)  # [S]
    max_new = b.reduce_max(n_new, axis=0)  # 0-D
    j = b.op("Range", zero, max_new, one)  # [max_n]
    col = b.op("Unsqueeze", j, b.ints(0))  # [1, max_n]
    starts_col = b.op("Unsqueeze", starts, b.ints(1))  # [S, 1]
    n_col = b.op("Unsqueeze", n_new, b.ints(1))  # [S, 1]
    lens_col = b.op("Unsqueeze", seq_lens, b.ints(1))  # [S, 1]
    is_row = b.op("Less", col, n_col)  # [S, max_n]: padded slots are False
    token = b.op("Where", is_row, b.op("Add", starts_col, col), zero)  # [S, max_n]: row of q, 0 for padding
    query_pos = b.op("Add", b.op("Sub", lens_col, n_col), col)  # [S, max_n]: p = seq_len − n + j

    # Queries, padded per sequence: [Hkv, G, S, max_n, D] in fp32.
    q = b.op("Gather", b.op("Squeeze", "q", b.ints(0)), token, axis=1)  # [Hq, S, max_n, D]
    q = b.op("Cast", q, to=TensorProto.FLOAT)
    padded_shape = b.op("Concat", num_kv_heads, b.ints(-1), num_seqs, b.op("Unsqueeze", max_new, b.ints(0)),
                        head_dim, axis=0)
    q = b.op("Reshape", q, padded_shape)  # [Hkv, G, S, max_n, D]

    # Keys and values of every sequence, in logical order through its block table: [Hkv, 1, S, L, D].
    def context(kv: int) -> str:
        pool = b.op("Gather", kv_cache, b.int_scalar(kv), axis=1)  # [NB, Hkv, bs, D]
        x = b.op("Gather", pool, "block_tables", axis=0)  # [S, MB, Hkv, bs, D]
        x = b.op("Transpose", x, perm=[2, 0, 1, 3, 4])  # [Hkv, S, MB, bs, D]
        shape = b.op("Concat", num_kv_heads, b.ints(1), num_seqs, b.ints(-1), head_dim, axis=0)
        x = b.op("Cast", b.op("Reshape", x, shape), to=TensorProto.FLOAT)  # [Hkv, 1, S, L, D]
        return b.op("Mul", x, b.attr("v_scale" if kv else "k_scale", float)) if fp8 else x

    keys, values = context(0), context(1)
    scale = b.attr("scale", float)
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 2, 4, 3])), scale)
    # scores: [Hkv, G, S, max_n, L]

    # Which keys each query sees: [S, max_n, L].
    context_len = b.op("Shape", keys, start=3, end=4)
    key_pos = b.op("Range", zero, b.scalar(context_len), one)  # [L]
    rel = b.op("Sub", key_pos, b.op("Unsqueeze", query_pos, b.ints(2)))  # [S, max_n, L]: kpos − p
    visible = b.op("Less", key_pos, b.op("Unsqueeze", lens_col, b.ints(2)))  # [S, 1, L]: inside the context
    not_causal = b.op("Equal", b.attr("causal", int), zero)
    visible = b.op("And", visible, b.op("Or", not_causal, b.op("LessOrEqual", rel, zero)))
    window = b.attr("sliding_window", int)
    no_window = b.op("LessOrEqual", window, zero)
    visible = b.op("And", visible, b.op("Or", no_window, b.op("Greater", rel, b.op("Neg", window))))

    # ALiBi: slope_h · (kpos − p); a model without ALiBi gets zero slopes (attach_functions).
    slopes = b.op("Cast", "alibi_slopes", to=TensorProto.FLOAT)  # [Hq]
    slopes = b.op("Reshape", slopes, b.op("Concat", num_kv_heads, b.ints(-1, 1, 1, 1), axis=0))  # [Hkv, G, 1, 1, 1]
    scores = b.op("Add", scores, b.op("Mul", slopes, b.op("Cast", rel, to=TensorProto.FLOAT)))
    scores = b.op("Where", visible, scores, b.float_scalar(LOWEST_FLOAT32))
    probs = b.op("Softmax", scores, axis=-1)
    attended = b.op("MatMul", probs, values)  # [Hkv, G, S, max_n, D]

    # Back to the packed token order: token t of sequence s_t is padded row s_t·max_n + (t − starts[s_t]).
    attended = b.op("Reshape", attended, b.op("Concat", b.dim("q", 1), b.ints(-1), head_dim, axis=0))
    num_tokens = b.scalar(b.dim("q", 2))
    t = b.op("Range", zero, num_tokens, one)  # [T]
    seq_of_token = b.op(  # [T]: how many sequences end at or before t
        "ReduceSum",
        b.op("Cast", b.op("LessOrEqual", ends, b.op("Unsqueeze", t, b.ints(1))), to=TensorProto.INT64),
        b.ints(1), keepdims=0,
    )
    j_of_token = b.op("Sub", t, b.op("Gather", starts, seq_of_token))  # [T]
    padded_row = b.op("Add", b.op("Mul", seq_of_token, max_new), j_of_token)  # [T]
    out = b.op("Gather", attended, padded_row, axis=1)  # [Hq, T, D]
    return b.op("CastLike", b.op("Unsqueeze", out, b.ints(0)), "q", name="out")  # [1, Hq, T, D]


def make_function(opset: int, *, kv_cache_dtype: str = "auto") -> onnx.FunctionProto:
    """The trtopt::PagedAttention FunctionProto for a model whose standard opset is ``opset`` (17 or newer), with
    pools of the model's dtype, or (kv_cache_dtype="fp8", opset 19 or newer) float8_e4m3fn pools."""
    fp8 = kv_cache_dtype == "fp8"
    assert not fp8 or opset >= FP8_MIN_OPSET, f"an FP8 pool needs opset >= {FP8_MIN_OPSET} (float8 Cast), got {opset}"
    b = BodyBuilder(opset)
    _, written = write_kv(b, fp8=fp8)
    attend(b, written, fp8=fp8)
    return b.function(
        OP_TYPE, INPUTS, OUTPUTS, [a.name for a in SCHEMA.attributes if fp8 or not a.omittable],
        doc="Paged attention over a block-table KV pool; see trtopt/plugins/paged_attention/schema.py.",
    )


def attach_fp8_kv_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give a plan with FP8 pools the FP8 body: replace the PagedAttention function that attach_functions attached
    (the model-dtype body) by make_function(opset, kv_cache_dtype="fp8"). Mutates and returns ``model``."""
    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend([*kept, make_function(default_opset(model), kv_cache_dtype="fp8")])
    return model
