"""Prompt → token ids for the HTTP layer.

The server tokenizes before it queues a request because it must know the prompt length to check
prompt + max_tokens against the context (the engine would clamp max_tokens silently) and to report usage.
The rules are the engine's: the chat template renders messages, and text that already starts with the BOS
token (as rendered chat does) gets no second one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from trtopt.errors import RequestError


@dataclasses.dataclass(frozen=True)
class PromptTokens:
    """A tokenized prompt, ready for LLMEngine.add_request."""

    text: str | None  # the prompt text (rendered chat included); None for token-id prompts
    token_ids: list[int]

    def engine_prompt(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def tokenize_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> PromptTokens:
    if not isinstance(prompt, str):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("a token-id prompt must be a list of integers.")
        return PromptTokens(None, list(prompt))
    if tokenizer is None:
        raise RequestError("this plan has no tokenizer files; send token ids as the prompt instead of text.")
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and prompt.startswith(bos))
    return PromptTokens(prompt, list(tokenizer(prompt, add_special_tokens=add_special).input_ids))


def tokenize_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> PromptTokens:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions with a text prompt.")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja raises its own errors for messages the template cannot render
        raise RequestError(f"the chat messages could not be rendered by the chat template ({e}).") from e
    return tokenize_prompt(tokenizer, text)
