"""Per-rank host timeline of tensor-parallel decode steps: when each rank's host reaches each phase of a step.

One clock for every process of the host (time.perf_counter_ns: CLOCK_MONOTONIC), so a worker's phase is an offset
from rank 0's. Runs one batch-1 greedy request of --tokens tokens through LLMEngine at tensor_parallel_size=N with
async scheduling (CPU: gloo, the tiny shape of tp_e2e.py unless --plan-dir; CUDA: NCCL, graphs on) and times, on
every rank, without changing the runtime (the probe wraps runtime functions: in this process directly, in the
workers through a sitecustomize.py on their PYTHONPATH, as tp_e2e.py's timeline does):

  rank 0   enter      TensorParallelExecutor._run entered (the engine's execute)
           encoded    the channel's publish entered (the step encoded for the wire: _to_wire)
           pickled    the shared-memory write entered (pickled; it waits for the workers' acks of the last one)
           published  the channel's publish returned (written: the workers may read it)
  worker   wait       its receive() entered (it finished the previous command)
           seen       its wait saw the message
           received   unpickled
           decoded    a StepInputs again (_from_wire)
  every    shared     async scheduling's sampled ids broadcast queued (the step's first collective)
           execute    TorchExecutor.execute entered (what tp_e2e.py's timeline calls the host launch)
           fill       CUDA graphs: StepGraphs._fill entered,
           synced     the previous step's input copy waited for (`_copied.synchronize()`),
           packed     the step packed into the pinned buffer and its copy queued
           launched   execute returned (CUDA: the replay queued; CPU: the step done)

Reported per rank: the median and p90 of every phase as an offset from rank 0's `published` of the same step, and
of the time between consecutive phases; `decode_tok_s` (wall clock of the timed steps). Steps are matched by their
order (every rank mirrors the same commands); the first --skip steps of the request (its prefill) are dropped.

--variants spin,sleep: the same run twice on one machine: "spin" as the runtime is, "sleep" with the pre-#31 wait
and ids path on the workers (the reader's spin_s set back to the channel's default, so it waits in timer sleeps
after 50 µs; the sampled ids received into a fresh buffer and copied by _fill). The pre-#31 wire format (the step's
fields pickled as numpy arrays) cannot be switched without rebinding the runtime's module functions: `codec` in the
JSON times both formats' encode and decode on this host instead. On 2 shared CPU cores the absolute numbers are
noise (and CPU workers keep the default spin either way); compare phases.

    PYTHONPATH=$PWD python3 benchmarks/tp_host_timeline.py --device cpu --tokens 48            # CPU, tiny plan
    PYTHONPATH=$PWD python3 benchmarks/tp_host_timeline.py --device cuda --plan-dir /tmp/tpw/8b-L4/plan_tp2 \\
        --variants sleep,spin --out docs/benchmarks/tp_host_timeline_h200.json
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DIR_ENV, VARIANT_ENV = "TP_HOST_TIMELINE", "TP_HOST_TIMELINE_VARIANT"
RANK0_PHASES = ("enter", "encoded", "pickled", "published")
WORKER_PHASES = ("wait", "seen", "received", "decoded")
COMMON_PHASES = ("shared", "execute", "fill", "synced", "packed", "launched")
SITECUSTOMIZE = f'''"""Written by benchmarks/tp_host_timeline.py: a tensor-parallel worker records its host timeline
when {DIR_ENV} is set; any other process is left alone."""
import os
if os.environ.get("{DIR_ENV}") and os.environ.get("RANK"):
    import sys
    sys.path.insert(0, {str(ROOT / "benchmarks")!r})
    import tp_host_timeline
    tp_host_timeline.Probe.install(int(os.environ["RANK"]), os.environ["{DIR_ENV}"],
                                   os.environ.get("{VARIANT_ENV}", "spin"))
'''


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the pre-#31 wire format, timed beside the current one (codec_timings) --------------------------------------

def _legacy_to_wire(step: Any) -> tuple[str, Any]:
    """A step as the driver sent it before #31: its fields as numpy arrays, pickled."""
    from trtopt.runtime.batch import StepInputs

    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(StepInputs) if f.name != "sampled_ids"}
    wire = {name: None if value is None else value.numpy() for name, value in fields.items()}
    wire["sampled_ids"] = None if step.sampled_ids is None else int(step.sampled_ids.numel())
    return "step", wire


