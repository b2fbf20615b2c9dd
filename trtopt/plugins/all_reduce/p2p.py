"""AllReduce's fast path on CUDA: a sum over peer-to-peer GPU memory (docs/architecture.md §7b, "All-reduce paths").

A graphed NCCL all-reduce of a decode-sized message costs ~14 µs on H100/H200, mostly fixed latency; vLLM's custom
all-reduce and TensorRT-LLM's one-shot all-reduce avoid it by reading the peers' memory directly. This module does
the same with PyTorch's symmetric memory (``torch.distributed._symmetric_memory``, CUDA backend, NVLink multicast
off):

- one symmetric buffer per rank, allocated and rendezvoused once (``P2PAllReduce.create``, a collective), mapped
  into every peer's address space; its size (``P2PLimits.max_bytes``) is the largest message the path takes;
- **one-shot** (``symm_mem::one_shot_all_reduce_copy_out``): one kernel copies x into this rank's buffer, meets the
  peers at a flag barrier, and sums every rank's buffer into a fresh output. Every rank reads the whole message of
  every peer, so it is for small messages (``P2PLimits.one_shot_max_bytes``);
- **two-shot** (``symm_mem::two_shot_all_reduce_out``): x is copied into the buffer, then each rank sums its 1/N
  slice of every peer's buffer (reduce-scatter) and every rank gathers the N reduced slices (all-gather);
- **NCCL** (the caller's own path) for larger messages, dtypes the kernels lack (they take float32 and bfloat16),
  sizes not a multiple of 4 bytes, and world sizes other than 2, 4 and 8 (the ones the kernels are compiled for).

Both kernels launch from shapes alone (no host sync) and allocate nothing but their output through the caching
allocator (a graph's private pool while capturing), so they are captured in the step's CUDA graphs like NCCL. The
buffer is reused by every call: each kernel ends with a second barrier, so no rank overwrites it while a peer still
reads it. The flags reset themselves (each barrier sets and clears them), so a graph replays any number of times.

Numerics: the kernels add in the input dtype in rank order (rank 0 + rank 1 + ...), the same order on every rank, so
every rank holds the same bits; NCCL's ring adds in another order. In bfloat16 the two differ by bf16 rounding; in
float32 they are equal for two ranks (one addition) and differ in the last bits for more.

Dead peers: the flag barriers have no timeout, so a kernel whose peer died spins forever (a NCCL kernel instead
returns once its communicator is aborted). ``release_barriers`` lets it finish (with garbage) by setting this rank's
flags and clearing the peers' from a side stream; the tensor-parallel executor's monitor calls it when a worker dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Callable, Literal

import torch

log = logging.getLogger(__name__)

KiB, MiB = 1024, 1024 * 1024
Algorithm = Literal["one_shot", "two_shot", "nccl"]
P2P_DTYPES = (torch.bfloat16, torch.float32)  # symm_mem's AT_DISPATCH_FLOAT_AND_BFLOAT16
P2P_WORLD_SIZES = (2, 4, 8)  # the world sizes its kernels are specialised for (two-shot's _out form takes no other)
# The ops the fast path calls (torch.ops.symm_mem), the first of each pair preferred where the running torch has it.
ONE_SHOT_OPS = ("one_shot_all_reduce_copy_out", "one_shot_all_reduce_out")
TWO_SHOT_OPS = ("two_shot_all_reduce_out", "two_shot_all_reduce_")
_VECTOR_BYTES = 16  # the kernels' widest load; one_shot's fused copy needs x and the buffer equally aligned


@dataclasses.dataclass(frozen=True)
class P2PLimits:
    """Which messages take which path (bytes of one rank's x)."""

    one_shot_max_bytes: int  # one-shot up to here (every rank reads all N messages: latency-bound sizes)
    max_bytes: int  # two-shot up to here; also the symmetric buffer's size. Larger messages go to NCCL.

    def __post_init__(self) -> None:
        assert 0 < self.one_shot_max_bytes <= self.max_bytes, self


def default_limits(world_size: int) -> P2PLimits:
    """vLLM's custom all-reduce switch points (one-shot under 512 KiB up to 4 ranks, 256 KiB at 8) and an 8 MiB
    buffer (2048 tokens of hidden 2048 in bf16). To be tuned from benchmarks/allreduce.py's crossover points."""
    return P2PLimits(one_shot_max_bytes=(512 if world_size <= 4 else 256) * KiB, max_bytes=8 * MiB)


def choose_algorithm(nbytes: int, dtype: torch.dtype, limits: P2PLimits) -> Algorithm:
    """The path for a message of ``nbytes`` bytes (one rank's x) of ``dtype``. A plain function of the message, so
    every rank takes the same path for the same call."""
    if dtype not in P2P_DTYPES or nbytes == 0 or nbytes % 4 or nbytes > limits.max_bytes:
        return "nccl"
    return "one_shot" if nbytes <= limits.one_shot_max_bytes else "two_shot"


def symm_mem_missing() -> str | None:
    """Why this torch cannot run the fast path (None: it can): the symmetric-memory module or one of its ops is
    absent (they came in torch 2.5-2.8; checked by feature, not by version)."""
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError as e:
        return f"torch.distributed._symmetric_memory cannot be imported ({e})"
    missing = [name for name in ("empty", "rendezvous") if not hasattr(symm, name)]
    for ops in (ONE_SHOT_OPS, TWO_SHOT_OPS):
        if not any(_has_op(op) for op in ops):
            missing.append(f"torch.ops.symm_mem.{ops[-1]}")
    return f"this torch lacks {', '.join(missing)}" if missing else None


def unavailable_reason(device: torch.device, *, world_size: int, local_world_size: int,
                       api_missing: Callable[[], str | None] = symm_mem_missing) -> str | None:
    """Why this rank cannot take the fast path (None: it can): not CUDA, one rank, ranks on several hosts, a world
    size the kernels lack, a peer GPU this one cannot access, or no symmetric-memory API. Local checks only: the
    ranks agree afterwards (the executor's setup), since one rank alone cannot use it."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if world_size == 1:
        return "a group of one rank has nothing to reduce"
    if local_world_size != world_size:
        return f"the group spans hosts ({local_world_size} of its {world_size} ranks on this one)"
    if world_size not in P2P_WORLD_SIZES:
        return f"world size {world_size} is not one of {P2P_WORLD_SIZES}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    blocked = [peer for peer in range(local_world_size)
               if peer != index and not torch.cuda.can_device_access_peer(index, peer)]
    if blocked:
        return f"cuda:{index} cannot access the memory of cuda:{blocked} (no peer-to-peer path)"
    return api_missing()


def _has_op(name: str) -> bool:
    try:
        return hasattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def engine_group_name() -> str:
    """A name of its own for one engine's P2P communicator, chosen by rank 0 (the other ranks read it from the
    group's store). Not the default group's: torch keeps a group name's symmetric-memory info (rank, size, store)
    from its first rendezvous for the life of the process, and every new default group is named "0" again, so a
    second engine in one process would rendezvous through the first one's store (on 4x H200 every P2P engine after
    the first in a test process failed; the same tests passed alone)."""
    return f"trtopt-p2p-{uuid.uuid4().hex}"


class P2PAllReduce:
    """One rank's symmetric buffer and the all-reduces over it. Made by ``create`` (a collective of the group) and
    owned by whoever made it (the tensor-parallel executor on each rank); ``close`` releases it."""

    def __init__(self, buffer: torch.Tensor, handle: object, *, group_name: str, limits: P2PLimits):
        self.buffer = buffer  # uint8 [limits.max_bytes], this rank's part of the symmetric allocation
        self.handle = handle  # the rendezvous' _SymmetricMemory: peers' buffers and signal pads
        self.group_name = group_name
        self.limits = limits
        self.device = buffer.device
        self.world_size = int(handle.world_size)
        self.rank = int(handle.rank)
        self._one_shot_op = next(op for op in ONE_SHOT_OPS if _has_op(op))
        self._two_shot_op = next(op for op in TWO_SHOT_OPS if _has_op(op))

    @classmethod
    def create(cls, group_name: str, device: torch.device, limits: P2PLimits, *, store: object = None
               ) -> P2PAllReduce:
        """Allocate this rank's buffer and map the peers' (a collective: every rank of the group calls it at the
        same point). NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST, unless the caller set it):
        the machines this runs on disable NVLS, and the multimem ops are not used.

        ``group_name``: the default group's name, or (with ``store``, the group's store) a name of the caller's
        that is registered here as a logical group of the default group's ranks (``engine_group_name``)."""
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import warnings

        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        if store is not None:
            from torch._C._distributed_c10d import _SymmetricMemory

            _SymmetricMemory.set_group_info(group_name, dist.get_rank(), dist.get_world_size(),
                                            dist.PrefixStore(f"{group_name}/", store))
        elif _torch_version() < (2, 11) and hasattr(symm, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():  # needed before 2.11 (it gives rendezvous the group's store)
                warnings.simplefilter("ignore", FutureWarning)
                symm.enable_symm_mem_for_group(group_name)
        buffer = symm.empty(limits.max_bytes, dtype=torch.uint8, device=device)
        buffer.zero_()
        handle = symm.rendezvous(buffer, group_name)
        return cls(buffer, handle, group_name=group_name, limits=limits)

    # ---- the all-reduces ---------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the group, as a new tensor; None when the message belongs to NCCL (choose_algorithm)."""
        algorithm = choose_algorithm(x.numel() * x.element_size(), x.dtype, self.limits)
        if algorithm == "one_shot":
            return self.one_shot(x)
        if algorithm == "two_shot":
            return self.two_shot(x)
        return None

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """One kernel: x → this rank's buffer, barrier, out = Σ_ranks buffer (rank order), barrier."""
        x = self._check(x)
        symmetric = self._staging(x)
        out = torch.empty_like(x)
        fused = self._one_shot_op == "one_shot_all_reduce_copy_out" and (
            x.storage_offset() * x.element_size() % _VECTOR_BYTES == 0)
        if fused:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symmetric, x, "sum", self.group_name, out)
        else:
            symmetric.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(symmetric, "sum", self.group_name, out)
        return out

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """x → this rank's buffer; one kernel: reduce this rank's slice over the peers, gather all slices."""
        x = self._check(x)
        symmetric = self._staging(x)
        symmetric.copy_(x)
        if self._two_shot_op == "two_shot_all_reduce_out":
            out = torch.empty_like(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(symmetric, "sum", self.group_name, out)
            return out
        torch.ops.symm_mem.two_shot_all_reduce_(symmetric, "sum", self.group_name)
        return symmetric.clone()

    def _check(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        assert x.device == self.device and x.dtype in P2P_DTYPES and 0 < nbytes <= self.limits.max_bytes \
            and nbytes % 4 == 0, (x.device, x.dtype, tuple(x.shape), self.limits)
        return x.contiguous()

    def _staging(self, x: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes as x's shape and dtype (storage offset 0: the kernels' alignment)."""
        return self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    # ---- start-up check and the end ----------------------------------------------------------------------------

    def agrees_with_sum(self) -> bool:
        """Run both kernels once on known values (rank r contributes r + 1) and check the sums: a peer-to-peer
        path that torch reports but the hardware does not honour (vLLM saw such drivers) fails here, at start-up.
        A collective; syncs this rank's device."""
        n = 2048  # 4 KiB of float32: one block of each kernel
        x = torch.full((n,), float(self.rank + 1), dtype=torch.float32, device=self.device)
        want = self.world_size * (self.world_size + 1) / 2
        sums = (self.one_shot(x), self.two_shot(x))
        return all(bool((y == want).all()) for y in sums)

    def release_barriers(self, keep_going: Callable[[], bool], *, timeout_s: float) -> threading.Thread:
        """Let kernels stuck at a barrier with a dead peer finish: from a thread of its own, every millisecond, set
        every flag of this rank's signal pad (its waits pass) and clear the peers' (its signals pass), on a side
        stream, while ``keep_going()`` holds or this device's default stream is busy (at most ``timeout_s``). The
        sums come out wrong; the caller fails the step. Then this rank's flags are cleared. Best effort: an error
        is logged, never raised (the caller is already handling a dead peer)."""

        def run() -> None:
            try:
                with torch.cuda.device(self.device):
                    stream = torch.cuda.Stream(self.device)
                    main = torch.cuda.default_stream(self.device)
                    own = self.handle.get_signal_pad(self.rank).view(torch.int32)
                    peers = [self.handle.get_signal_pad(r).view(torch.int32)
                             for r in range(self.world_size) if r != self.rank]
                    deadline = time.monotonic() + timeout_s
                    with torch.cuda.stream(stream):
                        while (keep_going() or not main.query()) and time.monotonic() < deadline:
                            own.fill_(1)
                            for pad in peers:
                                pad.zero_()
                            time.sleep(0.001)
                        if main.query():
                            own.zero_()
                        stream.synchronize()
            except Exception as e:
                log.warning("releasing the P2P all-reduce barriers failed (%s)", e)

        thread = threading.Thread(target=run, name="trtopt-p2p-release", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Drop the buffer (after every graph that captured these kernels is gone and the device is idle)."""
        self.buffer = self.handle = None  # type: ignore[assignment]


def all_reduce(x: torch.Tensor, *, world_size: int, comm: P2PAllReduce) -> torch.Tensor:
    """trtopt::AllReduce over ``comm`` where the message takes the fast path, else the NCCL torch face
    (reference.py). The torch executor's graph calls it once the tensor-parallel executor has routed the op here
    (runtime/executors/all_reduce.py)."""
    from trtopt.plugins.all_reduce.reference import all_reduce_ref

    if world_size == comm.world_size and x.device == comm.device:
        y = comm.all_reduce(x)
        if y is not None:
            return y
    return all_reduce_ref(x, world_size=world_size)
