"""`trtopt triton-repo`: write a Triton Inference Server model repository for a plan (thin over trtopt.serving)."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from trtopt.cli.common import console


def triton_repo(
    plan: Path = typer.Argument(..., help="A plan directory written by `trtopt build`."),
    output: Path = typer.Option(..., "-o", "--output", help="The model repository directory (created if missing)."),
    name: str = typer.Option("trtopt", "--name", help="Triton model name: /v2/models/NAME/generate."),
    instances: int = typer.Option(1, "--instances", help="Model instances, each with its own engine and KV cache."),
    kind: str = typer.Option("cpu", "--kind", help="Instance kind: cpu or gpu (gpu runs the engine on CUDA)."),
    max_batch_tokens: int = typer.Option(None, "--max-batch-tokens", help="Engine token budget per step (default: the plan's)."),
    max_batch: int = typer.Option(None, "--max-batch", "--max-num-seqs",
                                  help="Most sequences one instance decodes together (default: the plan's max_num_seqs)."),
    num_blocks: int = typer.Option(None, "--num-blocks", help="KV blocks per instance (default: 1 GB worth)."),
    backend: str = typer.Option("torch", "--backend", help="trtopt executor: torch, onnxruntime or tensorrt."),
    copy_plan: bool = typer.Option(False, "--copy-plan", help="Copy the plan into the repository instead of referencing it."),
    python_env: Path = typer.Option(None, "--python-env",
                                    help="A venv for the model's Python (EXECUTION_ENV_PATH) (default: python3 on Triton's PATH)."),
    speculative_config: str = typer.Option(None, "--speculative-config",
                                           help='Speculative decoding, as for `trtopt serve`: JSON such as \'{"method": '
                                                '"ngram", "num_speculative_tokens": 4}\'.'),
    ensemble_name: str = typer.Option("ensemble", "--ensemble-name",
                                      help="Also write this model: the same inputs with a batch dimension "
                                           "(TensorRT-LLM's ensemble shapes). \"\" = don't."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing models of those names."),
):
    """Write a Triton model repository serving PLAN: NAME/config.pbtxt (a decoupled Python-backend model) and
    NAME/1/model.py, which runs one trtopt engine per instance with a background step loop, so concurrent
    requests are batched continuously; plus ENSEMBLE-NAME, the same inputs with TensorRT-LLM's batched shapes.
    Inputs: the TensorRT-LLM backend's ensemble names (text_input, max_tokens, stop_words, temperature, ...) and
    the vLLM backend's sampling_parameters JSON. Outputs: text_output, finish_reason, num_input_tokens,
    num_output_tokens, and log-probs on request. Works with generate, generate_stream and gRPC streaming.
    The options are checked against the plan before anything is written.

    Examples:

        trtopt triton-repo out/plan -o out/triton-repo

        trtopt triton-repo out/plan -o repo --name smollm2 --instances 2 --kind gpu --max-batch 32 --copy-plan

        trtopt triton-repo out/plan -o repo --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

        curl http://127.0.0.1:8000/v2/models/trtopt/generate -d '{"text_input": "Hello", "max_tokens": 16}'
    """
    from trtopt.serving.triton_repo import TritonRepoConfig, write_triton_repo

    config = TritonRepoConfig(name=name, instances=instances, kind=kind, backend=backend, max_batch_tokens=max_batch_tokens,
                              max_batch=max_batch, num_blocks=num_blocks, python_env=python_env,
                              speculative_config=speculative_config, ensemble_name=ensemble_name or None)
    model_dir = write_triton_repo(plan, output, config, copy_plan=copy_plan, force=force)
    console.print(f"[green]wrote[/] {model_dir}/config.pbtxt and {model_dir}/1/model.py")
    if config.ensemble_name:
        console.print(f"[green]wrote[/] {output / config.ensemble_name} (TensorRT-LLM ensemble shapes)")
    _print_launch_hint(output, name)


def _print_launch_hint(repo: Path, name: str) -> None:
    """How to start it: with a tritonserver on PATH, or with the one bundled in the nvidia-pytriton wheel."""
    repo = repo.resolve()
    console.print("start it with your tritonserver (its python3 needs trtopt and numpy<2):", highlight=False)
    console.print(f"    tritonserver --model-repository={shlex.quote(str(repo))}", highlight=False, soft_wrap=True)
    console.print("or with the one in the nvidia-pytriton wheel:", highlight=False)
    console.print(f"    python -m trtopt.serving.tritonserver {shlex.quote(str(repo))} --http-port 8000 --grpc-port 8001",
                  highlight=False, soft_wrap=True)
    console.print(f"then: curl http://127.0.0.1:8000/v2/models/{name}/generate "
                  "-d '{\"text_input\": \"Hello\", \"max_tokens\": 16}'", highlight=False, soft_wrap=True)
