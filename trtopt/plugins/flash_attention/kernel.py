"""FlashAttention forward as a Triton kernel (face 4 of docs/architecture.md §4).

FA2 structure: one program per (query block, batch·head); it streams K/V blocks through an online softmax in
fp32 registers and writes each output row once. Causal runs in two phases: key blocks every row of the query
block may see (no mask arithmetic), then the diagonal blocks (masked). Head dims that are not a power of two
(80, 96) are padded to the next one with load masks. GQA/MQA: query head h reads KV head h // (Hq / Hkv).
On Hopper, q/k/v/out move through TMA (host-built tensor descriptors) where their strides allow; the pointer path
is the same math and serves everything else (and TensorRT AOT, which cannot pass descriptors).

`flash_attention_triton` has the signature of `reference.flash_attention_ref` and never reads device memory on
the host: the grid comes from shapes alone.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

_LOG2E = 1.4426950408889634
# An additive bias of finfo.min (HF padding masks) times log2(e) would overflow fp32 to -inf, and a row masked
# everywhere would then turn into NaN. Clamping keeps such rows finite (uniform weights, as softmax gives).
_BIAS_FLOOR = tl.constexpr(-1.0e30)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _autotune_configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter runs every config it is given; one small config keeps CPU tests fast.
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # Hopper (measured on H200, docs/benchmarks/NOTES.md): 128×128 with 8 warps wins long sequences at D=128,
    # 64×64 with 4 warps wins shorter ones and D=64.
    shapes = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3),
              (64, 128, 4, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=_set_tma_blocks)
            for m, n, w, s in shapes]


def _set_tma_blocks(nargs: dict) -> None:
    """TMA descriptors carry their box shape, which depends on the config being launched."""
    if isinstance(nargs["desc_q"], TensorDescriptor):
        block_m, block_n, block_d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
        nargs["desc_q"].block_shape = [1, 1, block_m, block_d]
        nargs["desc_o"].block_shape = [1, 1, block_m, block_d]
        nargs["desc_k"].block_shape = [1, 1, block_n, block_d]
        nargs["desc_v"].block_shape = [1, 1, block_n, block_d]


@triton.jit
def _attend_block_range(
    acc, l_i, m_i, q,  # acc: [BLOCK_M, BLOCK_D] fp32; l_i, m_i: [BLOCK_M]; q: [BLOCK_M, BLOCK_D]
    k_base, v_base, bias_base, desc_k, desc_v, b32, kvh32,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
    offs_m, offs_d, row_ok, start_n, end_n, Sk, causal_offset, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Fold key blocks [start_n, end_n) into the running softmax. MASKED blocks check bounds and causality."""
    d_ok = offs_d < HEAD_DIM
    for n0 in range(start_n, end_n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            kv_mask = (offs_n[:, None] < Sk) & d_ok[None, :]
        else:
            kv_mask = d_ok[None, :]
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        if USE_TMA:
            # The copy engine zero-fills keys past Sk; the masked phase hides their scores.
            k = desc_k.load([b32, kvh32, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED or BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)  # unmasked and unpadded: the loads vectorise freely
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # qk: [BLOCK_M, BLOCK_N], unscaled
        if HAS_BIAS:
            # Rows past S must not be read: a full [B,Hq,S,Sk] bias has no padding rows.
            b_mask = row_ok[:, None] & (offs_n[None, :] < Sk)
            b = tl.load(bias_base + offs_m[:, None] * stride_bm + offs_n[None, :] * stride_bn, mask=b_mask, other=0.0)
            qk = qk * qk_scale + tl.maximum(b.to(tl.float32), _BIAS_FLOOR) * 1.4426950408889634
        if MASKED:
            visible = offs_n[None, :] < Sk
            if IS_CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(visible, qk, float("-inf"))
        # Scores are in log2 units so the exponentials are exp2. Without a bias the scale is folded into the
        # subtraction (one FMA per score instead of a multiply and an add): the softmax is elementwise-bound.
        if HAS_BIAS:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if USE_TMA:
            v = desc_v.load([b32, kvh32, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED or BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """fp32 tiles of 128 rows spill registers and take ptxas minutes to compile: fp32 gets the 64-row configs."""
    if named_args["Q"].dtype == torch.float32:
        small = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64]
        return small[:1] or configs[:1]
    return configs


# Tuned per power-of-two bucket of the lengths, not per exact length: a runtime sees many lengths.
@triton.autotune(configs=_autotune_configs(), key=["S_BUCKET", "SK_BUCKET", "HEAD_DIM", "IS_CAUSAL", "HAS_BIAS", "GROUP", "USE_TMA"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def _flash_fwd_kernel(
    Q, K, V, Bias, Out,
    desc_q, desc_k, desc_v, desc_o,  # TMA descriptors of q/k/v/out when USE_TMA, else unused placeholders
    qk_scale,  # softmax scale · log2(e)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, S, Sk, S_BUCKET, SK_BUCKET,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Heaviest causal query blocks (the last ones) start first, which evens out the tail of the launch.
    num_m_blocks = tl.cdiv(S, BLOCK_M)
    start_m = (num_m_blocks - 1 - tl.program_id(0)) if IS_CAUSAL else tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    kvh = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    b32, h32, kvh32 = b.to(tl.int32), h.to(tl.int32), kvh.to(tl.int32)  # descriptor coordinates are int32

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    if USE_TMA:
        q = desc_q.load([b32, h32, start_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=q_mask, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    bias_base = Bias + b * stride_bb + h * stride_bh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Query row i sees keys j <= i + (Sk - S) when causal. Blocks below `full_end` are visible to every row.
    causal_offset = Sk - S
    if IS_CAUSAL:
        first_row_last_key = start_m * BLOCK_M + causal_offset
        full_end = tl.maximum((first_row_last_key + 1) // BLOCK_N * BLOCK_N, 0)
        full_end = tl.minimum(full_end, Sk // BLOCK_N * BLOCK_N)
        masked_end = tl.minimum(start_m * BLOCK_M + BLOCK_M + causal_offset, Sk)
    else:
        full_end = Sk // BLOCK_N * BLOCK_N
        masked_end = Sk

    acc, l_i, m_i = _attend_block_range(
        acc, l_i, m_i, q, k_base, v_base, bias_base, desc_k, desc_v, b32, kvh32,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
        offs_m, offs_d, offs_m < S, 0, full_end, Sk, causal_offset, qk_scale,
        BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, HAS_BIAS, DOT_PRECISION, USE_TMA,
    )
    acc, l_i, m_i = _attend_block_range(
        acc, l_i, m_i, q, k_base, v_base, bias_base, desc_k, desc_v, b32, kvh32,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
        offs_m, offs_d, offs_m < S, full_end, masked_end, Sk, causal_offset, qk_scale,
        BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, HAS_BIAS, DOT_PRECISION, USE_TMA,
    )

    # Rows that see no key at all (causal with S > Sk) have l_i == 0: they output zeros, not NaN.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if USE_TMA:
        # The copy engine drops rows past S.
        desc_o.store([b32, h32, start_m * BLOCK_M, 0], out.to(Out.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_D))
        return
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=q_mask)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None,
                  num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, S, D = q.shape
    if (Hq, D) != (num_heads, head_dim):
        raise ValueError(f"q is {tuple(q.shape)} but num_heads={num_heads}, head_dim={head_dim}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != num_kv_heads or k.shape[3] != D:
        raise ValueError(f"k/v must be [B={B}, Hkv={num_kv_heads}, Sk, D={D}]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v must share one dtype of {_SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q/k/v on different devices: {q.device}, {k.device}, {v.device}")
    if attn_bias is not None:
        if attn_bias.dim() > 4 or not attn_bias.is_floating_point():
            raise ValueError(f"attn_bias must be a float tensor broadcastable to [B,Hq,S,Sk]; got {attn_bias.dtype} "
                             f"{tuple(attn_bias.shape)}")
        if attn_bias.device != q.device:
            raise ValueError(f"attn_bias is on {attn_bias.device}, q on {q.device}")


def flash_attention_triton(
    q: torch.Tensor,  # [B, Hq, S, D], any strides
    k: torch.Tensor,  # [B, Hkv, Sk, D]
    v: torch.Tensor,  # [B, Hkv, Sk, D]
    attn_bias: torch.Tensor | None = None,  # additive, broadcastable to [B, Hq, S, Sk]
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: int = 0,
    out: torch.Tensor | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias [+ causal mask]) · v, fp32 accumulation, output [B, Hq, S, D] in q's dtype.

    Causal means query i sees keys j <= i + (Sk − S). Rows that see no key output zeros. `out`, if given, is a
    preallocated output buffer (any strides) to write instead of a new tensor. `use_tma` picks Hopper's bulk
    tensor copies for q/k/v/out (None: wherever the chip, dtype, head_dim and strides allow it).
    """
    _check_inputs(q, k, v, attn_bias, num_heads, num_kv_heads, head_dim)
    B, Hq, S, D = q.shape
    Sk = k.shape[2]
    if out is None:
        out = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (B, Hq, S, D) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {(B, Hq, S, D)} on {q.device}; got {out.dtype} {tuple(out.shape)}")
    if S == 0:
        return out
    if attn_bias is not None:
        # expand() gives broadcast dims stride 0: the kernel reads the same bias values, nothing is copied.
        bias = attn_bias.expand(B, Hq, S, Sk)
        bias_strides = bias.stride()
    else:
        bias = q  # never read: HAS_BIAS=False compiles the loads away
        bias_strides = (0, 0, 0, 0)
    if use_tma is None:
        use_tma = _tma_eligible(q, k, v, out)
    if use_tma:
        # The box shape is a placeholder: _set_tma_blocks sets it for each config the autotuner launches.
        descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, D]) for t in (q, k, v, out)]
    else:
        descs = [q, k, v, out]
    grid = lambda meta: (triton.cdiv(S, meta["BLOCK_M"]), B * Hq)  # noqa: E731 - the autotuner needs a callable
    _flash_fwd_kernel[grid](
        q, k, v, bias, out, *descs,
        scale * _LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *bias_strides, *out.stride(),
        Hq, S, Sk, triton.next_power_of_2(S), triton.next_power_of_2(Sk),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        IS_CAUSAL=bool(causal), HAS_BIAS=attn_bias is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_TMA=bool(use_tma),
    )
    return out


def _tma_eligible(*tensors: torch.Tensor) -> bool:
    """Bulk tensor copies need Hopper+, 16-byte aligned bases and strides, unit last stride, and (here) an unpadded
    power-of-two head_dim so boxes never cross D."""
    first = tensors[0]
    if first.device.type != "cuda" or torch.cuda.get_device_capability(first.device)[0] < 9:
        return False
    if first.dtype not in (torch.float16, torch.bfloat16) or first.shape[-1] not in (64, 128):
        return False
    size = first.element_size()
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(st > 0 and st * size % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def flash_attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> float:
    """Matmul FLOPs of one forward (2 GEMMs · 2 FLOP per MAC), halved for causal as FA papers count it."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    return flops / 2 if causal else flops


__all__ = ["flash_attention_triton", "flash_attention_flops"]
