"""Tensor-parallel benchmark: Llama-shaped random-weight bf16 plans at N = 1, 2, 4 ranks of one host, same run.

Shapes (random weights, made on the GPU, exported once in bf16 and built once per N under --work):
  8b    Llama-3-8B: 32 layers, hidden 4096, GQA 32/8, MLP 14336, vocab 128256, untied head
  70b   a Llama-3-70B layer: hidden 8192, GQA 64/8, MLP 28672, vocab 128256, untied head (80 layers in full)
  1b/3b Llama-3.2-1B (tied) and Llama-3.2-3B's layers (untied), the earlier H200 runs' shapes
  tiny  2 layers, hidden 256 (--smoke)

For every N and every all-reduce path (--all-reduce nccl,p2p sets TRTOPT_ALL_REDUCE for that run), through
LLMEngine.from_plan with CUDA graphs, in a fresh child process per run (so the path is read at start-up and one
failing run does not end the others):
1. batch-1 decode tok/s (128-token prompt, --new-tokens new ones; gpu_e2e.batch1_decode);
2. the --requests-request variable-length workload of gpu_e2e.py (continuous batching, max_num_seqs 256);
3. N > 1: the NCCL kernel share of rank 0's eager decode step (torch.profiler); every N (N = 1 is the baseline):
   rank 0's graphed decode steps by kernel, with the GPU's busy time against the wall time per step (and a Chrome
   trace of 8 steps with the host's ops, <run>.trace.json.gz beside the run's row under --work/runs);
   a per-rank timeline of graphed batch-1 decode steps: CUDA events around every rank's execute(), mapped to the
   host's monotonic clock (one clock for every process of the host), so each rank's step start is an offset from
   rank 0's, each step's duration is its own, and the GPU's idle until the next step is the gap. The JSON keeps a summary (median/p90/max per rank) and the first --plot-steps steps;
   <out>_timeline.png draws them. Workers are timed through a sitecustomize.py that --work/hook puts on their
   PYTHONPATH (the runtime is not changed); it acts only when TP_E2E_TIMELINE is set.
Speedup = tok/s at N / tok/s at N=1 of the same shape and layer count, from rows of the same GPU (each row keeps
its GPU, host and date; `same_host` says whether the N=1 row came from the same machine). Each row records the
all-reduce path asked for (`all_reduce`: the TRTOPT_ALL_REDUCE it ran with) and the one rank 0 took
(`all_reduce_used`: runtime/executors/all_reduce.py's start-up log line).

Fewer layers than the full model (--layers): the shape is also built with --fit-layers (default 2) layers, and
each run's per-token time (batch 1) and wall time (workload) are fitted as fixed + layers x per_layer through the
two points, then evaluated at the full layer count. Those numbers sit under "extrapolated" (marked so in the JSON,
with the method and both layer counts) and are drawn dashed, labelled "extrapolated"; measured rows stay as
measured. --fit-layers 0 scales the one measured point by full/measured layers instead (an upper bound: the LM
head and the host work are scaled too).

--nnodes 2 (a call of its own): N = the largest --sizes (4) as two "nodes" of N/2 ranks on this machine (node 0:
a child process with CUDA_VISIBLE_DEVICES of the first half, node 1: `trtopt serve --node-rank 1` with the second
half; docs/architecture.md §7b), batch-1 decode only, against one node of N ranks measured in the same call.
--node-transport net sets NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 on both (NCCL's network transport, as between
hosts), local leaves NCCL free; each transport gets its own one-node baseline.

Resuming: plans (and their export) are cached under --work/<shape>-L<layers>/ with a marker per stage, and every
run's row is saved to --work/results.json as it finishes; the JSON/PNGs are rewritten after every run, so a call cut
short keeps what it measured. A later call skips the rows already measured, in --work or in the --out JSON (so a
call on a fresh machine keeps the earlier calls' rows once that JSON is back in the tree; only the plans it needs
are built again); failed rows are measured again, --fresh re-measures everything. --deadline-s: no build or run
starts after that many seconds (a running one is not cut; give the device call's limit minus ~3 minutes).

Examples (PYTHONPATH=$PWD TRTOPT_CACHE=/tmp/c):
    python3 benchmarks/tp_e2e.py --smoke                                 # tiny shape, whole flow, < 2 min on GPUs
    python3 benchmarks/tp_e2e.py --smoke --device cpu --sizes 1,2        # the same on the CPU (gloo)
    python3 benchmarks/tp_e2e.py --shapes 8b --sizes 1,2,4 --all-reduce nccl,p2p
    python3 benchmarks/tp_e2e.py --shapes 8b --layers 8 --requests 64    # 8 layers + 2, extrapolated to 32
    python3 benchmarks/tp_e2e.py --shapes 70b --layers 8 --sizes 1,2,4   # N=1 only if it fits one GPU
    python3 benchmarks/tp_e2e.py --shapes 8b --layers 8 --nnodes 2       # two "nodes" of 2 vs one node of 4
    python3 benchmarks/tp_e2e.py --shapes 8b --build-only                # plans only (a later call measures)
    python3 benchmarks/tp_e2e.py --report-only --device cpu --out docs/benchmarks/tp_e2e_h200.json  # re-derive
Output: docs/benchmarks/tp_e2e_<gpu>.json, tp_e2e_<gpu>.png (tok/s vs N), tp_e2e_<gpu>_timeline.png
(--smoke: --work/smoke_<gpu>.*).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_e2e  # noqa: E402  (the shapes, workload and measuring functions are shared)

DOCS = ROOT / "docs" / "benchmarks"
SHAPES = {
    "tiny": gpu_e2e.TINY,
    "1b": gpu_e2e.Shape(),
    # Llama-3.2-3B's layers (28 x hidden 3072, GQA 24/8, MLP 8192) with an untied head, as the 8B has.
    "3b": gpu_e2e.Shape(layers=28, hidden=3072, heads=24, kv_heads=8, intermediate=8192, vocab=128256),
    "8b": gpu_e2e.Shape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "70b": gpu_e2e.Shape(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256),
}
TIED = ("tiny", "1b")
ALL_REDUCE_ENV = "TRTOPT_ALL_REDUCE"  # read by trtopt/plugins/all_reduce at start-up: nccl | p2p | auto
TIMELINE_ENV = "TP_E2E_TIMELINE"  # a timeline dir: the workers' sitecustomize.py times their steps into it
NET_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}  # NCCL as between hosts (its NET transport)
LM_HEADS = {"replicated": ("replicated",), "vocab-parallel": ("vocab-parallel",),
            "both": ("replicated", "vocab-parallel")}
GIB = 2**30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- pure helpers (tests/benchmarks/test_tp_e2e.py) ------------------------------------------------------------

def parse_sizes(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4): positive, sorted, unique."""
    sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give positive rank counts, e.g. 1,2,4")
    return tuple(sizes)


