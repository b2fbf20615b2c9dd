"""A plan built with `--kv-cache-dtype fp8 --kv-cache-smoothing kv` (and with the Hadamard rotation on top) on the
CPU (tiny Llama): what the build writes and prints, greedy decoding on the torch executor equal to the ONNX body on
onnxruntime, an error of FP8's size against the float32 plan, the self-draft plan, old plan.json files, and the
one-line errors a user can meet. The pass's exactness on float32 pools and the calibration's means are tested in
tests/fusion_passes/test_kv_smoothing.py."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from trtopt.builder.plan import Limits, PlanConfig, read_plan
from trtopt.errors import BuildError, ConfigError
from trtopt.fusion_passes.kv_rotation import INITIALIZER_PREFIX as HADAMARD_PREFIX
from trtopt.fusion_passes.kv_smoothing import INITIALIZER_PREFIX
from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
from trtopt.runtime.config import EngineConfig, load_tokenizer
from trtopt.runtime.sampling_params import SamplingParams

from build_errors import one_line_error
from stepping import assert_idle, run_all

MODEL = "tiny-llama"
LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plans(export_dir, plan_dir, module_tmp):
    """The tiny Llama's plans: "auto" (the session's float32 plan), "fp8", "smooth" (fp8 + K/V smoothing) and
    "both" (fp8 + smoothing + the Hadamard rotation)."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.runtime.kv_calibration import kv_stats

    out = {"auto": plan_dir(MODEL)}
    for name, smoothing, rotation in (("fp8", "none", "none"), ("smooth", "kv", "none"), ("both", "kv", "hadamard")):
        out[name] = build_plan(export_dir(MODEL), module_tmp / name, limits=LIMITS, force=True, progress=False,
                               kv_cache_dtype="fp8", kv_cache_smoothing=smoothing,
                               kv_cache_rotation=rotation, kv_calibrator=kv_stats).plan_dir
    return out


def _greedy(backend: str, plan_dir) -> list[list[int]]:
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.executors import create_executor

    executor = create_executor(backend, plan_dir, read_plan(plan_dir))
    eng = LLMEngine(executor, read_plan(plan_dir), load_tokenizer(plan_dir), EngineConfig(max_model_len=128))
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    done = run_all(eng)
    assert_idle(eng)
    return [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]


def test_the_build_records_the_smoothing_in_plan_json_the_report_and_the_graph(plans):
    plan = read_plan(plans["smooth"])
    assert (plan.kv_cache_dtype, plan.kv_cache_smoothing, plan.kv_cache_rotation) == ("fp8", "kv", "none")
    assert json.loads((plans["smooth"] / "plan.json").read_text())["kv_cache_smoothing"] == "kv"
    for name in ("fp8", "auto"):  # plans without it do not name it (they read and write the same file as before)
        assert "kv_cache_smoothing" not in json.loads((plans[name] / "plan.json").read_text())
        assert read_plan(plans[name]).kv_cache_smoothing == "none"
    report = json.loads((plans["smooth"] / "fusion_report.json").read_text())["kv_smoothing"]
    assert report == {**report, "windows": 8, "tokens": 8 * 256, "device": "cpu"}  # windows of max_model_len (no BOS)

    layers = plan.model.num_layers
    for name, rotated in (("smooth", False), ("both", True)):
        graph = onnx.load(str(plans[name] / "model.onnx"), load_external_data=False).graph
        produced_by = {out: node for node in graph.node for out in node.output}
        inits = {t.name: t for t in graph.initializer}
        for layer, node in enumerate(n for n in graph.node if n.op_type == "PagedAttention"):
            k = produced_by[node.input[1]]
            if rotated:  # (k - b_k)·H: the rotation runs after the smoothing
                assert k.op_type == "MatMul" and k.input[1].startswith(HADAMARD_PREFIX)
                k = produced_by[k.input[0]]
            assert k.op_type == "Sub" and k.input[1] == f"{INITIALIZER_PREFIX}k_{layer}"
            assert produced_by[k.input[0]].op_type == "Rope"
            b = inits[f"{INITIALIZER_PREFIX}k_{layer}"]
            assert list(b.dims) == [1, plan.model.num_kv_heads, 1, plan.model.head_dim]
            assert b.data_type == onnx.TensorProto.FLOAT
            assert produced_by[node.input[2]].op_type == "Sub"
        assert sum(n.op_type == "Add" and n.input[1].startswith(f"{INITIALIZER_PREFIX}v_out_")
                   for n in graph.node) == layers


def test_torch_executor_greedy_equals_the_onnx_body_on_onnxruntime(plans):
    for name in ("smooth", "both"):
        tokens = {backend: _greedy(backend, plans[name]) for backend in ("torch", "onnxruntime")}
        assert tokens["torch"] == tokens["onnxruntime"]
        assert all(len(t) == 20 for t in tokens["torch"])


