"""InputProcessor: the one place where a prompt becomes token ids and a request is checked against the plan.

Every front end calls it: `LLMEngine.add_request` (for raw prompts), the HTTP server and the Triton model (both
on their own threads, before they submit to the step thread, so tokenizing never stalls an engine step). It is
stateless after construction (a tokenizer and the engine's limits), so any thread may call `process()`.

Prompt forms (vLLM's): text; chat messages (a list of {"role", "content", ...} dicts, rendered with the plan's chat
template and the generation prompt; a ChatPrompt carries them with vLLM's rendering options); token ids (a list of
ints or a 1-D tensor); {"prompt_token_ids": [...]} (with an optional "prompt" text that is only reported back); {"prompt": "..."}. A ProcessedPrompt passes through unchanged.

Rules, in the order they run (each failure is a RequestError that says what to change):
  - text (prompt, every string in chat messages) is at most `max_prompt_bytes` of UTF-8, checked before any
    tokenizing (the engine sets it to min(1 MiB, max_model_len x the longest token's bytes): see prompt_byte_cap), and is valid Unicode (a lone UTF-16 surrogate cannot be encoded and is refused);
  - BOS: text gets the tokenizer's special tokens unless it already starts with the BOS token (rendered chat
    usually does; a second BOS would change the prompt);
  - token ids are ints in [0, vocab); the prompt is not empty and leaves room for one output token;
  - params against the plan: n <= max_num_seqs, top_k <= vocab, stop_token_ids, allowed_token_ids and logit_bias
    keys < vocab; logprobs and prompt_logprobs <= max_logprobs (-1: the vocabulary), and at most
    MAX_LOGPROB_ENTRIES logprob entries in all (prompt tokens and max_tokens times the alternatives);
  - truncate_prompt_tokens=k keeps the last k prompt tokens (vLLM's left truncation; -1 = max_model_len - 1), before
    the length checks below, and the reported prompt text becomes the text of the kept tokens;
  - bad_words are tokenized here (vLLM's rule: each word as written, and with one leading space when that gives
    as many tokens and a different first token, so a word is banned both at the start and inside the text);
  - max_tokens: prompt + max_tokens must fit max_model_len, else the request is refused (vLLM's OpenAI server
    rule; silently cutting the answer short would look like a model failure). max_tokens=None means "up to
    max_model_len" and is resolved here, so ProcessedPrompt.max_tokens is always the real budget.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Sequence

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, check_text, num_logprobs

# Prompt text larger than this is refused before tokenizing, whatever the context. 1 MiB of UTF-8 is >= ~200k
# tokens for every tokenizer we ship; an 8 MB prompt would cost seconds of CPU for a request that cannot fit.
# The engine lowers it further per context (prompt_byte_cap).
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
# Logprob entries (tokens x alternatives) one request may ask for: whole-vocabulary logprobs (-1, allowed by a large
# --max-logprobs) of a ~80-token prompt for a 49k vocabulary, or ~27 tokens for a 152k one. Each entry costs ~100 B
# in the engine and ~300 B rendered as JSON.
MAX_LOGPROB_ENTRIES = 1 << 22



def prompt_byte_cap(tokenizer: Any, max_model_len: int, limit: int = DEFAULT_MAX_PROMPT_BYTES) -> int:
    """The prompt byte cap for a context: `limit`, or less when even max_model_len of the vocabulary's longest
    tokens are fewer bytes. Byte-level BPE and SentencePiece token strings are at least as long in UTF-8 as the
    text they stand for (a space is 'Ġ' or '▁'), so longer text cannot fit the context however it tokenizes,
    and refusing it before tokenizing costs nothing. (SmolLM2: longest token 162 bytes, so 83 KB at 512 tokens.)
    Measured why it matters: a 1 MiB prompt held Triton's execute() for ~3 s while it was tokenized."""
    if tokenizer is None:
        return limit
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=0)
    return min(limit, max_model_len * longest) if longest else limit


