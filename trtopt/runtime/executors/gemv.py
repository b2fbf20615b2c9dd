"""Decode-sized projections through Triton GEMVs (`TorchExecutor(decode_gemv=...)`, on by default for
fp16/bf16 plans on CUDA).

`use_decode_gemv` rewrites the converted fx graph:
1. every constant 2-D MatMul weight is stored transposed, [N, K] with K contiguous (nn.Linear's layout, which a
   GEMV streams row by row), in place of the plan's [K, N] buffer, so memory does not grow;
2. its MatMuls run `projection(x, wt)`: runtime/kernels/gemv_triton.py's GEMV when the call has one row
   (`use_gemv`) on CUDA in fp16/bf16, else `F.linear` (cuBLAS on the same weight); MatMulAdd (a bias: Qwen2's
   Q/K/V) runs `F.linear(x, wt, bias)`;
3. the gate/up projection feeding trtopt.SiluMul through a two-way Split runs `projection_silu_mul`: one GEMV with
   SiLU·mul as its epilogue (one launch instead of two, no [M, 2I] intermediate), or the same three ops as before;
4. the fused Q/K/V projection whose Split feeds, through views only, the q, k and v of a PagedAttention with RoPE
   folded in (fx_fusions.fuse_rope_into_paged_attention) runs `projection_rope_kv`: for one row, one GEMV that also
   rotates q and k and writes k and v into the pool (runtime/kernels/gemv_triton.py `gemv_rope_kv`), and the
   attention op is told so (`kv_written`) and launches the attention kernels only; for any other step the
   projection as in 2;
5. a projection whose output reaches a Cast only through views (the LM head, then the float32 logits the paged
   signature returns) runs `projection_cast`: the GEMV stores the cast values itself, one launch fewer (for one
   row; otherwise F.linear, then the cast).

Which path a call takes depends on its shapes, dtype and device only, so a CUDA-graph bucket captures one path.
fp32 plans keep cuBLAS (`GEMV_DTYPES`): they are the fidelity configuration, and the GEMV's accumulation order is
not cuBLAS's. Measured (benchmarks/bench_gemv.py, gpu_e2e's `without_decode_gemv` row): docs/benchmarks/GPU_E2E.md.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx
import torch.nn.functional as F

from trtopt.runtime.executors import onnx_ops, trtopt_ops
from trtopt.runtime.executors.fx_fusions import VIEWS, recompiled, replace_node

GEMV_DTYPES = (torch.float16, torch.bfloat16)
# Where the GEMV runs, from benchmarks/bench_gemv.py on the H200 (docs/benchmarks/gemv_h200.json): at one row it beat
# cuBLAS on every projection of the 1.24B plan and of SmolLM2-135M (O 5.90 -> 4.32 µs, down with cuBLAS's split-K
# reduce 12.81 -> 11.21, gate/up + SiLU·mul 20.75 -> 18.74, LM head 124.1 -> 119.4) except SmolLM2's LM head
# (49152 rows of K = 576: 27.0 against 16.0 µs, tens of thousands of programs of 2 KB each); at 2 rows it was mixed
# (the down projection 15.6 against 12.8 µs), at 4 slower on every 1.24B shape.
GEMV_ROWS = 1
WIDE_N, SHORT_K = 16384, 1024  # more rows than WIDE_N of fewer than SHORT_K elements: cuBLAS


def use_gemv(rows: int, n: int, k: int) -> bool:
    """Whether a projection of `rows` rows against an [n, k] weight runs the GEMV (where measured faster)."""
    return rows == GEMV_ROWS and not (n > WIDE_N and k < SHORT_K)


@functools.cache
def _kernels():
    try:
        from trtopt.runtime.kernels import gemv_triton
    except ImportError:  # no Triton: F.linear is always correct
        return None
    assert gemv_triton.MAX_ROWS >= GEMV_ROWS
    return gemv_triton


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def _rows(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor | None:
    """x as [1, K] when the GEMV takes it (CUDA, fp16/bf16 like the weight, `use_gemv`, K contiguous), else None."""
    if not (_on_gpu(x) and x.dtype == wt.dtype and x.dtype in GEMV_DTYPES and x.shape[-1] == wt.shape[1]):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if not use_gemv(rows.shape[0], wt.shape[0], wt.shape[1]) or rows.stride(-1) != 1 or _kernels() is None:
        return None
    return rows


def projection(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x @ wtᵀ for a weight stored [N, K]: the GEMV for one row on CUDA, else F.linear."""
    rows = _rows(x, wt)
    if rows is None:
        return F.linear(x, wt)
    return _kernels().gemv(rows, wt).reshape(*x.shape[:-1], wt.shape[0])


