"""FlashAttention, face 5 of docs/architecture.md §4: the TensorRT registration (`tensorrt.plugin`, AOT). Importing this
module registers ``trtopt::FlashAttention``.

Written against the documented API and NOT run here (TensorRT cannot be installed on the project's machines); the
entry kernel, argument order, bias strides, grid and constexprs are tested in tests/plugins/
test_trt_plugin_flash_attention.py (trt_aot.py holds them, free of tensorrt), and register + aot_impl run against
a stand-in of tensorrt.plugin in tests/plugins/test_trt_plugin_aot_impl.py. The API facts it relies on are listed
in trtopt/plugins/paged_attention/trt_plugin.py; in short: parameters are the schema's inputs (attn_bias is always
present: a zero [1, 1, 1, 1] initializer when the graph has none) then its attributes, real annotation types (no
``from __future__ import annotations``), aot_impl takes every attribute positionally then (outputs, tactic).
"""

from typing import Tuple, Union

import tensorrt.plugin as trtp

from trtopt.errors import BuildError
from trtopt.plugins.flash_attention.trt_aot import (
    aot_constexprs,
    aot_extra_args,
    aot_grid,
    aot_signature,
    aot_tiling,
    bias_strides,
    flash_attention_aot_kernel,
)
from trtopt.plugins.trt_common import FLOAT_TYPES, compile_ptx, require_aot, triton_type

require_aot(trtp)

PLUGIN_ID = "trtopt::FlashAttention"


@trtp.register("trtopt::FlashAttention")
def flash_attention_desc(
    q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, attn_bias: trtp.TensorDesc,
    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int,
) -> trtp.TensorDesc:
    """out: q's shape and dtype ([B, Hq, S, D])."""
    return q.like()


def _is_constant_one(dim: trtp.ShapeExpr) -> bool:
    return dim.is_constant and dim.constant_value() == 1


@trtp.aot_impl("trtopt::FlashAttention")
def flash_attention_aot(
    q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, attn_bias: trtp.TensorDesc,
    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int,
    outputs: Tuple[trtp.TensorDesc], tactic: int,
) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    """Compile trt_aot.flash_attention_aot_kernel for this engine's dtypes and attributes, on the build GPU."""
    float_type = triton_type(q.dtype.name)
    bias_type = triton_type(attn_bias.dtype.name)
    if float_type not in FLOAT_TYPES or {triton_type(k.dtype.name), triton_type(v.dtype.name)} != {float_type}:
        raise BuildError(f"FlashAttention: q/k/v must share one of fp32/fp16/bf16; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}.")
    if bias_type not in (float_type, "fp32"):
        raise BuildError(f"FlashAttention: attn_bias is {attn_bias.dtype}; it must be float32 or q's dtype.")
    if attn_bias.ndim > 4:
        raise BuildError(f"FlashAttention: attn_bias has rank {attn_bias.ndim}; it must broadcast to [B, Hq, S, Sk].")
    tiling = aot_tiling(float_type=float_type, head_dim=head_dim)
    kernel = compile_ptx(flash_attention_aot_kernel, aot_signature(float_type, bias_type),
                         aot_constexprs(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        scale=float(scale), causal=causal, float_type=float_type, tiling=tiling),
                         num_warps=tiling.num_warps, num_stages=tiling.num_stages)

    batch, seq_q, seq_k = q.shape_expr[0], q.shape_expr[2], k.shape_expr[2]
    strides = bias_strides([attn_bias.shape_expr[i] for i in range(attn_bias.ndim)], _is_constant_one)
    grid_x, grid_y, grid_z = aot_grid(batch, seq_q, num_heads=num_heads, tiling=tiling, cdiv=trtp.cdiv)
    params = trtp.KernelLaunchParams()
    params.grid_x = grid_x
    params.grid_y = grid_y
    params.grid_z = grid_z
    params.block_x = kernel.block_x
    params.shared_mem = kernel.shared_mem
    extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in aot_extra_args(seq_q, seq_k, strides)])
    return kernel.name, kernel.ptx, params, extra_args
