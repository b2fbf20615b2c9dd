"""End-to-end GPU benchmark (issue 6): a Llama-shaped random-weight bf16 plan of ~1.2B parameters.

The model has Llama-3.2-1B's shape (16 layers, hidden 2048, GQA 32/8, MLP 8192, vocab 128256, tied embeddings) and
random weights. It is made here, saved as an HF directory, exported with `trtopt export` (dynamo, bf16) and built
with `trtopt build`; the same HF directory is loaded by transformers for the baseline. Every baseline runs in the
same process, on the same GPU, in the same run:

1. **Batch-1 decode vs the HBM roofline.** One request (128-token prompt, 256 new tokens) through `LLMEngine` with
   CUDA graphs. Roofline = bytes one decode step must read (every weight once, tied embedding counted once, plus
   the KV cache) / device-to-device copy bandwidth measured here (bytes read + written).
2. **Variable-length workload vs HF `generate` with static batching.** 256 requests, prompt lengths uniform in
   [64, 1024], output lengths uniform in [32, 512], seeded; EOS ignored so every engine generates exactly the
   requested tokens. HF runs the requests in arrival order in static batches (left padding, each batch runs to its
   longest output), as vLLM's `benchmark_throughput --backend hf` does; several batch sizes, the best is reported.
   Throughput = requested output tokens / wall time (padding and overshoot count for nothing).
3. **Continuous vs static batching in our engine**, at the same maximum batch: static = waves of B requests, the
   next wave starts when the whole wave is done; continuous = all requests queued, refilled every step.
4. **Async scheduling vs the synchronous loop** (`--scheduling both`, the default): batch 1 and every workload run
   of 3 once with one step in flight (the plain keys) and once synchronously (the `*_sync` keys), same run.
   host_ms_per_step is the wall time the GPU did not run the model, per step: all the host work when synchronous,
   only the exposed part with async scheduling.
5. **FP8 KV cache vs bf16 KV** (section `fp8_kv`; `--only fp8_kv` runs it alone): two more plans from the same
   export with max_model_len 8192, one with bf16 pools and one built with `kv_cache_dtype="fp8"` (float8_e4m3fn
   pools, scales 1.0). Batch-1 decode at a 128-token and a 7936-token prompt, then the workload at one KV budget
   small enough that the bf16 pools hold about a quarter of what its requests want at once (`--fp8-kv-gb`): output
   tok/s, the most sequences running at once, preemptions, and the blocks each engine allocated (2x by
   construction). Written to its own fp8_kv_e2e_<gpu>.json + .png (and under "fp8_kv" in the full run's JSON).

6. **Quantized plans vs bf16** (section `quant`; `--only quant` runs it with the main plan as its bf16 row): the same
   export quantized by `trtopt quantize --method rtn` (random weights: nothing to calibrate on) as FP8 W8A8 with
   dynamic per-token activation scales, FP8 weight-only and INT4 g128 weight-only, each built with the main plan's
   limits; batch-1 decode and the workload (warmed up on a quarter of the requests, then timed whole) per plan, one
   engine at a time, the KV budget of the main plan. Written to quant_e2e_workload_<gpu>.json (issue 32's
   workload row).

The engine runs without a tokenizer (token ids in, token ids out), as HF does here; nothing is detokenized.

    python3 benchmarks/gpu_e2e.py                      # on the GPU machine: docs/benchmarks/gpu_e2e_<gpu>.json + .png
    python3 benchmarks/gpu_e2e.py --tiny --device cpu  # a few-second smoke run of the same code on the CPU
    python3 benchmarks/gpu_e2e.py --only fp8_kv        # the FP8 KV rows alone: docs/benchmarks/fp8_kv_e2e_<gpu>.json
    python3 benchmarks/gpu_e2e.py --only quant         # quantized plans: docs/benchmarks/quant_e2e_workload_<gpu>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DOCS = ROOT / "docs" / "benchmarks"


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    vocab: int = 128256


TINY = Shape(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=2048)


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int = 256
    prompt_len: tuple[int, int] = (64, 1024)
    output_len: tuple[int, int] = (32, 512)
    seed: int = 0

    def make(self, vocab: int) -> list[tuple[list[int], int]]:
        """[(prompt token ids, output length)], the same for every engine."""
        rng = random.Random(self.seed)
        reqs = []
        for _ in range(self.requests):
            n = rng.randint(*self.prompt_len)
            reqs.append(([rng.randrange(vocab) for _ in range(n)], rng.randint(*self.output_len)))
        return reqs


@dataclasses.dataclass(frozen=True)
class KVSection:
    """The fp8_kv section's settings: its plans' max_model_len, the batch-1 prompts and the workload's KV budget."""

    max_model_len: int = 8192
    prompt_lens: tuple[int, ...] = (128, 7936)  # batch-1 decode; the long one fills max_model_len with new_tokens
    new_tokens: int = 256
    budget_fraction: float = 0.25  # of the blocks the workload's requests want at once, in bf16 blocks
    warmup_fraction: float = 0.25  # of the requests, run once per engine before the timed pass


TINY_KV = KVSection(max_model_len=256, prompt_lens=(32, 192), new_tokens=64)

# The quant section's plans: row -> trtopt.quantize.QuantizeConfig keywords (RTN: random weights have nothing to
# calibrate on, and W8A8's dynamic scales need no calibration either; ORT's CPU provider cannot run a bf16 export).
QUANT_ROWS = {"fp8_w8a8": dict(weights="fp8", activations="fp8", activation_scales="dynamic"),
              "fp8": dict(weights="fp8"),
              "int4_g128": dict(weights="int4", group_size=128)}
TINY_INT4_GROUP = 32  # the tiny shape's K of 256 takes it
# Ablation rows of the quant section: row -> the QUANT_ROWS plan it runs with the torch executor's fold of the INT4
# GEMV's x packing into the op before it switched off (runtime/executors/qmatmul_packing.py, rewrite 5).
QUANT_ABLATIONS = {"int4_g128_x_unfolded": "int4_g128"}

# Sections every run has unless skipped; with all of them skipped (--only fp8_kv) the 2048-token plan is not built
# and the run's JSON is fp8_kv_e2e_<gpu>.json alone.
MAIN_SECTIONS = ("batch1", "static", "continuous", "hf")


def device_tag(name: str) -> str:
    """The device's short name for file names: the first model-number word ("NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA H200" -> "h200"), else the last word."""
    words = name.split()
    return next((w for w in words if re.fullmatch(r"[A-Z]+\d+[A-Za-z]*", w)), words[-1]).lower()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the model -------------------------------------------------------------------------------------------------

