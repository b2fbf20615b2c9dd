"""The engine's host work per step, with the model taken out (issue 11: "the engine's host path").

On the GPU every served step replays a CUDA graph, and with async scheduling the host prepares step N+1 while step
N runs. Whatever the host spends per step beyond the GPU's step time is exposed: at 256 running sequences on the
H200 (`gpu_e2e.py`) that host path was ~3.3 ms a step against ~3.7 ms of GPU time, and the GPU sat idle 14% of the
time. This benchmark measures that host path alone, on the CPU, where it runs: the scheduler, the input builder,
the sampler's bookkeeping, the scheduler's update and the engine's outputs. The model is replaced by a stand-in
executor that returns zero logits of the right shape at once (NullExecutor below; greedy then picks token 0, and
EOS is ignored, so every request runs to its max_tokens). Nothing else is replaced: the engine, scheduler, block
pool and sampler are the real ones, run synchronously (every step's host work is on the critical path).

Two scenarios, each for the current tree and, in the same run, a baseline git revision (a temporary worktree run in a
subprocess), alternating A/B/A/B so that drift on a shared machine hits both:

- **decode**: S running sequences (512-token prompts, all decoding) for S in 1, 16, 64, 128, 256: host ms per step;
- **workload**: gpu_e2e.py's 256 requests (prompts 64–1024, outputs 32–512) with up to 256 running, steps with
  admissions and prefill chunks included: host ms per step and per component.

    python3 benchmarks/bench_host_step.py --baseline 2bf8805    # → docs/benchmarks/host_step_<cpu>.json + .png
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks"
DECODE_SIZES = (1, 16, 64, 128, 256)
COMPONENTS = {  # what is timed: (attribute path from the engine, method name)
    "schedule": ("scheduler", "schedule"),
    "build": ("input_builder", "build"),
    "sample": ("sampler", "sample_each"),
    "update": ("scheduler", "update"),
    "outputs": (None, "_outputs"),
}


class NullExecutor:
    """The model taken out: zero logits [N, vocab] for a step's N logits rows, at once."""

    def __init__(self, inner, vocab: int) -> None:
        self._inner, self.vocab = inner, vocab

    def __getattr__(self, name):  # pools, copy_blocks, limits: the real executor's
        return getattr(self._inner, name)

    def execute(self, step):
        import torch

        return torch.zeros(step.logits_indices.shape[0], self.vocab)


