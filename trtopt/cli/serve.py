"""`trtopt serve`: the OpenAI-compatible HTTP server over one plan (thin over trtopt.serving.server)."""

from __future__ import annotations

import gc
from pathlib import Path

import typer

from trtopt.cli.common import (
    async_scheduling_option, backend_option, check_request_options, console, device_option, eager_option,
    enable_auto_tool_choice_option, kv_cache_memory_gb_option, master_addr_option, master_port_option,
    max_logprobs_option, max_model_len_option, max_num_batched_tokens_option, max_num_seqs_option, nnodes_option,
    node_rank_option, num_blocks_option, plan_argument, reasoning_parser_option, return_tokens_as_token_ids_option,
    run_worker_node_if_remote, speculative_config_option, tensor_parallel_option, tool_call_id_type_option,
    tool_call_parser_option, trust_request_chat_template_option,
)


def serve(
    plan: Path = plan_argument(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 exposes it to the network)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    model_name: str = typer.Option(None, "--model-name",
                                   help="Model id clients send (default: the plan directory name)."),
    api_key: str = typer.Option(None, "--api-key", envvar="TRTOPT_API_KEY",
                                help="Require `Authorization: Bearer KEY` on /v1/* (or set TRTOPT_API_KEY)."),
    backend: str = backend_option(),
    device: str = device_option(),
    tensor_parallel_size: int = tensor_parallel_option(),
    nnodes: int = nnodes_option(),
    node_rank: int = node_rank_option(),
    master_addr: str = master_addr_option(),
    master_port: int = master_port_option(),
    eager: bool = eager_option(),
    async_scheduling: bool = async_scheduling_option(),
    max_num_batched_tokens: int = max_num_batched_tokens_option(),
    max_num_seqs: int = max_num_seqs_option(),
    max_model_len: int = max_model_len_option(),
    num_blocks: int = num_blocks_option(),
    kv_cache_memory_gb: float = kv_cache_memory_gb_option(),
    max_logprobs: int = max_logprobs_option(),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Larger request bodies get 413."),
    protect_metrics: bool = typer.Option(False, "--protect-metrics",
                                         help="/metrics needs the API key too (by default it is open, like /health)."),
    shutdown_timeout: float = typer.Option(5.0, "--shutdown-timeout",
                                           help="Seconds SIGTERM/SIGINT may take: in-flight requests are aborted at "
                                           "once and the process exits within about this long."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
    speculative_config: str = speculative_config_option(),
    root_path: str = typer.Option("", "--root-path", help="Path prefix a proxy routes to this server (e.g. /llm); "
                                  "routes answer with and without it (vLLM's flag)."),
    enable_server_load_tracking: bool = typer.Option(False, "--enable-server-load-tracking",
                                                     help="GET /load counts in-flight generation requests."),
    enable_tokenizer_info_endpoint: bool = typer.Option(False, "--enable-tokenizer-info-endpoint",
                                                        help="Serve GET /tokenizer_info (shows the chat template and "
                                                        "special tokens)."),
    enable_force_include_usage: bool = typer.Option(False, "--enable-force-include-usage",
                                                    help="Every stream carries usage, on every chunk and at the end."),
    trust_request_chat_template: bool = trust_request_chat_template_option(),
    return_tokens_as_token_ids: bool = return_tokens_as_token_ids_option(),
    reasoning_parser: str = reasoning_parser_option(),
    enable_auto_tool_choice: bool = enable_auto_tool_choice_option(),
    tool_call_parser: str = tool_call_parser_option(),
    enable_request_id_headers: bool = typer.Option(False, "--enable-request-id-headers",
                                                   help="Every response carries X-Request-Id: the request's own, else "
                                                   "a new id (vLLM's flag)."),
    server_dev_mode: bool = typer.Option(False, "--server-dev-mode",
                                         envvar=["TRTOPT_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE"],
                                         help="Serve vLLM's dev-mode routes POST /sleep, POST /wake_up and GET "
                                         "/is_sleeping (or set TRTOPT_SERVER_DEV_MODE=1 or VLLM_SERVER_DEV_MODE=1)."),
    enable_sleep_mode: bool = typer.Option(False, "--enable-sleep-mode",
                                           help="POST /sleep?level=1 may free the KV cache (vLLM's flag; level 0, a "
                                           "pause, needs only --server-dev-mode)."),
    tool_call_id_type: str = tool_call_id_type_option(),
):
    """Serve a plan over the OpenAI API: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming with
    `stream: true`), /health and /metrics (Prometheus), plus vLLM's /tokenize, /detokenize, /version, /load,
    /ping, /invocations and /tokenizer_info. Requests are batched continuously by one engine.

    Examples:

        trtopt serve out/plan --port 8000

        curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
            -d '{"model": "plan", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

        trtopt serve out/plan --host 0.0.0.0 --api-key secret --max-num-seqs 32 --max-model-len 1024

    Tensor parallelism over two hosts (plan built with --tensor-parallel 4; 2 ranks each). Node 0 serves; node 1
    only runs its ranks, blocks until node 0's server stops, then exits 0:

        trtopt serve out/plan --tp 4 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500

        trtopt serve out/plan --tp 4 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500
    """
    from trtopt.runtime.config import NodeConfig

    check_request_options(reasoning_parser=reasoning_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                          tool_call_parser=tool_call_parser, max_logprobs=max_logprobs)
    nodes = NodeConfig(nnodes, node_rank, master_addr, master_port)
    if run_worker_node_if_remote(plan, tensor_parallel_size, nodes, device):
        return  # a worker host needs neither the server nor its packages (uvicorn, fastapi)
    import uvicorn

    from trtopt.runtime.engine import LLMEngine
    from trtopt.serving.server import ServerOptions, create_app, run_server
    from trtopt.serving.tool_parsers import tool_call_id_type as id_type_of

    engine = LLMEngine.from_plan(
        plan, backend=backend, device=device, cuda_graphs=False if eager else None,
        tensor_parallel_size=tensor_parallel_size, nodes=nodes, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, num_blocks=num_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
        speculative_config=speculative_config, async_scheduling=async_scheduling, max_logprobs=max_logprobs,
    )
    # Start-up objects (the converted graph, weights, captured graphs) live as long as the process: freezing them
    # keeps every later collection to per-request garbage.
    gc.collect()
    gc.freeze()
    name = model_name or Path(plan).resolve().name
    options = ServerOptions(root_path=root_path.rstrip("/"), enable_server_load_tracking=enable_server_load_tracking,
                            enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
                            enable_force_include_usage=enable_force_include_usage,
                            trust_request_chat_template=trust_request_chat_template,
                            return_tokens_as_token_ids=return_tokens_as_token_ids, reasoning_parser=reasoning_parser,
                            enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                            enable_request_id_headers=enable_request_id_headers, server_dev_mode=server_dev_mode,
                            enable_sleep_mode=enable_sleep_mode,
                            tool_call_id_type=tool_call_id_type or id_type_of(engine.plan.model.model_type))
    app = create_app(engine, name, api_key=api_key, max_body_bytes=max_body_bytes, protect_metrics=protect_metrics,
                     options=options)
    console.print(f"[green]serving[/] {name!r} on http://{host}:{port}/v1 "
                  f"({backend}, {engine.limits.num_blocks - 1} KV blocks)")
    try:
        dead_reason = run_server(uvicorn.Config(app, host=host, port=port, log_level=log_level), app.state.engine,
                                 shutdown_timeout=shutdown_timeout)
    finally:
        engine.shutdown()  # tensor-parallel workers; a no-op for one device
    if dead_reason is not None:  # non-zero, so a supervisor restarts the server
        console.print(f"[red]error:[/] the engine broke and the server stopped: {dead_reason}")
        raise typer.Exit(1)
