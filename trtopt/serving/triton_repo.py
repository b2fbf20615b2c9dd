"""`trtopt triton-repo`: write a Triton Inference Server model repository that serves a plan.

    REPO/NAME/config.pbtxt    decoupled Python-backend model, its I/O, instances, engine parameters (speculative
                              decoding too: parameter speculative_config, the engine's JSON)
    REPO/NAME/1/model.py      trtopt.serving.triton_model, verbatim
    REPO/NAME/1/plan/         only with copy_plan=True; otherwise config.pbtxt points at the plan by absolute path
    REPO/ensemble/...         the same inputs with Triton's batch dimension (TensorRT-LLM's ensemble shapes),
                              forwarding to NAME (trtopt.serving.triton_ensemble); --ensemble-name "" leaves it out

The options are checked against the plan here, so a repository that could not load fails now, with the reason,
rather than in tritonserver's log.

The model's Python (the one that runs model.py) needs trtopt and numpy<2 (see tritonserver.py for a server
set-up that provides both).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from trtopt.builder.draft import self_draft_dir
from trtopt.builder.plan import PlanConfig, read_plan
from trtopt.errors import ConfigError
from trtopt.runtime.spec_decode.config import SpeculativeConfig
from trtopt.serving.triton_request import INPUTS, OUTPUTS, TensorSpec

_TEMPLATE = Path(__file__).with_name("triton_model.py")
_ENSEMBLE_TEMPLATE = Path(__file__).with_name("triton_ensemble.py")
BACKENDS = ("torch", "onnxruntime", "tensorrt")


@dataclasses.dataclass(frozen=True)
class TritonRepoConfig:
    """What goes into config.pbtxt."""

    name: str = "trtopt"  # the Triton model name (the URL path /v2/models/<name>/generate)
    instances: int = 1  # model instances; each runs its own engine (and holds its own KV cache)
    kind: str = "cpu"  # "cpu" or "gpu": Triton's instance kind; gpu runs the engine on cuda:<device id>
    backend: str = "torch"  # trtopt executor
    max_batch_tokens: int | None = None  # engine token budget per step; None = the plan's limit
    max_batch: int | None = None  # sequences one instance decodes together (engine max_num_seqs); None = the plan's
    num_blocks: int | None = None  # KV blocks per instance; None = from the engine's default memory budget
    python_env: Path | None = None  # a venv/conda dir for EXECUTION_ENV_PATH; None = the Python on Triton's PATH
    # Speculative decoding for every instance's engine: vLLM's speculative_config as a dict or its JSON text (the
    # engine's keys; runtime/spec_decode/config.py). None = off.
    speculative_config: dict | str | None = None
    # A second model with Triton's batch dimension ([batch, 1] inputs, TensorRT-LLM's ensemble shapes) that forwards
    # to `name`, so tritonclient code written for TensorRT-LLM's "ensemble" runs unchanged. None = not written.
    ensemble_name: str | None = "ensemble"

    def validate(self) -> None:
        for label, name in (("--name", self.name), ("--ensemble-name", self.ensemble_name)):
            if name is not None and (not name or not all(ch.isalnum() or ch in "-_." for ch in name)):
                raise ConfigError(f"{label} {name!r} must be non-empty letters, digits, '-', '_' or '.'.")
        if self.ensemble_name == self.name:
            raise ConfigError(f"--ensemble-name {self.ensemble_name!r} must differ from --name.")
        if self.instances < 1:
            raise ConfigError(f"--instances={self.instances} must be >= 1.")
        if self.kind not in ("cpu", "gpu"):
            raise ConfigError(f"--kind={self.kind!r} must be cpu or gpu.")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend={self.backend!r} must be one of {list(BACKENDS)}.")
        for field in ("max_batch_tokens", "max_batch", "num_blocks"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(f"--{field.replace('_', '-')}={value} must be >= 1.")
        SpeculativeConfig.parse(self.speculative_config)  # a ConfigError that names the key, before anything is written
        if self.kind == "cpu" and self.instances > (os.cpu_count() or 1):
            # Each CPU instance runs its own engine with its own threads: more instances than cores only contend.
            raise ConfigError(f"--instances={self.instances} CPU instances exceed this machine's {os.cpu_count()} "
                              "cores; use fewer instances (each one already batches its requests continuously).")

    def check_against_plan(self, plan_dir: Path, plan: PlanConfig) -> None:
        """Refuse, before tritonserver starts, what would make the model fail to load (tritonserver then exits
        with the Python stub's traceback buried in its log)."""
        from trtopt.runtime.config import EngineConfig, load_tokenizer, resolve_limits

        if plan.kind != "paged":
            raise ConfigError(f"{plan_dir} is a {plan.kind!r} plan; Triton serving needs a paged LLM plan from `trtopt build`.")
        lim = plan.limits
        if self.max_batch is not None and self.max_batch > lim.max_num_seqs:
            raise ConfigError(f"--max-batch={self.max_batch} exceeds the plan's max_num_seqs={lim.max_num_seqs}; "
                              "lower it, or rebuild the plan with a larger --max-num-seqs.")
        if self.max_batch_tokens is not None and self.max_batch_tokens > lim.max_num_tokens:
            raise ConfigError(f"--max-batch-tokens={self.max_batch_tokens} exceeds the plan's max_num_tokens="
                              f"{lim.max_num_tokens}; lower it, or rebuild the plan with a larger --max-num-tokens.")
        resolve_limits(plan, EngineConfig(num_blocks=self.num_blocks, max_num_seqs=self.max_batch,
                                          max_num_batched_tokens=self.max_batch_tokens))
        if load_tokenizer(plan_dir) is None:
            raise ConfigError(f"{plan_dir} has no tokenizer files; the Triton model takes text (text_input) and needs "
                              "them: rebuild the plan from an export that saved its tokenizer.")


def write_triton_repo(plan_dir: str | Path, repo_dir: str | Path, config: TritonRepoConfig = TritonRepoConfig(), *,
                      copy_plan: bool = False, force: bool = False) -> Path:
    """Write (or, with force, rewrite) the model `config.name` (and `config.ensemble_name`) into repo_dir; return
    the model directory.

    Raises ConfigError for bad options, options the plan cannot serve, or an existing model dir without force;
    BuildError for an unreadable plan.
    """
    config.validate()
    plan_dir = Path(plan_dir).resolve()
    plan = read_plan(plan_dir)
    config.check_against_plan(plan_dir, plan)
    speculative_json = _speculative_json(config, plan_dir)
    names = [n for n in (config.name, config.ensemble_name) if n is not None]
    for name in names:
        if (Path(repo_dir) / name).exists() and not force:
            raise ConfigError(f"{Path(repo_dir) / name} exists; pass --force to overwrite it or choose another name.")
    for name in names:
        shutil.rmtree(Path(repo_dir) / name, ignore_errors=True)
    model_dir = Path(repo_dir) / config.name
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True)
    shutil.copyfile(_TEMPLATE, version_dir / "model.py")
    if copy_plan:
        shutil.copytree(plan_dir, version_dir / "plan")
        plan_ref = "plan"  # relative to the version dir, so the repository can move
    else:
        plan_ref = str(plan_dir)
    (model_dir / "config.pbtxt").write_text(render_config(config, plan_ref, speculative_json))
    if config.ensemble_name is not None:
        ensemble_dir = Path(repo_dir) / config.ensemble_name
        (ensemble_dir / "1").mkdir(parents=True)
        shutil.copyfile(_ENSEMBLE_TEMPLATE, ensemble_dir / "1" / "model.py")
        max_batch = config.max_batch or plan.limits.max_num_seqs
        (ensemble_dir / "config.pbtxt").write_text(render_ensemble_config(config, max_batch * config.instances))
    return model_dir