def plan_dir(work: Path) -> Path:
    """A tiny Llama-shaped plan (gpu_e2e.py's TINY), built once: the engine needs a plan for its limits and pools."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    import gpu_e2e

    if not (work / "plan" / "plan.json").exists():
        gpu_e2e.build(work, gpu_e2e.TINY, torch.device("cpu"), 256)
    return work / "plan"


def measure(src: Path, plan: Path, repeats: int) -> dict:
    """Run in a process whose `trtopt` is imported from `src`: every scenario, `repeats` times each."""
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import torch

    import gpu_e2e
    import trtopt
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.executors import create_executor
    from trtopt.runtime.sampling_params import SamplingParams

    assert Path(trtopt.__file__).resolve().is_relative_to(src.resolve()), (trtopt.__file__, src)
    torch.set_num_threads(1)
    config = read_plan(plan)
    executor = NullExecutor(create_executor("torch", plan, config, device="cpu", cuda_graphs=False), gpu_e2e.TINY.vocab)

    def engine_with_timers(max_num_seqs: int):
        engine = gpu_e2e.make_engine(executor, config, max_num_seqs=max_num_seqs, kv_gb=0.5, async_scheduling=False)
        totals = collections.Counter()
        for name, (owner, method) in COMPONENTS.items():
            obj = engine if owner is None else getattr(engine, owner)
            inner = getattr(obj, method)

            def timed(*a, _inner=inner, _name=name, **k):
                t = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    totals[_name] += time.perf_counter() - t

            setattr(obj, method, timed)
        return engine, totals

    def run(engine, totals, requests, max_steps: int | None = None, **extra) -> dict:
        """Every step of `requests` (the workload), or with max_steps the first max_steps decode steps after every
        request has its first token (admission and prefill not measured). `extra`: more SamplingParams fields."""
        for i, (prompt, n) in enumerate(requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, **extra))
        if max_steps is not None:
            while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
                engine.step()
        gc.collect()
        gc.freeze()
        totals.clear()
        start, steps, running = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
            running += len(engine.scheduler.running)
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
        gc.unfreeze()
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
        return {"steps": steps, "mean_running": running / steps, "host_ms_per_step": wall / steps * 1e3,
                **{f"{k}_ms_per_step": v / steps * 1e3 for k, v in totals.items()}}

    out: dict = {"decode": {}, "workload": []}
    for size in DECODE_SIZES:
        engine, totals = engine_with_timers(max(size, 1))
        rows = []
        for r in range(repeats):
            reqs = [([(7 * i + j) % 2000 + 3 for j in range(512)], 400) for i in range(size)]
            rows.append(run(engine, totals, reqs, max_steps=300))
        out["decode"][str(size)] = rows
    engine, totals = engine_with_timers(256)
    workload = gpu_e2e.Workload().make(gpu_e2e.TINY.vocab)
    for r in range(repeats):
        out["workload"].append(run(engine, totals, workload))
    if "output_kind" in {f.name for f in dataclasses.fields(SamplingParams)}:  # LLM.generate's kind, where it exists
        out["workload_final_only"] = [run(engine, totals, workload, output_kind="final_only") for _ in range(repeats)]
    return out


def summarize(rows: list[dict]) -> dict:
    """The fastest of the repeats (its components with it), as timeit reports: on a shared machine a slower run is
    one that something else disturbed. The median and the slowest are kept beside it to show the spread."""
    best = min(rows, key=lambda r: r["host_ms_per_step"])
    host = [r["host_ms_per_step"] for r in rows]
    return {**best, "median_host_ms_per_step": statistics.median(host), "max_host_ms_per_step": max(host), "runs": len(rows)}


def worktree(ref: str) -> tuple[Path, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="trtopt-host-base-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tmp / "src"), ref], check=True,
                   capture_output=True)
    return tmp, tmp / "src"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = [t for t in ("baseline", "current") if t in data["results"]]
    bars = [(t, data["results"][t]["workload"]) for t in trees]
    if "workload_final_only" in data["results"].get("current", {}):
        bars.append(("current,\nfinal_only", data["results"]["current"]["workload_final_only"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tree, color in zip(trees, ("tab:gray", "tab:blue")):
        dec = data["results"][tree]["decode"]
        xs = [int(s) for s in dec]
        ax1.plot(xs, [dec[s]["host_ms_per_step"] for s in dec], "o-", color=color, label=f"{tree} ({data['revisions'][tree]})")
    ax1.set_xlabel("running sequences (all decoding)")
    ax1.set_ylabel("host ms per step (model excluded)")
    ax1.set_title("Decode steps: host work per step")
    ax1.grid(alpha=0.3)
    ax1.legend()
    names = list(COMPONENTS) + ["other"]
    bottom = [0.0] * len(bars)
    for name in names:
        vals = []
        for _, w in bars:
            if name == "other":
                vals.append(w["host_ms_per_step"] - sum(w.get(f"{c}_ms_per_step", 0.0) for c in COMPONENTS))
            else:
                vals.append(w.get(f"{name}_ms_per_step", 0.0))
        ax2.bar([label for label, _ in bars], vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("host ms per step")
    mean = data["results"][trees[-1]]["workload"]["mean_running"]
    ax2.set_title(f"gpu_e2e workload (256 requests, {mean:.0f} running on average)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"trtopt engine host path per step, model excluded ({data['machine']['cpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="a git revision measured in the same run (e.g. 2bf8805)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each scenario per tree (the fastest is reported)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trtopt-host-bench")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)  # child: measure this tree
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    plan = plan_dir(args.work)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, plan, 1)))
        return

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    trees = {"current": (ROOT, head + (" + uncommitted changes" if _dirty() else ""))}
    tmp = None
    if args.baseline:
        tmp, src = worktree(args.baseline)
        trees = {"baseline": (src, args.baseline), **trees}
    rows: dict[str, list] = {t: [] for t in trees}
    try:
        for r in range(args.repeats):  # A, B, A, B, ...: drift on the machine hits both trees alike
            for tree, (src, _) in trees.items():
                print(f"[{time.strftime('%H:%M:%S')}] {tree} run {r + 1}/{args.repeats}", flush=True)
                res = subprocess.run([sys.executable, __file__, "--measure", str(src), "--work", str(args.work)],
                                     check=True, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
                rows[tree].append(json.loads(res.stdout.strip().splitlines()[-1]))
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "src")], check=False)
    results = {}
    for tree, runs in rows.items():
        results[tree] = {
            "decode": {s: summarize([x for run in runs for x in run["decode"][s]]) for s in runs[0]["decode"]},
            "workload": summarize([x for run in runs for x in run["workload"]]),
        }
        if "workload_final_only" in runs[0]:
            results[tree]["workload_final_only"] = summarize([x for run in runs for x in run["workload_final_only"]])
    data = {
        "benchmark": "host_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "cores": os.cpu_count()},
        "method": "model replaced by zero logits (NullExecutor); synchronous loop; the fastest of the repeats "
                  "(median and slowest beside it); "
                  "decode rows: 300 steps of S running sequences once every one has its first token",
        "revisions": {t: rev for t, (_, rev) in trees.items()},
        "results": results,
    }
    if "baseline" in results:
        data["speedup"] = {
            "decode": {s: results["baseline"]["decode"][s]["host_ms_per_step"] / results["current"]["decode"][s]["host_ms_per_step"]
                       for s in results["current"]["decode"]},
            "workload": results["baseline"]["workload"]["host_ms_per_step"] / results["current"]["workload"]["host_ms_per_step"],
        }
    out = args.out or DOCS / "host_step_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out.with_suffix(".png"))
    for tree, res in results.items():
        dec = ", ".join(f"S={s}: {v['host_ms_per_step']:.3f}" for s, v in res["decode"].items())
        w = res["workload"]
        parts = ", ".join(f"{c} {w.get(c + '_ms_per_step', 0):.3f}" for c in COMPONENTS)
        print(f"{tree:9s} decode ms/step {dec}\n          workload {w['host_ms_per_step']:.3f} ms/step ({parts})")
        if "workload_final_only" in res:
            print(f"          workload, output_kind=final_only {res['workload_final_only']['host_ms_per_step']:.3f} ms/step")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _dirty() -> bool:
    res = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return bool(res.stdout.strip())


if __name__ == "__main__":
    main()
