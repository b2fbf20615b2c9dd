"""fusion_passes/horizontal_matmul.py on quantized projections: QMatMuls of one x with one quantization become one
QMatMul over the concatenated w_q / w_scale / w_zero_point + Split, equal to the Q/DQ graph on ORT; other
quantizations stay apart with a reason; on a quantized tiny-llama the fused plan keeps the float plan's downstream
fusions and the unfused plan's greedy tokens, and the torch executor's GEMV + RoPE + KV epilogue (a plain MatMul's
only) falls back to the attention op's own rotation and write."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from graphs import FLOAT, model, op_types
from test_qmatmul import session  # ORT with its QDQ fusions off, as the quantized graphs run
from onnx import TensorProto, helper, numpy_helper

from trtopt.fusion_passes.horizontal_matmul import MEMBERS_KEY, fuse_horizontal_matmul, members
from trtopt.fusion_passes.qmatmul import fuse_qmatmul
from trtopt.fusion_passes.trace import Trace

RNG = np.random.default_rng(7)
K = 64
FP8 = ml_dtypes.float8_e4m3fn
WIDTHS = {"q": 32, "k": 16, "v": 16, "g": 48, "u": 48}  # q/k/v read x, gate/up read h


def _weight(n: int, form: str, group: int):
    """(codes, scale, zero point or None, DequantizeLinear attributes) of one [K, n] weight."""
    if form.startswith("fp8"):
        w = RNG.standard_normal((K, n)).astype(np.float32)
        scale = (np.abs(w).max(0) / 448).astype(np.float32)
        return (w / scale).astype(FP8), scale, None, {"axis": 1}
    scale = (RNG.random((K // group, n)) * 0.1 + 0.01).astype(np.float32)
    if form == "uint4_asym":
        return (RNG.integers(0, 16, (K, n)).astype(ml_dtypes.uint4), scale,
                RNG.integers(0, 16, (K // group, n)).astype(ml_dtypes.uint4), {"axis": 0, "block_size": group})
    return RNG.integers(-8, 8, (K, n)).astype(ml_dtypes.int4), scale, None, {"axis": 0, "block_size": group}


def _act_qdq(x: str, act: str, scale: str) -> tuple[list, str]:
    """The activation Q/DQ of ``x`` (as trtopt quantize writes it: one per input tensor): its nodes, and the name
    of the dequantized x."""
    if act == "static":
        return ([helper.make_node("QuantizeLinear", [x, scale, "a_zp"], [f"{x}_q"]),
                 helper.make_node("DequantizeLinear", [f"{x}_q", scale, "a_zp"], [f"{x}_dq"])], f"{x}_dq")
    if act == "dynamic":
        nodes = [helper.make_node("Abs", [x], [f"{x}_ab"]), helper.make_node("ReduceMax", [f"{x}_ab", "axes"],
                                                                               [f"{x}_am"]),
                 helper.make_node("Div", [f"{x}_am", "fmax"], [f"{x}_ra"]),
                 helper.make_node("Max", [f"{x}_ra", "tiny"], [f"{x}_sc"]),
                 helper.make_node("QuantizeLinear", [x, f"{x}_sc"], [f"{x}_q"], axis=-1, block_size=K,
                                  output_dtype=TensorProto.FLOAT8E4M3FN),
                 helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_sc"], [f"{x}_dq"], axis=-1, block_size=K)]
        return nodes, f"{x}_dq"
    return [], x


def layer(form: str, *, group: int = 32, groups: dict[str, int] | None = None, bias: bool = False,
          act_scales: dict[str, float] | None = None, dynamic_chains: bool = False) -> onnx.ModelProto:
    """q/k/v = x @ DQ(W) and gate/up = h @ DQ(W) (SwiGLU), the Q/DQ graph of ``form``: fp8_static, fp8_dynamic,
    fp8_weight_only, int4_sym or uint4_asym. ``groups``: a block size per projection; ``act_scales``: a static
    scale initializer per projection (default: one per input); ``dynamic_chains``: each projection computes its own
    per-token scale (the same ops on x)."""
    act = {"fp8_static": "static", "fp8_dynamic": "dynamic"}.get(form, "none")
    inits: list = [("a_zp", np.zeros((), FP8)), ("axes", np.array([-1], np.int64)),
                   ("fmax", np.asarray(448.0, np.float32)), ("tiny", np.asarray(2.0 ** -24, np.float32)),
                   ("s_x", np.asarray(0.02, np.float32)), ("s_h", np.asarray(0.02, np.float32))]
    nodes: list = []
    dq: dict[str, str] = {}
    for x in ("x", "h"):
        if not (act == "dynamic" and dynamic_chains):
            more, dq[x] = _act_qdq(x, act, f"s_{x}")
            nodes += more
    for p, n in WIDTHS.items():
        x = "x" if p in "qkv" else "h"
        codes, scale, zp, attrs = _weight(n, form, (groups or {}).get(p, group))
        inits += [(f"w{p}_q", codes), (f"w{p}_s", scale), *([(f"w{p}_zp", zp)] if zp is not None else [])]
        nodes.append(helper.make_node("DequantizeLinear", [f"w{p}_q", f"w{p}_s", *([f"w{p}_zp"] if zp is not None
                                                                                    else [])], [f"w{p}"], **attrs))
        source = dq.get(x)
        if act_scales and p in act_scales:
            inits.append((f"s_{p}", np.asarray(act_scales[p], np.float32)))
            more, source = _act_qdq(x, act, f"s_{p}")
            nodes += _renamed(more, p)
            source = f"{source}_{p}"
        elif source is None:  # a per-token scale chain of its own
            more, source = _act_qdq(x, act, "")
            nodes += _renamed(more, p)
            source = f"{source}_{p}"
        out = f"{p}0" if bias else p
        nodes.append(helper.make_node("MatMul", [source, f"w{p}"], [out], name=f"proj_{p}"))
        if bias:
            inits.append((f"b{p}", RNG.standard_normal(n).astype(np.float32)))
            nodes.append(helper.make_node("Add", [out, f"b{p}"], [p]))
    nodes += [helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["silu"]),
              helper.make_node("Mul", ["silu", "u"], ["mlp"])]
    outputs = [helper.make_tensor_value_info(p, FLOAT, ["T", WIDTHS[p]]) for p in "qkv"]
    outputs.append(helper.make_tensor_value_info("mlp", FLOAT, ["T", WIDTHS["g"]]))
    inputs = [helper.make_tensor_value_info(x, FLOAT, ["T", K]) for x in ("x", "h")]
    return model(nodes, inputs, outputs, inits, opset=21)


def _renamed(nodes: list[onnx.NodeProto], suffix: str) -> list[onnx.NodeProto]:
    """A copy of the chain ``nodes`` with every value it computes suffixed: the chain of one projection."""
    own = {name for node in nodes for name in node.output}
    out = []
    for node in nodes:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        for names in (node.input, node.output):
            for i, name in enumerate(names):
                if name in own:
                    names[i] = f"{name}_{suffix}"
        out.append(node)
    return out


def fuse(proto: onnx.ModelProto, trace: Trace | None = None) -> tuple[int, onnx.ModelProto]:
    m = ir.from_proto(proto)
    assert fuse_qmatmul(m, trace) == len(WIDTHS)
    count = fuse_horizontal_matmul(m, trace)
    return count, ir.to_proto(m)


def assert_equal_on_ort(fused: onnx.ModelProto, proto: onnx.ModelProto) -> None:
    feeds = {x: RNG.standard_normal((5, K)).astype(np.float32) for x in ("x", "h")}
    for got, want in zip(session(fused).run(None, feeds), session(proto).run(None, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


FORMS = ["fp8_static", "fp8_dynamic", "fp8_weight_only", "int4_sym", "uint4_asym"]


@pytest.mark.parametrize("form", FORMS)
def test_qkv_and_gate_up_qmatmuls_become_one_each_and_equal_the_qdq_graph(form):
    proto = layer(form)
    count, fused = fuse(proto)
    assert count == 2
    types = op_types(fused)
    assert types.count("QMatMul") == 2 and types.count("Split") == 2 and "MatMul" not in types
    qkv = next(n for n in fused.graph.node if n.op_type == "QMatMul" and n.input[0] == "x")
    assert members(qkv) == [("proj_q.qmatmul", 32), ("proj_k.qmatmul", 16), ("proj_v.qmatmul", 16)]
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert inits[qkv.input[1]].shape == (K, 64) and inits[qkv.input[2]].shape[-1] == 64
    assert not any(name.startswith(("wq", "wk", "wv")) for name in inits)  # the members' weights are gone
    assert_equal_on_ort(fused, proto)


def test_biases_after_qmatmuls_are_concatenated_and_stay_an_add():
    proto = layer("int4_sym", bias=True)
    count, fused = fuse(proto)
    assert count == 2
    types = op_types(fused)
    assert types.count("QMatMul") == 2 and types.count("Add") == 2 and types.count("Split") == 2
    assert_equal_on_ort(fused, proto)


def test_equal_static_scales_fuse_and_other_scales_stay_apart_with_a_reason():
    proto = layer("fp8_static", act_scales={"q": 0.02, "k": 0.02, "v": 0.05})  # q, k: equal constants; v: another
    trace = Trace()
    count, fused = fuse(proto, trace)
    assert count == 2  # q+k, gate+up
    qkv = next(n for n in fused.graph.node if n.op_type == "QMatMul" and members(n) and n.input[0] == "x")
    assert [m for m, _ in members(qkv)] == ["proj_q.qmatmul", "proj_k.qmatmul"]
    assert op_types(fused).count("QMatMul") == 3
    [failure] = trace.failures
    assert failure.rule == "horizontal_matmul" and "proj_v.qmatmul left apart" in failure.reason
    assert_equal_on_ort(fused, proto)


def test_other_block_sizes_are_fused_only_within_their_kind():
    proto = layer("int4_sym", groups={"v": 16})
    trace = Trace()
    count, fused = fuse(proto, trace)
    assert count == 2 and op_types(fused).count("QMatMul") == 3
    assert "differ in weight dtype, K, block size" in trace.failures[0].reason
    assert_equal_on_ort(fused, proto)


def test_per_token_scales_computed_alike_from_x_fuse():
    """A producer that writes one per-token scale chain per projection: the chains are the same ops on x."""
    proto = layer("fp8_dynamic", dynamic_chains=True)
    assert op_types(proto).count("ReduceMax") == len(WIDTHS)
    count, fused = fuse(proto)
    assert count == 2 and op_types(fused).count("QMatMul") == 2
    assert_equal_on_ort(fused, proto)


def test_a_fused_qmatmul_records_its_members_in_the_plan_file(tmp_path):
    count, fused = fuse(layer("fp8_weight_only"))
    onnx.save(fused, tmp_path / "m.onnx")
    nodes = [n for n in onnx.load(tmp_path / "m.onnx").graph.node if n.op_type == "QMatMul"]
    recorded = [json.loads({p.key: p.value for p in n.metadata_props}[MEMBERS_KEY]) for n in nodes]
    assert recorded == [[["proj_q.qmatmul", 32], ["proj_k.qmatmul", 16], ["proj_v.qmatmul", 16]],
                        [["proj_g.qmatmul", 48], ["proj_u.qmatmul", 48]]]


# ---- end to end: tiny-llama quantized by trtopt quantize, built with and without the fusion ------------------------

E2E_CONFIGS = {
    "fp8_w8a8_static": dict(weights="fp8", activations="fp8", calibration_sequences=2, calibration_length=64),
    "fp8_w8a8_dynamic": dict(weights="fp8", activations="fp8", activation_scales="dynamic"),
    "int4_asym_g32": dict(weights="int4", group_size=32, asymmetric=True),
}
DOWNSTREAM = ("paged_attention", "rope", "rope_table", "rms_norm", "add_rms_norm", "silu_mul", "horizontal_matmul")


@pytest.mark.parametrize("name", list(E2E_CONFIGS))
def test_quantized_tiny_llama_fuses_like_the_float_plan_and_keeps_its_greedy_tokens(name, export_dir, plan_dir,
                                                                                  tmp_path):
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits, read_plan
    from trtopt.check.compare import Tolerance
    from trtopt.check.runner import Workload, compare_executors
    from trtopt.quantize import QuantizeConfig, quantize_model
    from trtopt.runtime.executors import create_executor
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    qdir = tmp_path / "q"
    quantize_model(export_dir("tiny-llama"), qdir, QuantizeConfig(**E2E_CONFIGS[name]), force=True)
    limits = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
    fused = build_plan(qdir, tmp_path / "fused", limits=limits, force=True, progress=False)
    apart = build_plan(qdir, tmp_path / "apart", limits=limits, force=True, progress=False,
                       disable_passes=("horizontal_matmul",))
    float_counts = json.loads((plan_dir("tiny-llama") / "fusion_report.json").read_text())["counts"]
    layers = fused.config.model.num_layers
    assert {p: fused.report.counts[p] for p in DOWNSTREAM} == {p: float_counts[p] for p in DOWNSTREAM}
    assert fused.report.counts["horizontal_matmul"] == 2 * layers  # q/k/v and gate/up
    assert fused.report.counts["qmatmul"] == apart.report.counts["qmatmul"] == 7 * layers
    proto = onnx.load(fused.plan_dir / "model.onnx", load_external_data=False)
    assert [n.op_type for n in proto.graph.node].count("QMatMul") == 4 * layers  # qkv, o, gate/up, down

    plan = read_plan(fused.plan_dir)
    executors = {f"{backend}-{kind}": create_executor(backend, built.plan_dir, plan, num_blocks=24)
                 for kind, built in (("fused", fused), ("apart", apart)) for backend in ("torch", "onnxruntime")}
    # The GEMV + RoPE + KV-write epilogue takes a plain MatMul's [N, K] weight only: with a fused QMatMul (forced on
    # here, on the CPU) the attention op keeps rotating and writing the pool itself.
    executors["torch-gemv"] = TorchExecutor(fused.plan_dir, plan, decode_gemv=True)
    executors["torch-gemv"].allocate_kv_cache(24)
    assert executors["torch-gemv"].num_gemv_rope_kv == executors["torch-gemv"].num_gemv_silu_mul == 0
    rng = np.random.default_rng(0)
    prompts = tuple(tuple(rng.integers(0, plan.model.vocab_size, n).tolist()) for n in (21, 6, 1))
    results = compare_executors(plan, executors, Workload(prompts, chunk=8, decode_steps=4),
                                Tolerance(atol=1e-2, rtol=0.0), reference="onnxruntime-apart")
    want = results["onnxruntime-apart"].greedy_tokens
    assert want and all(want)
    for backend in executors:
        assert results[backend].greedy_tokens == want, backend
    assert results["onnxruntime-fused"].logits.max_abs <= 1e-4, results["onnxruntime-fused"].logits.max_abs
