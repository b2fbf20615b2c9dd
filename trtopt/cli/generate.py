"""`trtopt generate`: run prompts through a plan and stream the text as it is generated."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from trtopt.cli.common import (
    async_scheduling_option, console, eager_option, err_console, master_addr_option, master_port_option,
    nnodes_option, node_rank_option, run_worker_node_if_remote, speculative_config_option, tensor_parallel_option,
)


def generate(
    plan: Path = typer.Argument(..., help="A plan dir built by `trtopt build`."),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="A prompt; repeat for a batch."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message with the chat template."),
    system: str = typer.Option(None, "--system", help="A system message (with --chat)."),
    backend: str = typer.Option("torch", help="torch or onnxruntime."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    tensor_parallel_size: int = tensor_parallel_option(),
    nnodes: int = nnodes_option(),
    node_rank: int = node_rank_option(),
    master_addr: str = master_addr_option(),
    master_port: int = master_port_option(),
    eager: bool = eager_option(),
    async_scheduling: bool = async_scheduling_option(),
    max_tokens: int = typer.Option(128, help="Tokens to generate per prompt at most."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = off."),
    min_p: float = typer.Option(0.0),
    repetition_penalty: float = typer.Option(1.0),
    seed: int = typer.Option(None, help="Makes sampling reproducible."),
    stop: list[str] = typer.Option(None, "--stop", help="A stop string; repeatable."),
    n: int = typer.Option(1, help="Completions per prompt."),
    speculative_config: str = speculative_config_option(),
):
    """Generate text for one or more prompts. A single prompt with n=1 is streamed token by token; with
    several, each completion is printed as it finishes. Timings go to stderr.

    Examples:

        trtopt generate out/plan --chat --prompt "What is the capital of France?"

        trtopt generate out/plan -p "Once upon a time" -p "The meaning of life is" --max-tokens 64

        trtopt generate out/plan -p "Write a haiku" --temperature 0.8 --top-p 0.95 --seed 1 --n 2 --backend onnxruntime

        trtopt generate out/plan -p "Repeat: a b c d e f" --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

    Over two hosts (torchrun's flags; node 1 ignores the prompts, runs its ranks until node 0 is done, exits 0):

        trtopt generate out/plan -p "Hi" --tp 4 --nnodes 2 --node-rank R --master-addr 10.0.0.1 --master-port 29500
    """
    from trtopt.runtime.config import NodeConfig
    from trtopt.runtime.llm import LLM
    from trtopt.runtime.sampling_params import SamplingParams

    nodes = NodeConfig(nnodes, node_rank, master_addr, master_port)
    if run_worker_node_if_remote(plan, tensor_parallel_size, nodes, device):
        return

    params = SamplingParams(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
        seed=seed, max_tokens=max_tokens, stop=tuple(stop or ()),
    )
    started = time.perf_counter()
    llm = LLM(plan, backend=backend, device=device, cuda_graphs=False if eager else None,
              tensor_parallel_size=tensor_parallel_size, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
              master_port=master_port, speculative_config=speculative_config,
              async_scheduling=async_scheduling)
    err_console.print(f"loaded {plan} on {backend}/{device} in {time.perf_counter() - started:.1f} s; {_describe(params)}", highlight=False)
    prompts = [_chat(p, system) if chat else p for p in prompt]
    stream = len(prompts) == 1 and n == 1
    started = time.perf_counter()
    with llm:
        outs = llm.generate(prompts, params, on_output=_print_delta if stream else _print_finished)
    elapsed = time.perf_counter() - started
    if stream:
        console.print()
    num_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttft = outs[0].metrics.time_to_first_token
    st = llm.engine.stats()
    spec = ""
    if llm.engine.spec is not None:
        steps = sum(o.metrics.num_spec_steps for o in outs)
        spec = (f"; speculative: {st.num_accepted_tokens}/{st.num_draft_tokens} draft tokens accepted "
                f"({st.num_accepted_tokens / max(st.num_draft_tokens, 1):.0%}), "
                f"{1 + st.num_accepted_tokens / max(steps, 1):.2f} tokens per verification step")
    err_console.print(
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s); first token after {ttft:.2f} s{spec}",
        highlight=False,
    )


def _chat(text: str, system: str | None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": text}]


def _describe(p) -> str:
    mode = "greedy" if p.greedy else f"temperature={p.temperature} top_p={p.top_p} top_k={p.top_k} min_p={p.min_p} seed={p.seed}"
    return f"{mode}, max_tokens={p.max_tokens}, n={p.n}" + (f", stop={list(p.stop)}" if p.stop else "")


def _print_delta(out) -> None:
    console.print(out.outputs[0].delta_text, end="", markup=False, highlight=False, soft_wrap=True)


def _print_finished(out) -> None:
    if not out.finished:
        return
    for c in out.outputs:
        console.rule(f"{out.request_id} [{c.index}] ({c.finish_reason})", style="dim")
        console.print(c.text, markup=False, highlight=False, soft_wrap=True)