# A prompt: text, chat messages, token ids, {"prompt_token_ids": [...]} / {"prompt": "..."}, or a ProcessedPrompt.
PromptType = Any


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with vLLM's chat-template options (a plain list of messages is ChatPrompt(messages))."""

    messages: Sequence[dict]
    add_generation_prompt: bool = True  # the template's prompt for the reply (e.g. "<|im_start|>assistant\n")
    continue_final_message: bool = False  # the last message is left open, for the model to continue
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's (callers decide whether to trust)
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    tools: Sequence[dict] | None = None  # OpenAI tool definitions, for templates that describe them (vLLM passes them)

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:  # vLLM's message
            raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for LLMEngine.add_request: tokenized and checked against the engine's limits."""

    prompt: str | None  # the text that was tokenized (rendered chat included); None for token-id prompts
    prompt_token_ids: list[int]
    max_tokens: int  # output tokens this request may produce (params.max_tokens, or what the context leaves)
    # params.bad_words as token sequences (see the module docstring); the sampler bans a sequence's last token
    # wherever the output ends with the rest of it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class InputLimits:
    """The engine limits a request is checked against (LLMEngine's ResolvedLimits and plan, flattened)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_prompt_tokens_per_step: int | None = None  # set when chunked prefill is off: a prompt must fit one step
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # alternatives per token (EngineConfig.max_logprobs, -1 resolved)


class InputProcessor:
    def __init__(self, tokenizer: Any, limits: InputLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize `prompt` and check it and `params` against the limits. Raises RequestError."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}.")
        self.check_params(params)  # first: cheap, and n=10**7 or top_k=2**63 must cost nothing
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, token_ids = self.tokenize(prompt)
        text, token_ids = self._truncate(text, token_ids, params.truncate_prompt_tokens)
        self._check_tokens(token_ids)
        max_tokens = self._max_tokens(len(token_ids), params)
        self._check_logprob_volume(len(token_ids), max_tokens, params)
        return ProcessedPrompt(text, token_ids, max_tokens, self.bad_words_token_ids(params))

    def bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """params.bad_words as token-id sequences (vLLM's tokenization, see the module docstring)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise RequestError("bad_words needs the plan's tokenizer files; pass the banned ids as a logit_bias of -100 instead.")
        out: list[tuple[int, ...]] = []
        for word in params.bad_words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                out.append(spaced)
        bad = next((t for seq in out for t in seq if t >= self.limits.vocab_size), None)
        assert bad is None, f"the tokenizer gave id {bad} outside the plan's vocabulary"
        return tuple(out)

    def _truncate(self, text: str | None, token_ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """Keep the last `keep` tokens (-1: as many as the context allows with one output token)."""
        if keep is None:
            return text, token_ids
        keep = self.limits.max_model_len - 1 if keep == -1 else keep
        if len(token_ids) <= keep:
            return text, token_ids
        token_ids = token_ids[-keep:]
        return (self.tokenizer.decode(token_ids) if self.tokenizer is not None else None), token_ids

    def check_params(self, params: SamplingParams) -> None:
        """The params' bounds that depend on the plan (SamplingParams checks the rest on construction)."""
        lim = self.limits
        if params.n > lim.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds max_num_seqs={lim.max_num_seqs}; ask for fewer completions.")
        if params.top_k > lim.vocab_size:
            raise RequestError(f"top_k={params.top_k} exceeds the vocabulary size {lim.vocab_size}; use at most "
                               f"{lim.vocab_size}, or -1 for no top-k.")
        for what, k in (("sample logprobs", params.logprobs), ("prompt logprobs", params.prompt_logprobs)):
            if k is not None and num_logprobs(k, lim.vocab_size) > lim.max_logprobs:  # vLLM's message, then ours
                raise RequestError(f"Requested {what} of {num_logprobs(k, lim.vocab_size)}, which is greater than "
                                   f"max allowed: {lim.max_logprobs}; ask for fewer, or start the server with a "
                                   "larger --max-logprobs (-1: the whole vocabulary).")
        for what, ids in (("stop token id", params.stop_token_ids), ("allowed_token_ids id", params.allowed_token_ids or ()),
                          ("logit_bias token id", params.logit_bias or {})):
            bad = next((t for t in ids if t >= lim.vocab_size), None)
            if bad is not None:
                raise RequestError(f"{what} {bad} is outside the vocabulary [0, {lim.vocab_size}).")

    def _check_logprob_volume(self, num_prompt_tokens: int, max_tokens: int, params: SamplingParams) -> None:
        """Whole-vocabulary logprobs (a large max_logprobs) over a long prompt or output would hold gigabytes of
        (token, logprob) entries: at most MAX_LOGPROB_ENTRIES per request."""
        vocab = self.limits.vocab_size
        entries = 0
        if params.prompt_logprobs is not None:
            entries += (num_prompt_tokens - 1) * (num_logprobs(params.prompt_logprobs, vocab) + 1)
        if params.logprobs is not None:
            entries += max_tokens * params.n * (num_logprobs(params.logprobs, vocab) + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            raise RequestError(f"this request would return {entries} logprob entries (tokens x alternatives), more "
                               f"than {MAX_LOGPROB_ENTRIES}; ask for fewer logprobs, a shorter prompt or a smaller "
                               "max_tokens.")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of any prompt form; RequestError if it is unusable."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt.prompt, list(prompt.prompt_token_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return (text if isinstance(text, str) else None), _token_list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            prompt = prompt["prompt"]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            prompt = self.render_chat(prompt)
        elif isinstance(prompt, ChatPrompt):
            prompt = self.render_chat(prompt.messages, add_generation_prompt=prompt.add_generation_prompt,
                                      continue_final_message=prompt.continue_final_message,
                                      chat_template=prompt.chat_template,
                                      chat_template_kwargs=prompt.chat_template_kwargs, tools=prompt.tools)
        elif not isinstance(prompt, str):
            return None, _token_list(prompt)
        self._check_text(prompt, "the prompt")
        if self.tokenizer is None:
            raise RequestError("this plan has no tokenizer files; pass token ids ({'prompt_token_ids': [...]}) instead of text.")
        add_special = not _starts_with_bos(self.tokenizer, prompt)
        return prompt, list(self.tokenizer(prompt, add_special_tokens=add_special).input_ids)

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None, tools: Sequence[dict] | None = None) -> str:
        """The chat template's rendering of `messages` (HF apply_chat_template's options, vLLM's defaults: the
        generation prompt appended; `tools` as apply_chat_template's). chat_template_kwargs become template
        variables; they may not set one of apply_chat_template's own parameters (tokenize=True or return_dict=True
        would change what it returns)."""
        limit = budget = self.limits.max_prompt_bytes
        for i, message in enumerate(messages):
            budget -= _check_strings(message, f"messages[{i}]", budget, limit)
        budget -= _check_strings(chat_template, "chat_template", budget, limit)
        budget -= _check_strings(chat_template_kwargs, "chat_template_kwargs", budget, limit)
        _check_strings(tools, "tools", budget, limit)
        if self.tokenizer is None or not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise RequestError("this plan's tokenizer has no chat template; send a plain text prompt instead of messages.")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & (set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
                                         | {"messages", "kwargs"}))
        if reserved:
            raise RequestError(f"chat_template_kwargs may not set {reserved}; use the request's own fields.")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template, tokenize=False,
                tools=list(tools) if tools else None, **kwargs)
        except Exception as e:  # jinja errors for messages the template cannot render
            raise RequestError(f"chat messages could not be rendered by the chat template ({e}); each needs "
                               "'role' and 'content'.") from e
        if not isinstance(text, str):
            raise RequestError("the chat template did not render text; check chat_template and chat_template_kwargs.")
        return text

    # ---- checks ------------------------------------------------------------------------------------------

    def _check_text(self, text: str, what: str) -> None:
        size = check_text(text, what)
        if size > self.limits.max_prompt_bytes:
            raise RequestError(f"{what} is {size} bytes of UTF-8, more than the limit of {self.limits.max_prompt_bytes}; "
                               "send a shorter prompt.")

    def _check_tokens(self, token_ids: list[int]) -> None:
        lim = self.limits
        if not token_ids:
            raise RequestError("the prompt is empty; send at least one token.")
        bad = next((t for t in token_ids if not 0 <= t < lim.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {lim.vocab_size}).")
        if len(token_ids) >= lim.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {lim.max_model_len} "
                "(prompt + at least one output token); shorten the prompt.")
        if lim.max_prompt_tokens_per_step is not None and len(token_ids) > lim.max_prompt_tokens_per_step:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens={lim.max_prompt_tokens_per_step} "
                "with chunked prefill off; shorten it or enable chunked prefill.")

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.limits.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {self.limits.max_model_len} tokens, but you requested "
                f"{num_prompt_tokens + params.max_tokens} ({num_prompt_tokens} in the prompt, {params.max_tokens} for "
                "the completion); reduce the prompt or max_tokens.")
        return params.max_tokens


def _check_strings(value: Any, where: str, budget: int, limit: int) -> int:
    """Check every string inside a chat message (content, name, content parts...) for valid Unicode and against
    the bytes left of the prompt budget; return their UTF-8 size."""
    if isinstance(value, str):
        size = check_text(value, where)
        if size > budget:
            raise RequestError(f"the chat messages exceed the prompt limit of {limit} bytes of "
                               f"UTF-8 (at {where}); send shorter messages.")
        return size
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return 0
    total = 0
    for key, item in items:
        total += _check_strings(item, f"{where}.{key}", budget - total, limit)
    return total


def _token_list(ids: Any) -> list[int]:
    if hasattr(ids, "flatten") and hasattr(ids, "tolist"):  # a torch tensor or numpy array
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("a prompt must be text, chat messages or token ids (a list of integers).")
    return list(ids)


def _starts_with_bos(tokenizer: Any, text: str) -> bool:
    """A chat template usually writes the BOS token itself; adding another would change the prompt."""
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and text.startswith(bos)
