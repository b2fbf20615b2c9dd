"""Accuracy of the FP8 KV cache (`trtopt build --kv-cache-dtype fp8`, docs/architecture.md §3) on real models, on the
CPU or on CUDA: perplexity and token KL divergence against pools of the model's dtype, greedy agreement, and (on
Gemma-3-270m at its 32K context) a needle-in-a-haystack retrieval test. The issue's targets: a perplexity increase of
at most 0.5% on SmolLM2-135M and Gemma-3-270m, and FP8 retrieving every needle the model-dtype pools retrieve.

Cells (one plan each, built from one export in --dtype: bf16 on CUDA, fp32 on the CPU):
- auto: pools of the model's dtype (the reference);
- fp8: float8_e4m3fn pools, per-layer K/V scales 1.0 (as vLLM without calibration);
- fp8_x0.95, fp8_x1.05 (scale jitter): scales 0.95 and 1.05. e4m3 keeps its relative error whatever the scale (away
  from subnormals and saturation); the scale only moves where values round. The spread of the three fp8 cells is
  what rounding alone does to one number, so the reported increase is their mean, with their range;
- fp8_amax: scales amax / 448 per layer, from the auto plan's pools after --calibration-windows calibration windows;
- fp8_hadamard: fp8 built with kv_cache_rotation="hadamard", when build_plan takes that keyword (else skipped, noted);
- fp8_smooth_k, fp8_smooth: fp8 built with kv_cache_smoothing="k" (the keys' calibrated per-layer mean subtracted)
  or "kv" (the values' too); fp8_hadamard_smooth_k, fp8_hadamard_smooth: the same with the Hadamard rotation on top
  (when build_plan takes kv_cache_smoothing; else skipped, noted). The build calibrates the means on data.py's
  calibration slice, disjoint from the held-out windows;
- fp8_hadamard_kv_smooth: K and V smoothed and both rotated (kv_cache_rotation="hadamard_kv"); ..._amax: the same
  with per-layer scales amax / 448 of its own pools at scale 1.0 over the calibration windows (what the pools store
  after the transforms, as e4m3 rounds it); ..._amax_built: the same scales computed by the build
  (kv_cache_scales="amax": the final graph's K/V amax over data.py's calibration windows, model-dtype pools);
  ..._amax_head: kv_cache_scales="amax_head" (those, and every KV head brought within 2x of its layer's range by a
  power of two, undone exactly on q and the output); fp8_search, ..._search: kv_cache_scales="search" (each layer's
  scale the one of 16 in [2, 4) x amax / 448 whose rounding costs the attention output least on calibration text).

Perplexity and KL: trtopt/quantize/data.py's text rule (the last --windows x --window tokens of Python's reference
manual, held out from calibration; BOS in front of each window when the tokenizer adds one, as for Gemma). The
executors run directly (no engine: the engine returns only top-k logprobs, and an honest KL needs whole
distributions): --batch windows per step, each prefilled in chunks of --chunk tokens from an empty pool, with every
position's logits; every token after the first is scored. The same step inputs go to every cell's executor, so the
KL(auto || cell) per token and the top-1 agreement compare the same rows; the per-window paired standard error of the
log-perplexity difference says how much of a Δppl is text noise. The PagedAttention kernels write each chunk's K/V
into the pool first and then read all keys and values back from it, so every token attends over FP8 values, its own
included, as in decoding.

Greedy agreement: the chat prompts of tests/e2e/test_gpu_smollm2.py through each cell's engine (plain prompts for a
model without a chat template), NEW_TOKENS tokens each with EOS ignored; the fraction of positions holding the same
token as the auto cell, and the number of prompts with the same tokens throughout.

Needle (--only needle; Gemma-3-270m by default, a base model: no chat template, so plain text): the filler is the
same reference-manual text, with "The secret passphrase for <name> is <word>." spliced in at a paragraph boundary
near each depth of --needle-depths, for each total prompt length of --needle-lengths (the longest capped at the plan's
max_model_len minus the answer), --needles-per-cell names and words each; the prompt ends in "Question: What is the
secret passphrase for <name>?\\nAnswer: The secret passphrase for <name> is" and decodes --needle-max-tokens greedy
tokens; retrieved = the word in the output. Every attempt is counted in "total"; the target is judged on the needles
the baseline (auto) retrieves.

Results are merged into --out (default docs/benchmarks/fp8_kv_<gpu>.json on CUDA, fp8_kv_cpu.json on the CPU) after
every phase: other keys (decode_speedup_vs_bf16 from benchmarks/gpu_e2e.py) are kept, needle attempts of other
calls are kept (keyed by length, depth and name), so a run may be split into calls: --only ppl|needle, --model
(--only prep exports and builds the plans alone). Exports and plans are cached under --cache.

    python3 benchmarks/fp8_kv.py --device cuda --only ppl --model smollm2-135m          # 128 windows
    python3 benchmarks/fp8_kv.py --device cuda --only ppl --model gemma3-270m
    python3 benchmarks/fp8_kv.py --device cuda --only needle                            # Gemma-3-270m, 4K-32K
    python3 benchmarks/fp8_kv.py --device cpu --model tiny-llama --windows 2 --out /tmp/fp8_kv_smoke.json
    python3 benchmarks/fp8_kv.py --device cuda --only ppl --model smollm2-135m --cells fp8 fp8_hadamard \
        fp8_smooth_k fp8_hadamard_smooth_k fp8_hadamard_smooth
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trtopt.builder.pipeline import build_plan  # noqa: E402
from trtopt.builder.plan import Limits, read_plan  # noqa: E402
from trtopt.quantize import data  # noqa: E402
from trtopt.runtime.batch import ScheduledBatch, ScheduledSeq, StepInputs  # noqa: E402
from trtopt.runtime.config import EngineConfig  # noqa: E402
from trtopt.runtime.engine import LLMEngine  # noqa: E402
from trtopt.runtime.executors import create_executor  # noqa: E402
from trtopt.runtime.executors.torch_executor import TorchExecutor  # noqa: E402
from trtopt.runtime.input_builder import InputBuilder  # noqa: E402
from trtopt.runtime.sampling_params import SamplingParams  # noqa: E402
from trtopt.signature import FP8_E4M3_MAX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET_DELTA_PCT = 0.5  # relative perplexity increase allowed by the issue, in percent
JITTER = ("fp8", "fp8_x0.95", "fp8_x1.05")  # the fp8 cells whose mean is the reported increase
NEW_TOKENS = 32  # greedy agreement
PLAIN_PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "A hash table is a data structure that",
    "The three most important things when learning Python are", "def fibonacci(n):",
    "The sky is blue because", "To boil an egg, first", "A CPU cache is",
]
NEEDLE_NAMES = ["Alice", "Bernard", "Chloe", "Dmitri", "Esther", "Farouk", "Greta", "Hiroshi", "Ingrid", "Jasper",
                "Kalinda", "Lorenzo", "Mireille", "Nikolai", "Odette", "Priya"]
NEEDLE_WORDS = ["tangerine", "lighthouse", "saxophone", "glacier", "marmalade", "cactus", "harpoon", "volcano",
                "origami", "pelican", "tambourine", "avalanche", "walrus", "porcupine", "lantern", "meteorite"]
START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f} s] {msg}", flush=True)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One KV configuration: the pools' dtype, the per-layer scales (a multiplier of 1.0, or "amax" / "amax_self" set
    here), a rotation, a smoothing, the build's own scales (build_plan's kv_cache_scales)."""

    name: str
    kv_cache_dtype: str = "auto"
    scale: float | str | tuple[float, float] = 1.0  # with build_scales: a multiplier of the built ones (K, V)
    rotation: str | None = None
    smoothing: str | None = None
    build_scales: str | None = None

    def build_options(self) -> dict:
        """build_plan's keywords beyond kv_cache_dtype."""
        calibrated = {}
        if self.smoothing or self.build_scales:
            from trtopt.runtime.kv_calibration import kv_stats

            calibrated = {"kv_calibrator": kv_stats}
        return {**({"kv_cache_rotation": self.rotation} if self.rotation else {}),
                **({"kv_cache_smoothing": self.smoothing} if self.smoothing else {}),
                **({"kv_cache_scales": self.build_scales} if self.build_scales else {}), **calibrated}