def parse_layers(text: str | None, shapes: list[str]) -> dict[str, int]:
    """--layers: "8" (every shape) or "8b=8,70b=10"; shapes not named keep their full layer count."""
    layers = {name: SHAPES[name].layers for name in shapes}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, count = part.rpartition("=")
        for target in ([name] if name else shapes):
            if target not in layers:
                raise argparse.ArgumentTypeError(f"--layers {text!r}: {target!r} is not among --shapes {shapes}")
            layers[target] = int(count)
    for name, count in layers.items():
        if not 2 <= count <= SHAPES[name].layers:
            raise argparse.ArgumentTypeError(f"--layers {name}={count}: choose 2..{SHAPES[name].layers} (a "
                                             "1-layer export keeps an attention_mask read the build refuses)")
    return layers


def plan_key(n: int, lm_head: str) -> str:
    """A plan dir's key: "1", "2", "4", "2-vocab" (the vocabulary-parallel head)."""
    return f"{n}-vocab" if lm_head == "vocab-parallel" else str(n)


def run_key(n: int, lm_head: str, path: str | None) -> str:
    """A row's key: "1" (no all-reduce), "2/nccl", "4/p2p", "2-vocab/nccl"."""
    return plan_key(n, lm_head) if n == 1 else f"{plan_key(n, lm_head)}/{path}"


def shape_params(shape: gpu_e2e.Shape, tied: bool) -> int:
    """Parameters of the Llama shape (tied head counted once)."""
    head_dim = shape.hidden // shape.heads
    attention = shape.hidden * (shape.heads + 2 * shape.kv_heads) * head_dim + shape.heads * head_dim * shape.hidden
    layer = attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    return shape.vocab * shape.hidden * (1 if tied else 2) + shape.layers * layer + shape.hidden


def fits_one_gpu(weight_bytes: int, kv_gb: float, gpu_bytes: int, headroom_gb: float = 6.0) -> bool:
    """Whether one GPU holds the weights, the KV pool and headroom (activations, graphs, the CUDA context)."""
    return weight_bytes + (kv_gb + headroom_gb) * GIB <= gpu_bytes


def line_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per_layer) of value = fixed + layers x per_layer through two (layers, value) points; one point:
    (0, value / layers), the proportional upper bound."""
    if len(points) == 1:
        layers, value = points[0]
        return 0.0, value / layers
    (la, va), (lb, vb) = sorted(points)[:1] + sorted(points)[-1:]
    assert la != lb, f"two fit points need two layer counts, got {points}"
    per_layer = (vb - va) / (lb - la)
    return va - la * per_layer, per_layer


def extrapolate_run(rows: dict[int, dict], to_layers: int) -> dict:
    """One run key's rows by layer count -> its per-layer cost and its numbers at ``to_layers`` layers.

    Batch 1: ms per token is fitted; the workload: wall seconds (the same requests, so the same output tokens)."""
    b1 = line_fit([(layers, row["batch1"]["ms_per_token"]) for layers, row in rows.items()])
    out = {"from_layers": sorted(rows), "method": "two-point line" if len(rows) > 1 else "proportional",
           "batch1": {"fixed_ms": b1[0], "per_layer_ms": b1[1], "ms_per_token": b1[0] + to_layers * b1[1],
                      "decode_tok_s": 1e3 / (b1[0] + to_layers * b1[1])}}
    with_workload = {layers: row["workload"] for layers, row in rows.items() if row.get("workload")}
    if len(with_workload) == len(rows) and len({json.dumps(r.get("workload_spec")) for r in rows.values()}) == 1:
        fit = line_fit([(layers, w["wall_s"]) for layers, w in with_workload.items()])
        wall = fit[0] + to_layers * fit[1]
        tokens = next(iter(with_workload.values()))["output_tokens"]
        out["workload"] = {"fixed_s": fit[0], "per_layer_s": fit[1], "wall_s": wall, "output_tok_s": tokens / wall}
    return out


def per_layer_bytes(rows: dict[int, dict]) -> float | None:
    """Weight bytes one layer adds to a rank: the difference of rank 0's plan bytes between two layer counts."""
    if len(rows) < 2 or any("weight_bytes_per_rank" not in r for r in rows.values()):
        return None
    (la, ra), (lb, rb) = sorted(rows.items())[:1] + sorted(rows.items())[-1:]
    return (rb["weight_bytes_per_rank"][0] - ra["weight_bytes_per_rank"][0]) / (lb - la)


def flag_implausible(runs: dict[str, dict], by_key: dict[str, dict[int, dict]], slack: float = 1.1) -> None:
    """Mark each fitted per-layer batch-1 cost that is below what its bytes allow as `unreliable` (in place).

    Every rank is the same GPU as N = 1, so a layer's time at N cannot beat its weight bytes per rank read at N = 1's
    fitted per-layer bandwidth (times ``slack``). A slope below that (or not above 0) means the two layer counts
    differ by less than the run-to-run noise of the fixed part; such a row is kept with its fit for the record but
    gets no extrapolated tok/s and no speedup. The workload's wall-time slope is only checked for being positive."""
    one_bytes, one = per_layer_bytes(by_key.get("1", {})), runs.get("1")
    bandwidth = (one_bytes / (one["batch1"]["per_layer_ms"] * 1e-3)
                 if one and one_bytes and one["batch1"]["per_layer_ms"] > 0 else None)
    for key, run in runs.items():
        if run["method"] != "two-point line":
            continue
        slope, nbytes = run["batch1"]["per_layer_ms"], per_layer_bytes(by_key.get(key, {}))
        floor_ms = nbytes / (slack * bandwidth) * 1e3 if bandwidth and nbytes else 0.0
        if slope <= floor_ms:
            run["batch1"]["unreliable"] = (
                f"fitted per-layer cost {slope * 1e3:.1f} us <= {floor_ms * 1e3:.1f} us, the floor its weight bytes "
                f"per layer and rank allow at N = 1's per-layer bandwidth: the layer counts differ by less than the "
                f"noise; measure more layers")
            run["batch1"].pop("decode_tok_s", None)
        if "workload" in run and run["workload"]["per_layer_s"] <= 0:
            run["workload"]["unreliable"] = "fitted per-layer wall time not positive: within the noise"
            run["workload"].pop("output_tok_s", None)


def speedups(runs: dict[str, dict]) -> dict[str, dict]:
    """Every N > 1 row against the "1" row: batch-1 and workload tok/s ratios (and whether both came from one
    host, i.e. one machine)."""
    one = runs.get("1")
    if one is None:
        return {}
    out = {}
    for key, row in runs.items():
        if key == "1":
            continue
        entry: dict[str, Any] = {"batch1": row["batch1"]["decode_tok_s"] / one["batch1"]["decode_tok_s"]}
        if row.get("workload") and one.get("workload") and row.get("workload_spec") == one.get("workload_spec"):
            entry["workload"] = row["workload"]["output_tok_s"] / one["workload"]["output_tok_s"]
        if "host" in row:
            entry["same_host"] = row.get("host") == one.get("host") and row.get("gpu") == one.get("gpu")
        out[key] = entry
    return out


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    stats = {"median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
             "max": ordered[-1], "min": ordered[0]}
    return {k: round(v, 1) for k, v in stats.items()}


