"""The torch executor's QMatMul rewrite (runtime/executors/qmatmul_packing.py): a converted graph of trtopt.QMatMul
nodes (FP8 and INT4/UINT4 weights, every activation mode, a shared weight, a weight that is a graph input) packed
once with CUDA faked, against the unrewritten graph. Without CUDA the GEMV runs under the Triton interpreter (set
here before the kernel module is imported); the `gpu` test repeats it on CUDA, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from trtopt.plugins.qmatmul.kernel import MAX_ROWS  # noqa: E402
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC, ACT_NONE, ACT_STATIC  # noqa: E402
from trtopt.runtime.executors import qmatmul_packing, trtopt_ops  # noqa: E402
from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch  # noqa: E402

K = 128
RNG = np.random.default_rng(0)
FP8 = ml_dtypes.float8_e4m3fn


def _fp8(n: int):
    w = RNG.standard_normal((K, n)).astype(np.float32)
    scale = (np.abs(w).max(0) / 448).astype(np.float32)
    return (w / scale).astype(FP8), scale, np.zeros(n, FP8), dict(axis=1, block_size=0,
                                                                  weight_dtype=TensorProto.FLOAT8E4M3FN)


def _int4(n: int, group: int, signed: bool):
    lo, hi, dtype, onnx_dtype = (-8, 8, ml_dtypes.int4, TensorProto.INT4) if signed else \
        (0, 16, ml_dtypes.uint4, TensorProto.UINT4)
    scale = (RNG.random((K // group, n)) * 0.1 + 0.01).astype(np.float32)
    zp = (np.zeros((K // group, n)) if signed else RNG.integers(lo, hi, (K // group, n))).astype(dtype)
    return RNG.integers(lo, hi, (K, n)).astype(dtype), scale, zp, dict(axis=0, block_size=group,
                                                                       weight_dtype=onnx_dtype)


def _model() -> tuple[ir.Model, int]:
    """y_i = QMatMul(x, weight_i): FP8 weight-only, FP8 with static and dynamic (scale a graph input) activation
    Q/DQ, symmetric INT4 and asymmetric UINT4, the INT4 weight again on x2, and an FP8 weight that is a graph input
    (not packed). Returns the model and the calls that read constant weights."""
    weights = {"f8": _fp8(24), "i4": _int4(13, 32, True), "u4": _int4(9, 64, False)}
    inits = [("act_one", np.asarray(1.0, np.float32)), ("act_s", np.asarray(0.02, np.float32)),
             ("act_zp", np.zeros((), FP8)), ("no", np.asarray(False)), ("yes", np.asarray(True))]
    for name, (w, s, z, _) in weights.items():
        inits += [(f"{name}_w", w), (f"{name}_s", s), (f"{name}_z", z)]
    # (x, weight, act_mode, act_scale) per output
    calls = [("x", "f8", ACT_NONE, "act_one"), ("x", "f8", ACT_STATIC, "act_s"), ("x", "f8", ACT_DYNAMIC, "dyn_s"),
             ("x", "i4", ACT_NONE, "act_one"), ("x", "u4", ACT_NONE, "act_one"), ("x2", "i4", ACT_NONE, "act_one")]
    nodes, outputs = [], []
    for i, (x, name, mode, act_scale) in enumerate(calls):
        flags = ["no", "no"] if mode == ACT_NONE else ["yes", "yes" if mode == ACT_STATIC else "no"]
        nodes.append(helper.make_node(
            "QMatMul", [x, f"{name}_w", f"{name}_s", f"{name}_z", act_scale, "act_zp", *flags], [f"y{i}"],
            domain="trtopt", act_mode=mode, act_block_size=K if mode == ACT_DYNAMIC else 0, **weights[name][3]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    fp8_attrs = weights["f8"][3]
    nodes.append(helper.make_node("QMatMul", ["x", "w_in", "f8_s", "f8_z", "act_one", "act_zp", "no", "no"],
                                  ["y_in"], domain="trtopt", **fp8_attrs))
    outputs.append(helper.make_tensor_value_info("y_in", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", K]),
              helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["B", "T", K]),
              helper.make_tensor_value_info("dyn_s", TensorProto.FLOAT, ["B", "T", 1]),
              helper.make_tensor_value_info("w_in", TensorProto.FLOAT8E4M3FN, [K, 24])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("trtopt", 1)],
                              ir_version=10)
    return ir.from_proto(proto), len(calls)


FUSED_PRODUCERS = ("rms_norm", "add_rms_norm", "silu_mul", "gelu_mul")  # the ops whose launch may quantize a W8A8 input


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_cpu_graphs_keep_the_op():
    model, _ = _model()
    gm = onnx_to_torch(model).module
    assert qmatmul_packing.pack_qmatmul_weights(gm) == 0
    assert _targets(gm).count(trtopt_ops.qmatmul) == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA for CPU tensors under the Triton interpreter")
def test_constant_weights_are_packed_once_and_compute_the_same(monkeypatch):
    model, constant_calls = _model()
    want_gm = onnx_to_torch(model).module
    gm = onnx_to_torch(model).module
    monkeypatch.setattr(qmatmul_packing, "_on_gpu", lambda t: True)
    assert qmatmul_packing.pack_qmatmul_weights(gm) == constant_calls
    targets = _targets(gm)
    assert targets.count(qmatmul_packing.qmatmul_packed_call) == constant_calls
    assert targets.count(trtopt_ops.qmatmul) == 1  # the graph input's weight
    buffers = dict(gm.named_buffers())
    packed = [name for name in buffers if "_packed_data" in name]
    assert len(packed) == 3  # f8, i4 (read twice, packed once), u4
    assert sum("_packed_zero" in name for name in buffers) == 1  # UINT4 with zero points; INT4's are a constant
    assert {buffers[name].dtype for name in packed} == {torch.uint8, torch.int32}
    # The plan's INT4/UINT4 buffers (one byte a value) are gone; the FP8 scale stays: the graph input's call reads it.
    assert not any(t.dtype in (torch.int8, torch.uint8) and t.shape[0] == K for t in buffers.values())
    w_in = torch.from_numpy((RNG.standard_normal((K, 24)) * 20).astype(np.float32)).to(torch.float8_e4m3fn)
    for rows in (1, 5, MAX_ROWS + 3):  # the GEMV, and the dequantize + GEMM path past MAX_ROWS
        x = torch.randn(1, rows, K, generator=torch.Generator().manual_seed(rows))
        dyn_s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
        got, want = gm(x, -x, dyn_s, w_in), want_gm(x, -x, dyn_s, w_in)
        assert len(got) == len(want) == constant_calls + 1
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_packed_graph_on_cuda_equals_the_op():
    """On CUDA the unrewritten op packs per call (qmatmul_triton) and runs the same GEMV: bit for bit up to MAX_ROWS
    rows; past it both dequantize and multiply in fp32 (the GEMM may pick another algorithm for the transposed
    weight: fp32 rounding)."""
    model, constant_calls = _model()
    want_gm = onnx_to_torch(model, device="cuda").module
    gm = onnx_to_torch(model, device="cuda").module
    assert qmatmul_packing.pack_qmatmul_weights(gm) == constant_calls
    w_in = torch.from_numpy((RNG.standard_normal((K, 24)) * 20).astype(np.float32)).to("cuda", torch.float8_e4m3fn)
    for rows in (1, 5, 12, MAX_ROWS, MAX_ROWS + 3):
        x = torch.randn(1, rows, K, generator=torch.Generator().manual_seed(rows)).cuda()
        dyn_s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(2.0 ** -24)
        for a, b in zip(gm(x, -x, dyn_s, w_in), want_gm(x, -x, dyn_s, w_in)):
            if rows <= MAX_ROWS:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _dynamic_model(dtype=TensorProto.FLOAT) -> ir.Model:
    """y0 = QMatMul(x, f8, dynamic) with the quantizer's per-token scale of x (quantize/qdq.py), y1 = the same weight
    with that formula applied to x2 but fed x's call (not x's scale: kept), y2 the scale itself (a second reader)."""
    np_dtype = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[dtype]
    w, s, z, attrs = _fp8(24)
    inits = [("w", w), ("s", s.astype(np_dtype)), ("z", z), ("act_zp", np.zeros((), FP8)),
             ("yes", np.asarray(True)), ("no", np.asarray(False)), ("axes", np.asarray([-1], np.int64)),
             ("fmax", np.asarray(448.0, np_dtype)), ("tiny", np.asarray(2.0 ** -24, np_dtype))]
    nodes = []
    for src in ("x", "x2"):
        nodes += [helper.make_node("Abs", [src], [f"{src}_abs"]),
                  helper.make_node("ReduceMax", [f"{src}_abs", "axes"], [f"{src}_amax"], keepdims=1),
                  helper.make_node("Div", [f"{src}_amax", "fmax"], [f"{src}_ratio"]),
                  helper.make_node("Max", [f"{src}_ratio", "tiny"], [f"{src}_scale"])]
    for i, scale in enumerate(("x_scale", "x2_scale")):
        nodes.append(helper.make_node("QMatMul", ["x", "w", "s", "z", scale, "act_zp", "yes", "no"], [f"y{i}"],
                                      domain="trtopt", act_mode=ACT_DYNAMIC, act_block_size=K, **attrs))
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in ("y0", "y1", "x2_scale")]
    inputs = [helper.make_tensor_value_info(n, dtype, ["B", "T", K]) for n in ("x", "x2")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("trtopt", 1)],
                              ir_version=10)
    return ir.from_proto(proto)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA for CPU tensors under the Triton interpreter")
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_dynamic_scale_moves_into_the_quantize_launch(monkeypatch, dtype):
    """The quantizer's per-token scale of the call's own x leaves the graph (its four ops erased) and the kernels
    compute it; a scale of another tensor stays a graph input of its call; outputs are bit for bit those of the same
    kernels reading the graph's scale."""
    model = _dynamic_model(dtype)
    ref_gm, unfolded_gm, gm = (onnx_to_torch(model).module for _ in range(3))
    before = _targets(gm)
    monkeypatch.setattr(qmatmul_packing, "_on_gpu", lambda t: True)
    with monkeypatch.context() as m:  # the same kernels with the graph's scale: what folding must equal bit for bit
        m.setattr(qmatmul_packing, "_dynamic_scale", lambda *args: None)
        assert qmatmul_packing.pack_qmatmul_weights(unfolded_gm) == 2
    assert qmatmul_packing.pack_qmatmul_weights(gm) == 2
    after = _targets(gm)
    assert before.count(torch.abs) == 2 and after.count(torch.abs) == 1  # x's formula gone, x2's kept (read twice)
    calls = [n for n in gm.graph.nodes if n.target is qmatmul_packing.qmatmul_packed_call]
    assert [n.args[4] is None for n in calls] == [True, False]
    assert calls[0].kwargs["dynamic_min_scale"] == 2.0 ** -24
    torch_dtype = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16}[dtype]
    for rows in (1, 5, MAX_ROWS + 3):
        gen = torch.Generator().manual_seed(rows)
        x = (torch.randn(1, rows, K, generator=gen) * 3).to(torch_dtype)
        x[0, 0] = 0  # a row of zeros: the minimum scale
        x2 = torch.randn(1, rows, K, generator=gen).to(torch_dtype)
        got = gm(x, x2)
        for a, b, want in zip(got, unfolded_gm(x, x2), ref_gm(x, x2)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
            tol = 1e-4 if dtype == TensorProto.FLOAT else 2e-3  # the CPU reference, another summation order
            torch.testing.assert_close(a.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA for CPU tensors under the Triton interpreter")
@pytest.mark.parametrize("model,dtype,scales", [("tiny-llama", "bf16", "dynamic"), ("gemma3", "fp32", "dynamic"),
                                                ("tiny-llama", "fp32", "static")])  # both dtypes, MLPs and scales
def test_w8a8_projections_take_their_codes_from_the_launch_of_their_inputs_producer(exported, tiny_hf_dir, model, dtype,
                                                                                    scales, tmp_path, monkeypatch):
    """On a tiny-llama quantized W8A8 with per-token scales, the Q/K/V and gate/up projections (the readers of an
    RMSNorm or AddRMSNorm output) and down (SiluMul's) read FP8 codes from that op's launch, O keeps the quantize
    launch, the final norm (the LM head stays unquantized) stays a plain norm; and the fused executor's logits and
    greedy tokens equal the unfused one's exactly, both running the same Triton kernels for those ops (the CPU's
    torch reference would differ in the last bit and flip codes). Gemma-3's down projection reads GeluMul's; with
    static (calibrated, per-tensor) scales the producers quantize under those."""
    monkeypatch.setattr(qmatmul_packing, "_on_gpu", lambda t: True)
    impl = trtopt_ops._impl
    monkeypatch.setattr(trtopt_ops, "_impl", lambda op, device: impl(op, "cuda" if op in FUSED_PRODUCERS else device))
    source = model if model.startswith("tiny-") else str(tiny_hf_dir(model))
    _norm_fusion_equals_the_unfused_executor(exported(source, dtype=dtype).out_dir, tmp_path, monkeypatch, "cpu",
                                             scales)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA for CPU tensors under the Triton interpreter")
def test_int4_projections_take_their_x_packed_by_the_launch_of_their_inputs_producer(exported, tmp_path,
                                                                                    monkeypatch):
    """On a tiny-llama (bf16) quantized INT4 weight-only, the Q/K/V and gate/up projections (the readers of an RMSNorm
    or AddRMSNorm output) and down (SiluMul's) take their x packed for the GEMV by that op's launch, O keeps the x
    launch; and the fused executor's logits and greedy tokens equal the unfused one's exactly, over a prefill chunk
    (the GEMM: the op writes its row alone) and a decode step of 2 rows (the GEMV on the packed words)."""
    monkeypatch.setattr(qmatmul_packing, "_on_gpu", lambda t: True)
    impl = trtopt_ops._impl
    monkeypatch.setattr(trtopt_ops, "_impl", lambda op, device: impl(op, "cuda" if op in FUSED_PRODUCERS else device))
    _x_pack_fusion_equals_the_unfused_executor(exported("tiny-llama", dtype="bf16").out_dir, tmp_path, monkeypatch,
                                               "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_int4_x_pack_fusion_on_cuda(exported, tmp_path, monkeypatch):
    """The same on CUDA, where the fused kernels are compiled (the half2 PTX of the packing included)."""
    _x_pack_fusion_equals_the_unfused_executor(exported("tiny-llama", dtype="bf16").out_dir, tmp_path, monkeypatch,
                                               "cuda")


def _quantized_plan(export: Path, tmp_path, config):
    """The export quantized with `config` (a QuantizeConfig) and built at small limits: (plan dir, plan)."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits, read_plan
    from trtopt.quantize import quantize_model

    quantize_model(export, tmp_path / "q", config, force=True)
    built = build_plan(tmp_path / "q", tmp_path / "plan", force=True, progress=False,
                       limits=Limits(block_size=16, max_num_tokens=64, max_num_seqs=4, max_model_len=64))
    return built.plan_dir, read_plan(built.plan_dir)


def _assert_fused_equals_unfused(plan, fused, unfused, seed: int) -> None:
    """Both executors over one workload: a chunk of 8 rows (the GEMMs), then a decode step of two sequences (2 rows:
    the GEMVs); the fused one's greedy tokens and logits equal the unfused one's exactly."""
    from trtopt.check.compare import Tolerance
    from trtopt.check.runner import Workload, compare_executors

    for executor in (fused, unfused):
        executor.allocate_kv_cache(16)
    rng = np.random.default_rng(seed)
    prompts = tuple(tuple(rng.integers(0, plan.model.vocab_size, n).tolist()) for n in (9, 2))
    results = compare_executors(plan, {"fused": fused, "unfused": unfused}, Workload(prompts, chunk=8, decode_steps=1),
                                Tolerance(atol=0.0, rtol=0.0), reference="unfused")
    assert results["fused"].greedy_tokens == results["unfused"].greedy_tokens and all(results["fused"].greedy_tokens)
    assert results["fused"].logits.max_abs == 0.0, results["fused"].logits.max_abs


def _x_pack_fusion_equals_the_unfused_executor(export: Path, tmp_path, monkeypatch, device: str):
    from trtopt.plugins.qmatmul import kernel
    from trtopt.quantize import QuantizeConfig
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    if device == "cpu":  # 32 columns a GEMV program (both executors alike): 8x fewer programs for the interpreter
        monkeypatch.setattr(kernel, "default_config_xp", lambda rows, n, k, group: (32, max(group, 64), 1, 1))
    plan_dir, plan = _quantized_plan(export, tmp_path, QuantizeConfig(weights="int4", group_size=32,
                                                                      calibration_sequences=2, calibration_length=64))
    fused = TorchExecutor(plan_dir, plan, device=device)
    unfused = TorchExecutor(plan_dir, plan, device=device, fold_x_pack=False)
    layers = plan.model.num_layers
    assert fused.num_packed_qmatmuls == unfused.num_packed_qmatmuls == 4 * layers
    assert fused.num_x_pack_fusions == 3 * layers and unfused.num_x_pack_fusions == 0
    assert fused.num_norm_quantize_fusions == 0  # weight-only: nothing to quantize
    targets = _targets(fused.graph.module)
    assert targets.count(qmatmul_packing.qmatmul_xp_call) == 3 * layers
    assert targets.count(qmatmul_packing.qmatmul_packed_call) == layers  # O
    assert sum(targets.count(form) for form, _ in qmatmul_packing._XP_FORMS.values()) == 3 * layers
    packed = []  # what each xp form's launch did: packed x for the GEMV (True) or wrote its row alone
    outputs = kernel.x_pack_outputs
    monkeypatch.setattr(kernel, "x_pack_outputs", lambda *a: packed.append(outputs(*a)[0] is not None) or outputs(*a))
    _assert_fused_equals_unfused(plan, fused, unfused, seed=2)
    # steps of up to 4 rows packed (every layer's three producers), the 8-row chunk did not
    assert packed.count(True) >= 3 * layers and packed.count(True) % (3 * layers) == 0 and packed.count(False) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_w8a8_norm_quantize_fusion_on_cuda(exported, tmp_path, monkeypatch):
    """The same on CUDA (bf16 plan: the dtype the W8A8 kernels serve), where the fused norm kernels are compiled."""
    _norm_fusion_equals_the_unfused_executor(exported("tiny-llama", dtype="bf16").out_dir, tmp_path, monkeypatch,
                                             "cuda")


def _norm_fusion_equals_the_unfused_executor(export: Path, tmp_path, monkeypatch, device: str,
                                             scales: str = "dynamic"):
    from trtopt.quantize import QuantizeConfig
    from trtopt.runtime.executors import torch_executor
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    plan_dir, plan = _quantized_plan(export, tmp_path, QuantizeConfig(
        weights="fp8", activations="fp8", activation_scales=scales, calibration_sequences=2, calibration_length=64))
    fused = TorchExecutor(plan_dir, plan, device=device)
    with monkeypatch.context() as m:
        m.setattr(torch_executor, "fuse_norm_quantize", lambda gm: 0)
        unfused = TorchExecutor(plan_dir, plan, device=device)
    layers = plan.model.num_layers
    assert fused.num_packed_qmatmuls == unfused.num_packed_qmatmuls == 4 * layers
    assert fused.num_norm_quantize_fusions == 3 * layers and unfused.num_norm_quantize_fusions == 0
    targets = _targets(fused.graph.module)
    assert targets.count(qmatmul_packing.qmatmul_codes_call) == 3 * layers
    assert targets.count(qmatmul_packing.qmatmul_packed_call) == layers  # O
    for node in fused.graph.module.graph.nodes:  # O's input is the attention's, not a producer with an FP8 form
        if node.target is qmatmul_packing.qmatmul_packed_call:
            assert qmatmul_packing._producer(node.args[0]) is None, node.args[0]
    _assert_fused_equals_unfused(plan, fused, unfused, seed=1)
