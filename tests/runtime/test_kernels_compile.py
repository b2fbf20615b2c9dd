"""Triton kernels compile to PTX for sm_90 on this CPU-only machine: the runtime's CUDA-only kernels of issue 11
(session 7) and the plugin kernels issue 13 changed. (They were written without a GPU; session 8 ran them on the
H200. This stays as the CPU guard for the next change to them, which CI would otherwise not compile.)

The interpreter tests (test_argmax.py, tests/plugins/test_paged_attention_kernel.py) check what these kernels
compute, but the interpreter never lowers them: a typing or layout error that only the compiler sees would
reach the GPU first. This compiles each one, in each dtype the engine launches it with, in a fresh process (the
interpreter mode of this one makes kernels un-compilable), as the TensorRT AOT tests do for their kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import triton.language as tl
    from trtopt.plugins.paged_attention.write_kv import _rope_write_kv_kernel
    from trtopt.plugins.trt_common import compile_ptx
    from trtopt.runtime.kernels.argmax_triton import _argmax_pieces, _argmax_rows

    TL = {"fp32": tl.float32, "fp16": tl.float16, "bf16": tl.bfloat16}
    done = []

    def ptx(fn, signature, constexprs, warps=4):
        kernel = compile_ptx(fn, signature, constexprs, num_warps=warps, num_stages=3, target=("cuda", 90, 32))
        assert ".target sm_90" in kernel.ptx, kernel.name
        done.append(kernel.name)

    for dt in ("fp32", "fp16", "bf16"):
        p = "*" + dt
        rope = {n: p for n in ("Q", "K", "V", "Cos", "Sin", "QOut", "Cache")}
        rope["SlotMapping"] = "*i64"
        rope.update(k_scale="fp32", v_scale="fp32")
        rope.update({n: "i32" for n in ("stride_qh", "stride_qt", "stride_qd", "stride_kh", "stride_kt", "stride_kd",
                                         "stride_vh", "stride_vt", "stride_vd", "stride_cos_t", "stride_cos_d",
                                         "stride_sin_t", "stride_sin_d", "stride_oh", "stride_ot", "stride_cb",
                                         "stride_ckv", "stride_ch", "stride_co", "stride_cd")})
        no_fp8 = dict(FP8_KV=False, ALLOW_DEPENDENTS=False)
        ptx(_rope_write_kv_kernel, rope, dict(BLOCK_SIZE=16, NUM_HEADS=32, NUM_KV_HEADS=8, HALF=32, BLOCK_HQ=32,
                                              BLOCK_HKV=8, BLOCK_HALF=32, DTYPE=TL[dt], **no_fp8))
        if dt != "fp32":  # the FP8 pool's write (kv_cache_dtype="fp8"); the scales are runtime fp32 arguments
            ptx(_rope_write_kv_kernel, {**rope, "Cache": "*fp8e4nv"},
                dict(BLOCK_SIZE=16, NUM_HEADS=32, NUM_KV_HEADS=8, HALF=32, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=32,
                     DTYPE=TL[dt], FP8_KV=True, ALLOW_DEPENDENTS=False))
            # and the form that lets decode_cuda.py's kernel, a programmatic dependent launch, start early
            kernel = compile_ptx(_rope_write_kv_kernel, {**rope, "Cache": "*fp8e4nv"},
                                 dict(BLOCK_SIZE=16, NUM_HEADS=32, NUM_KV_HEADS=8, HALF=32, BLOCK_HQ=32, BLOCK_HKV=8,
                                      BLOCK_HALF=32, DTYPE=TL[dt], FP8_KV=True, ALLOW_DEPENDENTS=True),
                                 num_warps=4, num_stages=3, target=("cuda", 90, 32))
            assert "griddepcontrol.launch_dependents" in kernel.ptx
        ptx(_argmax_pieces, {"X": p, "Keys": "*i64", "Idx": "*i32", "V": "i32", "stride_x": "i32",
                             "num_pieces": "i32"}, dict(CHUNK=4096), warps=8)
    ptx(_argmax_rows, {"Keys": "*i64", "Idx": "*i32", "Out": "*i64", "num_pieces": "i32"}, dict(BLOCK=32), warps=1)

    # Plugin kernels changed since their last GPU run (issue 13: the norms' scale-dtype output, GELU·mul).
    from trtopt.plugins.add_rms_norm.kernel import _add_rms_norm_fp8_kernel, _add_rms_norm_kernel
    from trtopt.plugins.gelu_mul.kernel import _gelu_mul_kernel
    from trtopt.plugins.rms_norm.kernel import _rms_norm_fp8_kernel, _rms_norm_kernel
    for x_dt, scale_dt in (("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")):
        x, sc = "*" + x_dt, "*" + scale_dt
        norm = dict(BLOCK=1024, X_DTYPE=TL[x_dt], OUT_DTYPE=TL[scale_dt])
        ptx(_add_rms_norm_kernel, {"X": x, "R": x, "Scale": sc, "Sum": x, "Out": sc, "stride_x": "i32",
                                   "stride_r": "i32", "N": "i32", "eps": "fp32"}, norm)
        ptx(_rms_norm_kernel, {"X": x, "Scale": sc, "Out": sc, "stride_x": "i32", "stride_o": "i32", "N": "i32",
                               "eps": "fp32"}, norm)
        # their FP8 forms (a W8A8 projection's input quantized in the norm's launch)
        dynamic = x_dt != "fp32"  # the dynamic per-token scale, and (fp32) the static one
        ptx(_add_rms_norm_fp8_kernel, {"X": x, "R": x, "Scale": sc, "Sum": x, "Q": "*u8", "RS": "*fp32", "S": "*fp32",
                                       "stride_x": "i32", "stride_r": "i32", "N": "i32", "eps": "fp32",
                                       "MIN_SCALE": "fp32"}, dict(norm, DYNAMIC=dynamic))
        ptx(_rms_norm_fp8_kernel, {"X": x, "Scale": sc, "Q": "*u8", "RS": "*fp32", "S": "*fp32", "stride_x": "i32",
                                   "N": "i32", "eps": "fp32", "MIN_SCALE": "fp32"}, dict(norm, DYNAMIC=dynamic))
    from trtopt.plugins.silu_mul.kernel import _silu_mul_fp8_kernel
    for dt in ("fp32", "fp16", "bf16"):  # SiluMul's FP8 form (a W8A8 down projection's input)
        ptx(_silu_mul_fp8_kernel, {"G": "*" + dt, "U": "*" + dt, "Q": "*u8", "RS": "*fp32", "S": "*fp32",
                                   "stride_g": "i32", "stride_u": "i32", "N": "i32", "MIN_SCALE": "fp32"},
            dict(BLOCK=8192, DTYPE=TL[dt], DYNAMIC=dt != "fp32"), warps=32)
    from trtopt.plugins.gelu_mul.kernel import _gelu_mul_fp8_kernel
    for tanh in (0, 1):  # GeluMul's FP8 form (Gemma's W8A8 down projection)
        ptx(_gelu_mul_fp8_kernel, {"G": "*bf16", "U": "*bf16", "Q": "*u8", "RS": "*fp32", "S": "*fp32",
                                   "stride_g": "i32", "stride_u": "i32", "N": "i32", "MIN_SCALE": "fp32"},
            dict(BLOCK=8192, DTYPE=TL["bf16"], DYNAMIC=bool(tanh), TANH=tanh), warps=32)
    for dt in ("fp32", "fp16", "bf16"):
        for tanh in (0, 1):
            ptx(_gelu_mul_kernel, {"G": "*" + dt, "U": "*" + dt, "Y": "*" + dt, "stride_g": "i32", "stride_u": "i32",
                                   "N": "i32"}, dict(BLOCK=1024, DTYPE=TL[dt], TANH=tanh))

    # The decode GEMVs (issue 11, session 13), in the dtypes the executor runs them in, plain (storing float32 at one
    # row, as the LM head's does) and SiLU·mul.
    from trtopt.runtime.kernels.gemv_triton import _gemv
    for dt in ("fp16", "bf16"):
        for m_pad in (1, 4):
            for silu in (False, True):
                ptx(_gemv, {"X": "*" + dt, "W": "*" + dt, "Y": "*" + dt, "M": "i32", "N": "i32", "K": "i32",
                            "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"},
                    dict(M_PAD=m_pad, BLOCK_N=2, BLOCK_K=2048 // m_pad, K_TILES=m_pad, EVEN_K=True, SILU_MUL=silu,
                         DTYPE=TL[dt], OUT_DTYPE=TL["fp32" if m_pad == 1 and not silu else dt]))
    # ... and the Q/K/V GEMV with RoPE and the KV write as its epilogue (session 14), one and two pairs a program.
    from trtopt.runtime.kernels.gemv_triton import _gemv_rope_kv
    for dt in ("fp16", "bf16"):
        for pairs in (1, 2):
            sig = {n: "*" + dt for n in ("X", "W", "Y", "Cos", "Sin", "Cache")}
            sig["SlotMapping"] = "*i64"
            sig.update(K="i32", k_scale="fp32", v_scale="fp32")
            sig.update({n: "i32" for n in ("stride_wn", "stride_cos_d", "stride_sin_d", "stride_cb",
                                            "stride_ckv", "stride_ch", "stride_co", "stride_cd")})
            for fp8 in (False, True):  # the pool in the model's dtype, and an FP8 pool
                ptx(_gemv_rope_kv, {**sig, "Cache": "*fp8e4nv"} if fp8 else sig,
                    dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=32, POOL_BLOCK=16, BLOCK_P=pairs, BLOCK_K=2048,
                         K_TILES=1, EVEN_K=True, DTYPE=TL[dt], FP8_KV=fp8))
    print(len(done))
""")


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == 3 * 2 + 2 + 1 + 4 * 4 + 3 + 2 + 3 * 2 + 2 * 2 * 2 + 2 * 2 * 2
