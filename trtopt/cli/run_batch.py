"""`trtopt run-batch`: vLLM's offline batch runner over one plan (thin over trtopt.serving.run_batch)."""

from __future__ import annotations

from pathlib import Path

import typer

from trtopt.cli.common import (
    async_scheduling_option, backend_option, check_request_options, console, device_option, eager_option,
    enable_auto_tool_choice_option, err_console, kv_cache_memory_gb_option, max_logprobs_option, max_model_len_option,
    max_num_batched_tokens_option, max_num_seqs_option, num_blocks_option, plan_argument, reasoning_parser_option,
    return_tokens_as_token_ids_option, speculative_config_option, tensor_parallel_option, tool_call_id_type_option,
    tool_call_parser_option, trust_request_chat_template_option,
)


def run_batch(
    plan: Path = plan_argument(),
    input_file: str = typer.Option(..., "--input-file", "-i",
                                   help="The requests: a local JSONL file, one OpenAI Batch API request a line "
                                   "(URLs are refused: nothing is downloaded)."),
    output_file: str = typer.Option(..., "--output-file", "-o",
                                    help="The results: a local JSONL file, one line per request, in input order."),
    model_name: str = typer.Option(None, "--model-name", "--served-model-name",
                                   help="Model id the bodies send (default: the plan directory name); a body may "
                                   "also leave `model` out."),
    backend: str = backend_option(),
    device: str = device_option(),
    tensor_parallel_size: int = tensor_parallel_option(),
    eager: bool = eager_option(),
    async_scheduling: bool = async_scheduling_option(),
    max_num_batched_tokens: int = max_num_batched_tokens_option(),
    max_num_seqs: int = max_num_seqs_option(),
    max_model_len: int = max_model_len_option(),
    num_blocks: int = num_blocks_option(),
    kv_cache_memory_gb: float = kv_cache_memory_gb_option(),
    max_logprobs: int = max_logprobs_option(),
    speculative_config: str = speculative_config_option(),
    enable_force_include_usage: bool = typer.Option(False, "--enable-force-include-usage",
                                                    help="Accepted for vLLM's command line (results are never "
                                                    "streamed, and always carry usage)."),
    trust_request_chat_template: bool = trust_request_chat_template_option(),
    return_tokens_as_token_ids: bool = return_tokens_as_token_ids_option(),
    reasoning_parser: str = reasoning_parser_option(),
    enable_auto_tool_choice: bool = enable_auto_tool_choice_option(),
    tool_call_parser: str = tool_call_parser_option(),
    tool_call_id_type: str = tool_call_id_type_option(),
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

    from trtopt.runtime.engine import LLMEngine
    from trtopt.serving.run_batch import local_path, read_lines, run_batch_file
    from trtopt.serving.server import DEFAULT_MAX_BODY_BYTES, ServerOptions, create_app
    from trtopt.serving.tool_parsers import tool_call_id_type as id_type_of

    # Every mistake that needs no model fails now, before the plan loads.
    check_request_options(reasoning_parser=reasoning_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                          tool_call_parser=tool_call_parser, max_logprobs=max_logprobs)
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
