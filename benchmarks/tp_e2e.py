"""Tensor-parallel benchmark (issue 15): the same Llama-shaped random-weight bf16 model at N = 1 and N = 2, same run.

Shapes: gpu_e2e.py's ~1.24B (Llama-3.2-1B's shape), a 3.6B one (Llama-3.2-3B's layers, untied head) and an 8B shape (Llama-3.1-8B: 32 layers, hidden 4096, GQA
32/8, MLP 14336, vocab 128256, untied head), random weights. Each is made as an HF directory, exported once (bf16)
and built twice: unsharded (N = 1) and with `--tensor-parallel 2`. Then, for each N, through LLMEngine.from_plan
(CUDA graphs on, as served):

1. batch-1 decode tok/s (128-token prompt, 256 new tokens; gpu_e2e.batch1_decode);
2. the 256-request variable-length workload of gpu_e2e.py (continuous batching, max_num_seqs 256);
3. the NCCL kernel time per decode step from a torch.profiler trace of rank 0 (eager steps: NCCL kernels by name),
   next to the whole step's device time. In eager steps a NCCL kernel also waits for the peer rank to arrive, so
   this is an upper bound on communication; hence also
4. the all-reduce alone: two processes, one per GPU, replaying a CUDA graph of 2 x layers all-reduces of the
   decode step's [tokens, hidden] bf16 tensor (tokens 1, 64, 256): the communication a graphed step really pays.

Scaling efficiency = (throughput at N=2 / throughput at N=1) / 2, reported as measured. Needs two GPUs of one host
(nvidia-h200-x2); `--tiny --device cpu` runs the same code on the CPU with gloo in under a minute (a harness smoke
run, its numbers mean nothing).

The LM head (docs/architecture.md §7b): `--lm-head replicated` (default) measures N = 2 with the replicated head
(run "2"); `--lm-head vocab-parallel` with the vocabulary-parallel one (run "2-vocab": each rank holds vocab/2
columns, one all-gather of the sampled rows per step); `--lm-head both` builds and measures both in the same run.
Every run records its plan's weight bytes per rank (initializers of each rank's model.onnx).

    python3 benchmarks/tp_e2e.py                          # docs/benchmarks/tp_e2e_<gpu>.json + .png
    python3 benchmarks/tp_e2e.py --shapes 1b              # only the 1.24B shape
    python3 benchmarks/tp_e2e.py --lm-head both           # N=1, N=2 replicated head, N=2 vocab-parallel head
    python3 benchmarks/tp_e2e.py --tiny --device cpu      # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_e2e  # noqa: E402  (the shapes, workload and measuring functions are shared)

DOCS = ROOT / "docs" / "benchmarks"
SHAPES = {
    "1b": gpu_e2e.Shape(),
    "8b": gpu_e2e.Shape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    # Llama-3.2-3B's layers (28 x hidden 3072, GQA 24/8, MLP 8192) with an untied head, as the 8B has: the shape
    # that fits one device call's time where the 8B's export and three builds do not.
    "3b": gpu_e2e.Shape(layers=28, hidden=3072, heads=24, kv_heads=8, intermediate=8192, vocab=128256),
}
UNTIED = ("8b", "3b")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# run key -> (tensor_parallel for build_plan, lm_head); "1" is the unsharded plan.
RUNS = {"1": (None, "replicated"), "2": (2, "replicated"), "2-vocab": (2, "vocab-parallel")}
LM_HEAD_RUNS = {"replicated": ("1", "2"), "vocab-parallel": ("1", "2-vocab"), "both": ("1", "2", "2-vocab")}


def weight_bytes_per_rank(plan_dir: Path) -> list[int]:
    """Initializer bytes of each rank's model.onnx (the unsharded plan: one entry), read from the protos' dims and
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


