"""Architecture coverage: tiny random model of each family → `trtopt export` → `trtopt build` → greedy tokens vs HF.

    PYTHONPATH=. python benchmarks/coverage.py --out docs/benchmarks/coverage.jsonl [--archs llama,gemma3]
        [--exporters dynamo,legacy,optimum] [--dtypes fp32,fp16,bf16]
    python benchmarks/coverage.py --table docs/benchmarks/coverage.jsonl > docs/coverage.md

The optimum exporter is not run here (optimum-onnx pins transformers 4.57): its rows build the committed exports of
tests/fixtures/optimum/ (tools/optimum_fixtures.py; tiny random configs of their own, fp32 only), whose HF
reference is the fixture dir itself.

Each (architecture, exporter, dtype) appends one JSON line (so an interrupted run keeps what it finished):
the stage that failed and its error, or the fused attention count and whether the greedy tokens of three prompts
(1-20 tokens, 10 new tokens, crossing the 8-token sliding windows) equal HF `generate` token for token. The tiny
configs are tests/export/tiny_archs.py's. fp16/bf16 rows compare with HF run in the same dtype; a prompt whose
tokens differ records its first differing step with both sides' logit gaps between the two tokens, and counts as a
near-tie (rounding, not a bug) when both are within the dtype's logit tolerance (see ``_divergence``). The
markdown has one table per dtype, one column per exporter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "export"))
OPTIMUM_FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "optimum"
# The coverage names of the fixture dirs (optimum's Falcon fixture is the multi-query form).
OPTIMUM_ARCH = {"falcon-mq": "falcon"}

PROMPTS = [[5, 17, 99, 3, 120, 7], list(range(10, 30)), [1]]
NEW_TOKENS = 10
LOGPROB_ALTERNATIVES = 5  # the plan's top-k at a divergence: enough to hold HF's token when it is a near-tie


def run_one(arch: str, exporter: str, dtype: str, root: Path) -> dict:
    import torch
    from tiny_archs import save_tiny
    from transformers import AutoModelForCausalLM

    from trtopt import LLM, SamplingParams
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.check.compare import tolerance_for
    from trtopt.export import export_model
    from trtopt.export.exporter import DTYPES

    row: dict = {"arch": arch, "exporter": exporter, "dtype": dtype}
    stage = "export"
    start = time.perf_counter()
    try:
        if exporter == "optimum":
            hf_dir = onnx_dir = OPTIMUM_FIXTURES / OPTIMUM_ARCH.get(arch, arch)
            if dtype != "fp32" or not (onnx_dir / "model.onnx").is_file():
                row |= {"status": "not run", "error": "no committed optimum fixture", "seconds": 0.0}
                return row
        else:
            hf_dir, onnx_dir = save_tiny(arch, root / "hf"), root / "onnx"
            # ORT's CPU provider has no bf16 kernels, so a bf16 export cannot be verified on ORT (the HF
            # comparison below still checks the plan end to end).
            export_model(hf_dir, onnx_dir, exporter=exporter, dtype=dtype, verify_outputs=dtype != "bf16")
        stage = "build"
        built = build_plan(onnx_dir, root / "plan", progress=False,
                           limits=Limits(block_size=8, max_num_tokens=128, max_num_seqs=4, max_model_len=64))
        row |= {"layers": built.config.model.num_layers, "fused": built.report.counts.get("paged_attention", 0),
                "unfused": len(built.report.unfused), "notes": list(built.notes),
                "counts": {k: v for k, v in built.report.counts.items() if v}}
        stage = "generate"
        llm = LLM(built.plan_dir)
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype]).eval()
        hf.generation_config.eos_token_id = None
        tolerance = tolerance_for(built.config.model.dtype)
        same, divergences, with_logprobs = 0, [], None
        for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
            got = out.outputs[0].token_ids
            ref, hf_logits = _hf_greedy(hf, prompt)
            if got == ref:
                same += 1
                continue
            step = next(k for k, (a, b) in enumerate(zip(ref, got)) if a != b)
            # The plan's logprobs at that step, from a second run asking for them (the first run's greedy path
            # is the fast one that returns no logprobs; both paths take the argmax of the same logits). It runs the
            # same batch as the first, step for step: in fp16/bf16 another batch composition rounds differently.
            if with_logprobs is None:
                with_logprobs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
                    temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=LOGPROB_ALTERNATIVES))
            again = with_logprobs[i].outputs[0]
            assert again.token_ids == got, "a logprobs run of the plan chose other greedy tokens"
            divergence = _divergence(step, ref[step], got[step], hf_logits[step], again.logprobs[step], tolerance)
            # The exact model's view of the same choice (HF in fp32, same context): information for the reader.
            exact = _next_logits(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(),
                                 prompt + ref[:step])
            divergence["fp32_gap"] = round(float(exact[ref[step]] - exact[got[step]]), 5)
            divergences.append({"prompt": i, **divergence})
        ties = sum(d["near_tie"] for d in divergences)
        row |= {"status": "ok", "greedy_equal": f"{same}/{len(PROMPTS)}", "near_ties": ties,
                "diverged": len(divergences) - ties, "divergences": divergences,
                "tolerance": dataclasses.asdict(tolerance)}
    except Exception as e:  # a coverage run records every failure and goes on
        row |= {"status": f"{stage} failed", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list]:
    """HF `generate`'s greedy tokens for ``prompt`` and the float32 logits it chose each of them from."""
    import torch

    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


