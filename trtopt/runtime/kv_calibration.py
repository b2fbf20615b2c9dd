"""The K/V calibration of `trtopt build --kv-cache-smoothing` and `--kv-cache-scales amax` (builder/kv_calibration.py
has the data and the windows): run the paged graph, pools still in the model's dtype, over the calibration windows and
average, and take the largest magnitude of, what every PagedAttention is handed to store. It sits in the runtime because it executes the graph through the torch converter
and the input builder; `trtopt build` hands it to build_plan as ``kv_calibrator`` (docs/architecture.md §3)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import onnx_ir as ir

from trtopt.builder.kv_calibration import KvStats
from trtopt.plugins.common import DOMAIN


def kv_stats(model: ir.Model, windows: np.ndarray, *, block_size: int, device: str | None = None,
             on_window: Callable[[], None] = lambda: None) -> KvStats:
    """The mean key and value, and their amax per KV head, of every PagedAttention of the paged ``model`` over
    ``windows`` [n, L]; ``on_window`` is called after each window (a progress bar). ``model`` is left as it was."""
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
    sums: list = [0.0] * len(watched)
    amaxes: list = [0.0] * len(watched)
    builder = InputBuilder(block_size, num_blocks)
    with torch.inference_mode():
        for window in windows:
            seq = ScheduledSeq("calibration", [int(t) for t in window], 0, list(range(1, num_blocks + 1)), True)
            feeds = {name: t.to(device) for name, t in step_tensors(builder.build(
                ScheduledBatch([seq], length, []))).items()}
            outputs = converted.module(*[feeds[n] if n in feeds else pools[n] for n in converted.input_names])
            for i, p in enumerate(positions):
                kv = outputs[p][0].double()  # k or v [1, Hkv, T, D]
                sums[i] = sums[i] + kv.sum(dim=1).cpu()  # [Hkv, D]
                amaxes[i] = torch.maximum(torch.as_tensor(amaxes[i]), kv.abs().amax(dim=(1, 2)).cpu())  # [Hkv]
            on_window()
    del converted, pools
    tokens = windows.size
    means = [(s / tokens).numpy() for s in sums]
    amax = [a.numpy() for a in amaxes]
    return KvStats(k=means[0::2], v=means[1::2], k_amax=amax[0::2], v_amax=amax[1::2], tokens=tokens, windows=len(windows), device=device,
                   seconds=time.perf_counter() - start)
