"""Tensor-parallel execution of a sharded plan (docs/architecture.md §7b): the TensorParallelExecutor and its workers.

One Executor over N ranks: rank 0 runs in the driver process (beside the scheduler, block manager and sampler, like
vLLM's driver worker), ranks 1..N-1 in worker processes. All N form one torch.distributed group, initialised the
torchrun way (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK; backend "gloo" on CPU, "cpu:gloo,cuda:nccl" on
CUDA, where local rank r owns cuda:r). On one host the driver spawns every worker. Over ``nnodes`` hosts
(NodeConfig: torchrun's flags) it spawns its own node's, and on every other node ``run_worker_node`` spawns that
node's ranks, which find the driver through the group's TCPStore at master_addr:master_port. Per engine step the
driver broadcasts one message (the step's StepInputs, or a KV-pool command) through control_plane.DriverChannel:
shared memory to the ranks of its node (shm_broadcast.py: no network hop and no pickled tensors; gloo's
broadcast_object_list cost 2.5-3.7 ms a step), TCP to the others; async scheduling's sampled ids, still being
computed on rank 0's device, follow as a device broadcast (the step's first collective); every rank runs its plan on
it, the plan's trtopt.AllReduce nodes sum the row-parallel partial results, and each rank writes its own heads into
its own KV pool. The LM head computes the sampled rows only (logits_indices). Replicated (the default build), it
leaves every logits row the sampler needs on rank 0 with nothing gathered; vocabulary-parallel (``--lm-head
vocab-parallel``), each rank computes its vocabulary columns of those rows and the plan's trtopt.AllGather hands
every rank the full rows. Either way rank 0's executor returns the full-vocabulary rows the driver samples from.

A worker that dies (crash, OOM kill) ends the engine: a monitor thread watches the worker processes of the driver's
node and the control connections of the others (closed: the process or node is gone; silent for ``timeout_s``: its
host is down or cut off), and the driver's next (or current) collective fails, at the latest after ``timeout_s``;
``execute`` then raises WorkerDiedError naming the rank, and every later call raises it at once. A worker leaves when
the driver does: its parent gone (one node), or its control connection closed or silent (other nodes).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from trtopt.builder.plan import rank_dir, read_plan
from trtopt.errors import ConfigError, WorkerDiedError
from trtopt.plugins.all_reduce.p2p import P2PAllReduce, engine_group_name
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.config import NodeConfig
from trtopt.runtime.executors.all_reduce import route_all_reduces, setup_all_reduce
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.control_plane import (
    ABORT_KEY, LAUNCH_KEY, READY_KEY, DriverChannel, Launch, PeerGone, TcpBroadcast, TcpReader,
)
from trtopt.runtime.executors.cuda_graphs import CaptureReport, StepGraphs
from trtopt.runtime.executors.shm_broadcast import DEFAULT_SPIN_S, ShmBroadcast
from trtopt.runtime.executors.torch_executor import TorchExecutor

log = logging.getLogger(__name__)

P2P_GROUP_KEY = "trtopt/p2p_group"  # the store key of the name the P2P all-reduce rendezvouses under (rank 0's)
DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer than this on a silent peer fails
# How long the nodes of a multi-node group wait for each other at start-up (torchrun's default join timeout): people
# start them by hand, and node 0 may come up minutes after the others.
DEFAULT_RENDEZVOUS_S = 600.0


@dataclasses.dataclass(frozen=True)
class _Command:
    """What the driver broadcasts once per call; workers mirror it on their own rank."""

    op: str  # "alloc" | "capture" | "step" | "copy" | "graphs" | "stop"
    arg: Any = None


def backend_for(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """Local rank r (its place on its node) owns cuda:r, one process per GPU; CPU ranks share the host."""
    return f"cuda:{local_rank}" if str(device).startswith("cuda") else "cpu"


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the host's cores: more intra-op threads than cores/size makes OpenMP spin against the
    other ranks (measured: 7x slower steps with the default on 2 cores)."""
    return max(1, (os.cpu_count() or 1) // size)


# A step on the wire is one bytes object, not pickled arrays: a header of int64s (the sampled ids' count, -1 for none;
# then per field its numpy dtype's character code, ndim, and two dims; code 0 for a None field), then each field's
# bytes in C order, padded to 8 bytes. Both ends sit on the critical path of every step (the driver's encode before
# its publish, the worker's decode before its launch); against pickling the fields as numpy arrays (what this
# replaced) a batch-1 decode step's encode + pickle costs ~1/2.5 and its unpickle + decode ~1/1.4, measured on CPU
# (benchmarks/tp_host_timeline.py's `codec`; torch.from_numpy per field is most of what is left).
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepInputs) if f.name != "sampled_ids")
_STEP_HEADER = struct.Struct(f"<{1 + 4 * len(_STEP_FIELDS)}q")


