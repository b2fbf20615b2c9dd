"""A plan built with `--kv-cache-dtype fp8 --kv-cache-rotation hadamard` on the CPU (tiny Llama, head_dim 16): what
the build writes and prints, greedy decoding on the torch executor equal to the ONNX body on onnxruntime, an error of
FP8's size (not more) against the float32 plan, the same tokens sharded over two ranks, the self-draft plan, old
plan.json files, and the one-line errors a user can meet. The pass's exactness on float32 pools is tested in
tests/fusion_passes/test_kv_rotation.py."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from trtopt.builder.plan import Limits, PlanConfig, read_plan
from trtopt.errors import BuildError
from trtopt.fusion_passes.kv_rotation import INITIALIZER_PREFIX
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
    """The tiny Llama's plans: "auto" (the session's float32 plan), "fp8", "hadamard" (fp8 + rotation) and
    "hadamard_kv" (fp8 + q, k and v rotated)."""
    from trtopt.builder.pipeline import build_plan

    out = {"auto": plan_dir(MODEL)}
    for name, rotation in (("fp8", "none"), ("hadamard", "hadamard"), ("hadamard_kv", "hadamard_kv")):
        out[name] = build_plan(export_dir(MODEL), module_tmp / name, limits=LIMITS, force=True, progress=False,
                               kv_cache_dtype="fp8", kv_cache_rotation=rotation).plan_dir
    return out


@pytest.fixture(scope="module")
def executors(plans):
    from trtopt.runtime.executors import create_executor

    cache: dict[tuple[str, str], object] = {}

    def get(name: str, backend: str):
        if (name, backend) not in cache:
            cache[(name, backend)] = create_executor(backend, plans[name], read_plan(plans[name]))
        return cache[(name, backend)]

    return get


def _greedy(executor, plan_dir) -> list[list[int]]:
    from trtopt.runtime.engine import LLMEngine

    eng = LLMEngine(executor, read_plan(plan_dir), load_tokenizer(plan_dir), EngineConfig(max_model_len=128))
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    done = run_all(eng)
    assert_idle(eng)
    return [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]


def test_the_build_records_the_rotation_in_plan_json_and_the_graph(plans):
    plan = read_plan(plans["hadamard"])
    assert (plan.kv_cache_dtype, plan.kv_cache_rotation, plan.model.head_dim) == ("fp8", "hadamard", 16)
    assert json.loads((plans["hadamard"] / "plan.json").read_text())["kv_cache_rotation"] == "hadamard"
    for name in ("fp8", "auto"):  # plans without it do not name it (they read and write the same file as before)
        assert "kv_cache_rotation" not in json.loads((plans[name] / "plan.json").read_text())
        assert read_plan(plans[name]).kv_cache_rotation == "none"

    graph = onnx.load(str(plans["hadamard"] / "model.onnx"), load_external_data=False).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    (h,) = [t for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX)]
    assert list(h.dims) == [16, 16] and h.data_type == onnx.TensorProto.FLOAT
    attention = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == plan.model.num_layers
    for node in attention:
        q, k = produced_by[node.input[0]], produced_by[node.input[1]]
        assert q.op_type == k.op_type == "MatMul" and q.input[1] == k.input[1] == h.name
        assert produced_by[node.input[2]].input[1:2] != [h.name]  # V is stored as it is
    assert sum(n.op_type == "MatMul" and n.input[1] == h.name for n in graph.node) == 2 * plan.model.num_layers


@pytest.mark.parametrize("name", ["hadamard", "hadamard_kv"])
def test_torch_executor_greedy_equals_the_onnx_body_on_onnxruntime(plans, executors, name):
    tokens = {backend: _greedy(executors(name, backend), plans[name]) for backend in ("torch", "onnxruntime")}
    assert tokens["torch"] == tokens["onnxruntime"]
    assert all(len(t) == 20 for t in tokens["torch"])
    # The cost: with MatMul(·, H) between them, the torch executor no longer folds Rope into PagedAttention.
    assert executors(name, "torch").num_fused_rope_kv == 0 and executors("fp8", "torch").num_fused_rope_kv == 2


def test_value_rotation_is_recorded_and_rotates_v_and_the_output(plans):
    plan = read_plan(plans["hadamard_kv"])
    assert (plan.kv_cache_dtype, plan.kv_cache_rotation) == ("fp8", "hadamard_kv")
    graph = onnx.load(str(plans["hadamard_kv"] / "model.onnx"), load_external_data=False).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    (h,) = [t for t in graph.initializer if t.name.startswith(INITIALIZER_PREFIX)]
    for node in (n for n in graph.node if n.op_type == "PagedAttention"):
        assert [produced_by[i].input[1] for i in node.input[:3]] == [h.name] * 3
        (back,) = [n for n in graph.node if node.output[0] in n.input]
        assert back.op_type == "MatMul" and back.input[1] == h.name  # the output rotated back, read by nothing else
    assert sum(n.op_type == "MatMul" and n.input[1] == h.name for n in graph.node) == 4 * plan.model.num_layers


def test_the_rotated_plan_errs_like_fp8_against_the_float32_plan(plans, executors):
    """A prefill and three decode steps: the rotated FP8 plan's logits differ from the float32 plan's by what FP8
    rounding does (the same order as the plain FP8 plan's), not more; a broken rotation (q and k rotated unlike, or
    V rotated) would change the scores themselves."""
    plan = read_plan(plans["auto"])
    from trtopt.runtime.input_builder import InputBuilder

    builder = InputBuilder(plan.limits.block_size, plan.max_blocks_per_seq)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 5000, 40)]
    steps = [builder.build(ScheduledBatch([ScheduledSeq("a", tokens[:37], 0, [1, 2, 3], True,
                                                        prompt_logprob_positions=range(37))], 37, []))]
    steps += [builder.build(ScheduledBatch([ScheduledSeq("a", [tokens[i]], i, [1, 2, 3], True)], 1, []))
              for i in range(37, 40)]
    logits = {}
    for name in ("auto", "fp8", "hadamard", "hadamard_kv"):
        ex = executors(name, "torch")
        ex.allocate_kv_cache(8)
        logits[name] = torch.cat([ex.execute(s).float() for s in steps])

    def kl(name: str) -> float:
        ref, lp = torch.log_softmax(logits["auto"], -1), torch.log_softmax(logits[name], -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    err = {name: float((logits[name] - logits["auto"]).abs().max()) for name in ("fp8", "hadamard", "hadamard_kv")}
    for name in ("hadamard", "hadamard_kv"):
        assert 0 < err[name] < 2 * err["fp8"] and 0 < kl(name) < 2 * kl("fp8"), (name, err, kl("fp8"))
        assert kl(name) < 0.02  # FP8's size on this model (about 4e-3 both ways)


def test_a_self_draft_plan_keeps_the_rotation(plans, tmp_path):
    from trtopt.builder.draft import build_draft_plan

    draft = build_draft_plan(plans["hadamard"], 1, tmp_path / "draft_1")
    assert read_plan(draft).kv_cache_rotation == "hadamard"
    graph = onnx.load(str(draft / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "MatMul" and n.input[1].startswith(INITIALIZER_PREFIX) for n in graph.node) == 2


def test_two_tensor_parallel_ranks_give_the_single_rank_tokens(plans, export_dir, module_tmp, executors):
    """H acts within a head, so every rank takes the same H (the rotation runs after sharding)."""
    import torch.distributed as dist

    from trtopt.builder.pipeline import build_plan
    from trtopt.runtime.llm import LLM

    out = module_tmp / "tp2"
    result = build_plan(export_dir(MODEL), out, limits=LIMITS, force=True, progress=False, tensor_parallel=2,
                        kv_cache_dtype="fp8", kv_cache_rotation="hadamard")
    assert result.parallel is not None and result.parallel.heads_per_rank == 2 and len(result.parallel.attention) == 2
    for rank in range(2):
        assert read_plan(out / f"rank{rank}").kv_cache_rotation == "hadamard"
        graph = onnx.load(str(out / f"rank{rank}" / "model.onnx"), load_external_data=False).graph
        assert sum(n.op_type == "MatMul" and n.input[1].startswith(INITIALIZER_PREFIX) for n in graph.node) == 4
    single = _greedy(executors("hadamard", "torch"), plans["hadamard"])
    llm = LLM(out, tensor_parallel_size=2)
    try:
        sharded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
    assert sharded == single


def test_old_plan_json_reads_as_none_and_an_unknown_rotation_is_refused(plans):
    data = json.loads((plans["fp8"] / "plan.json").read_text())
    assert "kv_cache_rotation" not in data and PlanConfig.from_dict(data).kv_cache_rotation == "none"
    with pytest.raises(BuildError, match="kv_cache_rotation 'givens'"):
        PlanConfig.from_dict({**data, "kv_cache_rotation": "givens"})


def test_bad_rotation_options_are_one_line_errors(export_dir, tmp_path):
    source = str(export_dir(MODEL))
    line = one_line_error([source, "--kv-cache-rotation", "hadamard"], tmp_path / "a")
    assert "--kv-cache-rotation hadamard" in line and "--kv-cache-dtype fp8" in line
    line = one_line_error([source, "--kv-cache-dtype", "fp8", "--kv-cache-rotation", "givens"], tmp_path / "b")
    assert "--kv-cache-rotation 'givens'" in line and "none, hadamard" in line


def test_a_head_dim_that_is_not_a_power_of_two_is_a_one_line_error(export_dir, tmp_path, monkeypatch):
    """No tiny model has such a head_dim (SmolLM2: 64, Gemma-3: 256; Phi-2's is 80): the check is made to see 16 as
    one."""
    from trtopt.builder import pipeline

    monkeypatch.setattr(pipeline, "is_power_of_two", lambda d: d != 16)
    line = one_line_error([str(export_dir(MODEL)), "--kv-cache-dtype", "fp8", "--kv-cache-rotation", "hadamard"],
                           tmp_path / "plan", after_progress=True)
    assert "power-of-two head_dim" in line and "head_dim 16" in line


def test_the_build_summary_names_the_rotation(export_dir, tmp_path):
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["build", str(export_dir(MODEL)), "-o", str(tmp_path / "plan"),
                                      "--kv-cache-dtype", "fp8", "--kv-cache-rotation", "hadamard",
                                      "--max-model-len", "128"])
    assert result.exit_code == 0, result.output
    assert "KV cache float8_e4m3fn, q/k rotated (hadamard)" in " ".join(result.output.split())
