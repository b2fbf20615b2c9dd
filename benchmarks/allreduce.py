"""All-reduce paths of the tensor-parallel step (docs/architecture.md §7b, "All-reduce paths"), same run, same GPUs.

For N ranks (one process per GPU, torch.multiprocessing, NCCL group) and [tokens, hidden] bf16 messages (tokens 1, 8,
64, 256, 2048; hidden 4096 and 8192), the µs per call of:

- ``nccl``: ``dist.all_reduce`` in place, tp_e2e.py's ``all_reduce_alone`` convention (the ~14 µs baseline);
- ``nccl_op``: the op's NCCL face as the step runs it (reference.py: a clone, then ``dist.all_reduce``);
- ``one_shot`` / ``two_shot``: the peer-to-peer kernels (plugins/all_reduce/p2p.py) at every size, on one symmetric
  buffer sized for the largest message;
- ``auto``: what the op does with the default limits (p2p.default_limits(N)): one-shot, two-shot or ``nccl_op``,

each eagerly (``--eager-calls`` calls between two events) and from a CUDA graph (``--calls`` calls captured in one
graph, replayed ``--replays`` times, divided). Every path's sum is checked against the exact (float64) sum and NCCL's:
within bf16 rounding, and whether it equals NCCL's bits. Writes docs/benchmarks/allreduce_<gpu>.json and a .png
(µs per graphed call against message size, one panel per N and hidden), with the GPU, torch and NCCL versions and
the multicast settings (NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

    python3 benchmarks/allreduce.py                       # N = 2 and 4 (those the machine has), ~1 min each
    python3 benchmarks/allreduce.py --ranks 2 --hidden 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DOCS = ROOT / "docs" / "benchmarks"
METHODS = ("nccl", "nccl_op", "one_shot", "two_shot", "auto")


def log(message: str) -> None:
    print(f"[allreduce {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _methods(comm, size: int):
    """name -> fn(x) returning the sum (a new tensor, or x itself for the in-place NCCL call)."""
    import torch.distributed as dist

    from trtopt.plugins.all_reduce import p2p
    from trtopt.plugins.all_reduce.reference import all_reduce_ref

    limits = p2p.default_limits(size)

    def nccl(x):
        dist.all_reduce(x)
        return x

    def nccl_op(x):
        return all_reduce_ref(x, world_size=size)

    def auto(x):  # the op's choice with the production limits (this comm's buffer is larger)
        path = p2p.choose_algorithm(x.numel() * x.element_size(), x.dtype, limits)
        return comm.one_shot(x) if path == "one_shot" else comm.two_shot(x) if path == "two_shot" else nccl_op(x)

    return {"nccl": nccl, "nccl_op": nccl_op, "one_shot": comm.one_shot, "two_shot": comm.two_shot, "auto": auto}


def _check(fn, x, size: int) -> dict:
    """fn's sum of x against the exact one and NCCL's (x is left unchanged)."""
    import torch.distributed as dist

    nccl = x.clone()
    dist.all_reduce(nccl)
    exact, bound = x.double(), x.double().abs()
    dist.all_reduce(exact)
    dist.all_reduce(bound)
    y = fn(x.clone())
    tol = size * torch.finfo(x.dtype).eps * bound + 1e-30
    ratio = float(((y.double() - exact).abs() / tol).max())
    return {"err_over_bf16_bound": ratio, "within_bf16_rounding": ratio <= 1.0, "equal_to_nccl": torch.equal(y, nccl)}


def _time_eager(fn, x, calls: int) -> float:
    import torch.distributed as dist

    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def _time_graph(fn, x, calls: int, replays: int) -> float:
    import torch.distributed as dist

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / (replays * calls) * 1e3


def _rank(rank: int, size: int, port: int, args: dict, out) -> None:
    import torch.distributed as dist

    from trtopt.plugins.all_reduce import p2p

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=device)
    try:
        largest = max(args["tokens"]) * max(args["hidden"]) * 2
        comm = p2p.P2PAllReduce.create(dist.group.WORLD.group_name, device,
                                       p2p.P2PLimits(one_shot_max_bytes=largest, max_bytes=largest))
        assert comm.agrees_with_sum(), "the P2P start-up sum is wrong"
        methods = _methods(comm, size)
        limits = p2p.default_limits(size)
        gen = torch.Generator(device=device).manual_seed(rank)
        result: dict = {"limits": {"one_shot_max_bytes": limits.one_shot_max_bytes, "max_bytes": limits.max_bytes}}
        for hidden in args["hidden"]:
            for tokens in args["tokens"]:
                x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, generator=gen)
                nbytes = x.numel() * x.element_size()
                entry = {"bytes": nbytes, "auto_path": p2p.choose_algorithm(nbytes, x.dtype, limits),
                         "check": {}, "eager_us": {}, "graph_us": {}}
                for name, fn in methods.items():
                    if name != "nccl":  # in place: its sum of a sum is not checkable against one NCCL call
                        entry["check"][name] = _check(fn, x, size)
                    entry["eager_us"][name] = _time_eager(fn, x.clone(), args["eager_calls"])
                    entry["graph_us"][name] = _time_graph(fn, x.clone(), args["calls"], args["replays"])
                result.setdefault(f"hidden={hidden}", {})[f"tokens={tokens}"] = entry
                if rank == 0:
                    timings = ", ".join(f"{k} {v:.1f}" for k, v in entry["graph_us"].items())
                    log(f"N={size} [{tokens}, {hidden}] ({nbytes // 1024} KiB, auto: {entry['auto_path']}) "
                        f"graphed µs: {timings}")
        comm.close()
        if rank == 0:
            out.put(result)
    except Exception as e:
        if rank == 0:
            out.put({"error": repr(e)})
        raise
    finally:
        dist.destroy_process_group()


def run_size(size: int, args: dict) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, args, out)) for r in range(size)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=300)
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return result


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, h) for n, run in data["runs"].items() if "error" not in run
              for h in run if h.startswith("hidden=")]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (n, h) in zip(axes[0], panels):
        entries = list(data["runs"][n][h].values())
        sizes = [e["bytes"] / 1024 for e in entries]
        for method in METHODS:
            line, = ax.plot(sizes, [e["graph_us"][method] for e in entries], marker="o", label=f"{method} (graph)")
            ax.plot(sizes, [e["eager_us"][method] for e in entries], linestyle=":", color=line.get_color(),
                    alpha=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message KiB per rank (bf16)")
        ax.set_ylabel("µs per call (dotted: eager)")
        ax.set_title(f"{n}, {h}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"all-reduce paths, {data['gpu']}, torch {data['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4], help="group sizes N (those with enough GPUs)")
    ap.add_argument("--hidden", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 256, 2048])
    ap.add_argument("--calls", type=int, default=100, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--eager-calls", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default docs/benchmarks/allreduce_<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("allreduce.py needs CUDA GPUs of one host")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, for NCCL and symmetric memory alike
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    gpu = torch.cuda.get_device_name(0)
    sizes = [n for n in args.ranks if n <= torch.cuda.device_count()]
    skipped = sorted(set(args.ranks) - set(sizes))
    if skipped:
        log(f"skipping N={skipped}: {torch.cuda.device_count()} GPUs")
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
            "num_gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "nccl": _nccl_version(),
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
            "dtype": "bfloat16", "calls_per_graph": args.calls, "replays": args.replays,
            "eager_calls": args.eager_calls, "runs": {}}
    started = time.perf_counter()
    settings = {"hidden": args.hidden, "tokens": args.tokens, "calls": args.calls, "replays": args.replays,
                "eager_calls": args.eager_calls}
    for size in sizes:
        t = time.perf_counter()
        data["runs"][f"N={size}"] = run_size(size, settings)
        log(f"N={size} done in {time.perf_counter() - t:.0f} s")
    data["seconds"] = time.perf_counter() - started
    slug = gpu.lower().replace("nvidia ", "").split()[0]
    out = args.out or DOCS / f"allreduce_{slug}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out.with_suffix(".png"))
    log(f"wrote {out} and {out.with_suffix('.png')} ({data['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
