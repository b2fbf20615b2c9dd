"""Speculative decoding benchmark (issue 12): tok/s with and without speculation, per proposer, batch 1 and 8,
on committed prompt sets (benchmarks/prompts/spec_*.json): copy_heavy (rewrite / fix / convert what the prompt
gives), code_edit (rename one name in a code block and print it again: the answer is mostly a copy) and open_chat.
Greedy, so every run produces the same tokens as the baseline (checked) and only the speed differs. By default a
request stops at EOS (the answer itself is measured; --ignore-eos generates --max-tokens past it, where a small
chat model starts an unrelated conversation that no proposer can guess).

    python benchmarks/spec_decode.py --plan out/smollm2-plan --device cpu --max-tokens 64
    python benchmarks/spec_decode.py --plan out/smollm2-plan --device cuda --k 2 4 6 8 --out docs/benchmarks/spec_decode_h200

n-gram runs once per K in --k (and --prompt-lookup-min/max); self-draft once per N in --self-draft-layers at
--self-draft-k. Self-draft plans are built beside the plan (plan/draft_N) when missing. Each row records the
engine's graph counters (eager target/draft steps: 0 on CUDA means every measured step replayed a graph) and the
draft's start-up capture. Writes OUT.json (after every cell) and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from trtopt.builder.draft import build_draft_plan, self_draft_dir
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams

PROMPTS = Path(__file__).parent / "prompts"
SETS = {name: PROMPTS / f"spec_{name}.json" for name in ("copy_heavy", "code_edit", "open_chat")}


def methods(args) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"baseline": None}
    for k in args.k:
        out[f"ngram_k{k}"] = {"method": "ngram", "num_speculative_tokens": k,
                              "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    for n in args.self_draft_layers:
        out[f"self_draft_{n}"] = {"method": "self_draft", "num_layers": n, "num_speculative_tokens": args.self_draft_k}
    return out


def graph_counters(engine: LLMEngine) -> tuple[int, int]:
    """(target steps, draft forwards) that ran eagerly so far; (-1, -1) where there are no graphs."""
    target = engine.executor.graphs
    proposer = getattr(engine.spec, "proposer", None) if engine.spec else None
    draft = getattr(getattr(proposer, "executor", None), "graphs", None)
    return (target.num_eager if target is not None else -1, draft.num_eager if draft is not None else -1)


def run(engine: LLMEngine, prompts: list, max_tokens: int, ignore_eos: bool) -> tuple[float, list[list[int]], dict]:
    """``prompts``: chat texts, or token-id lists (a plan without a tokenizer, prompts tokenized by --tokenizer)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    before = engine.stats()
    eager_before = graph_counters(engine)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p} if isinstance(p, list) else [{"role": "user", "content": p}],
                           params)
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    outs = [done[str(i)] for i in range(len(prompts))]
    st = engine.stats()
    eager = graph_counters(engine)
    spec = {"draft_tokens": st.num_draft_tokens - before.num_draft_tokens,
            "accepted_tokens": st.num_accepted_tokens - before.num_accepted_tokens,
            "spec_steps": sum(o.metrics.num_spec_steps for o in outs),
            "eager_target_steps": eager[0] - eager_before[0] if eager[0] >= 0 else None,
            "eager_draft_forwards": eager[1] - eager_before[1] if eager[1] >= 0 else None}
    return elapsed, [o.outputs[0].token_ids for o in outs], spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens past EOS")
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens of n-gram (one run per K)")
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--self-draft-layers", type=int, nargs="*", default=[8, 20])
    ap.add_argument("--self-draft-k", type=int, default=3)
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts run one at a time for batch 1 (summed)")
    ap.add_argument("--out", default="docs/benchmarks/spec_decode_cpu")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tokenizer", default=None,
                    help="an HF tokenizer dir whose chat template turns the prompt sets into token ids, for a plan "
                    "without a tokenizer (the random-weight 1.24B plan of gpu_e2e.py; its vocabulary must cover them)")
    ap.add_argument("--argmax-outside-graph", action="store_true",
                    help="launch the placeholder fill and the greedy argmax from Python between replays (the A/B of "
                    "the engine's argmax_in_graph, on by default; the draft's follows)")
    args = ap.parse_args()
    for n in args.self_draft_layers:
        if not (self_draft_dir(args.plan, n) / "plan.json").is_file():
            build_draft_plan(args.plan, n)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    results, captures = [], {}
    for name, spec in methods(args).items():
        started = time.perf_counter()
        engine = LLMEngine.from_plan(args.plan, device=args.device, max_model_len=args.max_model_len,
                                     argmax_in_graph=not args.argmax_outside_graph, speculative_config=spec)
        report = engine.spec.capture_report if engine.spec else None
        captures[name] = {"engine_start_s": round(time.perf_counter() - started, 2),
                          "draft_graphs": report.num_graphs if report else None,
                          "draft_capture_s": round(report.seconds, 2) if report else None,
                          "draft_capture_mib": round(report.pool_bytes / 2**20, 1) if report else None}
        run(engine, [[1, 2, 3, 4]] if tokenizer else ["Hello"], 8, True)  # warm-up (allocator, first replays)
        for set_name in args.sets:
            prompts = json.loads(SETS[set_name].read_text())
            if tokenizer is not None:
                prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                              add_generation_prompt=True, return_dict=False))
                           for p in prompts]
            for bs in args.batch_sizes:
                groups = [[p] for p in prompts[: args.batch1_prompts]] if bs == 1 else [prompts[:bs]]
                elapsed, tokens = 0.0, []
                agg = {"draft_tokens": 0, "accepted_tokens": 0, "spec_steps": 0, "eager_target_steps": 0,
                       "eager_draft_forwards": 0}
                for group in groups:
                    dt, toks, spec_stats = run(engine, group, args.max_tokens, args.ignore_eos)
                    elapsed += dt
                    tokens += toks
                    for key in agg:
                        agg[key] = None if spec_stats[key] is None else (agg[key] or 0) + spec_stats[key]
                num = sum(len(t) for t in tokens)
                row = {"method": name, "prompt_set": set_name, "batch_size": bs, "tokens": num,
                       "seconds": round(elapsed, 3), "tok_per_s": round(num / elapsed, 2),
                       "acceptance_rate": round(agg["accepted_tokens"] / agg["draft_tokens"], 3) if agg["draft_tokens"] else None,
                       "mean_accepted_length": round(1 + agg["accepted_tokens"] / agg["spec_steps"], 3) if agg["spec_steps"] else None,
                       "eager_target_steps": agg["eager_target_steps"], "eager_draft_forwards": agg["eager_draft_forwards"],
                       "token_ids": tokens}
                results.append(row)
                print(f"{name:14s} {set_name:10s} b={bs}: {row['tok_per_s']:8.2f} tok/s  acceptance={row['acceptance_rate']}"
                      f"  mean accepted length={row['mean_accepted_length']}  eager={row['eager_target_steps']}/"
                      f"{row['eager_draft_forwards']}", flush=True)
                write(args, results, captures)  # after every cell, so a cut-short run keeps what it measured
        del engine
    write(args, results, captures, final=True)


