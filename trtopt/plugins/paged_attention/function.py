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
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from trtopt.plugins.common import LOWEST_FLOAT32, BodyBuilder
from trtopt.plugins.paged_attention.schema import INPUTS, OP_TYPE, OUTPUTS, SCHEMA


def write_kv(b: BodyBuilder) -> str:
    """Step 1: scatter k and v into the pool at slot_mapping. Returns kv_cache_out."""
    num_kv_heads = b.dim("k", 1)  # [1]
    block_size = b.dim("kv_cache", 3)  # [1]
    head_dim = b.dim("kv_cache", 4)  # [1]

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

    updates = b.op("CastLike", b.op("Concat", "k", "v", axis=0), "kv_cache")  # [2, Hkv, T, D]
    rows = b.op("Reshape", "kv_cache", b.op("Concat", b.ints(-1), head_dim, axis=0))  # [NB·2·Hkv·bs, D]
    rows = b.op("ScatterND", rows, indices, updates)
    return b.op("Reshape", rows, b.op("Shape", "kv_cache"), name="kv_cache_out")


def attend(b: BodyBuilder, kv_cache: str) -> str:
    """Step 2: every new token attends over its sequence's cached keys (the pool AFTER the write). Returns out."""
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
        return b.op("Cast", b.op("Reshape", x, shape), to=TensorProto.FLOAT)  # [Hkv, 1, S, L, D]

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


def make_function(opset: int) -> onnx.FunctionProto:
    """The trtopt::PagedAttention FunctionProto for a model whose standard opset is ``opset`` (17 or newer)."""
    b = BodyBuilder(opset)
    kv_cache_out = write_kv(b)
    attend(b, kv_cache_out)
    return b.function(
        OP_TYPE, INPUTS, OUTPUTS, [a.name for a in SCHEMA.attributes],
        doc="Paged attention over a block-table KV pool; see trtopt/plugins/paged_attention/schema.py.",
    )