def _legacy_from_wire(message: tuple[str, Any]) -> Any:
    import torch

    from trtopt.runtime.batch import StepInputs

    arg = dict(message[1])
    count = arg.pop("sampled_ids")
    return StepInputs(**{name: None if array is None else torch.from_numpy(array) for name, array in arg.items()},
                      sampled_ids=None if count is None else torch.empty(count, dtype=torch.int64))


def codec_timings(calls: int = 2000) -> dict:
    """µs per call on this host of a batch-1 decode step's encode + pickle (the driver, before its publish) and
    unpickle + decode (a worker, after it): the current wire format and the pre-#31 one."""
    import pickle

    import torch

    from trtopt.runtime.batch import StepInputs
    from trtopt.runtime.executors.tensor_parallel import _Command, _from_wire, _to_wire

    int32 = torch.int32
    step = StepInputs(input_ids=torch.tensor([[-1]]), position_ids=torch.tensor([[200]]),
                      block_tables=torch.arange(1, 14, dtype=int32)[None], seq_lens=torch.tensor([201], dtype=int32),
                      query_start_loc=torch.tensor([0, 1], dtype=int32), slot_mapping=torch.tensor([3200]),
                      logits_indices=torch.tensor([0]), sampled_ids=torch.tensor([5]))
    command = _Command("step", step)

    def timed(fn: Callable[[], Any]) -> float:
        for _ in range(calls // 10):
            fn()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        return round((time.perf_counter_ns() - start) / calls / 1e3, 2)

    current = pickle.dumps(_to_wire(command), protocol=pickle.HIGHEST_PROTOCOL)
    legacy = pickle.dumps(_legacy_to_wire(step), protocol=pickle.HIGHEST_PROTOCOL)
    return {
        "current": {"bytes": len(current),
                    "encode_us": timed(lambda: pickle.dumps(_to_wire(command), protocol=pickle.HIGHEST_PROTOCOL)),
                    "decode_us": timed(lambda: _from_wire(pickle.loads(current)))},
        "pre_31": {"bytes": len(legacy),
                   "encode_us": timed(lambda: pickle.dumps(_legacy_to_wire(step), protocol=pickle.HIGHEST_PROTOCOL)),
                   "decode_us": timed(lambda: _legacy_from_wire(pickle.loads(legacy)))},
    }


# ---- the probe (rank 0 in this process, the workers through sitecustomize.py) ----------------------------------

class Probe:
    """This process's phase stamps, one dict per step command (in order); workers write <dir>/rank{r}.json at exit.
    It wraps methods of the runtime's classes (and torch.distributed.broadcast), never a trtopt module's globals."""

    def __init__(self, rank: int, directory: Path):
        self.rank, self.directory = rank, directory
        self.steps: list[dict[str, int]] = []
        self.current: dict[str, int] | None = None  # the step being run

    def mark(self, phase: str, *, first: bool = False) -> None:
        if self.current is not None and not (first and phase in self.current):
            self.current[phase] = time.perf_counter_ns()

    @classmethod
    def install(cls, rank: int, directory: str | Path, variant: str) -> Probe:
        import torch.distributed as dist

        from trtopt.runtime.batch import StepInputs
        from trtopt.runtime.executors import shm_broadcast
        from trtopt.runtime.executors.cuda_graphs import StepGraphs
        from trtopt.runtime.executors.shm_broadcast import ShmBroadcast
        from trtopt.runtime.executors.torch_executor import TorchExecutor

        probe = cls(rank, Path(directory))
        if variant == "sleep":  # the pre-#31 ids path: received into a fresh buffer, copied by _fill
            StepGraphs.sampled_ids_buffer = lambda self, count: None

        def around(fn: Callable, before: str | None, after: str | None) -> Callable:
            def wrapped(*args, **kwargs):
                if before:
                    probe.mark(before)
                out = fn(*args, **kwargs)
                if after:
                    probe.mark(after, first=True)
                return out
            return wrapped

        TorchExecutor.execute = around(TorchExecutor.execute, "execute", "launched")
        dist.broadcast = around(dist.broadcast, None, "shared")  # the step's sampled ids (its first collective)
        fill = StepGraphs._fill

        def timed_fill(self, step, bucket):
            probe.mark("fill")
            self._copied.synchronize()  # what _fill waits for first (a second wait is free)
            probe.mark("synced")
            fill(self, step, bucket)
            probe.mark("packed")

        StepGraphs._fill = timed_fill
        if rank == 0:
            from trtopt.runtime.executors.control_plane import DriverChannel
            from trtopt.runtime.executors.tensor_parallel import TensorParallelExecutor

            run = TensorParallelExecutor._run

            def timed_run(self, command):
                if command.op != "step":
                    return run(self, command)
                probe.current = {"enter": time.perf_counter_ns()}
                probe.steps.append(probe.current)
                try:
                    return run(self, command)
                finally:
                    probe.current = None

            TensorParallelExecutor._run = timed_run
            DriverChannel.publish = around(DriverChannel.publish, "encoded", "published")
            ShmBroadcast.publish_bytes = around(ShmBroadcast.publish_bytes, "pickled", None)
            return probe
        receive = ShmBroadcast.receive

        def timed_receive(self, alive=lambda: None):
            if variant == "sleep":
                self.spin_s = shm_broadcast.DEFAULT_SPIN_S  # the pre-#31 wait: timer sleeps after 50 µs
            stamps = {"wait": time.perf_counter_ns()}
            want = self._seq + 1  # receive's own wait, run first so that its end is seen (receive's then returns)
            shm_broadcast._wait(lambda: int(self._header[0]) >= want, alive, self.spin_s)
            stamps["seen"] = time.perf_counter_ns()
            message = receive(self, alive)
            stamps["received"] = time.perf_counter_ns()
            probe.current = stamps if message[0] == "step" else None
            if probe.current is not None:
                probe.steps.append(probe.current)
            return message

        ShmBroadcast.receive = timed_receive
        StepInputs.__init__ = around(StepInputs.__init__, None, "decoded")  # the worker's first: the message's
        atexit.register(probe.dump)
        return probe

    def dump(self) -> None:
        (self.directory / f"rank{self.rank}.json").write_text(json.dumps({"rank": self.rank, "steps": self.steps}))


# ---- analysis (pure) -------------------------------------------------------------------------------------------

def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 1),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1)}


