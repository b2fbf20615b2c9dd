"""The TensorRT executor (docs/architecture.md §5): load engine.trt (built by trtopt.builder.trt_engine when missing)
and run
it with execute_async_v3.

`tensorrt` cannot be installed on the project's machines, so everything that calls it is written against the
documented API (TensorRT 10.x / 11.x Python API, samples/python/aliased_io_plugin, TENSORRT_NOTES.md) and has NOT
been run. The pools are bound to both kv_cache.{i} and kv_cache_out.{i} (aliased plugin I/O: written in place).
Deserializing needs the plugins registered too, so the plan's `trtopt.plugins.<op>.trt_plugin` modules are imported
first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from trtopt.builder.plan import MODEL_FILE, PlanConfig
from trtopt.builder.trt_engine import ENGINE_FILE, build_engine, import_tensorrt, register_plugins
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.signature import TORCH_DTYPES, kv_dtype, kv_shape, step_tensors
from trtopt.signature import LOGITS, STEP_INPUT_NAMES, kv_input, kv_output


class TrtExecutor(Executor):
    """Runs a paged plan's TensorRT engine on CUDA; pools are torch CUDA tensors bound in and out (aliased)."""

    def __init__(self, plan_dir: str | Path, plan: PlanConfig, *, max_num_blocks: int | None = None):
        trt = import_tensorrt()
        if not torch.cuda.is_available():
            raise ConfigError("the tensorrt backend needs a CUDA GPU; use --backend torch or onnxruntime.")
        self.plan = plan
        self.kv_dtype: torch.dtype = kv_dtype(plan, TORCH_DTYPES)
        plan_dir = Path(plan_dir)
        engine_path = plan_dir / ENGINE_FILE
        register_plugins(plan_dir / MODEL_FILE)  # deserializing needs the plugins too
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
        self.kv_caches: list[torch.Tensor] = []  # marked intermediates are not bound: extra_outputs stays empty

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
            ctx.set_tensor_address(LOGITS.name, logits.data_ptr())
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
