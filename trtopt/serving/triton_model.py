"""Triton Inference Server Python-backend model for a trtopt plan (copied as `<repo>/<name>/1/model.py`).

It runs inside Triton's Python stub, which provides `triton_python_backend_utils`; nothing else imports it.
The model is decoupled: execute() only queues requests on the instance's EngineLoop and returns at once, and
the loop's step thread sends each request's responses, so concurrent requests share every engine step
(continuous batching) instead of being served one at a time.

Inputs:  text_input BYTES [1]; max_tokens INT32 [1]; optional temperature FP32 [1], top_p FP32 [1],
         stop_words BYTES [-1], stream BOOL [1], ignore_eos BOOL [1], seed INT64 [1].
Outputs: text_output BYTES [1] (the new text when streaming, the whole completion otherwise);
         step_batch_size INT32 [1] (the most requests that advanced together in one step while this one ran).
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from trtopt.errors import RequestError, TrtOptError
from trtopt.runtime.batch import RequestOutput
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.engine_loop import EngineLoop

log = logging.getLogger("trtopt.triton")

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Reply:
    """Sends the responses of one Triton request; called by the EngineLoop on the step thread."""

    def __init__(self, request_id: str, sender: Any, stream: bool, loop: EngineLoop) -> None:
        self.request_id = request_id
        self.sender = sender
        self.stream = stream
        self.loop = loop
        self.step_batch_size = 0  # most requests that advanced together in one step with this one

    def __call__(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            _send_error(self.sender, item)
            return
        if self.sender.is_cancelled():  # the client went away (gRPC stream cancelled, HTTP closed)
            self.loop.abort(self.request_id)
            self.sender.send(flags=_FINAL)
            return
        self.step_batch_size = max(self.step_batch_size, self.loop.last_step_requests)
        c = item.outputs[0]
        if self.stream and (c.delta_text or item.finished):
            self._send(c.delta_text, final=item.finished)
        elif not self.stream and item.finished:
            self._send(c.text, final=True)

    def _send(self, text: str, *, final: bool) -> None:
        outputs = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("step_batch_size", np.array([self.step_batch_size], dtype=np.int32)),
        ]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=_FINAL if final else 0)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / args["model_version"]
        plan_dir = version_dir / params["plan_dir"]  # an absolute plan_dir stays absolute
        device = f"cuda:{args['model_instance_device_id']}" if args["model_instance_kind"] == "GPU" else "cpu"
        limits = {k: int(params[k]) for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_blocks")
                  if params.get(k)}
        # speculative_config: the engine's JSON text, written by `trtopt triton-repo --speculative-config`.
        engine = LLMEngine.from_plan(plan_dir, backend=params.get("backend", "torch"), device=device,
                                     speculative_config=params.get("speculative_config") or None, **limits)
        gc.collect()  # start-up objects live as long as the model: keep them out of every later collection
        gc.freeze()
        self.loop = EngineLoop(engine)
        self.loop.start()
        self.ids = itertools.count()
        self.instance = args["model_instance_name"]
        log.info("trtopt model %s loaded %s on %s", self.instance, plan_dir, device)

    def execute(self, requests: list) -> None:
        """Prepare every request here, then queue it on the step loop and return (decoupled: responses come from
        the loop). Tokenizing runs on this (Triton's) thread through the engine's InputProcessor, with its byte
        cap checked first, so a huge prompt never stalls the step thread that every running request needs."""
        processor = self.loop.engine.input_processor  # stateless: safe to use off the step thread
        for request in requests:
            sender = request.get_response_sender()
            request_id = f"{self.instance}-{next(self.ids)}"
            try:
                text, params, stream = _parse(request)
                prompt = processor.process(text, params)
            except TrtOptError as e:  # a bad request answers with its own error; the others go on
                _send_error(sender, e)
                continue
            reply = _Reply(request_id, sender, stream, self.loop)
            queued = self.loop.submit(request_id, prompt, params, reply)
            queued.add_done_callback(functools.partial(_answer_rejected, sender))
        return None

    def finalize(self) -> None:
        # Bounded (README: <= 5 s): the step thread aborts what is in flight and answers every sender itself.
        self.loop.stop(timeout=4.0)


def _answer_rejected(sender: Any, queued: Any) -> None:
    """An invalid prompt (too long, out of vocabulary) is found when the step thread adds it: answer from there."""
    if queued.exception() is not None:
        _send_error(sender, queued.exception())


def _send_error(sender: Any, error: BaseException) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=_FINAL)


def _parse(request: Any) -> tuple[str, SamplingParams, bool]:
    text = _scalar(request, "text_input")
    if text is None:
        raise _bad("text_input is required (a BYTES tensor holding the prompt).")
    stop = pb_utils.get_input_tensor_by_name(request, "stop_words")
    stop_words = [_text(s, "stop_words") for s in stop.as_numpy().reshape(-1)] if stop else []
    kwargs: dict[str, Any] = {"stop": [s for s in stop_words if s]}
    for name, cast in (("max_tokens", int), ("temperature", float), ("top_p", float), ("seed", int), ("ignore_eos", bool)):
        value = _scalar(request, name)
        if value is not None:
            kwargs[name] = cast(value)
    if "max_tokens" not in kwargs:
        raise _bad("max_tokens is required (an INT32 tensor).")
    stream = bool(_scalar(request, "stream") or False)
    return _text(text, "text_input"), SamplingParams(**kwargs), stream


def _text(value: Any, name: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text.") from None


def _scalar(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise _bad(f"{name} must hold exactly one value, got {values.size}.")
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value


def _bad(message: str) -> RequestError:
    return RequestError(message)
