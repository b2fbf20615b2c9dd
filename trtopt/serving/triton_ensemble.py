"""Triton Python-backend model with TensorRT-LLM's "ensemble" shapes (copied as `<repo>/ensemble/1/model.py`).

TensorRT-LLM's ensemble and tensorrt_llm_bls models batch in Triton (max_batch_size > 0), so their clients send
every input with a batch dimension (text_input [1, 1], max_tokens [1, 1]); the trtopt model keeps
max_batch_size 0 (vLLM's shapes: text_input [1]) because it batches continuously inside its engine. This model
takes the batched shapes, drops the batch dimension and forwards each request to the trtopt model through
Triton's BLS API, streaming its responses back in TensorRT-LLM's output shapes (see _batched). It holds no engine: the
inputs are translated once, by the trtopt model (trtopt.serving.triton_request).

A request carries one prompt (batch 1): concurrent requests are what the trtopt model batches.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.target = config["parameters"]["target_model"]["string_value"]
        self.input_names = [t["name"] for t in config["input"]]
        self.output_names = [t["name"] for t in config["output"]]

    def execute(self, requests: list) -> None:
        """Decoupled: each request is forwarded on its own thread, so a long generation never holds up the next."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                forwarded = self._unbatched(request)
            except ValueError as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=_FINAL)
                continue
            threading.Thread(target=self._relay, args=(forwarded, sender), daemon=True).start()
        return None

    def _unbatched(self, request: Any) -> Any:
        tensors = []
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            array = tensor.as_numpy()
            if array.shape[0] != 1:
                raise ValueError(f"{name} has batch size {array.shape[0]}; send one prompt per request (batch 1): "
                                 f"the model batches concurrent requests itself.")
            tensors.append(pb_utils.Tensor(name, array[0]))
        return pb_utils.InferenceRequest(model_name=self.target, inputs=tensors,
                                         requested_output_names=self.output_names)

    def _relay(self, forwarded: Any, sender: Any) -> None:
        try:
            responses = forwarded.exec(decoupled=True)
            for response in responses:
                if sender.is_cancelled():  # the client went away: stop the generation too
                    getattr(responses, "cancel", lambda: None)()
                    break
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()), flags=_FINAL)
                    return
                outputs = [_batched(t) for t in response.output_tensors()]
                if outputs:  # the final flag may come alone
                    sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
        except Exception as e:  # noqa: BLE001 - answer the client whatever went wrong, then end its stream
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"forwarding to {self.target} failed: {e}")),
                        flags=_FINAL)
            return
        sender.send(flags=_FINAL)


def _batched(tensor: Any) -> Any:
    """TensorRT-LLM's shapes for a batch-1 response: numbers get the batch dimension ([1, n], [1, n, tokens]);
    text stays flat, one row per completion ([n]), as its postprocessing model sends it, so clients written for it
    (`result.as_numpy("text_output")[0].decode()`) work unchanged."""
    array = tensor.as_numpy()
    return pb_utils.Tensor(tensor.name(), array if array.dtype == np.object_ else np.expand_dims(array, 0))
