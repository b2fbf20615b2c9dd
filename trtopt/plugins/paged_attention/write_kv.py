"""The KV write of PagedAttention as Triton kernels (face 4 of docs/architecture.md §4): the plain write, and the
RoPE of q and k folded into it.

One program per token writes K and V of all its KV heads into the pool, [num_blocks, 2, Hkv, block_size, D] (K at
[:, 0], V at [:, 1]); slot −1 means "do not write". The attention launch (attention.py) runs it first. A variant
that fused it into the attention launch (commit 2680905) was exact but measured 25-40% slower on H200 and was
removed; see docs/benchmarks/NOTES.md. When the model rotates q and k (RoPE) right before attention, the same small
kernel also does the rotation of both (`_rope_write_kv_kernel`: the torch executor's fusion of the plan's two Rope
nodes into this op, fx_fusions.py).

An FP8 pool (float8_e4m3fn) is written by either kernel with FP8_KV: x / scale in fp32, saturated to ±448, and
the store's conversion rounds to the nearest even (reference.to_pool). The scales are runtime arguments (k_scale,
v_scale), so one compilation serves every layer. They were constexprs, and a plan with calibrated per-layer scales
then compiled every kernel once per layer: on an H200, Gemma-3's first perplexity pass took 90-105 s with searched
scales against 1.3 s at scale 1.0 (benchmarks/fp8_kv.py). TensorRT's AOT kernel keeps them constexprs (trt_aot.py:
no float scalars), as it does the score scale. An FP8 pool's values go in transposed, value d of a token at
d·block_size + offset of its block's value half (reference.pool_values; `value_offsets`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins.kernel_common import TL_DTYPES, next_pow2, no_fp_fusion
from trtopt.plugins.launcher import Launcher, launch
from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE, rope_tables_fit
from trtopt.plugins.rope.kernel import rotate_half_rows
from trtopt.signature import FP8_E4M3_MAX

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def fp8_saturate(x, scale):
    """What an FP8 pool stores for x, before the store's cast rounds it to the nearest even e4m3: x / scale in fp32,
    saturated to ±448 (−0 stays −0; reference.to_pool). Every FP8 write calls it: the two here, the Q/K/V GEMV's
    epilogue and TensorRT's AOT kernel."""
    return tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)


@triton.jit
def allow_dependents():
    """Let the next kernel on the stream start now, if it was launched as a programmatic dependent (decode_cuda.py's
    FP8 decode kernel is, and waits for this kernel's end before it reads q or the pool): a no-op otherwise."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


def dependents_constexpr(kv_cache: torch.Tensor) -> dict:
    """ALLOW_DEPENDENTS of a KV write launch: True for an FP8 pool on a GPU of compute capability >= 9.0 (where
    decode_cuda.py's kernel, a programmatic dependent launch, may follow), else False (passed all the same, as
    fp8_constexprs says why)."""
    return dict(ALLOW_DEPENDENTS=kv_cache.dtype == FP8_POOL_DTYPE and kv_cache.device.type == "cuda"
                and torch.cuda.get_device_capability(kv_cache.device)[0] >= 9)


@triton.jit
def value_offsets(offset, offs_d, stride_co, stride_cd, FP8_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Where value d of the token at ``offset`` in its block goes, from the block's value half: offset·stride_co +
    d·stride_cd, or in an FP8 pool, whose values are stored [D, block_size] (a contiguous plane: the launches check),
    d·BLOCK_SIZE + offset."""
    if FP8_KV:
        return offs_d * BLOCK_SIZE + offset
    return offset * stride_co + offs_d * stride_cd


