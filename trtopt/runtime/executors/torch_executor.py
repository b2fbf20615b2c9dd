"""The torch executor (docs/architecture.md §5): the plan's model.onnx converted to torch.fx, KV pools written in
place."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch

from trtopt.builder.plan import MODEL_FILE, PlanConfig
from trtopt.errors import ConfigError
from trtopt.runtime.batch import StepInputs, fill_placeholders, fill_placeholders_
from trtopt.runtime.executors import trtopt_ops
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.executors.cuda_graphs import CaptureReport, StepGraphs
from trtopt.runtime.executors.fx_fusions import fuse_rope, fuse_rope_into_paged_attention, gather_nonnegative
from trtopt.runtime.executors.gemv import GEMV_DTYPES, use_decode_gemv
from trtopt.runtime.executors.onnx_to_torch import ConvertedGraph, onnx_to_torch
from trtopt.runtime.executors.qmatmul_packing import fuse_norm_pack_x, fuse_norm_quantize, pack_qmatmul_weights
from trtopt.runtime.executors.signature import (
    TORCH_DTYPES, TORCH_POOL_DTYPES, check_paged_plan, kv_dtype, kv_shape, pool_dtype, step_tensors,
)
from trtopt.signature import (
    BLOCK_TABLES, INPUT_IDS, LOGITS, NONNEGATIVE_INPUTS, STEP_INPUT_NAMES, kv_input, kv_output, output_names,
)


class TorchExecutor(Executor):
    """Runs a paged plan as a torch.fx GraphModule on CPU or CUDA.

    fuse_rope_kv (default on): run the plan's Rope(q), Rope(k) → PagedAttention as one call whose CUDA path rotates
    q and k inside the KV-write kernel (fx_fusions.fuse_rope_into_paged_attention); off only for ablations.

    decode_gemv (default: on for fp16/bf16 plans on CUDA without compile_mode): projection weights stored [N, K]; a
    one-row step (batch-1 decode) runs them through Triton GEMVs, gate/up with SiLU·mul as the epilogue and Q/K/V
    with RoPE and the KV write as the epilogue (when fuse_rope_kv folded RoPE into the attention; gemv_rope_kv=False
    turns that part off, for ablations), larger steps through cuBLAS (runtime/executors/gemv.py, where the rule and
    its measurements are). Off: the plan's [K, N] weights through torch.matmul, as converted.

    compile_mode (opt-in; None = the GraphModule as converted): a torch.compile mode (torch_library.COMPILE_MODES);
    the graph then runs through Inductor, specialised and compiled once per step shape (each CUDA-graph bucket),
    with the trtopt ops as torch.library custom ops. `compiled.records` says what each compile cost.

    argmax_in_graph (default on; with cuda_graphs): each step graph also fills async scheduling's placeholders and
    takes the greedy argmax of its logits rows (`last_greedy_tokens`); off, the engine launches both from Python
    between replays (cuda_graphs.StepGraphs; benchmarks' A/B). argmax_kernel (default on): that argmax through the
    Triton kernel (kernels/argmax.py), off through torch.argmax (an ablation). Both are read whenever graphs are
    captured (capture_graphs), so a benchmark may change the attributes between engines on one executor.

    fold_x_pack (default on; CUDA): an INT4 weight-only projection takes its x packed for the decode GEMV by the
    launch of the op that produces x (qmatmul_packing.py rewrite 5); off, the GEMV packs x in a launch of its own
    (an ablation: the same values).

    reference_ops (default none): trtopt op types (trtopt_ops.REFERENCE_OPS: PagedAttention) run through their torch
    reference on every device instead of the kernel (fp32 math on the stored pool values; an ablation, slow).

    The module's KV inputs are this executor's pools; trtopt::PagedAttention writes them in place and returns the
    same tensor as kv_cache_out. If a layer's kv_cache_out is a new tensor instead (a plan whose attention runs as
    its ONNX function body), it is copied back so the pool stays the one source of truth.

    Placeholder input ids (async scheduling, StepInputs.sampled_ids) are filled on the device, after the step's
    inputs are copied there, so launching a step never waits for the previous one's tokens.
    """

    resolves_placeholders = True

    def __init__(self, plan_dir: str | Path, plan: PlanConfig, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None, body_ops: Sequence[str] = (), cuda_graphs: bool = False,
                 compile_mode: str | None = None, fuse_rope_kv: bool = True, decode_gemv: bool | None = None,
                 gemv_rope_kv: bool = True, argmax_in_graph: bool = True, argmax_kernel: bool = True,
                 fold_x_pack: bool = True, reference_ops: Sequence[str] = ()):
        self.plan = plan
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'.")
        self.kv_dtype: torch.dtype = kv_dtype(plan, TORCH_DTYPES)
        # The pools': the model's, or float8_e4m3fn for a plan built with --kv-cache-dtype fp8.
        self.pool_dtype: torch.dtype = pool_dtype(plan, TORCH_POOL_DTYPES, device=self.device)
        self._check_dtype(dtype)
        started = time.perf_counter()
        self.argmax_in_graph = argmax_in_graph
        self.argmax_kernel = argmax_kernel
        # What PagedAttention's kernel keeps between calls (plans, merge counters, its launcher's switch): this
        # executor's, for every call of its graph, CUDA-graph captures included; None off CUDA. The converted graph
        # passes it to each call (`state=`); under compile_mode, whose custom op cannot take a Python object, _run
        # sets it as the current one around each forward (trtopt_ops.CURRENT_PAGED_STATE) and the op reads it there.
        self.paged_state = trtopt_ops.paged_launch_state(self.device)
        self.graph: ConvertedGraph = onnx_to_torch(Path(plan_dir) / MODEL_FILE, device=self.device,
                                                   body_ops=body_ops, reference_ops=reference_ops,
                                                   paged_state=None if compile_mode else self.paged_state)
        # RoPE as one kernel on CUDA (bit-identical ops elsewhere): ~14 fewer launches per layer. Under torch.compile
        # Inductor fuses the unfused ops itself (torch_library.py).
        self.num_fused_rope = 0 if compile_mode else fuse_rope(self.graph.module)
        # The plan's Rope(q), Rope(k) and PagedAttention's KV write as one kernel on CUDA: two fewer launches per layer.
        self.num_fused_rope_kv = (fuse_rope_into_paged_attention(self.graph.module)
                                  if fuse_rope_kv and not compile_mode else 0)
        # Gathers by token ids, positions and logits rows: one index_select each, not four launches.
        self.num_nonnegative_gathers = gather_nonnegative(self.graph.module, self.graph.input_names,
                                                          NONNEGATIVE_INPUTS)
        # Decode-sized projections as GEMVs (gate/up with SiLU·mul in one launch); the cuBLAS path for larger steps.
        if decode_gemv is None:
            decode_gemv = self.device.type == "cuda" and self.kv_dtype in GEMV_DTYPES and not compile_mode
        elif decode_gemv and compile_mode:
            raise ConfigError("decode_gemv=True and compile_mode cannot be combined: the GEMVs are launched outside "
                              "Inductor's graph; leave decode_gemv unset with compile_mode.")
        self.num_gemv_weights, self.num_gemv_silu_mul, self.num_gemv_rope_kv = (
            use_decode_gemv(self.graph.module, rope_kv=gemv_rope_kv)
            if decode_gemv else (0, 0, 0))
        # QMatMul weights packed once into the decode GEMV's layout on CUDA (runtime/executors/qmatmul_packing.py);
        # the CPU and compile_mode (its custom op) keep the op, which packs per call on CUDA.
        self.num_packed_qmatmuls = 0 if compile_mode else pack_qmatmul_weights(self.graph.module)
        # ... and a W8A8 projection's activation quantized in the launch of the RMSNorm that produces it
        self.num_norm_quantize_fusions = fuse_norm_quantize(self.graph.module) if self.num_packed_qmatmuls else 0
        # ... and an INT4 projection's x packed for its GEMV in the launch of the op that produces it
        self.num_x_pack_fusions = fuse_norm_pack_x(self.graph.module) if self.num_packed_qmatmuls and fold_x_pack else 0
        self.convert_seconds = time.perf_counter() - started
        # What a step calls: the GraphModule itself, or (opt-in) torch.compile'd copies of it, one per step shape.
        self.compiled = None
        if compile_mode is not None:
            from trtopt.runtime.executors.torch_library import CompiledGraph

            self.compiled = CompiledGraph(self.graph.module, self.graph.input_names, mode=compile_mode,
                                          shape_inputs=STEP_INPUT_NAMES)
        self._module = self.graph.module if self.compiled is None else self.compiled
        check_paged_plan(plan, plan_dir, self.graph.input_names, self.graph.output_names)
        layers = range(plan.model.num_layers)
        self._step_positions = {name: self.graph.input_names.index(name) for name in STEP_INPUT_NAMES}
        self._kv_positions = [self.graph.input_names.index(kv_input(i)) for i in layers]
        self._kv_out_positions = [self.graph.output_names.index(kv_output(i)) for i in layers]
        self._logits_position = self.graph.output_names.index(LOGITS.name)
        signature_outputs = set(output_names(plan.model.num_layers))
        self._extra_positions = {name: i for i, name in enumerate(self.graph.output_names)
                                 if name not in signature_outputs}
        self.kv_caches: list[torch.Tensor] = []
        # Off unless asked for; LLMEngine.from_plan asks for them on CUDA (gpu tests: test_cuda_graphs.py, tests/e2e).
        # Buckets span the plan's limits until capture_graphs() learns the engine's (which may be smaller).
        self.graphs = StepGraphs(
            self._run, device=self.device, max_num_seqs=plan.limits.max_num_seqs,
            max_num_tokens=plan.limits.max_num_tokens, max_blocks_per_seq=plan.max_blocks_per_seq,
            argmax_in_graph=argmax_in_graph, argmax_kernel=argmax_kernel,
        ) if cuda_graphs and self.device.type == "cuda" else None

    def _check_dtype(self, dtype: torch.dtype | str | None) -> None:
        # A plan is built for one dtype: its Cast nodes and constants name it, so it cannot be changed here.
        if dtype is None:
            return
        wanted = TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if wanted != self.kv_dtype:
            raise ConfigError(
                f"dtype={dtype} was asked for but the plan was built in {self.plan.model.dtype}; export and build "
                f"the model in that dtype (`trtopt export --dtype`), or leave dtype unset."
            )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = kv_shape(self.plan, num_blocks)
        self.kv_caches = [torch.zeros(shape, dtype=self.pool_dtype, device=self.device)
                          for _ in range(self.plan.model.num_layers)]
        self.num_blocks = num_blocks
        if self.graphs is not None:
            self.graphs.reset()  # the captured graphs hold the old pools' addresses

    def capture_graphs(self, *, max_num_seqs: int, max_num_tokens: int,
                       max_logits: int | None = None) -> CaptureReport | None:
        """Capture the step graph of every bucket up to the engine's limits now; None without CUDA graphs.

        max_logits: logits rows a step may ask for (default max_num_seqs); speculative verification asks for
        K+1 per sequence, so the engine passes max_num_seqs * (K+1) there (cuda_graphs.graph_buckets)."""
        if self.graphs is None:
            return None
        assert self.kv_caches, "allocate_kv_cache() must run before the graphs capture the pools"
        self.graphs = StepGraphs(self._run, device=self.device, max_num_seqs=max_num_seqs,
                                 max_num_tokens=max_num_tokens, max_blocks_per_seq=self.plan.max_blocks_per_seq,
                                 max_logits=max_logits, argmax_in_graph=self.argmax_in_graph,
                                 argmax_kernel=self.argmax_kernel)
        return self.graphs.capture_all()

    def execute(self, step: StepInputs) -> torch.Tensor:
        assert self.kv_caches, "allocate_kv_cache() must run before execute()"
        feeds = step_tensors(step)
        if self.graphs is not None:
            logits = self.graphs.try_run(step)
            if logits is not None:
                return logits
        if self.compiled is not None:
            # Block tables at the plan's full width (zeros: the null block, never read past seq_lens), as the graph
            # buckets have them: a compiled shape then does not change every block_size tokens of a sequence.
            tables = feeds[BLOCK_TABLES.name]
            extra = self.plan.max_blocks_per_seq - tables.shape[1]
            assert extra >= 0, f"block tables {tuple(tables.shape)} wider than the plan's {self.plan.max_blocks_per_seq}"
            feeds[BLOCK_TABLES.name] = torch.nn.functional.pad(tables, (0, extra))
        feeds = {name: t.to(self.device, non_blocking=True) for name, t in feeds.items()}
        if step.sampled_ids is not None:
            ids, sampled = feeds[INPUT_IDS.name], step.sampled_ids.to(self.device)
            # In place on the device copy (one launch); on the CPU `.to` returned the step's own tensor: keep it.
            feeds[INPUT_IDS.name] = fill_placeholders_(ids, sampled) if ids.is_cuda else fill_placeholders(ids, sampled)
        return self._run(feeds)

    @property
    def last_greedy_tokens(self) -> torch.Tensor | None:
        """int64 [N] on the device: the greedy argmax of the last execute()'s logits rows, when its CUDA graph
        computed it (argmax_in_graph); valid until the next execute(). None after an eager step."""
        return self.graphs.last_tokens if self.graphs is not None else None

    def _run(self, feeds: dict[str, torch.Tensor], logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """One step on device-resident feeds; the pools are written in place. Returns logits [N, vocab] fp32,
        written into `logits_out` when given (graphs write one shared buffer)."""
        args: list[torch.Tensor | None] = [None] * len(self.graph.input_names)
        for name, tensor in feeds.items():
            args[self._step_positions[name]] = tensor
        for layer, position in enumerate(self._kv_positions):
            args[position] = self.kv_caches[layer]
        with torch.inference_mode():
            if self.compiled is None:
                outputs = self._module(*args)
            else:  # the custom op reads this executor's PagedLaunchState here (no Python object crosses it)
                token = trtopt_ops.CURRENT_PAGED_STATE.set(self.paged_state)
                try:
                    outputs = self._module(*args)
                finally:
                    trtopt_ops.CURRENT_PAGED_STATE.reset(token)
            for layer, position in enumerate(self._kv_out_positions):
                pool = self.kv_caches[layer]
                if outputs[position] is not pool:
                    pool.copy_(outputs[position])
            logits = outputs[self._logits_position]
            if self._extra_positions:
                self.extra_outputs = {name: outputs[i].clone() for name, i in self._extra_positions.items()}
        logits = logits.reshape(-1, logits.shape[-1])
        if logits_out is not None:
            return logits_out.copy_(logits)
        # Made outside inference mode, the copy is an ordinary tensor that callers may modify in place (the
        # sampler's penalties do); an inference tensor would refuse that.
        return logits.to(torch.float32, copy=True)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        from trtopt.plugins.paged_attention.reference import copy_blocks_ref

        index = torch.tensor(list(pairs), dtype=torch.int64)
        assert int(index.min()) >= 1 and int(index.max()) < self.num_blocks, (
            f"copy_blocks pairs {list(pairs)} must name blocks 1..{self.num_blocks - 1} (block 0 is the null block)"
        )
        with torch.inference_mode():
            copy_blocks_ref(self.kv_caches, index)
