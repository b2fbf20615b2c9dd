"""Triton Inference Server Python-backend model for a trtopt plan (copied as `<repo>/<name>/1/model.py`).

It runs inside Triton's Python stub, which provides `triton_python_backend_utils`; nothing else imports it.
The model is decoupled: execute() only queues requests on the instance's EngineLoop and returns at once, and
the loop's step thread sends each request's responses, so concurrent requests share every engine step
(continuous batching) instead of being served one at a time.

Inputs and outputs: trtopt.serving.triton_request (INPUTS, OUTPUTS), which also translates them: the TensorRT-LLM
backend's ensemble names and the vLLM backend's `sampling_parameters` both work. A streaming response holds the text
new since the previous one; a non-streaming one the whole text, led by the prompt unless exclude_input_in_output.
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

from trtopt.errors import TrtOptError
from trtopt.runtime.batch import RequestOutput
from trtopt.runtime.engine import LLMEngine
from trtopt.serving.engine_loop import EngineLoop
from trtopt.serving.triton_request import TritonRequest, parse_request

log = logging.getLogger("trtopt.triton")

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Reply:
    """Sends the responses of one Triton request; called by the EngineLoop on the step thread.

    Streaming sends each step's new text (never the prompt); otherwise one response at the end. Counts and
    log-probs in a response cover the tokens new since the previous response of this request.
    """

    def __init__(self, request_id: str, sender: Any, request: TritonRequest, loop: EngineLoop) -> None:
        self.request_id = request_id
        self.sender = sender
        self.request = request
        self.loop = loop
        self.step_batch_size = 0  # most requests that advanced together in one step with this one
        self.sent_tokens: dict[int, int] = {}  # completion index -> tokens already covered by a response

    def __call__(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            _send_error(self.sender, item)
            return
        if self.sender.is_cancelled():  # the client went away (gRPC stream cancelled, HTTP closed)
            self.loop.abort(self.request_id)
            self.sender.send(flags=_FINAL)
            return
        self.step_batch_size = max(self.step_batch_size, self.loop.last_step_requests)
        if self.request.stream:
            if item.finished or any(c.delta_text for c in item.outputs):
                self._send(item, [c.delta_text for c in item.outputs])
        elif item.finished:
            prefix = (item.prompt or "") if self.request.include_prompt else ""
            self._send(item, [prefix + c.text for c in item.outputs])

    def _send(self, item: RequestOutput, texts: list[str]) -> None:
        new = [c.token_ids[self.sent_tokens.get(c.index, 0):] for c in item.outputs]
        new_logprobs = [(c.logprobs or [])[self.sent_tokens.get(c.index, 0):] for c in item.outputs]
        for c in item.outputs:
            self.sent_tokens[c.index] = len(c.token_ids)
        outputs = [
            _tensor("text_output", [t.encode("utf-8") for t in texts], np.object_),
            _tensor("finish_reason", [(c.finish_reason or "").encode() for c in item.outputs], np.object_),
            _tensor("num_input_tokens", [len(item.prompt_token_ids)], np.uint32),
            _tensor("num_output_tokens", [len(ids) for ids in new], np.uint32),
            _tensor("step_batch_size", [self.step_batch_size], np.int32),
        ]
        chosen = [[lp[t] for t, lp in zip(ids, lps)] for ids, lps in zip(new, new_logprobs)]
        if self.request.trtllm_log_probs:
            width = max((len(row) for row in chosen), default=0)
            rows = [row + [0.0] * (width - len(row)) for row in chosen]  # rectangular: [completion, token]
            outputs.append(_tensor("output_log_probs", rows, np.float32, shape=(len(rows), width)))
            outputs.append(_tensor("cum_log_probs", [c.cumulative_logprob or 0.0 for c in item.outputs], np.float32))
        if self.request.vllm_cumulative_logprob:
            outputs.append(_tensor("cumulative_logprob", [c.cumulative_logprob or 0.0 for c in item.outputs], np.float32))
        if self.request.vllm_logprobs:
            rows = [json.dumps([{str(t): {"logprob": x}} for t, x in zip(ids, row)]).encode() for ids, row in zip(new, chosen)]
            outputs.append(_tensor("logprobs", rows, np.object_))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=_FINAL if item.finished else 0)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / args["model_version"]
        plan_dir = version_dir / params["plan_dir"]  # an absolute plan_dir stays absolute
        device = f"cuda:{args['model_instance_device_id']}" if args["model_instance_kind"] == "GPU" else "cpu"
        engine_config: dict[str, Any] = {k: int(params[k]) for k in ("max_num_batched_tokens", "max_num_seqs",
                                                                     "max_model_len", "num_blocks") if params.get(k)}
        if params.get("speculative_config"):  # JSON text, passed through as `trtopt serve --speculative-config`
            engine_config["speculative_config"] = params["speculative_config"]
        engine = LLMEngine.from_plan(plan_dir, backend=params.get("backend", "torch"), device=device, **engine_config)
        gc.collect()  # start-up objects live as long as the model: keep them out of every later collection
        gc.freeze()
        self.loop = EngineLoop(engine)
        self.loop.start()
        self.ids = itertools.count()
        self.instance = args["model_instance_name"]
        log.info("trtopt model %s loaded %s on %s", self.instance, plan_dir, device)

    def execute(self, requests: list) -> None:
        """Prepare every request here, then queue it on the step loop and return (decoupled: responses come from
        the loop). EngineLoop.prepare tokenizes (its byte cap checked first) and compiles a structured-output
        grammar on this (Triton's) thread, so neither a huge prompt nor a grammar stalls the step thread that every
        running request needs."""
        for request in requests:
            sender = request.get_response_sender()
            request_id = f"{self.instance}-{next(self.ids)}"
            try:
                parsed = parse_request(functools.partial(_input, request), self.loop.eos_token_ids)
                prepared = self.loop.prepare(parsed.prompt, parsed.params)
            except TrtOptError as e:  # a bad request answers with its own error; the others go on
                _send_error(sender, e)
                continue
            reply = _Reply(request_id, sender, parsed, self.loop)
            queued = self.loop.submit(request_id, prepared, reply)
            queued.add_done_callback(functools.partial(_answer_rejected, sender))
        return None

    def finalize(self) -> None:
        # Bounded (README: <= 5 s): the step thread aborts what is in flight and answers every sender itself.
        self.loop.stop(timeout=4.0)


def _answer_rejected(sender: Any, queued: Any) -> None:
    """A request the engine refused when the step thread added it (or a stopped loop): answer from there."""
    if queued.exception() is not None:
        _send_error(sender, queued.exception())


def _send_error(sender: Any, error: BaseException) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=_FINAL)


def _input(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _tensor(name: str, values: list, dtype: Any, shape: tuple[int, ...] | None = None) -> Any:
    array = np.array(values, dtype=dtype)
    return pb_utils.Tensor(name, array if shape is None else array.reshape(shape))