@triton.jit
def _write_kv_kernel(
    K, V, Cache, SlotMapping,
    k_scale, v_scale,  # an FP8 pool's scales (pool_scales; 1.0 and unread for other pools)
    stride_kh, stride_kt, stride_kd, stride_vh, stride_vt, stride_vd,
    stride_cb, stride_ckv, stride_ch, stride_co, stride_cd,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_KV: tl.constexpr = False, ALLOW_DEPENDENTS: tl.constexpr = False,
):
    if ALLOW_DEPENDENTS:
        allow_dependents()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # k, v: [BLOCK_H, BLOCK_D] for this token
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    head = Cache + block * stride_cb + offs_h[:, None] * stride_ch
    if FP8_KV:  # quantize; the cast below rounds to nearest even
        k = fp8_saturate(k, k_scale)
        v = fp8_saturate(v, v_scale)
    tl.store(head + offset * stride_co + offs_d[None, :] * stride_cd, k.to(Cache.dtype.element_ty), mask=mask)
    tl.store(head + stride_ckv + value_offsets(offset, offs_d, stride_co, stride_cd, FP8_KV, BLOCK_SIZE)[None, :],
             v.to(Cache.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    Q, K, V, Cos, Sin, QOut, Cache, SlotMapping,
    k_scale, v_scale,  # as _write_kv_kernel's
    stride_qh, stride_qt, stride_qd, stride_kh, stride_kt, stride_kd, stride_vh, stride_vt, stride_vd,
    stride_cos_t, stride_cos_d, stride_sin_t, stride_sin_d, stride_oh, stride_ot,
    stride_cb, stride_ckv, stride_ch, stride_co, stride_cd,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, DTYPE: tl.constexpr,
    FP8_KV: tl.constexpr = False, ALLOW_DEPENDENTS: tl.constexpr = False,
):
    """RoPE of q and k and the KV write in one launch (one program per token; cos/sin are one row per token,
    shared by every head): q_out[h, t] = rope(q[h, t]) for every query head, and for a token with slot >= 0
    pool[slot] = (rope(k[:, t]), v[:, t]). The rotation is rope/kernel.py's, so the result is bit for bit that of
    two Rope launches and the plain KV write (three launches per layer, one here), FP8 pools included: the rotated
    k is rounded to DTYPE first, then quantized as _write_kv_kernel quantizes."""
    if ALLOW_DEPENDENTS:
        allow_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_ok = offs < HALF
    c1 = tl.load(Cos + t * stride_cos_t + offs * stride_cos_d, mask=d_ok).to(tl.float32)[None, :]
    c2 = tl.load(Cos + t * stride_cos_t + (offs + HALF) * stride_cos_d, mask=d_ok).to(tl.float32)[None, :]
    s1 = tl.load(Sin + t * stride_sin_t + offs * stride_sin_d, mask=d_ok).to(tl.float32)[None, :]
    s2 = tl.load(Sin + t * stride_sin_t + (offs + HALF) * stride_sin_d, mask=d_ok).to(tl.float32)[None, :]

    # q: [BLOCK_HQ, BLOCK_HALF] per half, every query head of this token
    hq = tl.arange(0, BLOCK_HQ)
    mq = (hq < NUM_HEADS)[:, None] & d_ok[None, :]
    q_src = Q + t * stride_qt + hq[:, None] * stride_qh
    q1 = tl.load(q_src + offs[None, :] * stride_qd, mask=mq).to(tl.float32)
    q2 = tl.load(q_src + (offs + HALF)[None, :] * stride_qd, mask=mq).to(tl.float32)
    o1, o2 = rotate_half_rows(q1, q2, c1, c2, s1, s2, DTYPE)
    q_dst = QOut + t * stride_ot + hq[:, None] * stride_oh
    tl.store(q_dst + offs[None, :], o1, mask=mq)
    tl.store(q_dst + HALF + offs[None, :], o2, mask=mq)

    # k (rotated) and v into the pool, unless the slot is −1 (names differ from q's: the branch may not redefine a
    # value with another shape, which the compiler refuses and the interpreter does not notice)
    slot = tl.load(SlotMapping + t)
    if slot >= 0:
        hk = tl.arange(0, BLOCK_HKV)
        mk = (hk < NUM_KV_HEADS)[:, None] & d_ok[None, :]
        k_src = K + t * stride_kt + hk[:, None] * stride_kh
        k_lo = tl.load(k_src + offs[None, :] * stride_kd, mask=mk).to(tl.float32)
        k_hi = tl.load(k_src + (offs + HALF)[None, :] * stride_kd, mask=mk).to(tl.float32)
        k1, k2 = rotate_half_rows(k_lo, k_hi, c1, c2, s1, s2, DTYPE)
        v_src = V + t * stride_vt + hk[:, None] * stride_vh
        v1 = tl.load(v_src + offs[None, :] * stride_vd, mask=mk).to(DTYPE)
        v2 = tl.load(v_src + (offs + HALF)[None, :] * stride_vd, mask=mk).to(DTYPE)
        if FP8_KV:  # as _write_kv_kernel; the stores' cast rounds to nearest even
            k1 = fp8_saturate(k1, k_scale)
            k2 = fp8_saturate(k2, k_scale)
            v1 = fp8_saturate(v1, v_scale)
            v2 = fp8_saturate(v2, v_scale)
        offset = slot % BLOCK_SIZE
        head = Cache + (slot // BLOCK_SIZE) * stride_cb + hk[:, None] * stride_ch
        k_dst = head + offset * stride_co
        tl.store(k_dst + offs[None, :] * stride_cd, k1.to(Cache.dtype.element_ty), mask=mk)
        tl.store(k_dst + (offs + HALF)[None, :] * stride_cd, k2.to(Cache.dtype.element_ty), mask=mk)
        v_dst = head + stride_ckv
        tl.store(v_dst + value_offsets(offset, offs, stride_co, stride_cd, FP8_KV, BLOCK_SIZE)[None, :],
                 v1.to(Cache.dtype.element_ty), mask=mk)
        tl.store(v_dst + value_offsets(offset, offs + HALF, stride_co, stride_cd, FP8_KV, BLOCK_SIZE)[None, :],
                 v2.to(Cache.dtype.element_ty), mask=mk)


def fp8_constexprs(kv_cache: torch.Tensor) -> dict:
    """The FP8_KV constexpr of a launch: True for an FP8 pool (after checking that its values' plane is contiguous,
    `value_offsets`), else the kernels' default, passed all the same: the launcher keeps a compiled kernel (and
    prepares cuLaunchKernel launches) only for calls that pass every parameter, so leaving a defaulted constexpr out
    sends each launch through Triton's dispatcher (plugins/launcher.py `_launch_kept`)."""
    if kv_cache.dtype != FP8_POOL_DTYPE:
        return dict(FP8_KV=False)
    if kv_cache.stride(-1) != 1 or kv_cache.stride(-2) != kv_cache.shape[-1]:
        raise ValueError("an FP8 pool stores each block's values as [head_dim, block_size] in its (block_size, "
                         f"head_dim) plane, which must be contiguous; got strides {kv_cache.stride()}")
    return dict(FP8_KV=True)


def pool_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The k_scale and v_scale arguments of a launch: an FP8 pool's, as floats; 1.0 for any other pool, whose
    kernels never read them (so its launches key alike whatever scales the caller passed)."""
    if kv_cache.dtype != FP8_POOL_DTYPE:
        return 1.0, 1.0
    return float(k_scale), float(v_scale)


def _write_kv_launch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     k_scale: float = 1.0, v_scale: float = 1.0):
    """(kernel, grid, args, constexprs) of the KV write."""
    _, Hkv, T, D = k.shape
    return _write_kv_kernel, (T,), (
        k, v, kv_cache, slot_mapping, *pool_scales(kv_cache, k_scale, v_scale),
        *k.stride()[1:], *v.stride()[1:], *kv_cache.stride(),
    ), dict(
        BLOCK_SIZE=kv_cache.shape[3], NUM_KV_HEADS=Hkv, HEAD_DIM=D,
        BLOCK_H=next_pow2(Hkv), BLOCK_D=next_pow2(D),
        num_warps=4 if Hkv * D >= 1024 else 1, **fp8_constexprs(kv_cache), **dependents_constexpr(kv_cache),
    )


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                    launcher: Launcher | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """pool[slot // bs, 0, :, slot % bs, :] = k[0, :, t, :] (and V at index 1) for every t with slot >= 0.
    Launched through `launcher` (the caller's switch; PagedAttention passes its state's), else launcher.launch.
    An FP8 pool stores k / k_scale and v / v_scale quantized (reference.to_pool); other pools ignore the scales."""
    if k.shape[2] == 0:
        return
    kernel, grid, args, constexprs = _write_kv_launch(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    (launch if launcher is None else launcher.launch)(kernel, grid, *args, **constexprs)


def _row_strides(table: torch.Tensor) -> tuple[int, int]:
    """(token, dim) strides of a cos/sin table broadcast to [1, 1, T, D]: 0 along a size-1 dim (what expand gives,
    without a view per launch)."""
    return (table.stride(-2) if table.dim() >= 2 and table.shape[-2] != 1 else 0,
            table.stride(-1) if table.shape[-1] != 1 else 0)


def _rope_write_kv_launch(q, k, v, cos, sin, q_out, kv_cache, slot_mapping, k_scale: float = 1.0,
                          v_scale: float = 1.0):
    """(kernel, grid, args, constexprs) of the RoPE + KV write."""
    _, Hq, T, D = q.shape
    Hkv = k.shape[1]
    half = D // 2
    block_hq, block_half = next_pow2(Hq), next_pow2(half)
    return _rope_write_kv_kernel, (T,), (
        q, k, v, cos, sin, q_out, kv_cache, slot_mapping, *pool_scales(kv_cache, k_scale, v_scale),
        *q.stride()[1:], *k.stride()[1:], *v.stride()[1:], *_row_strides(cos), *_row_strides(sin),
        *q_out.stride()[1:3], *kv_cache.stride(),
    ), dict(
        BLOCK_SIZE=kv_cache.shape[3], NUM_HEADS=Hq, NUM_KV_HEADS=Hkv, HALF=half, BLOCK_HQ=block_hq,
        BLOCK_HKV=next_pow2(Hkv), BLOCK_HALF=block_half, DTYPE=TL_DTYPES[q.dtype],
        num_warps=4 if block_hq * block_half >= 1024 else 1, **fp8_constexprs(kv_cache),
        **dependents_constexpr(kv_cache), **no_fp_fusion(),
    )


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                         launcher: Launcher | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Rotate q and k (RoPE, cos/sin broadcastable to [1, 1, T, D]: one row per token, shared by all heads) and
    write the rotated k and v at slot_mapping, in one launch. Returns the rotated q, a new contiguous [1, Hq, T, D].
    Bit for bit `rope_triton(q)`, `rope_triton(k)` then `write_kv_triton`; q/k/v/kv_cache are checked by the caller.
    `launcher`, k_scale and v_scale as for write_kv_triton."""
    if not rope_tables_fit(q, cos, sin):
        raise ValueError(f"rope_write_kv_triton needs an even head_dim and cos/sin of q's dtype {q.dtype} that "
                         f"broadcast to [1, 1, T={q.shape[2]}, D={q.shape[3]}]; got cos {cos.dtype} "
                         f"{tuple(cos.shape)}, sin {sin.dtype} {tuple(sin.shape)}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[2] == 0:
        return q_out
    kernel, grid, args, constexprs = _rope_write_kv_launch(q, k, v, cos, sin, q_out, kv_cache, slot_mapping,
                                                           k_scale, v_scale)
    (launch if launcher is None else launcher.launch)(kernel, grid, *args, **constexprs)
    return q_out

