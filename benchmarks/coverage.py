"""Architecture coverage: tiny random model of each family → `trtopt export` → `trtopt build` → greedy tokens vs HF.

    PYTHONPATH=. python benchmarks/coverage.py --out docs/benchmarks/coverage.jsonl [--archs llama,gemma3]
        [--exporters dynamo,legacy,optimum] [--dtypes fp32]
    python benchmarks/coverage.py --table docs/benchmarks/coverage.jsonl > docs/coverage.md

The optimum exporter is not run here (optimum-onnx pins transformers 4.57): its rows build the committed exports of
tests/fixtures/optimum/ (tools/optimum_fixtures.py; tiny random configs of their own, fp32 only), whose HF
reference is the fixture dir itself.

Each (architecture, exporter, dtype) appends one JSON line (so an interrupted run keeps what it finished):
the stage that failed and its error, or the fused attention count and whether the greedy tokens of three prompts
(1-20 tokens, 10 new tokens, crossing the 8-token sliding windows) equal HF `generate` token for token. The tiny
configs are tests/export/tiny_archs.py's. fp16/bf16 rows compare with HF run in the same dtype.
"""

from __future__ import annotations

import argparse
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


def run_one(arch: str, exporter: str, dtype: str, root: Path) -> dict:
    import torch
    from tiny_archs import save_tiny
    from transformers import AutoModelForCausalLM

    from trtopt import LLM, SamplingParams
    from trtopt.build.builder import build_plan
    from trtopt.build.plan import Limits
    from trtopt.export import export_model

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
            export_model(hf_dir, onnx_dir, exporter=exporter, dtype=dtype, verify_outputs=dtype != "bf16")
        stage = "build"
        built = build_plan(onnx_dir, root / "plan", progress=False,
                           limits=Limits(block_size=8, max_num_tokens=128, max_num_seqs=4, max_model_len=64))
        row |= {"layers": built.config.model.num_layers, "fused": built.report.counts.get("paged_attention", 0),
                "unfused": len(built.report.unfused), "notes": list(built.notes)}
        stage = "generate"
        outs = LLM(built.plan_dir).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype).eval()
        hf.generation_config.eos_token_id = None
        same = 0
        for prompt, out in zip(PROMPTS, outs):
            x = torch.tensor([prompt])
            with torch.no_grad():
                ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
            same += out.outputs[0].token_ids == ref
        row |= {"status": "ok", "greedy_equal": f"{same}/{len(PROMPTS)}"}
    except Exception as e:  # a coverage run records every failure and goes on
        row |= {"status": f"{stage} failed", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _cell(row: dict | None) -> str:
    if row is None or row["status"] == "not run":
        return "–"
    if row["status"] != "ok":
        return f"**{row['status']}**: {row.get('error', '')[:300]}".replace("|", "/")
    return f"{row['fused']}/{row['layers']} fused, {row['greedy_equal']} = HF ({row['seconds']:.0f} s)"


def table(jsonl: Path) -> str:
    latest: dict[tuple, dict] = {}  # a re-run of a row (after a fix) replaces the earlier one
    for line in jsonl.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            latest[row["arch"], row["exporter"], row["dtype"]] = row
    archs = list(dict.fromkeys(key[0] for key in latest))
    columns = list(dict.fromkeys((key[1], key[2]) for key in latest))
    lines = ["# Architecture coverage", "",
             f"Generated by `benchmarks/coverage.py --table {jsonl}` from the runs recorded there (CPU; export →",
             "`trtopt build` → `LLM.generate` greedy vs HF `generate`, 3 prompts of 1–20 tokens × 10 new tokens",
             "crossing the 8-token sliding windows; the latest run of each cell). trtopt's exporters run on the tiny",
             "random configs of tests/export/tiny_archs.py; the optimum column builds the committed optimum-onnx 0.1.0",
             "exports of tests/fixtures/optimum/ (tools/optimum_fixtures.py, their own tiny configs). A cell reads",
             "\"fused attention / layers, prompts whose greedy tokens equal HF's\"; – was not run; a failure is shown",
             "as it happened. Seconds are wall time on a shared 2-core machine (export + build + both generations; the",
             "optimum cells have no export step), so they compare nothing but orders of magnitude.", "",
             "| architecture | " + " | ".join(f"{e} {d}" for e, d in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for arch in archs:
        lines.append(f"| {arch} | " + " | ".join(_cell(latest.get((arch, e, d))) for e, d in columns) + " |")
    return "\n".join(lines) + "\n"


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
