"""AllReduce's peer-to-peer fast path (plugins/all_reduce/p2p.py).

CPU: which message takes which path (size thresholds, dtypes, alignment) and why a rank cannot take it at all (no
CUDA, one rank, several hosts, a world size without kernels, no peer access, no symmetric-memory API).

multigpu (`pytest -m multigpu tests/plugins/test_all_reduce_p2p.py`, 2 and 4 GPUs of one host): one-shot, two-shot
and the auto choice against NCCL's sum at decode-to-prefill sizes in bf16 and fp32 (within bf16 rounding; fp32 at
two ranks bit for bit), the same bits on every rank, and the same sums replayed from a CUDA graph on new data.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

from trtopt.plugins.all_reduce import p2p
from trtopt.plugins.all_reduce.p2p import KiB, MiB, P2PLimits, choose_algorithm

CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("world_size, nbytes, dtype, want", [
    (2, 1 * 4096 * 2, torch.bfloat16, "one_shot"),  # one decode token, hidden 4096
    (2, 64 * 4096 * 2, torch.bfloat16, "one_shot"),  # 512 KiB: the one-shot limit itself
    (2, 64 * 4096 * 2 + 4, torch.bfloat16, "two_shot"),
    (8, 256 * KiB, torch.float32, "one_shot"),
    (8, 256 * KiB + 4, torch.float32, "two_shot"),  # 8 ranks: one-shot reads 8 messages, so it stops earlier
    (4, 8 * MiB, torch.bfloat16, "two_shot"),  # the buffer's size
    (4, 8 * MiB + 4, torch.bfloat16, "nccl"),
    (2, 8 * KiB, torch.float16, "nccl"),  # the kernels take bf16 and fp32 only
    (2, 0, torch.bfloat16, "nccl"),
    (2, 6, torch.bfloat16, "nccl"),  # 3 bf16 values: not a multiple of the kernels' 4-byte access
])
def test_choose_algorithm(world_size, nbytes, dtype, want):
    assert choose_algorithm(nbytes, dtype, p2p.default_limits(world_size)) == want


def test_limits_are_checked():
    assert choose_algorithm(64, torch.float32, P2PLimits(one_shot_max_bytes=32, max_bytes=128)) == "two_shot"
    with pytest.raises(AssertionError):
        P2PLimits(one_shot_max_bytes=256, max_bytes=128)


def test_unavailable_reason(monkeypatch):
    ok = dict(api_missing=lambda: None)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert p2p.unavailable_reason(torch.device("cpu"), world_size=2, local_world_size=2, **ok) == \
        "the device is cpu, not CUDA"
    assert "one rank" in p2p.unavailable_reason(CUDA0, world_size=1, local_world_size=1, **ok)
    assert "spans hosts (2 of its 4 ranks" in p2p.unavailable_reason(CUDA0, world_size=4, local_world_size=2, **ok)
    assert "world size 6 is not one of (2, 4, 8)" in p2p.unavailable_reason(CUDA0, world_size=6, local_world_size=6,
                                                                            **ok)
    for size in (2, 4, 8):
        assert p2p.unavailable_reason(CUDA0, world_size=size, local_world_size=size, **ok) is None
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: b != 3)  # cuda:3 behind PCIe
    assert "cuda:0 cannot access the memory of cuda:[3]" in p2p.unavailable_reason(
        CUDA0, world_size=4, local_world_size=4, **ok)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert p2p.unavailable_reason(CUDA0, world_size=2, local_world_size=2, api_missing=lambda: "no api") == "no api"


def test_symm_mem_api_found_by_feature(monkeypatch):
    assert p2p.symm_mem_missing() is None  # this torch has the module and the ops' schemas (CPU builds too)
    monkeypatch.setattr(p2p, "_has_op", lambda name: name != "one_shot_all_reduce_copy_out")
    assert p2p.symm_mem_missing() is None  # the plain one-shot is enough (the copy then runs as its own kernel)
    monkeypatch.setattr(p2p, "_has_op", lambda name: False)
    reason = p2p.symm_mem_missing()
    assert "torch.ops.symm_mem.one_shot_all_reduce_out" in reason and "two_shot_all_reduce_" in reason


# ---- on GPUs -------------------------------------------------------------------------------------------------------

SHAPES = [(1, 4096), (8, 4096), (64, 4096), (65, 4096), (256, 4096), (1, 2048), (3, 1000), (1024, 4096)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_rank(rank: int, size: int, port: int, out) -> None:
    """One rank: every path against NCCL, eagerly and from a CUDA graph; puts its failures (strings) on ``out``."""
    import torch.distributed as dist

    from trtopt.runtime.executors.all_reduce import setup_all_reduce

    failures: list[str] = []
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=size, device_id=device)
        comm = setup_all_reduce(device, local_world_size=size, mode="p2p")  # p2p: fail here, not fall back
        paths = {"one_shot": comm.one_shot, "two_shot": comm.two_shot,
                 "auto": lambda t: p2p.all_reduce(t, world_size=size, comm=comm)}
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        for dtype in (torch.bfloat16, torch.float32):
            for shape in SHAPES:
                x = torch.randn(shape, dtype=dtype, device=device, generator=gen)
                nccl = x.clone()
                dist.all_reduce(nccl)
                exact = x.double()
                dist.all_reduce(exact)
                bound = x.double().abs()
                dist.all_reduce(bound)
                for name, fn in paths.items():
                    if name != "auto" and x.numel() * x.element_size() > comm.limits.max_bytes:
                        continue  # larger than the buffer: only auto takes it (to NCCL)
                    y = fn(x)
                    failures += _compare(f"{name} {dtype} {shape}", y, nccl, exact, bound, size)
                    every = [torch.empty_like(y) for _ in range(size)]
                    dist.all_gather(every, y)
                    if not all(torch.equal(every[0], other) for other in every):
                        failures.append(f"{name} {dtype} {shape}: ranks hold different sums")
        failures += _check_graph(comm, paths, size, device, gen)
        comm.close()
        dist.destroy_process_group()
    except Exception:
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    out.put((rank, failures))


def _compare(label, y, nccl, exact, bound, size) -> list[str]:
    """y within the rounding of its dtype from the exact sum, as NCCL is; fp32 at two ranks: NCCL's bits."""
    if y.shape != nccl.shape or y.dtype != nccl.dtype:
        return [f"{label}: {tuple(y.shape)} {y.dtype}"]
    eps = torch.finfo(y.dtype).eps
    tol = size * eps * bound + 1e-30  # (size - 1) roundings of partial sums, plus the output's
    worst = float(((y.double() - exact).abs() / tol).max())
    nccl_worst = float(((nccl.double() - exact).abs() / tol).max())
    if worst > 1.0:
        return [f"{label}: off the exact sum by {worst:.3g} x the rounding bound (NCCL: {nccl_worst:.3g})"]
    if y.dtype == torch.float32 and size == 2 and not torch.equal(y, nccl):
        return [f"{label}: fp32 sum of two ranks differs from NCCL's"]
    return []


