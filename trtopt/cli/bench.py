"""`trtopt bench serve`: an online benchmark of a running server (thin over trtopt.serving.benchmark)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trtopt.cli.common import console, handle_errors
from trtopt.errors import ConfigError

bench = typer.Typer(help="Benchmarks of a running server.", no_args_is_help=True, rich_markup_mode="rich")


@bench.command("serve")
@handle_errors
def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", help="The server's address."),
    backend: str = typer.Option("openai", "--backend", help="openai (/v1/completions), openai-chat "
                                "(/v1/chat/completions) or triton (/v2/models/MODEL/generate_stream)."),
    model: str = typer.Option(..., "--model", help="Model name sent to the server (the Triton model for triton)."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="A plan dir or HF tokenizer dir: builds prompts of exact "
                                  "lengths and counts tokens where the server reports no usage."),
    dataset: str = typer.Option("random", "--dataset", help="random or conversations."),
    dataset_path: Path = typer.Option(None, "--dataset-path", help="A ShareGPT-format JSON file for conversations "
                                      "(default: trtopt's synthetic set)."),
    num_prompts: int = typer.Option(100, "--num-prompts", help="Requests per rate."),
    input_len: int = typer.Option(128, "--random-input-len", help="Prompt tokens (random dataset)."),
    output_len: int = typer.Option(64, "--random-output-len", help="Output tokens (random dataset)."),
    range_ratio: float = typer.Option(0.0, "--random-range-ratio", help="Lengths vary uniformly by +-this fraction."),
    request_rates: str = typer.Option("inf", "--request-rate", help="Requests/s, comma-separated for a curve "
                                      "(e.g. 0.5,1,2,inf); inf sends every request at once."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the arrival gaps: 1 = Poisson."),
    max_concurrency: int = typer.Option(None, "--max-concurrency", help="Most requests in flight at once."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly the output length."),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer key for the server."),
    seed: int = typer.Option(0, "--seed", help="Seeds the dataset and the arrival times."),
    note: str = typer.Option("", "--note", help="A note stored in the JSON (e.g. the machine's load)."),
    out: Path = typer.Option(None, "--out", help="Write the results as JSON here."),
    plot: Path = typer.Option(None, "--plot", help="Write a latency-throughput plot (PNG) here."),
):
    """Drive a running `trtopt serve`, any OpenAI-compatible server, or a Triton generate endpoint with
    `vllm bench serve`'s definitions: Poisson arrivals (or a burst), a random or conversation dataset, and request
    throughput, output tok/s, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).

    Examples:

        trtopt bench serve --model plan --tokenizer out/plan --request-rate 1,2,4,inf --num-prompts 64 \\
            --out serve.json --plot serve.png

        trtopt bench serve --backend openai-chat --dataset conversations --model plan --tokenizer out/plan

        trtopt bench serve --backend triton --base-url http://127.0.0.1:8000 --model trtopt --tokenizer out/plan
    """
    from transformers import AutoTokenizer

    from trtopt.serving import benchmark as bm

    target = bm.Target(backend, base_url.rstrip("/"), model, api_key=api_key, ignore_eos=ignore_eos)
    rates = _parse_rates(request_rates)
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {tokenizer!r} ({e}); pass a plan dir or an HF tokenizer dir.") from e
    if dataset == "random":
        requests = bm.random_dataset(tok, num_prompts, input_len, output_len, range_ratio, seed)
    elif dataset == "conversations":
        requests = bm.conversation_dataset(tok, num_prompts, dataset_path or bm.SYNTHETIC_CONVERSATIONS, seed=seed)
    else:
        raise ConfigError(f"--dataset {dataset!r} is not random or conversations.")

    # One request first, as vLLM does: a wrong URL, model or key fails here, not as N identical errors.
    warm, _ = asyncio.run(bm.run_load(target, requests[:1], tok, request_rate=math.inf))
    if not warm[0].success:
        raise ConfigError(f"the test request to {base_url} failed: {warm[0].error}")

    runs = []
    for rate in rates:
        with Progress(TextColumn(f"rate {rate:g} req/s"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("requests", total=len(requests))
            results, duration = asyncio.run(bm.run_load(
                target, requests, tok, request_rate=rate, burstiness=burstiness, max_concurrency=max_concurrency,
                seed=seed, on_done=lambda _r: progress.advance(task)))
        metrics = bm.compute_metrics(results, duration, rate)
        runs.append(metrics)
        console.print(_table(metrics))

    record = {
        "benchmark": "trtopt bench serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "note": note,
        "config": {"base_url": base_url, "backend": backend, "model": model, "dataset": dataset,
                   "num_prompts": num_prompts, "random_input_len": input_len, "random_output_len": output_len,
                   "random_range_ratio": range_ratio, "burstiness": burstiness, "max_concurrency": max_concurrency,
                   "ignore_eos": ignore_eos, "seed": seed},
        "runs": [dataclasses.asdict(m) for m in runs],
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"wrote {out}")
    if plot is not None:
        plot_curve(record, plot)
        console.print(f"wrote {plot}")


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"--request-rate {text!r} must be numbers or inf, comma-separated.") from e
    if not rates or any(r <= 0 for r in rates):
        raise ConfigError(f"--request-rate {text!r}: every rate must be > 0 (inf = a burst).")
    return rates


def _table(m) -> Table:
    t = Table(title=f"request rate {m.request_rate:g} req/s: {m.completed} ok, {m.failed} failed, {m.duration_s:.1f} s")
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")
    for name, stats in (("TTFT (ms)", m.ttft_ms), ("TPOT (ms)", m.tpot_ms), ("ITL (ms)", m.itl_ms), ("E2E latency (ms)", m.e2el_ms)):
        t.add_row(name, *(f"{stats[k]:.1f}" for k in ("mean", "p50", "p90", "p99")))
    t.caption = (f"{m.request_throughput:.2f} req/s, {m.output_throughput:.1f} output tok/s, "
                 f"{m.total_token_throughput:.1f} total tok/s, up to {m.max_concurrent_requests} in flight"
                 + (f"; errors: {'; '.join(m.errors)}" if m.errors else ""))
    return t


def plot_curve(record: dict, path: Path) -> None:
    """Two panels over the runs: TTFT and TPOT (mean, p99) against the achieved output throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    x = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for stat, style in (("mean", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][stat] for r in runs], style, label=stat)
        for r, xi in zip(runs, x):
            ax.annotate(f"{r['request_rate']:g}/s", (xi, r[key]["mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    c = record["config"]
    fig.suptitle(f"{c['model']} via {c['backend']}: {c['dataset']} dataset, {c['num_prompts']} requests per rate "
                 "(labels: request rate)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
