"""The TensorRT engine build of a paged plan, once: the executor and the Polygraphy script both call it.

- One optimization profile over every §3 input (trtopt/signature.py), its ranges from plan.json's Limits:
  T, S, blocks per sequence, N, and the pool's num_blocks.
- Strongly typed (dtypes come from the ONNX; TensorRT 11.x is always strongly typed and has no such flag), aliased
  plugin I/O so kv_cache_out.{i} is bound to the same device address as kv_cache.{i}, a workspace limit, and a
  persistent timing cache (timing.cache next to engine.trt).
- trtopt ops with a TensorRT plugin carry plugin_namespace="trtopt"; their registration (face 5 of §4) is imported
  before parsing (``register_plugins``), because Polygraphy's ``--plugins`` only loads .so files.
- A plugin declares every attribute of its op and TensorRT fills none in, so where a node leaves an omittable one
  off (PagedAttention's FP8 attributes on a plan without FP8 pools), TensorRT parses model.trt.onnx, a copy beside
  the model with them written at their defaults (``trt_model_path``), sharing the model's external data.

Parsing, the config and the build are Polygraphy's loaders (``NetworkFromOnnxPath``, ``CreateConfig``,
``EngineBytesFromNetwork``): the ``tensorrt`` extra brings Polygraphy with TensorRT. Neither can be installed on the
project's machines, so everything past ``profile_shapes`` is written against the documented APIs (TensorRT 10.x/11.x,
Polygraphy 0.49+) and has NOT been run; the profile logic is tested without them.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

from trtopt import signature
from trtopt.builder.plan import MODEL_FILE, PlanConfig
from trtopt.errors import BuildError, ConfigError

ENGINE_FILE = "engine.trt"
TRT_MODEL_FILE = "model.trt.onnx"  # the model as TensorRT parses it, where it differs (``trt_model_path``)
TIMING_CACHE_FILE = "timing.cache"
DEFAULT_WORKSPACE_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class ProfileShape:
    """min / opt / max of one dynamic input, as IOptimizationProfile.set_shape takes them."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def max_pool_blocks(plan: PlanConfig) -> int:
    """The largest pool an engine accepts by default: every sequence at max_model_len, plus the null block."""
    return plan.limits.max_num_seqs * plan.max_blocks_per_seq + 1


