"""`trtopt run-batch`: vLLM's offline batch runner over one plan (thin over trtopt.serving.run_batch)."""

from __future__ import annotations

from pathlib import Path

import typer

from trtopt.cli.common import (
    async_scheduling_option, console, eager_option, err_console, speculative_config_option, tensor_parallel_option,
)
from trtopt.runtime.sampling_params import DEFAULT_MAX_LOGPROBS


def run_batch(
    plan: Path = typer.Argument(..., help="A plan directory written by `trtopt build`."),
    input_file: str = typer.Option(..., "--input-file", "-i",
                                   help="The requests: a local JSONL file, one OpenAI Batch API request a line "
                                   "(URLs are refused: nothing is downloaded)."),
    output_file: str = typer.Option(..., "--output-file", "-o",
                                    help="The results: a local JSONL file, one line per request, in input order."),
    model_name: str = typer.Option(None, "--model-name", "--served-model-name",
                                   help="Model id the bodies send (default: the plan directory name); a body may "
                                   "also leave `model` out."),
    backend: str = typer.Option("torch", "--backend", help="Executor: torch, onnxruntime or tensorrt."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    tensor_parallel_size: int = tensor_parallel_option(),
    eager: bool = eager_option(),
    async_scheduling: bool = async_scheduling_option(),
    max_num_batched_tokens: int = typer.Option(None, "--max-num-batched-tokens", help="Token budget per engine step."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Most sequences per engine step."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Most tokens (prompt + output) per sequence."),
    num_blocks: int = typer.Option(None, "--num-blocks",
                                   help="KV blocks per layer (default: from --kv-cache-memory-gb)."),
    kv_cache_memory_gb: float = typer.Option(1.0, "--kv-cache-memory-gb",
                                             help="KV cache size when --num-blocks is unset."),
    max_logprobs: int = typer.Option(DEFAULT_MAX_LOGPROBS, "--max-logprobs",
                                     help="Most logprobs a request may ask for per token; -1: no cap (vLLM's flag)."),
    speculative_config: str = speculative_config_option(),
    enable_force_include_usage: bool = typer.Option(False, "--enable-force-include-usage",
                                                    help="Accepted for vLLM's command line (results are never "
                                                    "streamed, and always carry usage)."),
    trust_request_chat_template: bool = typer.Option(False, "--trust-request-chat-template",
                                                     help="Let requests send their own chat_template (Jinja)."),
    return_tokens_as_token_ids: bool = typer.Option(False, "--return-tokens-as-token-ids",
                                                    help='Logprob tokens are "token_id:N" unless a request says '
                                                    "otherwise."),
    reasoning_parser: str = typer.Option(None, "--reasoning-parser",
                                         help="Split chat replies' <think>...</think> into reasoning_content: "
                                         "deepseek_r1 or qwen3 (vLLM's parsers)."),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice",
                                                 help='Accept tool_choice "auto": the model decides, '
                                                 "--tool-call-parser reads its calls."),
    tool_call_parser: str = typer.Option(None, "--tool-call-parser",
                                         help="The model's tool-call syntax, for --enable-auto-tool-choice (the "
                                         "parsers of `trtopt serve`)."),
    tool_call_id_type: str = typer.Option(None, "--tool-call-id-type",
                                          help="Tool call ids: random, or kimi_k2 (default from the plan's "
                                          "model_type)."),
):
    """Run a file of OpenAI Batch API requests on a plan, all at once on one engine (continuous batching), and
    write one result per request: vLLM's `vllm run-batch`. Each request is answered exactly as `trtopt serve` would
    answer it (the same validation, model check and response body).

    An input line is {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
    "body": {...}}. An output line is {"id", "custom_id", "response": {"status_code", "request_id", "body"},
    "error"}: error is null on success; a refused request has its status, a null body and the server's error
    object. A bad line (not JSON, an unknown url, stream: true...) gets an error line and never stops the others;
    lines that are no batch request at all (not JSON, no custom_id) make the command exit 1 after writing every
    result, as vLLM refuses such a file.

    Examples:

        printf '%s%s\\n' '{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", ' \\
            '"body": {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}}' > requests.jsonl

        printf '%s%s\\n' '{"custom_id": "r2", "method": "POST", "url": "/v1/completions", ' \\
            '"body": {"prompt": "Once upon a time", "max_tokens": 32}}' >> requests.jsonl

        trtopt run-batch out/plan -i requests.jsonl -o results.jsonl

        trtopt run-batch out/plan -i requests.jsonl -o results.jsonl --device cuda --backend tensorrt --max-num-seqs 64
    """
    import gc

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trtopt.runtime.config import resolve_max_logprobs
    from trtopt.runtime.engine import LLMEngine
    from trtopt.serving.reasoning import get_reasoning_parser
    from trtopt.serving.run_batch import local_path, read_lines, run_batch_file
    from trtopt.serving.server import DEFAULT_MAX_BODY_BYTES, ServerOptions, create_app
    from trtopt.serving.tool_parsers import check_tool_options, tool_call_id_type as id_type_of

    # Every mistake that needs no model fails now, before the plan loads.
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    check_tool_options(enable_auto_tool_choice, tool_call_parser)
    resolve_max_logprobs(max_logprobs, 0)
    lines = read_lines(input_file)
    local_path(output_file, "output")
    engine = LLMEngine.from_plan(
        plan, backend=backend, device=device, cuda_graphs=False if eager else None,
        tensor_parallel_size=tensor_parallel_size, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_blocks=num_blocks,
        kv_cache_memory_gb=kv_cache_memory_gb, speculative_config=speculative_config,
        async_scheduling=async_scheduling, max_logprobs=max_logprobs,
    )
    gc.collect()
    gc.freeze()  # start-up objects live as long as the process (as in `trtopt serve`)
    name = model_name or Path(plan).resolve().name
    options = ServerOptions(enable_force_include_usage=enable_force_include_usage,
                            trust_request_chat_template=trust_request_chat_template,
                            return_tokens_as_token_ids=return_tokens_as_token_ids, reasoning_parser=reasoning_parser,
                            enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                            tool_call_id_type=tool_call_id_type or id_type_of(engine.plan.model.model_type))
    # Any body the file holds is accepted: the server's size limit guards a network port, not a local file.
    max_body_bytes = max(DEFAULT_MAX_BODY_BYTES, Path(input_file).stat().st_size)
    app = create_app(engine, name, max_body_bytes=max_body_bytes, options=options)
    columns = (TextColumn("[bold]run-batch[/]"), BarColumn(), MofNCompleteColumn(),
               TextColumn("[red]{task.fields[failed]} failed[/]"), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err_console, transient=False) as progress:
            task = progress.add_task("requests", total=len(lines), failed=0)
            failed = 0

            def on_result(result) -> None:
                nonlocal failed
                failed += result.status_code != 200
                progress.update(task, advance=1, failed=failed)

            summary = run_batch_file(app, lines, output_file, on_result=on_result)
    finally:
        engine.shutdown()  # tensor-parallel workers; a no-op for one device
    dead_reason = app.state.engine.dead_reason
    console.print(f"[green]wrote[/] {summary.total} results to {output_file}: {summary.succeeded} succeeded, "
                  f"{summary.failed} failed")
    if dead_reason is not None:
        err_console.print(f"[red]error:[/] the engine broke during the batch: {dead_reason}", highlight=False)
        raise typer.Exit(1)
    if summary.malformed_line_nos:
        shown = ", ".join(map(str, summary.malformed_line_nos[:10]))
        more = "..." if len(summary.malformed_line_nos) > 10 else ""
        err_console.print(f"[red]error:[/] input lines that are no batch request: {len(summary.malformed_line_nos)} "
                          f"(line {shown}{more}); their error results are in {output_file}.", highlight=False)
        raise typer.Exit(1)
