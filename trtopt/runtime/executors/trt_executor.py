"""The TensorRT executor (DESIGN.md §5): build or load engine.trt, run it with execute_async_v3.

`tensorrt` cannot be installed on the project's machines, so everything that calls it is written against the
documented API (TensorRT 10.x / 11.x Python API, samples/python/aliased_io_plugin, TENSORRT_NOTES.md) and has NOT
been run. The pure logic (optimization-profile shapes from the plan's Limits) is tested without tensorrt.

- Engine: strongly typed (dtypes come from the ONNX), one optimization profile over T, S, blocks per sequence, N
  and the pool's num_blocks, a persistent timing cache (timing.cache next to engine.trt), aliased plugin I/O so
  kv_cache_out.{i} is bound to the same device address as kv_cache.{i}.
- trtopt nodes of ops with a TensorRT plugin (PagedAttention, FlashAttention) carry plugin_namespace="trtopt", so the
  ONNX parser looks for the registered plugin instead of importing the function body; the others (RMSNorm,
  MatMulAdd) are imported as their function bodies. The registration (face 5 of DESIGN.md §4) must be imported
  before parsing; this module imports `trtopt.plugins.<op>.trt_plugin` for every such op in the plan.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Sequence

import torch

from trtopt.build.plan import MODEL_FILE, PlanConfig
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.executors.signature import (
    LOGITS, STEP_INPUT_NAMES, TORCH_DTYPES, kv_dtype, kv_input, kv_output, kv_shape, step_tensors,
)

ENGINE_FILE = "engine.trt"
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

    def tokens(*lead: int) -> ProfileShape:
        return ProfileShape((*lead, 1), (*lead, t_opt), (*lead, t_max))

    shapes = {
        "input_ids": tokens(1),
        "position_ids": tokens(1),
        "slot_mapping": tokens(),
        "logits_indices": tokens(),
        "block_tables": ProfileShape((1, 1), (s_opt, b_opt), (s_max, b_max)),
        "seq_lens": ProfileShape((1,), (s_opt,), (s_max,)),
        "query_start_loc": ProfileShape((2,), (s_opt + 1,), (s_max + 1,)),
    }
    pool = (2, m.num_kv_heads, lim.block_size, m.head_dim)
    for i in range(m.num_layers):
        shapes[kv_input(i)] = ProfileShape((2, *pool), (max_blocks, *pool), (max_blocks, *pool))
    return shapes


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as e:
        raise ConfigError(
            "the tensorrt backend needs the `tensorrt` package (NVIDIA's index: pip install tensorrt); "
            "use --backend torch or onnxruntime here."
        ) from e
    return trt


def _register_plugins(model_path: Path) -> None:
    from trtopt.plugins.trt_common import plugin_modules

    for module in plugin_modules(model_path):
        try:
            importlib.import_module(module)  # importing registers the plugin with tensorrt.plugin
        except ImportError as e:
            raise BuildError(
                f"{module} (the TensorRT registration of a trtopt op in this plan) cannot be imported ({e}); "
                "TensorRT cannot build this plan without it: use --backend torch or onnxruntime."
            ) from e


def build_engine(plan_dir: str | Path, plan: PlanConfig, *, max_num_blocks: int | None = None,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> bytes:
    """Parse the plan's model.onnx and build a serialized engine; writes engine.trt and timing.cache."""
    trt = _import_tensorrt()
    plan_dir = Path(plan_dir)
    model_path = plan_dir / MODEL_FILE
    _register_plugins(model_path)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    for name in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):  # 11.x is always strongly typed
        flag = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if flag is not None:
            flags |= 1 << int(flag)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {model_path}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    cache_path = plan_dir / TIMING_CACHE_FILE
    timing_cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(timing_cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for name, shape in profile_shapes(plan, max_num_blocks=max_num_blocks).items():
        profile.set_shape(name, shape.min, shape.opt, shape.max)
    config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError("TensorRT failed to build the engine; rerun with TensorRT's verbose log for the reason.")
    engine = bytes(serialized)
    (plan_dir / ENGINE_FILE).write_bytes(engine)
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return engine


class TrtExecutor:
    """Runs a paged plan's TensorRT engine on CUDA; pools are torch CUDA tensors bound in and out (aliased)."""

    def __init__(self, plan_dir: str | Path, plan: PlanConfig, *, max_num_blocks: int | None = None):
        trt = _import_tensorrt()
        if not torch.cuda.is_available():
            raise ConfigError("the tensorrt backend needs a CUDA GPU; use --backend torch or onnxruntime.")
        self.plan = plan
        self.kv_dtype: torch.dtype = kv_dtype(plan, TORCH_DTYPES)
        plan_dir = Path(plan_dir)
        engine_path = plan_dir / ENGINE_FILE
        _register_plugins(plan_dir / MODEL_FILE)  # deserializing needs the plugins too
        if engine_path.is_file():
            engine_bytes = engine_path.read_bytes()
        else:
            engine_bytes = build_engine(plan_dir, plan, max_num_blocks=max_num_blocks)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise BuildError(f"{engine_path} could not be deserialized (built by another TensorRT version or GPU?); "
                             "delete it and run again to rebuild.")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.device = torch.device("cuda")
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = kv_shape(self.plan, num_blocks)
        _, _, max_shape = self.engine.get_tensor_profile_shape(kv_input(0), 0)
        if num_blocks > max_shape[0]:
            raise ConfigError(f"num_blocks={num_blocks} exceeds the engine's profile ({max_shape[0]}); delete "
                              f"{ENGINE_FILE} and rebuild with a larger max_num_blocks.")
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                          for _ in range(self.plan.model.num_layers)]
        self.num_blocks = num_blocks

    def execute(self, step: StepInputs) -> torch.Tensor:
        assert self.kv_caches, "allocate_kv_cache() must run before execute()"
        ctx = self.context
        self.stream.wait_stream(torch.cuda.current_stream())  # the pools may have just been written (copy_blocks)
        # Everything the engine reads or writes is allocated on the engine's stream, so the caching allocator
        # cannot hand that memory to anyone else before the engine is done with it.
        with torch.cuda.stream(self.stream):
            feeds = {name: t.to(self.device, non_blocking=True).contiguous() for name, t in step_tensors(step).items()}
            logits = torch.empty((step.logits_indices.shape[0], self.plan.model.vocab_size), dtype=torch.float32,
                                 device=self.device)
            for name in STEP_INPUT_NAMES:
                ctx.set_input_shape(name, tuple(feeds[name].shape))
                ctx.set_tensor_address(name, feeds[name].data_ptr())
            for layer, pool in enumerate(self.kv_caches):
                ctx.set_input_shape(kv_input(layer), tuple(pool.shape))
                ctx.set_tensor_address(kv_input(layer), pool.data_ptr())
                ctx.set_tensor_address(kv_output(layer), pool.data_ptr())  # aliased: the plugin writes in place
            ctx.set_tensor_address(LOGITS, logits.data_ptr())
            if not ctx.execute_async_v3(self.stream.cuda_stream):
                raise BuildError("TensorRT execute_async_v3 failed; see the TensorRT log above.")
        torch.cuda.current_stream().wait_stream(self.stream)
        logits.record_stream(torch.cuda.current_stream())
        return logits

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        from trtopt.plugins.paged_attention.reference import copy_blocks_ref

        copy_blocks_ref(self.kv_caches, torch.tensor(list(pairs), dtype=torch.int64))
