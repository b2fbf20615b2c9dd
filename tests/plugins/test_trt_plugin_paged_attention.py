"""PagedAttention's TensorRT face: the AOT entry kernel (run here the way TensorRT launches it), its build-time
planning, the PTX compile step, and — where tensorrt is installed — the registration itself.

The kernel cases reuse the kernel suite's poisoned steps (NaN in the null block, unowned slots and the output), so
a read of a slot being written in the same launch, a missed row or a wrong stride shows up as NaN or a mismatch.
TensorRT hands dense buffers, so every input is made contiguous first.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
import triton

from test_paged_attention_fp8 import on_fp8_grid  # noqa: I001 - sibling test modules
from test_paged_attention_kernel import CASES, Case, make_step, tolerance
from trtopt.plugins.paged_attention import schema
from trtopt.plugins.paged_attention.reference import paged_attention_ref, quantized_pool
from trtopt.plugins.paged_attention.trt_aot import (
    aot_constexprs,
    aot_extra_args,
    aot_grid,
    aot_signature,
    aot_tiling,
    launch_like_tensorrt,
    paged_attention_aot_kernel,
)
from trtopt.plugins.trt_common import (
    check_aot_signature,
    check_register_signature,
    compile_ptx,
    launch_ptx,
    register_parameter_names,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FLOAT_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def run_aot_vs_reference(case: Case, device: torch.device, fp8_scales: tuple[float, float] | None = None) -> None:
    """The entry kernel launched as TensorRT launches it against paged_attention_ref, output and pool. fp8_scales
    (k_scale, v_scale): the step's pool quantized to FP8 first (reference.quantized_pool; its NaN poison stays NaN
    codes) and the node's FP8 attributes set; the pools must then agree byte for byte."""
    step = make_step(case, device)
    Hq = step.attrs["num_heads"]
    attrs = dict(step.attrs)
    if fp8_scales is not None:
        attrs.update(kv_cache_dtype="fp8", k_scale=fp8_scales[0], v_scale=fp8_scales[1])
        step.kv_cache = quantized_pool(step.kv_cache, *fp8_scales)
        # Under the interpreter the new k/v sit on the FP8 grid: its fp32 → e4m3 cast rounds some values wrongly
        # (Triton 3.9: 1.97 → 1.0, and 1.0625 → 1.125, not to even), where torch and GPUs round to nearest even. On
        # a GPU they stay as drawn, so the kernel's own rounding and saturation are checked there.
        step.k, step.v = (on_fp8_grid(x, scale, device) for x, scale in zip((step.k, step.v), fp8_scales))
    ref_attrs = {name: value for name, value in attrs.items() if name != "kv_cache_dtype"}
    # The plan always carries alibi_slopes: zeros when the model has none (docs/architecture.md §3).
    slopes = step.alibi_slopes if step.alibi_slopes is not None else torch.zeros(Hq, device=device)
    meta = (step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    ref_cache = step.kv_cache.cpu().clone()
    ref_out, _ = paged_attention_ref(step.q.cpu(), step.k.cpu(), step.v.cpu(), ref_cache, *(m.cpu() for m in meta),
                                     alibi_slopes=None if step.alibi_slopes is None else slopes.cpu(), **ref_attrs)
    q, k, v = (x.contiguous() for x in (step.q, step.k, step.v))
    cache = step.kv_cache  # contiguous already; kv_cache_out aliases it, as in the engine
    out = torch.full_like(q, float("nan"))
    float_type = FLOAT_TYPES[case.dtype]
    launch_like_tensorrt([q, k, v, cache, *meta, slopes], [out, cache], attrs=attrs,
                         block_size=case.block_size, float_type=float_type,
                         tiling=aot_tiling(Hq, case.num_kv_heads, interpret=device.type != "cuda"))
    assert not torch.isnan(out).any(), "NaN in the output: a row was skipped or poisoned memory was read"
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), **tolerance(case.dtype))
    if fp8_scales is None:
        torch.testing.assert_close(cache.cpu(), ref_cache, equal_nan=True, atol=0, rtol=0)
    else:
        assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))