def make_plans(work: Path, shape: gpu_e2e.Shape, device: torch.device, max_num_seqs: int, tied: bool,
               runs: tuple[str, ...] = ("1", "2")) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model

    hf_dir, onnx_dir = work / "hf", work / "onnx"
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )
    # Each stage is skipped when its output is complete (the marker file is written last), so an 8B build that
    # does not fit one device call's time limit goes on in the next call on the same warm machine.
    params_file = work / "params.json"
    if not params_file.is_file():
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(hf_dir)
        del model
        gc.collect()
        params_file.write_text(json.dumps({"params": params}))
    params = json.loads(params_file.read_text())["params"]
    log(f"HF model: {params / 1e9:.2f}B parameters")
    if not (work / "exported.ok").is_file():
        t = time.perf_counter()
        export_model(hf_dir, onnx_dir, dtype="bf16", verify_outputs=False, force=True)
        (work / "exported.ok").write_text(f"{time.perf_counter() - t:.1f}\n")
        log(f"exported ({time.perf_counter() - t:.1f} s)")
    limits = Limits(block_size=16, max_num_tokens=8192, max_num_seqs=max_num_seqs, max_model_len=2048)
    plans = {}
    for key in runs:
        tensor_parallel, lm_head = RUNS[key]
        plan_dir, done = work / f"plan_tp{key}", work / f"plan_tp{key}.json"
        if not done.is_file():
            t = time.perf_counter()
            result = build_plan(onnx_dir, plan_dir, force=True, progress=False, limits=limits,
                                tensor_parallel=tensor_parallel, lm_head=lm_head)
            done.write_text(json.dumps({"dir": str(result.plan_dir), "build_s": time.perf_counter() - t,
                                        "layout": result.parallel.summary() if result.parallel else None,
                                        "lm_head": lm_head, "weight_bytes_per_rank": weight_bytes_per_rank(plan_dir)}))
        plans[key] = json.loads(done.read_text())
        if "weight_bytes_per_rank" not in plans[key]:  # a marker written before the LM-head runs existed
            plans[key].update(lm_head=lm_head, weight_bytes_per_rank=weight_bytes_per_rank(plan_dir))
        log(f"built {key} ({plans[key]['build_s']:.1f} s, weights per rank "
            f"{[round(b / 2**30, 3) for b in plans[key]['weight_bytes_per_rank']]} GiB)")
    shutil.rmtree(onnx_dir, ignore_errors=True)
    shutil.rmtree(hf_dir, ignore_errors=True)
    return {"params": params, "plans": plans}


def all_reduce_profile(engine, vocab: int, steps: int = 8) -> dict | None:
    """Rank 0's device time per eager decode step, and the part of it in NCCL kernels (the all-reduces)."""
    from torch.profiler import ProfilerActivity, profile

    from trtopt.runtime.sampling_params import SamplingParams

    if not torch.cuda.is_available():
        return None
    prompt = list(range(5, 133))
    engine.add_request("prof", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0))
    engine.step()  # prefill
    executor = engine.executor
    graphs = executor.graphs
    was_enabled = bool(graphs and graphs.enabled)

    def set_graphs(flag: bool) -> None:  # on every rank at once for a tensor-parallel executor
        executor.set_cuda_graphs(flag)

    set_graphs(False)  # eager: the profiler sees every kernel
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        set_graphs(was_enabled)
    while engine.has_unfinished_requests():
        engine.step()
    total = nccl = 0.0
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if event.device_type.name != "CUDA":
            continue
        total += device_us
        if "nccl" in event.key.lower() or "allreduce" in event.key.lower():
            nccl += device_us
    return {"eager_steps": steps, "device_ms_per_step": total / steps / 1e3,
            "nccl_kernel_ms_per_step": nccl / steps / 1e3, "nccl_share": nccl / total if total else None}


def _all_reduce_rank(rank: int, port: int, hidden: int, calls: int, tokens: tuple, out) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    result = {}
    for t in tokens:
        x = torch.ones(t, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                dist.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        result[str(t)] = {"ms_per_step": ms, "us_per_call": ms / calls * 1e3}
        del graph
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def all_reduce_alone(hidden: int, layers: int, tokens: tuple = (1, 64, 256)) -> dict | None:
    """The all-reduces of one step (2 per layer), graphed, on two GPUs in lockstep: their real cost."""
    import socket

    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, hidden, 2 * layers, tokens, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=300)
    for proc in procs:
        proc.join(timeout=60)
    return result