def timeline_summary(ranks: dict[int, list[list]], plot_steps: int = 6, skip: int = 2) -> dict:
    """Per-rank step records [host_enter_ns, start_ns, end_ns, graphed] (one clock, the same step order on every
    rank) -> offsets from rank 0 and durations in µs: start (the rank's step began on its GPU), end, host (the rank's
    execute() was entered), the step's duration and the gap from its end to the next step's start; over the graphed
    steps (every step when none was graphed), the first ``skip`` dropped (the first one carries the clock
    calibration)."""
    count = min(len(steps) for steps in ranks.values())
    graphed = [k for k in range(count) if ranks[0][k][3]]
    chosen = (graphed or list(range(count)))[skip:] or (graphed or list(range(count)))
    per_rank = {}
    for rank in sorted(ranks):
        steps, base = ranks[rank], ranks[0]
        per_rank[str(rank)] = {
            "start_offset_us": _stats([(steps[k][1] - base[k][1]) / 1e3 for k in chosen]),
            "end_offset_us": _stats([(steps[k][2] - base[k][2]) / 1e3 for k in chosen]),
            "host_offset_us": _stats([(steps[k][0] - base[k][0]) / 1e3 for k in chosen]),
            "duration_us": _stats([(steps[k][2] - steps[k][1]) / 1e3 for k in chosen]),
        }
        # the GPU's idle between a step's end and the next step's start (sampling, the ids' exchange, the fill)
        gaps = [(steps[k + 1][1] - steps[k][2]) / 1e3 for k in chosen if k + 1 in chosen]
        if gaps:
            per_rank[str(rank)]["gap_to_next_us"] = _stats(gaps)
    first = chosen[:plot_steps]
    origin = ranks[0][first[0]][1] if first else 0
    return {"steps": len(chosen), "graphed": bool(graphed), "per_rank": per_rank,
            "records_per_rank": {str(rank): len(steps) for rank, steps in ranks.items()},
            # [rank][step] = [start_us, end_us] from rank 0's first plotted start: the plot's bars
            "first_steps_us": {str(rank): [[round((ranks[rank][k][1] - origin) / 1e3, 1),
                                            round((ranks[rank][k][2] - origin) / 1e3, 1)] for k in first]
                               for rank in sorted(ranks)}}


# ---- the per-rank step recorder (rank 0 in the run's process, the workers through sitecustomize.py) -------------

SITECUSTOMIZE = f'''"""Written by benchmarks/tp_e2e.py: a tensor-parallel worker times its steps when {TIMELINE_ENV}
is set (StepRecorder); any other process is left alone."""
import os
if os.environ.get("{TIMELINE_ENV}") and os.environ.get("RANK"):
    import sys
    sys.path.insert(0, {str(ROOT / "benchmarks")!r})
    import tp_e2e
    tp_e2e.StepRecorder.install(int(os.environ["RANK"]), __import__("pathlib").Path(os.environ["{TIMELINE_ENV}"]))
'''


