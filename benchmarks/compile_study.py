"""torch.compile (Inductor) against the hand-written fusions (issue 11 §1, last bullet), batch-1 decode.

The model is gpu_e2e.py's: a random-weight Llama-shaped bf16 plan of 1.24B parameters (one HF dir, one export,
two plan builds from it). Four rows, same process, same GPU, same run:

  a  plan with every fusion pass, the executor as is (eager ops, CUDA graphs)     the hand-written fusions (default)
  b  the same plan + torch.compile of the converted graph                         compile on top of them
  c  plan built without the elementwise passes (silu_mul, add_rms_norm, rope)
     + torch.compile                                                             Inductor fuses instead of our passes
  d  that plan without compile                                                   the unfused baseline
  a' row a again at the end                                                      the spread between passes

Compile (TorchExecutor(compile_mode=...), runtime/executors/torch_library.py) specialises the graph per step shape
(dynamic=False) with the trtopt ops (PagedAttention, RMSNorm, ...) as torch.library custom ops; the executor's CUDA
graphs capture the compiled callable per bucket. Under compile the executor's fx RoPE rewrite is off (Inductor fuses
those ops); without compile (row d) it still fuses RoPE, as today: `fx_rope_fused` says so per row.

The engine runs batch 1 with max_num_batched_tokens = --chunk (default 1), so prefill runs as one-token chunks and
only the decode bucket T=1 is captured (and compiled): each compiled shape costs seconds to minutes, and decode
steps are what is measured. Per row: decode tok/s and ms/token (gpu_e2e.batch1_decode), graph replay ms of the T=1
graph, kernels per eager decode step (gpu_e2e.profile_decode: graphs off for 4 steps, a compiled eager shape of
its own), the executor's load, compile and capture seconds, and the greedy tokens of a fixed prompt compared with
row a's.

    python3 benchmarks/compile_study.py                      # GPU: docs/benchmarks/compile_study_<gpu>.json + .png
    python3 benchmarks/compile_study.py --tiny --device cpu  # a CPU smoke run of the same code (Inductor on CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_e2e  # noqa: E402  (the model, its build, the engine and the batch-1 measurements are shared)

DOCS = ROOT / "docs" / "benchmarks"
# The plan passes Inductor stands in for in rows c and d (gpu_e2e.build_without's "+"-joined form); --unfused-passes
# may name others (e.g. add "rms_norm" too: Inductor then fuses the norms' own ops as well).
ELEMENTWISE = "silu_mul+add_rms_norm+rope"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    label: str
    unfused: bool  # the plan built without the ELEMENTWISE passes
    compiled: bool


# The quick (eager) rows first, so that a run cut short still has the baselines; row a first: the tokens reference.
ROWS = (
    Row("a_fused_eager", "a: all passes\neager ops", False, False),
    Row("d_unfused_eager", "d: no elementwise\neager ops", True, False),
    Row("c_unfused_compiled", "c: no elementwise\n+ compile", True, True),
    Row("b_fused_compiled", "b: all passes\n+ compile", False, True),
    Row("a_again", "a': all passes\neager (again)", False, False),
)


def greedy_tokens(engine, prompt: list[int], n: int) -> list[int]:
    from trtopt.runtime.sampling_params import SamplingParams

    engine.add_request("greedy", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, ignore_eos=True,
                                                                                 temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def run_row(row: Row, plan_dir: Path, args, device: torch.device, vocab: int, prompt: list[int]) -> dict:
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.executors import create_executor

    plan = read_plan(plan_dir)
    started = time.perf_counter()
    executor = create_executor("torch", plan_dir, plan, device=str(device), cuda_graphs=device.type == "cuda",
                               compile_mode=args.mode if row.compiled else None)
    load_s = time.perf_counter() - started
    t = time.perf_counter()
    # Allocates the pools and captures (compiling first, under compile) every bucket: T=1 with --chunk 1.
    engine = gpu_e2e.make_engine(executor, plan, max_num_seqs=1, kv_gb=args.kv_gb,
                                 max_num_batched_tokens=args.chunk)
    setup_s = time.perf_counter() - t
    compiled = executor.compiled
    startup_compiles = [dataclasses.asdict(r) for r in compiled.records] if compiled else []
    tokens = greedy_tokens(engine, prompt, args.greedy_tokens)
    r = gpu_e2e.batch1_decode(engine, vocab, device, new_tokens=args.new_tokens, prompt_len=args.prompt_len)
    r["graph_replay_ms"] = gpu_e2e.graph_replay_ms(engine, device)
    profile = gpu_e2e.profile_decode(engine, vocab, device)
    r["kernels_per_step"] = profile["kernels_per_step"] if profile else None
    r["kernel_us_per_step"] = profile["kernel_us_per_step"] if profile else None
    r["profile_top"] = profile["top"][:10] if profile else None
    graphs = executor.graphs
    report = graphs.capture_report if graphs is not None else None
    r.update({
        "plan": plan_dir.name, "compile_mode": args.mode if row.compiled else None,
        "fusion_counts": json.loads((plan_dir / "fusion_report.json").read_text()).get("counts"),
        "fx_rope_fused": executor.num_fused_rope,
        "custom_ops": compiled.num_custom_ops if compiled else None,
        "load_s": load_s,
        # make_engine: pool allocation + (compile +) capture of every bucket; the compiles' share is listed below.
        "startup_s": setup_s,
        "capture": ({"graphs": report.num_graphs, "seconds": report.seconds, "pool_MiB": report.pool_bytes / 2**20}
                    if report else None),
        "startup_compiles": startup_compiles,
        "startup_compile_s": sum(c["seconds"] for c in startup_compiles),
        # Every shape compiled in the row, the eager ones of the profile and of CPU runs included.
        "all_compiles": [dataclasses.asdict(c) for c in compiled.records] if compiled else [],
        "greedy_tokens": tokens,
    })
    if graphs is not None:
        r["eager_steps"], r["replayed_steps"] = graphs.num_eager, graphs.num_replayed
    del engine, executor, graphs, compiled
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {k: r for k, r in data["rows"].items() if "error" not in r}
    rows = [(ROWS_BY_KEY[k].label, r) for k, r in done.items()]
    colors = ["tab:blue" if not ROWS_BY_KEY[k].compiled else "tab:orange" for k in done]
    panels = [("decode_tok_s", "batch-1 decode tok/s", "%.0f"), ("graph_replay_ms", "graph replay ms / step", "%.3f"),
              ("kernels_per_step", "kernels per eager step", "%.0f"),
              ("startup_s", "start-up s (compile + capture)", "%.1f")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    for ax, (key, title, fmt) in zip(axes, panels):
        bars = ax.bar([label for label, _ in rows], [r.get(key) or 0 for _, r in rows], color=colors)
        ax.bar_label(bars, fmt=fmt)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"torch.compile ({data['compile_mode']}) vs hand-written fusions: {data['model']} on "
                 f"{data['machine']['gpu']} ({data['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


ROWS_BY_KEY = {row.key: row for row in ROWS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (a smoke run of the harness)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtopt-compile-study"))
    ap.add_argument("--mode", default="default", help="torch.compile mode (torch_library.COMPILE_MODES)")
    ap.add_argument("--emulate-precision-casts", action="store_true",
                    help="Inductor rounds intermediates to the model dtype as eager does (closer greedy tokens)")
    ap.add_argument("--rows", nargs="*", default=[row.key for row in ROWS], choices=[row.key for row in ROWS])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--unfused-passes", default=ELEMENTWISE,
                    help="plan passes rows c and d are built without, joined by '+'")
    ap.add_argument("--chunk", type=int, default=1, help="max_num_batched_tokens: prefill chunk = largest bucket")
    ap.add_argument("--kv-gb", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default docs/benchmarks/compile_study_<gpu>.json)")
    args = ap.parse_args()

    device = torch.device(args.device)
    shape = gpu_e2e.TINY if args.tiny else gpu_e2e.Shape()
    if args.tiny:
        args.new_tokens, args.prompt_len, args.greedy_tokens, args.kv_gb = 8, 8, 8, 0.05
    if args.emulate_precision_casts:
        from torch._inductor import config as inductor_config

        inductor_config.emulate_precision_casts = True
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    # One HF dir and one export; the plan with every pass and the plan without the elementwise ones.
    _, plan_dir, params, setup = gpu_e2e.build(args.work, shape, device, max_num_seqs=1,
                                               ablate=(args.unfused_passes,))
    unfused_dir = args.work / f"plan-without-{args.unfused_passes}"

    data: dict = {
        "benchmark": "compile_study",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": gpu_name, "torch": torch.__version__, "python": platform.python_version()},
        "model": f"Llama-shaped random bf16, {params / 1e9:.2f}B params" + (" (tiny)" if args.tiny else ""),
        "shape": dataclasses.asdict(shape), "params": params, "setup": setup,
        "compile_mode": args.mode, "emulate_precision_casts": args.emulate_precision_casts,
        "unfused_plan_disables": args.unfused_passes.split("+"),
        "engine": {"max_num_seqs": 1, "max_num_batched_tokens": args.chunk, "kv_gb": args.kv_gb},
        "rows": {},
    }
    out = args.out or DOCS / f"compile_study_{'tiny_' if args.tiny else ''}{gpu_name.split()[-1].lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    from trtopt.runtime.executors.torch_library import GraphCompileError

    rng = random.Random(2)
    prompt = [rng.randrange(shape.vocab) for _ in range(args.prompt_len)]
    for key in args.rows:
        row = ROWS_BY_KEY[key]
        gpu_e2e.log(f"row {key} ...")
        try:
            r = run_row(row, unfused_dir if row.unfused else plan_dir, args, device, shape.vocab, prompt)
        except GraphCompileError as e:  # recorded, not hidden: the row says why it has no numbers
            data["rows"][key] = {"error": str(e)}
            gpu_e2e.log(f"row {key}: torch.compile failed: {e}")
            out.write_text(json.dumps(data, indent=2) + "\n")
            continue
        reference = data["rows"].get("a_fused_eager", {}).get("greedy_tokens")  # None if row a failed or was skipped
        if reference is not None:
            same = [a == b for a, b in zip(r["greedy_tokens"], reference)]
            r["greedy_equal_row_a"] = all(same) and len(r["greedy_tokens"]) == len(reference)
            r["greedy_first_difference"] = same.index(False) if not all(same) else None
        data["rows"][key] = r
        gpu_e2e.log(f"row {key}: {r['decode_tok_s']:.0f} tok/s, graph replay {r['graph_replay_ms'] or 0:.3f} ms, "
                    f"kernels/step {r['kernels_per_step']}, startup {r['startup_s']:.1f} s (compile "
                    f"{r['startup_compile_s']:.1f} s), greedy = row a: {r.get('greedy_equal_row_a')}")
        out.write_text(json.dumps(data, indent=2) + "\n")  # after every row: a run cut short keeps what it measured

    print("\n== summary ==")
    for key, r in data["rows"].items():
        if "error" in r:
            print(f"{key:<20} FAILED: {r['error']}")
            continue
        print(f"{key:<20} {r['decode_tok_s']:8.0f} tok/s  {r['ms_per_token']:.3f} ms/token  graph replay "
              f"{r['graph_replay_ms'] or 0:.3f} ms  kernels/step {r['kernels_per_step']}  load {r['load_s']:.1f} s  "
              f"startup {r['startup_s']:.1f} s (compile {r['startup_compile_s']:.1f} s)  "
              f"greedy = a: {r.get('greedy_equal_row_a')} (first difference {r.get('greedy_first_difference')})")
    if len(data["rows"]) > 1:
        plot(data, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
