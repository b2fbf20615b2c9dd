"""The converter on ORIGINAL exports (standard ops, past KV in and present KV out) against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch

# (new tokens T, past length P, left padding): prefill, decode, chunk after a long past, padded batch row
SHAPES = [(7, 0, 0), (1, 1, 0), (1, 33, 0), (5, 12, 0), (4, 6, 3)]


def feeds_for(sess: ort.InferenceSession, T: int, P: int, pad: int, vocab: int, rng) -> dict[str, np.ndarray]:
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, vocab, (1, T)).astype(np.int64)
        elif i.name == "attention_mask":
            mask = np.ones((1, P + T), np.int64)
            mask[0, :pad] = 0  # left padding inside the past
            feeds[i.name] = mask
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(P, P + T)[None].astype(np.int64) - pad
        else:  # past_key_values.{i}.key/value: [1, Hkv, P, D]
            heads, dim = i.shape[1], i.shape[3]
            feeds[i.name] = rng.standard_normal((1, heads, P, dim)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2", "tiny-qwen2"])
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_original_export_matches_onnxruntime(model, exporter, export_dir):
    path = export_dir(model, exporter) / "model.onnx"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    converted = onnx_to_torch(path)
    assert converted.output_names == [o.name for o in sess.get_outputs()]
    vocab = sess.get_outputs()[0].shape[-1]
    assert isinstance(vocab, int)
    rng = np.random.default_rng(0)
    for T, P, pad in SHAPES:
        feeds = feeds_for(sess, T, P, pad, vocab, rng)
        expected = sess.run(None, feeds)
        with torch.inference_mode():
            got = converted.module(*[torch.from_numpy(feeds[n]) for n in converted.input_names])
        for name, e, g in zip(converted.output_names, expected, got):
            assert e.shape == tuple(g.shape), (name, T, P)
            np.testing.assert_allclose(g.numpy(), e, atol=1e-4, rtol=0, err_msg=f"{name} at T={T} P={P} pad={pad}")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2", "tiny-qwen2"])
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_shape_arithmetic_never_reads_device_data(model, exporter, export_dir):
    """On the meta device (shapes, no data) the graph runs end to end: every shape computation is a host value,
    so on CUDA nothing would sync with the GPU outside attention. Shapes must equal onnxruntime's."""
    path = export_dir(model, exporter) / "model.onnx"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    converted = onnx_to_torch(path, device="meta")
    feeds = feeds_for(sess, 5, 12, 0, 100, np.random.default_rng(0))
    expected = sess.run(None, feeds)
    with torch.inference_mode():
        got = converted.module(*[torch.from_numpy(feeds[n]).to("meta") for n in converted.input_names])
    assert all(g.device.type == "meta" for g in got)
    assert [tuple(g.shape) for g in got] == [e.shape for e in expected]