def summarize(ranks: dict[int, list[dict[str, int]]], chosen: range) -> dict:
    """Per rank: each phase's offset (µs) from rank 0's `published` of the same step, and the time between
    consecutive phases, over the steps in ``chosen`` (indices into every rank's list)."""
    base = ranks[0]
    out = {}
    for rank, steps in sorted(ranks.items()):
        order = (RANK0_PHASES if rank == 0 else WORKER_PHASES) + COMMON_PHASES
        phases = [p for p in order if all(p in steps[k] for k in chosen)]
        offsets = {p: _stats([(steps[k][p] - base[k]["published"]) / 1e3 for k in chosen]) for p in phases}
        gaps = {f"{a}->{b}": _stats([(steps[k][b] - steps[k][a]) / 1e3 for k in chosen])
                for a, b in zip(phases, phases[1:])}
        out[str(rank)] = {"offset_from_rank0_published_us": offsets, "between_phases_us": gaps}
    return out


def print_summary(name: str, result: dict) -> None:
    log(f"{name}: {result['decode_tok_s']:.1f} tok/s over {result['steps']} steps "
        "(median [p90] us from rank 0's publish)")
    for rank, entry in result["per_rank"].items():
        offsets = "  ".join(f"{p} {s['median']:+.0f} [{s['p90']:+.0f}]"
                            for p, s in entry["offset_from_rank0_published_us"].items())
        print(f"  rank {rank}: {offsets}")


# ---- one run (a child process: one torch.distributed group per process) ----------------------------------------