def projection_silu_mul(x: torch.Tensor, wt: torch.Tensor, *, sizes: list[int], axis: int) -> torch.Tensor:
    """silu_mul(*split(x @ wtᵀ, sizes, axis)): one GEMV with the SiLU·mul epilogue for one row on CUDA when the
    Split is gate and up as two halves of the last axis; otherwise exactly those three ops."""
    last = axis in (-1, x.dim() - 1)
    rows = _rows(x, wt) if last and sizes[0] == sizes[1] and 2 * sizes[0] == wt.shape[0] else None
    if rows is None:
        gate, up = onnx_ops.split(F.linear(x, wt), sizes, axis=axis, _n=2)
        return trtopt_ops.silu_mul(gate, up)
    return _kernels().gemv_silu_mul(rows, wt).reshape(*x.shape[:-1], sizes[0])


def projection_cast(x: torch.Tensor, wt: torch.Tensor, *, to: torch.dtype) -> torch.Tensor:
    """(x @ wtᵀ).to(to): one GEMV that rounds to x's dtype and stores `to` for one row on CUDA, else F.linear and the
    cast (what the graph did)."""
    rows = _rows(x, wt)
    if rows is None or to not in _kernels().TL_DTYPES:  # the float dtypes the GEMV can store
        return F.linear(x, wt).to(to)
    return _kernels().gemv(rows, wt, out_dtype=to).reshape(*x.shape[:-1], wt.shape[0])


