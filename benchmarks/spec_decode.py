"""Speculative decoding benchmark (issue 12): tok/s with and without speculation, per proposer, batch 1 and 8,
on a copy-heavy and an open-chat prompt set (benchmarks/prompts/spec_*.json). Greedy, so every run produces the
same tokens as the baseline (checked) and only the speed differs.

    python benchmarks/spec_decode.py --plan out/smollm2-plan --device cpu --max-tokens 64
    python benchmarks/spec_decode.py --plan out/smollm2-plan --device cuda --out docs/benchmarks/spec_decode_h100

Self-draft plans are built beside the plan (plan/draft_N) when missing. Writes OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from trtopt.build.draft import build_draft_plan, self_draft_dir
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams

PROMPTS = Path(__file__).parent / "prompts"
SETS = {"copy_heavy": PROMPTS / "spec_copy_heavy.json", "open_chat": PROMPTS / "spec_open_chat.json"}


def methods(args) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"baseline": None,
                                   "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                                             "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
    for n in args.self_draft_layers:
        out[f"self_draft_{n}"] = {"method": "self_draft", "num_layers": n, "num_speculative_tokens": args.k}
    return out


def run(engine: LLMEngine, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), [{"role": "user", "content": p}], params)
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    if engine.executor.__class__.__name__ == "TorchExecutor" and torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    outs = [done[str(i)] for i in range(len(prompts))]
    st = engine.stats()
    steps = sum(o.metrics.num_spec_steps for o in outs)
    spec = {"draft_tokens": st.num_draft_tokens, "accepted_tokens": st.num_accepted_tokens,
            "acceptance_rate": st.num_accepted_tokens / st.num_draft_tokens if st.num_draft_tokens else None,
            "mean_accepted_length": 1 + st.num_accepted_tokens / steps if steps else None}
    return elapsed, [o.outputs[0].token_ids for o in outs], spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--self-draft-layers", type=int, nargs="*", default=[8, 20])
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--batch1-prompts", type=int, default=2, help="prompts run one at a time for batch 1 (averaged)")
    ap.add_argument("--out", default="docs/benchmarks/spec_decode_cpu")
    args = ap.parse_args()
    for n in args.self_draft_layers:
        if not (self_draft_dir(args.plan, n) / "plan.json").is_file():
            build_draft_plan(args.plan, n)
    results = []
    for name, spec in methods(args).items():
        engine = LLMEngine.from_plan(args.plan, device=args.device, max_model_len=1024, speculative_config=spec)
        run(engine, ["Hello"], 8)  # warm-up (CUDA graphs, allocator)
        for set_name, path in SETS.items():
            prompts = json.loads(path.read_text())
            for bs in args.batch_sizes:
                groups = [[p] for p in prompts[: args.batch1_prompts]] if bs == 1 else [prompts[:bs]]
                elapsed, tokens, agg = 0.0, [], {"draft_tokens": 0, "accepted_tokens": 0}
                for group in groups:
                    engine = LLMEngine(engine.executor, engine.plan, engine.tokenizer, engine_config(spec),
                                       plan_dir=args.plan, device=args.device) if spec else engine
                    dt, toks, spec_stats = run(engine, group, args.max_tokens)
                    elapsed += dt
                    tokens += toks
                    agg["draft_tokens"] += spec_stats["draft_tokens"]
                    agg["accepted_tokens"] += spec_stats["accepted_tokens"]
                num = sum(len(t) for t in tokens)
                row = {"method": name, "prompt_set": set_name, "batch_size": bs, "tokens": num,
                       "seconds": round(elapsed, 3), "tok_per_s": round(num / elapsed, 2),
                       "acceptance_rate": round(agg["accepted_tokens"] / agg["draft_tokens"], 3) if agg["draft_tokens"] else None,
                       "token_ids": tokens}
                results.append(row)
                print(f"{name:14s} {set_name:10s} b={bs}: {row['tok_per_s']:7.2f} tok/s  acceptance={row['acceptance_rate']}", flush=True)
                write(args, results)  # after every cell, so a cut-short run keeps what it measured
    write(args, results, final=True)


def write(args, results: list[dict], final: bool = False) -> None:
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
            "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None, "complete": final}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if final:
        plot(rows, out.with_suffix(".png"), meta)


def engine_config(spec):
    from trtopt.runtime.engine import EngineConfig

    return EngineConfig(max_model_len=1024, speculative_config=spec)


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
    ax.set_title(f"Speculative decoding, SmolLM2-135M fp32, {meta['device']}, K={meta['k']}, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
