"""A plan built with `--kv-cache-dtype fp8 --kv-cache-scales amax` on the CPU (tiny Llama): the scales are each
layer's amax / 448 of what its pools hold on the calibration text (read back from the FP8 pools an executor fills),
calibrated on the final graph (after smoothing and rotation), recorded in plan.json, fusion_report.json and the build
summary; with `amax_head` (on a source whose heads have uneven ranges) every head's largest code lands within 2x of
the layer's; greedy decoding on the torch executor equals the ONNX body on onnxruntime; the self-draft plan keeps
them; and the one-line errors a user can meet. The calibration's statistics are tested in
tests/fusion_passes/test_kv_smoothing.py, the head factors' exactness in tests/fusion_passes/test_kv_head_scales.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from trtopt.builder.kv_calibration import calibration_windows
from trtopt.builder.plan import Limits, PlanConfig, read_plan
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
from trtopt.runtime.config import EngineConfig, load_tokenizer
from trtopt.runtime.sampling_params import SamplingParams

from build_errors import one_line_error
from stepping import assert_idle, run_all

MODEL = "tiny-llama"
LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PLANS = {"amax": dict(kv_cache_scales="amax"),  # name -> build_plan's KV options beside kv_cache_dtype="fp8"
         "amax_rotated": dict(kv_cache_scales="amax", kv_cache_smoothing="kv", kv_cache_rotation="hadamard_kv"),
         "search": dict(kv_cache_scales="search"),
         "one": dict()}


UNEVEN = {"amax_uneven": dict(kv_cache_scales="amax"),  # plans of the uneven source (below)
          "amax_head": dict(kv_cache_scales="amax_head", kv_cache_smoothing="kv", kv_cache_rotation="hadamard_kv")}


def _uneven_source(export: Path, out: Path) -> Path:
    """The tiny Llama export with KV head 1's keys and KV head 0's values made 16x smaller in every layer (their K/V
    projection columns divided by 16): heads of uneven range, as real models have (the random tiny model's are
    within 2x of each other)."""
    shutil.copytree(export, out)
    model = onnx.load(str(out / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    kv = [inits[n.input[1]] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
          and list(inits[n.input[1]].dims) == [64, 32]]  # [hidden, Hkv * D]: k_proj, v_proj of each layer, in order
    assert len(kv) == 4, [t.name for t in kv]
    for i, tensor in enumerate(kv):
        w = onnx.numpy_helper.to_array(tensor).copy()
        w[:, 16:] /= 16 if i % 2 == 0 else 1  # K: head 1
        w[:, :16] /= 16 if i % 2 == 1 else 1  # V: head 0
        tensor.CopyFrom(onnx.numpy_helper.from_array(w, tensor.name))
    onnx.save(model, str(out / "model.onnx"))
    return out


@pytest.fixture(scope="module")
def plans(export_dir, module_tmp):
    from trtopt.builder.pipeline import build_plan
    from trtopt.runtime.kv_calibration import kv_stats

    uneven = _uneven_source(export_dir(MODEL), module_tmp / "uneven-source")
    return {name: build_plan(source, module_tmp / name, limits=LIMITS, force=True, progress=False,
                             kv_cache_dtype="fp8", kv_calibrator=kv_stats, **options).plan_dir
            for source, table in ((export_dir(MODEL), PLANS), (uneven, UNEVEN)) for name, options in table.items()}


def _node_scales(plan_dir) -> tuple[list[float], list[float]]:
    graph = onnx.load(str(plan_dir / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "PagedAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    return [a["k_scale"] for a in attrs], [a["v_scale"] for a in attrs]


def _pool_amax_codes(plan_dir) -> np.ndarray:
    """[layers, 2 (K, V), Hkv]: the largest |FP8 code| each head of the plan's pools holds over the calibration
    windows (each window prefilled from position 0, as the calibration runs them)."""
    from trtopt.runtime.executors import create_executor
    from trtopt.runtime.input_builder import InputBuilder

    plan = read_plan(plan_dir)
    windows = calibration_windows(load_tokenizer(plan_dir), max_len=plan.limits.max_model_len)
    blocks = -(-windows.shape[1] // plan.limits.block_size)
    executor = create_executor("torch", plan_dir, plan)
    executor.allocate_kv_cache(blocks + 1)
    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    top = np.zeros((plan.model.num_layers, 2, plan.model.num_kv_heads))
    for window in windows:
        seq = ScheduledSeq("w", window.tolist(), 0, list(range(1, blocks + 1)), True)
        executor.execute(builder.build(ScheduledBatch([seq], windows.shape[1], [])))
        for layer, pool in enumerate(executor.kv_caches):  # [blocks, 2, Hkv, block, D] float8_e4m3fn
            codes = pool[1:].float().abs().amax(dim=(0, 3, 4)).numpy()  # [2, Hkv]
            top[layer] = np.maximum(top[layer], codes)
    return top


def test_the_scales_put_each_layers_largest_calibrated_value_on_448(plans):
    """The FP8 pools an executor fills with the calibration windows: layer 0's largest key and value code is exactly
    448 (its K and V do not depend on earlier layers' FP8 rounding); later layers' are within one E4M3 step of it
    (their inputs went through FP8 attention, the calibration's did not). With scales of 1.0 the tiny model's keys
    use a small corner of the range, which is what the amax scales are for."""
    for name in ("amax", "amax_rotated", "amax_uneven", "amax_head"):
        top = _pool_amax_codes(plans[name]).max(axis=2)  # [layers, 2]: over the heads
        assert (top[0] == 448).all(), (name, top)
        assert (top >= 416).all(), (name, top)  # E4M3's values below 448 are 416, 384, ...
    assert _pool_amax_codes(plans["one"]).max() < 64


def test_amax_head_brings_every_head_within_2x_of_its_layers_range(plans):
    """On the uneven source, per-layer amax scales leave the small heads' largest codes near 448 / 16; with the
    per-head powers of two every head's largest code is above half the layer's (layer 0: (224, 448]; later layers
    within an E4M3 step of that, as above)."""
    plain = _pool_amax_codes(plans["amax_uneven"])
    assert plain[:, 0, 1].max() < 64 and plain[:, 1, 0].max() < 64, plain  # K head 1, V head 0
    heads = _pool_amax_codes(plans["amax_head"])
    assert (heads[0] > 224).all() and (heads[0] <= 448).all(), heads[0]
    assert (heads >= 208).all(), heads
    report = json.loads((plans["amax_head"] / "fusion_report.json").read_text())["kv_scales"]
    factors = np.array([report["k_head_factors"], report["v_head_factors"]])  # [2 (K, V), layers, Hkv]
    assert (factors[0, :, 1] >= 8).all() and (factors[1, :, 0] >= 8).all(), factors
    assert (factors >= 1).all() and (np.exp2(np.round(np.log2(factors))) == factors).all()


def test_the_build_records_the_scales_in_the_graph_plan_json_and_the_report(plans):
    for name in ("amax", "amax_rotated", "amax_head"):
        plan = read_plan(plans[name])
        assert plan.kv_cache_scales == {**PLANS, **UNEVEN}[name]["kv_cache_scales"]
        assert json.loads((plans[name] / "plan.json").read_text())["kv_cache_scales"] == plan.kv_cache_scales
        report = json.loads((plans[name] / "fusion_report.json").read_text())["kv_scales"]
        assert report == {**report, "windows": 8, "tokens": 8 * 256, "device": "cpu"}
        k, v = _node_scales(plans[name])
        assert len(k) == len(v) == plan.model.num_layers
        np.testing.assert_allclose(report["k"], k, rtol=1e-6)  # the attributes are float32
        np.testing.assert_allclose(report["v"], v, rtol=1e-6)
    # smoothing and rotation change what the pools hold, so the same text gives other scales
    assert _node_scales(plans["amax"]) != _node_scales(plans["amax_rotated"])
    assert _node_scales(plans["one"]) == ([1.0] * 2, [1.0] * 2)
    data = json.loads((plans["one"] / "plan.json").read_text())
    assert "kv_cache_scales" not in data and read_plan(plans["one"]).kv_cache_scales == "one"
    assert "kv_scales" not in json.loads((plans["one"] / "fusion_report.json").read_text())


def test_search_keeps_the_candidate_with_the_least_attention_error(plans):
    """Each layer's searched scale is its least-error candidate of [2, 4) x amax / 448 (the first calibration's
    amax, as the amax plan's), recorded in the report and on the node."""
    from trtopt.builder.kv_calibration import SEARCH_HEADROOM, SEARCH_STEPS

    report = json.loads((plans["search"] / "fusion_report.json").read_text())["kv_scales"]
    amax_k, amax_v = _node_scales(plans["amax"])
    k, v = _node_scales(plans["search"])
    grid = SEARCH_HEADROOM * np.exp2(np.arange(SEARCH_STEPS) / SEARCH_STEPS)
    for scales, amax, errors in ((k, amax_k, report["k_relative_errors"]), (v, amax_v, report["v_relative_errors"])):
        for layer, (scale, base, errs) in enumerate(zip(scales, amax, errors)):
            assert len(errs) == SEARCH_STEPS and min(errs) == 1.0 and max(errs) > 1.0, (layer, errs)
            np.testing.assert_allclose(scale, base * grid[int(np.argmin(errs))], rtol=1e-6)
    assert [round(x, 6) for x in report["k"]] == [round(x, 6) for x in k]
    top = _pool_amax_codes(plans["search"]).max(axis=2)  # the headroom: nothing saturates, codes span (112, 224]
    assert (top[0] > 112).all() and (top <= 240).all(), top


def test_the_search_errors_measure_the_attention_output(plan_dir):
    """kv_stats' candidate errors: a scale and twice it round alike (within the subnormals' change), a scale 50x too
    small saturates most values and costs far more, and the exact attention (no candidate) has no error."""
    import onnx_ir as ir

    from trtopt.runtime.kv_calibration import kv_stats

    source = plan_dir(MODEL)
    plan = read_plan(source)
    windows = calibration_windows(load_tokenizer(source), max_len=plan.limits.max_model_len, windows=2, window=64)
    model = ir.from_proto(onnx.load(str(source / "model.onnx")))
    first = kv_stats(model, windows, block_size=plan.limits.block_size, device="cpu")
    k, v = first.fp8_scales()
    candidates = ([np.array([s, 2 * s, s / 50]) for s in k], [np.array([s, 2 * s, s / 50]) for s in v])
    stats = kv_stats(model, windows, block_size=plan.limits.block_size, device="cpu", scale_candidates=candidates)
    np.testing.assert_allclose(stats.k_amax, first.k_amax)  # the statistics do not change
    for errors in stats.k_errors + stats.v_errors:
        assert errors[0] > 0 and abs(errors[1] / errors[0] - 1) < 0.05 and errors[2] > 20 * errors[0], errors


def test_torch_executor_greedy_equals_the_onnx_body_on_onnxruntime(plans):
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.executors import create_executor

    prompts = ["Hello, my name is", "The capital of France"]

    def greedy(backend: str, name: str) -> list[list[int]]:
        plan = read_plan(plans[name])
        engine = LLMEngine(create_executor(backend, plans[name], plan), plan, load_tokenizer(plans[name]),
                           EngineConfig(max_model_len=128))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        done = run_all(engine)
        assert_idle(engine)
        return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]

    for name in ("amax_rotated", "amax_head", "search"):
        tokens = greedy("torch", name)
        assert tokens == greedy("onnxruntime", name) and all(len(t) == 16 for t in tokens)


@pytest.mark.parametrize("name", ["amax", "amax_head"])
def test_a_self_draft_plan_keeps_the_scales(plans, tmp_path, name):
    from trtopt.builder.draft import build_draft_plan
    from trtopt.fusion_passes.kv_head_scales import INITIALIZER_PREFIX

    draft = build_draft_plan(plans[name], 1, tmp_path / "draft_1")
    assert read_plan(draft).kv_cache_scales == name
    k, v = _node_scales(plans[name])
    assert _node_scales(draft) == (k[:1], v[:1])
    graph = onnx.load(str(draft / "model.onnx"), load_external_data=False).graph
    factors = sorted(t.name for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX))
    assert factors == ([f"{INITIALIZER_PREFIX}{what}_0" for what in ("k", "out", "q", "v")] if name == "amax_head"
                       else [])
    assert _pool_amax_codes(draft)[0].max() == 448  # the draft runs, its layer 0 as the target's


