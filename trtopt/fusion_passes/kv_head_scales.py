"""Rewrite: per-KV-head powers of two around every PagedAttention, so each head of an FP8 pool spans the layer's range
(`trtopt build --kv-cache-scales amax_head`, docs/architecture.md §3).

    q ─ Mul(·, 1/c_k per query head) ─┐
    k ─ Mul(·, c_k) ──────────────────┼─ PagedAttention ─ out ─ Mul(·, 1/c_v per query head) ─▶
    v ─ Mul(·, c_v) ──────────────────┘

c_k and c_v are one layer's [Hkv] factors, each a power of two (builder/kv_calibration.py KvStats.head_factors):
2^floor(log2(layer amax / head amax)) over calibration text, so every head's largest calibrated value lands within a
factor of two of the layer's, never above it, and the layer's one K and V scale (amax / 448) serves every head as a
per-head scale would. Exact in floating point, not only in real arithmetic: scaling by a power of two only moves
exponents (the model's dtypes have range to spare), so each score of a query head is (q / c)·(k c) = q·k and its
output P·(v c) / c = P·v bit for bit before FP8 rounds the pools. The pools then hold k·c_k and v·c_v, which e4m3
rounds with fewer subnormals in the heads whose values are small. It runs last, on the final graph (after
--kv-cache-smoothing and --kv-cache-rotation, which act within a head and commute with it). Like those it costs the
torch executor's Rope-into-PagedAttention fusion (runtime/executors/fx_fusions.py); it is refused with
--tensor-parallel, as the amax calibration is.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import binary_node, initializer
from trtopt.plugins.common import DOMAIN

INITIALIZER_PREFIX = "trtopt_kv_head_scale_"  # + "q_{layer}", "k_{layer}", "v_{layer}" or "out_{layer}"


def _power_of_two(factors: np.ndarray, n: int) -> np.ndarray:
    factors = np.asarray(factors, dtype=np.float64)
    assert factors.shape == (n,) and (factors > 0).all(), f"factors {factors} are not {n} positive numbers"
    assert (np.exp2(np.round(np.log2(factors))) == factors).all(), f"factors {factors} are not powers of two"
    return factors


def scale_kv_heads(model: ir.Model, k_factors: Sequence[np.ndarray], v_factors: Sequence[np.ndarray]) -> int:
    """Around every trtopt.PagedAttention (graph order is layer order): k ← k·c_k and v ← v·c_v per KV head, q ← q / c_k
    and the output ← output / c_v per query head (its KV head's factor), with c_k = k_factors[layer] and c_v =
    v_factors[layer], [Hkv] powers of two each. A layer whose factors are all 1 is left alone. Returns the number of
    layers rewritten; mutates ``model``."""
    graph = model.graph
    nodes = [n for n in graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    assert len(k_factors) == len(v_factors) == len(nodes), (
        f"{len(nodes)} PagedAttention layers but {len(k_factors)} K and {len(v_factors)} V head factors")
    rewritten = 0
    for layer, node in enumerate(nodes):
        hq, hkv = (int(node.attributes[a].value) for a in ("num_heads", "num_kv_heads"))
        c_k, c_v = _power_of_two(k_factors[layer], hkv), _power_of_two(v_factors[layer], hkv)
        if (c_k == 1).all() and (c_v == 1).all():
            continue
        rewritten += 1
        q, k, v, out = node.inputs[0], node.inputs[1], node.inputs[2], node.outputs[0]
        assert q is not None and k is not None and v is not None and q.dtype is not None, (
            f"{node.name}: q, k or v is absent or untyped")
        group = hq // hkv

        def mul_input(index: int, x: ir.Value, factors: np.ndarray, what: str) -> None:
            c = initializer(graph, f"{INITIALIZER_PREFIX}{what}_{layer}", factors.reshape(1, -1, 1, 1), x.dtype)
            mul = binary_node("Mul", x, c, f"{node.name}.head_scale_{what}")
            graph.insert_before(node, mul)
            node.replace_input_with(index, mul.outputs[0])

        if not (c_k == 1).all():
            mul_input(0, q, 1 / np.repeat(c_k, group), "q")
            mul_input(1, k, c_k, "k")
        if (c_v == 1).all():
            continue
        mul_input(2, v, c_v, "v")
        assert not out.is_graph_output(), f"{node.name}: the attention output is a graph output"
        uses = list(out.uses())
        c = initializer(graph, f"{INITIALIZER_PREFIX}out_{layer}", (1 / np.repeat(c_v, group)).reshape(1, hq, 1, 1),
                      v.dtype)
        mul = binary_node("Mul", out, c, f"{node.name}.head_unscale_out")
        graph.insert_after(node, mul)
        for user, index in uses:
            user.replace_input_with(index, mul.outputs[0])
    return rewritten
