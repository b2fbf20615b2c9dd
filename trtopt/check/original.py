"""The original export (optimum-style past_key_values I/O) run on onnxruntime, batch 1, one sequence at a time.

This is the other side of `trtopt check ORIGINAL.onnx PLAN`: what the graph meant before the build fused it and
rewrote it to the paged signature. Each sequence keeps its own past KV; a step feeds the sequence's new tokens
with ``position_ids`` (when the graph has them) and an all-ones ``attention_mask`` (no padding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError

from trtopt.builder.plan import ModelFacts
from trtopt.builder.source import check_external_data
from trtopt.errors import BuildError, ConfigError
from trtopt.plugins import DOMAIN
from trtopt.runtime.executors.ort_executor import session_options
from trtopt.signature import INPUT_IDS, LOGITS, POSITION_IDS

_ORT_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
_MASK = "attention_mask"


def check_original(path: Path) -> None:
    """ConfigError unless ``path`` is a readable ONNX graph that is not itself a trtopt plan graph."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError) as e:
        raise ConfigError(f"the original {path} is not a readable ONNX model ({type(e).__name__}); pass the export "
                          "the plan was built from (`trtopt export` output).") from e
    if not proto.graph.node:
        raise ConfigError(f"the original {path} has no graph nodes; pass the export the plan was built from.")
    if any(node.domain == DOMAIN for node in proto.graph.node):
        raise ConfigError(f"the original {path} is a trtopt plan graph; pass the export the plan was built from "
                          "first, then the plan: `trtopt check EXPORT PLAN`.")
    try:
        check_external_data(proto, path.parent)
    except BuildError as e:
        raise ConfigError(f"the original {path}: {e}") from e


class OriginalModel:
    """An export with past KV inputs on ORT CPU; ``step`` runs one sequence's new tokens."""

    def __init__(self, onnx_path: str | Path, facts: ModelFacts, *, extra_outputs: Sequence[str] = (),
                 threads: int | None = None):
        self.path = Path(onnx_path)
        try:
            self.session = ort.InferenceSession(str(onnx_path), session_options(threads=threads),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own types (Fail, InvalidGraph, NotImplemented...) for a bad graph
            raise ConfigError(f"onnxruntime cannot load the original {self.path}: {str(e).splitlines()[0][:300]}. "
                              "Pass the export that the plan was built from (`trtopt export` output).") from e
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.past_names = [n for n in inputs if "past" in n]
        self.present_of = _present_names(self.past_names, self.output_names, self.path)
        self.extra_outputs = list(extra_outputs)
        self._check_inputs(inputs, facts)
        self.feeds_position_ids = POSITION_IDS.name in inputs
        self.feeds_mask = _MASK in inputs
        first = inputs[self.past_names[0]]
        if first.type not in _ORT_FLOATS:
            raise ConfigError(f"the original's KV cache is {first.type}, which onnxruntime cannot take from numpy "
                              "here; check a float32 or float16 export.")
        self.empty = np.zeros((1, facts.num_kv_heads, 0, facts.head_dim), _ORT_FLOATS[first.type])

    def _check_inputs(self, inputs: dict, facts: ModelFacts) -> None:
        where = f"the original {self.path}"
        if INPUT_IDS.name not in inputs or LOGITS.name not in self.output_names:
            raise ConfigError(f"{where} has no `input_ids` input or `logits` output; pass the causal-LM export the "
                              "plan was built from.")
        if not self.past_names:
            raise ConfigError(f"{where} has no past_key_values inputs (no KV cache), so it is not what a paged plan "
                              "is built from; pass the export with a KV cache (`trtopt export`).")
        unknown = sorted(set(inputs) - {INPUT_IDS.name, POSITION_IDS.name, _MASK, *self.past_names})
        if unknown:
            raise ConfigError(f"{where} has inputs that `trtopt check` cannot feed: {unknown}.")
        if len(self.past_names) != 2 * facts.num_layers:
            raise ConfigError(f"{where} has {len(self.past_names) // 2} layers of past KV but the plan has "
                              f"{facts.num_layers}; is this the export the plan was built from?")
        for name in self.past_names:
            dims = inputs[name].shape
            static = {axis: d for axis, d in enumerate(dims) if isinstance(d, int)} if len(dims) == 4 else {}
            want = {1: facts.num_kv_heads, 3: facts.head_dim}
            wrong = {axis: d for axis, d in static.items() if axis in want and d != want[axis]}
            if len(dims) != 4 or wrong:
                raise ConfigError(f"{where}'s `{name}` has shape {dims}, not [batch, {facts.num_kv_heads} kv heads, "
                                  f"past, {facts.head_dim}] as the plan; is this the export the plan was built from?")

    def new_state(self) -> dict[str, np.ndarray]:
        return {n: self.empty for n in self.past_names}

    def step(self, past: dict[str, np.ndarray], tokens: list[int], start: int
             ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Run ``tokens`` at positions start.. on top of ``past``: (logits [n, vocab] float32, the new past,
        the marked extra outputs by name)."""
        n = len(tokens)
        feeds = {INPUT_IDS.name: np.array([tokens], np.int64), **past}
        if self.feeds_position_ids:
            feeds[POSITION_IDS.name] = np.arange(start, start + n, dtype=np.int64)[None]
        if self.feeds_mask:
            feeds[_MASK] = np.ones((1, start + n), np.int64)
        by_name = dict(zip(self.output_names, self.session.run(None, feeds)))
        new_past = {p: by_name[self.present_of[p]] for p in self.past_names}
        logits = by_name[LOGITS.name]
        logits = logits.reshape(-1, logits.shape[-1])[-n:].astype(np.float32)
        return logits, new_past, {name: by_name[name] for name in self.extra_outputs}


def _present_names(pasts: list[str], outputs: list[str], path: Path) -> dict[str, str]:
    """past input → present output: optimum's names (past_key_values.* → present.*), else the order of both."""
    by_name = {p: p.replace("past_key_values", "present") for p in pasts}
    if all(present in outputs for present in by_name.values()):
        return by_name
    presents = [o for o in outputs if "present" in o]
    if len(presents) != len(pasts):
        raise ConfigError(f"the original {path} has {len(pasts)} past inputs but {len(presents)} present outputs; "
                          "pass an export whose every past input has its present output.")
    return dict(zip(pasts, presents))
