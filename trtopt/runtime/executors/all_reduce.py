"""Which path the tensor-parallel all-reduces take on each rank (docs/architecture.md §7b, "All-reduce paths"):
peer-to-peer GPU memory for small and medium messages (plugins/all_reduce/p2p.py), NCCL otherwise.

``setup_all_reduce`` runs once per rank at start-up, right after the rank joins the group (a collective: every rank
calls it at the same point): the ranks agree whether the fast path is usable on all of them, and if so allocate and
map its symmetric buffers. ``route_all_reduces`` then points the rank's converted graph at it. The caller (the
tensor-parallel executor, on every rank) owns the returned P2PAllReduce and closes it after its CUDA graphs are gone.

``TRTOPT_ALL_REDUCE`` (read when ``mode`` is not given): ``nccl`` (the default for now: never the fast path),
``auto`` (the fast path where every rank can take it, NCCL otherwise, silently), ``p2p`` (the fast path or a
ConfigError at start-up saying why not; messages it does not take still go to NCCL). NCCL stays the default until
the tensor-parallel e2e GPU tests, the killed-worker one included, have passed with the fast path on (they did not
finish inside the first GPU call that ran them: README "P2P all-reduce").
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Literal

import torch
import torch.distributed as dist
import torch.fx

from trtopt.errors import ConfigError
from trtopt.plugins.all_reduce import p2p
from trtopt.plugins.all_reduce.p2p import P2PAllReduce, P2PLimits
from trtopt.runtime.executors import trtopt_ops
from trtopt.runtime.executors.fx_fusions import recompiled

log = logging.getLogger(__name__)

ALL_REDUCE_ENV = "TRTOPT_ALL_REDUCE"
Mode = Literal["auto", "nccl", "p2p"]
MODES: tuple[Mode, ...] = ("auto", "nccl", "p2p")
DEFAULT_MODE: Mode = "nccl"
COMM_ATTR = "p2p_all_reduce"  # the graph module's attribute holding the communicator (one get_attr node)


def all_reduce_mode(value: str | None = None) -> Mode:
    """``value`` (default: the TRTOPT_ALL_REDUCE variable, or "nccl") checked against MODES."""
    raw = value if value is not None else os.environ.get(ALL_REDUCE_ENV, DEFAULT_MODE)
    mode = raw.strip().lower() or DEFAULT_MODE
    if mode not in MODES:
        raise ConfigError(f"{ALL_REDUCE_ENV}={mode!r} is not one of {', '.join(MODES)}; unset it for {DEFAULT_MODE}.")
    return mode  # type: ignore[return-value]


def setup_all_reduce(device: torch.device, *, local_world_size: int, mode: str | None = None,
                     limits: P2PLimits | None = None, group_name: str | None = None,
                     store: object = None) -> P2PAllReduce | None:
    """The fast path's communicator for this rank, or None (NCCL only). Call on every rank of the default group
    after it is joined and the rank's device is current. On CPU or for one rank it returns None at once, with no
    collective (every rank has the same device type and group size). ``mode``: see the module docstring.
    ``group_name``: the name every rank rendezvouses under (rank 0's ``p2p.engine_group_name``; default: the
    default group's); one that is not the default group's is registered with the group's ``store``."""
    mode = all_reduce_mode(mode)
    if device.type != "cuda" or (size := dist.get_world_size()) == 1:
        return None
    reason = (f"{ALL_REDUCE_ENV}=nccl" if mode == "nccl"
              else p2p.unavailable_reason(device, world_size=size, local_world_size=local_world_size))
    comm = None
    if _every_rank(reason is None, device):
        world = dist.group.WORLD.group_name
        group = group_name or world
        try:
            own = {"store": store} if group != world else {}
            comm = P2PAllReduce.create(group, device, limits or p2p.default_limits(size), **own)
            if not comm.agrees_with_sum():
                reason = "its start-up sum came out wrong (a peer-to-peer path the driver reports but does not honour)"
        except Exception as e:  # a rendezvous the driver refuses (no IPC, no VMM): NCCL it is
            reason = f"symmetric memory failed: {e}"
        if not _every_rank(reason is None, device):
            reason = reason or "another rank cannot use it"
    elif reason is None:
        reason = "another rank cannot use it"
    if reason is None:
        assert comm is not None
        log.info("all-reduce: P2P one-shot up to %d KiB, two-shot up to %d KiB, NCCL above (rank %d of %d)",
                 comm.limits.one_shot_max_bytes // 1024, comm.limits.max_bytes // 1024, comm.rank, size)
        return comm
    if comm is not None:
        comm.close()
    if mode == "p2p":
        raise ConfigError(f"{ALL_REDUCE_ENV}=p2p but the peer-to-peer all-reduce is unavailable: {reason}. "
                          f"Unset {ALL_REDUCE_ENV} (auto) to use NCCL.")
    log.info("all-reduce: NCCL only (%s)", reason)
    return None


def _every_rank(ok: bool, device: torch.device) -> bool:
    """True when ``ok`` holds on every rank (a MIN all-reduce over NCCL; one host sync, at start-up only)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def route_all_reduces(gm: torch.fx.GraphModule, comm: P2PAllReduce) -> int:
    """Every trtopt::AllReduce call of a converted graph → ``p2p.all_reduce`` with ``comm`` (held by the module as
    the attribute COMM_ATTR, read through one get_attr node, like PagedAttention's launch state). Returns how many."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is trtopt_ops.all_reduce]
    if not calls:
        return 0
    setattr(gm, COMM_ATTR, comm)
    with gm.graph.inserting_before(calls[0]), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fx warns that a get_attr names no module/parameter/buffer
        held = gm.graph.get_attr(COMM_ATTR)
    for node in calls:
        node.target = p2p.all_reduce
        node.kwargs = {**node.kwargs, "comm": held}
    return recompiled(gm, len(calls))