class StepRecorder:
    """Times every TorchExecutor.execute() of this process while the flag byte (<dir>/flag, one writer: rank 0's
    recorder) is 1: the host clock at entry, and CUDA events around the call mapped onto the host's monotonic clock
    (perf_counter_ns, shared by every process of the host) by calibrations at the first recorded step and at the
    end. On the CPU the host clock at entry and exit. Workers write <dir>/rank{r}.json when they exit."""

    def __init__(self, rank: int, directory: Path, *, owner: bool):
        self.rank, self.directory = rank, directory
        self.cuda: bool | None = None  # the executor's device, seen at the first recorded step
        flag = directory / "flag"
        if owner:
            flag.write_bytes(b"\0")
        self._file = open(flag, "r+b" if owner else "rb")
        self._flag = mmap.mmap(self._file.fileno(), 1, access=mmap.ACCESS_WRITE if owner else mmap.ACCESS_READ)
        self.records: list[tuple] = []
        self.calibrations: list[tuple] = []

    @classmethod
    def install(cls, rank: int, directory: Path, *, owner: bool = False) -> StepRecorder:
        import atexit

        from trtopt.runtime.executors.torch_executor import TorchExecutor

        recorder = cls(rank, directory, owner=owner)
        inner = TorchExecutor.execute

        def execute(executor, step):
            if not recorder._flag[0]:
                return inner(executor, step)
            return recorder.record(inner, executor, step)

        TorchExecutor.execute = execute
        if not owner:
            atexit.register(recorder.dump)
        return recorder

    def set(self, on: bool) -> None:
        self._flag[0] = 1 if on else 0

    def calibrate(self) -> tuple:
        """(event, host ns, ± ns): an event and the host time it ran at, the tightest of five tries."""
        best = None
        for _ in range(5):
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            before = time.perf_counter_ns()
            event.record()
            event.synchronize()
            after = time.perf_counter_ns()
            if best is None or after - before < 2 * best[2]:
                best = (event, (before + after) // 2, (after - before) // 2)
        return best

    def record(self, inner, executor, step):
        if self.cuda is None:
            self.cuda = executor.device.type == "cuda"
            if self.cuda:
                self.calibrations.append(self.calibrate())
        graphs = executor.graphs
        replayed = graphs.num_replayed if graphs is not None else 0
        host = time.perf_counter_ns()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        out = inner(executor, step)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            start, end = host, time.perf_counter_ns()
        self.records.append((host, start, end, bool(graphs is not None and graphs.num_replayed > replayed)))
        return out

    def steps(self) -> list[list]:
        """[[host_enter_ns, start_ns, end_ns, graphed], ...] on the host clock."""
        if not self.cuda or not self.records:
            return [list(r) for r in self.records]
        self.calibrations.append(self.calibrate())
        (ref, host0, _), (last, host1, _) = self.calibrations[0], self.calibrations[-1]
        span_ms = ref.elapsed_time(last)
        scale = (host1 - host0) / (span_ms * 1e6) if span_ms > 0 else 1.0  # the GPU clock's rate against the host's

        def on_host(event) -> int:
            return int(host0 + ref.elapsed_time(event) * 1e6 * scale)

        return [[host, on_host(start), on_host(end), graphed] for host, start, end, graphed in self.records]

    def dump(self) -> None:
        data = {"rank": self.rank, "steps": self.steps(),
                "calibration_ns": [c[2] for c in self.calibrations] if self.cuda else []}
        (self.directory / f"rank{self.rank}.json").write_text(json.dumps(data))


def hook_dir(work: Path) -> Path:
    """--work/hook/sitecustomize.py (written once per run)."""
    path = work / "hook"
    path.mkdir(parents=True, exist_ok=True)
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


# ---- plans -----------------------------------------------------------------------------------------------------

def make_hf_dir(out: Path, shape: gpu_e2e.Shape, device: torch.device, tied: bool) -> int:
    """A random LlamaForCausalLM in bf16 saved at ``out``: made on ``device`` without an fp32 copy (meta, then
    filled: N(0, 0.02), norms 1). Returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    if tied:
        model.tie_weights()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return params


def weight_bytes_per_rank(plan_dir: Path) -> list[int]:
    """Initializer bytes of each rank's model.onnx (the unsharded plan: one entry), from the protos' dims and
    types without loading the weights."""
    import numpy as np
    import onnx
    from onnx import helper

    from trtopt.builder.plan import rank_dir, read_plan

    parallel = read_plan(plan_dir).parallel
    dirs = [rank_dir(plan_dir, r) for r in range(parallel.size)] if parallel else [Path(plan_dir)]
    sizes = []
    for path in dirs:
        proto = onnx.load(path / "model.onnx", load_external_data=False)
        sizes.append(sum(int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                         for t in proto.graph.initializer))
    return sizes


@dataclasses.dataclass(frozen=True)
class Model:
    """One shape at one layer count, built under work/<name>-L<layers>/."""

    name: str
    shape: gpu_e2e.Shape  # with the built layer count
    tied: bool

    @property
    def tag(self) -> str:
        return f"{self.name}-L{self.shape.layers}"


def make_plans(work: Path, model: Model, device: torch.device, max_num_seqs: int, keys: list[tuple[int, str]],
               deadline: float) -> dict:
    """HF dir -> export -> one plan per (N, lm_head), each stage skipped when its marker says it is done (so a
    build cut short by a device call's limit goes on in the next call). Returns {"params", "make_s", "export_s",
    "plans": {plan_key: {"dir", "build_s", "layout", "lm_head", "weight_bytes_per_rank"}}}; plans not built before
    ``deadline`` (time.monotonic) are missing."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model

    root = work / model.tag
    root.mkdir(parents=True, exist_ok=True)
    hf_dir, onnx_dir, made = root / "hf", root / "onnx", root / "made.json"
    info = json.loads(made.read_text()) if made.is_file() else {}
    if "export_s" not in info and time.monotonic() > deadline:
        log(f"{model.tag}: deadline reached before the export; a later call goes on")
        return {**info, "plans": {}}
    if "params" not in info:
        t = time.perf_counter()
        info["params"] = make_hf_dir(hf_dir, model.shape, device, model.tied)
        info["make_s"] = time.perf_counter() - t
        made.write_text(json.dumps(info))
        log(f"{model.tag}: HF model, {info['params'] / 1e9:.2f}B parameters ({info['make_s']:.1f} s)")
    if "export_s" not in info:
        t = time.perf_counter()
        export_model(hf_dir, onnx_dir, dtype="bf16", verify_outputs=False, force=True)
        info["export_s"] = time.perf_counter() - t
        made.write_text(json.dumps(info))
        shutil.rmtree(hf_dir, ignore_errors=True)
        log(f"{model.tag}: exported ({info['export_s']:.1f} s)")
    limits = Limits(block_size=16, max_num_tokens=8192, max_num_seqs=max_num_seqs, max_model_len=2048)
    plans = {}
    for n, lm_head in keys:
        key = plan_key(n, lm_head)
        plan_dir, done = root / f"plan_tp{key}", root / f"plan_tp{key}.json"
        if not done.is_file():
            if time.monotonic() > deadline:
                log(f"{model.tag}: deadline reached before building plan {key}; a later call builds it")
                continue
            t = time.perf_counter()
            result = build_plan(onnx_dir, plan_dir, force=True, progress=False, limits=limits,
                                tensor_parallel=n if n > 1 else None, lm_head=lm_head)
            done.write_text(json.dumps({"dir": str(result.plan_dir), "build_s": time.perf_counter() - t,
                                        "layout": result.parallel.summary() if result.parallel else None,
                                        "lm_head": lm_head, "weight_bytes_per_rank": weight_bytes_per_rank(plan_dir)}))
        plans[key] = json.loads(done.read_text())
        log(f"{model.tag}: plan {key} ({plans[key]['build_s']:.1f} s to build, weights per rank "
            f"{[round(b / GIB, 2) for b in plans[key]['weight_bytes_per_rank']]} GiB)")
    return {**info, "plans": plans}


# ---- one measured run (a child process) ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a child process measures (written as JSON, read by `tp_e2e.py --child SPEC`)."""

    plan_dir: str
    size: int  # tensor-parallel ranks (1: the unsharded plan)
    vocab: int
    device: str
    out: str  # the result JSON the child writes
    kv_gb: float
    max_num_seqs: int
    new_tokens: int  # batch-1 decode
    workload: dict | None  # gpu_e2e.Workload fields; None: no workload section
    profile: bool  # the eager NCCL share (N > 1 on CUDA)
    timeline_dir: str | None  # per-rank step timeline
    timeline_steps: int
    plot_steps: int
    nnodes: int = 1
    master_port: int | None = None


def all_reduce_profile(engine, steps: int = 8) -> dict | None:
    """Rank 0's device time per eager decode step, and the part of it in NCCL kernels (incl. waiting for peers)."""
    from torch.profiler import ProfilerActivity, profile

    from trtopt.runtime.sampling_params import SamplingParams

    if not torch.cuda.is_available():
        return None
    engine.add_request("prof", {"prompt_token_ids": list(range(5, 133))},
                       SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0))
    engine.step()  # prefill
    executor = engine.executor
    was_enabled = bool(executor.graphs and executor.graphs.enabled)
    executor.set_cuda_graphs(False)  # eager, on every rank: the profiler sees every kernel
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        executor.set_cuda_graphs(was_enabled)
    while engine.has_unfinished_requests():
        engine.step()
    total = nccl = 0.0
    for event in prof.key_averages():
        if event.device_type.name != "CUDA":
            continue
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        total += device_us
        if "nccl" in event.key.lower() or "allreduce" in event.key.lower():
            nccl += device_us
    return {"eager_steps": steps, "device_ms_per_step": total / steps / 1e3,
            "nccl_kernel_ms_per_step": nccl / steps / 1e3, "nccl_share": nccl / total if total else None}


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (kernels that overlap count once)."""
    busy, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            busy, reach = busy + (end - start), end
        elif end > reach:
            busy, reach = busy + (end - reach), end
    return busy


def graphed_profile(engine, steps: int = 16, trace: Path | None = None) -> dict | None:
    """Rank 0's graphed batch-1 decode steps as served (every N, N = 1 the baseline): device time per step by
    kernel (CUPTI records each kernel of a replayed graph, and what the engine launches around the replay: the id
    share, the sampler, the copies), and the GPU's busy time per step (the union of its kernels' intervals) against
    the wall time per step, whose difference is the GPU idle between and inside steps. A second pass with the host's
    ops too (slower host: for where the host time goes, not for its length) is written to ``trace`` as a Chrome
    trace (gzip) when given."""
    from torch.profiler import ProfilerActivity, profile

    from trtopt.runtime.sampling_params import SamplingParams

    if not torch.cuda.is_available() or engine.executor.graphs is None:
        return None
    engine.add_request("gprof", {"prompt_token_ids": list(range(9, 137))},
                       SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0.0))
    for _ in range(4):  # the prefill and a few graphed steps before the window
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    spans = []
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        start, end = event.time_range.start, event.time_range.end
        spans.append((start, end))
        entry = kernels.setdefault(event.name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    busy = union_length(spans)
    wall = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    top = sorted(({"name": k, "per_step": c / steps, "us_per_step": t / steps} for k, (c, t) in kernels.items()),
                 key=lambda k: -k["us_per_step"])
    out = {"steps": steps, "kernels_per_step": len(spans) / steps, "kernel_us_per_step": sum(
        k["us_per_step"] for k in top), "busy_us_per_step": busy / steps, "wall_us_per_step": wall / steps,
        "top": top[:20]}
    if trace is not None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                engine.step()
            torch.cuda.synchronize()
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        import gzip
        trace.write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
        out["trace"] = str(trace)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def timeline_window(engine, recorder: StepRecorder, steps: int) -> None:
    """One request of ``steps`` decode steps with every rank's recorder on (its prefill carries the calibration)."""
    from trtopt.runtime.sampling_params import SamplingParams

    engine.add_request("timeline", {"prompt_token_ids": list(range(7, 71))},
                       SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0))
    recorder.set(True)
    try:
        while engine.has_unfinished_requests():
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # rank 0's last step waited for every rank's: all of them have recorded it
    finally:
        recorder.set(False)