def _encode_step(step: StepInputs) -> bytes:
    header = [-1 if step.sampled_ids is None else step.sampled_ids.numel()]
    parts = []
    for name in _STEP_FIELDS:
        tensor = getattr(step, name)
        if tensor is None:
            header += (0, 0, 0, 0)
            continue
        array = tensor.numpy()
        assert array.ndim <= 2, f"StepInputs.{name} has {array.ndim} dims; the step wire format carries 2 at most"
        header += (ord(array.dtype.char), array.ndim, *(array.shape + (0, 0))[:2])
        parts += (array.tobytes(), bytes(-array.nbytes % 8))
    return _STEP_HEADER.pack(*header) + b"".join(parts)


def _decode_step(data: bytes) -> StepInputs:
    buffer = bytearray(data)  # writable: the worker's tensors are its own to change, as unpickled ones were
    header = _STEP_HEADER.unpack_from(buffer)
    offset, fields = _STEP_HEADER.size, {}
    for i, name in enumerate(_STEP_FIELDS):
        code, ndim, *dims = header[1 + 4 * i: 5 + 4 * i]
        if not code:
            fields[name] = None
            continue
        array = np.ndarray(tuple(dims[:ndim]), np.dtype(chr(code)), buffer, offset)
        fields[name] = torch.from_numpy(array)
        offset += -(-array.nbytes // 8) * 8
    count = header[0]
    return StepInputs(**fields, sampled_ids=None if count < 0 else torch.empty(count, dtype=torch.int64))


def reader_spin_s(device: str) -> float:
    """How long a worker's wait for the driver's next message spins before it sleeps (shm_broadcast.py). On CUDA
    through a whole batch-1 decode step's gap (~1 ms): the rank's core has nothing else to do, and the channel's
    default (timer sleeps after 50 µs, 60-76 µs each) let a worker see a step up to that late, its GPU then starting
    the step after rank 0's, which waits for it at the first collective (docs/architecture.md §7b). Past 5 ms a nap's
    wake-up is small beside the gap. On the CPU the default: the ranks' cores compute the steps."""
    return 5e-3 if str(device).startswith("cuda") else DEFAULT_SPIN_S


def _to_wire(command: _Command) -> tuple[str, Any]:
    """A step travels as `_encode_step`'s bytes, except async scheduling's sampled ids: they live on rank 0's device,
    unsampled yet, so only their count travels here and the ids follow on the device (`_share_sampled_ids`)."""
    if command.op == "step":
        return command.op, _encode_step(command.arg)
    return command.op, command.arg


def _from_wire(message: tuple[str, Any]) -> _Command:
    """The command a worker mirrors; a step's sampled ids are an empty int64 tensor of their count (filled by
    `_share_sampled_ids` on the worker's device)."""
    op, arg = message
    return _Command(op, _decode_step(arg) if op == "step" else arg)


def _share_sampled_ids(step: StepInputs, executor: TorchExecutor, *, sender: bool,
                       fast: P2PAllReduce | None = None) -> StepInputs:
    """Async scheduling's sampled ids, broadcast from rank 0 to every rank on the ranks' devices (queued on the
    stream, so neither the driver nor a worker waits on the host for the previous step's tokens; gloo on the CPU).
    Every rank calls it before the step's forward, so it is each step's first collective on every rank, and it
    sits on every step's critical path (rank 0 samples, then the others can start). A worker receives them where
    its CUDA graphs' fill reads them (StepGraphs.sampled_ids_buffer), when it can.

    With the P2P all-reduce (`fast`, all_reduce.py) the broadcast is its one-shot kernel: rank 0 contributes the ids
    as float32, every other rank zeros, so the sum is rank 0's ids exactly (integers below 2^24; vocabularies larger
    than that keep NCCL). NCCL's broadcast walks its ring rank by rank: on 4xH200 the last rank started its step
    ~68 µs after rank 0 at batch 1 (docs/benchmarks/tp_e2e_h200.json, timeline), against ~7 µs for a one-shot call
    (docs/benchmarks/allreduce_h200.json)."""
    if step.sampled_ids is None or not step.sampled_ids.numel():
        return step
    count = step.sampled_ids.numel()
    if sender:
        ids = step.sampled_ids.to(device=executor.device, dtype=torch.int64).contiguous()
    elif executor.graphs is None or (ids := executor.graphs.sampled_ids_buffer(count)) is None:
        ids = torch.empty(count, dtype=torch.int64, device=executor.device)
    if fast is not None and executor.plan.model.vocab_size <= _EXACT_FLOAT32_IDS:
        mine = ids.to(torch.float32) if sender else torch.zeros(count, dtype=torch.float32, device=ids.device)
        summed = fast.all_reduce(mine)
        if summed is not None:  # None: a message too large for the P2P kernels (thousands of sequences): NCCL
            if not sender:
                ids.copy_(summed)  # exact: float32 holds every integer below 2^24
            return dataclasses.replace(step, sampled_ids=ids)
    dist.broadcast(ids, src=0)
    return dataclasses.replace(step, sampled_ids=ids)


_EXACT_FLOAT32_IDS = 2**24  # float32 represents every integer up to here: the P2P broadcast of token ids is exact


def _init_group(rank: int, size: int, device: str, timeout_s: float, store: Any) -> None:
    """Join the default group through the driver's store, once the driver says every rank is there (READY_KEY)."""
    store.wait([READY_KEY])
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout)