CELLS = {c.name: c for c in (
    Cell("auto"), Cell("fp8", "fp8"), Cell("fp8_x0.95", "fp8", 0.95), Cell("fp8_x1.05", "fp8", 1.05),
    Cell("fp8_amax", "fp8", "amax"), Cell("fp8_hadamard", "fp8", rotation="hadamard"),
    Cell("fp8_smooth_k", "fp8", smoothing="k"), Cell("fp8_smooth", "fp8", smoothing="kv"),
    Cell("fp8_hadamard_smooth_k", "fp8", rotation="hadamard", smoothing="k"),
    Cell("fp8_hadamard_smooth", "fp8", rotation="hadamard", smoothing="kv"),
    Cell("fp8_hadamard_kv_smooth", "fp8", rotation="hadamard_kv", smoothing="kv"),
    Cell("fp8_hadamard_kv_smooth_amax", "fp8", "amax_self", rotation="hadamard_kv", smoothing="kv"),
    Cell("fp8_hadamard_kv_smooth_amax_built", "fp8", rotation="hadamard_kv", smoothing="kv", build_scales="amax"),
    Cell("fp8_hadamard_kv_smooth_amax_head", "fp8", rotation="hadamard_kv", smoothing="kv", build_scales="amax_head"),
    Cell("fp8_search", "fp8", build_scales="search"),
    Cell("fp8_hadamard_kv_smooth_search", "fp8", rotation="hadamard_kv", smoothing="kv", build_scales="search"),
    Cell("fp8_hadamard_smooth_search", "fp8", rotation="hadamard", smoothing="kv", build_scales="search"),
    # headroom over the build's amax scales (the held-out text exceeds the calibration's amax): x2, x4, and vLLM's
    # calculate_kv_scales constants (K amax -> 200, V amax -> 100 instead of 448)
    *(Cell(f"fp8_hadamard_kv_smooth_amax_built_{tag}", "fp8", mult, rotation="hadamard_kv", smoothing="kv",
           build_scales="amax") for tag, mult in (("x2", 2.0), ("x4", 4.0), ("vllm", (448 / 200, 448 / 100)))),
)}


