"""Run the real tritonserver that the `nvidia-pytriton` wheel bundles, standalone, on any model repository.

The wheel's server directory is read-only in spirit (site-packages) and lacks the Python-backend stub in the
place the backend looks, so prepare_tritonserver() copies it to a writable directory and drops in the stub that
matches this Python. The environment it returns puts this interpreter first on PATH (the stub runs model.py
with the first `python3` it finds, which must have trtopt and numpy<2) and lists the wheel's bundled libraries
and this Python's libpython on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from trtopt.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TritonServerInstall:
    root: Path  # the writable copy of the server
    binary: Path  # root/bin/tritonserver
    backend_dir: Path  # root/backends (holds python/ with the stub)
    env: dict[str, str]  # the full environment to start the server with

    def command(self, repo: str | Path, *, http_port: int, grpc_port: int, host: str = "127.0.0.1") -> list[str]:
        return [
            str(self.binary), f"--model-repository={Path(repo).resolve()}", f"--backend-directory={self.backend_dir}",
            f"--http-address={host}", f"--http-port={http_port}", f"--grpc-address={host}", f"--grpc-port={grpc_port}",
            "--allow-metrics=false", "--exit-timeout-secs=5",
        ]


def prepare_tritonserver(dest: str | Path) -> TritonServerInstall:
    """Copy the bundled tritonserver to `dest` (once) and return how to run it. Raises ConfigError without the wheel."""
    pytriton = _package_dir("pytriton")
    libs = pytriton.parent / "nvidia_pytriton.libs"
    src = pytriton / "tritonserver"
    dest = Path(dest).resolve()
    if not (dest / "bin" / "tritonserver").is_file():
        shutil.copytree(src, dest, dirs_exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ConfigError(f"nvidia-pytriton has no Python-backend stub for Python {version}; use Python 3.8-3.13.")
    shutil.copy2(stub, dest / "backends" / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    lib_path = [str(libs), sysconfig.get_config_var("LIBDIR") or "", env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in lib_path if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return TritonServerInstall(dest, dest / "bin" / "tritonserver", dest / "backends", env)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled tritonserver needs the nvidia-pytriton wheel: pip install --no-deps nvidia-pytriton")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str] | None = None) -> None:
    """`python -m trtopt.serving.tritonserver REPO [--http-port P] [--grpc-port Q] [--host H]`: prepare the bundled
    server under $TRTOPT_CACHE/tritonserver (once) and replace this process with it."""
    import argparse

    from trtopt.export.models import cache_root

    parser = argparse.ArgumentParser(prog="python -m trtopt.serving.tritonserver", description=main.__doc__)
    parser.add_argument("repo", type=Path, help="a model repository, e.g. from `trtopt triton-repo`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    args = parser.parse_args(argv)
    try:
        install = prepare_tritonserver(cache_root() / "tritonserver")
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    cmd = install.command(args.repo, http_port=args.http_port, grpc_port=args.grpc_port, host=args.host)
    os.execve(cmd[0], cmd, install.env)


if __name__ == "__main__":
    main()
