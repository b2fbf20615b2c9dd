"""What every subcommand shares: printing TrtOptErrors without a traceback, one console, and the options of the
commands that run a plan (generate, serve)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import typer
from rich.console import Console

from trtopt.errors import TrtOptError

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


def tensor_parallel_option() -> Any:
    return typer.Option(None, "--tensor-parallel-size", "--tp",
                        help="Ranks for a plan built with `trtopt build --tensor-parallel N` (default: the plan's N).")


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