def rotation_supported() -> bool:
    """build_plan takes kv_cache_rotation (the Hadamard-rotated FP8 KV cache), in this tree."""
    return "kv_cache_rotation" in inspect.signature(build_plan).parameters


def cell_supported(cell: Cell) -> bool:
    """build_plan takes every keyword ``cell`` needs, in this tree."""
    return set(cell.build_options()) <= set(inspect.signature(build_plan).parameters)


# ---- exports and plans ---------------------------------------------------------------------------------------------


def export(model: str, dtype: str, cache: Path) -> Path:
    out = cache / f"{model}-{dtype}-export"
    if not (out / "model.onnx").is_file():
        from trtopt.export import export_model

        t0 = time.perf_counter()
        export_model(model, out, dtype=dtype, force=True)
        log(f"exported {model} in {dtype} ({time.perf_counter() - t0:.0f} s)")
    return out


def build(source: Path, cache: Path, cell: Cell, limits: Limits) -> Path:
    """The plan of ``cell`` without its scales (those are rewritten by with_scales), cached by its build options."""
    kwargs: dict = {"kv_cache_dtype": cell.kv_cache_dtype, **cell.build_options()}
    suffix = "".join(f"-{x}" for x in (cell.rotation, cell.smoothing and f"smooth_{cell.smoothing}",
                                        cell.build_scales and f"scales_{cell.build_scales}") if x)
    out = cache / f"{source.name}-plan-{cell.kv_cache_dtype}{suffix}"
    named = {k: v for k, v in kwargs.items() if k != "kv_calibrator"}  # the options, not the function that runs them
    stamp = json.dumps({"source": str(source), "limits": dataclasses.asdict(limits), **named}, sort_keys=True)
    if (out / "plan.json").is_file() and (out / "fp8_kv_stamp.json").is_file() \
            and (out / "fp8_kv_stamp.json").read_text() == stamp:
        return out
    t0 = time.perf_counter()
    build_plan(source, out, limits=limits, force=True, progress=False, **kwargs)
    (out / "fp8_kv_stamp.json").write_text(stamp)
    log(f"built {out.name} ({time.perf_counter() - t0:.0f} s)")
    return out


