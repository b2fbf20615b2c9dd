"""PagedAttention, face 5 of docs/architecture.md §4: the TensorRT registration (`tensorrt.plugin`, AOT). Importing this
module registers ``trtopt::PagedAttention`` (the executor and trtopt/builder/polygraphy_net.py import it).

Written against the documented API and NOT run here (TensorRT cannot be installed on the project's machines); the
kernel it compiles, its argument order, grid and constexprs are tested in tests/plugins/
test_trt_plugin_paged_attention.py (trt_aot.py holds them, free of tensorrt), and this module's register and
aot_impl run end to end against a stand-in of tensorrt.plugin in tests/plugins/test_trt_plugin_aot_impl.py.
API facts this relies on (NVIDIA/TensorRT python/packaging/bindings_wheel/tensorrt/plugin/{_lib,_validate,
_plugin_class}.py and samples/python/quickly_deployable_plugins/qdp_defs.py):

- The plugin name is the ONNX op_type and the namespace "trtopt": the node carries plugin_namespace="trtopt", and
  the parser passes only the attributes declared here, by name (INT → int32, FLOAT → float32, converted to the
  annotated int/float). So the register function's parameters are the schema's inputs then its attributes, with
  the schema's names, all annotated, none defaulted; alibi_slopes is always an input (a zero initializer when the
  model has no ALiBi). TensorRT validates annotations with issubclass, so this module must not use
  ``from __future__ import annotations``.
- kv_cache_out is ``kv_cache.aliased()``: TensorRT binds it to kv_cache's buffer (the builder enables
  trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03; trtopt.builder.trt_engine.build_engine does).
- aot_impl is called as ``f(*input_descs, *attribute_values, output_descs, tactic)``: every attribute, positionally,
  in register order, then outputs and tactic; it returns (kernel name, PTX, KernelLaunchParams, SymIntExprs).
- No autotune function: TensorRT then offers the one combination of the inputs' own dtypes, LINEAR format.
- kv_cache_dtype, k_scale and v_scale are declared like every attribute, though a node may omit them (schema.py):
  trtopt.builder.trt_engine parses a copy of the model whose trtopt nodes carry every attribute
  (trt_common.`fill_plugin_attributes`). A STRING attribute arrives as text, possibly with a trailing NUL.
- FP8 pools (kv_cache_dtype="fp8"): kv_cache is TensorRT's FP8 (the ONNX float8e4m3fn input); the kernel quantizes
  on write and reads e4m3 with the scales baked in as constexprs (trt_aot.py). PluginTensorDesc's documentation
  excludes only BOOL and UINT8 from plugin I/O types; whether TensorRT binds an FP8 network input to this plugin
  has not been run.
"""

import math
from typing import Tuple, Union

import tensorrt.plugin as trtp

from trtopt.errors import BuildError
from trtopt.plugins.paged_attention.trt_aot import (
    aot_constexprs,
    aot_extra_args,
    aot_grid,
    aot_signature,
    aot_tiling,
    paged_attention_aot_kernel,
)
from trtopt.plugins.trt_common import FLOAT_TYPES, FP8_TYPE, TRITON_TYPES, compile_ptx, require_aot
from trtopt.signature import KV_CACHE_DTYPES

require_aot(trtp)

PLUGIN_ID = "trtopt::PagedAttention"


@trtp.register("trtopt::PagedAttention")
def paged_attention_desc(
    q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, kv_cache: trtp.TensorDesc,
    block_tables: trtp.TensorDesc, seq_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc,
    slot_mapping: trtp.TensorDesc, alibi_slopes: trtp.TensorDesc,
    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int, sliding_window: int,
    kv_cache_dtype: str, k_scale: float, v_scale: float,
) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """out: q's shape and dtype ([1, Hq, T, D]); kv_cache_out: kv_cache itself (written in place)."""
    return q.like(), kv_cache.aliased()


def _constant_dim(desc: trtp.TensorDesc, axis: int, what: str) -> int:
    dim = desc.shape_expr[axis]
    if not dim.is_constant:
        raise BuildError(f"PagedAttention: the pool's {what} (kv_cache dim {axis}) must be fixed in the ONNX "
                         "graph; the AOT kernel bakes it in. Rebuild the plan with a static kv_cache shape.")
    return dim.constant_value()


