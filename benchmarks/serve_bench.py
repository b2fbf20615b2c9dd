"""Serving benchmark: time to first token and throughput of `trtopt serve` under concurrent streaming clients.

For each plan it starts `trtopt serve` on 127.0.0.1 and runs, in the same process and on the same prompts:
  - `server xC`: C concurrent clients (default 16), each sending its requests one after another (closed loop);
  - `server x1`: one client, the same requests sequentially (what serving without batching would give);
  - baseline `offline`: the same requests added at once to an in-process LLMEngine and stepped to the end
    (no HTTP, no tokenization on the clock): the ceiling the server's batching can reach.
Every request streams a greedy completion of a fixed length (ignore_eos) spread around --max-tokens.

    python benchmarks/serve_bench.py --plan tiny=/tmp/plan-tiny --plan smollm2=/tmp/plan-smol \
        --out docs/benchmarks/serve_cpu.json

Writes JSON (machine, date, per-run p50/p95 TTFT, p50 inter-token latency, throughput) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

NOTES = (
    "TTFT is measured by the client from sending the request to the first streamed token. The offline baseline adds "
    "every request at once, so its TTFT includes waiting for one of the --concurrency seats: compare its throughput, "
    "not its TTFT. Run with OMP_NUM_THREADS=1 on a shared 2-core machine: with 2 intra-op threads and other jobs "
    "running, OpenMP spin-waits made engine steps 10-30x slower at p90."
)

PROMPT_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "birds", "sing")


def max_tokens_of(i: int, mean: int) -> int:
    """Output lengths spread over [mean/2, 3*mean/2] (deterministic), so closed-loop clients do not move in lockstep
    (equal lengths would make all of them finish, and all new prompts prefill, in the same step)."""
    return mean // 2 + (i * 37) % (mean + 1)


def prompts(num: int, words: int) -> list[str]:
    """Distinct prompts of about `words` words (distinct, so the prefix cache does not flatter TTFT)."""
    return [f"Request {i}: " + " ".join(PROMPT_WORDS[(i + j) % len(PROMPT_WORDS)] for j in range(words))
            for i in range(num)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ---- server runs ---------------------------------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "end": stamps[-1]}


async def _clients(base_url: str, all_prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    queue = [(p, max_tokens_of(i, max_tokens)) for i, p in enumerate(all_prompts)]
    results = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            prompt, n = queue.pop(0)
            results.append({**await _one(client, prompt, n), "tokens": n})

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(f"server x{concurrency}", [r["ttft"] for r in results], [x for r in results for x in r["itl"]],
                     sum(r["tokens"] for r in results), wall, len(results))


def summarize(name: str, ttft: list[float], itl: list[float], tokens: int, wall: float, requests: int) -> dict:
    return {
        "run": name, "requests": requests, "output_tokens": tokens, "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 2), "requests_per_s": round(requests / wall, 3),
        "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1), "ttft_p95_ms": round(1000 * percentile(ttft, 0.95), 1),
        "itl_p50_ms": round(1000 * percentile(itl, 0.5), 2) if itl else None,
        "itl_p95_ms": round(1000 * percentile(itl, 0.95), 2) if itl else None,
    }


def start_server(plan: Path, port: int, max_num_seqs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trtopt.cli.main", "serve", str(plan), "--port", str(port), "--model-name", "bench",
           "--max-num-seqs", str(max_num_seqs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"trtopt serve failed:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("trtopt serve did not become healthy in 300 s")


# ---- offline baseline ----------------------------------------------------------------------------------------


def offline(plan: Path, all_prompts: list[str], max_tokens: int, max_num_seqs: int) -> dict:
    from trtopt.runtime.engine import LLMEngine
    from trtopt.runtime.sampling_params import SamplingParams

    engine = LLMEngine.from_plan(plan, max_num_seqs=max_num_seqs)
    engine.add_request("warmup", all_prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    arrival, first, last, itl = {}, {}, {}, []
    for i, p in enumerate(all_prompts):
        arrival[str(i)] = time.perf_counter()
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens_of(i, max_tokens), temperature=0.0,
                                                     ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.outputs[0].delta_token_ids:
                if o.request_id in first:
                    itl.append(now - last[o.request_id])
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    wall = time.perf_counter() - start
    ttft = [first[k] - arrival[k] for k in arrival]
    tokens = sum(max_tokens_of(i, max_tokens) for i in range(len(all_prompts)))
    return summarize("offline LLMEngine (baseline)", ttft, itl, tokens, wall, len(all_prompts))


# ---- main ----------------------------------------------------------------------------------------------------


def bench_plan(label: str, plan: Path, args: argparse.Namespace, port: int) -> list[dict]:
    all_prompts = prompts(args.requests, args.prompt_words)
    proc = start_server(plan, port, args.concurrency)
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_clients(base, all_prompts[:2], 2, 4))  # warm-up: first-step compilation and allocations
        runs = [asyncio.run(_clients(base, all_prompts, args.concurrency, args.max_tokens)),
                asyncio.run(_clients(base, all_prompts[: args.sequential_requests], 1, args.max_tokens))]
    finally:
        proc.terminate()
        proc.wait(30)
    runs.append(offline(plan, all_prompts, args.max_tokens, args.concurrency))
    for r in runs:
        r["model"] = label
        print(json.dumps(r))
    return runs


def plot(results: list[dict], path: Path, title: str) -> None:
    """One row per model: throughput, and p50/p95 TTFT, of each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.4 * len(models)), squeeze=False)
    for (ax1, ax2), model in zip(axes, models):
        runs = [r for r in results if r["model"] == model]
        labels = [r["run"].replace("offline LLMEngine (baseline)", "offline engine\n(baseline)") for r in runs]
        x = range(len(runs))
        bars = ax1.bar(labels, [r["throughput_tok_s"] for r in runs], color="tab:blue")
        ax1.bar_label(bars, fmt="%.0f")
        ax1.set_ylabel("output tokens / s")
        ax1.set_title(f"{model}: throughput")
        ax2.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in runs], width=0.4, label="p50")
        ax2.bar([i + 0.2 for i in x], [r["ttft_p95_ms"] for r in runs], width=0.4, label="p95")
        ax2.set_xticks(list(x), labels)
        ax2.set_yscale("log")
        ax2.set_ylabel("ms")
        ax2.set_title(f"{model}: time to first token")
        ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _title(doc: dict) -> str:
    m = doc["machine"]
    return (f"trtopt serve, streaming completions, CPU ({m['cpu_count']} cores, {m['torch_threads']} torch thread(s), "
            f"load avg {m['loadavg_1m_before_after'][0]}), {doc['date'][:10]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="append", default=[], help="LABEL=PLAN_DIR (repeatable)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="requests in the concurrent run")
    parser.add_argument("--sequential-requests", type=int, default=8, help="requests in the one-client run")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean output length (each in [mean/2, 3*mean/2])")
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--port", type=int, default=18777)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/serve_cpu.json"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing --out JSON")
    args = parser.parse_args()
    if args.plot_only:
        doc = json.loads(args.out.read_text())
        plot(doc["results"], args.out.with_suffix(".png"), _title(doc))
        return
    load_before = os.getloadavg()
    results = []
    for spec in args.plan:
        label, _, plan = spec.partition("=")
        results += bench_plan(label, Path(plan), args, args.port)
    import torch

    doc = {
        "benchmark": "trtopt serve: streaming /v1/completions, closed-loop clients, greedy, ignore_eos",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    # The machine is shared: a load average above the core count means other jobs competed.
                    "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "notes": NOTES,
        "settings": {k: v for k, v in vars(args).items() if k not in ("plan", "out", "port")},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"), _title(doc))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