def measure(plan_dir: str, device: str, size: int, tokens: int, skip: int, directory: Path, variant: str) -> dict:
    import torch

    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.sampling_params import SamplingParams

    probe = Probe.install(0, directory, variant)
    engine = LLMEngine.from_plan(plan_dir, device=device, tensor_parallel_size=size, max_num_seqs=4,
                                 max_num_batched_tokens=256, kv_cache_memory_gb=0.25, enable_prefix_caching=False,
                                 async_scheduling=True)
    try:
        prompt = {"prompt_token_ids": list(range(7, 71))}
        engine.add_request("warm", prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("timed", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0))
        first = len(probe.steps) + skip
        started = None
        while engine.has_unfinished_requests():
            engine.step()
            if started is None and len(probe.steps) >= first:
                started = (time.perf_counter(), len(probe.steps))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall, last = time.perf_counter() - started[0], len(probe.steps)
    finally:
        engine.shutdown()  # the workers write their records as they exit
    ranks = {0: probe.steps}
    for rank in range(1, size):
        ranks[rank] = json.loads((directory / f"rank{rank}.json").read_text())["steps"]
    assert all(len(steps) == len(ranks[0]) for steps in ranks.values()), {r: len(s) for r, s in ranks.items()}
    chosen = range(first, last)
    return {"variant": variant, "steps": len(chosen), "decode_tok_s": (last - started[1]) / wall,
            "per_rank": summarize(ranks, chosen)}


def run_child(args: argparse.Namespace, variant: str, work: Path) -> dict:
    directory = work / f"timeline_{variant}"
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("rank*.json"):
        old.unlink()
    hook = work / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, DIR_ENV: str(directory), VARIANT_ENV: variant,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = directory / "result.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", variant, "--plan-dir", str(args.plan_dir), "--device", args.device,
           "--size", str(args.size), "--tokens", str(args.tokens), "--skip", str(args.skip), "--work", str(work)]
    try:
        code = subprocess.run(cmd, env=env, timeout=args.run_timeout_s).returncode
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.run_timeout_s:.0f} s"}
    if code != 0 or not out.is_file():
        return {"variant": variant, "error": f"the run exited with code {code} (its output above says why)"}
    return json.loads(out.read_text())


def tiny_plan(work: Path, size: int) -> Path:
    """tp_e2e.py's tiny shape (2 layers, hidden 256, bf16, random weights) built for ``size`` ranks, cached."""
    import torch

    import tp_e2e

    model = tp_e2e.Model("tiny", tp_e2e.SHAPES["tiny"], tied=True)
    made = tp_e2e.make_plans(work, model, torch.device("cpu"), 4, [(size, "replicated")], float("inf"))
    return Path(made["plans"][tp_e2e.plan_key(size, "replicated")]["dir"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plan-dir", type=Path, default=None, help="a plan built for --size ranks (default: tiny)")
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens of the timed request")
    ap.add_argument("--skip", type=int, default=3, help="steps of the timed request left out (its prefill)")
    ap.add_argument("--variants", default="spin",
                    help="spin (the runtime as it is), sleep (the workers' pre-#31 wait and ids path), or both")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtopt-tp-host-timeline"))
    ap.add_argument("--out", type=Path, default=None, help="JSON (default: --work/tp_host_timeline.json)")
    ap.add_argument("--run-timeout-s", type=float, default=240.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        directory = args.work / f"timeline_{args.child}"
        result = measure(str(args.plan_dir), args.device, args.size, args.tokens, args.skip, directory, args.child)
        (directory / "result.json").write_text(json.dumps(result))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in ("spin", "sleep") for v in variants):
        raise SystemExit(f"--variants {args.variants!r}: spin, sleep or sleep,spin")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.plan_dir is None:
        args.plan_dir = tiny_plan(args.work, args.size)
    import torch

    codec = codec_timings()
    log(f"wire format, µs per call on this host (encode+pickle / unpickle+decode): current "
        f"{codec['current']['encode_us']} / {codec['current']['decode_us']}, pre-#31 {codec['pre_31']['encode_us']} / "
        f"{codec['pre_31']['decode_us']}")
    results = {}
    for variant in variants:
        log(f"{variant}: N={args.size} on {args.device}, {args.tokens} tokens")
        results[variant] = run_child(args, variant, args.work)
        if "error" in results[variant]:
            log(f"{variant}: {results[variant]['error']}")
        else:
            print_summary(variant, results[variant])
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor(),
            "host": socket.gethostname(), "torch": torch.__version__, "python": platform.python_version(),
            "plan_dir": str(args.plan_dir), "size": args.size, "tokens": args.tokens, "codec": codec,
            "results": results}
    out = args.out or args.work / "tp_host_timeline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