def _pool_dtype(kv_cache_dtype: str) -> str:
    """The node's kv_cache_dtype as text ("auto" or "fp8"), a STRING attribute's trailing NUL dropped."""
    value = kv_cache_dtype.decode() if isinstance(kv_cache_dtype, bytes) else str(kv_cache_dtype)
    value = value.rstrip("\x00")
    if value not in KV_CACHE_DTYPES:
        raise BuildError(f"PagedAttention: kv_cache_dtype={value!r}; the op takes one of {KV_CACHE_DTYPES} "
                         "(schema.py).")
    return value


def _type(desc: trtp.TensorDesc) -> str:
    """Triton's name of the desc's dtype, or TensorRT's for one no kernel takes (reported, not raised on)."""
    return TRITON_TYPES.get(desc.dtype.name, desc.dtype.name)


def _check_dtypes(q: trtp.TensorDesc, others: dict, *, fp8_pool: bool) -> str:
    float_type = _type(q)
    if float_type not in FLOAT_TYPES:
        raise BuildError(f"PagedAttention: q is {q.dtype}; the kernel runs in fp32/fp16/bf16.")
    want = {"k": float_type, "v": float_type, "kv_cache": FP8_TYPE if fp8_pool else float_type,
            "block_tables": "i32", "seq_lens": "i32", "query_start_loc": "i32", "slot_mapping": "i64",
            "alibi_slopes": "fp32"}
    for name, desc in others.items():
        if _type(desc) != want[name]:
            pool = " (the node's kv_cache_dtype is 'fp8')" if fp8_pool and name == "kv_cache" else ""
            raise BuildError(f"PagedAttention: {name} is {desc.dtype}, the op takes {want[name]}{pool} "
                             "(docs/architecture.md §3); fix the graph that feeds it.")
    return float_type


@trtp.aot_impl("trtopt::PagedAttention")
def paged_attention_aot(
    q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, kv_cache: trtp.TensorDesc,
    block_tables: trtp.TensorDesc, seq_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc,
    slot_mapping: trtp.TensorDesc, alibi_slopes: trtp.TensorDesc,
    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int, sliding_window: int,
    kv_cache_dtype: str, k_scale: float, v_scale: float,
    outputs: Tuple[trtp.TensorDesc], tactic: int,
) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    """Compile trt_aot.paged_attention_aot_kernel for this engine's dtype and attributes, on the build GPU."""
    pool_dtype = _pool_dtype(kv_cache_dtype)
    fp8_pool = pool_dtype == "fp8"
    float_type = _check_dtypes(q, dict(k=k, v=v, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
                                       query_start_loc=query_start_loc, slot_mapping=slot_mapping,
                                       alibi_slopes=alibi_slopes), fp8_pool=fp8_pool)
    if fp8_pool and not all(float(s) > 0 and math.isfinite(float(s)) for s in (k_scale, v_scale)):
        raise BuildError(f"PagedAttention: k_scale={k_scale}, v_scale={v_scale}; an FP8 pool's scales are finite "
                         "and positive (rebuild the plan: `trtopt build --kv-cache-dtype fp8`).")
    tiling = aot_tiling(num_heads, num_kv_heads)
    constexprs = aot_constexprs(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                scale=float(scale), causal=causal, sliding_window=sliding_window,
                                block_size=_constant_dim(kv_cache, 3, "block size"), float_type=float_type,
                                tiling=tiling, kv_cache_dtype=pool_dtype, k_scale=float(k_scale),
                                v_scale=float(v_scale))
    kernel = compile_ptx(paged_attention_aot_kernel, aot_signature(float_type, fp8_pool=fp8_pool), constexprs,
                         num_warps=tiling.num_warps, num_stages=tiling.num_stages)

    # T, S and the table width are dynamic: symbolic expressions that TensorRT resolves at each enqueue.
    num_tokens, num_seqs, max_blocks = q.shape_expr[2], seq_lens.shape_expr[0], block_tables.shape_expr[1]
    grid_x, grid_y, grid_z = aot_grid(num_tokens, num_seqs, num_kv_heads=num_kv_heads, tiling=tiling)
    params = trtp.KernelLaunchParams()
    params.grid_x = grid_x
    params.grid_y = grid_y
    params.grid_z = grid_z
    params.block_x = kernel.block_x
    params.shared_mem = kernel.shared_mem
    extra_args = trtp.SymIntExprs.from_tuple(
        [trtp.SymInt32(e) for e in aot_extra_args(num_tokens, num_seqs, max_blocks)])
    return kernel.name, kernel.ptx, params, extra_args