def write(args, results: list[dict], captures: dict, final: bool = False) -> None:
    base = {(r["prompt_set"], r["batch_size"]): r for r in results if r["method"] == "baseline"}
    rows = []
    for r in results:
        b = base.get((r["prompt_set"], r["batch_size"]))
        row = {k: v for k, v in r.items() if k != "token_ids"}
        if b is not None:
            row["speedup"] = round(r["tok_per_s"] / b["tok_per_s"], 3)
            row["identical_to_baseline"] = r["token_ids"] == b["token_ids"]
        rows.append(row)
    meta = {"plan": str(args.plan), "device": args.device, "max_tokens": args.max_tokens, "k": args.k,
            "ignore_eos": args.ignore_eos, "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
            "self_draft_k": args.self_draft_k, "start_up": captures, "argmax_in_graph": not args.argmax_outside_graph,
            "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None, "complete": final}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if final:
        plot(rows, out.with_suffix(".png"), meta)


def plot(results: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["method"] for r in results))
    keys = list(dict.fromkeys((r["prompt_set"], r["batch_size"]) for r in results))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [next(r["tok_per_s"] for r in results if r["method"] == name and (r["prompt_set"], r["batch_size"]) == k)
                for k in keys]
        ax.bar([x + i * width for x in range(len(keys))], vals, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(keys))])
    ax.set_xticklabels([f"{s}\nbatch {b}" for s, b in keys])
    ax.set_ylabel("tok/s")
    ax.set_title(f"Speculative decoding, {Path(meta['plan']).name}, {meta['gpu'] or meta['device']}, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
