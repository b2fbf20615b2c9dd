"""What every subcommand shares: printing TrtOptErrors without a traceback, one console, and the options of the
commands that run a plan (generate, serve, run-batch) or answer OpenAI requests (serve, run-batch)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import typer
from rich.console import Console

from trtopt.errors import TrtOptError
from trtopt.runtime.sampling_params import DEFAULT_MAX_LOGPROBS

console = Console()
err_console = Console(stderr=True)


def handle_errors(command: Callable) -> Callable:
    """User mistakes (TrtOptError) print one clear line and exit 1; anything else is a bug and keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except TrtOptError as e:
            err_console.print(f"[bold red]error:[/] {type(e).__name__}: {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


# ---- options of the commands that run a plan: a new typer.Option per use, so each command owns its parameter -------


def plan_argument() -> Any:
    return typer.Argument(..., help="A plan directory written by `trtopt build`.")


def backend_option() -> Any:
    return typer.Option("torch", "--backend", help="Executor: torch, onnxruntime or tensorrt.")


def device_option() -> Any:
    return typer.Option("cpu", "--device", help="cpu or cuda.")


def tensor_parallel_option() -> Any:
    return typer.Option(None, "--tensor-parallel-size", "--tp",
                        help="Ranks for a plan built with `trtopt build --tensor-parallel N` (default: the plan's N).")


def nnodes_option() -> Any:
    return typer.Option(1, "--nnodes", help="Hosts the tensor-parallel ranks spread over (torchrun's flag): each runs "
                        "tensor-parallel-size / nnodes of them. Start the same command on every host, with its own "
                        "--node-rank.")


def node_rank_option() -> Any:
    return typer.Option(0, "--node-rank", help="This host's place among --nnodes (torchrun's flag). 0 runs the "
                        "engine; any other only runs its ranks for node 0 and blocks until node 0's engine ends, "
                        "then exits 0 (non-zero when node 0 died or fell silent).")


def master_addr_option() -> Any:
    return typer.Option(None, "--master-addr", help="With --nnodes > 1: node 0's address, as every host reaches it.")


def master_port_option() -> Any:
    return typer.Option(None, "--master-port", help="With --nnodes > 1: a free TCP port on node 0 for the group's "
                        "rendezvous (every host passes the same one).")


def run_worker_node_if_remote(plan: Any, tensor_parallel_size: int | None, nodes: Any, device: str) -> bool:
    """Node R > 0 of a multi-node group: run this host's ranks until node 0's engine ends, and return True (the
    command is then done); False on node 0, which goes on to run the engine."""
    if nodes.node_rank == 0:
        return False
    from trtopt.runtime.executors.tensor_parallel import run_worker_node

    err_console.print(f"node {nodes.node_rank} of {nodes.nnodes}: running this host's tensor-parallel ranks for the "
                      f"driver at {nodes.master_addr}:{nodes.master_port} until it ends", highlight=False)
    run_worker_node(plan, tensor_parallel_size, nodes, device=device)
    err_console.print(f"node {nodes.node_rank}: the driver stopped the group", highlight=False)
    return True


def eager_option() -> Any:
    return typer.Option(False, "--eager", help="No CUDA graphs: run every step eagerly (on CUDA, decode steps "
                        "replay captured graphs by default).")


def async_scheduling_option() -> Any:
    return typer.Option(None, "--async-scheduling/--no-async-scheduling",
                        help="Schedule and launch each step before the previous step's tokens reach the host "
                        "(default: on for cuda, off for cpu).")


def speculative_config_option() -> Any:
    return typer.Option(None, "--speculative-config",
                        help='Speculative decoding as JSON (vLLM\'s keys), e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' or \'{"method": "self_draft", "num_layers": 8, '
                        '"num_speculative_tokens": 3}\'.')


def max_num_batched_tokens_option() -> Any:
    return typer.Option(None, "--max-num-batched-tokens", help="Token budget per engine step.")


def max_num_seqs_option() -> Any:
    return typer.Option(None, "--max-num-seqs", help="Most sequences per engine step.")


def max_model_len_option() -> Any:
    return typer.Option(None, "--max-model-len", help="Most tokens (prompt + output) per sequence.")


def num_blocks_option() -> Any:
    return typer.Option(None, "--num-blocks", help="KV blocks per layer (default: from --kv-cache-memory-gb).")


def kv_cache_memory_gb_option() -> Any:
    return typer.Option(1.0, "--kv-cache-memory-gb", help="KV cache size when --num-blocks is unset.")


# ---- options of the commands that answer OpenAI requests (serve, run-batch) ------------------------------------------


def trust_request_chat_template_option() -> Any:
    return typer.Option(False, "--trust-request-chat-template",
                        help="Let requests send their own chat_template (Jinja).")


def return_tokens_as_token_ids_option() -> Any:
    return typer.Option(False, "--return-tokens-as-token-ids",
                        help='Logprob tokens are "token_id:N" unless a request says otherwise.')


def reasoning_parser_option() -> Any:
    return typer.Option(None, "--reasoning-parser", help="Split chat replies' <think>...</think> into "
                        "reasoning_content: deepseek_r1 or qwen3 (vLLM's parsers).")


def max_logprobs_option() -> Any:
    return typer.Option(DEFAULT_MAX_LOGPROBS, "--max-logprobs",
                        help="Most logprobs/top_logprobs/prompt_logprobs a request may ask for per token; -1: no cap "
                        "(a request's -1 asks for the whole vocabulary). vLLM's flag.")


def enable_auto_tool_choice_option() -> Any:
    return typer.Option(False, "--enable-auto-tool-choice",
                        help='Accept tool_choice "auto" (the default when tools are sent): the model decides, '
                        "--tool-call-parser reads its calls.")


def tool_call_parser_option() -> Any:
    return typer.Option(None, "--tool-call-parser",
                        help="The model's tool-call syntax, for --enable-auto-tool-choice: hermes, llama3_json, "
                        "mistral, pythonic, granite, granite-20b-fc or internlm (vLLM's parsers).")


def tool_call_id_type_option() -> Any:
    return typer.Option(None, "--tool-call-id-type",
                        help="Tool call ids: random, or kimi_k2 (functions.<name>:<index>); default from the plan's "
                        "model_type, as vLLM picks them.")


def check_request_options(*, reasoning_parser: str | None, enable_auto_tool_choice: bool,
                          tool_call_parser: str | None, max_logprobs: int) -> None:
    """Fail now, before the plan loads, on every mistake in these options that needs no model."""
    from trtopt.runtime.config import resolve_max_logprobs
    from trtopt.serving.reasoning import get_reasoning_parser
    from trtopt.serving.tool_parsers import check_tool_options

    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    check_tool_options(enable_auto_tool_choice, tool_call_parser)
    resolve_max_logprobs(max_logprobs, 0)
