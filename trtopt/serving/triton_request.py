"""The one translation of a Triton request's input tensors into a trtopt request (prompt, SamplingParams, options).

Two conventions that users already script against are accepted, so a client written for either works unchanged:

- the TensorRT-LLM backend's ensemble / tensorrt_llm_bls names: one tensor per option (text_input, max_tokens,
  num_return_sequences, beam_width (1 only), bad_words, stop_words, end_id, pad_id, top_k, top_p, temperature, repetition_penalty, presence_penalty,
  frequency_penalty, min_tokens, seed, return_log_probs, stream, exclude_input_in_output,
  guided_decoding_guide_type, guided_decoding_guide);
- the vLLM backend's single `sampling_parameters` input: JSON text of vLLM SamplingParams fields (numbers may be
  JSON strings, as the vLLM backend's samples send them), with its return_finish_reason, return_cumulative_logprob,
  return_logprobs, return_num_input_tokens and return_num_output_tokens flags.

INPUTS is the config.pbtxt contract (triton_repo.py writes it, triton_model.py reads through parse_request), so
names, dtypes and dims live in this module only. It imports neither Triton nor torch: `get(name)` hands it each
tensor as a numpy array (None when the client left the optional input out). Every bad value is a RequestError that
names the input and says what to send; the model answers it as a Triton error and keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import SamplingParams, StructuredOutputsParams


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    triton_type: str  # the config.pbtxt data_type
    dims: tuple[int, ...]  # without Triton's batch dimension
    optional: bool = True


# Dtypes and dims follow tensorrtllm_backend's all_models/inflight_batcher_llm/ensemble/config.pbtxt and the vLLM
# backend's auto-completed config. Only text_input is required: max_tokens defaults to SamplingParams' 16 (vLLM's
# default) for vLLM clients, which never send it.
INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=False),
    # TensorRT-LLM names
    TensorSpec("max_tokens", "TYPE_INT32", (1,)),
    TensorSpec("num_return_sequences", "TYPE_INT32", (1,)),
    TensorSpec("beam_width", "TYPE_INT32", (1,)),
    TensorSpec("bad_words", "TYPE_STRING", (-1,)),
    TensorSpec("stop_words", "TYPE_STRING", (-1,)),
    TensorSpec("end_id", "TYPE_INT32", (1,)),
    TensorSpec("pad_id", "TYPE_INT32", (1,)),
    TensorSpec("top_k", "TYPE_INT32", (1,)),
    TensorSpec("top_p", "TYPE_FP32", (1,)),
    TensorSpec("temperature", "TYPE_FP32", (1,)),
    TensorSpec("repetition_penalty", "TYPE_FP32", (1,)),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,)),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,)),
    TensorSpec("min_tokens", "TYPE_INT32", (1,)),
    TensorSpec("seed", "TYPE_UINT64", (1,)),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,)),
    TensorSpec("stream", "TYPE_BOOL", (1,)),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,)),
    TensorSpec("guided_decoding_guide_type", "TYPE_STRING", (1,)),
    TensorSpec("guided_decoding_guide", "TYPE_STRING", (1,)),
    # vLLM backend names
    TensorSpec("sampling_parameters", "TYPE_STRING", (1,)),
    TensorSpec("return_finish_reason", "TYPE_BOOL", (1,)),
    TensorSpec("return_cumulative_logprob", "TYPE_BOOL", (1,)),
    TensorSpec("return_logprobs", "TYPE_BOOL", (1,)),
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", (1,)),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", (1,)),
    # trtopt's own
    TensorSpec("ignore_eos", "TYPE_BOOL", (1,)),
)

# Responses carry text_output, finish_reason, num_input_tokens, num_output_tokens and step_batch_size always; the
# log-prob outputs only when asked for (TensorRT-LLM: return_log_probs; vLLM: return_cumulative_logprob and
# return_logprobs). One row per completion (n > 1 through sampling_parameters gives n rows).
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", (-1,)),  # "" while running, then "stop" | "length" | "abort"
    TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
    TensorSpec("num_output_tokens", "TYPE_UINT32", (-1,)),  # new tokens in this response
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,)),  # TensorRT-LLM
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1)),  # TensorRT-LLM: [completion, token] of this response
    TensorSpec("cumulative_logprob", "TYPE_FP32", (-1,)),  # vLLM
    TensorSpec("logprobs", "TYPE_STRING", (-1,)),  # vLLM: JSON [{token_id: {"logprob": x}}, ...] per completion
    TensorSpec("step_batch_size", "TYPE_INT32", (1,)),  # the most requests that advanced in one step with this one
)

# TensorRT-LLM's guided_decoding_guide_type -> StructuredOutputsParams field.
_GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}

# TensorRT-LLM tensor -> SamplingParams field.
_SCALAR_FIELDS = {
    "max_tokens": "max_tokens", "num_return_sequences": "n", "top_k": "top_k", "top_p": "top_p", "temperature": "temperature",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "min_tokens": "min_tokens", "seed": "seed", "ignore_eos": "ignore_eos",
}

_VLLM_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens")

_PARAM_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
# SamplingParams fields (and vLLM backend keys) that a Triton request cannot use, and why.
_NOT_OVER_TRITON = {
    "lora_name": "trtopt serves no LoRA adapters; leave it out.",
    "logits_processors": "logits processors are Python callables (LLM.generate only); leave it out.",
    "prompt_logprobs": "the Triton model has no prompt log-prob output; use `trtopt serve` (/v1/completions) for them.",
}
_PARAM_HINTS = typing.get_type_hints(SamplingParams)


@dataclasses.dataclass(frozen=True)
class TritonRequest:
    """One parsed Triton request."""

    prompt: str
    params: SamplingParams
    stream: bool
    include_prompt: bool  # a non-streaming text_output starts with the prompt (both backends' default)
    trtllm_log_probs: bool  # send cum_log_probs and output_log_probs
    vllm_cumulative_logprob: bool  # send cumulative_logprob
    vllm_logprobs: bool  # send logprobs (JSON)


def parse_request(get: Callable[[str], np.ndarray | None], eos_token_ids: tuple[int, ...] = ()) -> TritonRequest:
    """Translate the tensors of one request. get(name) returns an input as a numpy array, or None when absent.

    eos_token_ids: the model's end tokens, so that a TensorRT-LLM `end_id` naming one of them changes nothing and
    any other id replaces them (TensorRT-LLM's meaning). Raises RequestError for anything the client must fix.
    """
    prompt = _text(_scalar(get, "text_input"), "text_input")
    if prompt is None:
        raise RequestError("text_input is required: a BYTES tensor holding the prompt.")
    kwargs: dict[str, Any] = {}
    for tensor, field in _SCALAR_FIELDS.items():
        value = _scalar(get, tensor)
        if value is not None:
            kwargs[field] = _typed(field, value, tensor)
    stop = _strings(get, "stop_words")
    if stop:
        kwargs["stop"] = stop
    bad = _strings(get, "bad_words")
    if bad:
        kwargs["bad_words"] = bad
    end_id = _scalar(get, "end_id")
    if end_id is not None:
        end_id = _typed("stop_token_ids", end_id, "end_id", scalar_of=int)
        if end_id < 0:
            raise RequestError(f"end_id={end_id} is invalid: send a token id >= 0.")
        if end_id not in eos_token_ids:  # TensorRT-LLM's end_id replaces the model's EOS
            kwargs["ignore_eos"] = True
            kwargs["stop_token_ids"] = [end_id]
    beam_width = _scalar(get, "beam_width")
    if beam_width is not None and beam_width != 1:  # TensorRT-LLM clients send beam_width 1 by default
        raise RequestError(f"beam_width={beam_width}: the Triton model has no beam search (`trtopt serve` has, as "
                           "use_beam_search); send beam_width 1 (or leave it out) and num_return_sequences for several "
                           "samples.")
    pad_id = _scalar(get, "pad_id")
    if pad_id is not None and int(pad_id) < 0:  # pads TensorRT-LLM's output_ids; text outputs have no padding
        raise RequestError(f"pad_id={int(pad_id)} is invalid: send a token id >= 0.")
    guide = _guide(get)
    if guide is not None:
        kwargs["structured_outputs"] = guide
    trtllm_log_probs = bool(_scalar(get, "return_log_probs") or False)
    flags = {name: bool(_scalar(get, name) or False) for name in _VLLM_FLAGS}
    _merge(kwargs, _sampling_parameters(get))
    if (trtllm_log_probs or flags["return_cumulative_logprob"] or flags["return_logprobs"]) and kwargs.get("logprobs") is None:
        kwargs["logprobs"] = 0  # the chosen token's log-prob only
    stream = bool(_scalar(get, "stream") or False)
    exclude = _scalar(get, "exclude_input_in_output")
    params = _sampling_params(kwargs)
    return TritonRequest(prompt=prompt, params=params, stream=stream,
                         include_prompt=not stream and not bool(exclude if exclude is not None else False),
                         trtllm_log_probs=trtllm_log_probs, vllm_cumulative_logprob=flags["return_cumulative_logprob"],
                         vllm_logprobs=flags["return_logprobs"])


def _sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:  # a structurally wrong value that the field checks did not anticipate
        raise RequestError(f"invalid sampling parameters: {e}.") from None


def _sampling_parameters(get: Callable[[str], np.ndarray | None]) -> dict[str, Any]:
    """The vLLM backend's `sampling_parameters`: JSON text of vLLM SamplingParams fields."""
    raw = _text(_scalar(get, "sampling_parameters"), "sampling_parameters")
    if raw is None or not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"sampling_parameters is not valid JSON ({e}); send a JSON object such as "
                           '{"temperature": 0, "max_tokens": 32}.') from None
    if not isinstance(body, dict):
        raise RequestError(f"sampling_parameters must be a JSON object, got {type(body).__name__}.")
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("structured_outputs", "guided_decoding"):  # vLLM sends StructuredOutputsParams as JSON text
            out["structured_outputs"] = _structured(value, f"sampling_parameters.{key}")
        elif key in _NOT_OVER_TRITON:
            raise RequestError(f"sampling_parameters.{key}: {_NOT_OVER_TRITON[key]}")
        elif key == "logit_bias" and isinstance(value, dict):  # JSON object keys are strings: {"1234": -100}
            out[key] = {_token_id(k, "sampling_parameters.logit_bias"): v for k, v in value.items()}
        elif key in _PARAM_FIELDS and key != "structured_outputs":
            out[key] = value if value is None else _typed(key, value, f"sampling_parameters.{key}")
        else:
            known = sorted(k for k in _PARAM_FIELDS if k not in _NOT_OVER_TRITON)
            raise RequestError(f"sampling_parameters has the unknown key {key!r}; the keys are {known}.")
    return out


