"""FlashAttention's AOT entry point for TensorRT (face 5 of docs/architecture.md §4), with no `tensorrt` import:
testable here.

The entry kernel is a thin @triton.jit wrapper that calls kernel.py's own `_flash_fwd_kernel` (its JIT function,
`.fn`, under the autotuner) with what TensorRT's AOT launch can give it:

- TensorRT's argument order: input pointers (q, k, v, attn_bias), then SymInt32 scalars, then the output pointer.
- The softmax scale as a constexpr (QK_SCALE = scale·log2 e): AOT kernels take no float scalars.
- Dense buffers: q/k/v/out strides follow from the shapes (S and Sk are extra args); the bias's strides are extra
  args, 0 on the axes where the bias is a build-time constant 1 (broadcast), so a [B, 1, 1, Sk] key-padding mask
  is read in place. A dynamic bias axis is taken to be full size (exports keep broadcast axes static).
- No TMA (USE_TMA=False: host tensor descriptors do not exist in an AOT launch), one fixed tile config instead of
  the autotuner's, and HAS_BIAS always on: the descs cannot tell the zero [1, 1, 1, 1] initializer (no bias) from
  a real bias, and a zero bias adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import triton
import triton.language as tl

from trtopt.plugins.flash_attention.kernel import _flash_fwd_kernel
from trtopt.plugins.trt_common import FLOAT_TYPES, dot_precision

_LOG2E = 1.4426950408889634
_FLASH_FWD = _flash_fwd_kernel.fn  # the @triton.jit function under the autotuner


@triton.jit
def flash_attention_aot_kernel(
    Q, K, V, Bias,  # inputs, node order
    seq_q, seq_k, stride_bb, stride_bh, stride_bm, stride_bn,  # extra args (SymInt32)
    Out,  # output
    QK_SCALE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Dense [B, H, S, D] strides for q/out and [B, Hkv, Sk, D] for k/v.
    _FLASH_FWD(
        Q, K, V, Bias, Out, Q, K, V, Out,  # the TMA descriptor slots get plain pointers: USE_TMA is off
        QK_SCALE,
        NUM_HEADS * seq_q * HEAD_DIM, seq_q * HEAD_DIM, HEAD_DIM, 1,
        NUM_KV_HEADS * seq_k * HEAD_DIM, seq_k * HEAD_DIM, HEAD_DIM, 1,
        NUM_KV_HEADS * seq_k * HEAD_DIM, seq_k * HEAD_DIM, HEAD_DIM, 1,
        stride_bb, stride_bh, stride_bm, stride_bn,
        NUM_HEADS * seq_q * HEAD_DIM, seq_q * HEAD_DIM, HEAD_DIM, 1,
        NUM_HEADS, seq_q, seq_k, 0, 0,  # S_BUCKET / SK_BUCKET only key the autotuner
        NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, BLOCK_D, IS_CAUSAL, True, DOT_PRECISION, False, BLOCK_M, BLOCK_N,
    )


@dataclass(frozen=True)
class AotTiling:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def aot_tiling(*, float_type: str = "fp16", head_dim: int = 64, interpret: bool = False) -> AotTiling:
    """64×64 with 4 warps for fp16/bf16: kernel.py's H200 sweep has it winning short sequences and D=64 (encoders,
    prefill). fp32 tiles are twice the bytes: the tile shrinks with head_dim so that one pipeline stage fits the
    48 KiB a TensorRT launch gets without an opt-in (64×64 needs 49 KiB at D=64 and 82 KiB at D=128; first seen
    failing on an H200, 2026-11-21)."""
    if interpret:
        return AotTiling(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if float_type == "fp32":
        if head_dim <= 32:
            return AotTiling(block_m=64, block_n=64, num_warps=4, num_stages=2)
        if head_dim <= 64:
            return AotTiling(block_m=64, block_n=32, num_warps=4, num_stages=2)
        return AotTiling(block_m=32, block_n=32, num_warps=4, num_stages=2)
    return AotTiling(block_m=64, block_n=64, num_warps=4, num_stages=3)


def aot_signature(float_type: str, bias_type: str) -> dict[str, str]:
    """Triton types of the runtime parameters, in TensorRT's order. bias_type: "fp32" or q's float_type."""
    assert float_type in FLOAT_TYPES and bias_type in (float_type, "fp32"), f"q {float_type}, bias {bias_type}"
    f = f"*{float_type}"
    return {"Q": f, "K": f, "V": f, "Bias": f"*{bias_type}",
            "seq_q": "i32", "seq_k": "i32", "stride_bb": "i32", "stride_bh": "i32", "stride_bm": "i32",
            "stride_bn": "i32", "Out": f}


def aot_constexprs(*, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int,
                   float_type: str, tiling: AotTiling) -> dict[str, Any]:
    assert num_kv_heads > 0 and num_heads % num_kv_heads == 0, f"{num_heads} heads, {num_kv_heads} kv heads"
    assert math.isfinite(scale), f"scale {scale}"
    return {"QK_SCALE": float(scale) * _LOG2E, "NUM_HEADS": num_heads, "NUM_KV_HEADS": num_kv_heads,
            "HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "IS_CAUSAL": bool(causal),
            "DOT_PRECISION": dot_precision(float_type), "BLOCK_M": tiling.block_m, "BLOCK_N": tiling.block_n}


Dim = TypeVar("Dim")  # an int here, a tensorrt.plugin ShapeExpr in aot_impl


def bias_strides(dims: Sequence[Dim], is_one: Callable[[Dim], bool]) -> list[Any]:
    """Strides of a dense bias broadcast to [B, Hq, S, Sk]: its own dense strides, 0 on axes of size 1.

    ``dims`` is the bias's shape (rank <= 4, left-padded with 1s); ``is_one`` says whether a dim is a build-time 1.
    """
    assert len(dims) <= 4, f"attn_bias rank {len(dims)} > 4"
    strides: list[Any] = []
    running: Any = None  # product of the dims to the right; None is 1 (ShapeExprs cannot be multiplied from the left)
    for d in reversed(dims):
        strides.append(0 if is_one(d) else (1 if running is None else running))
        running = d if running is None else running * d
    strides.reverse()
    return [0] * (4 - len(dims)) + strides


def aot_grid(batch: Dim, seq_q: Dim, *, num_heads: int, tiling: AotTiling,
             cdiv: Callable[[Dim, int], Dim]) -> tuple[Dim, Dim, int]:
    """(cdiv(S, BLOCK_M), B·Hq, 1), as kernel.py's launcher."""
    return cdiv(seq_q, tiling.block_m), batch * num_heads, 1


def aot_extra_args(seq_q: Dim, seq_k: Dim, strides: Sequence[Any]) -> list[Any]:
    return [seq_q, seq_k, *strides]


def launch_like_tensorrt(q, k, v, attn_bias, out, *, attrs: dict[str, Any], float_type: str,
                         tiling: AotTiling) -> None:
    """Launch the entry kernel as TensorRT will (dense torch tensors); for tests."""
    B, _, S, _ = q.shape
    strides = bias_strides(list(attn_bias.shape), lambda d: d == 1)
    grid = aot_grid(B, S, num_heads=attrs["num_heads"], tiling=tiling, cdiv=triton.cdiv)
    flash_attention_aot_kernel[grid](
        q, k, v, attn_bias, *aot_extra_args(S, k.shape[2], strides), out,
        **aot_constexprs(**attrs, float_type=float_type, tiling=tiling),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )


__all__ = ["AotTiling", "aot_tiling", "aot_signature", "aot_constexprs", "bias_strides", "aot_grid",
           "aot_extra_args", "flash_attention_aot_kernel", "launch_like_tensorrt"]
