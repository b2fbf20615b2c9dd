"""`trtopt triton-repo`: write a Triton Inference Server model repository that serves a plan.

    REPO/NAME/config.pbtxt    decoupled Python-backend model, its I/O, instances, engine parameters (speculative
                              decoding too: parameter speculative_config, the engine's JSON)
    REPO/NAME/1/model.py      trtopt.serving.triton_model, verbatim
    REPO/NAME/1/plan/         only with copy_plan=True; otherwise config.pbtxt points at the plan by absolute path

The model's Python (the one that runs model.py) needs trtopt and numpy<2 (see tritonserver.py for a server
set-up that provides both).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from trtopt.build.draft import self_draft_dir
from trtopt.build.plan import read_plan
from trtopt.errors import ConfigError
from trtopt.runtime.spec_decode.config import SpeculativeConfig

_TEMPLATE = Path(__file__).with_name("triton_model.py")

# name, Triton type, dims, optional
_INPUTS = (
    ("text_input", "TYPE_STRING", "[ 1 ]", False),
    ("max_tokens", "TYPE_INT32", "[ 1 ]", False),
    ("temperature", "TYPE_FP32", "[ 1 ]", True),
    ("top_p", "TYPE_FP32", "[ 1 ]", True),
    ("stop_words", "TYPE_STRING", "[ -1 ]", True),
    ("stream", "TYPE_BOOL", "[ 1 ]", True),
    ("ignore_eos", "TYPE_BOOL", "[ 1 ]", True),
    ("seed", "TYPE_INT64", "[ 1 ]", True),
)
_OUTPUTS = (("text_output", "TYPE_STRING", "[ 1 ]"), ("step_batch_size", "TYPE_INT32", "[ 1 ]"))


@dataclasses.dataclass(frozen=True)
class TritonRepoConfig:
    """What goes into config.pbtxt."""

    name: str = "trtopt"  # the Triton model name (the URL path /v2/models/<name>/generate)
    instances: int = 1  # model instances; each runs its own engine (and holds its own KV cache)
    kind: str = "cpu"  # "cpu" or "gpu": Triton's instance kind; gpu runs the engine on cuda:<device id>
    backend: str = "torch"  # trtopt executor
    max_batch_tokens: int | None = None  # engine token budget per step; None = the plan's limit
    max_num_seqs: int | None = None
    num_blocks: int | None = None  # KV blocks per instance; None = from the engine's default memory budget
    python_env: Path | None = None  # a venv/conda dir for EXECUTION_ENV_PATH; None = the Python on Triton's PATH
    # Speculative decoding for every instance's engine: vLLM's speculative_config as a dict or its JSON text (the
    # engine's keys; runtime/spec_decode/config.py). None = off.
    speculative_config: dict | str | None = None

    def validate(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "-_." for ch in self.name):
            raise ConfigError(f"model name {self.name!r} must be non-empty letters, digits, '-', '_' or '.'.")
        if self.instances < 1:
            raise ConfigError(f"--instances={self.instances} must be >= 1.")
        if self.kind not in ("cpu", "gpu"):
            raise ConfigError(f"--kind={self.kind!r} must be cpu or gpu.")
        for field in ("max_batch_tokens", "max_num_seqs", "num_blocks"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(f"{field}={value} must be >= 1.")
        SpeculativeConfig.parse(self.speculative_config)  # a ConfigError that names the key, before anything is written


def write_triton_repo(plan_dir: str | Path, repo_dir: str | Path, config: TritonRepoConfig = TritonRepoConfig(), *,
                      copy_plan: bool = False, force: bool = False) -> Path:
    """Write (or, with force, rewrite) the model `config.name` into repo_dir; return the model directory.

    Raises ConfigError for bad options or an existing model dir without force, BuildError for an unreadable plan.
    """
    config.validate()
    plan_dir = Path(plan_dir).resolve()
    plan = read_plan(plan_dir)
    if plan.kind != "paged":
        raise ConfigError(f"{plan_dir} is a {plan.kind!r} plan; Triton serving needs a paged LLM plan from `trtopt build`.")
    speculative_json = _speculative_json(config, plan_dir)
    model_dir = Path(repo_dir) / config.name
    if model_dir.exists():
        if not force:
            raise ConfigError(f"{model_dir} exists; pass --force to overwrite it or choose another --name.")
        shutil.rmtree(model_dir)
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True)
    shutil.copyfile(_TEMPLATE, version_dir / "model.py")
    if copy_plan:
        shutil.copytree(plan_dir, version_dir / "plan")
        plan_ref = "plan"  # relative to the version dir, so the repository can move
    else:
        plan_ref = str(plan_dir)
    (model_dir / "config.pbtxt").write_text(render_config(config, plan_ref, speculative_json))
    return model_dir


def _speculative_json(config: TritonRepoConfig, plan_dir: Path) -> str | None:
    """The speculative config as JSON for config.pbtxt, its draft checked to exist now (the model loads it later, on
    the server) and a draft plan's path made absolute (the server's working directory is not the caller's)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None
    if spec.method == "draft_model":
        draft = Path(spec.model).resolve()
        if not (draft / "plan.json").is_file():
            raise ConfigError(f"the draft plan {draft} does not exist (no plan.json); build one with `trtopt build` "
                              "or point 'model' at an existing plan dir.")
        spec = dataclasses.replace(spec, model=str(draft))
    elif spec.method == "self_draft" and not (self_draft_dir(plan_dir, spec.num_layers) / "plan.json").is_file():
        raise ConfigError(f"{self_draft_dir(plan_dir, spec.num_layers)} does not exist; build it with "
                          f"`trtopt build MODEL -o {plan_dir} --draft-layers {spec.num_layers}`.")
    return json.dumps({f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                       if getattr(spec, f.name) is not None})


def render_config(config: TritonRepoConfig, plan_ref: str, speculative_json: str | None = None) -> str:
    inputs = ",\n".join(
        f'  {{ name: "{n}" data_type: {t} dims: {d}{" optional: true" if opt else ""} }}' for n, t, d, opt in _INPUTS)
    outputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in _OUTPUTS)
    params = {"plan_dir": plan_ref, "backend": config.backend}
    for key, value in (("max_num_batched_tokens", config.max_batch_tokens), ("max_num_seqs", config.max_num_seqs),
                       ("num_blocks", config.num_blocks)):
        if value is not None:
            params[key] = str(value)
    if speculative_json is not None:
        params["speculative_config"] = speculative_json
    if config.python_env is not None:
        params["EXECUTION_ENV_PATH"] = str(Path(config.python_env).resolve())
    parameters = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{_pbtxt_escape(v)}" }} }}' for k, v in params.items())
    kind = "KIND_GPU" if config.kind == "gpu" else "KIND_CPU"
    return f"""# Written by `trtopt triton-repo`. Decoupled: one request may get many responses (streaming).
name: "{config.name}"
backend: "python"
max_batch_size: 0  # trtopt batches continuously inside the model; Triton's dynamic batcher is not needed
model_transaction_policy {{ decoupled: true }}
input [
{inputs}
]
output [
{outputs}
]
instance_group [ {{ count: {config.instances} kind: {kind} }} ]
parameters [
{parameters}
]
"""


def _pbtxt_escape(value: str) -> str:
    """A protobuf text-format string body: backslashes and double quotes escaped (JSON values carry quotes)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')
