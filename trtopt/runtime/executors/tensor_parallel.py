"""Tensor-parallel execution of a sharded plan (docs/architecture.md §7b): the TensorParallelExecutor and its workers.

One Executor over N ranks: rank 0 runs in the driver process (beside the scheduler, block manager and sampler, like
vLLM's driver worker), ranks 1..N-1 in worker processes it spawns. All N form one torch.distributed group,
initialised the torchrun way (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK; backend "gloo" on CPU,
"cpu:gloo,cuda:nccl" on CUDA, where rank r owns cuda:r). Per engine step the driver broadcasts one message (the
step's StepInputs, or a KV-pool command) through a shared-memory channel (executors/shm_broadcast.py: one host, so
no network hop and no pickled tensors; gloo's broadcast_object_list cost 2.5-3.7 ms a step); every rank runs its
plan on it, the plan's trtopt.AllReduce nodes sum the row-parallel partial results, and each rank writes its own
heads into its own KV pool. The LM head computes the sampled rows only (logits_indices). Replicated (the default
build), it leaves every logits row the sampler needs on rank 0 with nothing gathered; vocabulary-parallel
(``--lm-head vocab-parallel``), each rank computes its vocabulary columns of those rows and the plan's
trtopt.AllGather hands every rank the full rows. Either way rank 0's executor returns the full-vocabulary rows the
driver samples from.

A worker that dies (crash, OOM kill) ends the engine: a monitor thread watches the worker processes, and the
driver's next (or current) collective fails, at the latest after ``timeout_s``; ``execute`` then raises
WorkerDiedError naming the rank and its exit code, and every later call raises it at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trtopt.builder.plan import rank_dir, read_plan
from trtopt.errors import ConfigError, WorkerDiedError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.cuda_graphs import CaptureReport, StepGraphs
from trtopt.runtime.executors.shm_broadcast import ShmBroadcast
from trtopt.runtime.executors.torch_executor import TorchExecutor

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer than this on a silent peer fails


@dataclasses.dataclass(frozen=True)
class _Command:
    """What the driver broadcasts once per call; workers mirror it on their own rank."""

    op: str  # "alloc" | "capture" | "step" | "copy" | "graphs" | "stop"
    arg: Any = None


def backend_for(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r owns cuda:r (one process per GPU); CPU ranks share the host."""
    return f"cuda:{rank}" if str(device).startswith("cuda") else "cpu"


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the host's cores: more intra-op threads than cores/size makes OpenMP spin against the
    other ranks (measured: 7x slower steps with the default on 2 cores)."""
    return max(1, (os.cpu_count() or 1) // size)


def _to_wire(command: _Command) -> tuple[str, Any]:
    """A step's tensors travel as numpy arrays (pickled in-band, ~10x cheaper than torch tensors' reduction)."""
    if command.op == "step":
        fields = {f.name: getattr(command.arg, f.name) for f in dataclasses.fields(StepInputs)}
        return command.op, {name: None if value is None else value.numpy() for name, value in fields.items()}
    return command.op, command.arg


def _from_wire(message: tuple[str, Any]) -> _Command:
    op, arg = message
    if op == "step":
        arg = StepInputs(**{name: None if array is None else torch.from_numpy(array) for name, array in arg.items()})
    return _Command(op, arg)


def _init_group(rank: int, size: int, device: str, timeout_s: float, store: Any = None) -> None:
    """Join the default group (the torchrun env vars, or the driver's store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    if store is None:  # a worker: the driver (rank 0) hosts the store at MASTER_ADDR:MASTER_PORT
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def worker_main(plan_dir: str, device: str, cuda_graphs: bool, timeout_s: float, channel: str) -> None:
    """A worker rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment, as torchrun sets them):
    join the group, load its rank's plan, mirror the driver's commands until "stop"."""
    # Ctrl-C reaches the terminal's whole process group: the driver decides when workers stop ("stop", or its
    # death, which fails the next collective here), so a worker must not die of it mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not str(device).startswith("cuda"):
        torch.set_num_threads(cpu_threads_per_rank(size))
    _init_group(rank, size, device, timeout_s)
    messages = ShmBroadcast.attach(channel, num_readers=size - 1, reader=rank - 1)
    driver = os.getppid()

    def driver_alive() -> None:  # a driver killed without "stop" re-parents us: leave instead of waiting forever
        if os.getppid() != driver:
            raise SystemExit(f"tensor-parallel rank {rank}: the driver (pid {driver}) is gone")
    if str(device).startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    path = rank_dir(plan_dir, rank)
    executor = TorchExecutor(path, read_plan(path), device=rank_device(device, rank), cuda_graphs=cuda_graphs)
    while True:
        command = _from_wire(messages.receive(alive=driver_alive))
        if command.op == "stop":
            break
        _apply(executor, command)
    _release_graphs(executor)
    messages.close()
    dist.destroy_process_group()


def _apply(executor: Executor, command: _Command) -> torch.Tensor | None:
    if command.op == "step":
        return executor.execute(command.arg)
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
    here; its graphs are this executor's, its greedy tokens and placeholders are not read through it (the defaults)."""

    def __init__(self, plan_dir: str | Path, size: int, *, device: str = "cpu", cuda_graphs: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if dist.is_initialized():
            raise ConfigError("this process already belongs to a torch.distributed group; run one tensor-parallel "
                              "engine per process (shut the other down first).")
        if str(device).startswith("cuda") and torch.cuda.device_count() < size:
            raise ConfigError(f"tensor_parallel_size={size} needs {size} GPUs; torch sees {torch.cuda.device_count()}.")
        self.size = size
        self._device = str(device)
        self.device = torch.device(rank_device(self._device, 0))  # rank 0's, like a single-device executor's
        self._threads = torch.get_num_threads()  # restored by shutdown()
        if not self._device.startswith("cuda"):
            torch.set_num_threads(cpu_threads_per_rank(size))  # rank 0 runs in this process
        self._error: WorkerDiedError | None = None
        self._closed = False
        self._local: TorchExecutor | None = None  # rank 0's, once the group is up
        self._channel = ShmBroadcast.create(num_readers=size - 1)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # Port 0: the store picks a free port, so concurrent engines on one host never collide.
        store = dist.TCPStore(addr, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        # Fresh interpreters (`python -m trtopt.runtime.executors.tensor_parallel`), not multiprocessing: nothing of
        # the caller's __main__ is re-imported, and a worker is exactly what torchrun would start.
        self._workers: list[subprocess.Popen] = []
        for rank in range(1, size):
            env = {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(store.port), "RANK": str(rank),
                   "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size)}
            args = [sys.executable, "-m", "trtopt.runtime.executors.tensor_parallel", str(plan_dir),
                    "--device", str(device), "--timeout", str(timeout_s), "--channel", str(self._channel.path)]
            args += ["--cuda-graphs"] if cuda_graphs else []
            self._workers.append(subprocess.Popen(args, env=env))
        self._monitor = threading.Thread(target=self._watch, name="trtopt-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            _init_group(0, size, device, timeout_s, store=store)
            self._store = store
            path = rank_dir(plan_dir, 0)
            if str(device).startswith("cuda"):
                torch.cuda.set_device(0)
            self.plan = read_plan(path)
            self._local = TorchExecutor(path, self.plan, device=rank_device(device, 0), cuda_graphs=cuda_graphs)
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
        if self._error is None and dist.is_initialized() and all(p.poll() is None for p in self._workers):
            try:
                self._channel.publish(_to_wire(_Command("stop")), alive=self._check_workers)
                stopped = True
            except Exception:  # a worker died in between: it is terminated below
                log.warning("tensor-parallel stop message failed; terminating the workers")
        _release_graphs(self._local)
        if dist.is_initialized():
            if stopped:
                # Leaving a NCCL group is a handshake: the workers destroy theirs right after "stop", so the driver
                # must do the same now, not after waiting for them to exit (the first H200x2 run hung exactly so).
                if not _destroy_group(timeout_s=30.0):
                    log.warning("tensor-parallel group did not close within 30 s; terminating the workers")
            else:
                _abort_group()
        for proc in self._workers:
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
            return _apply(self._local, command)
        except Exception as e:
            # The collective failed: a worker is gone (or going). Give the monitor a moment to see which.
            for proc in self._workers:
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
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
        return None


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
    parser.add_argument("--channel", required=True, help="the driver's shared-memory channel (shm_broadcast.py)")
    args = parser.parse_args()
    worker_main(args.plan_dir, args.device, args.cuda_graphs, args.timeout, args.channel)


if __name__ == "__main__":
    _main()
