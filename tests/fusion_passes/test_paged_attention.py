"""The paged rule on real exports: exact counts, the §3 signature, and multi-step paged generation on ORT equal
to the original graph with past KV."""

from __future__ import annotations

import onnx
import pytest
from paged_harness import compare_generation, session

from trtopt.signature import input_names, output_names

# model → (layers, heads, kv heads, head_dim, expected counts beyond the attention/logits ones)
MODELS = {
    "tiny-gpt2": {"rms_norm": 0, "matmul_add": 0, "horizontal_matmul": 0},  # GPT-2's c_attn is one GEMM already
    "tiny-llama": {"rms_norm": 5, "matmul_add": 0, "horizontal_matmul": 4},  # qkv and gate/up in 2 layers
    "tiny-qwen2": {"rms_norm": 5, "matmul_add": 2, "horizontal_matmul": 4},  # the qkv biases: one per layer
}
CASES = [(m, e) for m in MODELS for e in ("dynamo", "legacy")]


def _dims(config: dict) -> tuple[int, int, int, int]:
    layers = config.get("num_hidden_layers") or config["n_layer"]
    heads = config.get("num_attention_heads") or config["n_head"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or config["n_embd"]) // heads
    return layers, heads, kv_heads, head_dim


@pytest.mark.parametrize("model,exporter", CASES)
def test_exact_fusion_counts(fused, model, exporter):
    result = fused(model, exporter)
    layers, *_ = _dims(result.config)
    counts = result.report.counts
    assert result.report.kind == "paged"
    assert counts["paged_attention"] == layers
    assert counts["logits_gather"] == 1
    for name, expected in MODELS[model].items():
        assert counts[name] == expected, (name, counts)
    assert not result.report.unfused


@pytest.mark.parametrize("model,exporter", CASES)
def test_signature_and_checker(fused, model, exporter):
    result = fused(model, exporter)
    layers, heads, kv_heads, head_dim = _dims(result.config)
    graph = result.proto.graph
    inputs, outputs = input_names(layers), output_names(layers)
    assert [i.name for i in graph.input] == inputs
    assert [o.name for o in graph.output] == outputs
    nodes = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == layers
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == "trtopt" and attrs["plugin_namespace"] == b"trtopt"
        assert (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]) == (heads, kv_heads, head_dim)
        assert attrs["scale"] == pytest.approx(head_dim**-0.5, rel=1e-6)
        assert attrs["causal"] == 1 and attrs["sliding_window"] == 0
    assert ("trtopt", 1) in [(o.domain, o.version) for o in result.proto.opset_import]
    # Nothing of the old mask/cache plumbing survives.
    names = {i for n in graph.node for i in n.input}
    assert not any(n.startswith("past_key_values") or n == "attention_mask" for n in names)
    onnx.checker.check_model(result.proto, full_check=True)


@pytest.mark.parametrize("model,exporter", CASES)
def test_paged_generation_matches_original(fused, model, exporter):
    """Prompt (chunked for one sequence), then decode steps, two sequences of different lengths packed per step."""
    result = fused(model, exporter)
    layers, _, kv_heads, head_dim = _dims(result.config)
    err = compare_generation(
        session(result.proto.SerializeToString()),
        session(str(result.source / "model.onnx")),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=4,
        prompts=[[5, 17, 33, 2, 90, 11, 7, 41, 3], [3, 4, 99]],
        decode_steps=4,
        chunk=4,
    )
    assert err <= 1e-4


def test_fp16_export_keeps_fp16_pools_and_float32_logits(tmp_path):
    """fp16: pools in fp16, RMSNorm fused across HF's fp32 upcast, logits cast to float32 (§3)."""
    import numpy as np
    from paged_harness import PagedRunner, ReferenceRunner, Seq

    from trtopt.builder.pipeline import build_plan
    from trtopt.export import export_model

    export_model("tiny-llama", tmp_path / "onnx", exporter="dynamo", dtype="fp16", force=True)
    result = build_plan(tmp_path / "onnx", tmp_path / "plan", progress=False)
    facts = result.config.model
    assert facts.dtype == "float16"
    assert result.report.counts["rms_norm"] == 5 and result.report.counts["paged_attention"] == facts.num_layers
    plan = onnx.load(str(tmp_path / "plan" / "model.onnx"))
    assert plan.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT

    paged = PagedRunner(
        session(str(tmp_path / "plan" / "model.onnx")),
        num_layers=facts.num_layers,
        num_kv_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        block_size=16,
        dtype=np.float16,
    )
    ref = ReferenceRunner(session(str(tmp_path / "onnx" / "model.onnx")))
    seq = Seq([5, 17, 33, 2, 90])
    got = paged.step([seq], [5])[0]
    want, _ = ref.step(ref.new_state(facts.num_kv_heads, facts.head_dim, np.float16), seq.tokens, 0)
    want = want.astype(np.float32)
    # fp16 storage: the bound is fp16 resolution at the logits' scale, not the fp32 1e-4.
    assert np.abs(got - want).max() <= 2e-3 * max(1.0, np.abs(want).max())


def test_opset_23_export_with_onnx_attention_ops(tmp_path):
    """At opset 23 the dynamo exporter emits the standard Attention op (and RMSNormalization, RotaryEmbedding)."""
    from trtopt.export import export_model

    export_model("tiny-llama", tmp_path / "onnx", exporter="dynamo", opset=23, force=True)
    import json

    import onnx_ir as ir

    from trtopt.builder.model_facts import head_dims_from_config
    from trtopt.fusion_passes import optimize
    from trtopt.plugins import attach_functions

    source = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    assert any(n.op_type == "Attention" for n in source.graph.node)
    config = json.loads((tmp_path / "onnx" / "config.json").read_text())
    graph = ir.load(str(tmp_path / "onnx" / "model.onnx"))
    report = optimize(graph, dims=head_dims_from_config(config), block_size=4, vocab_size=config["vocab_size"])
    layers, _, kv_heads, head_dim = _dims(config)
    assert report.counts["paged_attention"] == layers and not report.unfused
    fused = attach_functions(ir.to_proto(graph))
    err = compare_generation(
        session(fused.SerializeToString()),
        session(str(tmp_path / "onnx" / "model.onnx")),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=4,
        prompts=[[5, 17, 33, 2, 90, 11, 7, 41, 3], [3, 4, 99]],
        decode_steps=3,
        chunk=4,
    )
    assert err <= 1e-4


def test_bf16_export_builds(exported, tmp_path):
    """ORT's CPU provider has no bf16 kernels: the mask probe runs a float32 copy of the mask subgraph instead."""
    from trtopt.builder.pipeline import build_plan

    source = exported("tiny-llama", "dynamo", dtype="bf16").out_dir  # shared with tests/export/test_export.py
    result = build_plan(source, tmp_path / "plan", progress=False)
    assert result.config.model.dtype == "bfloat16"
    assert result.report.counts["paged_attention"] == result.config.model.num_layers
    assert result.report.counts["rms_norm"] == 5
    plan = onnx.load(str(tmp_path / "plan" / "model.onnx"))
    assert plan.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    cache = next(i for i in plan.graph.input if i.name == "kv_cache.0")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
