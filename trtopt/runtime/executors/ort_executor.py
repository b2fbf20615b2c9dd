"""The onnxruntime executor (docs/architecture.md §5): the plan's model.onnx run as it is, trtopt ops by their
function bodies.

It is the independent check that the fused graph means what the original meant, and the portable fallback.

KV pools: in ONNX semantics kv_cache_out.{i} is a new tensor, so ORT cannot write the pool it reads. The executor
keeps two host buffers per layer and binds them with IOBinding: step n reads set A and writes set B, step n+1
reads B and writes A. Nothing is allocated or copied by the executor per step; the copy of the pool inside the
ScatterND of the function body is ORT's.
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch

from trtopt.builder.plan import MODEL_FILE, PlanConfig
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.signature import (
    NUMPY_POOL_DTYPES, check_paged_plan, kv_shape, pool_dtype, step_tensors,
)
from trtopt.signature import FP8_KV_DTYPE, LOGITS, kv_input, kv_output, output_names


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def session_options(*, threads: int | None = None) -> ort.SessionOptions:
    """All graph optimizations, one intra-op thread per available core, sequential execution."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or _cpu_count()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Q/DQ (trtopt.QMatMul bodies, or unfused): run as written, as trtopt/quantize/runner.py does; ORT's QDQ
    # fusions compute something else (int8 activations in MatMulNBits, an invalid FP8 MatMulIntegerToFloat).
    # No effect on a graph without Q/DQ.
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return options


class OrtExecutor(Executor):
    """Runs a paged plan on onnxruntime; pools are numpy arrays bound to the session through IOBinding."""

    def __init__(self, plan_dir: str | Path, plan: PlanConfig, *, providers: Sequence[str] | None = None,
                 threads: int | None = None):
        self.plan = plan
        model_path = Path(plan_dir) / MODEL_FILE
        if not model_path.is_file():
            raise BuildError(f"{plan_dir} has no {MODEL_FILE}; build the plan with `trtopt build`.")
        available = ort.get_available_providers()
        providers = list(providers) if providers else ["CPUExecutionProvider"]
        unknown = [p for p in providers if p not in available]
        if unknown:
            raise ConfigError(f"onnxruntime providers {unknown} are not available here (available: {available}).")
        self.kv_dtype = pool_dtype(plan, NUMPY_POOL_DTYPES)
        self.session = ort.InferenceSession(str(model_path), session_options(threads=threads), providers=providers)
        input_names = [i.name for i in self.session.get_inputs()]
        graph_outputs = [o.name for o in self.session.get_outputs()]
        check_paged_plan(plan, plan_dir, input_names, graph_outputs)
        signature_outputs = set(output_names(plan.model.num_layers))
        self._extra_names = [name for name in graph_outputs if name not in signature_outputs]
        self._pools: list[list[np.ndarray]] = [[], []]  # two sets of per-layer pools, swapped every step
        self._current = 0  # index of the set that holds the live pools
        self._pool_values: list[list[ort.OrtValue]] = [[], []]

    @property
    def kv_caches(self) -> list[np.ndarray]:
        """The live per-layer pools."""
        return self._pools[self._current]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = kv_shape(self.plan, num_blocks)
        layers = self.plan.model.num_layers
        pools = [[self._new_pool(shape) for _ in range(layers)] for _ in range(2)]
        self._pools = [[array for array, _ in row] for row in pools]
        self._pool_values = [[value for _, value in row] for row in pools]
        self._current = 0
        self.num_blocks = num_blocks

    def _new_pool(self, shape: tuple[int, ...]) -> tuple[np.ndarray, ort.OrtValue]:
        """A zeroed pool as a numpy array and the OrtValue bound to the session, sharing its memory."""
        if self.plan.kv_pool_dtype != FP8_KV_DTYPE:
            # On CPU an OrtValue made from a numpy array shares its memory: both views stay valid as long as the array.
            array = np.zeros(shape, dtype=self.kv_dtype)
            return array, ort.OrtValue.ortvalue_from_numpy(array)
        # numpy has no float8 (nor can an OrtValue be made from ml_dtypes' arrays): ORT allocates the float8 tensor,
        # and the array is a view of its bytes (valid as long as the OrtValue, which is kept beside it).
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), onnx.TensorProto.FLOAT8E4M3FN)
        buffer = (ctypes.c_uint8 * math.prod(shape)).from_address(value.data_ptr())
        array = np.ctypeslib.as_array(buffer).reshape(shape)
        array[...] = 0
        return array, value

    def execute(self, step: StepInputs) -> torch.Tensor:
        assert self._pools[0], "allocate_kv_cache() must run before execute()"
        binding = self.session.io_binding()
        for name, tensor in step_tensors(step).items():
            binding.bind_cpu_input(name, np.ascontiguousarray(tensor.numpy()))
        binding.bind_output(LOGITS.name, "cpu")  # bound first: get_outputs() returns outputs in binding order
        live, spare = self._pool_values[self._current], self._pool_values[1 - self._current]
        for layer in range(self.plan.model.num_layers):
            binding.bind_ortvalue_input(kv_input(layer), live[layer])
            binding.bind_ortvalue_output(kv_output(layer), spare[layer])
        for name in self._extra_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        self._current = 1 - self._current
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()
        if self._extra_names:  # bound last, so they come last
            extras = outputs[len(outputs) - len(self._extra_names):]
            self.extra_outputs = {name: torch.from_numpy(v.numpy()) for name, v in zip(self._extra_names, extras)}
        return torch.from_numpy(logits).reshape(-1, logits.shape[-1]).float()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        index = np.asarray(pairs, dtype=np.int64)
        assert index.min() >= 1 and index.max() < self.num_blocks, (
            f"copy_blocks pairs {list(pairs)} must name blocks 1..{self.num_blocks - 1} (block 0 is the null block)"
        )
        for pool in self.kv_caches:
            pool[index[:, 1]] = pool[index[:, 0]]  # fancy indexing on the right copies every source first
