"""trtopt-domain ops for the torch converter: the Triton kernel on CUDA, the torch reference elsewhere (for
PagedAttention on CPU, plugins/paged_attention/cpu.py, a batched SDPA path, which is checked against the reference).

The kernel modules import triton at module level, so they are imported lazily and only for CUDA tensors; when
they are missing (no triton, or a build without them) the reference runs instead, which is always correct, just
slower. A trtopt op that is not listed here is executed through its ONNX function body (the converter inlines it).

What PagedAttention's kernel keeps between calls (its per-step-shape plans, the split-KV merge counters, its
launcher's switch) is a `PagedLaunchState` (plugins/paged_attention/planning.py) that the torch executor owns
(`paged_launch_state`) and the converter passes to every PagedAttention call of its graph (`state=`); a call
without one gets a state of its own that ends with it. Under torch.compile the call is a torch.library custom op
(torch_library.py), which cannot take a Python object: there the executor sets its state as `CURRENT_PAGED_STATE`
around each forward and the op reads it from there.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
from typing import TYPE_CHECKING, Callable

import torch

from trtopt.plugins.paged_attention.reference import broadcasts_to, rope_tables_fit
from trtopt.runtime.executors.onnx_ops import OpSpec

if TYPE_CHECKING:
    from trtopt.plugins.paged_attention.planning import PagedLaunchState

log = logging.getLogger(__name__)

# The PagedLaunchState of the forward running now, for calls that cannot be handed one (the custom op of
# torch_library.py): the torch executor sets it around each forward of a compiled graph. Made once, never rebound.
CURRENT_PAGED_STATE: contextvars.ContextVar[PagedLaunchState | None] = contextvars.ContextVar(
    "trtopt_paged_state", default=None)


@functools.cache
def _impl_reference(op: str) -> Callable[..., object]:
    return getattr(importlib.import_module(f"trtopt.plugins.{op}.reference"), f"{op}_ref")


@functools.cache
def _impl(op: str, device_type: str) -> Callable[..., object]:
    """The function that runs `op` ("paged_attention", "rms_norm", "silu_mul", ...) for tensors on `device_type`."""
    reference = _impl_reference(op)
    if device_type == "cpu" and op == "paged_attention":
        from trtopt.plugins.paged_attention.cpu import paged_attention_cpu

        return paged_attention_cpu
    if device_type != "cuda":
        return reference
    try:
        return getattr(importlib.import_module(f"trtopt.plugins.{op}.kernel"), f"{op}_triton")
    except (ImportError, AttributeError) as e:
        log.warning("trtopt.%s: Triton kernel unavailable (%s); running the torch reference on CUDA", op, e)
        return reference


def paged_launch_state(device: torch.device) -> PagedLaunchState | None:
    """A new PagedLaunchState for an executor on `device`, or None where PagedAttention does not run its Triton
    kernel there (off CUDA, or the kernel is unavailable: `_impl` runs the reference instead)."""
    if device.type != "cuda" or _impl("paged_attention", "cuda") is _impl_reference("paged_attention"):
        return None
    from trtopt.plugins.paged_attention.planning import PagedLaunchState

    return PagedLaunchState()


def _fp8_scales(kv_cache_dtype: str, k_scale: float, v_scale: float) -> dict[str, float]:
    """The FP8 pool's scales as the implementations take them; nothing for a pool of the model's dtype."""
    return {} if kv_cache_dtype == "auto" else {"k_scale": k_scale, "v_scale": v_scale}


def paged_attention(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes=None,
                    *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int = 1,
                    sliding_window: int = 0, state: PagedLaunchState | None = None, kv_cache_dtype: str = "auto",
                    k_scale: float = 1.0, v_scale: float = 1.0):
    """trtopt::PagedAttention. Writes kv_cache in place and returns it as the second output (the alias). `state`:
    the executor's (paged_launch_state), passed on to the Triton kernel (CUDA); the other paths keep nothing.
    kv_cache_dtype/k_scale/v_scale: an FP8 pool's (plugins/paged_attention/schema.py)."""
    fn = _impl("paged_attention", q.device.type)
    scales = _fp8_scales(kv_cache_dtype, k_scale, v_scale)
    if state is not None and q.is_cuda:
        return fn(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                  num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal,
                  sliding_window=sliding_window, alibi_slopes=alibi_slopes, state=state, **scales)
    return fn(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal,
              sliding_window=sliding_window, alibi_slopes=alibi_slopes, **scales)