def with_scales(plan_dir: Path, out: Path, k_scales: list[float], v_scales: list[float]) -> Path:
    """A copy of the fp8 plan whose PagedAttention nodes carry these scales (the loader refuses hard-linked weights,
    so they are copied)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in plan_dir.iterdir():
        if f.name != "model.onnx":
            shutil.copy2(f, out / f.name)
    model = onnx.load(str(plan_dir / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    for node, k, v in zip(nodes, k_scales, v_scales, strict=True):
        for attr in node.attribute:
            if attr.name in ("k_scale", "v_scale"):
                attr.f = k if attr.name == "k_scale" else v
    onnx.save(model, str(out / "model.onnx"))
    return out


def open_executor(plan_dir: Path, device: str, attention: str = "kernel"):
    """The torch executor of a plan; on CUDA with CUDA graphs, which an engine over it captures (ppl steps, with a
    logits row per token, hold no graph bucket and run eagerly through the same kernels). attention="reference":
    every PagedAttention runs its torch reference (fp32 math on the pool's stored values; TorchExecutor
    reference_ops) instead of the Triton kernel, without CUDA graphs."""
    t0 = time.perf_counter()
    if attention == "reference":
        executor = TorchExecutor(plan_dir, read_plan(plan_dir), device=device, reference_ops=("PagedAttention",))
    else:
        executor = create_executor("torch", plan_dir, read_plan(plan_dir), device=device,
                                   cuda_graphs=device == "cuda")
    log(f"opened {plan_dir.name} on {device} ({time.perf_counter() - t0:.0f} s)")
    return executor


# ---- perplexity and KL ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WindowStep:
    """One step of the held-out windows: its inputs, the token each logits row predicts, and its window."""

    inputs: StepInputs
    targets: torch.Tensor  # int64 [N]
    window_of_row: torch.Tensor  # int64 [N]: index into the windows


def pool_blocks(window_len: int, batch: int, block_size: int) -> int:
    """Blocks a pool needs for ``batch`` windows at once (plus the null block)."""
    return batch * -(-(window_len - 1) // block_size) + 1


def window_steps(windows: np.ndarray, *, batch: int, chunk: int, block_size: int, max_blocks_per_seq: int):
    """Yield the steps that prefill ``windows`` ([n, L]) ``batch`` at a time in chunks of ``chunk`` tokens, each
    window from position 0 in its own blocks, asking for the logits of every position but the last token's."""
    builder = InputBuilder(block_size, max_blocks_per_seq)
    length = windows.shape[1]
    per_window = -(-(length - 1) // block_size)
    for first in range(0, len(windows), batch):
        group = range(first, min(first + batch, len(windows)))
        for start in range(0, length - 1, chunk):
            end = min(start + chunk, length - 1)
            seqs = [ScheduledSeq(request_id=f"w{w}", token_ids=[int(t) for t in windows[w, start:end]],
                                 start_pos=start, block_ids=list(range(1 + k * per_window, 1 + (k + 1) * per_window)),
                                 samples=False, prompt_logprob_positions=range(start, end))
                    for k, w in enumerate(group)]
            inputs = builder.build(ScheduledBatch(seqs, sum(len(s.token_ids) for s in seqs), []))
            targets = torch.from_numpy(np.concatenate([windows[w, start + 1:end + 1] for w in group]))
            rows = torch.repeat_interleave(torch.tensor(list(group)), end - start)
            yield WindowStep(inputs, targets, rows)


def score(ref: torch.Tensor, logits: torch.Tensor, step: WindowStep, acc: dict, *, rows: int = 512) -> None:
    """Add this step's NLL per window, KL(ref || logits) and top-1 agreement with ref to ``acc``; row slices bound
    the memory of a 262k vocabulary."""
    targets, windows = step.targets.to(logits.device), step.window_of_row.to(logits.device)
    for lo in range(0, logits.shape[0], rows):
        sl = slice(lo, lo + rows)
        lp = torch.log_softmax(logits[sl].float(), dim=-1)
        ref_lp = torch.log_softmax(ref[sl].float(), dim=-1)
        nll = -lp.gather(1, targets[sl, None])[:, 0].double()
        acc["nll"].index_add_(0, windows[sl], nll)
        terms = torch.where(ref_lp.isfinite(), ref_lp.exp() * (ref_lp - lp), 0.0)  # 0 log 0 = 0
        acc["kl"] += terms.sum(-1).double().sum()
        acc["top1"] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum()
        acc["count"].index_add_(0, windows[sl], torch.ones_like(nll))


def perplexities(executors: dict, windows: np.ndarray, *, batch: int, chunk: int, plan) -> dict:
    """Per cell: per-window NLL sums and token counts, KL(auto || cell) sum, top-1 agreements with auto, seconds.
    Every cell's executor runs the same steps; ``executors`` holds "auto"."""
    device = executors["auto"].device
    n = len(windows)
    accs = {name: {"nll": torch.zeros(n, dtype=torch.float64, device=device), "count": torch.zeros(
        n, dtype=torch.float64, device=device), "kl": torch.zeros((), dtype=torch.float64, device=device),
        "top1": torch.zeros((), dtype=torch.int64, device=device), "seconds": 0.0} for name in executors}
    blocks = pool_blocks(windows.shape[1], batch, plan.limits.block_size)
    for executor in executors.values():
        executor.allocate_kv_cache(blocks)
    steps = list(window_steps(windows, batch=batch, chunk=chunk, block_size=plan.limits.block_size,
                              max_blocks_per_seq=plan.max_blocks_per_seq))
    for i, step in enumerate(steps):
        ref = None
        for name, executor in executors.items():
            t0 = time.perf_counter()
            logits = executor.execute(step.inputs)
            ref = logits if ref is None else ref
            score(ref, logits, step, accs[name])
            if device.type == "cuda":
                torch.cuda.synchronize()
            accs[name]["seconds"] += time.perf_counter() - t0
        if i % max(1, len(steps) // 8) == 0 or i == len(steps) - 1:
            log(f"  step {i + 1}/{len(steps)}")
    return accs


def summarize(accs: dict) -> dict:
    """Each cell's perplexity, Δppl against auto (with the paired per-window standard error of the log ratio), mean
    KL and top-1 agreement."""
    base = accs["auto"]
    base_mean = (base["nll"] / base["count"]).cpu().numpy()
    out = {}
    for name, acc in accs.items():
        tokens = float(acc["count"].sum())
        log_ppl = float(acc["nll"].sum()) / tokens
        diff = (acc["nll"] / acc["count"]).cpu().numpy() - base_mean
        stderr = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else float("nan")
        out[name] = {"perplexity": round(math.exp(log_ppl), 5), "scored_tokens": int(tokens),
                     "delta_ppl_pct": round(100 * (math.exp(log_ppl - float(base["nll"].sum()) / tokens) - 1), 4),
                     "delta_ppl_pct_paired_stderr": round(100 * stderr, 4),
                     "mean_kl_nats": float(f"{float(acc['kl']) / tokens:.3e}"),
                     "top1_agreement": round(int(acc["top1"]) / tokens, 6), "seconds": round(acc["seconds"], 2)}
    return out


def amax_scales(executor, windows: np.ndarray, *, batch: int, chunk: int, plan) -> tuple[list[float], list[float]]:
    """Per-layer K and V scales amax / 448 of the pools over ``windows`` (model-dtype pools; or FP8 pools at scale
    1.0, whose values are e4m3's roundings of what they store, for amax_self)."""
    executor.allocate_kv_cache(pool_blocks(windows.shape[1], batch, plan.limits.block_size))
    amax = None
    for step in window_steps(windows, batch=batch, chunk=chunk, block_size=plan.limits.block_size,
                             max_blocks_per_seq=plan.max_blocks_per_seq):
        executor.execute(step.inputs)
        now = torch.stack([p.float().abs().amax(dim=(0, 2, 3, 4)) for p in executor.kv_caches])  # [layers, 2]
        amax = now if amax is None else torch.maximum(amax, now)
    k, v = (amax / FP8_E4M3_MAX).cpu().T.tolist()
    return k, v


# ---- greedy agreement and the needle ---------------------------------------------------------------------------------


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, on_done=None) -> list[list[int]]:
    """Token ids of each prompt's completion through ``engine``; on_done(i, token_ids) as each finishes."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
                if on_done is not None:
                    on_done(int(out.request_id), done[int(out.request_id)])
    return [done[i] for i in range(len(prompts))]


def engine_for(executor, plan, tokenizer, device: str, **config) -> LLMEngine:
    t0 = time.perf_counter()
    engine = LLMEngine(executor, plan, tokenizer, EngineConfig(enable_prefix_caching=False, **config), device=device)
    log(f"  engine up ({time.perf_counter() - t0:.0f} s: pools{', CUDA graphs' if device == 'cuda' else ''})")
    return engine


def greedy_prompts(tokenizer) -> tuple[str, list[list[int]]]:
    if tokenizer.chat_template:
        return "chat", [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
                        for q in data.CHAT_QUESTIONS]
    return "plain", [tokenizer(p).input_ids for p in PLAIN_PROMPTS]


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict:
    same = [float(np.mean([a == b for a, b in zip(t, r)])) for t, r in zip(tokens, ref)]
    first = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None) for t, r in zip(tokens, ref)]
    before = [len(t) if f is None else f for f, t in zip(first, tokens)]
    return {"position_agreement": round(float(np.mean(same)), 4), "identical_prompts": sum(s == 1.0 for s in same),
            "prompts": len(same), "mean_tokens_before_divergence": round(float(np.mean(before)), 2),
            "first_divergence": first}


@dataclasses.dataclass(frozen=True)
class Needle:
    length: int  # tokens of the whole prompt
    depth: float  # where the needle sits in the filler, 0 = first, 1 = last
    name: str
    word: str
    token_ids: list[int]
    needle_at: int  # token index of the needle in the prompt


def needle_prompts(tokenizer, lengths: list[int], depths: list[float], per_cell: int) -> list[Needle]:
    """The needle prompts: filler from the reference-manual text (a different slice for each), the needle spliced in
    at the paragraph boundary nearest its depth, the question last."""
    corpus = data.corpus_tokens(tokenizer)
    bos = data.with_bos(np.zeros((1, 0), np.int64), tokenizer)[0].tolist()
    newline = {int(t): "\n" in tokenizer.decode([int(t)]) for t in np.unique(corpus)}
    prompts = []
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            for j in range(per_cell):
                k = (li * len(depths) + di) * per_cell + j
                name, word = NEEDLE_NAMES[k % len(NEEDLE_NAMES)], NEEDLE_WORDS[(k * 7 + li) % len(NEEDLE_WORDS)]
                needle = tokenizer(f"The secret passphrase for {name} is {word}.\n", add_special_tokens=False).input_ids
                question = tokenizer(f"\n\nQuestion: What is the secret passphrase for {name}?\nAnswer: The secret "
                                     f"passphrase for {name} is", add_special_tokens=False).input_ids
                size = length - len(bos) - len(needle) - len(question)
                assert 0 < size < len(corpus), f"a {length}-token prompt needs {size} filler tokens of {len(corpus)}"
                offset = (k * 7919) % (len(corpus) - size)
                filler = corpus[offset:offset + size].tolist()
                at = paragraph_boundary([newline[t] for t in filler], round(depth * size))
                ids = bos + filler[:at] + needle + filler[at:] + question
                prompts.append(Needle(length, depth, name, word, ids, len(bos) + at))
    return prompts


def paragraph_boundary(is_newline: list[bool], at: int) -> int:
    """The index after the newline token nearest ``at`` (the start stays the start), or ``at`` when there is none."""
    if at <= 0:
        return 0
    ends = [i + 1 for i, nl in enumerate(is_newline) if nl]
    return min(ends, key=lambda e: abs(e - at)) if ends else at


def run_needles(executor, plan, tokenizer, needles: list[Needle], args) -> list[str]:
    """Each needle prompt's greedy answer through an engine over ``executor``."""
    longest = max(len(n.token_ids) for n in needles) + args.needle_max_tokens
    per_seq = -(-longest // plan.limits.block_size)
    engine = engine_for(executor, plan, tokenizer, args.device, num_blocks=args.needle_batch * per_seq + 1,
                        max_num_seqs=args.needle_batch, max_model_len=longest)
    params = SamplingParams(temperature=0, max_tokens=args.needle_max_tokens)
    t0 = time.perf_counter()

    def done(i: int, ids: list[int]) -> None:
        n = needles[i]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        log(f"  needle {i + 1}/{len(needles)} L={n.length} depth={n.depth} {n.name}={n.word}: "
            f"{'HIT ' if n.word in text.lower() else 'miss'} {text!r} ({time.perf_counter() - t0:.0f} s)")

    tokens = generate(engine, [n.token_ids for n in needles], params, on_done=done)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in tokens]


# ---- phases --------------------------------------------------------------------------------------------------------


def save(path: Path, update) -> None:
    """Apply ``update`` to the file's JSON as it is now (other phases and calls wrote their own keys) and write it."""
    report = json.loads(path.read_text()) if path.is_file() else {}
    update(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def cell_plans(cells: list[Cell], source: Path, limits: Limits, args, auto_executor, calibration) -> dict[str, Path]:
    """Each cell's plan dir; fp8_amax's scales come from ``auto_executor`` over the calibration windows."""
    plans: dict[str, Path] = {}
    for cell in cells:
        if cell.scale == "amax_self":  # the transforms' own values: amax of this cell's pools at scale 1.0
            base = build(source, args.cache, dataclasses.replace(cell, name=cell.name + "_x1", scale=1.0), limits)
            executor = open_executor(base, args.device, args.attention)
            k, v = amax_scales(executor, calibration, batch=args.batch, chunk=args.chunk, plan=executor.plan)
            del executor
            log(f"  {cell.name}: amax scales of its transformed K/V over {len(calibration)} calibration windows: "
                f"K {min(k):.4f}..{max(k):.4f}, V {min(v):.4f}..{max(v):.4f}")
            plans[cell.name] = with_scales(base, args.cache / f"{base.name}-{cell.name}", k, v)
            continue
        if cell.build_scales and cell.scale != 1.0:  # headroom over the build's own scales
            base = build(source, args.cache, dataclasses.replace(cell, scale=1.0), limits)
            mk, mv = cell.scale if isinstance(cell.scale, tuple) else (cell.scale, cell.scale)
            k, v = scales_of(base)
            plans[cell.name] = with_scales(base, args.cache / f"{base.name}-{cell.name}", [x * mk for x in k],
                                           [x * mv for x in v])
            continue
        if cell.kv_cache_dtype == "auto" or cell.build_options() or cell.scale == 1.0:
            plans[cell.name] = build(source, args.cache, cell, limits)
            continue
        fp8 = build(source, args.cache, CELLS["fp8"], limits)
        layers = read_plan(fp8).model.num_layers
        if cell.scale == "amax":
            plan = auto_executor.plan
            k, v = amax_scales(auto_executor, calibration, batch=args.batch, chunk=args.chunk, plan=plan)
            log(f"  amax scales over {len(calibration)} calibration windows: K {min(k):.4f}..{max(k):.4f}, "
                f"V {min(v):.4f}..{max(v):.4f}")
        else:
            k = v = [float(cell.scale)] * layers
        plans[cell.name] = with_scales(fp8, args.cache / f"{fp8.name}-{cell.name}", k, v)
    return plans


def ppl_phase(args, source: Path, tokenizer, limits: Limits) -> None:
    t_phase = time.perf_counter()
    slices = data.split_windows(data.corpus_tokens(tokenizer), heldout=(args.windows, args.window), calibration=(
        data.DEFAULT_CALIBRATION_SEQUENCES, data.DEFAULT_CALIBRATION_LENGTH))
    heldout = data.with_bos(slices.heldout, tokenizer)
    calibration = data.with_bos(slices.calibration[:args.calibration_windows], tokenizer)
    cells, notes = [], {}
    for name in dict.fromkeys(["auto", *args.cells]):
        if not cell_supported(CELLS[name]):
            notes[name] = f"skipped: build_plan takes no {' or '.join(CELLS[name].build_options())} in this tree"
            log(f"{name}: {notes[name]}")
        else:
            cells.append(CELLS[name])
    auto = open_executor(build(source, args.cache, CELLS["auto"], limits), args.device, args.attention)
    plans = cell_plans(cells, source, limits, args, auto, calibration)
    executors = {"auto": auto, **{c.name: open_executor(plans[c.name], args.device, args.attention) for c in cells[1:]}}
    log(f"{args.model} ppl: {len(heldout)} windows x {heldout.shape[1]} tokens, {len(executors)} cells")
    results = summarize(perplexities(executors, heldout, batch=args.batch, chunk=args.chunk, plan=auto.plan))
    for name, res in results.items():
        res["kv_pool_dtype"] = executors[name].plan.kv_pool_dtype
        if name in ("fp8_amax", "fp8_hadamard_kv_smooth_amax") or CELLS[name].build_scales:
            res["k_scales"], res["v_scales"] = scales_of(plans[name])
        log(f"  {name}: ppl {res['perplexity']} ({res['delta_ppl_pct']:+.3f}% +- {res['delta_ppl_pct_paired_stderr']}),"
            f" KL {res['mean_kl_nats']:.2e}, top-1 {res['top1_agreement']:.4f} [{res['seconds']} s]")
    entry = ppl_entry(args, heldout, results, notes)
    key = args.model if args.attention == "kernel" else f"{args.model}@reference"
    entry["attention"] = args.attention
    save(args.out, lambda r: r.setdefault("ppl", {}).__setitem__(key, entry))
    if args.attention == "kernel":
        entry["greedy_agreement"] = greedy_phase(args, executors, tokenizer)
        save(args.out, lambda r: r.setdefault("ppl", {}).__setitem__(key, entry))
    log(f"{args.model} ppl phase done ({time.perf_counter() - t_phase:.0f} s)")


def scales_of(plan_dir: Path) -> tuple[list[float], list[float]]:
    nodes = [n for n in onnx.load(str(plan_dir / "model.onnx"), load_external_data=False).graph.node
             if n.op_type == "PagedAttention"]
    k, v = ([round(next(a.f for a in n.attribute if a.name == s), 6) for n in nodes] for s in ("k_scale", "v_scale"))
    return k, v


def ppl_entry(args, heldout: np.ndarray, results: dict, notes: dict) -> dict:
    jitter = [results[c]["delta_ppl_pct"] for c in JITTER if c in results]
    mean = float(np.mean(jitter)) if jitter else None
    return {
        "dtype": args.dtype, "device": device_name(args.device),
        "text": f"trtopt/quantize/data.py held-out: last {args.windows} x {args.window} tokens",
        "windows": list(heldout.shape), "bos_prepended": heldout.shape[1] > args.window,
        "steps": f"{args.batch} windows a step in chunks of {args.chunk} tokens, executors driven directly",
        "cells": results, "notes": notes,
        "fp8_jitter_cells": [c for c in JITTER if c in results],
        "relative_perplexity_increase_pct": None if mean is None else round(mean, 4),
        "relative_perplexity_increase_pct_range": [min(jitter), max(jitter)] if jitter else None,
        "mean_kl_nats_fp8_jitter": float(f"{np.mean([results[c]['mean_kl_nats'] for c in JITTER if c in results]):.3e}")
        if jitter else None,
        "target_pct": TARGET_DELTA_PCT, "meets_target": None if mean is None else mean <= TARGET_DELTA_PCT,
        "versions": versions(),
    }


def greedy_phase(args, executors: dict, tokenizer) -> dict:
    """Greedy tokens of each cell's engine on the chat (or plain) prompts, against the auto cell's."""
    kind, prompts = greedy_prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for name, executor in executors.items():
        t0 = time.perf_counter()
        longest = max(map(len, prompts)) + NEW_TOKENS
        per_seq = -(-longest // executor.plan.limits.block_size)
        engine = engine_for(executor, executor.plan, tokenizer, args.device, max_num_seqs=len(prompts),
                            num_blocks=len(prompts) * per_seq + 1, max_model_len=longest,
                            max_num_batched_tokens=min(512, executor.plan.limits.max_num_tokens))
        tokens[name] = generate(engine, prompts, params)
        log(f"  greedy {name} ({time.perf_counter() - t0:.0f} s)")
    out = {"prompts": kind, "new_tokens": NEW_TOKENS, "ignore_eos": True,
           "auto_text": [tokenizer.decode(t) for t in tokens["auto"]]}
    for name in tokens:
        if name != "auto":
            out[name] = agreement(tokens[name], tokens["auto"])
            log(f"  greedy {name} vs auto: {out[name]['position_agreement']} of positions, "
                f"{out[name]['identical_prompts']}/{out[name]['prompts']} prompts identical")
    return out


def needle_phase(args, source: Path, tokenizer, limits: Limits) -> None:
    t_phase = time.perf_counter()
    base = args.dtype  # the baseline's key: the pools' dtype (bf16 on CUDA)
    names = ["auto", "fp8"] + (["fp8_hadamard"] if "fp8_hadamard" in args.cells and rotation_supported() else [])
    plans = {name: build(source, args.cache, CELLS[name], limits) for name in names}
    max_len = read_plan(plans["auto"]).limits.max_model_len
    lengths = [min(length, max_len - args.needle_max_tokens) for length in args.needle_lengths]
    needles = needle_prompts(tokenizer, lengths, args.needle_depths, args.needles_per_cell)
    log(f"needle: {len(needles)} prompts of {sorted(set(lengths))} tokens on {args.model}, cells {names}")
    details = [{"length": n.length, "depth": n.depth, "name": n.name, "word": n.word, "needle_at": n.needle_at,
                "prompt_tokens": len(n.token_ids)} for n in needles]
    for name in names:
        t0 = time.perf_counter()
        executor = open_executor(plans[name], args.device)
        answers = run_needles(executor, executor.plan, tokenizer, needles, args)
        key = base if name == "auto" else name
        for d, n, text in zip(details, needles, answers):
            d[key] = {"retrieved": n.word in text.lower(), "answer": text}
        hits = sum(d[key]["retrieved"] for d in details)
        log(f"needle {key}: {hits}/{len(needles)} retrieved ({time.perf_counter() - t0:.0f} s)")
        del executor
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save(args.out, lambda r: r.__setitem__("needle", merge_needles(r.get("needle"), details, args, base)))
    log(f"needle phase done ({time.perf_counter() - t_phase:.0f} s)")


def merge_needles(old: dict | None, details: list[dict], args, base: str) -> dict:
    """The needle section with this call's attempts replacing those of the same (model, length, depth, name), and
    the counts recomputed over all of them."""
    def key(d: dict) -> tuple:
        return d.get("model", args.model), d["length"], d["depth"], d["name"]

    merged = {key(d): d for d in (old or {}).get("details", [])}
    merged.update({key(d): {"model": args.model, **d} for d in details})
    rows = sorted(merged.values(), key=key)
    cells = [c for c in (base, "fp8", "fp8_hadamard") if any(c in d for d in rows)]

    def counts(sel: list[dict]) -> dict:
        return {"total": len(sel), **{c: sum(bool(d.get(c, {}).get("retrieved")) for d in sel) for c in cells}}

    hits = [d for d in rows if d.get(base, {}).get("retrieved")]
    missed = [{k: d[k] for k in ("model", "length", "depth", "name")} for d in hits
              if "fp8" in d and not d["fp8"]["retrieved"]]
    return {
        **counts(rows),
        "baseline": base, "counted": f"total = every attempt; the target is judged on the {base} hits",
        "fp8_on_baseline_hits": f"{sum(bool(d.get('fp8', {}).get('retrieved')) for d in hits)}/{len(hits)}",
        "fp8_misses_where_baseline_retrieved": missed, "meets_target": not missed if hits else None,
        "per_depth": {str(p): counts([d for d in rows if d["depth"] == p]) for p in sorted({d["depth"] for d in rows})},
        "per_length": {str(n): counts([d for d in rows if d["length"] == n])
                       for n in sorted({d["length"] for d in rows})},
        "prompt": "filler (Python reference manual text) with 'The secret passphrase for <name> is <word>.' at a "
                  "paragraph boundary near the depth, then '\\n\\nQuestion: What is the secret passphrase for "
                  "<name>?\\nAnswer: The secret passphrase for <name> is'; greedy, retrieved = word in the answer",
        "max_tokens": args.needle_max_tokens, "device": device_name(args.device), "versions": versions(),
        "details": rows,
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()


def versions() -> str:
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}"


def default_out(device: str) -> Path:
    if device != "cuda":
        return ROOT / "docs/benchmarks/fp8_kv_cpu.json"
    gpu = torch.cuda.get_device_name()
    name = "h200" if "H200" in gpu else "h100" if "H100" in gpu else gpu.replace(" ", "_").lower()
    return ROOT / f"docs/benchmarks/fp8_kv_{name}.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=("ppl", "needle", "all", "prep"), default="ppl",
                   help="prep: only export and build the auto/fp8 plans into --cache (a call of its own)")
    p.add_argument("--needle", action="store_true", help="the same as --only needle")
    p.add_argument("--model", help="smollm2-135m, gemma3-270m, tiny-llama, ... (default: smollm2-135m for ppl, "
                   "gemma3-270m for the needle)")
    p.add_argument("--dtype", help="the export's dtype (default bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    p.add_argument("--windows", type=int, help="held-out windows (default 128 on CUDA, 16 on the CPU)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, help="windows per step (default 8 on CUDA, 2 on the CPU)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk of each window per step")
    p.add_argument("--calibration-windows", type=int, default=8, help="fp8_amax's calibration windows")
    p.add_argument("--max-num-tokens", type=int, default=2048, help="the plans' token budget per step")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--needles-per-cell", type=int, default=2, help="names/words per (length, depth)")
    p.add_argument("--needle-max-tokens", type=int, default=12)
    p.add_argument("--needle-batch", type=int, help="needle prompts in flight (default 8 on CUDA, 2 on the CPU)")
    p.add_argument("--cache", type=Path, default=Path("/tmp/trtopt-fp8-kv"))
    p.add_argument("--out", type=Path, help="default docs/benchmarks/fp8_kv_<gpu>.json (fp8_kv_cpu.json on the CPU)")
    p.add_argument("--attention", choices=("kernel", "reference"), default="kernel",
                   help="reference: every cell's PagedAttention runs its torch reference (fp32 math on the pool's "
                        "values, plugins/paged_attention/reference.py) instead of the Triton kernel, which separates "
                        "the cost of storing e4m3 from the kernel's own arithmetic; results go under ppl[<model>"
                        "@reference]")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.only = "needle" if args.needle else args.only
    args.model = args.model or ("gemma3-270m" if args.only == "needle" else "smollm2-135m")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.windows = args.windows or (128 if cuda else 16)
    args.batch = args.batch or (8 if cuda else 2)
    args.needle_batch = args.needle_batch or (8 if cuda else 2)
    args.out = args.out or default_out(args.device)
    if args.batch * args.chunk > args.max_num_tokens:
        p.error(f"--batch {args.batch} x --chunk {args.chunk} exceeds --max-num-tokens {args.max_num_tokens}")
    return args


def main() -> None:
    args = parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    log(f"{args.model} {args.dtype} on {device_name(args.device)}: {args.only} -> {args.out}")
    source = export(args.model, args.dtype, args.cache)
    tokenizer = data.load_tokenizer(source)
    # One limit set for both phases (the plans are shared): a 32K sequence (capped at the model's context by the
    # build), chunked prefill in steps of --max-num-tokens.
    limits = Limits(block_size=16, max_num_tokens=args.max_num_tokens,
                    max_num_seqs=max(8, args.batch, args.needle_batch), max_model_len=32768)
    if args.only == "prep":
        for name in ("auto", "fp8", *(["fp8_hadamard"] if rotation_supported() else [])):
            build(source, args.cache, CELLS[name], limits)
    if args.only in ("ppl", "all"):
        ppl_phase(args, source, tokenizer, limits)
    if args.only in ("needle", "all"):
        needle_phase(args, source, tokenizer, limits)
    log("done" + ("" if args.only == "prep" else f"; wrote {args.out}"))


if __name__ == "__main__":
    main()
