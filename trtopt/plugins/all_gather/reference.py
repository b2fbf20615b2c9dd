"""AllGather, face 3 of docs/architecture.md §4: the torch face, over torch.distributed's default process group (gloo
for CPU tensors, NCCL for CUDA tensors; trtopt/runtime/executors/tensor_parallel.py initialises it with the backend
"cpu:gloo,cuda:nccl").

``all_gather_single`` (``all_gather_into_tensor`` before torch 2.13) writes the ranks' blocks one after the other
along dim 0, so the result is rearranged to put them side by side along ``axis``. On CUDA this is one NCCL kernel plus one copy on the current stream, with no
host synchronisation, so it is captured in the step's CUDA graph like trtopt.AllReduce. Outside an initialised group
(a single-device runtime) the op is the identity, which is only right for a plan sharded for one rank: a
``world_size`` that disagrees with the group is an error, never a silent partial vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_ref(x: torch.Tensor, *, world_size: int, axis: int = -1) -> torch.Tensor:
    group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if group_size != world_size:
        raise RuntimeError(
            f"trtopt.AllGather: the plan was sharded for {world_size} ranks but runs in a group of {group_size}; "
            "run it with tensor_parallel_size equal to the plan's (plan.json's parallel.size)."
        )
    if world_size == 1:
        return x
    axis = axis % x.dim()
    x = x.contiguous()
    # The blocks concatenated along dim 0 ([W*d0, ...]): the one output layout both gloo and NCCL accept (gloo
    # refuses the stacked [W, *x.shape] form that NCCL also takes).
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x)
    # [W, d0, .., d_axis, ..] -> [d0, .., W, d_axis, ..] -> merge (W, d_axis): rank r's block at [r*d, (r+1)*d).
    shape = list(x.shape)
    shape[axis] *= world_size
    return out.view(world_size, *x.shape).movedim(0, axis).reshape(shape)


# torch 2.13 renamed all_gather_into_tensor (now a deprecated alias) to all_gather_single; older torch has only the
# former. Same collective either way.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
