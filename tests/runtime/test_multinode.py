"""Tensor parallelism over two "nodes" on CPU (gloo): two process trees on this machine that share nothing but the
TCP address of node 0 (docs/architecture.md §7b).

Node 1 is a separate process tree (`trtopt serve PLAN --nnodes 2 --node-rank 1 ...`, or LLM(..., node_rank=1) in a
fresh interpreter) whose rank reads the driver's messages over TCP, not shared memory; the driver runs in this
process as node 0. At TP = 2 with one rank per node, greedy tokens on tiny Llama equal the single-rank engine's
(fp32); node 1 exits 0 when the driver shuts down; a killed node 1 ends the engine with WorkerDiedError within
seconds (its connection closes), a frozen one (SIGSTOP: a host that stops answering) after the timeout; bad launch
flags fail with one line on the side that has them, and node 0 learns of a node refusing the launch at once.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits
from trtopt.errors import ConfigError, WorkerDiedError
from trtopt.runtime.config import NodeConfig
from trtopt.runtime.executors.control_plane import PeerGone, TcpBroadcast, TcpReader
from trtopt.runtime.executors.tensor_parallel import TensorParallelExecutor
from trtopt.runtime.llm import LLM
from trtopt.runtime.sampling_params import SamplingParams

LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=128)
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ADDR = "127.0.0.1"


@pytest.fixture(scope="module")
def tp_plan(export_dir, module_tmp):
    return build_plan(export_dir("tiny-llama"), module_tmp / "tp2", limits=LIMITS, force=True, progress=False,
                      tensor_parallel=2).plan_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return s.getsockname()[1]


def start_node1(plan, port: int, *, via: str = "cli", device: str = "cpu") -> subprocess.Popen:
    """Node 1 as its own process tree (a new session: its own process group, killed as a whole like a host)."""
    flags = ["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", ADDR, "--master-port", str(port)]
    env = None
    if via == "cli":
        args = [sys.executable, "-m", "trtopt.cli.main", "serve", str(plan), *flags, "--device", device]
        path = [str(no_server_packages()), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    else:
        args = [sys.executable, "-c", "from trtopt import LLM; llm = LLM(%r, tensor_parallel_size=2, nnodes=2, "
                "node_rank=1, master_addr=%r, master_port=%d); assert not llm.is_driver" % (str(plan), ADDR, port)]
    return subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


@functools.cache
def no_server_packages() -> Path:
    """A folder whose uvicorn and fastapi fail to import: put first on node 1's path, a worker host without the
    server's packages (the GPU image has none: node 1 died there at `import uvicorn`)."""
    folder = Path(tempfile.mkdtemp(prefix="no-server-"))
    for name in ("uvicorn", "fastapi"):
        (folder / f"{name}.py").write_text(f"raise ImportError('a worker node must not import {name}')\n")
    return folder


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=30)


def driver(plan, port: int) -> LLM:
    return LLM(plan, tensor_parallel_size=2, nnodes=2, master_addr=ADDR, master_port=port)


def greedy_tokens_one_rank(engine) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


def test_tcp_channel_delivers_in_order_and_each_side_sees_the_other_leave():
    """The network path alone, in one process: every message in order (sizes that split across TCP reads), a
    reader that leaves is reported lost by rank, and a reader whose driver leaves gets PeerGone."""
    writer = TcpBroadcast([1, 2], timeout_s=30)
    readers: dict[int, TcpReader] = {}
    connect = [threading.Thread(target=lambda r=r: readers.__setitem__(
        r, TcpReader.connect(ADDR, writer.port, r, timeout_s=30))) for r in (1, 2)]
    for t in connect:
        t.start()
    writer.accept(timeout_s=30)
    for t in connect:
        t.join()
    assert set(writer.peers) == {1, 2} and writer.lost() is None
    sent = [("step", np.arange(n, dtype=np.int64)) for n in (1000, 3, 300_000, 0, 7)] * 3
    got: dict[int, list] = {1: [], 2: []}
    reading = [threading.Thread(target=lambda r=r: got[r].extend(readers[r].receive() for _ in sent)) for r in (1, 2)]
    for t in reading:
        t.start()
    for message in sent:
        writer.publish(pickle.dumps(message))
    for t in reading:
        t.join(timeout=30)
    for r in (1, 2):
        assert len(got[r]) == len(sent)
        for (op, ids), (got_op, got_ids) in zip(sent, got[r]):
            assert got_op == op and np.array_equal(got_ids, ids)
    readers[2].close()
    deadline = time.monotonic() + 10
    while writer.lost() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.lost() == (2, "closed its control connection (its process or host is gone)")
    writer.close()
    with pytest.raises(PeerGone, match="closed the connection"):
        readers[1].receive()
    readers[1].close()