def run_size(plan_dir: Path, n: int, device: torch.device, requests, vocab: int, args, label: str = "") -> dict:
    from trtopt.runtime.engine import LLMEngine

    label = label or f"N={n}"
    t = time.perf_counter()
    engine = LLMEngine.from_plan(plan_dir, device=str(device), tensor_parallel_size=n if n > 1 else None,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
                                 kv_cache_memory_gb=args.kv_gb, enable_prefix_caching=False)
    out: dict = {"start_s": time.perf_counter() - t, "num_blocks": engine.limits.num_blocks}
    try:
        out["batch1"] = gpu_e2e.batch1_decode(engine, vocab, device)
        log(f"{label} batch-1 decode: {out['batch1']['decode_tok_s']:.1f} tok/s")
        out["profile"] = all_reduce_profile(engine, vocab)
        if out["profile"]:
            log(f"{label} eager step {out['profile']['device_ms_per_step']:.2f} ms on rank 0, NCCL kernels "
                f"{out['profile']['nccl_kernel_ms_per_step']:.3f} ms (incl. waiting for the peer)")
        out["workload"] = gpu_e2e.run_engine(engine, requests, wave=None, device=device)
        log(f"{label} workload: {out['workload']['output_tok_s']:.0f} output tok/s")
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(data["shapes"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    runs = [k for k in RUNS if any(k in data["shapes"][s]["runs"] for s in shapes)]  # a shape without a run: no bar
    labels = {"1": "N=1", "2": "N=2", "2-vocab": "N=2, vocab-parallel head"}
    for ax, (key, label) in zip(axes, (("batch1", "batch-1 decode tok/s"), ("workload", "256-request output tok/s"))):
        width = 0.8 / len(runs)
        for i, run in enumerate(runs):
            values = [data["shapes"][s]["runs"][run][key]["decode_tok_s" if key == "batch1" else "output_tok_s"]
                      if run in data["shapes"][s]["runs"] else 0.0 for s in shapes]
            offset = (i - (len(runs) - 1) / 2) * width
            ax.bar([x + offset for x in range(len(shapes))], values, width, label=labels[run])
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_title(label)
        ax.legend()
    fig.suptitle(f"tensor parallel, {data['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", nargs="*", default=["1b", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="a small model and workload (a smoke run of the harness)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtopt-tp-e2e"))
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gb", type=float, default=30.0, help="KV pool per rank")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default docs/benchmarks/tp_e2e_<gpu>.json); shapes already in it and not run "
                    "now are kept, each with its own date")
    ap.add_argument("--lm-head", choices=sorted(LM_HEAD_RUNS), default="replicated",
                    help="the N=2 runs: replicated head (\"2\"), vocab-parallel head (\"2-vocab\"), or both")
    ap.add_argument("--build-only", action="store_true",
                    help="make, export and build the plans in --work and stop (a later call measures them)")
    args = ap.parse_args()
    device = torch.device(args.device)
    shapes = {"tiny": gpu_e2e.TINY} if args.tiny else {s: SHAPES[s] for s in args.shapes}
    workload = gpu_e2e.Workload(requests=args.requests or (8 if args.tiny else 256),
                                **({"prompt_len": (8, 32), "output_len": (4, 16)} if args.tiny else {}))
    if args.tiny:
        args.kv_gb = min(args.kv_gb, 0.25)
        args.max_num_seqs = min(args.max_num_seqs, 16)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
            "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0, "torch": torch.__version__,
            "workload": dataclasses.asdict(workload), "shapes": {}}
    for name, shape in shapes.items():
        work = args.work / name
        work.mkdir(parents=True, exist_ok=True)
        keys = LM_HEAD_RUNS[args.lm_head]
        made = make_plans(work, shape, device, args.max_num_seqs, tied=(name not in UNTIED), runs=keys)
        if args.build_only:
            continue
        requests = workload.make(shape.vocab)
        alone = all_reduce_alone(shape.hidden, shape.layers) if device.type == "cuda" else None
        if alone:
            log(f"{name}: graphed all-reduces of one step, per token count: {alone}")
        runs = {}
        for key in keys:
            runs[key] = run_size(made["plans"][key]["dir"], RUNS[key][0] or 1, device, requests, shape.vocab, args,
                                 label=f"run {key}")
            runs[key].update(lm_head=made["plans"][key]["lm_head"],
                             weight_bytes_per_rank=made["plans"][key]["weight_bytes_per_rank"])
        one = runs["1"]
        efficiency = {key: {"batch1_decode": runs[key]["batch1"]["decode_tok_s"] / one["batch1"]["decode_tok_s"] / 2,
                            "workload": runs[key]["workload"]["output_tok_s"] / one["workload"]["output_tok_s"] / 2}
                      for key in keys if key != "1"}
        data["shapes"][name] = {
            "date": data["date"], "shape": dataclasses.asdict(shape), "params": made["params"],
            "layouts": {key: made["plans"][key]["layout"] for key in keys if key != "1"}, "runs": runs,
            "all_reduce_graphed": alone,
            # "2" alone keeps the key earlier JSONs had; every N=2 run is under "by_run"
            "scaling_efficiency": {**efficiency.get("2", {}), "by_run": efficiency},
        }
        log(f"{name}: scaling efficiency {efficiency}")
        shutil.rmtree(work)
    if args.build_only:
        log(f"plans built in {args.work}")
        return
    slug = "tiny_cpu" if args.tiny else gpu.lower().replace("nvidia ", "").split()[0]
    out = args.out or DOCS / f"tp_e2e_{slug}.json"
    if out.is_file():  # keep the shapes of an earlier run that this one did not measure
        earlier = json.loads(out.read_text())
        for name, entry in earlier.get("shapes", {}).items():
            entry.setdefault("date", earlier.get("date"))
            data["shapes"].setdefault(name, entry)
    out.write_text(json.dumps(data, indent=2) + "\n")
    if not args.tiny:
        plot(data, out.with_suffix(".png"))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