# Every feature at least once: decode, prefill, mixed, GQA/MQA, head_dim 80/128, dropped slots, window, ALiBi.
AOT_CASES = ["decode_gqa4_bs32", "mixed_step", "mqa_gqa8_bs64", "head_dim_80", "dropped_slots", "sliding_window",
             "alibi_window_gqa4", "non_causal", "prefill_gqa2"]


@pytest.mark.parametrize("name", AOT_CASES)
def test_aot_kernel_launched_like_tensorrt_matches_reference(name: str, kernel_device: torch.device) -> None:
    run_aot_vs_reference(CASES[name], kernel_device)


def test_prefill_chunk_spanning_many_tiles_reads_new_keys_from_the_inputs(kernel_device: torch.device) -> None:
    # 40 new tokens after 23 cached ones: most key tiles hold new keys that other programs are writing meanwhile.
    run_aot_vs_reference(Case(context=(23, 0, 5), new=(40, 3, 1), num_heads=4, num_kv_heads=2, seed=11),
                         kernel_device)


# FP8 pools: decode and prefill, new keys read from the inputs and (dropped slots) from the pool, GQA/MQA, a padded
# head size, ALiBi and a window; scales that saturate some values (0.01) and that leave them in range.
FP8_AOT_CASES = ["decode_gqa4_bs32", "mixed_step", "mqa_gqa8_bs64", "head_dim_80", "dropped_slots",
                 "alibi_window_gqa4", "prefill_gqa2"]


@pytest.mark.parametrize("scales", [(0.5, 2.0), (0.01, 0.02)], ids=["in_range", "saturating"])
@pytest.mark.parametrize("name", FP8_AOT_CASES)
def test_aot_kernel_on_fp8_pools_matches_reference(name: str, scales, kernel_device: torch.device) -> None:
    run_aot_vs_reference(CASES[name], kernel_device, fp8_scales=scales)


def test_signature_is_inputs_then_extra_args_then_outputs() -> None:
    params = list(inspect.signature(paged_attention_aot_kernel.fn).parameters)
    signature = aot_signature("fp16")
    assert list(signature) == params[: len(signature)], "runtime parameters come first, in the signature's order"
    pointers = [n for n, t in signature.items() if t.startswith("*")]
    assert pointers[: len(schema.INPUTS)] == ["Q", "K", "V", "Cache", "BlockTables", "SeqLens", "QueryStartLoc",
                                             "SlotMapping", "Alibi"]
    assert list(signature)[-2:] == ["Out", "CacheOut"]
    assert [signature[n] for n in ("num_tokens", "num_seqs", "max_blocks")] == ["i32"] * 3
    assert signature["BlockTables"] == "*i32" and signature["SlotMapping"] == "*i64" and signature["Alibi"] == "*fp32"
    constexprs = aot_constexprs(num_heads=8, num_kv_heads=2, head_dim=80, scale=0.125, causal=1, sliding_window=0,
                                block_size=16, float_type="fp16", tiling=aot_tiling(8, 2))
    assert list(signature) + list(constexprs) == params
    assert len(aot_extra_args(7, 2, 5)) == 3
    fp8 = aot_signature("bf16", fp8_pool=True)
    assert fp8["Cache"] == fp8["CacheOut"] == "*fp8e4nv" and fp8["Q"] == fp8["Out"] == "*bf16"
    assert {n: t for n, t in fp8.items() if n not in ("Cache", "CacheOut")} == {
        n: t for n, t in aot_signature("bf16").items() if n not in ("Cache", "CacheOut")}


