"""`trtopt build` end to end on a tiny export: the plan dir, the CLI, and every user-error case."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits, read_plan
from trtopt.errors import BuildError, ConfigError, FusionError


@pytest.fixture(scope="module")
def llama_plan(export_dir, tmp_path_factory):
    source = export_dir("tiny-llama", "dynamo")
    out = tmp_path_factory.mktemp("plan") / "tiny-llama"
    return source, build_plan(
        source, out, limits=Limits(block_size=32, max_num_tokens=256, max_num_seqs=8), progress=False
    )


def test_plan_dir_contents(llama_plan):
    source, result = llama_plan
    plan_dir = result.plan_dir
    config = json.loads((source / "config.json").read_text())
    plan = read_plan(plan_dir)
    assert plan.kind == "paged"
    facts = plan.model
    assert facts.num_layers == config["num_hidden_layers"]
    assert facts.num_heads == config["num_attention_heads"]
    assert facts.num_kv_heads == config["num_key_value_heads"]
    assert facts.head_dim == config["hidden_size"] // config["num_attention_heads"]
    assert facts.vocab_size == config["vocab_size"]
    assert facts.dtype == "float32" and facts.model_type == "llama"
    assert facts.eos_token_ids and facts.max_position_embeddings == config["max_position_embeddings"]
    assert plan.limits == Limits(
        block_size=32, max_num_tokens=256, max_num_seqs=8, max_model_len=min(2048, config["max_position_embeddings"])
    )
    report = json.loads((plan_dir / "fusion_report.json").read_text())
    assert report["kind"] == "paged" and report["counts"]["paged_attention"] == facts.num_layers
    assert report["unfused"] == []
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (plan_dir / name).is_file(), name
    model = onnx.load(str(plan_dir / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert {f.name for f in model.functions} >= {"PagedAttention", "RMSNorm"}
    cache = next(i for i in model.graph.input if i.name == "kv_cache.0")
    dims = [d.dim_value or d.dim_param for d in cache.type.tensor_type.shape.dim]
    assert dims == ["num_blocks", 2, facts.num_kv_heads, 32, facts.head_dim]


def test_cli_prints_the_fusion_table(llama_plan, tmp_path):
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    source, _ = llama_plan
    result = CliRunner().invoke(
        app, ["build", str(source), "-o", str(tmp_path / "p"), "--block-size", "16", "--explain"]
    )
    assert result.exit_code == 0, result.output
    assert "paged_attention" in result.output and "every attention-like region fused" in result.output
    assert read_plan(tmp_path / "p").limits.block_size == 16


def test_cli_reports_errors_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    (tmp_path / "model.onnx").write_text("not a model")
    result = CliRunner().invoke(app, ["build", str(tmp_path), "-o", str(tmp_path / "p")])
    assert result.exit_code == 1
    assert "BuildError" in result.output and "Traceback" not in result.output


def test_not_onnx(tmp_path):
    (tmp_path / "model.onnx").write_text("hello, I am not a protobuf\n" * 10)
    with pytest.raises(BuildError, match="not .*ONNX"):
        build_plan(tmp_path, tmp_path / "plan", progress=False)


def test_corrupt_file(llama_plan, tmp_path):
    source, _ = llama_plan
    data = (source / "model.onnx").read_bytes()
    (tmp_path / "model.onnx").write_bytes(data[: len(data) // 3])
    with pytest.raises(BuildError):
        build_plan(tmp_path, tmp_path / "plan", progress=False)


def test_missing_model(tmp_path):
    with pytest.raises(BuildError, match="does not exist"):
        build_plan(tmp_path / "nope", tmp_path / "plan", progress=False)


def _external_data_model(model_dir, location: str) -> None:
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=location)
    weight.external_data.add(key="offset", value="0")
    weight.external_data.add(key="length", value="64")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(model_dir / "model.onnx"))


def test_external_data_outside_the_model_dir_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    _external_data_model(tmp_path / "model", "../secret.bin")
    with pytest.raises(BuildError, match="outside the model directory"):
        build_plan(tmp_path / "model", tmp_path / "plan", progress=False)


def test_external_data_absolute_path_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    _external_data_model(tmp_path / "model", str(tmp_path / "secret.bin"))
    with pytest.raises(BuildError, match="outside the model directory"):
        build_plan(tmp_path / "model", tmp_path / "plan", progress=False)


def test_truncated_external_data_is_refused(tmp_path):
    _external_data_model(tmp_path / "model", "w.bin")
    (tmp_path / "model" / "w.bin").write_bytes(b"\0" * 10)
    with pytest.raises(BuildError, match="truncated"):
        build_plan(tmp_path / "model", tmp_path / "plan", progress=False)


def test_cache_graph_without_collapsible_attention(tmp_path):
    """past → Concat → present, but no attention reads it (scores are not a softmax of QKᵀ)."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        helper.make_node("ReduceSum", ["present.0.key"], ["s"], keepdims=0),
        helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
        helper.make_node("MatMul", ["h", "head"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["p"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "T"]),
            helper.make_tensor_value_info("past_key_values.0.key", f, [1, 2, "P", 4]),
            helper.make_tensor_value_info("k", f, [1, 2, "T", 4]),
        ],
        [
            helper.make_tensor_value_info("logits", f, [1, "T", 8]),
            helper.make_tensor_value_info("present.0.key", f, [1, 2, "L", 4]),
            helper.make_tensor_value_info("p", f, [1, "T", 8]),
        ],
        [
            numpy_helper.from_array(np.ones((8, 4), np.float32), "emb"),
            numpy_helper.from_array(np.ones((4, 8), np.float32), "head"),
        ],
    )
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "m" / "model.onnx"))
    with pytest.raises(FusionError, match="no attention could be collapsed") as info:
        build_plan(tmp_path / "m", tmp_path / "plan", progress=False)
    assert "not MatMul(probs, v)" in str(info.value)  # the failed check is named


