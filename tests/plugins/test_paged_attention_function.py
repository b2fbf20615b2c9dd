"""The PagedAttention ONNX function body, run by onnxruntime, against the torch reference."""

from __future__ import annotations

import functools
import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from test_paged_attention_reference import make_step
from trtopt.plugins import attach_functions, make_node
from trtopt.plugins.common import ZERO_INPUT_PREFIX
from trtopt.plugins.paged_attention.function import make_function
from trtopt.plugins.paged_attention.reference import paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = 0.25
TORCH_TO_ONNX = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
INPUT_NAMES = ["q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping"]


def one_node_model(opset: int, dtype: torch.dtype, *, alibi: bool, causal: int = 1, sliding_window: int = 0,
                   num_heads: int = NUM_HEADS, num_kv_heads: int = NUM_KV_HEADS) -> onnx.ModelProto:
    """A model with one PagedAttention node and fully symbolic T, S, blocks, block_size."""
    elem = TORCH_TO_ONNX[dtype]
    vi = helper.make_tensor_value_info
    inputs = [
        vi("q", elem, [1, num_heads, "T", HEAD_DIM]), vi("k", elem, [1, num_kv_heads, "T", HEAD_DIM]),
        vi("v", elem, [1, num_kv_heads, "T", HEAD_DIM]),
        vi("kv_cache", elem, ["num_blocks", 2, num_kv_heads, "block_size", HEAD_DIM]),
        vi("block_tables", TensorProto.INT32, ["S", "max_blocks"]), vi("seq_lens", TensorProto.INT32, ["S"]),
        vi("query_start_loc", TensorProto.INT32, ["S_plus_1"]), vi("slot_mapping", TensorProto.INT64, ["T"]),
    ]
    names = list(INPUT_NAMES)
    if alibi:
        inputs.append(vi("alibi_slopes", TensorProto.FLOAT, [num_heads]))
        names.append("alibi_slopes")
    node = make_node("PagedAttention", names, ["out", "kv_cache_out"], name="attn", num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, scale=SCALE, causal=causal,
                     sliding_window=sliding_window)
    outputs = [vi("out", elem, [1, num_heads, "T", HEAD_DIM]),
               vi("kv_cache_out", elem, ["num_blocks", 2, num_kv_heads, "block_size", HEAD_DIM])]
    graph = helper.make_graph([node], "paged_attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return attach_functions(model)


@functools.lru_cache(maxsize=None)
def session(opset: int, dtype: torch.dtype, alibi: bool, causal: int = 1, sliding_window: int = 0):
    model = one_node_model(opset, dtype, alibi=alibi, causal=causal, sliding_window=sliding_window)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def compare(sess, step: dict, *, alibi_slopes, causal=1, sliding_window=0, atol=1e-5):
    feeds = {name: step[name].numpy() for name in INPUT_NAMES}
    if alibi_slopes is not None:
        feeds["alibi_slopes"] = alibi_slopes.numpy()
    out, pool = sess.run(None, feeds)
    expected_out, expected_pool = paged_attention_ref(
        *(step[name].clone() for name in INPUT_NAMES), num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, scale=SCALE, causal=causal, sliding_window=sliding_window, alibi_slopes=alibi_slopes,
    )
    np.testing.assert_allclose(out.astype(np.float32), expected_out.float().numpy(), atol=atol, rtol=atol)
    # Block 0 is the null block: the body parks slot −1 writes there, the reference skips them. Nobody reads it.
    np.testing.assert_array_equal(pool[1:], expected_pool[1:].numpy())


STEPS = [  # (context_lens, new_tokens, skipped slots): mixed, decode-only, one prefill
    ([23, 57, 1, 40, 35], [23, 19, 1, 1, 3], 2),
    ([9, 70, 33], [1, 1, 1], 0),
    ([45], [45], 0),
]


@pytest.mark.parametrize("opset", [17, 18, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference_across_dynamic_shapes(opset, dtype, alibi, block_size):
    sess = session(opset, dtype, alibi)
    rng = random.Random(opset + block_size + alibi)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / NUM_HEADS) for h in range(NUM_HEADS)]) if alibi else None
    for context_lens, new_tokens, skip in STEPS:  # one session, several T/S/block counts
        step = make_step(rng, context_lens=context_lens, new_tokens=new_tokens, num_heads=NUM_HEADS,
                         num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=block_size, skip_slots=skip,
                         dtype=dtype)
        compare(sess, step, alibi_slopes=slopes, atol=1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("causal,sliding_window", [(1, 7), (1, 1), (0, 0)])
def test_masking_attributes(causal, sliding_window):
    sess = session(18, torch.float32, False, causal, sliding_window)
    step = make_step(random.Random(causal * 10 + sliding_window), context_lens=[30, 12, 50], new_tokens=[30, 4, 1],
                     num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=16)
    compare(sess, step, alibi_slopes=None, causal=causal, sliding_window=sliding_window)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_gqa_ratios(num_heads, num_kv_heads):
    model = one_node_model(23, torch.float32, alibi=False, num_heads=num_heads, num_kv_heads=num_kv_heads)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    step = make_step(random.Random(num_heads), context_lens=[20, 37], new_tokens=[20, 2], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, block_size=16)
    out, _ = sess.run(None, {name: step[name].numpy() for name in INPUT_NAMES})
    expected, _ = paged_attention_ref(*(step[name].clone() for name in INPUT_NAMES), num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, scale=SCALE)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("absent", ["empty_name", "left_off"])
def test_absent_alibi_becomes_a_shared_zero_initializer(absent):
    names = INPUT_NAMES + ([""] if absent == "empty_name" else [])
    vi = helper.make_tensor_value_info
    nodes = [make_node("PagedAttention", names, [f"out{i}", f"kv{i}"], name=f"attn{i}", num_heads=NUM_HEADS,
                       num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=SCALE) for i in range(2)]
    graph = helper.make_graph(nodes, "two_layers", [vi(n, TensorProto.FLOAT, None) for n in INPUT_NAMES],
                              [vi(o, TensorProto.FLOAT, None) for n in nodes for o in n.output])
    model = attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    zero_inits = [i for i in model.graph.initializer if i.name.startswith(ZERO_INPUT_PREFIX)]
    assert len(zero_inits) == 1 and list(zero_inits[0].dims) == [NUM_HEADS]
    assert not onnx.numpy_helper.to_array(zero_inits[0]).any()
    assert all(node.input[8] == zero_inits[0].name for node in model.graph.node)


def test_function_is_generic_and_matches_the_model_opset():
    model = one_node_model(17, torch.float32, alibi=True)
    attach_functions(model)  # a second call replaces, never duplicates
    (function,) = model.functions
    assert (function.domain, function.name) == ("trtopt", "PagedAttention")
    assert [(o.domain, o.version) for o in function.opset_import] == [("", 17)]
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 17), ("trtopt", 1)}
    assert {"scale", "causal", "sliding_window", "plugin_namespace"} <= set(function.attribute)
    refs = {a.ref_attr_name for n in function.node for a in n.attribute if a.ref_attr_name}
    assert refs == {"scale", "causal", "sliding_window"}, "per-layer values must come from the node, not the body"
    assert make_function(23).name == make_function(17).name == "PagedAttention"
    node = model.graph.node[0]
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "plugin_namespace")) == b"trtopt"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), alibi=st.booleans(), block_size=st.sampled_from([16, 32]))
def test_property_random_steps(data, alibi, block_size):
    num_seqs = data.draw(st.integers(1, 4))
    context_lens = data.draw(st.lists(st.integers(1, 80), min_size=num_seqs, max_size=num_seqs))
    new_tokens = [data.draw(st.integers(1, min(c, 16))) for c in context_lens]
    step = make_step(random.Random(data.draw(st.integers(0, 10_000))), context_lens=context_lens,
                     new_tokens=new_tokens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                     block_size=block_size, skip_slots=data.draw(st.integers(0, 2)))
    slopes = torch.rand(NUM_HEADS) if alibi else None
    compare(session(23, torch.float32, alibi), step, alibi_slopes=slopes)