class _Said(logging.Handler):
    """The messages a logger emitted (which all-reduce path rank 0 took: runtime/executors/all_reduce.py logs it)."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def measure(spec: RunSpec) -> dict:
    """The child's work: one engine, its sections, one result dict."""
    from trtopt.runtime.config import NodeConfig
    from trtopt.runtime.engine import LLMEngine

    device = torch.device(spec.device)
    said = _Said("trtopt.runtime.executors.all_reduce")
    recorder = None
    if spec.timeline_dir:
        directory = Path(spec.timeline_dir)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        recorder = StepRecorder.install(0, directory, owner=True)
        os.environ[TIMELINE_ENV] = str(directory)  # the workers spawned below inherit it
    nodes = NodeConfig(spec.nnodes, 0, "127.0.0.1", spec.master_port) if spec.nnodes > 1 else None
    t = time.perf_counter()
    engine = LLMEngine.from_plan(spec.plan_dir, device=spec.device, nodes=nodes,
                                 tensor_parallel_size=spec.size if spec.size > 1 else None,
                                 max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=8192,
                                 kv_cache_memory_gb=spec.kv_gb, enable_prefix_caching=False)
    os.environ.pop(TIMELINE_ENV, None)
    out: dict[str, Any] = {"start_s": time.perf_counter() - t, "num_blocks": engine.limits.num_blocks,
                           "all_reduce_used": said.messages[-1] if said.messages else None}
    try:
        out["batch1"] = gpu_e2e.batch1_decode(engine, spec.vocab, device, new_tokens=spec.new_tokens)
        log(f"batch-1 decode: {out['batch1']['decode_tok_s']:.1f} tok/s")
        if spec.profile and spec.size > 1 and device.type == "cuda":
            out["profile"] = all_reduce_profile(engine)
        if spec.profile and device.type == "cuda":
            trace = Path(spec.out).with_suffix(".trace.json.gz")
            out["graphed_profile"] = graphed_profile(engine, trace=trace)
            if out["graphed_profile"]:
                g = out["graphed_profile"]
                log(f"graphed step: {g['wall_us_per_step']:.0f} us wall, GPU busy {g['busy_us_per_step']:.0f} us; "
                    + "; ".join(f"{k['name'][:40]} {k['us_per_step']:.0f}" for k in g["top"][:8]))
        if recorder is not None:
            timeline_window(engine, recorder, spec.timeline_steps)
        if spec.workload is not None:
            requests = gpu_e2e.Workload(**spec.workload).make(spec.vocab)
            out["workload"] = gpu_e2e.run_engine(engine, requests, wave=None, device=device)
            log(f"workload: {out['workload']['output_tok_s']:.0f} output tok/s")
    finally:
        engine.shutdown()
    if recorder is not None:
        ranks = {0: recorder.steps()}
        calibration = {"0": [c[2] for c in recorder.calibrations]}
        for rank in range(1, spec.size):
            path = Path(spec.timeline_dir) / f"rank{rank}.json"
            if path.is_file():
                dumped = json.loads(path.read_text())
                ranks[rank], calibration[str(rank)] = dumped["steps"], dumped["calibration_ns"]
        if len(ranks) == spec.size and all(ranks.values()):
            out["timeline"] = timeline_summary(ranks, plot_steps=spec.plot_steps)
            # ± of each rank's clock mapping (first and last calibration): the offsets' own uncertainty
            out["timeline"]["calibration_us"] = {r: [round(c / 1e3, 1) for c in cs] for r, cs in calibration.items()}
        else:
            out["timeline"] = {"error": f"records from ranks {sorted(ranks)} of {spec.size}"}
    return out


def child_main(spec_path: Path) -> None:
    spec = RunSpec(**json.loads(spec_path.read_text()))
    result = measure(spec)
    result.update(gpu=torch.cuda.get_device_name(0) if spec.device.startswith("cuda") else platform.processor(),
                  host=socket.gethostname(), date=now(), all_reduce=os.environ.get(ALL_REDUCE_ENV),
                  cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    Path(spec.out).write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_child(spec: RunSpec, env: dict[str, str], timeout_s: float) -> dict:
    """Run ``spec`` in a fresh interpreter with ``env`` on top of ours; the result, or {"error": ...}."""
    spec_path = Path(spec.out).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    Path(spec.out).unlink(missing_ok=True)
    # The benchmark's process group (no new session): whatever stops the benchmark stops its runs; their workers
    # leave when they see their parent gone (tensor_parallel.worker_main).
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path)], env={**os.environ, **env})
    try:
        code = proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if code != 0 or not Path(spec.out).is_file():
        return {"error": f"the run exited with code {code} (its output above says why)"}
    return json.loads(Path(spec.out).read_text())


