"""An exported causal LM (optimum-style past KV I/O) on onnxruntime CPU: one sequence at a time, batch 1.

Calibration reads intermediate tensors through it (extra graph outputs); the accuracy benchmark reads logits and
decodes greedily. Empty past (length 0) for a fresh sequence; each step feeds ``position_ids`` and an all-ones
``attention_mask`` when the graph has them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from trtopt.errors import QuantizeError
from trtopt.signature import INPUT_IDS, LOGITS, POSITION_IDS

_MASK = "attention_mask"
_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
# ORT's QDQ fusions compute something else than the graph says: DQ(int4) -> MatMul becomes MatMulNBits, whose default
# accuracy level 4 quantizes the activations to int8, and ORT 1.30 fuses FP8 Q/DQ -> MatMul into an invalid
# MatMulIntegerToFloat. With them off, DQ runs as written and the MatMul in fp32: ORT measures the Q/DQ graph's
# meaning, which is what TensorRT must match. (Level 1 = fp32 in case a MatMulNBits fusion still happens.)
_ORT_CONFIG = {"session.disable_quant_qdq": "1", "session.qdq_matmulnbits_accuracy_level": "1"}


def session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    for key, value in _ORT_CONFIG.items():
        options.add_session_config_entry(key, value)
    return options


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also returns the intermediate tensors ``names`` (typed as the float dtype)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    have = {o.name for o in copy.graph.output}
    elem = next(i.type.tensor_type.elem_type for i in copy.graph.input if "past" in i.name)
    for name in names:
        if name not in have:
            copy.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return copy


class OrtCausalLM:
    """An exported model (path or in-memory proto under 2 GB) on ORT CPU."""

    def __init__(self, model: Path | onnx.ModelProto, *, threads: int = 2):
        source = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
        try:
            self.session = ort.InferenceSession(source, session_options(threads), providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own types (Fail, InvalidGraph, NotImplemented...)
            raise QuantizeError(f"onnxruntime cannot load the model: {str(e).splitlines()[0][:300]}; pass an "
                                "export from `trtopt export`.") from e
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.past_names = [n for n in inputs if "past" in n]
        if INPUT_IDS.name not in inputs or LOGITS.name not in self.outputs or not self.past_names:
            raise QuantizeError("the model has no input_ids input, logits output or past KV inputs; pass a causal-LM "
                                "export from `trtopt export`.")
        unknown = sorted(set(inputs) - {INPUT_IDS.name, POSITION_IDS.name, _MASK, *self.past_names})
        if unknown:
            raise QuantizeError(f"the model has inputs the calibration cannot feed: {unknown}.")
        self.present_of = self._presents()
        self.feeds_positions = POSITION_IDS.name in inputs
        self.feeds_mask = _MASK in inputs
        self.empty = {}
        for name in self.past_names:
            spec = inputs[name]
            dims = spec.shape
            if len(dims) != 4 or not all(isinstance(d, int) for d in (dims[1], dims[3])):
                raise QuantizeError(f"past input {name} has shape {dims}; expected [batch, kv_heads, past, head_dim].")
            self.empty[name] = np.zeros((1, dims[1], 0, dims[3]), _FLOATS.get(spec.type, np.float32))

    def _presents(self) -> dict[str, str]:
        by_name = {p: p.replace("past_key_values", "present") for p in self.past_names}
        if all(v in self.outputs for v in by_name.values()):
            return by_name
        presents = [o for o in self.outputs if "present" in o]
        assert len(presents) == len(self.past_names), "every past input needs its present output"
        return dict(zip(self.past_names, presents))

    def run(self, tokens: Sequence[int], *, past: dict[str, np.ndarray] | None = None, start: int = 0,
            outputs: Sequence[str] = (LOGITS.name,)) -> dict[str, np.ndarray]:
        """One step of ``tokens`` at positions start.. on ``past`` (empty when None); returns ``outputs`` by name."""
        n = len(tokens)
        feeds = {INPUT_IDS.name: np.asarray(tokens, np.int64)[None], **(past or self.empty)}
        if self.feeds_positions:
            feeds[POSITION_IDS.name] = np.arange(start, start + n, dtype=np.int64)[None]
        if self.feeds_mask:
            feeds[_MASK] = np.ones((1, start + n), np.int64)
        return dict(zip(outputs, self.session.run(list(outputs), feeds)))

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, *, eos: int | None = None) -> list[int]:
        """Greedy decoding with the KV cache: the new token ids (stops after ``eos``)."""
        names = [LOGITS.name, *self.present_of.values()]
        out = self.run(prompt, outputs=names)
        start, new = len(prompt), []
        while True:
            token = int(np.argmax(out[LOGITS.name].reshape(-1, out[LOGITS.name].shape[-1])[-1]))
            new.append(token)
            if len(new) == max_new_tokens or token == eos:
                return new
            past = {p: out[self.present_of[p]] for p in self.past_names}
            out = self.run([token], past=past, start=start, outputs=names)
            start += 1