def test_constexprs_bake_an_fp8_pools_scales_in() -> None:
    common = dict(num_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, causal=1, sliding_window=0, block_size=16,
                  float_type="bf16", tiling=aot_tiling(8, 2))
    plain = aot_constexprs(**common)
    assert (plain["FP8_KV"], plain["K_SCALE"], plain["V_SCALE"]) == (False, 1.0, 1.0)
    assert aot_constexprs(**common, kv_cache_dtype="auto", k_scale=0.3, v_scale=0.2) == plain  # scales unused
    fp8 = aot_constexprs(**common, kv_cache_dtype="fp8", k_scale=0.03125, v_scale=0.5)
    assert (fp8["FP8_KV"], fp8["K_SCALE"], fp8["V_SCALE"]) == (True, 0.03125, 0.5)
    for bad in (dict(kv_cache_dtype="fp16"), dict(kv_cache_dtype="fp8", k_scale=0.0),
                dict(kv_cache_dtype="fp8", v_scale=float("inf"))):
        with pytest.raises(AssertionError):
            aot_constexprs(**common, **bad)


def test_constexprs_bake_the_scale_in_log2_units() -> None:
    c = aot_constexprs(num_heads=12, num_kv_heads=4, head_dim=80, scale=0.1, causal=0, sliding_window=5,
                       block_size=32, float_type="fp32", tiling=aot_tiling(12, 4))
    assert c["QK_SCALE"] == pytest.approx(0.1 * 1.4426950408889634, rel=1e-15)
    assert (c["GROUP"], c["GROUP_PAD"], c["BLOCK_D"], c["BLOCK_Q"]) == (3, 4, 128, 4)
    assert (c["IS_CAUSAL"], c["SLIDING_WINDOW"], c["DOT_PRECISION"]) == (False, 5, "ieee")
    with pytest.raises(AssertionError):
        aot_constexprs(num_heads=12, num_kv_heads=4, head_dim=80, scale=0.1, causal=0, sliding_window=0,
                       block_size=24, float_type="fp32", tiling=aot_tiling(12, 4))


@pytest.mark.parametrize("num_tokens,num_seqs,group", [(1, 1, 1), (64, 64, 4), (300, 3, 8), (17, 2, 16)])
def test_grid_covers_every_query_tile_and_every_row(num_tokens: int, num_seqs: int, group: int) -> None:
    tiling = aot_tiling(group * 2, 2)
    grid = aot_grid(num_tokens, num_seqs, num_kv_heads=2, tiling=tiling)
    assert grid[1:] == (2, 1)
    # The fused write needs cdiv(T, BLOCK_Q) programs; the attention needs T // BLOCK_Q + S (kernel.py).
    assert grid[0] >= triton.cdiv(num_tokens, tiling.block_q)
    assert grid[0] == num_tokens // tiling.block_q + num_seqs
    assert tiling.block_q * triton.next_power_of_2(group) >= 16, "tl.dot needs >= 16 rows"