def _store(addr: str, port: int, size: int, *, timeout_s: float, server: bool = False) -> Any:
    """The group's TCPStore: the driver hosts it (``server``; port 0 picks a free one), every other rank connects
    (retrying until it is up, for at most ``timeout_s``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return dist.TCPStore(addr, port, size, server, timeout=timeout, wait_for_workers=False)
    except dist.DistNetworkError as e:
        if server:
            raise ConfigError(f"cannot host the tensor-parallel store on port {port} ({e}); pick a free "
                              "--master-port.") from e
        raise ConfigError(f"cannot reach the tensor-parallel driver's store at {addr}:{port} within "
                          f"{timeout_s:.0f} s ({e}); start node 0 and check --master-addr/--master-port.") from e


def worker_main(plan_dir: str, device: str, cuda_graphs: bool, timeout_s: float, channel: str | None,
                rendezvous_timeout_s: float) -> None:
    """A worker rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment,
    as torchrun sets them): join the group, load its rank's plan, mirror the driver's commands until "stop".
    channel: the driver's shared-memory channel (a rank on the driver's node); None: connect to the driver over TCP
    (a rank on another node; the port is in the store's launch record)."""
    # Ctrl-C reaches the terminal's whole process group: the driver decides when workers stop ("stop", or its
    # death, which fails the next collective here), so a worker must not die of it mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if not str(device).startswith("cuda"):
        torch.set_num_threads(cpu_threads_per_rank(local_size))
    parent = os.getppid()  # the driver, or the node's run_worker_node

    def parent_alive() -> None:  # a parent killed without "stop" re-parents us: leave instead of waiting forever
        if os.getppid() != parent:
            raise SystemExit(f"tensor-parallel rank {rank}: its parent (pid {parent}) is gone")

    addr = os.environ["MASTER_ADDR"]
    store = _store(addr, int(os.environ["MASTER_PORT"]), size, timeout_s=rendezvous_timeout_s)
    messages: ShmBroadcast | TcpReader
    if channel is not None:
        messages = ShmBroadcast.attach(channel, num_readers=local_size - 1, reader=local_rank - 1,
                                       spin_s=reader_spin_s(device))
    else:
        launch = Launch.from_json(store.get(LAUNCH_KEY))
        messages = TcpReader.connect(addr, launch.control_port, rank, timeout_s=timeout_s)
    _init_group(rank, size, device, timeout_s, store)
    if str(device).startswith("cuda"):
        torch.cuda.set_device(local_rank)
    fast_all_reduce = setup_all_reduce(torch.device(rank_device(device, local_rank)), local_world_size=local_size,
                                       group_name=store.get(P2P_GROUP_KEY).decode(), store=store)
    if fast_all_reduce is not None:
        _exit_with_parent(parent, rank)
    path = rank_dir(plan_dir, rank)
    executor = TorchExecutor(path, read_plan(path), device=rank_device(device, local_rank), cuda_graphs=cuda_graphs)
    if fast_all_reduce is not None:
        route_all_reduces(executor.graph.module, fast_all_reduce)
    while True:
        try:
            command = _from_wire(messages.receive(alive=parent_alive))
        except PeerGone as e:
            raise SystemExit(f"tensor-parallel rank {rank}: {e}") from None
        if command.op == "stop":
            break
        _apply(executor, command, rank=rank, fast=fast_all_reduce)
    _release_graphs(executor)
    if fast_all_reduce is not None:
        fast_all_reduce.close()
    messages.close()
    dist.destroy_process_group()


def _exit_with_parent(parent: int, rank: int) -> None:
    """With P2P all-reduces a rank can be stuck in a kernel that waits for a dead peer (no abort reaches it, unlike
    NCCL's): leave as soon as the driver is gone, whatever the main thread is doing."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        print(f"tensor-parallel rank {rank}: its parent (pid {parent}) is gone", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="trtopt-tp-parent", daemon=True).start()


def _spawn_worker(plan_dir: str | Path, rank: int, local_rank: int, local_size: int, size: int, *, addr: str,
                  port: int, device: str, cuda_graphs: bool, timeout_s: float, rendezvous_timeout_s: float,
                  channel: Path | None) -> subprocess.Popen:
    # Fresh interpreters (`python -m trtopt.runtime.executors.tensor_parallel`), not multiprocessing: nothing of
    # the caller's __main__ is re-imported, and a worker is exactly what torchrun would start.
    env = {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(size),
           "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size)}
    args = [sys.executable, "-m", "trtopt.runtime.executors.tensor_parallel", str(plan_dir), "--device", str(device),
            "--timeout", str(timeout_s), "--rendezvous-timeout", str(rendezvous_timeout_s)]
    args += ["--channel", str(channel)] if channel is not None else []
    args += ["--cuda-graphs"] if cuda_graphs else []
    return subprocess.Popen(args, env=env)


def run_worker_node(plan_dir: str | Path, size: int | None, nodes: NodeConfig, *, device: str = "cpu",
                    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_S) -> None:
    """Node ``nodes.node_rank`` > 0 of a multi-node group: start this node's ranks, and block until they end.

    The ranks find the driver (node 0) through its store at master_addr:master_port (waiting up to
    ``rendezvous_timeout_s`` for it to come up) and take its graphs and timeout settings. Returns when the driver
    stopped the group; raises WorkerDiedError when a rank of this node exited otherwise (the driver died or fell
    silent, or the rank crashed: its stderr says which), ConfigError when this node's flags do not match node 0's.
    size: the group's ranks (None = the plan's own size, as on node 0).
    """
    from trtopt.runtime.executors import _resolve_plan

    assert nodes.node_rank > 0, "node 0 runs the driver (TensorParallelExecutor)"
    size = _resolve_plan(plan_dir, size)[2]
    local_size = nodes.ranks_per_node(size)
    assert nodes.master_addr is not None and nodes.master_port is not None  # NodeConfig checked them
    addr, port = nodes.master_addr, nodes.master_port
    store = _store(addr, port, size, timeout_s=rendezvous_timeout_s)
    launch = Launch.from_json(store.get(LAUNCH_KEY))
    problem = launch.mismatch(size=size, nnodes=nodes.nnodes, device=device)
    if problem is None and str(device).startswith("cuda") and torch.cuda.device_count() < local_size:
        problem = (f"tensor_parallel_size={size} over {nodes.nnodes} nodes needs {local_size} GPUs on node "
                   f"{nodes.node_rank}; torch sees {torch.cuda.device_count()}.")
    if problem is not None:
        store.set(ABORT_KEY, f"node {nodes.node_rank}: {problem}")  # the driver fails now rather than time out
        raise ConfigError(problem)
    first = nodes.node_rank * local_size
    log.info("node %d: starting tensor-parallel ranks %d..%d of %d for the driver at %s:%d", nodes.node_rank, first,
             first + local_size - 1, size, addr, port)
    workers = [_spawn_worker(plan_dir, first + i, i, local_size, size, addr=addr, port=port, device=launch.device,
                             cuda_graphs=launch.cuda_graphs, timeout_s=launch.timeout_s,
                             rendezvous_timeout_s=rendezvous_timeout_s, channel=None)
               for i in range(local_size)]
    try:
        while (codes := [proc.poll() for proc in workers]) != [0] * local_size:
            for rank, (proc, code) in enumerate(zip(workers, codes), start=first):
                if code not in (None, 0):
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; the group is over. "
                        f"Its stderr says why (the driver at {addr}:{port} gone or silent, or a crash).")
            time.sleep(0.2)
    finally:
        for proc in workers:  # the others cannot go on without it; Ctrl-C here stops them too
            if proc.poll() is None:
                proc.terminate()
        for proc in workers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _apply(executor: TorchExecutor, command: _Command, *, rank: int,
           fast: P2PAllReduce | None = None) -> torch.Tensor | None:
    if command.op == "step":
        return executor.execute(_share_sampled_ids(command.arg, executor, sender=rank == 0, fast=fast))
    if command.op == "alloc":
        executor.allocate_kv_cache(command.arg)
    elif command.op == "capture":
        executor.capture_graphs(**command.arg)
    elif command.op == "copy":
        executor.copy_blocks(command.arg)
    elif command.op == "graphs":
        executor.set_cuda_graphs(command.arg)
    else:
        raise AssertionError(f"unknown command {command.op!r}")
    return None


class TensorParallelExecutor(Executor):
    """The Executor contract (base.py) over ``size`` ranks; see the module docstring. Rank 0's TorchExecutor runs
    here; its graphs are this executor's, its greedy tokens are not read through it (the default). It resolves async
    scheduling's placeholders on the devices: the step message carries their count, the ids follow by broadcast
    (`_share_sampled_ids`), so the engine need not wait for a step's tokens before launching the next (that wait left
    a ~0.35 ms gap between the steps of N=2 batch-1 decode on 2xH200: docs/benchmarks/tp_e2e_h200.json)."""

    resolves_placeholders = True

    def __init__(self, plan_dir: str | Path, size: int, *, device: str = "cpu", cuda_graphs: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, nnodes: int = 1, master_addr: str | None = None,
                 master_port: int | None = None, rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_S):
        """nnodes > 1: this is node 0 of a group over that many hosts (NodeConfig), hosting the store at
        master_port and waiting up to ``rendezvous_timeout_s`` for the other nodes' ranks (run_worker_node)."""
        local_size = NodeConfig(nnodes, 0, master_addr, master_port).ranks_per_node(size)
        if dist.is_initialized():
            raise ConfigError("this process already belongs to a torch.distributed group; run one tensor-parallel "
                              "engine per process (shut the other down first).")
        if str(device).startswith("cuda") and torch.cuda.device_count() < local_size:
            raise ConfigError(f"tensor_parallel_size={size} over {nnodes} node(s) needs {local_size} GPUs on this "
                              f"node; torch sees {torch.cuda.device_count()}.")
        self._closed = True  # nothing to shut down until the store is up
        if nnodes > 1:
            assert master_addr is not None and master_port is not None  # NodeConfig checked them
            addr, port, rendezvous = master_addr, master_port, rendezvous_timeout_s
        else:  # port 0: the store picks a free port, so concurrent engines on one host never collide
            addr, port, rendezvous = os.environ.get("MASTER_ADDR", "127.0.0.1"), 0, timeout_s
        store = self._store = _store(addr, port, size, timeout_s=timeout_s, server=True)
        self._closed = False
        self.size, self._local_size = size, local_size
        self._device = str(device)
        self.device = torch.device(rank_device(self._device, 0))  # rank 0's, like a single-device executor's
        self._threads = torch.get_num_threads()  # restored by shutdown()
        if not self._device.startswith("cuda"):
            torch.set_num_threads(cpu_threads_per_rank(local_size))  # rank 0 runs in this process
        self._error: WorkerDiedError | None = None
        self._local: TorchExecutor | None = None  # rank 0's, once the group is up
        self._all_reduce: P2PAllReduce | None = None  # rank 0's P2P all-reduce buffers (all_reduce.py), or None
        self._remote = TcpBroadcast(range(local_size, size), timeout_s=timeout_s) if nnodes > 1 else None
        self._channel = DriverChannel(ShmBroadcast.create(num_readers=local_size - 1), self._remote)
        self._workers: list[subprocess.Popen] = []  # this node's, rank 1 first
        launch = Launch(size, nnodes, self._device, cuda_graphs, timeout_s,
                        self._remote.port if self._remote is not None else 0)
        store.set(LAUNCH_KEY, launch.to_json())
        for rank in range(1, local_size):
            self._workers.append(_spawn_worker(
                plan_dir, rank, rank, local_size, size, addr=addr, port=store.port, device=device,
                cuda_graphs=cuda_graphs, timeout_s=timeout_s, rendezvous_timeout_s=rendezvous,
                channel=self._channel.local.path))
        self._monitor = threading.Thread(target=self._watch, name="trtopt-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            if self._remote is not None:
                log.info("tensor-parallel driver: waiting for ranks %d..%d of nodes 1..%d at %s:%d", local_size,
                         size - 1, nnodes - 1, addr, port)
                self._remote.accept(rendezvous_timeout_s, alive=self._check_launch)
            store.set(READY_KEY, "1")
            _init_group(0, size, device, timeout_s, store)
            self._store = store
            path = rank_dir(plan_dir, 0)
            if str(device).startswith("cuda"):
                torch.cuda.set_device(0)
            p2p_group = engine_group_name()
            store.set(P2P_GROUP_KEY, p2p_group)  # every rank rendezvouses its P2P buffers under rank 0's choice
            self._all_reduce = setup_all_reduce(torch.device(rank_device(device, 0)), local_world_size=local_size,
                                                group_name=p2p_group, store=store)
            self.plan = read_plan(path)
            self._local = TorchExecutor(path, self.plan, device=rank_device(device, 0), cuda_graphs=cuda_graphs)
            if self._all_reduce is not None:
                route_all_reduces(self._local.graph.module, self._all_reduce)
        except ConfigError:  # another node was launched with other flags (it said so in the store)
            self.shutdown()
            raise
        except Exception as e:
            self.shutdown()
            raise self._error or WorkerDiedError(f"the tensor-parallel group did not start: {e}") from e

    # ---- the Executor contract -----------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._run(_Command("alloc", num_blocks))
        self.num_blocks = num_blocks

    def capture_graphs(self, *, max_num_seqs: int, max_num_tokens: int,
                       max_logits: int | None = None) -> CaptureReport | None:
        """Every rank captures the same buckets; returns rank 0's capture report (None without graphs)."""
        self._run(_Command("capture", {"max_num_seqs": max_num_seqs, "max_num_tokens": max_num_tokens,
                                        "max_logits": max_logits}))
        return self.graphs.capture_report if self.graphs is not None else None

    def execute(self, step: StepInputs) -> torch.Tensor:
        logits = self._run(_Command("step", step))
        assert logits is not None
        return logits

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._run(_Command("copy", list(pairs)))

    @property
    def graphs(self) -> StepGraphs | None:
        """Rank 0's CUDA graphs (every rank captured the same buckets), or None."""
        return self._local.graphs if self._local is not None else None

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Turn graph replay on/off on every rank together (a rank replaying while another runs eagerly would
        still pair the collectives, but profiles of rank 0 must see the same kernels the others run)."""
        self._run(_Command("graphs", enabled))

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers and leave the group; idempotent. Live workers get "stop", dead ones are reaped."""
        if self._closed:
            return
        self._closed = True
        stopped = False
        if self._error is None and dist.is_initialized() and self._dead_worker() is None:
            try:
                self._channel.publish(_to_wire(_Command("stop")), alive=self._check_workers)
                stopped = True
            except Exception:  # a worker died in between: it is terminated below
                log.warning("tensor-parallel stop message failed; terminating the workers")
        _release_graphs(self._local)
        if self._all_reduce is not None:
            self._all_reduce.close()
        if dist.is_initialized():
            if stopped:
                # Leaving a NCCL group is a handshake: the workers destroy theirs right after "stop", so the driver
                # must do the same now, not after waiting for them to exit (the first H200x2 run hung exactly so).
                if not _destroy_group(timeout_s=30.0):
                    log.warning("tensor-parallel group did not close within 30 s; terminating the workers")
            else:
                _abort_group()
        for proc in self._workers:
            if self._local is None:  # the group never formed: nothing for the workers to wait for
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._channel.close()
        torch.set_num_threads(self._threads)

    def __del__(self) -> None:  # an engine dropped without shutdown() must not leave workers behind
        try:
            if not self._closed:
                self.shutdown()
        except Exception:
            pass

    # ---- internals --------------------------------------------------------------------------------------------

    def _run(self, command: _Command) -> torch.Tensor | None:
        if self._error is None and (error := self._dead_worker()) is not None:
            self._error = error  # died while the engine was idle: fail before sending anything
            self.shutdown()
        if self._error is not None:
            raise self._error
        if self._closed:
            raise WorkerDiedError("the tensor-parallel executor was shut down; start a new engine.")
        assert self._local is not None, "rank 0's executor is made before the first command"
        try:
            self._channel.publish(_to_wire(command), alive=self._check_workers)
            result = _apply(self._local, command, rank=0, fast=self._all_reduce)
            if self._error is not None:  # a peer died mid-step: released P2P all-reduces summed garbage
                raise self._error
            return result
        except Exception as e:
            # The collective failed: a worker is gone (or going). Give the monitor a moment to see which.
            deadline = time.monotonic() + 2.0
            while self._error is None and self._dead_worker() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            error = self._error or self._dead_worker() or WorkerDiedError(
                f"a tensor-parallel collective failed ({e}); the engine is stopped. Check the workers' stderr."
            )
            self._error = error
            self.shutdown()
            raise error from e

    def _watch(self) -> None:
        """Wait for any worker to exit; record which (and, on CUDA, abort the group so NCCL calls return)."""
        while not self._closed:
            error = self._dead_worker()
            if error is not None and not self._closed:
                self._error = error
                log.error("%s", error)
                if self._device.startswith("cuda"):
                    if self._all_reduce is not None:  # its kernels wait for the dead peer's flags until released
                        self._all_reduce.release_barriers(lambda: not self._closed, timeout_s=DEFAULT_TIMEOUT_S)
                    # A NCCL collective waits forever on a dead peer; aborting the group makes it return an error.
                    _abort_group()
                return
            time.sleep(0.2)

    def _check_workers(self) -> None:
        if (error := self._error or self._dead_worker()) is not None:
            raise error

    def _dead_worker(self) -> WorkerDiedError | None:
        for rank, proc in enumerate(self._workers, start=1):
            code = proc.poll()
            if code is not None:
                return WorkerDiedError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}; the engine "
                    "is stopped and its requests failed. Check that rank's stderr (and memory), then restart."
                )
        if self._remote is not None and (lost := self._remote.lost()) is not None:
            rank, how = lost
            node = rank // self._local_size
            return WorkerDiedError(
                f"tensor-parallel worker rank {rank} on node {node} ({self._remote.peers.get(rank, '?')}) {how}; "
                "the engine is stopped and its requests failed. Check that node's log, then restart every node."
            )
        return None

    def _check_launch(self) -> None:
        """While waiting for the other nodes: a local worker died, or a node refused the launch (ABORT_KEY)."""
        self._check_workers()
        if self._store.check([ABORT_KEY]):
            raise ConfigError(self._store.get(ABORT_KEY).decode())


