"""The `trtopt` command: one thin subcommand per module (docs/architecture.md §2, STYLE.md §13).

A subcommand whose optional dependencies are missing is the only one disabled.
"""

from __future__ import annotations

import importlib

import typer

from trtopt.cli.common import handle_errors

app = typer.Typer(
    name="trtopt",
    help="""TensorRT/ONNX graph optimization and a paged-KV runtime for LLM inference.

Pipeline: export (HF → ONNX) → build (fuse attention into trtopt plugins, write a plan) → generate / serve.

Examples:

    trtopt export smollm2-135m -o out/onnx

    trtopt build out/onnx -o out/plan

    trtopt generate out/plan --chat --prompt "What is the capital of France?"

    trtopt check out/onnx out/plan --layerwise

    trtopt serve out/plan --port 8000
""",
    no_args_is_help=True,
    rich_markup_mode="rich",
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# (module, function): each module holds one subcommand; a failed import disables only that one.
SUBCOMMANDS = [
    ("trtopt.cli.export", "export"),
    ("trtopt.cli.build", "build"),
    ("trtopt.cli.quantize", "quantize"),
    ("trtopt.cli.generate", "generate"),
    ("trtopt.cli.check", "check"),
    ("trtopt.cli.bench", "bench"),
    ("trtopt.cli.serve", "serve"),
    ("trtopt.cli.run_batch", "run_batch"),
    ("trtopt.cli.triton_repo", "triton_repo"),
]


@app.callback()
def _root() -> None:
    """Keeps `trtopt` a command group even while only one subcommand is installed."""


def _register() -> None:
    for module_name, func_name in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # not part of this build of trtopt
            missing = e.name

            def unavailable(missing=missing, name=func_name):
                raise typer.BadParameter(f"`{name}` needs the missing package `{missing}`; install trtopt's extras.")

            app.command(name=func_name.replace("_", "-"), help=f"(unavailable: needs `{missing}`)")(unavailable)
            continue
        command = getattr(module, func_name)
        if isinstance(command, typer.Typer):  # a command group such as `trtopt bench serve`
            app.add_typer(command, name=func_name.replace("_", "-"))
        else:
            app.command(name=func_name.replace("_", "-"))(handle_errors(command))


_register()

if __name__ == "__main__":
    app()
