"""Rewrite: a calibrated per-channel mean subtracted from the keys (and values) before every PagedAttention (`trtopt
build --kv-cache-smoothing`, docs/architecture.md §3).

    k ─ Sub(·, b_k) ──┐
    v ─ Sub(·, b_v) ──┼─ PagedAttention ─ out ─ Add(·, b_v per query head) ─▶      (v and out with "kv" only)
    q ────────────────┘

b_k and b_v are one layer's [Hkv, D] means of the post-RoPE keys and values (what the pools hold) over calibration
text (builder/kv_calibration.py), stored as [1, Hkv, 1, D] initializers in the model's dtype, one pair per layer.
Exact in real arithmetic whatever b is: every score of a query shifts by the same q·b_k, which the softmax ignores
(SageAttention's key smoothing), and the softmax weights sum to 1, so attending over v - b_v gives the output less
b_v, added back. The pools then hold k - b_k and v - b_v, whose rounding to e4m3 costs less where a channel carries a
large offset that every token shares: e4m3's error is relative, so it grows with the offset, and the offset itself
carries no information about which key matters. Every key that enters the softmax passes through the Sub: the
kernels write the step's keys into the pool and read all keys back from it, the fresh chunk's included.

With --kv-cache-rotation hadamard the rotation runs after this pass, so the pools hold (k - b_k)·H. With
--tensor-parallel it runs on the whole graph too, and the sharding splits every b by heads, as it splits the K/V
projections (builder/sharding/analysis.py). Like the rotation it costs the torch executor's Rope-into-PagedAttention
fusion (runtime/executors/fx_fusions.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import binary_node, initializer
from trtopt.plugins.common import DOMAIN

INITIALIZER_PREFIX = "trtopt_kv_smoothing_"  # + "k_{layer}", "v_{layer}" or "v_out_{layer}"


def smooth_kv(model: ir.Model, k_means: Sequence[np.ndarray], v_means: Sequence[np.ndarray] | None = None) -> int:
    """Before every trtopt.PagedAttention (graph order is layer order), k ← k - k_means[layer]; with ``v_means``
    also v ← v - v_means[layer] and the attention output ← output + v_means[layer] (each query head adding its KV
    head's mean). Means are [Hkv, D] arrays. Returns the number of nodes rewritten; mutates ``model``."""
    graph = model.graph
    nodes = [n for n in graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    assert len(k_means) == len(nodes) and (v_means is None or len(v_means) == len(nodes)), (
        f"{len(nodes)} PagedAttention layers but {len(k_means)} K and {v_means and len(v_means)} V means")
    for layer, node in enumerate(nodes):
        hq, hkv, d = (int(node.attributes[a].value) for a in ("num_heads", "num_kv_heads", "head_dim"))
        k, v, out = node.inputs[1], node.inputs[2], node.outputs[0]
        assert k is not None and v is not None and k.dtype is not None, f"{node.name}: k or v is absent or untyped"
        b_k = np.asarray(k_means[layer], dtype=np.float64)
        assert b_k.shape == (hkv, d), f"{node.name}: a K mean of shape {b_k.shape}, not {(hkv, d)}"
        b = initializer(graph, f"{INITIALIZER_PREFIX}k_{layer}", b_k.reshape(1, hkv, 1, d), k.dtype)
        sub = binary_node("Sub", k, b, f"{node.name}.smooth_k")
        graph.insert_before(node, sub)
        node.replace_input_with(1, sub.outputs[0])
        if v_means is None:
            continue
        # The same rounded constant is subtracted and added back; each query head adds its KV head's mean.
        b_v = np.asarray(v_means[layer], dtype=np.float64).astype(v.dtype.numpy())
        assert b_v.shape == (hkv, d), f"{node.name}: a V mean of shape {b_v.shape}, not {(hkv, d)}"
        b = initializer(graph, f"{INITIALIZER_PREFIX}v_{layer}", b_v.reshape(1, hkv, 1, d), v.dtype)
        sub = binary_node("Sub", v, b, f"{node.name}.smooth_v")
        graph.insert_before(node, sub)
        node.replace_input_with(2, sub.outputs[0])
        per_head = np.repeat(b_v, hq // hkv, axis=0).reshape(1, hq, 1, d)
        assert not out.is_graph_output(), f"{node.name}: the attention output is a graph output"
        uses = list(out.uses())
        add = binary_node("Add", out, initializer(graph, f"{INITIALIZER_PREFIX}v_out_{layer}", per_head, v.dtype),
                      f"{node.name}.unsmooth_out")
        graph.insert_after(node, add)
        for user, index in uses:
            user.replace_input_with(index, add.outputs[0])
    return len(nodes)