def _release_graphs(executor: TorchExecutor | None) -> None:
    """Drop the CUDA graphs that captured all-reduces: NCCL holds a reference per such graph and its comm destroy
    waits until every one is gone (pytorch#115388; vLLM and TensorRT release graphs before NCCL for this reason)."""
    if executor is not None and executor.graphs is not None:
        executor.graphs.reset()
        torch.cuda.synchronize(executor.device)
        gc.collect()


def _destroy_group(timeout_s: float) -> bool:
    """destroy_process_group() with a bound: True when it returned in time (a peer that never answers the goodbye
    would otherwise hang the driver's shutdown forever)."""
    done = threading.Event()

    def run() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=run, name="trtopt-tp-destroy", daemon=True).start()
    return done.wait(timeout_s)


def _abort_group() -> None:
    """Leave a group whose peers are gone without the goodbye handshake destroy_process_group would wait for.

    The one use of a private torch API (torch 2.13): ``distributed_c10d._abort_process_group``. Public torch has
    ``ProcessGroup.abort()`` (on ``dist.group.WORLD``), but it only aborts the backends: torch.distributed's registry
    still holds the group, and the ``destroy_process_group`` that must follow would call ``shutdown`` on NCCL
    communicators that were just aborted (not tried on GPUs). ``_abort_process_group`` aborts every backend inside
    one NCCL group call (pytorch#119797) and clears the registry, so this process can start another engine; it is
    the path the 2xH200 dead-worker test passed with. Replace it here if torch makes it public or drops it.
    """
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # a torch without it, or a group already gone: destroy below still leaves what is left
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="A trtopt tensor-parallel worker rank (started by the driver).")
    parser.add_argument("plan_dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_RENDEZVOUS_S)
    parser.add_argument("--channel", default=None,
                        help="the driver's shared-memory channel (shm_broadcast.py); absent: TCP (another node)")
    args = parser.parse_args()
    worker_main(args.plan_dir, args.device, args.cuda_graphs, args.timeout, args.channel, args.rendezvous_timeout)


if __name__ == "__main__":
    _main()
