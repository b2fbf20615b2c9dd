"""AllReduce, face 3 of docs/architecture.md §4: the torch face, over torch.distributed's default process group (gloo
for CPU tensors, NCCL for CUDA tensors; trtopt/runtime/executors/tensor_parallel.py initialises it with the backend
"cpu:gloo,cuda:nccl").

Outside an initialised group (a single-device runtime) the op is the identity, which is only right for a plan sharded
for one rank: a ``world_size`` that disagrees with the group is an error, never a silent partial sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_ref(x: torch.Tensor, *, world_size: int) -> torch.Tensor:
    group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if group_size != world_size:
        raise RuntimeError(
            f"trtopt.AllReduce: the plan was sharded for {world_size} ranks but runs in a group of {group_size}; "
            "run it with tensor_parallel_size equal to the plan's (plan.json's parallel.size)."
        )
    if world_size == 1:
        return x
    # A fresh buffer: the collective writes in place, and x may be read elsewhere in the graph.
    y = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y
