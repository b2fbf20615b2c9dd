"""The K/V calibration of `trtopt build --kv-cache-smoothing` and `--kv-cache-scales amax` (builder/kv_calibration.py
has the data and the windows): run the paged graph, pools still in the model's dtype, over the calibration windows and
average, and take the largest magnitude of, what every PagedAttention is handed to store. It sits in the runtime
because it executes the graph through the torch converter and the input builder; `trtopt build` hands it to build_plan
as ``kv_calibrator`` (docs/architecture.md §3)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import onnx_ir as ir

from trtopt.builder.kv_calibration import KvStats
from trtopt.plugins.common import DOMAIN


def kv_stats(model: ir.Model, windows: np.ndarray, *, block_size: int, device: str | None = None,
             on_window: Callable[[], None] = lambda: None,
             scale_candidates: tuple[list[np.ndarray], list[np.ndarray]] | None = None) -> KvStats:
    """The mean key and value, and their amax per KV head, of every PagedAttention of the paged ``model`` over
    ``windows`` [n, L]; ``on_window`` is called after each window (a progress bar). ``model`` is left as it was.

    ``scale_candidates`` (every layer's candidate K scales and V scales, [C] each): also the squared error, summed
    over the windows, of each layer's attention output when its keys (values) are rounded to e4m3 with each
    candidate scale and the values (keys) are left exact, against the exact output (`--kv-cache-scales search`)."""
    import torch

    from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq
    from trtopt.runtime.executors.onnx_to_torch import onnx_to_torch
    from trtopt.runtime.executors.onnx_ops import ONNX_TO_TORCH_DTYPE
    from trtopt.runtime.executors.signature import step_tensors
    from trtopt.runtime.input_builder import InputBuilder
    from trtopt.signature import is_kv_input, kv_dims

    start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    graph = model.graph
    nodes = [n for n in graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    assert nodes, "kv_stats needs a paged graph"
    watched = [value for node in nodes for value in (node.inputs[1], node.inputs[2])]
    if scale_candidates is not None:
        assert len(scale_candidates[0]) == len(scale_candidates[1]) == len(nodes), "one K and V set per layer"
        watched += [node.inputs[0] for node in nodes]  # q, after the k and v of every layer
    assert all(v is not None and v.name and not v.is_graph_output() for v in watched), (
        "every k and v must be a named value that is not a graph output")
    graph.outputs.extend(watched)
    try:
        converted = onnx_to_torch(model, device=device)
    finally:
        for _ in watched:
            graph.outputs.pop()
    positions = [converted.output_names.index(v.name) for v in watched]
    length = windows.shape[1]
    num_blocks = -(-length // block_size)
    pools = {}
    for value in graph.inputs:
        if is_kv_input(value.name):
            heads, head_dim = int(value.shape[2]), int(value.shape[4])
            pools[value.name] = torch.zeros(kv_dims(num_blocks + 1, heads, block_size, head_dim),
                                            dtype=ONNX_TO_TORCH_DTYPE[value.dtype.value], device=device)
    sums: list = [0.0] * 2 * len(nodes)
    amaxes: list = [0.0] * 2 * len(nodes)
    errors = [[np.zeros(len(c)) for c in candidates] for candidates in scale_candidates or ()]  # [K|V][layer][C]
    builder = InputBuilder(block_size, num_blocks)
    with torch.inference_mode():
        for window in windows:
            seq = ScheduledSeq("calibration", [int(t) for t in window], 0, list(range(1, num_blocks + 1)), True)
            feeds = {name: t.to(device) for name, t in step_tensors(builder.build(
                ScheduledBatch([seq], length, []))).items()}
            outputs = converted.module(*[feeds[n] if n in feeds else pools[n] for n in converted.input_names])
            for i, p in enumerate(positions[:2 * len(nodes)]):
                kv = outputs[p][0].double()  # k or v [1, Hkv, T, D]
                sums[i] = sums[i] + kv.sum(dim=1).cpu()  # [Hkv, D]
                amaxes[i] = torch.maximum(torch.as_tensor(amaxes[i]), kv.abs().amax(dim=(1, 2)).cpu())  # [Hkv]
            if scale_candidates is not None:
                for layer, node in enumerate(nodes):
                    q, k, v = (outputs[positions[j]] for j in (2 * len(nodes) + layer, 2 * layer, 2 * layer + 1))
                    for kv_index, (cands, errs) in enumerate(zip((c[layer] for c in scale_candidates),
                                                                 (e[layer] for e in errors))):
                        errs += _rounding_errors(node, q, k, v, kv_index, cands, block_size)
            on_window()
    del converted, pools
    tokens = windows.size
    means = [(s / tokens).numpy() for s in sums]
    amax = [a.numpy() for a in amaxes]
    return KvStats(k=means[0::2], v=means[1::2], k_amax=amax[0::2], v_amax=amax[1::2], tokens=tokens,
                   windows=len(windows), device=device, seconds=time.perf_counter() - start,
                   k_errors=errors[0] if errors else [], v_errors=errors[1] if errors else [])


def _rounding_errors(node: ir.Node, q, k, v, kv_index: int, candidates: np.ndarray, block_size: int) -> np.ndarray:
    """[C]: the squared error of one window's attention output (the op's torch reference, fp32) when k (kv_index 0)
    or v (1) is stored in e4m3 with each candidate scale and read back, against the exact output."""
    import torch

    from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE, from_pool, paged_attention_ref, to_pool

    attrs = {name: node.attributes[name].value for name in ("num_heads", "num_kv_heads", "head_dim", "scale")}
    attrs.update({name: node.attributes[name].value for name in ("causal", "sliding_window") if name in node.attributes})
    alibi = node.inputs[8] if len(node.inputs) > 8 else None
    assert alibi is None or alibi.const_value is not None, f"{node.name}: ALiBi slopes that are not a constant"
    q, k, v = q.float(), k.float(), v.float()
    slopes = None if alibi is None else torch.from_numpy(alibi.const_value.numpy()).float().to(q.device)
    length = q.shape[2]
    num_blocks = -(-length // block_size)
    tables = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
    lens, starts = torch.tensor([length], dtype=torch.int32), torch.tensor([0, length], dtype=torch.int32)
    slots = torch.arange(block_size, block_size + length, dtype=torch.int64)

    def attend(k, v):
        pool = torch.zeros(num_blocks + 1, 2, k.shape[1], block_size, k.shape[3], device=q.device)
        return paged_attention_ref(q, k, v, pool, tables.to(q.device), lens.to(q.device), starts.to(q.device),
                                   slots.to(q.device), alibi_slopes=slopes, **attrs)[0].double()

    exact = attend(k, v)
    errors = np.zeros(len(candidates))
    for c, s in enumerate(candidates):
        x = (k, v)[kv_index]
        rounded = from_pool(to_pool(x, FP8_POOL_DTYPE, float(s)), float(s), torch.float32)
        out = attend(rounded, v) if kv_index == 0 else attend(k, rounded)
        errors[c] = float(((out - exact) ** 2).sum())
    return errors