def _token_id(key: str, where: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise RequestError(f"{where} key {key!r} is not a token id; send {{\"<token id>\": <bias>}}.") from None


def _merge(kwargs: dict[str, Any], extra: dict[str, Any]) -> None:
    both = sorted(set(kwargs) & set(extra))
    if both:
        raise RequestError(f"{both} given both as input tensors and in sampling_parameters; send each once.")
    kwargs.update(extra)


def _guide(get: Callable[[str], np.ndarray | None]) -> StructuredOutputsParams | None:
    kind = _text(_scalar(get, "guided_decoding_guide_type"), "guided_decoding_guide_type")
    guide = _text(_scalar(get, "guided_decoding_guide"), "guided_decoding_guide")
    if not kind:
        if guide:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type "
                               f"(one of {sorted(_GUIDE_TYPES)}).")
        return None
    if kind not in _GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type={kind!r} is not supported; use one of {sorted(_GUIDE_TYPES)}.")
    field = _GUIDE_TYPES[kind]
    if field == "json_object":
        return StructuredOutputsParams(json_object=True)
    if not guide:
        raise RequestError(f"guided_decoding_guide_type={kind!r} needs guided_decoding_guide (the {field} text).")
    return StructuredOutputsParams(**{field: guide})


def _structured(value: Any, where: str) -> StructuredOutputsParams:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RequestError(f"{where} is not valid JSON ({e}).") from None
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be an object such as {{\"regex\": \"[0-9]+\"}}.")
    names = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise RequestError(f"{where} has unknown keys {unknown}; the keys are {sorted(names)}.")
    return StructuredOutputsParams(**value)


def _typed(field: str, value: Any, where: str, scalar_of: type | None = None) -> Any:
    """Coerce to the SamplingParams field's type: numpy scalars to Python, and (as the vLLM backend does) number
    strings to numbers. Containers (stop, stop_token_ids, ...) pass through to SamplingParams' own checks."""
    target = scalar_of or _field_type(field)
    if target is None:
        return value
    try:
        if target is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                return value.lower() == "true"
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(value)
            return bool(value)
        if isinstance(value, (bool, np.bool_)):
            raise ValueError(value)
        if target is int:
            if isinstance(value, (float, np.floating)) and not float(value).is_integer():
                raise ValueError(value)
            return int(value)
        return float(value)
    except (TypeError, ValueError, OverflowError):
        expected = {bool: "true or false", int: "an integer", float: "a number"}[target]
        raise RequestError(f"{where}={value!r} is invalid: send {expected}.") from None


def _field_type(field: str) -> type | None:
    """int, float or bool for the scalar SamplingParams fields (`int | None` included); None for the rest."""
    hint = _PARAM_HINTS.get(field)
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    args = [a for a in (typing.get_args(hint) if union else (hint,)) if a is not type(None)]
    return args[0] if len(args) == 1 and args[0] in (bool, int, float) else None


def _scalar(get: Callable[[str], np.ndarray | None], name: str) -> Any:
    array = get(name)
    if array is None:
        return None
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got {values.size}.")
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value


def _strings(get: Callable[[str], np.ndarray | None], name: str) -> list[str]:
    """A list-of-strings input; empty strings are dropped (TensorRT-LLM clients send "" for none)."""
    array = get(name)
    if array is None:
        return []
    texts = [_text(v, name) for v in np.asarray(array).reshape(-1)]
    return [t for t in texts if t]


def _text(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text.") from None