def _check_graph(comm, paths, size, device, gen) -> list[str]:
    """Ten calls of each path captured in one graph, replayed on new data: the sums of the new data."""
    import torch.distributed as dist

    failures = []
    for shape in ((1, 4096), (256, 4096)):
        x = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for fn in paths.values():
                fn(x)  # warm-up outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = {name: [fn(x) for _ in range(10)] for name, fn in paths.items()}
        for _ in range(3):
            x.copy_(torch.randn(shape, dtype=x.dtype, device=device, generator=gen))
            graph.replay()
            nccl = x.clone()
            dist.all_reduce(nccl)
            exact, bound = x.double(), x.double().abs()
            dist.all_reduce(exact)
            dist.all_reduce(bound)
            for name, ys in outs.items():
                for y in (ys[0], ys[-1]):
                    failures += _compare(f"graphed {name} {shape}", y, nccl, exact, bound, size)
        del graph
    return failures


@pytest.mark.multigpu
@pytest.mark.parametrize("size", [2, 4])
def test_p2p_sums_equal_nccl_eager_and_graphed(size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} CUDA GPUs of one host")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_check_rank, args=(r, size, port, out)) for r in range(size)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    failures = [f for rank in sorted(results) for f in results[rank]]
    assert not failures, "\n".join(failures[:20])