@pytest.mark.parametrize(
    "limits,message",
    [
        (Limits(block_size=7), "block-size"),
        (Limits(max_num_seqs=0), "max-num-seqs"),
        (Limits(max_num_tokens=8, max_num_seqs=16), "max-num-seqs"),
    ],
)
def test_bad_option_values(llama_plan, tmp_path, limits, message):
    source, _ = llama_plan
    with pytest.raises(ConfigError, match=message):
        build_plan(source, tmp_path / "plan", limits=limits, progress=False)


def test_max_model_len_beyond_the_model_context(llama_plan, tmp_path):
    source, _ = llama_plan
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        build_plan(source, tmp_path / "plan", max_model_len=10**7, progress=False)


def test_non_empty_output_needs_force(llama_plan, tmp_path):
    source, _ = llama_plan
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "keep.txt").write_text("x")
    with pytest.raises(BuildError, match="--force"):
        build_plan(source, tmp_path / "plan", progress=False)
    build_plan(source, tmp_path / "plan", force=True, progress=False)
    assert not (tmp_path / "plan" / "keep.txt").exists()


def test_a_plan_is_not_rebuilt(llama_plan, tmp_path):
    _, result = llama_plan
    with pytest.raises(BuildError, match="already a trtopt plan"):
        build_plan(result.plan_dir, tmp_path / "again", progress=False)


def _export_conv_net(path, classifier_softmax: bool) -> None:
    import torch

    class ConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.fc = torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 3), torch.nn.Linear(4, 10)

        def forward(self, x):
            logits = self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))
            return torch.softmax(logits, -1) if classifier_softmax else logits

    path.parent.mkdir(parents=True, exist_ok=True)
    with pytest.warns(DeprecationWarning):  # the legacy exporter is the quick one for a 5-op graph
        torch.onnx.export(ConvNet().eval(), (torch.randn(1, 3, 16, 16),), str(path), dynamo=False,
                          input_names=["pixels"], output_names=["scores"])


@pytest.mark.parametrize("classifier_softmax", [False, True])
def test_a_conv_net_is_refused(tmp_path, classifier_softmax):
    """Not an LLM or an encoder: a BuildError that says what the graph holds, and no plan (it used to 'build' a
    0-layer plan and print 'every attention-like region fused')."""
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    _export_conv_net(tmp_path / "conv" / "model.onnx", classifier_softmax)
    with pytest.raises(BuildError, match=r"not a causal LM or a transformer encoder.*no KV-cache inputs.*pixels") as e:
        build_plan(tmp_path / "conv", tmp_path / "plan", progress=False)
    if classifier_softmax:  # the Softmax was examined as attention: the failed check is named
        assert "1 Softmax region(s) examined as attention" in str(e.value) and "/Softmax" in str(e.value)
    else:
        assert "no attention" in str(e.value) and "Conv×2" in str(e.value)
    assert not (tmp_path / "plan").exists()
    result = CliRunner().invoke(app, ["build", str(tmp_path / "conv"), "-o", str(tmp_path / "plan"), "--explain"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 1 and "BuildError" in result.output and "Traceback" not in result.output
    assert "every attention-like region fused" not in result.output
