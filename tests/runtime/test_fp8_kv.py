"""A plan built with `--kv-cache-dtype fp8` (float8_e4m3fn KV pools) on the CPU: what the build writes, greedy
decoding on the torch executor equal to the ONNX body on onnxruntime, copy-on-write and prefix caching over FP8
pools, the pool's capacity from the same memory, and the errors a user can meet."""

from __future__ import annotations

import dataclasses
import json

import onnx
import pytest
import torch
from typer.testing import CliRunner

from trtopt.builder.plan import PlanConfig, read_plan
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.config import EngineConfig, block_bytes, load_tokenizer, resolve_limits
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.signature import FP8_KV_DTYPE, kv_input, kv_output

from stepping import assert_idle, run_all

MODEL = "tiny-llama"
BACKENDS = ["torch", "onnxruntime"]


@pytest.fixture(scope="module")
def fp8_plan(export_dir, tmp_path_factory):
    """The tiny Llama's plan with FP8 pools, with the limits of the session's `plan_dir` plan (its "auto" twin)."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits

    limits = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
    out = tmp_path_factory.mktemp("plan-tiny-llama-fp8")
    return build_plan(export_dir(MODEL), out, limits=limits, force=True, progress=False,
                      kv_cache_dtype="fp8").plan_dir


@pytest.fixture(scope="module")
def plans(fp8_plan, plan_dir):
    return {"fp8": fp8_plan, "auto": plan_dir(MODEL)}


@pytest.fixture(scope="module")
def executors(plans):
    from trtopt.runtime.executors import create_executor

    cache: dict[tuple[str, str], object] = {}

    def get(kv: str, backend: str):
        if (kv, backend) not in cache:
            cache[(kv, backend)] = create_executor(backend, plans[kv], read_plan(plans[kv]))
        return cache[(kv, backend)]

    return get


@pytest.fixture(scope="module")
def engine(plans, executors):
    from trtopt.runtime.engine import LLMEngine

    tokenizer = load_tokenizer(plans["fp8"])

    def make(kv: str = "fp8", backend: str = "torch", **config):
        return LLMEngine(executors(kv, backend), read_plan(plans[kv]), tokenizer,
                         EngineConfig(**{"max_model_len": 128, **config}))

    return make


def test_the_build_records_fp8_in_plan_json_the_graph_and_the_nodes(fp8_plan, plan_dir):
    plan = read_plan(fp8_plan)
    assert plan.kv_cache_dtype == "fp8" and plan.kv_pool_dtype == FP8_KV_DTYPE
    assert json.loads((fp8_plan / "plan.json").read_text())["kv_cache_dtype"] == "fp8"
    # A default plan's plan.json does not name it (old and new default plans read and write the same file).
    assert "kv_cache_dtype" not in json.loads((plan_dir(MODEL) / "plan.json").read_text())
    assert read_plan(plan_dir(MODEL)).kv_cache_dtype == "auto"

    model = onnx.load(str(fp8_plan / "model.onnx"), load_external_data=False)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 19
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    for layer in range(plan.model.num_layers):
        assert types[kv_input(layer)] == types[kv_output(layer)] == onnx.TensorProto.FLOAT8E4M3FN
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == plan.model.num_layers
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["kv_cache_dtype"], attrs["k_scale"], attrs["v_scale"]) == (b"fp8", 1.0, 1.0)
    (body,) = [f for f in model.functions if f.name == "PagedAttention"]
    assert {"k_scale", "v_scale"} <= set(body.attribute)

    # The default plan keeps its nodes and body as they were: no FP8 attribute anywhere.
    auto = onnx.load(str(plan_dir(MODEL) / "model.onnx"), load_external_data=False)
    fp8_names = {"kv_cache_dtype", "k_scale", "v_scale"}
    assert not any(fp8_names & {a.name for a in n.attribute} for n in auto.graph.node if n.op_type == "PagedAttention")
    assert not any(fp8_names & set(f.attribute) for f in auto.functions if f.name == "PagedAttention")


def test_torch_executor_greedy_equals_the_onnx_body_on_onnxruntime(engine):
    prompts = ["Hello, my name is", "The capital of France", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    outputs = {}
    for backend in BACKENDS:
        eng = engine("fp8", backend)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        done = run_all(eng)
        outputs[backend] = [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]
        assert_idle(eng)
    assert outputs["torch"] == outputs["onnxruntime"]
    assert all(len(tokens) == 20 for tokens in outputs["torch"])


def test_pools_are_float8(executors):
    torch_pools = executors("fp8", "torch")
    torch_pools.allocate_kv_cache(4)
    assert all(p.dtype == torch.float8_e4m3fn for p in torch_pools.kv_caches)
    ort = executors("fp8", "onnxruntime")
    ort.allocate_kv_cache(4)
    assert all(v.data_type() == "tensor(float8e4m3fn)" for v in ort._pool_values[0])


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_n2_copy_on_write_equals_two_independent_runs(engine, kv, backend):
    prompt = "Once upon a time there was a"  # the last prompt token sits in a shared, partly filled block
    params = SamplingParams(n=2, temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    eng = engine(kv, backend, enable_prefix_caching=False)
    eng.add_request("pair", prompt, params)
    pair = run_all(eng)["pair"]
    assert eng.kv.num_cow_copies >= 1
    assert_idle(eng)
    for i in range(2):
        solo = engine(kv, backend, enable_prefix_caching=False)
        solo.add_request("solo", prompt, SamplingParams(temperature=0.9, top_k=50, seed=7 + i, max_tokens=12,
                                                        ignore_eos=True))
        assert run_all(solo)["solo"].outputs[0].token_ids == pair.outputs[i].token_ids


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_prefix_cache_hits_give_the_tokens_of_a_cold_run(engine, kv):
    prefix = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    prompts = [prefix + "seventeen", prefix + "and then"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cold = {}
    for i, p in enumerate(prompts):
        eng = engine(kv, enable_prefix_caching=False)
        eng.add_request("r", p, params)
        cold[i] = run_all(eng)["r"].outputs[0].token_ids
    warm = engine(kv, enable_prefix_caching=True)
    for i, p in enumerate(prompts):
        warm.add_request(str(i), p, params)
        assert run_all(warm)[str(i)].outputs[0].token_ids == cold[i]
    assert warm.stats().num_prefix_cache_hit_tokens >= 16
    assert_idle(warm)


FUSIONS = ("num_fused_rope", "num_fused_rope_kv", "num_nonnegative_gathers", "num_gemv_weights", "num_gemv_silu_mul",
           "num_gemv_rope_kv", "num_packed_qmatmuls", "num_norm_quantize_fusions")


def test_an_fp8_plan_gets_every_rewrite_its_auto_twin_gets(plans):
    """The torch executor's graph rewrites do not depend on the pool's dtype: with the decode GEMVs on, the FP8 plan
    and its auto twin count the same rewrites of every kind. (Until session 30 the fused Q/K/V + KV write was off
    for FP8 pools, although its kernel quantizes into them: this is the check that would have said so.)"""
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    counts = {kv: {name: getattr(TorchExecutor(plans[kv], read_plan(plans[kv]), decode_gemv=True), name)
                   for name in FUSIONS} for kv in ("auto", "fp8")}
    assert counts["fp8"] == counts["auto"]
    assert counts["fp8"]["num_gemv_rope_kv"] > 0 and counts["fp8"]["num_fused_rope_kv"] > 0


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_speculative_rollback_keeps_greedy_tokens(engine, kv):
    """n-gram speculation over the pools: verified drafts write their K/V before the target accepts or rejects
    them, and a rejected draft's slots are written again by the tokens that follow (the rollback). Greedy tokens
    equal the run without speculation, and no block leaks. The tiny random model seldom repeats itself, so most
    drafts are rejected: what this checks is the rollback, over FP8 pools and model-dtype ones alike."""
    prompts = ["one two three one two three one two three one two", "a b c d a b c d a b c", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = engine(kv, enable_prefix_caching=False)
    spec = engine(kv, enable_prefix_caching=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    for eng in (plain, spec):
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
    want, got = run_all(plain), run_all(spec)
    assert {k: o.outputs[0].token_ids for k, o in got.items()} == {k: o.outputs[0].token_ids for k, o in want.items()}
    st = spec.stats()
    assert st.num_draft_tokens >= 10 and st.num_accepted_tokens < st.num_draft_tokens, "no draft was rejected"
    assert_idle(spec)


def test_the_same_memory_holds_twice_the_blocks_of_bf16_and_four_times_fp32(fp8_plan, plan_dir):
    fp8 = read_plan(fp8_plan)
    fp32 = read_plan(plan_dir(MODEL))
    assert fp32.model.dtype == "float32" and fp32.kv_pool_dtype == "float32"
    bf16 = dataclasses.replace(fp32, model=dataclasses.replace(fp32.model, dtype="bfloat16"))
    fp8_of_bf16 = dataclasses.replace(bf16, kv_cache_dtype="fp8")
    assert block_bytes(fp32) == 4 * block_bytes(fp8) and block_bytes(bf16) == 2 * block_bytes(fp8_of_bf16)
    assert block_bytes(fp8) == block_bytes(fp8_of_bf16)
    config = EngineConfig(kv_cache_memory_gb=block_bytes(fp32) * 10 / 2**30, max_num_seqs=8, max_model_len=128)
    blocks = {name: resolve_limits(plan, config).num_blocks - 1
              for name, plan in dict(fp32=fp32, bf16=bf16, fp8=fp8).items()}
    assert blocks == {"fp32": 10, "bf16": 20, "fp8": 40}


def test_old_plan_json_reads_as_auto_and_an_unknown_dtype_is_refused(plan_dir):
    data = json.loads((plan_dir(MODEL) / "plan.json").read_text())
    assert PlanConfig.from_dict(data).kv_cache_dtype == "auto"
    with pytest.raises(BuildError, match="kv_cache_dtype 'int8'"):
        PlanConfig.from_dict({**data, "kv_cache_dtype": "int8"})


def test_fp8_pools_on_a_cuda_device_older_than_8_9_are_a_config_error(fp8_plan, plan_dir, monkeypatch):
    from trtopt.runtime.executors.signature import TORCH_POOL_DTYPES, pool_dtype

    plan = read_plan(fp8_plan)
    assert pool_dtype(plan, TORCH_POOL_DTYPES) == torch.float8_e4m3fn  # the CPU always can
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8\.9 or newer.*8\.0"):
        pool_dtype(plan, TORCH_POOL_DTYPES, device="cuda")
    assert pool_dtype(read_plan(plan_dir(MODEL)), TORCH_POOL_DTYPES, device="cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert pool_dtype(plan, TORCH_POOL_DTYPES, device="cuda") == torch.float8_e4m3fn


def test_an_unknown_kv_cache_dtype_is_a_one_line_error(export_dir, tmp_path):
    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["build", str(export_dir(MODEL)), "-o", str(tmp_path / "plan"),
                                      "--kv-cache-dtype", "int8"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--kv-cache-dtype 'int8'" in lines[0] and "auto, fp8" in lines[0], result.output
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("kv,dtype", [("auto", "float32"), ("fp8", FP8_KV_DTYPE)])
def test_stats_and_metrics_report_the_pool_dtype(engine, kv, dtype):
    from prometheus_client import CollectorRegistry, generate_latest

    from trtopt.serving.metrics import _EngineCollector

    eng = engine(kv)
    assert eng.stats().kv_cache_dtype == dtype
    registry = CollectorRegistry()
    registry.register(_EngineCollector(eng.stats, sleep_level=lambda: None))  # an engine that never sleeps
    text = generate_latest(registry).decode()
    assert f'trtopt_kv_cache_dtype_info{{dtype="{dtype}"}} 1.0' in text
    assert f"trtopt_kv_blocks_total {float(eng.stats().num_blocks_total)}" in text


def test_a_self_draft_plan_of_an_fp8_plan_keeps_fp8_pools(fp8_plan, tmp_path):
    from trtopt.builder.draft import build_draft_plan

    draft = build_draft_plan(fp8_plan, 1, tmp_path / "draft_1")
    assert read_plan(draft).kv_cache_dtype == "fp8"
    model = onnx.load(str(draft / "model.onnx"), load_external_data=False)
    (pool,) = [v for v in model.graph.input if v.name == kv_input(0)]
    assert pool.type.tensor_type.elem_type == onnx.TensorProto.FLOAT8E4M3FN


@pytest.mark.slow
def test_compile_mode_runs_an_fp8_plan_like_the_eager_executor(fp8_plan):
    """torch.compile (Inductor, CPU fp32) of an FP8 plan: the PagedAttention custom op carries the node's
    kv_cache_dtype and scales, so greedy tokens, logits and the FP8 pools (byte for byte) are the eager executor's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "executors"))
    from test_torch_library import greedy_steps

    from trtopt.runtime.executors.torch_executor import TorchExecutor

    plan = read_plan(fp8_plan)
    eager = TorchExecutor(fp8_plan, plan)
    compiled = TorchExecutor(fp8_plan, plan, compile_mode="default")
    for ex in (eager, compiled):
        ex.allocate_kv_cache(8)
        assert ex.kv_caches[0].dtype == torch.float8_e4m3fn
    want, want_tokens = greedy_steps(eager, plan.limits.block_size)
    got, got_tokens = greedy_steps(compiled, plan.limits.block_size)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(compiled.kv_caches, eager.kv_caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    paged = [n for n in compiled.graph.module.graph.nodes if "paged_attention" in str(n.target)]
    assert len(paged) == plan.model.num_layers and all(n.kwargs["kv_cache_dtype"] == "fp8" for n in paged)


def test_reference_ops_runs_the_fp8_pool_through_the_torch_reference(engine, plans):
    """TorchExecutor(reference_ops=("PagedAttention",)) (benchmarks/fp8_kv.py --attention reference): the same
    greedy tokens as the executor's own path on the FP8 pools, through the reference function; an op without a
    reference path is refused."""
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.executors import trtopt_ops
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    reference = TorchExecutor(plans["fp8"], read_plan(plans["fp8"]), reference_ops=("PagedAttention",))
    calls = [n for n in reference.graph.module.graph.nodes if n.op == "call_function"]
    assert any(n.target is trtopt_ops.paged_attention_reference for n in calls)
    assert not any(n.target is trtopt_ops.paged_attention for n in calls)
    prompts = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    outputs = []
    for eng in (engine("fp8"), LLMEngine(reference, read_plan(plans["fp8"]), load_tokenizer(plans["fp8"]),
                                         EngineConfig(max_model_len=128))):
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        done = run_all(eng)
        outputs.append([done[str(i)].outputs[0].token_ids for i in range(len(prompts))])
    assert outputs[0] == outputs[1]
    with pytest.raises(ValueError, match="reference path"):
        TorchExecutor(plans["fp8"], read_plan(plans["fp8"]), reference_ops=("RMSNorm",))


@pytest.mark.gpu
def test_compile_mode_runs_an_fp8_plan_on_cuda(fp8_plan):
    """The same on CUDA: Inductor around the Triton kernels over FP8 pools, the eager executor's tokens and pools."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "executors"))
    from test_torch_library import greedy_steps

    from trtopt.runtime.executors.torch_executor import TorchExecutor

    plan = read_plan(fp8_plan)
    runs = {}
    for mode in (None, "default"):
        ex = TorchExecutor(fp8_plan, plan, device="cuda", compile_mode=mode)
        ex.allocate_kv_cache(8)
        logits, tokens = greedy_steps(ex, plan.limits.block_size)
        runs[mode] = (torch.cat(logits).cpu(), tokens, [p.view(torch.uint8).cpu() for p in ex.kv_caches])
    assert runs["default"][1] == runs[None][1]
    torch.testing.assert_close(runs["default"][0], runs[None][0], atol=1e-4, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(runs["default"][2], runs[None][2]))
