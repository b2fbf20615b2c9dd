"""What n-gram speculation can at best give on a prompt set, whatever a step costs: the greedy outputs are generated
once without speculation, then the proposer is replayed on them (prompt + output so far -> its guess; accepted =
the guess's longest prefix that the output continues with). Greedy verification accepts exactly that, so the
tokens per step computed here are what the engine would get; tokens per step bounds the batch-1 speed-up from
above (a verification step costs at least a decode step).

    python benchmarks/spec_ngram_ceiling.py --plan out/smollm2-plan --device cpu --out docs/benchmarks/spec_ngram_ceiling_cpu

Writes OUT.json: per prompt set, per (K, prompt_lookup_min, prompt_lookup_max): tokens per step and acceptance,
over the answer up to EOS (what the benchmark measures by default) and over --max-tokens past it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.runtime.spec_decode.ngram import ngram_lookup

SETS = {name: Path(__file__).parent / "prompts" / f"spec_{name}.json" for name in ("copy_heavy", "code_edit", "open_chat")}
GRID = [(k, lo, hi) for k in (2, 3, 4, 6, 8) for lo, hi in ((1, 3), (1, 4), (2, 4), (3, 5))]


def replay(prompt: list[int], output: list[int], k: int, lo: int, hi: int) -> tuple[int, int, int]:
    """(steps, draft tokens, accepted) of greedy n-gram speculation generating `output` after `prompt`; the first
    token comes from the prefill step, as in the engine."""
    steps, drafted, accepted, i = 1, 0, 0, 1
    while i < len(output):
        room = min(k, len(output) - i - 1)  # the scheduler leaves room for the accepted drafts plus one token
        guess = ngram_lookup(np.asarray(prompt + output[:i], dtype=np.int64), room, lo, hi) if room > 0 else []
        a = 0
        while a < len(guess) and guess[a] == output[i + a]:
            a += 1
        steps, drafted, accepted, i = steps + 1, drafted + len(guess), accepted + a, i + a + 1
    return steps, drafted, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="docs/benchmarks/spec_ngram_ceiling_cpu")
    args = ap.parse_args()
    engine = LLMEngine.from_plan(args.plan, device=args.device, max_model_len=1024)
    eos = set(engine.plan.model.eos_token_ids)
    report = {"meta": {"plan": str(args.plan), "device": args.device, "max_tokens": args.max_tokens}, "sets": {}}
    for name, path in SETS.items():
        prompts = json.loads(path.read_text())
        for i, p in enumerate(prompts):
            engine.add_request(str(i), [{"role": "user", "content": p}],
                               SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        pairs = [(done[str(i)].prompt_token_ids, done[str(i)].outputs[0].token_ids) for i in range(len(prompts))]
        rows = []
        for k, lo, hi in GRID:
            row = {"k": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
            for scope in ("to_eos", "past_eos"):
                steps = drafted = accepted = tokens = 0
                for prompt, out in pairs:
                    if scope == "to_eos":
                        out = out[: next((j + 1 for j, t in enumerate(out) if t in eos), len(out))]
                    s, d, a = replay(prompt, out, k, lo, hi)
                    steps, drafted, accepted, tokens = steps + s, drafted + d, accepted + a, tokens + len(out)
                row[scope] = {"tokens": tokens, "tokens_per_step": round(tokens / steps, 3),
                              "acceptance_rate": round(accepted / drafted, 3) if drafted else None}
            rows.append(row)
            print(f"{name:10s} K={k} n={lo}-{hi}: tokens/step {row['to_eos']['tokens_per_step']:.2f} to EOS, "
                  f"{row['past_eos']['tokens_per_step']:.2f} over {args.max_tokens}", flush=True)
        report["sets"][name] = rows
        out = Path(args.out).with_suffix(".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