def test_two_nodes_greedy_equals_one_rank_and_node1_exits_0(tp_plan, engine_for):
    port = free_port()
    node1 = start_node1(tp_plan, port)
    try:
        with driver(tp_plan, port) as llm:
            executor = llm.engine.executor
            assert executor._workers == [] and executor._remote is not None  # rank 1 is node 1's, over TCP
            got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert not dist.is_initialized()
        _, err = node1.communicate(timeout=60)
        assert node1.returncode == 0, err
        assert "the driver stopped the group" in err
    finally:
        kill_tree(node1)
    assert got == greedy_tokens_one_rank(engine_for("tiny-llama", max_model_len=128))


def test_killed_remote_node_ends_the_engine_in_bounded_time(tp_plan):
    port = free_port()
    node1 = start_node1(tp_plan, port, via="llm")
    llm = driver(tp_plan, port)
    killed_at: list[float] = []

    def kill_after_three_tokens(out):
        if not killed_at and len(out.outputs[0].token_ids) == 3:
            os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its LLM process and its rank
            killed_at.append(time.monotonic())

    try:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 on node 1 \(127\.0\.0\.1\) (closed|broke)"):
            llm.generate("Hello", params, on_output=kill_after_three_tokens)
        assert time.monotonic() - killed_at[0] < 15
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(WorkerDiedError):  # the engine stays stopped
            llm.generate("Hello", GREEDY)
        assert not dist.is_initialized()
    finally:
        llm.shutdown()
        kill_tree(node1)


def test_silent_remote_node_is_declared_dead_after_the_timeout(tp_plan):
    """A frozen node (SIGSTOP: like a host that lost power or its network) closes no connection: the driver gives
    up after timeout_s without a heartbeat."""
    port = free_port()
    node1 = start_node1(tp_plan, port)
    executor = TensorParallelExecutor(tp_plan, 2, nnodes=2, master_addr=ADDR, master_port=port, timeout_s=4.0)
    try:
        executor.allocate_kv_cache(16)
        os.killpg(node1.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline = stopped_at + 20
        while executor._error is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 3.5 < time.monotonic() - stopped_at < 15
        with pytest.raises(WorkerDiedError, match="rank 1 on node 1 .* sent no heartbeat"):
            executor.allocate_kv_cache(16)
    finally:
        executor.shutdown()
        kill_tree(node1)
    assert not dist.is_initialized()


def test_bad_launch_flags_fail_with_one_line(tp_plan):
    with pytest.raises(ConfigError, match="needs master_addr"):
        NodeConfig(nnodes=2)
    with pytest.raises(ConfigError, match=r"node_rank=2 must be in \[0, 1\]"):
        NodeConfig(nnodes=2, node_rank=2, master_addr=ADDR, master_port=29500)
    with pytest.raises(ConfigError, match="needs master_port"):
        NodeConfig(nnodes=2, master_addr=ADDR)
    with pytest.raises(ConfigError, match="does not split evenly over nnodes=4"):
        LLM(tp_plan, nnodes=4, master_addr=ADDR, master_port=free_port())
    with socket.socket() as taken:  # node 0 cannot host the store on a port in use
        taken.bind(("", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="pick a free --master-port"):
            driver(tp_plan, taken.getsockname()[1])
    assert not dist.is_initialized()
    cli = subprocess.run([sys.executable, "-m", "trtopt.cli.main", "serve", str(tp_plan), "--nnodes", "2",
                          "--node-rank", "1"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1
    assert cli.stderr.strip().splitlines() == [
        "error: ConfigError: nnodes=2 needs master_addr (--master-addr): node 0's address, reachable from every node."]


def test_a_node_started_with_other_flags_fails_both_sides_at_once(tp_plan):
    """Node 1 asks for CUDA while node 0 runs on the CPU: node 1 refuses (one line, exit 1) and node 0's start
    fails with the same reason instead of waiting for a rank that will never come."""
    port = free_port()
    node1 = start_node1(tp_plan, port, device="cuda")
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError, match="node 1: this node was started with device='cuda'"):
            driver(tp_plan, port)
        assert time.monotonic() - started < 60
        _, err = node1.communicate(timeout=60)
        assert node1.returncode == 1
        assert "ConfigError: this node was started with device='cuda' but the driver" in err
    finally:
        kill_tree(node1)
    assert not dist.is_initialized()