def paged_attention_rope(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                         alibi_slopes=None, *, rope_cos, rope_sin, rope_half: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, scale: float, causal: int = 1, sliding_window: int = 0,
                         kv_written: bool = False, state: PagedLaunchState | None = None,
                         kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
    """trtopt::PagedAttention(Rope(q), Rope(k), ...) as the torch executor fuses it (fx_fusions.py): on CUDA one
    kernel rotates q and k and writes the pool (then the attention kernel), two launches fewer than the plan's ops;
    everywhere else, or when the fused kernel's preconditions fail, exactly the two Rope ops and then the op.

    kv_written: the Q/K/V projection already rotated q and k and wrote k and v into the pool (executors/gemv.py
    `projection_rope_kv`, a batch-1 decode step): on CUDA only the attention kernels run; elsewhere the op runs on
    the rotated q and k as given (writing the same k and v again). `state` and the FP8 scales as for paged_attention."""
    scales = _fp8_scales(kv_cache_dtype, k_scale, v_scale)
    fp8 = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if kv_written:
        fn = _impl("paged_attention", q.device.type)
        if q.is_cuda and fn is not _impl_reference("paged_attention"):
            return fn(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal,
                      sliding_window=sliding_window, alibi_slopes=alibi_slopes, kv_written=True, state=state,
                      **scales)
        return paged_attention(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                               causal=causal, sliding_window=sliding_window, state=state, **fp8)
    if q.is_cuda and rope_tables_fit(q, rope_cos, rope_sin, rope_half):
        fn = _impl("paged_attention", "cuda")
        if fn is not _impl_reference("paged_attention"):
            return fn(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal,
                      sliding_window=sliding_window, alibi_slopes=alibi_slopes, rope_cos=rope_cos, rope_sin=rope_sin,
                      state=state, **scales)
    q, k = (rope(x, rope_cos, rope_sin, half=rope_half) for x in (q, k))
    return paged_attention(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes,
                           num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                           causal=causal, sliding_window=sliding_window, state=state, **fp8)


def flash_attention(q, k, v, attn_bias=None, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    causal: int = 0):
    """trtopt::FlashAttention."""
    fn = _impl("flash_attention", q.device.type)
    return fn(q, k, v, attn_bias, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
              causal=causal)


def matmul_add(x, weight, bias):
    """trtopt::MatMulAdd: x @ weight + bias as one addmm."""
    from trtopt.plugins.matmul_add.reference import matmul_add_ref

    return matmul_add_ref(x, weight, bias)


def qmatmul(x, w_q, w_scale, w_zero_point, act_scale, act_zero_point, act_quantized=None, act_static=None, *,
            axis: int, block_size: int = 0, act_mode: int = 0, act_block_size: int = 0, weight_dtype: int = 0):
    """trtopt::QMatMul: on CUDA the Triton GEMV (dequantizing in registers) for one-row steps and a tensor-core GEMM
    for larger ones (plugins/qmatmul/kernel.py `qmatmul_packed`), else the reference (dequantize, matmul in fp32)."""
    fn = _impl("qmatmul", x.device.type)
    return fn(x, w_q, w_scale, w_zero_point, act_scale, act_zero_point, axis=axis, block_size=block_size,
              act_mode=act_mode, act_block_size=act_block_size, weight_dtype=weight_dtype)


def rms_norm(x, scale, *, epsilon: float):
    """trtopt::RMSNorm (below opset 23, where RMSNormalization does not exist): one Triton kernel on CUDA."""
    return _impl("rms_norm", x.device.type)(x, scale, epsilon=epsilon)


def silu_mul(gate, up):
    """trtopt::SiluMul: one Triton kernel on CUDA; elsewhere the unfused ops' arithmetic with one allocation."""
    return _impl("silu_mul", gate.device.type)(gate, up)


def gelu_mul(gate, up, *, tanh: int):
    """trtopt::GeluMul: one Triton kernel on CUDA; elsewhere the unfused ops' arithmetic in one buffer."""
    return _impl("gelu_mul", gate.device.type)(gate, up, tanh=tanh)


def add_rms_norm(x, residual, scale, *, epsilon: float):
    """trtopt::AddRMSNorm → (y, sum): one Triton kernel on CUDA when x and residual have one shape and dtype (the
    residual stream always does); the reference (the unfused Add, then RMSNorm's reference) otherwise."""
    from trtopt.plugins.add_rms_norm.reference import add_rms_norm_ref

    fn = _impl("add_rms_norm", x.device.type)
    if x.shape != residual.shape or x.dtype != residual.dtype:
        fn = add_rms_norm_ref  # a broadcasting add: the kernel reads one row of each
    return fn(x, residual, scale, epsilon=epsilon)


def rope(x, cos, sin, *, half: int = 0):
    """trtopt::Rope: the Triton kernel on CUDA where its preconditions hold (x [B, H, T, D] with D = 2·half, one
    dtype, cos/sin broadcast to x), else the reference: the exported ops' arithmetic, bit for bit."""
    h = half or x.shape[-1] // 2
    if (x.is_cuda and x.dim() == 4 and x.shape[-1] == 2 * h and x.dtype == cos.dtype == sin.dtype
            and broadcasts_to(cos.shape, x.shape) and broadcasts_to(sin.shape, x.shape)):
        return _impl("rope", "cuda")(x, cos, sin)
    from trtopt.plugins.rope.reference import rope_ref

    return rope_ref(x, cos, sin, half=half)


def all_reduce(x, *, world_size: int):
    """trtopt::AllReduce: the sum over the tensor-parallel group (torch.distributed; identity for one rank)."""
    from trtopt.plugins.all_reduce.reference import all_reduce_ref

    return all_reduce_ref(x, world_size=world_size)


def all_gather(x, *, world_size: int, axis: int = -1):
    """trtopt::AllGather: the ranks' x side by side along ``axis`` (torch.distributed; identity for one rank)."""
    from trtopt.plugins.all_gather.reference import all_gather_ref

    return all_gather_ref(x, world_size=world_size, axis=axis)


def paged_attention_reference(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                              alibi_slopes=None, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                              causal: int = 1, sliding_window: int = 0, state: PagedLaunchState | None = None,
                              kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
    """trtopt::PagedAttention through its torch reference on any device (fp32 math on the pool's stored values;
    `state` is not needed): what TorchExecutor(reference_ops=("PagedAttention",)) runs, so a benchmark can tell the
    cost of storing a pool's dtype from the kernel's own arithmetic (benchmarks/fp8_kv.py --attention reference)."""
    return _impl_reference("paged_attention")(
        q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, causal=causal, sliding_window=sliding_window,
        alibi_slopes=alibi_slopes, **_fp8_scales(kv_cache_dtype, k_scale, v_scale))


# Ops with side effects on an input (the KV pool) are never constant-folded nor deduplicated by the converter.
TRTOPT_OPS: dict[str, OpSpec] = {
    "PagedAttention": OpSpec(paged_attention),
    "FlashAttention": OpSpec(flash_attention),
    "MatMulAdd": OpSpec(matmul_add),
    "QMatMul": OpSpec(qmatmul),
    "RMSNorm": OpSpec(rms_norm),
    "AllReduce": OpSpec(all_reduce),
    "AllGather": OpSpec(all_gather),
    "SiluMul": OpSpec(silu_mul),
    "GeluMul": OpSpec(gelu_mul),
    "AddRMSNorm": OpSpec(add_rms_norm),
    "Rope": OpSpec(rope),
}
# The trtopt ops a converter can be asked to run through their torch reference instead (onnx_to_torch reference_ops).
REFERENCE_OPS: dict[str, OpSpec] = {"PagedAttention": OpSpec(paged_attention_reference)}
# AllReduce and AllGather are collectives: folding or deduplicating one would desynchronise the ranks' call sequences.
IMPURE_OPS = frozenset({("trtopt", "PagedAttention"), ("trtopt", "AllReduce"), ("trtopt", "AllGather")})