def start_node1(plan_dir: str, size: int, device: str, port: int, env: dict[str, str], log_path: Path):
    """Node 1 of a two-"node" group: `trtopt serve --node-rank 1` (as the multi-node test starts it), its stderr to
    ``log_path``; it shares nothing with node 0 but 127.0.0.1:port."""
    args = [sys.executable, "-m", "trtopt.cli.main", "serve", plan_dir, "--device", device, "--tp", str(size),
            "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    with open(log_path, "w") as stderr:
        return subprocess.Popen(args, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=stderr)


def stop_node1(proc: subprocess.Popen) -> int:
    """Node 1's exit code: 0 after the driver's "stop"; killed (its ranks then leave) if it hangs."""
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---- results, report, plots ------------------------------------------------------------------------------------

class Results:
    """--work/results.json: every finished row, by model tag and run key (the one owner of that file). Rows of an
    earlier JSON of this script (``earlier``: the --out file, as the lead's tree holds it) fill in what --work lacks,
    so a call on a fresh machine keeps the rows of calls before it; --fresh ignores both."""

    def __init__(self, path: Path, fresh: bool, earlier: dict | None = None):
        self.path = path
        self.data: dict[str, dict] = {"rows": {}, "builds": {}, "nnodes": {}, "models": {}}
        if fresh:
            return
        if path.is_file():
            self.data.update(json.loads(path.read_text()))
        for name, entry in (earlier or {}).get("shapes", {}).items():
            if name not in SHAPES or "measured" not in entry:  # another layout (an older JSON): kept as it is
                continue
            for layers, measured in entry["measured"].items():
                tag = f"{name}-L{layers}"
                for key, row in measured["runs"].items():
                    self.data["rows"].setdefault(tag, {}).setdefault(key, row)
                if measured.get("build"):
                    self.data["builds"].setdefault(tag, {}).setdefault("info", measured["build"])
                counts = {*self.data["models"].get(name, []), int(layers)}
                self.data["models"][name] = sorted(counts, reverse=True)
            if "nnodes" in entry:
                tag = f"{name}-L{entry['nnodes']['layers']}"
                for key, row in {**entry["nnodes"]["rows"], "size": entry["nnodes"]["size"]}.items():
                    self.data["nnodes"].setdefault(tag, {}).setdefault(key, row)

    def done(self, section: str, tag: str, key: str) -> bool:
        """Whether that row is there and did not fail (a failed or timed-out row is measured again)."""
        row = self.data[section].get(tag, {}).get(key)
        return row is not None and "error" not in row

    def add_models(self, models: dict[str, list[Model]]) -> dict[str, list[Model]]:
        """Record this call's models beside earlier calls'; returns them all (the report covers every one)."""
        for name, built in models.items():
            self.data["models"][name] = sorted({*self.data["models"].get(name, []), *(m.shape.layers for m in built)},
                                               reverse=True)
        self.path.write_text(json.dumps(self.data))
        return {name: [Model(name, dataclasses.replace(SHAPES[name], layers=layers), name in TIED)
                       for layers in counts] for name, counts in self.data["models"].items()}

    def put(self, section: str, tag: str, key: str, value: dict) -> None:
        self.data[section].setdefault(tag, {})[key] = value
        self.path.write_text(json.dumps(self.data))


def report(results: Results, models: dict[str, list[Model]], full_layers: dict[str, int], meta: dict) -> dict:
    """The JSON: per shape, the measured rows of each layer count with their speedups, and (fewer layers than the
    full model) the per-layer costs and the numbers extrapolated to the full layer count."""
    data = {**meta, "shapes": {}}
    for name, built in models.items():
        entry: dict[str, Any] = {"shape": dataclasses.asdict(SHAPES[name]), "full_layers": full_layers[name],
                                 "tied": name in TIED, "measured": {}}
        by_key: dict[str, dict[int, dict]] = {}
        for model in built:
            runs = {k: v for k, v in results.data["rows"].get(model.tag, {}).items() if "error" not in v}
            failed = {k: v["error"] for k, v in results.data["rows"].get(model.tag, {}).items() if "error" in v}
            entry["measured"][str(model.shape.layers)] = {
                "build": results.data["builds"].get(model.tag, {}).get("info"), "runs": runs,
                "speedup": speedups(runs), **({"failed": failed} if failed else {})}
            for key, row in runs.items():
                by_key.setdefault(key, {})[model.shape.layers] = row
        target = full_layers[name]
        if by_key and all(m.shape.layers != target for m in built):
            runs = {key: extrapolate_run(rows, target) for key, rows in by_key.items()}
            flag_implausible(runs, by_key)
            flat = {key: {"batch1": {"decode_tok_s": r["batch1"]["decode_tok_s"]},
                          **({"workload": {"output_tok_s": r["workload"]["output_tok_s"]}}
                             if "output_tok_s" in r.get("workload", {}) else {})}
                    for key, r in runs.items() if "decode_tok_s" in r["batch1"]}
            entry["extrapolated"] = {
                "note": f"EXTRAPOLATED to {target} layers from measured plans of "
                        f"{sorted(m.shape.layers for m in built)} layers (per-token / wall time = fixed + layers x "
                        "per_layer); not measured",
                "to_layers": target, "runs": runs, "speedup": speedups(flat)}
        nnodes = results.data["nnodes"].get(built[0].tag) if built else None
        if nnodes:
            entry["nnodes"] = {"layers": built[0].shape.layers, **nnodes_summary(nnodes)}
        data["shapes"][name] = entry
    return data


def nnodes_summary(rows: dict) -> dict:
    """--nnodes 2 rows ("1node/<transport>", "2nodes/<transport>", "size") -> the rows and, per transport, the
    two-node / one-node batch-1 tok/s ratio."""
    ratios = {}
    for transport in sorted({k.split("/")[1] for k in rows if "/" in k}):
        one, two = rows.get(f"1node/{transport}", {}), rows.get(f"2nodes/{transport}", {})
        if "batch1" in one and "batch1" in two:
            ratios[transport] = two["batch1"]["decode_tok_s"] / one["batch1"]["decode_tok_s"]
    return {"size": rows.get("size"), "rows": {k: v for k, v in rows.items() if k != "size"},
            "two_over_one_batch1": ratios}


def series_of(runs: dict[str, dict]) -> dict[str, dict[int, tuple[float, float | None]]]:
    """Rows by run key -> path -> {N: (batch-1 tok/s, workload tok/s)}; the N=1 row starts every path's line."""
    series: dict[str, dict[int, tuple[float, float | None]]] = {}
    for key, row in runs.items():
        if "decode_tok_s" not in row["batch1"]:  # an extrapolation flagged unreliable (flag_implausible)
            continue
        plan, _, path = key.partition("/")
        n = int(plan.split("-")[0])
        label = f"{path or 'none'}{' vocab-head' if plan.endswith('vocab') else ''}"
        series.setdefault(label, {})[n] = (row["batch1"]["decode_tok_s"],
                                           (row.get("workload") or {}).get("output_tok_s"))
    one = series.pop("none", {}).get(1)
    if one is not None:
        for points in series.values():
            points.setdefault(1, one)
        if not series:
            series["N=1"] = {1: one}
    return series


def curves(entry: dict) -> list[tuple[str, str, dict]]:
    """(label suffix, line style, series) to draw for a shape: the largest measured layer count (solid), and the
    numbers extrapolated to the full model (dashed, labelled EXTRAPOLATED) when that count is below it."""
    out = []
    measured = {layers: m for layers, m in entry["measured"].items() if m["runs"]}
    if measured:
        layers = max(measured, key=int)
        extrapolated = "extrapolated" in entry
        out.append((f", {layers} layers measured" if extrapolated else "", "-o", series_of(measured[layers]["runs"])))
    if entry.get("extrapolated", {}).get("runs"):
        out.append((f", EXTRAPOLATED to {entry['full_layers']} layers", "--s",
                    series_of(entry["extrapolated"]["runs"])))
    return out


def plot(data: dict, path: Path) -> None:
    """tok/s vs N, one row per shape (batch-1 decode, workload), one line per all-reduce path; extrapolated
    numbers dashed and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = {name: curves(entry) for name, entry in data["shapes"].items() if "measured" in entry}
    shapes = {name: drawn for name, drawn in shapes.items() if drawn}
    if not shapes:
        return
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.8 * len(shapes)), squeeze=False)
    for row, (name, drawn) in enumerate(shapes.items()):
        for col, title in enumerate(("batch-1 decode tok/s", f"{data['workload']['requests']}-request output tok/s")):
            ax = axes[row][col]
            for suffix, style, series in drawn:
                for label, points in series.items():
                    ns = sorted(n for n in points if points[n][col] is not None)
                    ax.plot(ns, [points[n][col] for n in ns], style, label=f"{label}{suffix}")
            ax.set_xlabel("tensor-parallel ranks N")
            ax.set_xticks(sorted({n for _, _, series in drawn for p in series.values() for n in p}))
            drew = any(points[n][col] is not None for _, _, series in drawn for points in series.values()
                       for n in points)
            ax.set_title(f"{name}: {title}" if drew else f"{name}: {title} (not run)", fontsize=9)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.suptitle(f"tensor parallel, {data['gpu']} ({data['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(data: dict, path: Path) -> bool:
    """Each timed run (shape, layers, run key): every rank's first graphed decode steps on one clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{name} L{layers} {key}", row["timeline"]) for name, entry in data["shapes"].items()
              if entry.get("measured") for layers in [max(entry["measured"], key=int)]
              for key, row in entry["measured"][layers]["runs"].items()
              if row.get("timeline", {}).get("first_steps_us")]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.45 * max(len(t["first_steps_us"]) for _, t in panels)
                                                        * len(panels)), squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], panels):
        for rank, steps in timeline["first_steps_us"].items():
            ax.broken_barh([(start, end - start) for start, end in steps], (int(rank) - 0.4, 0.8),
                           facecolors=[f"C{i % 10}" for i in range(len(steps))], edgecolor="black", linewidth=0.3)
        offsets = {rank: stats["start_offset_us"]["median"] for rank, stats in timeline["per_rank"].items()}
        ax.set_yticks(range(len(offsets)), [f"rank {rank}: {offset:+.0f} µs" for rank, offset in offsets.items()])
        ax.set_title(f"{title}: step start/end per rank (median start offset from rank 0)", fontsize=9)
    axes[-1][0].set_xlabel("µs from rank 0's first plotted step (host clock; CUDA events, calibrated per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main ------------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="8b", help=f"comma-separated, of {', '.join(SHAPES)} (default 8b)")
    ap.add_argument("--sizes", type=parse_sizes, default=(1, 2, 4),
                    help="tensor-parallel sizes (default 1,2,4; those above the GPU count are dropped; N=1 of a "
                    "shape that does not fit one GPU too)")
    ap.add_argument("--layers", default=None,
                    help="build fewer layers: 8 (every shape) or 8b=8,70b=10; the rest is extrapolated")
    ap.add_argument("--fit-layers", type=int, default=2,
                    help="with --layers below the full count, the second layer count built for the line fit "
                    "(0: scale the one point proportionally)")
    ap.add_argument("--all-reduce", default="nccl",
                    help=f"comma-separated paths, each a run of every N > 1 with {ALL_REDUCE_ENV} set (nccl,p2p,auto)")
    ap.add_argument("--lm-head", choices=sorted(LM_HEADS), default="replicated",
                    help="the N > 1 plans' LM head (docs/architecture.md §7b); both: every N > 1 twice")
    ap.add_argument("--requests", type=int, default=None, help="the workload's requests (default 256; --smoke 8)")
    ap.add_argument("--no-workload", action="store_true", help="batch-1 decode only")
    ap.add_argument("--new-tokens", type=int, default=256, help="batch-1 decode tokens")
    ap.add_argument("--timeline-steps", type=int, default=32, help="graphed decode steps timed per rank (0: none)")
    ap.add_argument("--plot-steps", type=int, default=6, help="steps per rank kept in the JSON and drawn")
    ap.add_argument("--no-profile", action="store_true", help="skip the eager NCCL-share profile and the graphed kernel profile")
    ap.add_argument("--nnodes", type=int, default=1, choices=(1, 2),
                    help="2: only the two-node comparison: the largest --sizes as two 'nodes' of N/2 ranks vs one "
                    "node (batch-1 only; that plan alone is built)")
    ap.add_argument("--node-transport", default="local,net",
                    help="--nnodes 2: NCCL free (local) and/or its network transport only (net)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gb", type=float, default=30.0, help="KV pool per rank")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtopt-tp-e2e"),
                    help="plans, results.json and timelines (kept between calls: resume)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default docs/benchmarks/tp_e2e_<gpu>.json)")
    ap.add_argument("--fresh", action="store_true", help="re-measure rows already in --work/results.json")
    ap.add_argument("--build-only", action="store_true", help="make, export and build the plans, then stop")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite --out's JSON and plots from the rows it (and --work) holds: no GPU, nothing run")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no new build or run after this many seconds (0: none); the next call resumes")
    ap.add_argument("--run-timeout-s", type=float, default=300.0, help="a child run's limit (a failed row is "
                    "measured again by the next call)")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny shape (2 layers, hidden 256), 8 short requests, 8 timeline steps, "
                    "output under --work: the whole flow in a minute or two")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in what --smoke and the GPU count imply; check the lists."""
    shapes = ["tiny"] if args.smoke else [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    paths = [p.strip() for p in args.all_reduce.split(",") if p.strip()]
    bad = [p for p in paths if p not in ("nccl", "p2p", "auto")]
    transports = [t.strip() for t in args.node_transport.split(",") if t.strip()]
    if bad or not paths or any(t not in ("local", "net") for t in transports):
        raise SystemExit("--all-reduce takes nccl,p2p,auto; --node-transport takes local,net")
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    sizes = tuple(n for n in args.sizes if args.device == "cpu" or n <= gpus)
    if not sizes:
        raise SystemExit(f"--sizes {args.sizes}: none fits the {gpus} GPU(s) here")
    if args.nnodes == 2:
        if max(sizes) % 2:
            raise SystemExit(f"--nnodes 2 splits the largest size in two; --sizes {args.sizes} (GPUs: {gpus})")
        sizes = (max(sizes),)  # the two-node comparison alone: that plan, no fit point
    return argparse.Namespace(**{**vars(args), "shape_list": shapes, "paths": paths, "transports": transports,
                                 "work": args.work / "smoke" if args.smoke else args.work,  # its own rows
                                 "size_list": sizes, "layer_counts": parse_layers(args.layers, shapes),
                                 "requests": args.requests or (8 if args.smoke else 256),
                                 "kv_gb": min(args.kv_gb, 0.25) if args.smoke else args.kv_gb,
                                 "max_num_seqs": min(args.max_num_seqs, 16) if args.smoke else args.max_num_seqs,
                                 "timeline_steps": min(args.timeline_steps, 8) if args.smoke else args.timeline_steps,
                                 "new_tokens": min(args.new_tokens, 32) if args.smoke else args.new_tokens})


def models_for(args: argparse.Namespace) -> dict[str, list[Model]]:
    """Per shape: the built layer count, and the fit point when that is below the full count."""
    out = {}
    for name in args.shape_list:
        layers = args.layer_counts[name]
        counts = [layers]
        if layers < SHAPES[name].layers and args.fit_layers and args.fit_layers != layers and args.nnodes == 1:
            counts.append(args.fit_layers)
        out[name] = [Model(name, dataclasses.replace(SHAPES[name], layers=c), name in TIED) for c in counts]
    return out


def workload(args: argparse.Namespace) -> gpu_e2e.Workload:
    if args.smoke:
        return gpu_e2e.Workload(requests=args.requests, prompt_len=(8, 32), output_len=(4, 16))
    return gpu_e2e.Workload(requests=args.requests)


class Runner:
    """Builds and measures in order, saving every row; the one place that knows the deadline."""

    def __init__(self, args: argparse.Namespace, results: Results, write: Any):
        self.args, self.results, self.write = args, results, write
        self.start = time.monotonic()
        self.deadline = self.start + args.deadline_s if args.deadline_s else float("inf")
        self.hook = hook_dir(args.work)
        self.env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(self.hook), str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}

    def spec(self, model: Model, plan: dict, n: int, name: str, **kw: Any) -> RunSpec:
        args = self.args
        base = dict(plan_dir=plan["dir"], size=n, vocab=model.shape.vocab, device=args.device,
                    out=str(args.work / "runs" / f"{model.tag}_{name}.json"), kv_gb=args.kv_gb,
                    max_num_seqs=args.max_num_seqs, new_tokens=args.new_tokens,
                    workload=None if args.no_workload else dataclasses.asdict(workload(args)),
                    profile=not args.no_profile, timeline_dir=None, timeline_steps=args.timeline_steps,
                    plot_steps=args.plot_steps)
        if args.timeline_steps:  # N = 1 too: its step and gap between steps are the baseline
            base["timeline_dir"] = str(args.work / "timeline" / f"{model.tag}_{name}")
        return RunSpec(**{**base, **kw})

    def plans(self, model: Model) -> dict | None:
        args = self.args
        keys = [(n, head) for n in args.size_list for head in (("replicated",) if n == 1 else LM_HEADS[args.lm_head])]
        if 1 in args.size_list and args.device.startswith("cuda"):
            weight = shape_params(model.shape, model.tied) * 2
            total = torch.cuda.get_device_properties(0).total_memory
            if not fits_one_gpu(weight, args.kv_gb, total):
                log(f"{model.tag}: {weight / GIB:.1f} GiB of weights + {args.kv_gb} GiB KV do not fit one "
                    f"{total / GIB:.0f} GiB GPU: no N=1")
                keys = [k for k in keys if k[0] > 1]
        made = make_plans(args.work, model, torch.device(args.device if torch.cuda.is_available() else "cpu"),
                          args.max_num_seqs, keys, self.deadline)
        self.results.put("builds", model.tag, "info", made)
        return made

    def measure(self, model: Model, made: dict) -> None:
        args = self.args
        for key, plan in made["plans"].items():
            n = int(key.split("-")[0])
            head = plan["lm_head"]
            for path in (args.paths if n > 1 else [None]):
                row_key = run_key(n, head, path)
                if self.results.done("rows", model.tag, row_key) and not args.fresh:
                    continue
                if time.monotonic() > self.deadline:
                    log(f"deadline: {model.tag} {row_key} left for a later call")
                    return
                log(f"{model.tag} run {row_key}")
                spec = self.spec(model, plan, n, row_key.replace("/", "_"))
                env = {**self.env, **({ALL_REDUCE_ENV: path} if path else {})}
                row = run_child(spec, env, self.args.run_timeout_s)
                row.update(lm_head=head, weight_bytes_per_rank=plan["weight_bytes_per_rank"], size=n,
                           workload_spec=spec.workload, new_tokens=spec.new_tokens)
                self.results.put("rows", model.tag, row_key, row)
                self.write()

    def two_nodes(self, model: Model, made: dict) -> None:
        """The largest N over two "nodes" against one node, batch-1 only, per NCCL transport."""
        args = self.args
        n = max(args.size_list)
        plan = made["plans"].get(str(n))
        if plan is None:
            return
        section = self.results.data["nnodes"].get(model.tag, {})
        half = n // 2
        if section.get("size", n) != n:
            section.clear()
        for transport in args.transports:
            net = NET_ONLY if transport == "net" else {}
            env = {**self.env, ALL_REDUCE_ENV: "nccl", **net}
            for nodes in (1, 2):
                key = f"{nodes}node{'s' if nodes > 1 else ''}/{transport}"
                if self.results.done("nnodes", model.tag, key) and not args.fresh:
                    continue
                if time.monotonic() > self.deadline:
                    log(f"deadline: {model.tag} nnodes {key} left for a later call")
                    return
                self.results.put("nnodes", model.tag, "size", n)
                log(f"{model.tag} N={n} {key}")
                spec = self.spec(model, plan, n, f"nnodes_{key.replace('/', '_')}", workload=None, profile=False,
                                 timeline_dir=None, nnodes=nodes, master_port=free_port() if nodes > 1 else None)
                if nodes == 1:
                    row = run_child(spec, env, self.args.run_timeout_s)
                else:
                    visible = {} if args.device == "cpu" else {
                        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(half))}
                    other = {} if args.device == "cpu" else {
                        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(half, n))}
                    node1 = start_node1(plan["dir"], n, args.device, spec.master_port, {**env, **other},
                                        args.work / "runs" / f"{model.tag}_node1_{transport}.log")
                    row = run_child(spec, {**env, **visible}, self.args.run_timeout_s)
                    row["node1_exit"] = stop_node1(node1)
                self.results.put("nnodes", model.tag, key, row)
                self.write()


def main() -> None:
    args = _parser().parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    args = resolve(args)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "runs").mkdir(exist_ok=True)
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"
    slug = gpu_e2e.device_tag(gpu) if device.type == "cuda" else "cpu"
    out = args.out or (args.work / f"smoke_{slug}.json" if args.smoke else DOCS / f"tp_e2e_{slug}.json")
    earlier = json.loads(out.read_text()) if out.is_file() else None
    results = Results(args.work / "results.json", args.fresh and not args.report_only, earlier)
    models = {} if args.report_only else models_for(args)
    every = results.add_models(models)  # this call's and earlier calls' (same --work): the report covers all
    full_layers = {name: SHAPES[name].layers for name in every}
    meta = {"date": now(), "gpu": gpu, "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "torch": torch.__version__, "host": socket.gethostname(), "workload": dataclasses.asdict(workload(args)),
            "settings": {k: v for k, v in vars(args).items() if k in (
                "sizes", "all_reduce", "lm_head", "new_tokens", "timeline_steps", "kv_gb", "max_num_seqs",
                "fit_layers", "nnodes", "node_transport", "smoke")}}
    meta["settings"]["sizes"] = list(args.size_list)

    def write() -> None:
        data = report(results, every, full_layers, meta)
        for name, entry in (earlier or {}).get("shapes", {}).items():  # an older JSON's other shapes stay
            data["shapes"].setdefault(name, entry)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        plot(data, out.with_suffix(".png"))
        plot_timeline(data, out.with_name(out.stem + "_timeline.png"))

    if args.report_only:
        meta.update({k: earlier[k] for k in ("date", "gpu", "num_gpus", "torch", "host", "workload", "settings")
                     if earlier and k in earlier})
        write()
        log(f"rewrote {out} (+ .png, _timeline.png) from its rows")
        return
    runner = Runner(args, results, write)
    built = {model.tag: runner.plans(model) for name in models for model in models[name]}
    if args.build_only:
        log(f"plans in {args.work}")
        return
    for name in models:
        for model in models[name]:
            if args.nnodes == 2:
                runner.two_nodes(model, built[model.tag])
            else:
                runner.measure(model, built[model.tag])
    write()
    log(f"wrote {out} (+ .png, _timeline.png) in {time.monotonic() - runner.start:.0f} s")


if __name__ == "__main__":
    main()
