"""trtopt ops through the converter: the torch implementation and the inlined ONNX body both equal onnxruntime."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from test_cpu_attention import random_step
from trtopt.plugins import attach_functions, make_node
from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch

HQ, HKV, D = 6, 2, 16
vi = helper.make_tensor_value_info


def save(model: onnx.ModelProto, path) -> str:
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return str(path)


def run_three_ways(path: str, feeds: dict[str, np.ndarray], body_op: str) -> tuple[list, list, list]:
    """(onnxruntime, converter with the torch op, converter with the op's body inlined) outputs."""
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    results = []
    for body_ops in ((), (body_op,)):
        converted = onnx_to_torch(path, body_ops=body_ops)
        args = [torch.from_numpy(feeds[n].copy()) for n in converted.input_names]
        with torch.inference_mode():
            results.append([o.numpy() for o in converted.module(*args)])
    return expected, results[0], results[1]


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_flash_attention(causal, with_bias, tmp_path):
    inputs = [vi("q", TensorProto.FLOAT, ["B", HQ, "S", D]), vi("k", TensorProto.FLOAT, ["B", HKV, "Sk", D]),
              vi("v", TensorProto.FLOAT, ["B", HKV, "Sk", D])]
    if with_bias:
        inputs.append(vi("attn_bias", TensorProto.FLOAT, ["B", 1, 1, "Sk"]))
    node = make_node("FlashAttention", [i.name for i in inputs], ["out"], num_heads=HQ, num_kv_heads=HKV,
                     head_dim=D, scale=0.3, causal=causal)
    graph = helper.make_graph([node], "g", inputs, [vi("out", TensorProto.FLOAT, ["B", HQ, "S", D])])
    model = attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    path = save(model, tmp_path / "flash.onnx")
    rng = np.random.default_rng(causal * 2 + with_bias)
    for batch, s, sk in [(2, 5, 5), (1, 3, 9)]:
        feeds = {"q": rng.standard_normal((batch, HQ, s, D)), "k": rng.standard_normal((batch, HKV, sk, D)),
                 "v": rng.standard_normal((batch, HKV, sk, D))}
        if with_bias:
            bias = np.zeros((batch, 1, 1, sk))
            bias[0, ..., -2:] = -1e9  # the last two keys of batch row 0 are padding
            feeds["attn_bias"] = bias
        feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
        expected, by_op, by_body = run_three_ways(path, feeds, "FlashAttention")
        np.testing.assert_allclose(by_op[0], expected[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(by_body[0], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,alibi", [(0, False), (0, True), (7, False), (7, True)])
def test_paged_attention_with_window_and_alibi(window, alibi, tmp_path):
    names = ["q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping"]
    inputs = [vi("q", TensorProto.FLOAT, [1, HQ, "T", D]), vi("k", TensorProto.FLOAT, [1, HKV, "T", D]),
              vi("v", TensorProto.FLOAT, [1, HKV, "T", D]),
              vi("kv_cache", TensorProto.FLOAT, ["nb", 2, HKV, 16, D]),
              vi("block_tables", TensorProto.INT32, ["S", "mb"]), vi("seq_lens", TensorProto.INT32, ["S"]),
              vi("query_start_loc", TensorProto.INT32, ["S1"]), vi("slot_mapping", TensorProto.INT64, ["T"])]
    if alibi:
        inputs.append(vi("alibi_slopes", TensorProto.FLOAT, [HQ]))
        names.append("alibi_slopes")
    node = make_node("PagedAttention", names, ["out", "kv_cache_out"], num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                     scale=0.25, causal=1, sliding_window=window)
    outputs = [vi("out", TensorProto.FLOAT, [1, HQ, "T", D]), vi("kv_cache_out", TensorProto.FLOAT, ["nb", 2, HKV, 16, D])]
    graph = helper.make_graph([node], "g", inputs, outputs)
    model = attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    path = save(model, tmp_path / "paged.onnx")
    rng = random.Random(window + alibi)
    for decode_only in (False, True):
        tables, lens, qsl, slots, cache = random_step(rng, num_seqs=4, decode_only=decode_only, block_size=16,
                                                      num_blocks=40, hkv=HKV, d=D, dtype=torch.float32)
        T = int(qsl[-1])
        feeds = {"q": torch.randn(1, HQ, T, D), "k": torch.randn(1, HKV, T, D), "v": torch.randn(1, HKV, T, D),
                 "kv_cache": cache, "block_tables": tables, "seq_lens": lens, "query_start_loc": qsl,
                 "slot_mapping": slots}
        if alibi:
            feeds["alibi_slopes"] = torch.tensor([2.0 ** -(i + 1) for i in range(HQ)])
        feeds = {k: v.numpy() for k, v in feeds.items()}
        expected, by_op, by_body = run_three_ways(path, feeds, "PagedAttention")
        for got in (by_op, by_body):
            np.testing.assert_allclose(got[0], expected[0], atol=1e-5, rtol=1e-5)
            # Block 0 is the null block: the body parks skipped writes there, the torch op skips them.
            np.testing.assert_array_equal(got[1][1:], expected[1][1:])


def test_zero_markers_of_absent_inputs_become_none(plan_dir):
    """attach_functions wires zeros for absent optional inputs (the bodies need a tensor); the torch op gets None."""
    from trtopt.runtime.executors.trtopt_ops import paged_attention

    converted = onnx_to_torch(plan_dir("tiny-llama") / "model.onnx")
    calls = [n for n in converted.module.graph.nodes if n.target is paged_attention]
    assert calls and all(len(n.args) == 8 for n in calls)  # alibi_slopes dropped: no ALiBi work at all