def make_hf_dir(out: Path, shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """A random-weight LlamaForCausalLM (bf16 by default) saved at `out`. Returns its parameter count (tied counted
    once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        # 8192: the fp8_kv section's long prompt (the export does not depend on it; the other plans stay at 2048)
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.2B parameters on the GPU takes a second, on the CPU a minute
        model = LlamaForCausalLM(config).to(dtype)
    n = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    model.save_pretrained(out)
    del model
    return n


# What the torch executor does on top of the plan, measured like the plan passes (same plan, another executor):
# name -> (row name, TorchExecutor keywords of the variant). rope_kv is on by default (the row turns it off).
# (Session 8 removed two opt-in variants the H200 measured slower at batch 1: `linear_weights`, [N, K] weights via
# F.linear, 1.141 vs 1.120 ms per step, and `small_m_gemv`, Triton GEMVs, 1.439 ms; GPU_E2E.md. Session 13's
# decode GEMVs, another kernel design for one-row steps, measured faster and are on by default: decode_gemv.)
EXECUTOR_VARIANTS = {"rope_kv": ("without_rope_kv", {"fuse_rope_kv": False}),
                     "decode_gemv": ("without_decode_gemv", {"decode_gemv": False}),
                     "gemv_rope_kv": ("without_gemv_rope_kv", {"gemv_rope_kv": False})}


def build_without(onnx_dir: Path, plan_dir: Path, rule: str, limits) -> None:
    """An ablation plan: the same export built with a plan-level fusion pass turned off (`--disable-pass`); `rule`
    may name several joined by "+" (e.g. "silu_mul+add_rms_norm+rope", compile_study.py's unfused plan)."""
    from trtopt.builder.pipeline import build_plan

    build_plan(onnx_dir, plan_dir, force=True, progress=False, limits=limits, disable_passes=tuple(rule.split("+")))


# Ablations that flip an option of the object that owns it (same plan, same executor): the greedy argmax kernel
# (torch.argmax instead: the executor's `argmax_kernel` for its graphs, the engine sampler's for eager steps),
# PagedAttention's split-KV merge inside the attention launch (a second merge launch instead: the executor's
# PagedLaunchState), and the placeholder fill and greedy argmax inside each step graph (the executor's
# `argmax_in_graph`: launched from Python between replays instead).
RUNTIME_SWITCHES = ("argmax", "merge_in_kernel", "argmax_in_graph")


def set_switch(rule: str, on: bool, executor) -> None:
    """Turn `rule` on or off in `executor` (the argmax options are read when the next engine captures its graphs;
    the argmax kernel of an engine's sampler is that engine's own: see the ablation loop)."""
    if rule == "argmax":
        executor.argmax_kernel = on
    elif rule == "argmax_in_graph":
        executor.argmax_in_graph = on
    else:
        state = executor.paged_state  # the torch executor's (None off CUDA: no Triton attention to switch)
        if state is not None:
            state.merge_in_kernel = on
            state.clear_plans()  # plans hold their launches


def build(work: Path, shape: Shape, device: torch.device, max_num_seqs: int,
          ablate: tuple[str, ...] = (), *, main_plan: bool = True,
          kv_max_model_len: int | None = None, quant: bool = False) -> tuple[Path, Path | None, int, dict]:
    """The HF dir, its export and the plans: the main one (work/plan, unless main_plan=False), the ablation plans,
    with kv_max_model_len the fp8_kv section's pair work/plan-kv-auto (bf16 pools) and work/plan-kv-fp8, and with
    quant the quant section's work/plan-q-<row> (QUANT_ROWS, the main plan's limits)."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model

    hf_dir, onnx_dir, plan_dir = work / "hf", work / "onnx", work / "plan"
    times = {}
    t = time.perf_counter()
    params = make_hf_dir(hf_dir, shape, device)
    times["make_hf_s"] = time.perf_counter() - t
    log(f"HF model: {params / 1e9:.3f}B parameters ({times['make_hf_s']:.1f} s)")
    t = time.perf_counter()
    # onnxruntime's CPU provider has no bf16 kernels, so the export cannot be verified there (tests/e2e checks bf16).
    export_model(hf_dir, onnx_dir, dtype="bf16", verify_outputs=False, force=True)
    times["export_s"] = time.perf_counter() - t
    log(f"exported ({times['export_s']:.1f} s)")
    if kv_max_model_len is not None:
        kv_limits = Limits(block_size=16, max_num_tokens=8192, max_num_seqs=max_num_seqs,
                           max_model_len=kv_max_model_len)
        for kv_dtype in ("auto", "fp8"):
            t = time.perf_counter()
            result = build_plan(onnx_dir, work / f"plan-kv-{kv_dtype}", force=True, progress=False,
                                limits=kv_limits, kv_cache_dtype=kv_dtype)
            times[f"build_kv_{kv_dtype}_s"] = time.perf_counter() - t
            log(f"built the fp8_kv section's plan, KV cache {result.config.kv_pool_dtype} "
                f"({times[f'build_kv_{kv_dtype}_s']:.1f} s)")
    if not main_plan:
        shutil.rmtree(onnx_dir)
        return hf_dir, None, params, times
    t = time.perf_counter()
    limits = Limits(block_size=16, max_num_tokens=8192, max_num_seqs=max_num_seqs, max_model_len=2048)
    result = build_plan(onnx_dir, plan_dir, force=True, progress=False, limits=limits)
    times["build_s"] = time.perf_counter() - t
    log(f"built: {result.report.counts} ({times['build_s']:.1f} s)")
    for rule in ablate:
        if rule in EXECUTOR_VARIANTS or rule in RUNTIME_SWITCHES:
            continue  # the same plan, run by another executor (or sampler, or attention merge)
        build_without(onnx_dir, work / f"plan-without-{rule}", rule, limits)
        log(f"built the ablation plan without {rule}")
    if quant:
        from trtopt.quantize import QuantizeConfig, quantize_model

        for row, config in QUANT_ROWS.items():
            if "group_size" in config and shape.hidden % config["group_size"]:
                config = {**config, "group_size": TINY_INT4_GROUP}
            t = time.perf_counter()
            q = quantize_model(onnx_dir, work / f"q-{row}", QuantizeConfig(**config), force=True)
            times[f"quantize_{row}_s"] = time.perf_counter() - t
            t = time.perf_counter()
            result = build_plan(q.out_dir, work / f"plan-q-{row}", force=True, progress=False, limits=limits)
            times[f"build_q_{row}_s"] = time.perf_counter() - t
            shutil.rmtree(q.out_dir)
            log(f"quantized ({row}, {times[f'quantize_{row}_s']:.1f} s) and built: "
                f"{result.report.counts.get('qmatmul')} QMatMuls ({times[f'build_q_{row}_s']:.1f} s)")
    shutil.rmtree(onnx_dir)  # the plan holds its own copy of the weights
    return hf_dir, plan_dir, params, times


# ---- instrumentation ------------------------------------------------------------------------------------------

class StepTimer:
    """Wraps an engine's executor and sampler to split each step's wall time.

    gpu_ms: CUDA-event time from the start of `execute` to the end of the logits (the device's busy time for the
    model); host_ms: everything else the step's thread did (scheduling, packing, sampling, bookkeeping), measured as
    wall time minus the time spent waiting for the GPU inside the sampler's first device->host read.
    """

    def __init__(self, engine, device: torch.device):
        self.engine, self.device = engine, device
        self.cuda = device.type == "cuda"
        self.events: list[tuple] = []
        self.execute_wall = 0.0
        executor = engine.executor
        inner_execute = executor.execute

        graphs = executor.graphs

        def execute(step):
            start = time.perf_counter()
            replayed = graphs.num_replayed if graphs else 0
            if self.cuda:
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
            logits = inner_execute(step)
            if self.cuda:
                b.record()
                self.events.append((a, b, bool(graphs and graphs.num_replayed > replayed)))
            self.execute_wall += time.perf_counter() - start
            return logits

        executor.execute = execute

    def restore(self) -> None:
        del self.engine.executor.execute

    def gpu_seconds(self, graphed: bool | None = None) -> float:
        """Device time of the model over the steps (only graph-replayed or only eager ones, if asked)."""
        sync(self.device)
        return sum(a.elapsed_time(b) for a, b, g in self.events if graphed is None or g == graphed) / 1e3

    def num_steps(self, graphed: bool) -> int:
        return sum(g == graphed for *_, g in self.events)


# ---- our engine ------------------------------------------------------------------------------------------------

def make_engine(executor, plan, *, max_num_seqs: int, kv_gb: float, max_num_batched_tokens: int = 8192,
                async_scheduling: bool | None = None):
    from trtopt.runtime.config import EngineConfig
    from trtopt.runtime.engine import LLMEngine

    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          kv_cache_memory_gb=kv_gb, enable_prefix_caching=False, async_scheduling=async_scheduling)
    return LLMEngine(executor, plan, None, config)


def run_engine(engine, requests: list[tuple[list[int], int]], *, wave: int | None, device: torch.device) -> dict:
    """Generate every request; wave=None queues them all at once (continuous), wave=B runs static waves of B."""
    from trtopt.runtime.sampling_params import SamplingParams

    timer = StepTimer(engine, device)
    preemptions_before = engine.stats().num_preemptions
    waves = [requests] if wave is None else [requests[i:i + wave] for i in range(0, len(requests), wave)]
    out_tokens, steps, batch_sizes = 0, 0, []
    sync(device)
    start = time.perf_counter()
    for w, chunk in enumerate(waves):
        for i, (prompt, n_out) in enumerate(chunk):
            # FINAL_ONLY, as LLM.generate (and vLLM's offline benchmark) runs: one output per request, at the end.
            engine.add_request(f"w{w}-{i}", {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0, output_kind="final_only"))
        while engine.has_unfinished_requests():
            batch_sizes.append(len(engine.scheduler.running))
            for out in engine.step():
                if out.finished:
                    out_tokens += len(out.outputs[0].token_ids)
            steps += 1
    sync(device)
    wall = time.perf_counter() - start
    gpu = timer.gpu_seconds()
    split = {}
    if timer.events:
        for kind, graphed in (("graphed", True), ("eager", False)):
            n = timer.num_steps(graphed)
            split[f"{kind}_steps"] = n
            split[f"{kind}_gpu_ms_per_step"] = timer.gpu_seconds(graphed) / n * 1e3 if n else None
    timer.restore()
    expected = sum(n for _, n in requests)
    assert out_tokens == expected, (out_tokens, expected)
    st = engine.stats()
    assert st.num_blocks_free == st.num_blocks_total, "KV blocks leaked"
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "wall_s": wall, "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "output_tok_s": out_tokens / wall, "total_tok_s": (out_tokens + prompt_tokens) / wall,
        "steps": steps, "mean_running": sum(batch_sizes) / max(1, len(batch_sizes)),
        "max_running": max(batch_sizes, default=0), "preemptions": st.num_preemptions - preemptions_before,
        "num_blocks_total": st.num_blocks_total,
        "gpu_busy_s": gpu, "gpu_busy_frac": gpu / wall if gpu else None,
        # The wall time the GPU did not run the model, per step: all of the host work in the synchronous loop, only
        # the part left exposed (not overlapped with the previous step) with async scheduling.
        "host_ms_per_step": (wall - gpu) / steps * 1e3 if gpu else None,
        "step_ms": wall / steps * 1e3, "async_scheduling": engine.async_scheduling, "output_kind": "final_only",
        "cuda_graphs": bool(engine.executor.graphs and engine.executor.graphs.enabled),
        **split,
    }


def _fill_by_pad_step(graphs, step, bucket) -> None:
    """Ablation of StepGraphs._fill: the step padded into new CPU tensors (pad_step) and copied from pageable memory,
    as the first version of every-step graphs did."""
    from trtopt.runtime.batch import fill_placeholders_
    from trtopt.runtime.executors.cuda_graphs import pad_step
    from trtopt.signature import INPUT_IDS

    padded = pad_step(step, bucket, graphs.max_blocks_per_seq)
    inputs = graphs.device_inputs(bucket)
    for name, view in inputs.items():
        view.copy_(getattr(padded, name), non_blocking=True)
    if step.sampled_ids is not None:  # async scheduling's placeholders, as StepGraphs._fill fills them
        fill_placeholders_(inputs[INPUT_IDS.name], step.sampled_ids)


def timed_workload(executor, plan, requests, *, max_batch: int, wave: int | None, kv_gb: float, device: torch.device,
                   variant: str = "default", async_scheduling: bool | None = None) -> dict:
    """One engine at `max_batch`: a warm-up pass of the whole workload, then the timed pass. `variant` ablates:
    "decode_only" graphs only steps of one token per sequence; "pad_step" stages inputs the unpinned way;
    "argmax_outside" leaves the placeholder fill and the greedy argmax out of the step graphs (launched from Python)."""
    if variant == "argmax_outside":
        set_switch("argmax_in_graph", False, executor)  # read by the StepGraphs the engine captures
    try:
        engine = make_engine(executor, plan, max_num_seqs=max_batch, kv_gb=kv_gb, async_scheduling=async_scheduling)
    finally:
        set_switch("argmax_in_graph", True, executor)
    graphs = executor.graphs
    if graphs is not None:
        graphs.decode_only = variant == "decode_only"
        if variant == "pad_step":
            graphs._fill = lambda step, bucket: _fill_by_pad_step(graphs, step, bucket)
    # Warm-up: the whole workload once, so that every prefill shape's Triton and cuBLAS kernels are compiled and
    # chosen before the timed pass (a first pass measured 100 ms eager steps against 35 ms warm on the H200).
    run_engine(engine, requests, wave=wave, device=device)
    gc.collect()
    gc.freeze()  # as `trtopt serve` does after start-up
    try:
        r = run_engine(engine, requests, wave=wave, device=device)
    finally:
        gc.unfreeze()
    r["max_batch"] = max_batch
    report = graphs.capture_report if graphs is not None else None
    if report is not None:
        r["graph_capture"] = {"graphs": report.num_graphs, "seconds": report.seconds,
                              "pool_MiB": report.pool_bytes / 2**20,
                              "max_tokens": graphs.buckets[-1].num_tokens}
    return r


def batch1_decode(engine, vocab: int, device: torch.device, new_tokens: int = 256, prompt_len: int = 128) -> dict:
    """Decode tokens/s of one request, timed from its first output token to its last (prefill excluded)."""
    from trtopt.runtime.sampling_params import SamplingParams

    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b1", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0))
    stamps = []  # when each token reached the host (with async scheduling a step reports the previous one's token)
    timer = StepTimer(engine, device)
    gc.collect()
    gc.freeze()  # as `trtopt serve` does after start-up (and timed_workload): no full collection of start-up objects
    try:
        while engine.has_unfinished_requests():
            if engine.step():
                stamps.append(time.perf_counter())
    finally:
        gc.unfreeze()
    gpu = timer.gpu_seconds() - (timer.events[0][0].elapsed_time(timer.events[0][1]) / 1e3 if timer.events else 0)
    timer.restore()
    decode_steps = len(stamps) - 1  # the first token came from the prefill
    wall = stamps[-1] - stamps[0]
    graphs = engine.executor.graphs
    return {
        "prompt_len": prompt_len, "new_tokens": new_tokens, "decode_tok_s": decode_steps / wall,
        "ms_per_token": wall / decode_steps * 1e3,
        "gpu_ms_per_token": gpu / decode_steps * 1e3 if device.type == "cuda" else None,
        "cuda_graphs": bool(graphs and graphs.enabled and graphs._captured),
        "async_scheduling": engine.async_scheduling,
        # Wall time per token the GPU did not run the model (all host work when synchronous, the exposed part async).
        "host_ms_per_token": (wall - gpu) / decode_steps * 1e3 if device.type == "cuda" else None,
    }


def profile_decode(engine, vocab: int, device: torch.device, steps: int = 4, graphed: bool = False) -> dict | None:
    """The kernels of batch-1 decode steps: how many per step, and where the device time goes, by kernel name.
    graphed=False: graphs off for the profile (every kernel launched from Python, the issue's count); True: the
    served step, its graph replay (CUPTI records each kernel of a replayed graph) plus what the engine launches
    around it (the input copy, the placeholder fill, the logits copy, the sampler)."""
    from torch.profiler import ProfilerActivity, profile

    from trtopt.runtime.sampling_params import SamplingParams

    graphs = engine.executor.graphs
    if device.type != "cuda" or graphs is None:
        return None
    engine.add_request("prof", {"prompt_token_ids": list(range(3, 67))},
                       SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0))
    while not any(out.outputs[0].token_ids for out in engine.step()):
        pass  # prefill, in one step or in chunks (max_num_batched_tokens < 64)
    enabled, graphs.enabled = graphs.enabled, graphed
    try:
        # A first eager decode step outside the profile: Triton compiles its T=1 variants (and torch.compile, under
        # TorchExecutor(compile_mode=...), this shape), so that no compile-time launch lands in the profile.
        engine.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync(device)
    finally:
        graphs.enabled = enabled
    while engine.has_unfinished_requests():
        engine.step()
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.count and t and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            kernels.append({"name": e.key[:90], "per_step": e.count / steps, "us_per_step": t / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    return {"steps": steps, "kernels_per_step": sum(k["per_step"] for k in kernels),
            "kernel_us_per_step": sum(k["us_per_step"] for k in kernels), "top": kernels[:15]}


def profile_workload(engine, requests: list[tuple[list[int], int]], device: torch.device, top: int = 25) -> dict | None:
    """Where the device time of a workload goes, by kernel name: ``requests`` run once more under torch.profiler
    (CUPTI records the kernels of replayed step graphs) after the timed run. Not timed itself: the profiler's
    overhead falls on the host, so the kernel times are the served ones, but the wall time is not."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_engine(engine, requests, wave=None, device=device)
        sync(device)
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.count and t and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            kernels.append({"name": e.key[:100], "count": e.count, "ms": t / 1e3})
    kernels.sort(key=lambda k: -k["ms"])
    return {"requests": len(requests), "kernel_ms": sum(k["ms"] for k in kernels), "top": kernels[:top]}


def graph_replay_ms(engine, device: torch.device) -> float | None:
    """Device time of one replay of the batch-1 decode graph (the model alone, no engine)."""
    from trtopt.runtime.executors.cuda_graphs import GraphBucket

    graphs = engine.executor.graphs
    one = GraphBucket(1, 1, 1)
    if device.type != "cuda" or not graphs or one not in graphs._captured:
        return None
    import triton.testing

    return triton.testing.do_bench(graphs._captured[one].replay, warmup=50, rep=300, return_mode="median")


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + written), on 2 GiB buffers."""
    if device.type != "cuda":
        return None
    import triton.testing

    src = torch.randn(2**29, device=device)  # 2 GiB of fp32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms / 1e3)  # the buffers go with the frame


# ---- FP8 KV cache -----------------------------------------------------------------------------------------------

def kv_budget_gb(plan, requests: list[tuple[list[int], int]], *, fraction: float, max_model_len: int) -> float:
    """A KV budget (GiB) in which `plan`'s pools hold `fraction` of the blocks the requests want when all run at
    once (each its prompt + output tokens), and at least one sequence of max_model_len (the engine's minimum)."""
    from trtopt.runtime.config import block_bytes

    size = plan.limits.block_size
    wanted = sum(-(-(len(p) + n) // size) for p, n in requests)
    blocks = max(int(wanted * fraction), -(-max_model_len // size))
    # A quarter block over: the engine floors bytes // block bytes, and FP8's half-size blocks then number 2x exactly
    return (blocks + 0.25) * block_bytes(plan) / 2**30


def warm_then_timed(engine, warmup: list[tuple[list[int], int]], requests: list[tuple[list[int], int]],
                    device: torch.device, label: str) -> dict:
    """The workload on ``engine`` as the fp8_kv and quant sections time it: ``warmup`` run once untimed, then every
    request queued at once and timed with the garbage collector frozen (as timed_workload does)."""
    t = time.perf_counter()
    run_engine(engine, warmup, wave=None, device=device)
    log(f"{label}: warm-up on {len(warmup)} requests ({time.perf_counter() - t:.1f} s)")
    gc.collect()
    gc.freeze()
    try:
        r = run_engine(engine, requests, wave=None, device=device)
    finally:
        gc.unfreeze()
    log(f"{label}: workload {r['output_tok_s']:.0f} output tok/s, {r['wall_s']:.1f} s, max running "
        f"{r['max_running']}, mean {r['mean_running']:.0f}, {r['preemptions']} preemptions")
    return r


def fp8_kv_section(work: Path, requests: list[tuple[list[int], int]], kv: KVSection, *, vocab: int,
                   device: torch.device, max_num_seqs: int, kv_gb: float | None, async_scheduling: bool) -> dict:
    """Batch-1 decode and the workload at one KV budget, with the bf16-pool plan then the FP8-pool plan (both
    built by `build` from the same export, same limits). Each dtype: one engine, one executor, freed before the
    next; the workload is warmed up on a fraction of the requests, then timed whole."""
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.config import block_bytes
    from trtopt.runtime.executors import create_executor

    # row -> the plan's --kv-cache-dtype ("auto": the model's bf16)
    plans = {row: read_plan(work / f"plan-kv-{dtype}") for row, dtype in (("bf16", "auto"), ("fp8", "fp8"))}
    if kv_gb is None:
        kv_gb = kv_budget_gb(plans["bf16"], requests, fraction=kv.budget_fraction, max_model_len=kv.max_model_len)
    warmup = requests[:max(1, int(len(requests) * kv.warmup_fraction))]
    section: dict = {"kv_cache_memory_gb": kv_gb, "max_model_len": kv.max_model_len, "max_num_seqs": max_num_seqs,
                     "budget_fraction": kv.budget_fraction, "warmup_requests": len(warmup),
                     "requests": len(requests), "scales": "1.0 per layer (no calibration)"}
    log(f"fp8_kv: KV budget {kv_gb:.4g} GiB for every engine, {len(requests)} requests")
    for name, plan in plans.items():
        row = section[name] = {"kv_cache_dtype": plan.kv_cache_dtype}
        t = time.perf_counter()
        executor = create_executor("torch", work / f"plan-kv-{plan.kv_cache_dtype}", plan, device=str(device),
                                   cuda_graphs=device.type == "cuda")
        engine = make_engine(executor, plan, max_num_seqs=max_num_seqs, kv_gb=kv_gb,
                             async_scheduling=async_scheduling)
        st = engine.stats()
        row.update(kv_pool_dtype=st.kv_cache_dtype, num_blocks_total=st.num_blocks_total,
                   block_bytes=block_bytes(plan), engine_start_s=time.perf_counter() - t)
        log(f"fp8_kv {name}: engine up, {st.num_blocks_total} KV blocks ({row['engine_start_s']:.1f} s)")
        for prompt_len in kv.prompt_lens:
            b = row[f"batch1_prompt_{prompt_len}"] = batch1_decode(engine, vocab, device, new_tokens=kv.new_tokens,
                                                                   prompt_len=prompt_len)
            log(f"fp8_kv {name}: batch 1, prompt {prompt_len}: {b['decode_tok_s']:.0f} tok/s "
                f"({b['ms_per_token']:.3f} ms/token)")
        r = row["workload"] = warm_then_timed(engine, warmup, requests, device, f"fp8_kv {name}")
        del engine, executor
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bf16, fp8 = section["bf16"], section["fp8"]
    section["ratios_fp8_vs_bf16"] = {
        "num_blocks": fp8["num_blocks_total"] / bf16["num_blocks_total"],
        "max_running": fp8["workload"]["max_running"] / max(1, bf16["workload"]["max_running"]),
        "workload_output_tok_s": fp8["workload"]["output_tok_s"] / bf16["workload"]["output_tok_s"],
        **{f"batch1_decode_tok_s_prompt_{n}": (fp8[f"batch1_prompt_{n}"]["decode_tok_s"]
                                               / bf16[f"batch1_prompt_{n}"]["decode_tok_s"]) for n in kv.prompt_lens},
    }
    return section


def quant_section(work: Path, requests: list[tuple[list[int], int]], *, vocab: int, device: torch.device,
                  max_num_seqs: int, kv_gb: float, async_scheduling: bool, warmup_fraction: float = 0.25) -> dict:
    """Batch-1 decode and the workload for the main bf16 plan and each quantized plan (QUANT_ROWS), one engine at
    a time (freed before the next), the same KV budget, requests and warm-up."""
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.executors import torch_executor

    warmup = requests[:max(1, int(len(requests) * warmup_fraction))]
    section: dict = {"kv_cache_memory_gb": kv_gb, "max_num_seqs": max_num_seqs, "requests": len(requests),
                     "warmup_requests": len(warmup), "configs": QUANT_ROWS,
                     "method": "rtn (random weights), the LM head and embeddings in bf16"}

    ablations = {row: base for row, base in QUANT_ABLATIONS.items() if base in QUANT_ROWS}
    section["ablations"] = {row: f"{base}'s plan, the x packing of its INT4 GEMVs not folded into the op before"
                            for row, base in ablations.items()}
    rows = [("bf16", work / "plan"), *((row, work / f"plan-q-{row}") for row in QUANT_ROWS),
            *((row, work / f"plan-q-{base}") for row, base in ablations.items())]
    for name, plan_dir in rows:
        plan = read_plan(plan_dir)
        t = time.perf_counter()
        executor = torch_executor.TorchExecutor(plan_dir, plan, device=str(device), cuda_graphs=device.type == "cuda",
                                                fold_x_pack=name not in ablations)
        engine = make_engine(executor, plan, max_num_seqs=max_num_seqs, kv_gb=kv_gb, async_scheduling=async_scheduling)
        row = section[name] = {"engine_start_s": time.perf_counter() - t,
                               "x_pack_fusions": executor.num_x_pack_fusions}
        b = row["batch1"] = batch1_decode(engine, vocab, device)
        log(f"quant {name}: batch 1 {b['decode_tok_s']:.0f} tok/s")
        row["workload"] = warm_then_timed(engine, warmup, requests, device, f"quant {name}")
        row["workload_profile"] = profile_workload(engine, warmup, device)
        if row["workload_profile"]:
            top = row["workload_profile"]["top"][:6]
            log(f"quant {name}: warm-up set profiled, {row['workload_profile']['kernel_ms']:.0f} ms of kernels; top: "
                + ", ".join(f"{k['name'][:40]} {k['ms']:.0f} ms" for k in top))
        del engine, executor
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bf16 = section["bf16"]
    section["ratios_vs_bf16"] = {name: {
        "batch1_decode_tok_s": section[name]["batch1"]["decode_tok_s"] / bf16["batch1"]["decode_tok_s"],
        "workload_output_tok_s": section[name]["workload"]["output_tok_s"] / bf16["workload"]["output_tok_s"]}
        for name, _ in rows[1:]}
    return section


# ---- HF baseline -----------------------------------------------------------------------------------------------

def run_hf(hf_dir: Path, requests: list[tuple[list[int], int]], batch: int, device: torch.device) -> dict:
    """HF generate with static batches of `batch` requests in arrival order (left padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()
    pad = 0

    def generate(chunk):
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        n = max(o for _, o in chunk)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad)
        return out.shape[1] - width

    with torch.inference_mode():
        generate([(requests[0][0][:64], 8)] * 2)  # warm-up
        sync(device)
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(requests), batch):
            chunk = requests[i:i + batch]
            generated += generate(chunk) * len(chunk)
            log(f"  hf batch {batch}: {min(i + batch, len(requests))}/{len(requests)} requests")
        sync(device)
        wall = time.perf_counter() - start
    useful = sum(n for _, n in requests)
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {"batch": batch, "wall_s": wall, "output_tokens": useful, "generated_incl_padding": generated,
            "output_tok_s": useful / wall, "total_tok_s": (useful + prompt_tokens) / wall}


# ---- report ----------------------------------------------------------------------------------------------------

# Issue 11's targets, read off a run's own figures (`targets`), with where the explanation of a miss lives.
WHY = "docs/benchmarks/GPU_E2E.md, the latest session's section"


def targets(data: dict) -> dict:
    """Each issue-11 target this run measured: its value, the target, met or not, and by how much it was missed.
    The eager PagedAttention host cost is benchmarks/bench_launch_host.py's, not this script's."""
    out = {}

    def row(name: str, value, target: float, higher_is_better: bool, unit: str, why: str) -> None:
        if value is None:
            return
        met = value >= target if higher_is_better else value <= target
        out[name] = {"value": value, "target": target, "unit": unit, "met": met,
                     "missed_by": None if met else abs(target - value), "why_missed": None if met else why}

    b1, workload, ratios = data.get("batch1", {}), data.get("workload", {}), data.get("ratios", {})
    frac = b1.get("fraction_of_roofline")
    row("batch1_fraction_of_hbm_roofline", frac, 0.60, True, "fraction",
        f"the projections (decode GEMVs at batch 1) are ~78% of the step's kernels, the small ones latency-bound; "
        f"the rest is attention, norms and gaps between ~160 kernels ({WHY})")
    row("kernels_per_batch1_decode_step", (b1.get("profile_eager") or {}).get("kernels_per_step"), 150, False,
        "kernels (graphs off)", f"8 per layer at batch 1: 4 projections (gate/up with SiLU·mul), RoPE+KV write, "
        f"attention, 2 Add+RMSNorm ({WHY})")
    row("continuous_vs_static_max_batch_64", ratios.get("continuous_vs_static_same_max_batch"), 1.5, True, "x",
        f"GPU-bound; the step counts cap it at static/continuous steps "
        f"{workload.get('static', {}).get('steps')}/{workload.get('continuous', {}).get('steps')} ({WHY})")
    row("workload_vs_hf_generate_static", ratios.get("trtopt_vs_best_hf_static"), 25.0, True, "x", WHY)
    busy = [workload[k]["gpu_busy_frac"] for k in ("static", "continuous", "continuous_max")
            if k in workload and workload[k].get("gpu_busy_frac") is not None]
    row("gpu_busy_min_over_async_workload_rows", min(busy) if busy else None, 0.90, True, "fraction", WHY)
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    b1 = data["batch1"]
    bars = ax1.bar(["trtopt\nbatch-1 decode", "HBM roofline"], [b1["decode_tok_s"], b1["roofline_tok_s"]],
                   color=["tab:blue", "lightgray"])
    ax1.bar_label(bars, fmt="%.0f")
    ax1.set_ylabel("tokens / s")
    ax1.set_title(f"batch 1: {100 * b1['fraction_of_roofline']:.0f}% of the roofline")
    wl = data["workload"]
    names, vals, colors = [], [], []
    for r in wl["hf"]:
        names.append(f"HF generate\nstatic {r['batch']}")
        vals.append(r["output_tok_s"])
        colors.append("tab:gray")
    for key, label, color in (("static", "trtopt\nstatic {B}", "tab:orange"),
                              ("continuous", "trtopt\ncontinuous {B}", "tab:blue"),
                              ("continuous_max", "trtopt\ncontinuous {B}", "tab:blue")):
        if key in wl:
            names.append(label.format(B=wl[key]["max_batch"]))
            vals.append(wl[key]["output_tok_s"])
            colors.append(color)
    bars = ax2.bar(names, vals, color=colors)
    ax2.bar_label(bars, fmt="%.0f")
    ax2.set_ylabel("output tokens / s")
    w = data["workload_spec"]
    ax2.set_title(f"{w['requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, "
                  f"outputs {w['output_len'][0]}-{w['output_len'][1]}")
    fig.suptitle(f"{data['model']} on {data['machine']['gpu']} ({data['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_fp8_kv(section: dict, title: str, path: Path) -> None:
    """Bars of the fp8_kv section, bf16 pools against FP8 pools: batch-1 decode per prompt, workload throughput at
    the section's KV budget, and the most sequences that ran at once (with the blocks each engine allocated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, colors = ("bf16", "fp8"), {"bf16": "tab:gray", "fp8": "tab:green"}
    prompts = sorted(int(k.rsplit("_", 1)[1]) for k in section["bf16"] if k.startswith("batch1_prompt_"))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1, 1]})
    for i, name in enumerate(rows):
        vals = [section[name][f"batch1_prompt_{n}"]["decode_tok_s"] for n in prompts]
        bars = ax1.bar([j + 0.4 * i for j in range(len(prompts))], vals, width=0.4, color=colors[name],
                       label=f"{name} KV")
        ax1.bar_label(bars, fmt="%.0f")
    ax1.set_xticks([j + 0.2 for j in range(len(prompts))], [f"prompt {n}" for n in prompts])
    ax1.set_ylabel("tokens / s")
    ax1.set_title("batch-1 decode")
    ax1.legend()
    gb = section["kv_cache_memory_gb"]
    bars = ax2.bar(rows, [section[n]["workload"]["output_tok_s"] for n in rows], color=[colors[n] for n in rows])
    ax2.bar_label(bars, fmt="%.0f")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title(f"{section['requests']} requests, KV {gb:.3g} GiB")
    bars = ax3.bar([f"{n}\n{section[n]['num_blocks_total']} blocks" for n in rows],
                   [section[n]["workload"]["max_running"] for n in rows], color=[colors[n] for n in rows])
    ax3.bar_label(bars, fmt="%.0f")
    ax3.set_ylabel("sequences")
    ax3.set_title(f"most running at once (max {section['max_num_seqs']})")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge_decode_speedup(path: Path, section: dict, model: str) -> None:
    """Set `decode_speedup_vs_bf16` in the issue's docs/benchmarks/fp8_kv_<gpu>.json (FP8 pools' tok/s over bf16
    pools', per batch-1 prompt length and for the workload at the section's KV budget); the file's other keys are
    benchmarks/fp8_kv.py's and are kept."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    ratios = section["ratios_fp8_vs_bf16"]
    attention = data.get("decode_speedup_vs_bf16", {}).get("attention_per_shape")  # bench_attention.py's, kept
    data["decode_speedup_vs_bf16"] = {
        "source": "benchmarks/gpu_e2e.py, section fp8_kv (fp8_kv_e2e_<gpu>.json)", "model": model,
        **{k.removeprefix("batch1_decode_tok_s_"): v for k, v in ratios.items() if k.startswith("batch1_")},
        "workload_output_tok_s": ratios["workload_output_tok_s"],
        "workload_kv_cache_memory_gb": section["kv_cache_memory_gb"],
        **({"attention_per_shape": attention} if attention else {}),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model and workload (a smoke run of the harness)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtopt-gpu-e2e"))
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=64, help="max batch of the static vs continuous comparison")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="our engine's best configuration")
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[64, 128, 256],
                    help="HF static batch sizes to try (the best is the baseline); 256 was the best on the H200")
    ap.add_argument("--kv-gb", type=float, default=40.0)
    ap.add_argument("--ablate", nargs="*",
                    default=["horizontal_matmul", "silu_mul", "add_rms_norm", "rope", "rope_table", "rope_kv",
                             "decode_gemv", "gemv_rope_kv", "argmax", "merge_in_kernel", "argmax_in_graph"],
                    help="plan-level fusion passes, the executor's RoPE fold and decode GEMVs (rope_kv, decode_gemv, "
                    "gemv_rope_kv: "
                    "turned off), the sampler's argmax kernel, PagedAttention's in-kernel split-KV merge and the "
                    "placeholder fill + greedy argmax inside the step graphs (argmax_in_graph) (turned off), to "
                    "measure at batch 1 against the default, same run")
    sections = ["batch1", "eager", "hf", "static", "continuous", "ablation", "fp8_kv", "quant"]
    ap.add_argument("--quant-rows", nargs="+", default=None, choices=list(QUANT_ROWS),
                    help="the quant section's quantized plans (default: all)")
    ap.add_argument("--skip", nargs="*", default=[], choices=sections)
    ap.add_argument("--only", nargs="+", default=None, choices=sections,
                    help="run these sections alone (--only fp8_kv: the FP8 KV rows, written to their own JSON)")
    ap.add_argument("--fp8-kv-gb", type=float, default=None,
                    help="the fp8_kv section's KV budget for both engines (default: a quarter of the blocks the "
                    "workload's requests want at once, in bf16 blocks)")
    ap.add_argument("--scheduling", choices=["both", "async", "sync"], default="both",
                    help="the engine loop: async scheduling (one step in flight), synchronous, or both in the same run "
                    "(the plain keys are async, the *_sync keys synchronous)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default docs/benchmarks/gpu_e2e_<gpu>.json)")
    args = ap.parse_args()

    device = torch.device(args.device)
    shape = TINY if args.tiny else Shape()
    spec = Workload(requests=16, prompt_len=(8, 64), output_len=(4, 24)) if args.tiny else Workload()
    if args.requests:
        spec = dataclasses.replace(spec, requests=args.requests)
    if args.tiny:
        args.max_batch, args.max_num_seqs, args.hf_batches, args.kv_gb = 4, 16, [4, 8], 0.05
    if args.only:
        args.skip = [name for name in sections if name not in args.only]
    for row in set(QUANT_ROWS) - set(args.quant_rows or QUANT_ROWS):
        del QUANT_ROWS[row]
    main_run = not set(MAIN_SECTIONS) <= set(args.skip)  # False: the fp8_kv and/or quant sections alone
    kv_section = TINY_KV if args.tiny else KVSection()
    requests = spec.make(shape.vocab)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    gpu_tag = f"{'tiny_' if args.tiny else ''}{device_tag(gpu_name)}"

    args.work.mkdir(parents=True, exist_ok=True)
    hf_dir, plan_dir, params, build_times = build(
        args.work, shape, device, args.max_num_seqs, tuple(args.ablate) if main_run else (),
        main_plan=main_run or "quant" not in args.skip,
        kv_max_model_len=kv_section.max_model_len if "fp8_kv" not in args.skip else None,
        quant="quant" not in args.skip)
    data: dict = {
        "benchmark": "gpu_e2e",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": gpu_name, "torch": torch.__version__, "python": platform.python_version()},
        "model": f"Llama-shaped random bf16, {params / 1e9:.2f}B params" + (" (tiny)" if args.tiny else ""),
        "shape": dataclasses.asdict(shape), "params": params, "setup": build_times,
        "workload_spec": dataclasses.asdict(spec),
    }
    out = args.out or DOCS / f"gpu_e2e_{gpu_tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    kv_out = out.parent / f"fp8_kv_e2e_{gpu_tag}.json"  # the fp8_kv section's own file, next to the run's JSON

    def save() -> None:  # after every section, so that a run cut short keeps what it measured
        out.write_text(json.dumps(data, indent=2) + "\n")

    import triton  # the CUDA kernels need it; the CPU smoke run has it too

    data["machine"]["triton"] = triton.__version__

    use_async = args.scheduling != "sync"

    def run_fp8_kv() -> None:
        """The fp8_kv section: its own JSON (the run's metadata + "fp8_kv") and PNG, under "fp8_kv" in the run's
        JSON too when other sections ran, and the issue's fp8_kv_<gpu>.json speedups (full-size GPU runs only)."""
        section = data["fp8_kv"] = fp8_kv_section(
            args.work, requests, kv_section, vocab=shape.vocab, device=device, max_num_seqs=args.max_num_seqs,
            kv_gb=args.fp8_kv_gb, async_scheduling=use_async)
        kv_data = {**data, "benchmark": "gpu_e2e fp8_kv"}
        for key in ("batch1", "batch1_sync", "batch1_eager_dispatcher", "batch1_eager", "fusion_ablation",
                    "workload", "ratios", "targets"):
            kv_data.pop(key, None)  # the other sections' rows live in the run's own JSON
        kv_out.write_text(json.dumps(kv_data, indent=2) + "\n")
        plot_fp8_kv(section, f"FP8 vs bf16 KV cache: {data['model']} on {gpu_name} ({data['date'][:10]})",
                    kv_out.with_suffix(".png"))
        if device.type == "cuda" and not args.tiny:
            merge_decode_speedup(out.parent / f"fp8_kv_{device_tag(gpu_name)}.json", section, data["model"])
        print("\n== fp8_kv ==")
        for name in ("bf16", "fp8"):
            row = section[name]
            print(f"{name} KV ({row['kv_pool_dtype']}): {row['num_blocks_total']} blocks in "
                  f"{section['kv_cache_memory_gb']:.4g} GiB; " + ", ".join(
                      f"batch 1 prompt {n}: {row[f'batch1_prompt_{n}']['decode_tok_s']:.0f} tok/s"
                      for n in kv_section.prompt_lens))
            w = row["workload"]
            print(f"   workload: {w['output_tok_s']:.0f} output tok/s, {w['wall_s']:.1f} s, max running "
                  f"{w['max_running']}, mean {w['mean_running']:.1f}, preemptions {w['preemptions']}, "
                  f"steps {w['steps']}")
        for k, v in section["ratios_fp8_vs_bf16"].items():
            print(f"fp8 vs bf16 {k}: {v:.3f}x")
        print(f"wrote {kv_out}")

    def run_quant() -> None:
        """The quant section: its own JSON (the run's metadata + "quant"), under "quant" in the run's JSON too."""
        section = data["quant"] = quant_section(args.work, requests, vocab=shape.vocab, device=device,
                                                max_num_seqs=args.max_num_seqs, kv_gb=args.kv_gb,
                                                async_scheduling=use_async)
        q_data = {k: v for k, v in data.items() if k in ("benchmark", "date", "machine", "model", "shape", "params",
                                                         "setup", "workload_spec", "quant")}
        q_out = out.parent / f"quant_e2e_workload_{gpu_tag}.json"
        q_out.write_text(json.dumps({**q_data, "benchmark": "gpu_e2e quant"}, indent=2) + "\n")
        print("\n== quant ==")
        for name in ("bf16", *QUANT_ROWS, *section["ablations"]):
            row = section[name]
            ratio = section["ratios_vs_bf16"].get(name, {})
            print(f"{name:10s} batch 1 {row['batch1']['decode_tok_s']:7.0f} tok/s "
                  f"({ratio.get('batch1_decode_tok_s', 1.0):.2f}x), workload {row['workload']['output_tok_s']:7.0f} "
                  f"output tok/s ({ratio.get('workload_output_tok_s', 1.0):.2f}x)")
        print(f"wrote {q_out}")

    if not main_run:
        if "fp8_kv" not in args.skip:
            run_fp8_kv()
        if "quant" not in args.skip:
            run_quant()
        return

    from trtopt.builder.plan import read_plan
    from trtopt.runtime.executors import create_executor

    plan = read_plan(plan_dir)
    t = time.perf_counter()
    executor = create_executor("torch", plan_dir, plan, device=str(device), cuda_graphs=device.type == "cuda")
    build_times["load_plan_s"] = time.perf_counter() - t
    log(f"plan loaded on {device} ({build_times['load_plan_s']:.1f} s)")
    if "batch1" not in args.skip:
        engine = make_engine(executor, plan, max_num_seqs=args.max_num_seqs, kv_gb=min(args.kv_gb, 4.0),
                             async_scheduling=use_async)
        b1 = batch1_decode(engine, shape.vocab, device)
        head_dim = shape.hidden // shape.heads
        kv_bytes = 2 * shape.layers * shape.kv_heads * head_dim * 2 * (b1["prompt_len"] + b1["new_tokens"] / 2)
        b1["weight_bytes"] = params * 2
        b1["bytes_per_step"] = params * 2 + kv_bytes
        b1["copy_bandwidth_Bps"] = copy_bandwidth(device)
        b1["graph_replay_ms"] = graph_replay_ms(engine, device)
        b1["profile_eager"] = profile_decode(engine, shape.vocab, device)
        b1["profile_graphed"] = profile_decode(engine, shape.vocab, device, graphed=True)
        if b1["copy_bandwidth_Bps"]:
            b1["roofline_tok_s"] = b1["copy_bandwidth_Bps"] / b1["bytes_per_step"]
            b1["fraction_of_roofline"] = b1["decode_tok_s"] / b1["roofline_tok_s"]
        data["batch1"] = b1
        graphs = executor.graphs
        if graphs is not None and graphs.capture_report is not None:
            report = graphs.capture_report
            b1["graph_capture"] = {"graphs": report.num_graphs, "seconds": report.seconds,
                                   "pool_MiB": report.pool_bytes / 2**20, "max_tokens": graphs.buckets[-1].num_tokens}
        del engine
        if args.scheduling == "both":  # the synchronous loop, same run, same plan
            engine = make_engine(executor, plan, max_num_seqs=args.max_num_seqs, kv_gb=min(args.kv_gb, 4.0),
                                 async_scheduling=False)
            data["batch1_sync"] = batch1_decode(engine, shape.vocab, device)
            del engine
            log(f"batch 1 sync: {data['batch1_sync']['decode_tok_s']:.0f} tok/s vs async {b1['decode_tok_s']:.0f}")
        if "eager" not in args.skip and executor.graphs is not None:
            # Graphs off: every step launches its ~200 kernels from Python. Triton's dispatcher against
            # plugins/launcher.py (the compiled kernels launched directly), same plan, same run. The switch is the
            # executor's PagedLaunchState's launcher: PagedAttention's launches (and no per-step plan); the other
            # kernels launch as TRTOPT_TRITON_DISPATCH said at import (set it for an all-dispatcher run).
            launcher = executor.paged_state.launcher
            for row, dispatch in (("batch1_eager_dispatcher", True), ("batch1_eager", False)):
                previous, launcher.dispatcher_only = launcher.dispatcher_only, dispatch
                engine = make_engine(executor, plan, max_num_seqs=args.max_num_seqs, kv_gb=min(args.kv_gb, 4.0),
                                     async_scheduling=use_async)
                executor.graphs.enabled = False  # the engine captured a new set; none of them replays here
                data[row] = batch1_decode(engine, shape.vocab, device, new_tokens=128)
                launcher.dispatcher_only = previous
                del engine
                log(f"{row}: {data[row]['decode_tok_s']:.0f} tok/s, host {data[row]['host_ms_per_token']:.3f} "
                    f"ms/token exposed")
        ablations = data["fusion_ablation"] = {"with_all": {
            k: b1.get(k) for k in ("decode_tok_s", "ms_per_token", "graph_replay_ms")}}
        ablations["with_all"]["kernels_per_step"] = (b1["profile_eager"] or {}).get("kernels_per_step")
        for rule in args.ablate:
            row = f"without_{rule}"
            if rule in RUNTIME_SWITCHES:  # an executor option off, same plan and executor
                set_switch(rule, False, executor)
                plan_x, executor_x = plan, executor
            elif rule in EXECUTOR_VARIANTS:
                from trtopt.runtime.executors.torch_executor import TorchExecutor

                row, variant = EXECUTOR_VARIANTS[rule]
                plan_x = plan
                executor_x = TorchExecutor(plan_dir, plan, device=str(device), cuda_graphs=device.type == "cuda",
                                           **variant)
            else:
                plan_x = read_plan(args.work / f"plan-without-{rule}")
                executor_x = create_executor("torch", args.work / f"plan-without-{rule}", plan_x, device=str(device),
                                             cuda_graphs=device.type == "cuda")
            engine = make_engine(executor_x, plan_x, max_num_seqs=args.max_num_seqs, kv_gb=min(args.kv_gb, 4.0))
            if rule == "argmax":  # this engine's sampler too: the argmax of its eager steps
                engine.sampler.argmax_kernel = False
            bx = batch1_decode(engine, shape.vocab, device)
            bx["graph_replay_ms"] = graph_replay_ms(engine, device)
            bx["profile_eager"] = profile_decode(engine, shape.vocab, device)  # which kernels (cuBLAS's choice too)
            bx["kernels_per_step"] = (bx["profile_eager"] or {}).get("kernels_per_step")
            ablations[row] = bx
            if rule in RUNTIME_SWITCHES:
                set_switch(rule, True, executor)
            log(f"batch 1 {row}: {bx['decode_tok_s']:.0f} tok/s, graph replay "
                f"{bx['graph_replay_ms'] or 0:.3f} ms, {bx['kernels_per_step']} kernels/step")
            del engine, executor_x
            # The same run's plan again, right after, to see the spread between passes. The replay is timed after
            # the decode, as in every other row: a graph replays the inputs last copied into it, and a new engine
            # re-captures (new pools), so timing it before the decode (as the rows of session 8 did) replays the
            # capture's dummy step, a shorter attention: it read ~0.06 ms low.
            engine = make_engine(executor, plan, max_num_seqs=args.max_num_seqs, kv_gb=min(args.kv_gb, 4.0))
            again = batch1_decode(engine, shape.vocab, device)
            ablations[f"with_all_again_after_{rule}"] = {"graph_replay_ms": graph_replay_ms(engine, device), **again}
            del engine
        log(f"batch 1: {b1['decode_tok_s']:.0f} tok/s ({b1['ms_per_token']:.3f} ms/token, GPU "
            f"{b1['gpu_ms_per_token'] or 0:.3f} ms, graph replay {b1['graph_replay_ms'] or 0:.3f} ms); roofline "
            f"{b1.get('roofline_tok_s', 0):.0f} tok/s")
        save()

    workload: dict = {"hf": []}
    data["workload"] = workload
    runs = []
    if "static" not in args.skip:
        runs.append(("static", args.max_batch, args.max_batch, "default"))
    if "continuous" not in args.skip:
        runs += [("continuous", args.max_batch, None, "default"), ("continuous_max", args.max_num_seqs, None, "default")]
        if device.type == "cuda" and "ablation" not in args.skip:
            # Ablations, same run: only steps of one token per sequence graphed (the rule before issue 11), so
            # every step that admits a request runs eagerly; and the unpinned input staging. Then the defaults
            # again, to see the spread between passes.
            for variant in ("decode_only", "pad_step", "argmax_outside"):
                runs += [(f"continuous_{variant}", args.max_batch, None, variant),
                         (f"continuous_max_{variant}", args.max_num_seqs, None, variant)]
            runs += [("continuous_again", args.max_batch, None, "default"),
                     ("continuous_max_again", args.max_num_seqs, None, "default")]
    if args.scheduling == "both":  # the synchronous loop on the same workloads, same run
        runs += [(f"{key}_sync", b, w, v) for key, b, w, v in runs if key in ("static", "continuous", "continuous_max")]
    for key, max_batch, wave, variant in runs:
        r = timed_workload(executor, plan, requests, max_batch=max_batch, wave=wave, kv_gb=args.kv_gb,
                           device=device, variant=variant, async_scheduling=use_async and not key.endswith("_sync"))
        workload[key] = r
        log(f"trtopt {key} (max batch {max_batch}): {r['output_tok_s']:.0f} output tok/s, {r['wall_s']:.1f} s, "
            f"{r['steps']} steps, mean running {r['mean_running']:.0f}, GPU busy {100 * (r['gpu_busy_frac'] or 0):.0f}%, "
            f"eager steps {r.get('eager_steps')}")
        save()
    graphs = executor.graphs
    del executor, graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "fp8_kv" not in args.skip:
        run_fp8_kv()
        save()
    if "quant" not in args.skip:
        run_quant()
        save()
    if "hf" not in args.skip:
        for b in args.hf_batches:
            r = run_hf(hf_dir, requests, b, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the HF model of this batch size is gone with run_hf's frame
            workload["hf"].append(r)
            log(f"HF static {b}: {r['output_tok_s']:.0f} output tok/s ({r['wall_s']:.1f} s)")

    best_hf = max(workload["hf"], key=lambda r: r["output_tok_s"], default=None)
    ratios = {}
    if best_hf and "continuous_max" in workload:
        ratios["trtopt_vs_best_hf_static"] = workload["continuous_max"]["output_tok_s"] / best_hf["output_tok_s"]
    if "static" in workload and "continuous" in workload:
        ratios["continuous_vs_static_same_max_batch"] = (workload["continuous"]["output_tok_s"]
                                                         / workload["static"]["output_tok_s"])
    if "static_sync" in workload and "continuous_sync" in workload:
        ratios["continuous_vs_static_same_max_batch_sync"] = (workload["continuous_sync"]["output_tok_s"]
                                                              / workload["static_sync"]["output_tok_s"])
    for key in ("static", "continuous", "continuous_max"):
        if key in workload and f"{key}_sync" in workload:
            ratios[f"{key}_async_vs_sync"] = workload[key]["output_tok_s"] / workload[f"{key}_sync"]["output_tok_s"]
    if "batch1" in data and "batch1_sync" in data:
        ratios["batch1_async_vs_sync"] = data["batch1"]["decode_tok_s"] / data["batch1_sync"]["decode_tok_s"]
    for key in ("continuous", "continuous_max"):
        if f"{key}_decode_only" in workload:
            ratios[f"{key}_every_step_graphed_vs_decode_only"] = (workload[key]["output_tok_s"]
                                                                  / workload[f"{key}_decode_only"]["output_tok_s"])
        if f"{key}_argmax_outside" in workload:
            ratios[f"{key}_argmax_in_graph_vs_outside"] = (workload[key]["output_tok_s"]
                                                           / workload[f"{key}_argmax_outside"]["output_tok_s"])
    data["ratios"] = ratios
    data["targets"] = targets(data)

    save()
    if "batch1" in data and "roofline_tok_s" in data["batch1"] and workload.get("continuous_max"):
        plot(data, out.with_suffix(".png"))

    print("\n== summary ==")
    if "batch1" in data:
        b1 = data["batch1"]
        print(f"batch-1 decode      {b1['decode_tok_s']:8.0f} tok/s   {b1['ms_per_token']:.3f} ms/token"
              + (f"   roofline {b1['roofline_tok_s']:.0f} tok/s -> {100 * b1['fraction_of_roofline']:.1f}%"
                 if "roofline_tok_s" in b1 else ""))
    for name in ("batch1", "batch1_sync", "batch1_eager_dispatcher", "batch1_eager"):
        if name in data:
            b = data[name]
            print(f"{name:<12} async={b['async_scheduling']!s:<5} {b['decode_tok_s']:8.0f} tok/s   "
                  f"{b['ms_per_token']:.3f} ms/token   GPU {b['gpu_ms_per_token'] or 0:.3f} ms   "
                  f"exposed host {b['host_ms_per_token'] or 0:.3f} ms")
    prof = data.get("batch1", {}).get("profile_eager")
    if prof:
        print(f"eager batch-1 decode step: {prof['kernels_per_step']:.0f} kernels, {prof['kernel_us_per_step']:.0f} us of kernels")
        for k in prof["top"][:10]:
            print(f"   {k['us_per_step']:8.1f} us  {k['per_step']:6.1f}x  {k['name'][:70]}")
    prof = data.get("batch1", {}).get("profile_graphed")
    if prof:
        print(f"served (graphed) batch-1 decode step: {prof['kernels_per_step']:.0f} kernels, "
              f"{prof['kernel_us_per_step']:.0f} us of kernels")
    for name, r in data.get("fusion_ablation", {}).items():
        print(f"batch-1 {name:<40} {r.get('decode_tok_s') or 0:8.0f} tok/s   graph replay {r.get('graph_replay_ms') or 0:.3f} ms"
              f"   kernels/step {r.get('kernels_per_step')}")
    for r in workload["hf"]:
        print(f"HF static {r['batch']:<4}       {r['output_tok_s']:8.0f} output tok/s   {r['wall_s']:.1f} s")
    rows = [(key, r) for key, r in workload.items() if key != "hf"]
    for key, r in rows:
        if True:
            print(f"trtopt {key:<34}  {r['output_tok_s']:8.0f} output tok/s   {r['wall_s']:.1f} s   "
                  f"async={r['async_scheduling']!s:<5}  GPU busy {100 * (r['gpu_busy_frac'] or 0):.0f}%  "
                  f"max batch {r['max_batch']}  steps {r['steps']}  host {r['host_ms_per_step'] or 0:.2f} ms/step  "
                  f"GPU/step graphed {r.get('graphed_gpu_ms_per_step') or 0:.2f} ms x{r.get('graphed_steps', 0)}, "
                  f"eager {r.get('eager_gpu_ms_per_step') or 0:.2f} ms x{r.get('eager_steps', 0)}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
