"""OpenAI wire format: request bodies (pydantic, types only) and their mapping onto SamplingParams.

Range checks live in SamplingParams and the InputProcessor (one place, one message per field); pydantic here
only checks types, so a bad value reaches the user as the same RequestError text whether it came over HTTP or
from Python. Types are strict: JSON `"yes"` is not a bool and `"8"` is not an int (a client that sends them has
a bug it should hear about), and floats must be finite (JSON's NaN/Infinity extensions are refused).
The field names follow the OpenAI API plus vLLM's extras (top_k, min_p, repetition_penalty, ...). Unknown
fields are accepted and ignored, as vLLM and the OpenAI API do for forward compatibility; the server logs a
warning the first time it sees each unknown field name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from trtopt.serving.structured import ToolCallPlan, structured_outputs_of, tool_call_plan


_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are kept in model_extra (the server warns once per name) and otherwise ignored.
    model_config = ConfigDict(**_STRICT, extra="allow")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # Structured output (trtopt.serving.structured): OpenAI's response_format, vLLM's structured_outputs object
    # and its older guided_* spellings; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _structured(self) -> StructuredOutputsParams | None:
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        return structured_outputs_of(self.response_format, self.structured_outputs, guided)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids as decimal strings -> bias (the range is SamplingParams')."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise RequestError(f"logit_bias key {key!r} is not a token id; the keys are token ids as strings, "
                                   'e.g. {"50256": -100}.')
            out[int(key)] = bias
        return out

    def _common_params(self, max_tokens: int | None, logprobs: int | None,
                       structured: StructuredOutputsParams | None = None, **extra: Any) -> SamplingParams:
        if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's rule and message
            raise RequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.")
        given = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
        }
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=_stop_list(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured,
            logit_bias=self._logit_bias(),
            bad_words=tuple(self.bad_words or ()),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **extra,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy completions API
    logprobs: int | None = None  # top alternatives per token (0..20); None = no logprobs
    echo: bool = False  # the prompt text is prepended to each choice (and its logprobs, when logprobs is set)
    suffix: str | None = None
    best_of: int | None = None  # best_of >= n completions are generated; the n of highest cumulative logprob return
    prompt_logprobs: int | None = None  # vLLM's extra: each choice carries the prompt's logprobs (top-k per token)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each text or token ids (a list of them is a batch: n choices per prompt)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else [p]
        if isinstance(p, list) and any(isinstance(x, (str, list)) for x in p) and len(batch) != len(p):
            raise RequestError("prompt must be text, a list of texts, token ids, or a list of token-id lists; not a mix.")
        for one in batch:
            if not one:
                raise RequestError("a prompt is empty; send at least one token.")
        return batch

    @property
    def num_generated(self) -> int:
        """Completions generated per prompt: best_of when it is set, else n."""
        return self.best_of if self.best_of is not None else self.n

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise RequestError("suffix (insertion) is not supported by trtopt; remove it from the request.")
        logprobs = self.logprobs
        if self.best_of is not None:
            if not (isinstance(self.best_of, int) and self.n <= self.best_of):
                raise RequestError(f"best_of={self.best_of} must be an integer >= n ({self.n}).")
            if self.stream and self.best_of > self.n:
                raise RequestError("best_of > n cannot be streamed (the best completions are known only at the end); "
                                   "set stream=false or best_of=n.")
            if self.best_of > self.n and logprobs is None:
                logprobs = 0  # the ranking needs each token's logprob; the renderer drops them again
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # vLLM: echo with logprobs returns the prompt's logprobs too
        params = self._common_params(self.max_tokens, logprobs, self._structured(), prompt_logprobs=prompt_logprobs)
        return dataclasses.replace(params, n=self.num_generated) if self.num_generated != self.n else params


class ContentPart(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="allow")

    type: str
    text: str | None = None


ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="allow")  # name, tool_call_id... are passed through to the template

    role: ChatRole
    content: Union[str, list[ContentPart]]  # required: a message without content is a client bug, not ""


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # tool_choice "required" or a named function constrains the output to valid calls; "auto" is refused
    # (trtopt.serving.structured says why).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None

    def template_messages(self) -> list[dict[str, Any]]:
        return _template_messages(self.messages)

    def tool_plan(self) -> ToolCallPlan | None:
        return tool_call_plan(self.tools, self.tool_choice)

    def to_sampling_params(self) -> SamplingParams:
        structured = self._structured()
        plan = self.tool_plan()
        if plan is not None:
            if structured is not None:
                raise RequestError("tools with tool_choice constrain the output already; drop response_format/structured_outputs.")
            structured = plan.constraint
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true; set both.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._common_params(max_tokens, logprobs, structured)


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: content parts of type "text" joined into one string."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise RequestError("only text content parts are supported; send {'type': 'text', 'text': ...} parts.")
            d["content"] = "".join(part.text for part in m.content)
        out.append(d)
    return out


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a text prompt, or chat messages rendered with the chat template and the
    generation prompt. The ids are exactly those a completion or chat request with this prompt would run on."""

    model_config = ConfigDict(**_STRICT, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    return_token_strs: bool = False

    def engine_prompt(self) -> str | list[dict[str, Any]]:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send exactly one of 'prompt' (text) or 'messages' (chat) to /tokenize.")
        return self.prompt if self.prompt is not None else _template_messages(self.messages)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids -> {"prompt": text}."""

    model_config = ConfigDict(**_STRICT, extra="ignore")

    model: str | None = None
    tokens: list[int]


def _stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ---- responses -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """An OpenAI-style error: HTTP status plus the body fields."""

    status: int  # 400 bad request, 401 bad key, 404 unknown model/route, 413 body too large, 5xx ours
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