def _next_logits(hf, ids: list[int]):
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def _divergence(step: int, hf_token: int, plan_token: int, hf_logits, plan_logprobs: dict[int, float],
                tolerance) -> dict:
    """Where the plan's greedy tokens leave HF's: both choices are argmaxes over the same context (every token
    before ``step`` agreed), so the divergence is a near-tie when each side's preference for its own token over
    the other's is within the dtype's logit tolerance (trtopt check's: max(atol, rtol·|logit|)). Logprob gaps
    equal logit gaps (one normaliser), so HF's logits and the plan's logprobs compare directly. A gap beyond the
    tolerance on either side is a real disagreement: the two backends' logits differ by more than the tolerance."""
    hf_gap = float(hf_logits[hf_token] - hf_logits[plan_token])
    allowed = max(tolerance.atol, tolerance.rtol * abs(float(hf_logits[hf_token])))
    # None: HF's token is not among the plan's top alternatives, i.e. the plan prefers its own by a wide margin
    plan_gap = (plan_logprobs[plan_token] - plan_logprobs[hf_token]) if hf_token in plan_logprobs else None
    return {"step": step, "hf_token": hf_token, "plan_token": plan_token, "hf_gap": round(hf_gap, 5),
            "plan_gap": None if plan_gap is None else round(plan_gap, 5), "allowed": round(allowed, 5),
            "near_tie": hf_gap <= allowed and plan_gap is not None and plan_gap <= allowed}


EXPORTERS = ("dynamo", "legacy", "optimum")
DTYPE_ORDER = ("fp32", "fp16", "bf16")


def _cell(row: dict | None, notes: list[str]) -> str:
    """One cell; a divergence or failure is told in full in ``notes`` (the footnotes under its table)."""
    if row is None or row["status"] == "not run":
        return "–"
    if row["status"] != "ok":
        notes.append(f"{row['arch']}, {row['exporter']}: {row.get('error', '')}")
        return f"**{row['status']}** [{len(notes)}]"
    text = f"{row['fused']}/{row['layers']} fused, {row['greedy_equal']} = HF"
    divergences = row.get("divergences", [])  # rows recorded before the near-tie criterion have none
    if divergences:
        for d in divergences:
            plan_gap = "HF's token not in the plan's top 5" if d["plan_gap"] is None else f"plan gap {d['plan_gap']:g}"
            notes.append(f"{row['arch']}, {row['exporter']}: prompt {d['prompt']} diverges at new token {d['step']} "
                         f"(HF {d['hf_token']}, plan {d['plan_token']}): HF gap {d['hf_gap']:g}, {plan_gap}, "
                         f"allowed {d['allowed']:g}; fp32 model's gap {d['fp32_gap']:g}: "
                         + ("a near-tie" if d["near_tie"] else "**beyond the tolerance**"))
        parts = [f"{n} {word}" for n, word in ((row["near_ties"], "near-tie"), (row["diverged"], "**diverged**")) if n]
        text += f" + {', '.join(parts)} [{len(notes) - len(divergences) + 1}" + \
            (f"–{len(notes)}]" if len(divergences) > 1 else "]")
    return f"{text} ({row['seconds']:.0f} s)"