def _tensors(specs: tuple[TensorSpec, ...], with_optional: bool) -> str:
    def one(t: TensorSpec) -> str:
        dims = ", ".join(str(d) for d in t.dims)
        optional = " optional: true" if with_optional and t.optional else ""
        return f'  {{ name: "{t.name}" data_type: {t.triton_type} dims: [ {dims} ]{optional} }}'

    return ",\n".join(one(t) for t in specs)


def _parameters(params: dict[str, str]) -> str:
    return ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{_pbtxt_escape(v)}" }} }}' for k, v in params.items())


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
    params = {"plan_dir": plan_ref, "backend": config.backend}
    for key, value in (("max_num_batched_tokens", config.max_batch_tokens), ("max_num_seqs", config.max_batch),
                       ("num_blocks", config.num_blocks), ("speculative_config", speculative_json)):
        if value is not None:
            params[key] = str(value)
    if config.python_env is not None:
        params["EXECUTION_ENV_PATH"] = str(Path(config.python_env).resolve())
    kind = "KIND_GPU" if config.kind == "gpu" else "KIND_CPU"
    return f"""# Written by `trtopt triton-repo`. Decoupled: one request may get many responses (streaming).
# Inputs: the TensorRT-LLM backend's ensemble names and the vLLM backend's sampling_parameters (see the README).
name: "{config.name}"
backend: "python"
max_batch_size: 0  # trtopt batches continuously inside the model; Triton's dynamic batcher is not needed
model_transaction_policy {{ decoupled: true }}
input [
{_tensors(INPUTS, True)}
]
output [
{_tensors(OUTPUTS, False)}
]
instance_group [ {{ count: {config.instances} kind: {kind} }} ]
parameters [
{_parameters(params)}
]
"""


def render_ensemble_config(config: TritonRepoConfig, max_batch_size: int) -> str:
    params = {"target_model": config.name}
    if config.python_env is not None:
        params["EXECUTION_ENV_PATH"] = str(Path(config.python_env).resolve())
    return f"""# Written by `trtopt triton-repo`: TensorRT-LLM's "ensemble" shapes (a batch dimension: text_input [1, 1]),
# forwarded one request at a time to "{config.name}", which batches them continuously.
name: "{config.ensemble_name}"
backend: "python"
max_batch_size: {max_batch_size}
model_transaction_policy {{ decoupled: true }}
input [
{_tensors(INPUTS, True)}
]
output [
{_tensors(OUTPUTS, False)}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters [
{_parameters(params)}
]
"""


def _pbtxt_escape(value: str) -> str:
    """A protobuf text-format string body: backslashes and double quotes escaped (JSON values carry quotes)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')