def decorated_parameters(module_path: str, decorator: str) -> list[tuple[str, str]]:
    """(name, annotation source) of the function in ``module_path`` decorated with ``decorator`` (e.g.
    'trtp.register("trtopt::PagedAttention")'), read with ast so that it needs no tensorrt."""
    tree = ast.parse(open(module_path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == decorator for d in node.decorator_list):
            assert not node.args.defaults and not node.args.kw_defaults, f"{node.name}: no defaults allowed"
            return [(a.arg, ast.unparse(a.annotation) if a.annotation else "") for a in node.args.args]
    raise AssertionError(f"no function decorated with @{decorator} in {module_path}")


def trt_plugin_path(schema_module) -> str:
    return os.path.join(os.path.dirname(inspect.getfile(schema_module)), "trt_plugin.py")


def check_plugin_source(schema_module) -> None:
    """Without tensorrt: the register and aot_impl parameter lists in trt_plugin.py are the schema's inputs (as
    TensorDescs) then its attributes (annotated with the schema's kinds) in order, and aot_impl ends with
    (outputs, tactic)."""
    path, spec = trt_plugin_path(schema_module), schema_module.SCHEMA
    plugin_id = repr(f"trtopt::{spec.op_type}")  # ast.unparse writes single quotes
    expected = [(n, "trtp.TensorDesc") for n in spec.inputs] + [(a.name, a.kind.__name__) for a in spec.attributes]
    assert [n for n, _ in expected] == register_parameter_names(spec)
    assert decorated_parameters(path, f"trtp.register({plugin_id})") == expected
    aot = decorated_parameters(path, f"trtp.aot_impl({plugin_id})")
    assert aot == expected + [("outputs", "Tuple[trtp.TensorDesc]"), ("tactic", "int")]
    future = [a.name for n in ast.parse(open(path).read()).body if isinstance(n, ast.ImportFrom)
              and n.module == "__future__" for a in n.names]
    assert "annotations" not in future, "tensorrt.plugin checks annotations with issubclass: they must be types"


def test_plugin_source_parameters_match_the_schema() -> None:
    assert register_parameter_names(schema.SCHEMA) == [
        "q", "k", "v", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping", "alibi_slopes",
        "num_heads", "num_kv_heads", "head_dim", "scale", "causal", "sliding_window", "kv_cache_dtype", "k_scale",
        "v_scale"]
    check_plugin_source(schema)


PTX_SCRIPT = textwrap.dedent("""
    import sys
    from trtopt.plugins.paged_attention.trt_aot import (aot_constexprs, aot_signature, aot_tiling,
                                                          paged_attention_aot_kernel)
    from trtopt.plugins.trt_common import compile_ptx, ptx_param_count
    tiling = aot_tiling(8, 2)
    signature = aot_signature("fp16")
    kernel = compile_ptx(paged_attention_aot_kernel, signature,
                         aot_constexprs(num_heads=8, num_kv_heads=2, head_dim=128, scale=128 ** -0.5, causal=1,
                                        sliding_window=0, block_size=16, float_type="fp16", tiling=tiling),
                         num_warps=tiling.num_warps, num_stages=tiling.num_stages, target=("cuda", 90, 32))
    assert kernel.name == "paged_attention_aot_kernel", kernel.name
    assert f".entry {kernel.name}" in kernel.ptx and ".target sm_90" in kernel.ptx
    assert ptx_param_count(kernel.ptx, kernel.name) == len(signature), 'hidden params must be stripped'
    # An FP8 pool (bf16 model): e4m3 loads widened to fp16 for the dots, the write's conversion to e4m3
    fp8_signature = aot_signature("bf16", fp8_pool=True)
    fp8 = compile_ptx(paged_attention_aot_kernel, fp8_signature,
                      aot_constexprs(num_heads=8, num_kv_heads=2, head_dim=128, scale=128 ** -0.5, causal=1,
                                     sliding_window=0, block_size=16, float_type="bf16", tiling=tiling,
                                     kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.02),
                      num_warps=tiling.num_warps, num_stages=tiling.num_stages, target=("cuda", 90, 32))
    assert ptx_param_count(fp8.ptx, fp8.name) == len(fp8_signature)
    assert "e4m3" in fp8.ptx, "no e4m3 conversion in the FP8 kernel"
    print(kernel.block_x, kernel.shared_mem, len(kernel.ptx))
""")


def test_compiles_to_ptx_for_sm90_without_a_gpu() -> None:
    """triton.compile(ASTSource, target=GPUTarget("cuda", 90, 32)) works on a CPU-only machine (ptxas is not
    needed for PTX). A fresh process: the interpreter mode of this one makes kernels un-compilable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    block_x, shared_mem, ptx_len = map(int, done.stdout.split())
    assert block_x == 128 and shared_mem >= 0 and ptx_len > 1000


@pytest.mark.tensorrt
def test_registered_functions_match_the_schema() -> None:
    """The parser passes node attributes by name and aot_impl gets them positionally, in register order."""
    pytest.importorskip("tensorrt", reason="TensorRT cannot be installed here (NVIDIA index unreachable)")
    from trtopt.plugins.paged_attention import trt_plugin

    check_register_signature(trt_plugin.paged_attention_desc, schema.SCHEMA)
    check_aot_signature(trt_plugin.paged_attention_aot, schema.SCHEMA)


GPU_CASES = {
    **{name: CASES[name] for name in AOT_CASES},
    # Many query tiles of one prefill running at once with decode rows: any read of a slot written in the same
    # launch would race here (the interpreter runs programs one by one and cannot show it).
    "long_prefill_mixed": Case(context=(0, 100, 37, 0), new=(300, 1, 64, 129), num_heads=8, num_kv_heads=2,
                               head_dim=128, seed=12),
}


def _driver_launch(step, case: Case, dtype: torch.dtype, cache: torch.Tensor, slopes, meta, **fp8) -> torch.Tensor:
    """Compile the entry kernel's PTX for this GPU (hidden params stripped) and launch it with cuLaunchKernel with
    exactly TensorRT's arguments (inputs, T/S/table width, outputs) on the aliased pool `cache`; returns the output.
    fp8: the node's kv_cache_dtype/k_scale/v_scale for an FP8 pool."""
    q, k, v = (x.contiguous() for x in (step.q, step.k, step.v))
    out = torch.full_like(q, float("nan"))
    Hq, Hkv = step.attrs["num_heads"], step.attrs["num_kv_heads"]
    tiling = aot_tiling(Hq, Hkv)
    signature = aot_signature(FLOAT_TYPES[dtype], fp8_pool=fp8.get("kv_cache_dtype") == "fp8")
    kernel = compile_ptx(paged_attention_aot_kernel, signature,
                         aot_constexprs(**step.attrs, block_size=case.block_size, float_type=FLOAT_TYPES[dtype],
                                        tiling=tiling, **fp8),
                         num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    T, S, width = q.shape[2], step.seq_lens.shape[0], step.block_tables.shape[1]
    pointers = [x.data_ptr() for x in (q, k, v, cache, *meta, slopes)]
    launch_ptx(kernel, signature, [*pointers, *aot_extra_args(T, S, width), out.data_ptr(), cache.data_ptr()],
               aot_grid(T, S, num_kv_heads=Hkv, tiling=tiling), stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_ptx_launched_by_the_driver_matches_reference(name: str, dtype: torch.dtype) -> None:
    """The AOT artifact itself: PTX compiled for this GPU, hidden params stripped, launched with cuLaunchKernel
    with exactly TensorRT's arguments (inputs, T/S/table width, outputs) on an aliased pool."""
    case = replace(GPU_CASES[name], dtype=dtype)
    device = torch.device("cuda")
    step = make_step(case, device)
    Hq = step.attrs["num_heads"]
    slopes = step.alibi_slopes if step.alibi_slopes is not None else torch.zeros(Hq, device=device)
    meta = (step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    ref_cache = step.kv_cache.cpu().clone()
    ref_out, _ = paged_attention_ref(step.q.cpu(), step.k.cpu(), step.v.cpu(), ref_cache, *(m.cpu() for m in meta),
                                     alibi_slopes=None if step.alibi_slopes is None else slopes.cpu(), **step.attrs)
    out = _driver_launch(step, case, dtype, step.kv_cache, slopes, meta)
    cache = step.kv_cache
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), **tolerance(dtype))
    torch.testing.assert_close(cache.cpu(), ref_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["decode_gqa4_bs32", "dropped_slots", "long_prefill_mixed"])
def test_ptx_on_fp8_pools_launched_by_the_driver_matches_reference(name: str, dtype: torch.dtype) -> None:
    """The FP8 pool's AOT artifact the same way: new k/v as drawn (the GPU's own e4m3 rounding and saturation at
    k_scale 0.01), pools byte for byte against the reference's write."""
    case = replace(GPU_CASES[name], dtype=dtype)
    device = torch.device("cuda")
    step = make_step(case, device)
    Hq = step.attrs["num_heads"]
    k_scale, v_scale = 0.01, 0.5
    cache = quantized_pool(step.kv_cache, k_scale, v_scale)
    slopes = torch.zeros(Hq, device=device)
    meta = (step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    ref_cache = cache.cpu().clone()
    ref_out, _ = paged_attention_ref(step.q.cpu(), step.k.cpu(), step.v.cpu(), ref_cache, *(m.cpu() for m in meta),
                                     alibi_slopes=None, **step.attrs, k_scale=k_scale, v_scale=v_scale)
    out = _driver_launch(step, case, dtype, cache, slopes, meta, kv_cache_dtype="fp8", k_scale=k_scale,
                         v_scale=v_scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), **tolerance(dtype))
    assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