def projection_rope_kv(x: torch.Tensor, wt: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                       head_dim: int, rope_half: int, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> tuple[torch.Tensor, bool]:
    """(x @ wtᵀ, written) for the fused Q/K/V weight of an attention with RoPE folded in. written: one GEMV made the
    product with q and k rotated and wrote k and v into kv_cache at slot_mapping (one row on CUDA, the whole head
    rotated, and nothing gemv_triton.rope_kv_refusal refuses); else the plain `projection`, and the attention op
    rotates and writes as before. k_scale/v_scale: an FP8 pool's (the attention node's), ignored by other pools."""
    rows = _rows(x, wt)
    if rows is None or rope_half not in (0, head_dim // 2) or _kernels().rope_kv_refusal(
            rows.shape, wt.shape, x.dtype, cos.shape, cos.dtype, sin.shape, sin.dtype, kv_cache.shape,
            kv_cache.dtype, slot_mapping.shape, slot_mapping.dtype, num_heads, num_kv_heads, head_dim) is not None:
        return projection(x, wt), False
    y = _kernels().gemv_rope_kv(rows, wt, cos, sin, kv_cache, slot_mapping, num_heads=num_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, k_scale=k_scale, v_scale=v_scale)
    return y.reshape(*x.shape[:-1], wt.shape[0]), True


def _transpose_weights(gm: torch.fx.GraphModule) -> int:
    """Store every constant 2-D MatMul/MatMulAdd weight [N, K] (in place of the [K, N] buffer) and point its readers
    at `projection` / F.linear; a weight is moved only when every reader takes it as the right operand."""
    readers = {torch.matmul: 1, trtopt_ops.matmul_add: 1}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        weight = getattr(gm, node.target, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            continue
        users = list(node.users)
        if not users or not all(u.op == "call_function" and u.target in readers and len(u.args) >= 2
                                and u.args[1] is node and u.args[0] is not node for u in users):
            continue
        setattr(gm, node.target, weight.t().contiguous())
        del weight
        for user in users:
            if user.target is trtopt_ops.matmul_add:
                replace_node(gm, user, F.linear, (user.args[0], node, user.args[2]))
            else:
                replace_node(gm, user, projection, (user.args[0], node))
        count += 1
    return count


def _split_sizes(gm: torch.fx.GraphModule, split: torch.fx.Node, parts: int = 2) -> list[int] | None:
    """A Split node's `parts` output sizes when they are constants (a list, or a constant tensor), else None."""
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split")
    if isinstance(sizes, torch.fx.Node) and sizes.op == "get_attr":
        const = getattr(gm, sizes.target, None)
        sizes = onnx_ops.as_ints(const) if isinstance(const, torch.Tensor) and const.dim() == 1 else None
    if isinstance(sizes, (list, tuple)) and len(sizes) == parts and all(isinstance(s, int) for s in sizes):
        return list(sizes)
    return None


def _fuse_silu_mul(gm: torch.fx.GraphModule) -> int:
    """projection → Split (two outputs) → trtopt.SiluMul(gate, up) → projection_silu_mul."""
    fused = 0
    for silu in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is trtopt_ops.silu_mul]:
        gate, up = silu.args[:2]
        if not all(isinstance(g, torch.fx.Node) and g.target is operator.getitem and len(g.users) == 1
                   for g in (gate, up)):
            continue
        split = gate.args[0]
        if not (up.args[0] is split and (gate.args[1], up.args[1]) == (0, 1) and split.target is onnx_ops.split
                and len(split.users) == 2):
            continue
        proj = split.args[0]
        if not (isinstance(proj, torch.fx.Node) and proj.target is projection and len(proj.users) == 1):
            continue
        sizes = _split_sizes(gm, split)
        if sizes is None:
            continue
        with gm.graph.inserting_before(silu):
            node = gm.graph.call_function(projection_silu_mul, (proj.args[0], proj.args[1]),
                                          {"sizes": list(sizes), "axis": split.kwargs.get("axis", 0)})
        silu.replace_all_uses_with(node)
        for dead in (silu, gate, up, split, proj):
            gm.graph.erase_node(dead)
        fused += 1
    return fused


# Ops between the Q/K/V Split and the attention op that only relabel values (shape, order of dims): the attention's
# q, k and v are then views of the projection's output. That they are head-major views of one row (what the fused
# KV write assumes) is checked by the attention op on its first call (paged_attention_triton, kv_written).
_RELABELS = (*VIEWS, onnx_ops.transpose)


def _source_through(node, ops: tuple):
    """The node whose values `node` carries through a chain of `ops` calls, each read by nothing else."""
    while (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in ops
           and len(node.users) == 1):
        node = node.args[0]
    return node


def _split_output(node) -> torch.fx.Node | None:
    """The `getitem(split, i)` node that `node` relabels (through `_RELABELS`, each read by nothing else), or None."""
    node = _source_through(node, _RELABELS)
    if isinstance(node, torch.fx.Node) and node.target is operator.getitem and len(node.users) == 1:
        return node
    return None


def _fuse_rope_kv(gm: torch.fx.GraphModule) -> int:
    """projection → Split(q, k, v) → views → paged_attention_rope ⇒ projection_rope_kv, whose `written` output the
    attention op reads as kv_written. Matched only when the Split's sizes are the attention's Hq·D, Hkv·D, Hkv·D
    along the last axis, each output reaches only its attention input, and the pool, slot mapping and cos/sin the
    attention reads are computed before the projection (the fused call takes its place)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    fused = 0
    for attn in [n for n in gm.graph.nodes
                 if n.op == "call_function" and n.target is trtopt_ops.paged_attention_rope and len(n.args) >= 8]:
        outs = [_split_output(a) for a in attn.args[:3]]
        if any(o is None for o in outs) or [o.args[1] for o in outs] != [0, 1, 2]:
            continue
        split = outs[0].args[0]
        if not (all(o.args[0] is split for o in outs) and split.target is onnx_ops.split and len(split.users) == 3
                and split.kwargs.get("axis", 0) == -1):
            continue
        proj = split.args[0]
        if not (isinstance(proj, torch.fx.Node) and proj.target is projection and len(proj.users) == 1):
            continue
        kw = attn.kwargs
        hq, hkv, d = kw["num_heads"], kw["num_kv_heads"], kw["head_dim"]
        if _split_sizes(gm, split, 3) != [hq * d, hkv * d, hkv * d]:
            continue
        inputs = (kw["rope_cos"], kw["rope_sin"], attn.args[3], attn.args[7])
        if not all(isinstance(a, torch.fx.Node) and order[a] < order[proj] for a in inputs):
            continue
        with gm.graph.inserting_before(proj):
            call = gm.graph.call_function(projection_rope_kv, (*proj.args[:2], *inputs),
                                          dict(num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                               rope_half=kw.get("rope_half", 0), k_scale=kw.get("k_scale", 1.0),
                                               v_scale=kw.get("v_scale", 1.0)))
            y = gm.graph.call_function(operator.getitem, (call, 0))
            written = gm.graph.call_function(operator.getitem, (call, 1))
        proj.replace_all_uses_with(y)
        gm.graph.erase_node(proj)
        attn.kwargs = dict(kw, kv_written=written)
        fused += 1
    return fused


def _fuse_cast(gm: torch.fx.GraphModule) -> int:
    """projection → views (each read once) → Cast ⇒ projection_cast → the same views (the Cast is dropped)."""
    fused = 0
    for cast in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is onnx_ops.cast]:
        to = cast.kwargs.get("to")
        if not isinstance(to, torch.dtype) or len(cast.args) != 1:
            continue
        node = _source_through(cast.args[0], VIEWS)
        if not (isinstance(node, torch.fx.Node) and node.target is projection and len(node.users) == 1):
            continue
        node.target = projection_cast
        node.kwargs = dict(node.kwargs, to=to)
        cast.replace_all_uses_with(cast.args[0])
        gm.graph.erase_node(cast)
        fused += 1
    return fused


def use_decode_gemv(gm: torch.fx.GraphModule, rope_kv: bool = True) -> tuple[int, int, int]:
    """Apply the rewrite above (step 4 only with rope_kv); returns (weights stored [N, K], gate/up + SiLU·mul pairs
    fused, Q/K/V projections with RoPE and the KV write fused)."""
    moved = _transpose_weights(gm)
    fused = _fuse_silu_mul(gm)
    rope_kv = _fuse_rope_kv(gm) if rope_kv else 0
    casts = _fuse_cast(gm)
    recompiled(gm, moved + fused + rope_kv + casts)
    return moved, fused, rope_kv
