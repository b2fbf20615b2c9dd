"""`trtopt check FP_EXPORT QUANT_PLAN`: a quantized plan against the float export it was quantized from.

The check is a quantization check when the plan's graph is quantized (QMatMul, or Q/DQ ops the build left) and the
original is not: its logits are then held to compare.QuantTolerance (top-1 agreement, mean KL, max |Δ logprob|)
instead of the elementwise float bar, on text rather than random token ids (random ids make every next-token
distribution flat, where any rounding flips the argmax). With --layerwise it ranks the plan's decoder layers by the
error each adds alone (trtopt/quantize/sensitivity.py, with the codes and scales read back from the plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from trtopt.builder.plan import MODEL_FILE, PlanConfig
from trtopt.check.runner import Workload, random_workload
from trtopt.errors import ConfigError

_QUANTIZED_OPS = frozenset({"QMatMul", "QuantizeLinear", "DequantizeLinear", "MatMulNBits"})
SENSITIVITY_WINDOWS = (4, 256)  # held-out windows x tokens (cut to the plan's max_model_len)


def is_quantized(model_path: Path) -> bool:
    """Whether a graph (a plan's or an export's) holds quantized MatMuls or Q/DQ ops; weights are not read."""
    proto = onnx.load(str(model_path), load_external_data=False)
    return any(node.op_type in _QUANTIZED_OPS for node in proto.graph.node)


def heldout_tokens(plan_dir: Path) -> np.ndarray | None:
    """The evaluation text (trtopt/quantize/data.py's corpus) tokenized with the plan's tokenizer; None without one."""
    from trtopt.quantize import data
    from trtopt.runtime.config import load_tokenizer

    tokenizer = load_tokenizer(plan_dir)
    return None if tokenizer is None else data.corpus_tokens(tokenizer)


def text_workload(plan: PlanConfig, tokens: np.ndarray, *, num_seqs: int = 3, decode_steps: int = 4) -> Workload:
    """random_workload's prompt lengths and schedule, the prompts cut one after another from the end of ``tokens``
    (data.py's held-out side)."""
    shape = random_workload(plan, num_seqs=num_seqs, decode_steps=decode_steps)
    lens = [len(p) for p in shape.prompts]
    if sum(lens) > len(tokens):
        raise ConfigError(f"the evaluation text has {len(tokens)} tokens, fewer than the {sum(lens)} the prompts "
                          "need; pass --prompt or --token-ids.")
    stream, prompts, at = tokens[len(tokens) - sum(lens):], [], 0
    for n in lens:
        prompts.append(tuple(int(t) for t in stream[at:at + n]))
        at += n
    return Workload(tuple(prompts), chunk=shape.chunk, decode_steps=decode_steps, seed=None)


def plan_sensitivity(plan_dir: Path, original: Path, sequences: list[list[int]], *, threads: int | None = None,
                     on_progress: Callable[[str, int, int], None] | None = None):
    """Every decoder layer of a quantized plan ranked by the error it adds alone (a SensitivityReport): the float
    ``original`` with only that layer's MatMuls quantized as the plan's QMatMuls are. ConfigError for a plan with no
    QMatMul (a float plan: nothing to rank)."""
    from trtopt.quantize.graph import upgrade_opset
    from trtopt.quantize.sensitivity import layer_sensitivity, module_paths, specs_from_plan

    plan_model = onnx.load(str(plan_dir / MODEL_FILE))
    if not any(node.op_type == "QMatMul" for node in plan_model.graph.node):
        raise ConfigError(f"{plan_dir} is not quantized (no QMatMul in its graph), so there is no quantized layer to "
                          "rank; pass a plan built from `trtopt quantize` output (on a float plan, --layerwise "
                          "compares each layer's attention output instead).")
    model = onnx.load(str(original))
    specs = specs_from_plan(plan_model, model)
    del plan_model
    blocked = any(s.weight.group is not None or s.act_mode == "dynamic" for s in specs)
    paths = module_paths(model)  # before the version converter drops node metadata
    model = upgrade_opset(model, 21 if blocked else 19)
    return layer_sensitivity(model, specs, sequences, paths=paths, threads=threads or 2, on_progress=on_progress)


def sensitivity_sequences(plan: PlanConfig, tokens: np.ndarray | None, workload: Workload) -> list[list[int]]:
    """What --layerwise runs each variant on: held-out text windows, or the workload's prompts without a
    tokenizer."""
    if tokens is None:
        return [list(p) for p in workload.prompts]
    count, length = SENSITIVITY_WINDOWS
    length = min(length, plan.limits.max_model_len - 1, len(tokens) // count)
    return tokens[len(tokens) - count * length:].reshape(count, length).tolist()
