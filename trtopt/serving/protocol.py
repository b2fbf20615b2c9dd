"""OpenAI wire format: request bodies (pydantic, types only) and their mapping onto SamplingParams.

Range checks live in SamplingParams and the InputProcessor (one place, one message per field); pydantic here
only checks types, so a bad value reaches the user as the same RequestError text whether it came over HTTP or
from Python. Types are strict: `"8"` is not an int and `"yes"` is not a bool (a client that sends them has a bug
it should hear about), and floats must be finite (JSON's NaN/Infinity extensions are refused). The one leniency is
vLLM's: a boolean field also takes the strings "true" and "false" (any case), which clients written in loosely typed
languages send.
The field names follow the OpenAI API plus vLLM's extras (top_k, min_p, repetition_penalty, ...). Unknown
fields are accepted and ignored, as vLLM and the OpenAI API do for forward compatibility; the server logs a
warning the first time it sees each unknown field name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from trtopt.errors import RequestError
from trtopt.runtime.beam_search import BeamSearchParams
from trtopt.runtime.input_processor import ChatPrompt
from trtopt.runtime.sampling_params import ALL_LOGPROBS, SEED_LIMIT, SamplingParams, StructuredOutputsParams
from trtopt.serving.structured import ToolCallPlan, structured_outputs_of, tool_call_plan


_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def _string_bool(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value  # anything else meets the strict bool check


# A JSON boolean, or the string "true"/"false" (vLLM's pydantic models coerce these; trtopt takes no other spelling).
Bool = Annotated[bool, BeforeValidator(_string_bool)]

_INT64_MIN = -(2**63)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are kept in model_extra (the server warns once per name) and otherwise ignored.
    model_config = ConfigDict(**_STRICT, extra="allow")

    model: str | None = None  # vLLM's: left out means the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None  # any int64, as vLLM takes (see _seed)
    stream: Bool = False
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
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's beam search: n beams, the n best returned (runtime/beam_search.py); length_penalty ranks the finished ones.
    use_beam_search: Bool = False
    length_penalty: float = 1.0
    # vLLM's token-id outputs: prompt_token_ids and each choice's token_ids; logprob tokens as "token_id:N"
    # (None: the server's --return-tokens-as-token-ids).
    return_token_ids: Bool | None = None
    return_tokens_as_token_ids: Bool | None = None
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
            seed=_seed(self.seed),
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

    def _beam_search_params(self, max_tokens: int | None, refused: dict[str, bool]) -> BeamSearchParams:
        """vLLM's to_beam_search_params: n is the beam width. A field that would change a sampled reply but that
        beam search does not apply (it ranks the model's raw logprobs) is refused, where vLLM ignores it;
        temperature, top_p, top_k, min_p and seed change nothing (vLLM's too)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.")
        refused = {"stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids),
                   "min_tokens": self.min_tokens > 0, "logit_bias": bool(self.logit_bias),
                   "bad_words": bool(self.bad_words),
                   "allowed_token_ids": self.allowed_token_ids is not None,
                   "repetition_penalty": self.repetition_penalty not in (None, 1),
                   "presence_penalty": self.presence_penalty not in (None, 0),
                   "frequency_penalty": self.frequency_penalty not in (None, 0),
                   "structured output (response_format, structured_outputs, guided_*)":
                       self._structured() is not None,
                   **refused}
        name = next((name for name, on in refused.items() if on), None)
        if name is not None:
            raise RequestError(f"{name} does not apply to beam search, which ranks the model's raw logprobs; drop it, "
                               "or set use_beam_search to false.")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                skip_special_tokens=self.skip_special_tokens)

    def prepare_params(self, max_tokens: int | None) -> SamplingParams:
        """What a beam search's prompt is prepared with: the output budget and prompt truncation (the rest of the
        search has its own params)."""
        return SamplingParams(max_tokens=max_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens)

    def usage_options(self, force: bool = False) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk) of a stream, by vLLM's rule: --enable-force-include-usage
        (`force`) turns both on; else stream_options.include_usage, and continuous_usage_stats with it."""
        if force:
            return True, True
        include = bool(self.stream_options and self.stream_options.include_usage)
        return include, include and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy completions API
    logprobs: int | None = None  # top alternatives per token (0..--max-logprobs); None = no logprobs
    echo: Bool = False  # the prompt text is prepended to each choice (and its logprobs, when logprobs is set)
    suffix: str | None = None
    best_of: int | None = None  # best_of >= n completions are generated; the n of highest cumulative logprob return
    # vLLM's extra: each choice carries the prompt's logprobs (top-k per token; -1: the whole vocabulary)
    prompt_logprobs: int | None = None

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
        if self.logprobs is not None and self.logprobs < 0:  # vLLM's rule and message: no -1 here
            raise RequestError("`logprobs` must be a positive value.")
        _check_prompt_logprobs(self.prompt_logprobs)
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


    def to_beam_search_params(self) -> BeamSearchParams:
        """use_beam_search (vLLM's rules and message: not streamed)."""
        if self.stream:
            raise RequestError("Streaming is not currently supported with beam search")
        if self.suffix:
            raise RequestError("suffix (insertion) is not supported by trtopt; remove it from the request.")
        if self.logprobs is not None and self.logprobs < 0:
            raise RequestError("`logprobs` must be a positive value.")
        return self._beam_search_params(self.max_tokens, {"prompt_logprobs": self.prompt_logprobs is not None,
                                                          "best_of": self.best_of not in (None, self.n)})


class ContentPart(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="allow")

    type: str
    text: str | None = None


# Any role string reaches the chat template, as in vLLM (its CustomChatCompletionMessageParam): OpenAI's system, user,
# assistant, tool and developer, or a template's own ("ipython", "my-custom-role"). The template decides what it means.
ChatRole = str


class ChatMessage(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="allow")  # name, tool_call_id... are passed through to the template

    role: ChatRole
    # Required, except on an assistant message that made tool calls (OpenAI sends `content: null` there): any other
    # message without content is a client bug, not "".
    content: Union[str, list[ContentPart], None] = None
    # An earlier reply's calls, sent back in a tool loop: OpenAI's shape, `arguments` a JSON string (the template
    # gets it parsed, as vLLM does: Hermes/Llama/Qwen templates render the arguments as a mapping).
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        for i, call in enumerate(self.tool_calls or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"tool_calls[{i}] needs {{'type': 'function', 'function': {{'name': ..., "
                                 "'arguments': ...}}")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except ValueError:
                    raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string") from None
            elif not isinstance(arguments, dict):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string")
        return self


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: int | None = None
    logprobs: Bool = False
    top_logprobs: int | None = None  # -1: the whole vocabulary (vLLM's; needs --max-logprobs of at least the vocab)
    # tool_choice "required" or a named function constrains the output to valid calls; "auto" needs the server's
    # --enable-auto-tool-choice (trtopt.serving.structured says why). The tools reach the chat template.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    # vLLM's chat extras. echo: the reply starts with the last message's content when that message has the reply's
    # role; continue_final_message: the last message is left open and the model continues it (not with
    # add_generation_prompt); chat_template: a Jinja template instead of the plan's (only with
    # --trust-request-chat-template); chat_template_kwargs: extra variables for the template.
    echo: Bool = False
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the prompt's logprobs (top-k per token) at the top of the response; not with stream (vLLM's rule:
    # a stream has nowhere to put them, so only 0 is taken there, and ignored).
    prompt_logprobs: int | None = None

    def template_messages(self) -> ChatPrompt:
        kwargs = dict(self.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None)  # vLLM takes the template from the kwargs too
        return ChatPrompt(_template_messages(self.messages), add_generation_prompt=self.add_generation_prompt,
                          continue_final_message=self.continue_final_message,
                          chat_template=self.chat_template if self.chat_template is not None else template,
                          chat_template_kwargs=kwargs, tools=self.tools)

    @property
    def response_role(self) -> str:
        """vLLM's: "assistant" after a generation prompt, else the role of the message being continued."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """What echo prepends to each reply: the last message's text if it has the reply's role, else ""."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role:
            return ""
        if last.content is None:
            return ""
        return last.content if isinstance(last.content, str) else "".join(p.text or "" for p in last.content)

    def tool_plan(self, *, auto_tool_choice: bool = False) -> ToolCallPlan | None:
        return tool_call_plan(self.tools, self.tool_choice, auto_tool_choice=auto_tool_choice)

    def to_sampling_params(self, *, auto_tool_choice: bool = False) -> SamplingParams:
        """auto_tool_choice: the server's --enable-auto-tool-choice (tool_choice "auto" generates freely)."""
        structured = self._structured()  # validated even when a forced tool call replaces it
        plan = self.tool_plan(auto_tool_choice=auto_tool_choice)
        if plan is not None:
            structured = plan.constraint  # vLLM's rule: a forced tool call overrides response_format and the rest
        self._check_top_logprobs()
        _check_prompt_logprobs(self.prompt_logprobs)
        logprobs = self.num_logprobs
        max_tokens = self.max_output_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.stream and prompt_logprobs is not None:
            if prompt_logprobs > 0 or prompt_logprobs == -1:
                raise RequestError("`prompt_logprobs` are not available when `stream=True`.")  # vLLM's message
            if prompt_logprobs == 0:  # a stream has nowhere to put them
                prompt_logprobs = None
        return self._common_params(max_tokens, logprobs, structured, prompt_logprobs=prompt_logprobs)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token in the reply's logprobs; None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_beam_search_params(self, *, auto_tool_choice: bool = False) -> BeamSearchParams:
        """use_beam_search (vLLM's: streamed too, the whole reply in one chunk per choice). A forced tool call, whose
        grammar beam search would not apply, is refused."""
        self._check_top_logprobs()
        forced = self.tool_plan(auto_tool_choice=auto_tool_choice) is not None
        return self._beam_search_params(self.max_output_tokens, {
            "a forced tool call (tool_choice)": forced, "prompt_logprobs": self.prompt_logprobs is not None,
            "top_logprobs=-1 (the whole vocabulary)": bool(self.logprobs and self.top_logprobs == ALL_LOGPROBS)})

    def _check_top_logprobs(self) -> None:
        if self.top_logprobs is not None and self.top_logprobs < ALL_LOGPROBS:  # vLLM's message
            raise RequestError("`top_logprobs` must be a positive value or -1.")
        if self.top_logprobs is not None and self.top_logprobs != 0 and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true; set both.")


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: content parts of type "text" joined into one string."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        d.setdefault("content", "")  # an assistant turn that only called tools
        if m.tool_calls:
            d["tool_calls"] = [_template_tool_call(call) for call in m.tool_calls]
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise RequestError("only text content parts are supported; send {'type': 'text', 'text': ...} parts.")
            d["content"] = "".join(part.text for part in m.content)
        out.append(d)
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as templates read it: the arguments a mapping (validated as JSON by ChatMessage)."""
    function = dict(call["function"])
    if isinstance(function.get("arguments", "{}"), str):
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return {**call, "type": call.get("type", "function"), "function": function}


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a text prompt, or chat messages rendered with the chat template and the
    generation prompt. The ids are exactly those a completion or chat request with this prompt would run on."""

    model_config = ConfigDict(**_STRICT, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    return_token_strs: Bool = False
    add_generation_prompt: Bool = True  # for messages, as in a chat request
    continue_final_message: Bool = False

    def engine_prompt(self) -> str | ChatPrompt:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send exactly one of 'prompt' (text) or 'messages' (chat) to /tokenize.")
        if self.prompt is not None:
            return self.prompt
        return ChatPrompt(_template_messages(self.messages), add_generation_prompt=self.add_generation_prompt,
                          continue_final_message=self.continue_final_message)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids -> {"prompt": text}."""

    model_config = ConfigDict(**_STRICT, extra="ignore")

    model: str | None = None
    tokens: list[int]


def _check_prompt_logprobs(prompt_logprobs: int | None) -> None:
    """vLLM's rule and message; the cap (--max-logprobs) is the engine's."""
    if prompt_logprobs is not None and prompt_logprobs < ALL_LOGPROBS:
        raise RequestError("`prompt_logprobs` must be a positive value or -1.")


def _seed(seed: int | None) -> int | None:
    """vLLM takes any int64 seed; trtopt's seeds are [0, 2**63): a negative seed maps to its low 63 bits
    (seed + 2**63), one to one. Outside int64 is a RequestError naming pydantic's error type as vLLM's 400 does
    (greater_than_equal / less_than_equal: clients and vLLM's test_long_seed match on it)."""
    if seed is not None and not _INT64_MIN <= seed < SEED_LIMIT:
        kind, bound = ("greater_than_equal", _INT64_MIN) if seed < _INT64_MIN else ("less_than_equal", SEED_LIMIT - 1)
        raise RequestError(f"seed={seed} is outside int64 ({kind} {bound}); send an integer in [-2**63, 2**63).")
    if seed is None or seed >= 0:
        return seed
    return seed + SEED_LIMIT


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