def profile_shapes(plan: PlanConfig, *, max_num_blocks: int | None = None, opt_num_tokens: int | None = None
                   ) -> dict[str, ProfileShape]:
    """The optimization profile of a paged plan: every §3 input over its range from the plan's Limits.

    opt is tuned for the common case: decode steps of many sequences (T = S) with contexts of a quarter of
    max_model_len, unless opt_num_tokens says otherwise.
    """
    lim, m = plan.limits, plan.model
    max_blocks = max_num_blocks or max_pool_blocks(plan)
    if max_blocks < 2:
        raise ConfigError(f"max_num_blocks must be >= 2 (block 0 is the null block); got {max_blocks}.")
    t_max, s_max, b_max = lim.max_num_tokens, lim.max_num_seqs, plan.max_blocks_per_seq
    t_opt = min(opt_num_tokens or s_max, t_max)
    s_opt = min(s_max, t_opt)
    b_opt = max(1, b_max // 4)
    # min / opt / max of each symbolic dim of the signature; N (logit rows) ranges like T.
    ranges = {
        "T": (1, t_opt, t_max), "N": (1, t_opt, t_max), "S": (1, s_opt, s_max), "S_plus_1": (2, s_opt + 1, s_max + 1),
        "max_blocks": (1, b_opt, b_max), "num_blocks": (2, max_blocks, max_blocks),
    }

    def profile(dims: tuple[signature.Dim, ...]) -> ProfileShape:
        return ProfileShape(*(signature.resolve_dims(dims, {k: v[i] for k, v in ranges.items()}) for i in range(3)))

    shapes = {spec.name: profile(spec.dims) for spec in signature.STEP_INPUTS}
    pool = signature.kv_dims("num_blocks", m.num_kv_heads, lim.block_size, m.head_dim)
    for i in range(m.num_layers):
        shapes[signature.kv_input(i)] = profile(pool)
    return shapes


def import_tensorrt():
    """The tensorrt module, or a ConfigError that says how to get it."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise ConfigError(
            "the tensorrt backend needs the `tensorrt` package (NVIDIA's index: pip install 'trtopt[tensorrt]'); "
            "use --backend torch or onnxruntime here."
        ) from e
    return trt


def register_plugins(model_path: Path) -> list[str]:
    """Import the TensorRT registration of every trtopt op in the model that has one; returns the modules."""
    from trtopt.plugins.trt_common import plugin_modules

    modules = plugin_modules(model_path)
    for module in modules:
        try:
            importlib.import_module(module)  # importing registers the plugin with tensorrt.plugin
        except ImportError as e:
            raise BuildError(
                f"{module} (the TensorRT registration of a trtopt op in this plan) cannot be imported ({e}); "
                "TensorRT cannot build this plan without it: use --backend torch or onnxruntime."
            ) from e
    return modules


def trt_model_path(model_path: Path) -> Path:
    """The model TensorRT parses: ``model_path`` itself when every trtopt node carries every attribute its plugin
    declares, else a copy beside it (TRT_MODEL_FILE) with the missing ones at their schema defaults
    (trt_common.fill_plugin_attributes). The copy names the same external data files, so it adds no weights."""
    import onnx

    from trtopt.plugins.trt_common import fill_plugin_attributes

    model = onnx.load(str(model_path), load_external_data=False)
    if not fill_plugin_attributes(model):
        return model_path
    out = model_path.with_name(TRT_MODEL_FILE)
    onnx.save(model, str(out))
    return out


def network_loader(model_path: Path):
    """Polygraphy's loader of (builder, network, parser) for a plan's model.onnx, plugins registered first."""
    trt = import_tensorrt()
    from polygraphy.backend.trt import NetworkFromOnnxPath

    register_plugins(model_path)
    # 10.x needs STRONGLY_TYPED; 11.x has no such flag (always strongly typed) and Polygraphy refuses to set it.
    strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    return NetworkFromOnnxPath(str(trt_model_path(model_path)), strongly_typed=strongly_typed)


def config_loader(plan: PlanConfig, *, max_num_blocks: int | None = None,
                  workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, timing_cache: Path | None = None):
    """Polygraphy's CreateConfig with the plan's profile, aliased plugin I/O, the workspace and the timing cache."""
    trt = import_tensorrt()
    from polygraphy.backend.trt import CreateConfig, Profile

    profile = Profile()
    for name, shape in profile_shapes(plan, max_num_blocks=max_num_blocks).items():
        profile.add(name, shape.min, shape.opt, shape.max)
    return CreateConfig(
        profiles=[profile],
        memory_pool_limits={trt.MemoryPoolType.WORKSPACE: workspace_bytes},
        preview_features=[trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03],
        # A missing file is an empty cache (Polygraphy warns and goes on).
        load_timing_cache=str(timing_cache) if timing_cache is not None else None,
    )


def build_engine(plan_dir: str | Path, plan: PlanConfig, *, max_num_blocks: int | None = None,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> bytes:
    """Parse the plan's model.onnx and build a serialized engine; writes engine.trt and updates timing.cache."""
    from polygraphy.backend.trt import EngineBytesFromNetwork
    from polygraphy.exception import PolygraphyException

    plan_dir = Path(plan_dir)
    cache_path = plan_dir / TIMING_CACHE_FILE
    network = network_loader(plan_dir / MODEL_FILE)
    config = config_loader(plan, max_num_blocks=max_num_blocks, workspace_bytes=workspace_bytes,
                           timing_cache=cache_path)
    try:
        engine = bytes(EngineBytesFromNetwork(network, config, save_timing_cache=str(cache_path))())
    except PolygraphyException as e:  # a parse or build failure
        raise BuildError(f"TensorRT could not build {plan_dir / MODEL_FILE}: {e}. Rerun with TensorRT's verbose "
                         "log (POLYGRAPHY_LOG_VERBOSITY / trt.Logger.VERBOSE) for the reason.") from e
    (plan_dir / ENGINE_FILE).write_bytes(engine)
    return engine
