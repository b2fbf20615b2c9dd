"""The FlashAttention ONNX function body, run by onnxruntime, against the torch reference."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from trtopt.plugins import attach_functions, make_node
from trtopt.plugins.flash_attention.reference import flash_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
TORCH_TO_ONNX = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}


@functools.lru_cache(maxsize=None)
def session(opset: int, dtype: torch.dtype, with_bias: bool, causal: int, scale: float = 0.25):
    """One FlashAttention node; batch, heads' lengths and the bias shape are all symbolic."""
    elem = TORCH_TO_ONNX[dtype]
    vi = helper.make_tensor_value_info
    inputs = [vi("q", elem, ["B", NUM_HEADS, "S", HEAD_DIM]), vi("k", elem, ["B", NUM_KV_HEADS, "Sk", HEAD_DIM]),
              vi("v", elem, ["B", NUM_KV_HEADS, "Sk", HEAD_DIM])]
    if with_bias:
        inputs.append(vi("attn_bias", elem, ["b0", "b1", "b2", "b3"]))
    node = make_node("FlashAttention", [i.name for i in inputs], ["out"], num_heads=NUM_HEADS,
                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scale=scale, causal=causal)
    graph = helper.make_graph([node], "flash", inputs, [vi("out", elem, ["B", NUM_HEADS, "S", HEAD_DIM])])
    model = attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10))
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def padding_bias(batch: int, seq_k: int, dtype: torch.dtype) -> torch.Tensor:
    """A BERT-style [B, 1, 1, Sk] key-padding mask: row b has its last b keys padded."""
    keep = torch.ones(batch, 1, 1, seq_k)
    for b in range(batch):
        keep[b, ..., seq_k - b:] = 0
    return ((1.0 - keep) * torch.finfo(dtype).min).to(dtype)


@pytest.mark.parametrize("opset", [17, 18, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(opset, dtype, causal, with_bias):
    sess = session(opset, dtype, with_bias, causal)
    gen = torch.Generator().manual_seed(opset + causal)
    for batch, seq_q, seq_k in [(2, 7, 7), (3, 4, 10), (1, 1, 5)]:  # one session, several shapes, S != Sk
        q = torch.randn(batch, NUM_HEADS, seq_q, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(batch, NUM_KV_HEADS, seq_k, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(batch, NUM_KV_HEADS, seq_k, HEAD_DIM, generator=gen).to(dtype)
        feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}
        bias = None
        if with_bias:
            bias = padding_bias(batch, seq_k, dtype)
            feeds["attn_bias"] = bias.numpy()
        (out,) = sess.run(None, feeds)
        expected = flash_attention_ref(q, k, v, bias, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                       head_dim=HEAD_DIM, scale=0.25, causal=causal)
        atol = 1e-5 if dtype == torch.float32 else 2e-3
        np.testing.assert_allclose(out.astype(np.float32), expected.float().numpy(), atol=atol, rtol=atol)


def test_full_rank_bias():
    sess = session(18, torch.float32, True, 0, 0.125)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, NUM_HEADS, 5, HEAD_DIM, generator=gen)
    k, v = (torch.randn(2, NUM_KV_HEADS, 6, HEAD_DIM, generator=gen) for _ in range(2))
    bias = torch.randn(2, NUM_HEADS, 5, 6, generator=gen)
    (out,) = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "attn_bias": bias.numpy()})
    expected = flash_attention_ref(q, k, v, bias, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                   scale=0.125)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-5, rtol=1e-5)
