"""A peer producer's Q/DQ graphs through `trtopt build` (issue 32): NVIDIA ModelOpt's ONNX PTQ
(`nvidia-modelopt`, `modelopt.onnx.quantization`) quantizes a trtopt export, and the plan built from its graph is
checked against that graph (`trtopt check ORIGINAL PLAN`: torch CPU and ONNX Runtime, logits and greedy tokens).

ModelOpt pulls its own torch, cupy and onnxruntime-gpu, so it lives in a venv of its own; this script runs its
quantizer there (--modelopt-python) and everything else here:

    python3 -m venv /tmp/mo && /tmp/mo/bin/pip install "nvidia-modelopt[onnx]==0.47.0"
    python benchmarks/modelopt_producer.py --modelopt-python /tmp/mo/bin/python \\
        --out docs/benchmarks/modelopt_producer.json

Forms (ModelOpt 0.47 on the CPU, offline):
- ``int4_rtn_b32``: `quantize_mode="int4"`, `calibration_method="rtn_dq"`, `block_size=32` (tiny-llama's K of 64
  and 128 take no larger block): blocked int4 DequantizeLinear(axis 0) → MatMul, symmetric. (`use_zero_point` has
  no effect with rtn_dq.)
- ``fp8_w8a8``: `quantize_mode="fp8"` with `--high_precision_dtype fp32` and `--nodes_to_quantize` the MatMuls
  with a constant weight (its default also quantizes the attention's two MatMuls, which the attention rule cannot
  collapse), calibrated on one 16-token sequence: the weight stays fp32 and is quantized in the graph,
  QuantizeLinear(w, per-channel scale) → DequantizeLinear, with a static per-tensor activation Q/DQ. Its default
  LM-head exclusion (`/lm_head`) does not match trtopt's node names, so the LM head is quantized too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUANTIZE = r'''
import shutil, sys
from pathlib import Path
import onnx
from modelopt.onnx.quantization import quantize
src, out, form, calib = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
out.mkdir(parents=True, exist_ok=True)
if form == "int4_rtn_b32":
    kw = dict(quantize_mode="int4", calibration_method="rtn_dq", block_size=32)
else:
    m = onnx.load(str(src / "model.onnx"), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    nodes = [n.name for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    import numpy as np
    calibration = dict(np.load(calib))
    kw = dict(quantize_mode="fp8", calibration_data=calibration, high_precision_dtype="fp32", nodes_to_quantize=nodes)
quantize(str(src / "model.onnx"), output_path=str(out / "model.onnx"), calibration_eps=["cpu"], **kw)
for f in src.iterdir():
    if f.suffix in (".json", ".jinja"):
        shutil.copy(f, out / f.name)
'''


def calibration_file(export: Path, path: Path, length: int = 16) -> None:
    """One sequence of `length` random token ids with no past, as the export's inputs (an .npz ModelOpt reads)."""
    import numpy as np
    import onnx

    proto = onnx.load(str(export / "model.onnx"), load_external_data=False)
    rng = np.random.default_rng(0)
    feeds = {}
    for value in proto.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, 1000, (1, length)).astype(np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, length), np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(length, dtype=np.int64)[None]
        else:  # past key/value [batch, kv heads, 0, head dim]
            feeds[value.name] = np.zeros((1, dims[1], 0, dims[3]), np.float32)
    np.savez(path, **feeds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modelopt-python", required=True, help="python of a venv with nvidia-modelopt[onnx]")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from trtopt.builder.pipeline import build_plan
    from trtopt.check import run_check
    from trtopt.export import export_model

    work = Path(tempfile.mkdtemp(prefix="modelopt-"))
    export = export_model(args.model, work / "onnx", force=True).out_dir
    calib = work / "calib.npz"
    calibration_file(export, calib)
    version = subprocess.run([args.modelopt_python, "-c", "import modelopt; print(modelopt.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    results = {}
    for form in ("int4_rtn_b32", "fp8_w8a8"):
        started = time.monotonic()
        qdir = work / form
        done = subprocess.run([args.modelopt_python, "-c", QUANTIZE, str(export), str(qdir), form, str(calib)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            results[form] = {"quantized": False, "error": done.stderr.strip().splitlines()[-1][:500]}
            print(form, json.dumps(results[form]), flush=True)
            continue
        built = build_plan(qdir, work / f"plan-{form}", force=True, progress=False)
        report = run_check(built.plan_dir, original=qdir, backends=["torch-cpu", "onnxruntime-cpu"])
        row = {"quantized": True, "fusion_counts": {k: v for k, v in built.report.counts.items() if v},
               "unfused_qmatmul": [str(f) for f in built.report.unfused if f.rule == "qmatmul"],
               "check_passed": report.passed, "seconds": round(time.monotonic() - started, 1)}
        for name in ("torch-cpu", "onnxruntime-cpu"):
            r = report.by_name(name)
            agree, total = report.tokens_agree(r)
            row[name] = {"passed": r.logits.passed, "logits_max_abs": r.logits.max_abs,
                         "greedy_tokens_equal": f"{agree}/{total}"}
        results[form] = row
        print(form, json.dumps(row), flush=True)
    data = {"benchmark": "modelopt_producer", "model": args.model, "modelopt": version,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "reference": "the ModelOpt Q/DQ graph on onnxruntime-cpu (trtopt check ORIGINAL PLAN)", "forms": results}
    out = args.out or Path("docs/benchmarks/modelopt_producer.json")
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    if not all(r.get("check_passed") for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