def table(jsonl: Path) -> str:
    latest: dict[tuple, dict] = {}  # a re-run of a row (after a fix) replaces the earlier one
    for line in jsonl.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            latest[row["arch"], row["exporter"], row["dtype"]] = row
    from tiny_archs import ARCHS

    order = {arch: i for i, arch in enumerate(ARCHS)}  # tiny_archs' order; any other name after them
    archs = sorted(dict.fromkeys(key[0] for key in latest), key=lambda a: order.get(a, len(order)))
    lines = ["# Architecture coverage", "",
             f"Generated by `benchmarks/coverage.py --table {jsonl}` from the runs recorded there (CPU; export →",
             "`trtopt build` → `LLM.generate` greedy vs HF `generate`, 3 prompts of 1–20 tokens × 10 new tokens",
             "crossing the 8-token sliding windows; the latest run of each cell). trtopt's exporters run on the tiny",
             "random configs of tests/export/tiny_archs.py; the optimum column builds the committed optimum-onnx 0.1.0",
             "exports of tests/fixtures/optimum/ (tools/optimum_fixtures.py, their own tiny configs; fp32 only). A cell",
             "reads \"fused attention / layers, prompts whose greedy tokens equal HF's\"; – was not run; a failure is",
             "shown as it happened (numbered notes under each table). Seconds are wall time on a shared 2-core machine",
             "(export + build + both generations; the optimum cells have no export step), so they compare nothing but",
             "orders of magnitude.", "",
             "fp16 and bf16 plans are compared with HF run in the same dtype. Two implementations of one model in a",
             "16-bit dtype round differently (fused kernels, summation order), so greedy tokens may leave each other",
             "where the top two logits are nearly tied, and every token after that is a different continuation. A",
             "prompt that does not equal HF is therefore judged at its first differing token, where both sides chose",
             "an argmax over the same context: it is a *near-tie* when HF's logit gap between its token and the",
             "plan's, and the plan's logprob gap the other way, are both within the dtype's logit tolerance (`trtopt",
             "check`'s, trtopt/check/compare.py: max(atol, rtol·|logit|), fp16 5e-2/1e-2, bf16 2.5e-1/5e-2), and it",
             "*diverged* (a bug to find) otherwise. The notes give both gaps.", ""]
    for dtype in [d for d in DTYPE_ORDER if any(key[2] == d for key in latest)]:
        exporters = [e for e in EXPORTERS if any(key[1:] == (e, dtype) for key in latest)]
        notes: list[str] = []
        lines += [f"## {dtype}", "", "| architecture | " + " | ".join(exporters) + " |", "|---|" + "---|" * len(exporters)]
        for arch in archs:
            cells = [_cell(latest.get((arch, e, dtype)), notes) for e in exporters]
            lines.append(f"| {arch} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        lines.append("")
        lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
        if notes:
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    from tiny_archs import ARCHS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/coverage.jsonl"))
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--exporters", default="dynamo")
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--table", type=Path, help="print the markdown table of a recorded run and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table), end="")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for arch in args.archs.split(","):
        for exporter in args.exporters.split(","):
            for dtype in args.dtypes.split(","):
                root = Path(tempfile.mkdtemp(prefix=f"coverage-{arch}-"))
                try:
                    row = run_one(arch, exporter, dtype, root)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                print(json.dumps(row), flush=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