def test_an_unknown_scales_value_in_plan_json_is_refused(plans):
    data = json.loads((plans["amax"] / "plan.json").read_text())
    assert PlanConfig.from_dict(data).kv_cache_scales == "amax"
    with pytest.raises(BuildError, match="kv_cache_scales 'max'"):
        PlanConfig.from_dict({**data, "kv_cache_scales": "max"})


def test_the_build_summary_names_the_scales(export_dir, tmp_path):
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["build", str(export_dir(MODEL)), "-o", str(tmp_path / "plan"),
                                      "--kv-cache-dtype", "fp8", "--kv-cache-scales", "amax", "--max-model-len", "128"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "KV cache float8_e4m3fn, amax K/V scales (K " in text and "calibrated on 8 x 128 tokens" in text, text


def test_bad_scales_options_are_one_line_errors(export_dir, tmp_path):
    source = str(export_dir(MODEL))
    line = one_line_error([source, "--kv-cache-scales", "amax"], tmp_path / "a")
    assert "--kv-cache-scales amax" in line and "--kv-cache-dtype fp8" in line
    line = one_line_error([source, "--kv-cache-dtype", "fp8", "--kv-cache-scales", "max"], tmp_path / "b")
    assert "--kv-cache-scales 'max'" in line and "one, amax, amax_head, search" in line
    line = one_line_error([source, "--kv-cache-dtype", "fp8", "--kv-cache-scales", "amax", "--tensor-parallel", "2"],
                           tmp_path / "c")
    assert "--tensor-parallel" in line and "--kv-cache-scales one" in line


def test_build_plan_without_the_calibrator_says_what_to_pass(export_dir, tmp_path):
    from trtopt.builder.pipeline import build_plan

    with pytest.raises(ConfigError, match="kv_cache_scales='amax' calibrate.*kv_calibration.kv_stats"):
        build_plan(export_dir(MODEL), tmp_path / "plan", limits=LIMITS, progress=False, kv_cache_dtype="fp8",
                   kv_cache_scales="amax")



def test_the_search_errors_read_alibi_slopes_and_the_window():
    """_rounding_errors attends as the node does: its ALiBi slopes (a constant input) and sliding window change the
    errors it measures, and a node without them measures plain causal attention."""
    import onnx_ir as ir

    from trtopt.plugins.common import DOMAIN
    from trtopt.runtime.kv_calibration import _rounding_errors

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 8, generator=gen) for h in (4, 2, 2))
    slopes = ir.Value(name="slopes", const_value=ir.tensor(np.array([0.5, 0.25, 0.125, 0.0625], np.float32)))

    def node(alibi: bool, window: int = 0) -> ir.Node:
        inputs = [ir.Value(name=n) for n in ("q", "k", "v", "kv_cache", "bt", "sl", "qsl", "slots")]
        attrs = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "scale": 8 ** -0.5, "sliding_window": window}
        return ir.node("PagedAttention", [*inputs, *([slopes] if alibi else [])], attributes=attrs, domain=DOMAIN)

    candidates = np.array([0.01, 0.02, 0.0005])
    plain = _rounding_errors(node(False), q, k, v, 0, candidates, 16)
    alibi = _rounding_errors(node(True), q, k, v, 0, candidates, 16)
    windowed = _rounding_errors(node(False, window=8), q, k, v, 0, candidates, 16)
    assert (plain > 0).all() and not np.allclose(plain, alibi) and not np.allclose(plain, windowed)
    assert plain[2] > 10 * plain[0]  # a scale 20x too small saturates every |k| above 0.224
