"""What every subcommand shares: printing TrtOptErrors without a traceback, and one console."""

from __future__ import annotations

import functools
from typing import Callable

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
