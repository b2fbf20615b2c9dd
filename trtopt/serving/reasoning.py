"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat reply's `<think>…</think>` part becomes reasoning_content.

Two parsers, with vLLM's names and rules:
  - deepseek_r1: the chat template opens `<think>`, so a reply starts inside its reasoning. Text up to the first
    `</think>` is reasoning (a `<think>` the model writes itself before it is dropped), the rest is content; a
    reply with no `</think>` (cut short) is all reasoning.
  - qwen3: reasoning only between a `<think>` the model writes and the `</think>` after it (a reply cut short inside
    it: everything after `<think>` is reasoning); without `<think>`, or with the request's chat_template_kwargs
    `{"enable_thinking": false}`, the whole reply is content.

The split is done on text, not token ids, so a tag that spans several tokens (or stream chunks) is found all the
same: the streaming splitter holds back a tail that may still become a tag. A full reply is split by that same
splitter fed the whole text, so streamed and non-streamed replies agree by construction. The tags never reach the
client.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, ClassVar, Mapping

from trtopt.errors import ConfigError

THINK_START = "<think>"
THINK_END = "</think>"


class _Phase(enum.Enum):
    BEFORE = "before"  # no reasoning yet; text is content until <think> (qwen3)
    REASONING = "reasoning"
    CONTENT = "content"  # past </think>, or reasoning is off: every character is content


@dataclasses.dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of streamed text adds to each part ("" for nothing)."""

    reasoning: str = ""
    content: str = ""


@dataclasses.dataclass(frozen=True)
class ReasoningSplit:
    """A whole reply, split (vLLM's values: content is None when reasoning took all of the reply)."""

    reasoning: str | None  # None: the reply has no reasoning part
    content: str | None


@dataclasses.dataclass(frozen=True)
class ReasoningRule:
    """How the replies of one request split: a parser's answer for that request."""

    starts_in_reasoning: bool  # the template opened <think>: the reply starts inside its reasoning (deepseek_r1)
    enabled: bool = True  # False: every reply is content (qwen3 with enable_thinking=false)

    def stream(self) -> ReasoningStream:
        """A splitter for one streamed reply (one per choice)."""
        return ReasoningStream(self)

    def split(self, text: str) -> ReasoningSplit:
        """A whole reply, split exactly as streaming it in any pieces would."""
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        if not stream.has_reasoning:
            return ReasoningSplit(None, first.content + last.content)
        return ReasoningSplit(first.reasoning + last.reasoning, (first.content + last.content) or None)


class ReasoningStream:
    """Splits one reply as its text arrives. feed() each new piece, finish() once at the end (it releases a held
    tail that never became a tag)."""

    def __init__(self, rule: ReasoningRule) -> None:
        if not rule.enabled:
            self._phase = _Phase.CONTENT
        else:
            self._phase = _Phase.REASONING if rule.starts_in_reasoning else _Phase.BEFORE
        self.has_reasoning = self._phase is _Phase.REASONING  # whether the reply has a reasoning part (maybe "")
        # deepseek_r1 drops one <think> the model writes itself inside its reasoning (its template wrote one already).
        self._drop_start = self._phase is _Phase.REASONING
        self._held = ""  # a tail of the text that may be the start of a tag

    def _tags(self) -> tuple[str, ...]:
        """The tags that would end or change the current phase."""
        if self._phase is _Phase.BEFORE:
            return (THINK_START,)
        if self._phase is _Phase.REASONING:
            return (THINK_START, THINK_END) if self._drop_start else (THINK_END,)
        return ()

    def feed(self, text: str) -> ReasoningDelta:
        parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        held = self._held + text
        while True:
            tags = self._tags()
            hits = [(held.find(tag), tag) for tag in tags if tag in held]
            if hits:
                at, tag = min(hits)
                parts[self._part()].append(held[:at])
                held = held[at + len(tag):]
                self._cross(tag)
                continue
            keep = _partial_tag_len(held, tags)
            parts[self._part()].append(held[: len(held) - keep])
            self._held = held[len(held) - keep:]
            return ReasoningDelta("".join(parts["reasoning"]), "".join(parts["content"]))

    def finish(self) -> ReasoningDelta:
        """The held tail (it never became a tag, so it is text of the current phase)."""
        held, self._held = self._held, ""
        return ReasoningDelta(reasoning=held) if self._part() == "reasoning" else ReasoningDelta(content=held)

    def _part(self) -> str:
        return "reasoning" if self._phase is _Phase.REASONING else "content"

    def _cross(self, tag: str) -> None:
        if tag == THINK_END:
            self._phase = _Phase.CONTENT
        elif self._phase is _Phase.BEFORE:
            self._phase = _Phase.REASONING
            self.has_reasoning = True
        else:  # deepseek_r1's own <think> inside the reasoning its template opened
            assert self._drop_start, "a <think> inside reasoning is only sought while it may still be dropped"
            self._drop_start = False


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `tags` (0 if none)."""
    for k in range(min(len(text), max((len(t) for t in tags), default=1) - 1), 0, -1):
        if any(t.startswith(text[-k:]) for t in tags):
            return k
    return 0


# ---- parsers ------------------------------------------------------------------------------------------------------


class ReasoningParser(abc.ABC):
    """A model family's reasoning format: its rule for one request."""

    name: ClassVar[str]

    @abc.abstractmethod
    def rule(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningRule:
        """How the replies to a request with these chat_template_kwargs split."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the template ends the prompt with `<think>\\n`."""

    name = "deepseek_r1"

    def rule(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningRule:
        return ReasoningRule(starts_in_reasoning=True)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model writes `<think>` itself; `enable_thinking: false` (a template variable) turns it off."""

    name = "qwen3"

    def rule(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningRule:
        enabled = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
        return ReasoningRule(starts_in_reasoning=False, enabled=enabled)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered under `name` (vLLM's names); ConfigError for any other."""
    if name not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser {name!r} is not one of {sorted(REASONING_PARSERS)}; pick one of them "
                          "(or leave the flag out for no reasoning split).")
    return REASONING_PARSERS[name]()