def test_the_smoothed_plan_errs_like_fp8_against_the_float32_plan(plans):
    """A prefill and three decode steps: the smoothed FP8 plan's logits differ from the float32 plan's by what FP8
    rounding does, not more; a broken smoothing (a mean not added back, or subtracted from q) would change them."""
    from trtopt.runtime.executors import create_executor
    from trtopt.runtime.input_builder import InputBuilder

    plan = read_plan(plans["auto"])
    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 5000, 40)]
    steps = [builder.build(ScheduledBatch([ScheduledSeq("a", tokens[:37], 0, [1, 2, 3], True,
                                                        prompt_logprob_positions=range(37))], 37, []))]
    steps += [builder.build(ScheduledBatch([ScheduledSeq("a", [tokens[i]], i, [1, 2, 3], True)], 1, []))
              for i in range(37, 40)]
    logits = {}
    for name in ("auto", "fp8", "smooth", "both"):
        ex = create_executor("torch", plans[name], read_plan(plans[name]))
        ex.allocate_kv_cache(8)
        logits[name] = torch.cat([ex.execute(s).float() for s in steps])

    def kl(name: str) -> float:
        ref, lp = torch.log_softmax(logits["auto"], -1), torch.log_softmax(logits[name], -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    for name in ("smooth", "both"):
        assert 0 < kl(name) < 2 * kl("fp8") and kl(name) < 0.02, (name, kl(name), kl("fp8"))


def test_a_self_draft_plan_keeps_the_smoothing(plans, tmp_path):
    from trtopt.builder.draft import build_draft_plan

    draft = build_draft_plan(plans["smooth"], 1, tmp_path / "draft_1")
    assert read_plan(draft).kv_cache_smoothing == "kv"
    graph = onnx.load(str(draft / "model.onnx"), load_external_data=False).graph
    assert sorted(t.name for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX)) == [
        f"{INITIALIZER_PREFIX}{what}_0" for what in ("k", "v", "v_out")]


def test_old_plan_json_reads_as_none_and_an_unknown_smoothing_is_refused(plans):
    data = json.loads((plans["fp8"] / "plan.json").read_text())
    assert "kv_cache_smoothing" not in data and PlanConfig.from_dict(data).kv_cache_smoothing == "none"
    with pytest.raises(BuildError, match="kv_cache_smoothing 'q'"):
        PlanConfig.from_dict({**data, "kv_cache_smoothing": "q"})


def test_bad_smoothing_options_are_one_line_errors(export_dir, tmp_path):
    source = str(export_dir(MODEL))
    line = one_line_error([source, "--kv-cache-smoothing", "kv"], tmp_path / "a")
    assert "--kv-cache-smoothing kv" in line and "--kv-cache-dtype fp8" in line
    line = one_line_error([source, "--kv-cache-dtype", "fp8", "--kv-cache-smoothing", "q"], tmp_path / "b")
    assert "--kv-cache-smoothing 'q'" in line and "none, k, kv" in line


def test_a_source_without_a_tokenizer_is_a_config_error(export_dir, tmp_path):
    import shutil

    from trtopt.builder.pipeline import build_plan

    source = tmp_path / "source"
    shutil.copytree(export_dir(MODEL), source)
    for f in source.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    from trtopt.runtime.kv_calibration import kv_stats

    with pytest.raises(ConfigError, match="tokenizer files"):
        build_plan(source, tmp_path / "plan", limits=LIMITS, progress=False, kv_cache_dtype="fp8",
                   kv_cache_smoothing="k", kv_calibrator=kv_stats)
    # The builder cannot run the graph itself: without the runtime's calibrator it says what to pass.
    with pytest.raises(ConfigError, match="kv_calibrator=trtopt.runtime.kv_calibration.kv_stats"):
        build_plan(export_dir(MODEL), tmp_path / "plan2", limits=LIMITS, progress=False, kv_cache_dtype="fp8",
                   kv_cache_smoothing="k")


def test_the_build_summary_names_the_smoothing_and_its_calibration(export_dir, tmp_path):
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["build", str(export_dir(MODEL)), "-o", str(tmp_path / "plan"),
                                      "--kv-cache-dtype", "fp8", "--kv-cache-smoothing", "k",
                                      "--max-model-len", "128"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "KV cache float8_e4m3fn, K smoothed (calibrated on 8 x 128 tokens" in text, text


def test_smoothing_builds_with_tensor_parallel(export_dir, tmp_path):
    """With --tensor-parallel every rank plan is smoothed, each with its KV heads' means (the slices are checked in
    tests/runtime/test_tensor_parallel.py)."""
    from trtopt.builder.plan import rank_dir
    from trtopt.cli.main import app

    plan = tmp_path / "plan"
    result = CliRunner().invoke(app, ["build", str(export_dir(MODEL)), "-o", str(plan), "--kv-cache-dtype", "fp8",
                                      "--kv-cache-smoothing", "k", "--tensor-parallel", "2", "--max-model-len", "128"])
    assert result.exit_code == 0, result.output
    assert "K smoothed (calibrated on 8 x 128 tokens" in " ".join(result.output.split())
    for rank in range(2):
        config = read_plan(rank_dir(plan, rank))
        assert (config.kv_cache_smoothing, config.parallel.rank, config.model.num_kv_heads) == ("k", rank, 1)
        graph = onnx.load(str(rank_dir(plan, rank) / "model.onnx"), load_external_data=False).graph
        means = [t for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX)]
        assert len(means) == config.model.num_layers
        assert all(list(t.dims) == [1, 1, 1, config.model.head_dim] for t in means)
