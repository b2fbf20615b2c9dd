"""The FlashAttention rule: the attention forms the exporters produce fuse and keep their numbers; the real
all-MiniLM-L6-v2 fuses all 6 layers with both exporters."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from graphs import FLOAT, apply, const, model, run
from onnx import TensorProto, helper

from trtopt.fusion_passes.context import HeadDims, PassContext
from trtopt.fusion_passes.flash_attention import fuse_flash_attention
from trtopt.fusion_passes.trace import Trace

H, HKV, S, D = 4, 2, 5, 8
RNG = np.random.default_rng(3)


def _attention_graph(scale_form: str, mask_form: str | None, guard: bool, gqa: bool, softmax_axis: int = -1):
    scale = D**-0.5
    nodes = [const("perm_dummy", np.int64(0))]
    kv_heads = HKV if gqa else H
    k, v = "k", "v"
    if gqa:
        nodes += [
            const("ax2", np.array([2], np.int64)),
            const("eshape", np.array([1, HKV, H // HKV, S, D], np.int64)),
            const("rshape", np.array([1, H, S, D], np.int64)),
        ]
        for name in ("k", "v"):
            nodes += [
                helper.make_node("Unsqueeze", [name, "ax2"], [f"{name}_u"]),
                helper.make_node("Expand", [f"{name}_u", "eshape"], [f"{name}_e"]),
                helper.make_node("Reshape", [f"{name}_e", "rshape"], [f"{name}_r"]),
            ]
        k, v = "k_r", "v_r"
    nodes += [helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2])]
    q, kt = "q", "kt"
    if scale_form == "sqrt_both":
        nodes += [
            const("s", np.float32(scale**0.5)),
            helper.make_node("Mul", ["q", "s"], ["qs"]),
            helper.make_node("Mul", ["kt", "s"], ["kts"]),
        ]
        q, kt = "qs", "kts"
    nodes += [helper.make_node("MatMul", [q, kt], ["scores"])]
    scores = "scores"
    if scale_form == "mul_after":
        nodes += [const("c", np.float32(scale)), helper.make_node("Mul", ["scores", "c"], ["scaled"])]
        scores = "scaled"
    elif scale_form == "div_after":
        nodes += [const("c", np.float32(D**0.5)), helper.make_node("Div", ["scores", "c"], ["scaled"])]
        scores = "scaled"
    inputs = [
        helper.make_tensor_value_info("q", FLOAT, [1, H, S, D]),
        helper.make_tensor_value_info("k", FLOAT, [1, kv_heads, S, D]),
        helper.make_tensor_value_info("v", FLOAT, [1, kv_heads, S, D]),
    ]
    if mask_form == "add":
        inputs.append(helper.make_tensor_value_info("mask", FLOAT, [1, 1, S, S]))
        nodes += [helper.make_node("Add", [scores, "mask"], ["masked"])]
        scores = "masked"
    elif mask_form == "where":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, S, S]))
        nodes += [const("neg", np.float32(-np.inf)), helper.make_node("Where", ["mask", scores, "neg"], ["masked"])]
        scores = "masked"
    nodes += [helper.make_node("Softmax", [scores], ["probs"], axis=softmax_axis)]
    probs = "probs"
    if guard:
        nodes += [
            const("zero", np.float32(0.0)),
            helper.make_node("IsNaN", ["probs"], ["nan"]),
            helper.make_node("Where", ["nan", "zero", "probs"], ["guarded"]),
        ]
        probs = "guarded"
    nodes += [helper.make_node("MatMul", [probs, v], ["out"])]
    return model(nodes, inputs, [helper.make_tensor_value_info("out", FLOAT, [1, H, S, D])])


def _feeds(proto):
    feeds = {}
    for info in proto.graph.input:
        shape = [d.dim_value for d in info.type.tensor_type.shape.dim]
        if info.type.tensor_type.elem_type == TensorProto.BOOL:
            feeds[info.name] = np.tril(np.ones(shape, bool))
        elif info.name == "mask":
            feeds[info.name] = np.where(np.tril(np.ones(shape, bool)), 0.0, -1e9).astype(np.float32)
        else:
            feeds[info.name] = RNG.standard_normal(shape).astype(np.float32)
    return feeds


def _rule(trace: Trace):
    return lambda m: fuse_flash_attention(m, PassContext(trace=trace, dims=HeadDims(H, HKV, D)))


@pytest.mark.parametrize("scale_form", ["mul_after", "div_after", "sqrt_both"])
@pytest.mark.parametrize("mask_form", ["add", "where", None])
@pytest.mark.parametrize("guard,gqa", [(False, False), (True, True)])
def test_attention_forms_fuse(scale_form, mask_form, guard, gqa):
    proto = _attention_graph(scale_form, mask_form, guard, gqa)
    count, fused = apply(proto, _rule(Trace()))
    assert count == 1
    node = next(n for n in fused.graph.node if n.domain == "trtopt")
    assert node.op_type == "FlashAttention"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["scale"] == pytest.approx(D**-0.5, rel=1e-6)
    assert attrs["num_kv_heads"] == (HKV if gqa else H)
    feeds = _feeds(proto)
    np.testing.assert_allclose(run(fused, feeds)[0], run(proto, feeds)[0], atol=1e-5)


def test_softmax_over_the_query_axis_is_explained_not_fused():
    trace = Trace()
    count, fused = apply(_attention_graph("mul_after", "add", False, False, softmax_axis=2), _rule(trace))
    assert count == 0
    assert not any(n.domain == "trtopt" for n in fused.graph.node)
    assert "axis 2" in trace.failures[0].reason


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_real_minilm_fuses_all_layers_and_keeps_outputs(minilm_dir, exporter, tmp_path):
    from trtopt.builder.pipeline import build_plan

    source = minilm_dir(exporter)
    result = build_plan(source, tmp_path / "plan", progress=False)
    assert result.report.kind == "flash" and result.config.kind == "flash"
    assert result.report.counts["flash_attention"] == 6
    assert result.report.counts["horizontal_matmul"] == 6  # q, k and v with their biases: one MatMul a layer
    assert result.report.counts["matmul_add"] == 24  # qkv, o and the two FFN linears of 6 layers
    assert not result.report.unfused
    assert result.config.model.num_layers == 6 and result.config.model.num_heads == 12

    ids = np.array([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 7592, 2088, 999, 2003, 2307, 1012, 102]])
    mask = (ids != 0).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    want = ort.InferenceSession(str(source / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(str(tmp_path / "plan" / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    assert np.abs(got - want).max() <= 1e-4
    assert (tmp_path / "plan" / "tokenizer.json").is_file()
    graph = ir.load(str(tmp_path / "plan" / "model.onnx")).graph
    assert sum(n.op_type == "FlashAttention" for n in graph) == 6


def test_prefill_only_causal_lm_gets_flash_attention(tmp_path):
    """A causal LM exported without a cache: the causal+padding mask travels as the bias, logits unchanged."""
    import torch
    import transformers

    from trtopt.builder.pipeline import build_plan
    from trtopt.export import resolve_model

    source = resolve_model("tiny-llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()

    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, input_ids, attention_mask, position_ids):
            return self.hf(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits

    names = ["input_ids", "attention_mask", "position_ids"]
    ids, mask, pos = torch.randint(0, 100, (2, 6)), torch.ones(2, 6, dtype=torch.int64), torch.arange(6)[None]
    (tmp_path / "m").mkdir()
    torch.onnx.export(
        Prefill(),
        (ids, mask, pos.expand(2, 6)),
        str(tmp_path / "m" / "model.onnx"),
        dynamo=False,
        opset_version=17,
        input_names=names,
        output_names=["logits"],
        dynamic_axes={n: {0: "B", 1: "T"} for n in [*names, "logits"]},
    )
    hf.config.save_pretrained(tmp_path / "m")
    result = build_plan(tmp_path / "m", tmp_path / "plan", progress=False)
    assert result.report.kind == "flash"
    assert result.report.counts["flash_attention"] == hf.config.num_hidden_layers

    feeds = {
        "input_ids": ids.numpy(),
        "attention_mask": np.array([[1] * 6, [1] * 4 + [0] * 2]),
        "position_ids": pos.expand(2, 6).numpy(),
    }
    want = ort.InferenceSession(str(tmp_path / "m" / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(str(tmp_path / "plan" / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    assert np.abs(got[0] - want[0]).max() <= 1e-4


@pytest.mark.parametrize("mask_type", [TensorProto.BOOL, TensorProto.FLOAT, None])
def test_onnx_attention_op_becomes_flash_attention(mask_type):
    """The standard opset-23 Attention op (4-D, GQA through repeat_kv or natively) is our op with a bias."""
    inputs = [
        helper.make_tensor_value_info("q", FLOAT, [1, H, S, D]),
        helper.make_tensor_value_info("k", FLOAT, [1, HKV, S, D]),
        helper.make_tensor_value_info("v", FLOAT, [1, HKV, S, D]),
    ]
    names = ["q", "k", "v"]
    if mask_type is not None:
        inputs.append(helper.make_tensor_value_info("mask", mask_type, [1, 1, S, S]))
        names.append("mask")
    node = helper.make_node("Attention", names, ["out"], scale=0.3)
    proto = model([node], inputs, [helper.make_tensor_value_info("out", FLOAT, [1, H, S, D])], opset=23)
    count, fused = apply(proto, _rule(Trace()))
    assert count == 1
    assert [n.op_type for n in fused.graph.node if n.domain == "trtopt"] == ["FlashAttention"]
    feeds = _feeds(proto)
    np.testing.assert_allclose(run(fused, feeds)[0], run(proto, feeds)[0], atol=1e-5)
