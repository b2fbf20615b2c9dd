"""Rewrite: q and k rotated by one orthonormal Hadamard matrix before every PagedAttention (`trtopt build
--kv-cache-rotation hadamard`, docs/architecture.md §3).

    q ─ MatMul(·, H) ─┐
    k ─ MatMul(·, H) ─┼─ PagedAttention      H: [D, D] Sylvester Hadamard / sqrt(D), one initializer per D
    v ────────────────┘

Exact in real arithmetic: H Hᵀ = I, so (qH)(kH)ᵀ = q kᵀ and the attention output is unchanged; the pools then hold
kH, whose values FP8 rounds differently: rotating spreads a key's few large channels over all D. V is left alone
(nearly all of FP8's loss on SmolLM2 is K's) unless asked (`hadamard_kv`: v·H stored, the output multiplied by H
after attention, P·(vH)·H = P·v; with K and V smoothing it took Gemma-3-270m's fake-quantized FP8 KV from +0.89%
to +0.54%, docs/benchmarks/fp8_kv_schemes_gemma3_cpu.json). Whether it helps is a property of the model (it did on SmolLM2, not on
Gemma-3-270m), so it is an option, measured per model (benchmarks/fp8_kv.py, cell fp8_hadamard).

q and k are [1, H, T, D] after RoPE and MatMul broadcasts H over heads and tokens, so the rewrite acts within a head:
a tensor-parallel rank graph takes the same H. The graph stays standard ONNX (no kernel changes), at the cost of the
torch executor's Rope-into-PagedAttention fusion, which no longer matches (runtime/executors/fx_fusions.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtopt.plugins.common import DOMAIN

INITIALIZER_PREFIX = "trtopt_kv_rotation_hadamard_"  # + head_dim; shared by every layer of that head_dim


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard(d: int) -> np.ndarray:
    """The [d, d] Sylvester Hadamard matrix divided by sqrt(d) (orthonormal and symmetric), float64; d a power of
    two."""
    assert is_power_of_two(d), f"Sylvester's Hadamard matrix needs a power-of-two size, got {d}"
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def _rotation(graph: ir.Graph, d: int, dtype: ir.DataType, cache: dict) -> tuple[ir.Value, float]:
    """The shared H initializer for head_dim ``d`` in ``dtype``, and the factor by which it multiplies q kᵀ.

    Every entry is ±1/sqrt(d), rounded alike, so the stored matrix is exactly alpha·H with alpha = round(1/sqrt(d)) ·
    sqrt(d) (1 where 1/sqrt(d) is a power of two; 1 - 1.1e-4 for fp16/bf16 at d = 32 or 128): it multiplies every
    score by alpha², which the caller divides out of the node's ``scale``."""
    key = (d, dtype)
    if key not in cache:
        array = hadamard(d).astype(dtype.numpy())
        alpha = float(np.abs(array.astype(np.float64)[0, 0])) * np.sqrt(d)
        name = INITIALIZER_PREFIX + str(d) + ("" if dtype == ir.DataType.FLOAT else f"_{dtype.name.lower()}")
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.shape, value.type = ir.Shape([d, d]), ir.TensorType(dtype)
        graph.register_initializer(value)
        cache[key] = (value, alpha * alpha)
    return cache[key]


def _rotated(graph: ir.Graph, node: ir.Node, index: int, h: ir.Value, what: str) -> None:
    """Input ``index`` of ``node`` replaced by MatMul(input, h), inserted just before ``node``."""
    x = node.inputs[index]
    assert x is not None, f"{node.name}: input {index} ({what}) is absent"
    matmul = ir.node("MatMul", [x, h], name=f"{node.name}.rotate_{what}")
    matmul.outputs[0].name = f"{x.name}.rotated"
    matmul.outputs[0].shape, matmul.outputs[0].type = x.shape, x.type
    graph.insert_before(node, matmul)
    node.replace_input_with(index, matmul.outputs[0])


def _rotated_back(graph: ir.Graph, node: ir.Node, h: ir.Value, factor: float) -> None:
    """The attention output o of ``node`` (computed on v·H) replaced, for every reader, by o·H (H symmetric: H·H =
    I), divided by ``factor`` when the stored H is alpha·H with alpha² = factor != 1."""
    out = node.outputs[0]
    readers = list(out.uses())  # before the MatMul below becomes one
    matmul = ir.node("MatMul", [out, h], name=f"{node.name}.rotate_back_v")
    result = matmul.outputs[0]
    result.name, result.shape, result.type = f"{out.name}.rotated_back", out.shape, out.type
    nodes = [matmul]
    if factor != 1.0:
        inv = ir.Value(name=f"{h.name}_inv_alpha2", const_value=ir.tensor(
            np.asarray(1.0 / factor, dtype=out.dtype.numpy()), name=f"{h.name}_inv_alpha2"))
        inv.shape, inv.type = ir.Shape([]), ir.TensorType(out.dtype)
        if inv.name not in graph.initializers:
            graph.register_initializer(inv)
        inv = graph.initializers[inv.name]
        mul = ir.node("Mul", [result, inv], name=f"{node.name}.rotate_back_v_scale")
        mul.outputs[0].name, mul.outputs[0].shape, mul.outputs[0].type = f"{out.name}.unrotated", out.shape, out.type
        nodes.append(mul)
    final = nodes[-1].outputs[0]
    for reader, index in readers:
        reader.replace_input_with(index, final)
    if out.is_graph_output():
        graph.outputs[graph.outputs.index(out)] = final
    graph.insert_after(node, nodes)


def rotate_qk(model: ir.Model, *, values: bool = False) -> int:
    """Put MatMul(q, H) and MatMul(k, H) before every trtopt.PagedAttention (H = hadamard(head_dim) in q's dtype,
    one initializer per head_dim shared by every layer); with ``values`` (`--kv-cache-rotation hadamard_kv`) also
    MatMul(v, H) before it and MatMul(o, H) after it (the pools hold v·H; the output P·v·H times H is P·v). Returns
    the number of nodes rotated. Mutates ``model``.

    Works on any paged graph, whatever its pool dtype (the build allows it with FP8 pools only, where it pays). Every
    node's head_dim must be a power of two: the caller checks it (assert here)."""
    graph = model.graph
    nodes = [n for n in graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    cache: dict = {}
    for node in nodes:
        d = int(node.attributes["head_dim"].value)
        q = node.inputs[0]
        assert q is not None and q.dtype is not None, f"{node.name}: q has no known dtype"
        h, score_factor = _rotation(graph, d, q.dtype, cache)
        _rotated(graph, node, 0, h, "q")
        _rotated(graph, node, 1, h, "k")
        if score_factor != 1.0:
            node.attributes["scale"] = ir.AttrFloat32("scale", float(node.attributes["scale"].value) / score_factor)
        if values:
            _rotated(graph, node, 2, h, "v")
            _rotated_back(graph, node, h, score_factor)
    return len(nodes)


def head_dims(model: ir.Model) -> list[int]:
    """The head_dim of every trtopt.PagedAttention node, in graph order."""
    return [int(n.attributes["head_dim"].value) for n in model.graph
            if n.domain == DOMAIN and n.op_type == "PagedAttention"]
