"""RequestOutput → OpenAI JSON: full responses and SSE chunks for /v1/completions and /v1/chat/completions.

A renderer belongs to one request. For streaming it remembers, per completion, how many tokens' logprobs it
has sent and whether it has sent the finish, because every RequestOutput carries all n completions.

vLLM's extras (RenderOptions): token ids (the prompt's and each choice's, as vLLM names them), logprob tokens as
"token_id:N", and usage on every streamed chunk.
"""

from __future__ import annotations

import abc
import dataclasses
import time
import uuid
from typing import Any, Sequence

from trtopt.runtime.batch import CompletionOutput, RequestOutput
from trtopt.runtime.sampling_params import ALL_LOGPROBS
from trtopt.serving.protocol import usage
from trtopt.serving.reasoning import ReasoningDelta, ReasoningRule, ReasoningStream
from trtopt.serving.structured import ToolCallPlan, tool_calls
from trtopt.serving.tool_parsers import ToolCallStream, ToolParser, kimi_k2_call_id


@dataclasses.dataclass(frozen=True)
class RenderOptions:
    """vLLM's per-request output extras."""

    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids (streamed: the new ids per chunk)
    tokens_as_token_ids: bool = False  # logprob tokens (and their bytes) as "token_id:N" (return_tokens_as_token_ids)
    continuous_usage: bool = False  # every streamed chunk carries usage: its prompt and its choice's tokens so far


class Renderer(abc.ABC):
    """What the two endpoints share: ids, token strings, and per-completion stream progress."""

    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, model_name: str, tokenizer: Any, *, n: int = 1,
                 options: RenderOptions = RenderOptions()) -> None:
        self.request_id = request_id
        self.options = options
        self.n = n  # choices per prompt: prompt k's completion i is choice k * n + i
        self.model_name = model_name
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self._sent_tokens: dict[int, int] = {}  # completion index -> tokens whose logprobs were streamed
        self._sent_finish: set[int] = set()

    # ---- subclass hooks ------------------------------------------------------------------------------------

    has_prefix = False  # the first chunk of each streamed choice carries add_prefix's fields

    @abc.abstractmethod
    def choice(self, c: CompletionOutput, index: int, out: RequestOutput) -> dict[str, Any]:
        """One finished choice of a full (non-streamed) response (`out` is its prompt's output)."""

    def add_prefix(self, choice: dict[str, Any], out: RequestOutput) -> None:
        """Put what comes before the generated text (an echoed prompt) into a choice's first streamed chunk."""

    @abc.abstractmethod
    def delta_choice(self, c: CompletionOutput, index: int, text: str,
                     logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        """One choice of a streamed chunk (finish_reason is filled in by the caller), or None when a parser holds
        the new text back (vLLM's None delta: no chunk, unless the choice finishes or token ids are returned)."""

    def empty_choice(self, index: int, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """The choice of a chunk whose delta_choice was None but that is sent all the same."""
        raise AssertionError(f"{type(self).__name__}.delta_choice never returns None")

    @abc.abstractmethod
    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        """The logprobs of generated tokens start..end-1, in this endpoint's format."""

    def stream_start(self, prompt_token_ids: list[list[int]]) -> list[dict[str, Any]]:
        """Chunks sent before any output (prompt_token_ids: each prompt's ids, in order)."""
        return []

    def finish_reason(self, c: CompletionOutput) -> str | None:
        return c.finish_reason

    def select(self, out: RequestOutput) -> list[CompletionOutput]:
        """The completions of `out` that become choices (all of them, unless best_of picks)."""
        return out.outputs

    # ---- shared ---------------------------------------------------------------------------------------------

    def full_response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The response to a request whose prompts (one per item of outs, in order) have all finished."""
        choices = [self.choice(c, k * self.n + c.index, out) for k, out in enumerate(outs) for c in self.select(out)]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
        completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
        # vLLM's full responses carry every field of its response model, null when unused (streamed chunks do not).
        return {**self._envelope(self.object_full), "choices": choices, "service_tier": None,
                "system_fingerprint": None, "usage": usage(prompt_tokens, completion_tokens)}

    def stream_chunks(self, out: RequestOutput, prompt_index: int = 0) -> list[dict[str, Any]]:
        """vLLM's stream shape: one chunk per completion that got new tokens (its text delta may be "", as vLLM
        sends while a stop string or a partial character is held back) or has just finished. A parser's None
        delta sends nothing; those tokens' logprobs and ids go with the next chunk."""
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            start, end = self._sent_tokens.get(index, 0), len(c.token_ids)
            newly_finished = c.finished and index not in self._sent_finish
            first = index not in self._sent_tokens
            if not (end > start or newly_finished or (first and self.has_prefix)):
                continue
            lp = self.logprobs(c, start, end) if c.logprobs is not None and end > start else None
            choice = self.delta_choice(c, index, c.delta_text, lp)
            if choice is None:
                if not (newly_finished or self.options.return_token_ids or (first and self.has_prefix)):
                    continue
                choice = self.empty_choice(index, lp)
            self._sent_tokens[index] = end
            if newly_finished:
                self._sent_finish.add(index)
            if first and self.has_prefix:
                self.add_prefix(choice, out)
            choice["finish_reason"] = self.finish_reason(c) if newly_finished else None
            if self.options.return_token_ids:
                choice["token_ids"] = list(c.token_ids[start:end])
                if first:
                    self.add_prompt_token_ids(choice, out)
            chunk = {**self._envelope(self.object_chunk), "choices": [choice]}
            if self.options.continuous_usage:
                chunk["usage"] = usage(len(out.prompt_token_ids), end)
            chunks.append(chunk)
        return chunks

    def add_prompt_token_ids(self, choice: dict[str, Any], out: RequestOutput) -> None:
        """Put the prompt's ids into a choice's first streamed chunk (completions; chat sends them up front)."""

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk), "choices": [], "usage": counts}

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model_name}

    def logprob_token(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.options.tokens_as_token_ids else self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self._tokenizer.decode([token_id]) if self._tokenizer else str(token_id)
        return self._token_text[token_id]

    def _token_logprobs(self, c: CompletionOutput, start: int, end: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """(chosen id, its logprob, the top alternatives best first) for tokens start..end-1."""
        assert c.logprobs is not None and len(c.logprobs) >= end, "logprobs cover every generated token"
        rows = []
        for tid, alts in zip(c.token_ids[start:end], c.logprobs[start:end]):
            ranked = sorted(alts.items(), key=lambda kv: -kv[1])
            rows.append((tid, alts[tid], ranked))
        return rows

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, decoded_token}} per token."""
        if out.prompt_logprobs is None:
            return None
        return [None if row is None else {str(t): {"logprob": v, "decoded_token": self.token_text(t)} for t, v in row.items()}
                for row in out.prompt_logprobs]


def _legacy_logprobs(tokens: list[str], token_logprobs: list[float | None],
                     top_logprobs: list[dict[str, float] | None]) -> dict[str, Any]:
    """The /v1/completions logprobs object; each text_offset is where its token's text starts in their concatenation."""
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


class CompletionRenderer(Renderer):
    """The legacy /v1/completions format (logprobs as tokens / token_logprobs / top_logprobs / text_offset).

    echo: each choice starts with the prompt text, and (with logprobs) its logprobs start with the prompt tokens'
    (the first one None, as OpenAI and vLLM answer). best_of: the n completions of highest cumulative logprob
    become the choices (logprobs were asked for internally only for the ranking when `logprobs` is False).
    prompt_logprobs: vLLM's per-choice list, None for the first token, then {token id: {logprob, decoded_token}}.
    """

    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, request_id: str, model_name: str, tokenizer: Any, *, n: int = 1, echo: bool = False,
                 logprobs: bool = False, prompt_logprobs: bool = False, best_of: int | None = None,
                 options: RenderOptions = RenderOptions()) -> None:
        super().__init__(request_id, model_name, tokenizer, n=n, options=options)
        self.echo = echo
        self.want_logprobs = logprobs
        self.want_prompt_logprobs = prompt_logprobs
        self.best_of = best_of
        self.has_prefix = echo or prompt_logprobs

    def select(self, out: RequestOutput) -> list[CompletionOutput]:
        outputs = out.outputs
        if self.best_of is not None and self.best_of > self.n:
            ranked = sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[: self.n]
            outputs = [dataclasses.replace(c, index=i) for i, c in enumerate(ranked)]
        if not self.want_logprobs:
            outputs = [dataclasses.replace(c, logprobs=None, cumulative_logprob=None) for c in outputs]
        return outputs

    def choice(self, c: CompletionOutput, index: int, out: RequestOutput) -> dict[str, Any]:
        lp = self.logprobs(c, 0, len(c.token_ids)) if c.logprobs is not None else None
        # vLLM sends prompt_logprobs: null when they were not asked for; clients read the key unconditionally.
        choice = {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
        self.add_prefix(choice, out)
        if self.options.return_token_ids:  # vLLM's: per choice, since each prompt of a batch has its own
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = list(c.token_ids)
        return choice

    def add_prompt_token_ids(self, choice: dict[str, Any], out: RequestOutput) -> None:
        choice["prompt_token_ids"] = list(out.prompt_token_ids)

    def add_prefix(self, choice: dict[str, Any], out: RequestOutput) -> None:
        if self.want_prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        if not self.echo:
            return
        choice["text"] = self._prompt_text(out) + choice["text"]
        if choice.get("logprobs") is not None or (self.want_logprobs and out.prompt_logprobs is not None):
            prompt = self._echo_logprobs(out)
            gen = choice.get("logprobs") or _legacy_logprobs([], [], [])
            shift = sum(len(t) for t in prompt["tokens"])
            choice["logprobs"] = {
                "tokens": prompt["tokens"] + gen["tokens"],
                "token_logprobs": prompt["token_logprobs"] + gen["token_logprobs"],
                "top_logprobs": prompt["top_logprobs"] + gen["top_logprobs"],
                "text_offset": prompt["text_offset"] + [o + shift for o in gen["text_offset"]],
            }

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self._tokenizer.decode(out.prompt_token_ids) if self._tokenizer else ""

    def _echo_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        """The prompt tokens in the logprobs format: the first has no logprob (nothing comes before it)."""
        ids = out.prompt_token_ids
        rows = out.prompt_logprobs or [None] * len(ids)
        return _legacy_logprobs(
            [self.logprob_token(t) for t in ids],
            [None if row is None else row[t] for t, row in zip(ids, rows)],
            [None if row is None else self._top_logprobs(t, sorted(row.items(), key=lambda kv: -kv[1]))
             for t, row in zip(ids, rows)],
        )

    def delta_choice(self, c: CompletionOutput, index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs}

    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        rows = self._token_logprobs(c, start, end)
        return _legacy_logprobs(
            [self.logprob_token(tid) for tid, _, _ in rows],
            [lp for _, lp, _ in rows],
            [self._top_logprobs(tid, ranked) for tid, _, ranked in rows],
        )

    def _top_logprobs(self, token_id: int, ranked: list[tuple[int, float]]) -> dict[str, float]:
        """One position's top_logprobs in vLLM's order: the position's own token first, then the alternatives best
        first (clients read the first key as the token's own)."""
        row = {self.logprob_token(token_id): dict(ranked)[token_id]}
        row.update((self.logprob_token(t), v) for t, v in ranked if t != token_id)
        return row


class ChatRenderer(Renderer):
    """The /v1/chat/completions format.

    role: the reply's role (vLLM's: "assistant", or the last message's role when there is no generation prompt).
    echo_text: vLLM's chat echo: the content every reply starts with (streamed as its own chunk after the role).
    reasoning: the request's reasoning split (--reasoning-parser): each reply's reasoning goes to `reasoning`
        (current vLLM's name) and `reasoning_content` (older vLLM's and DeepSeek's), streamed as the same delta
        fields; the rest is the content that tool calls (forced or parsed) and echo then see.
    prompt_logprobs (vLLM's) sit at the top of the response, null when not asked for.
    tool_parser: tool_choice "auto" (--enable-auto-tool-choice): the parser turns the model's own tool-call syntax
        in each reply's content into tool_calls (streamed as tool-call deltas), finish_reason "tool_calls".
    kimi_call_index: None for random tool call ids; else ids are Kimi-K2's functions.<name>:<index>, the index
        counting on from this many calls made earlier in the conversation (vLLM's make_tool_call_id).
    """

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, request_id: str, model_name: str, tokenizer: Any, *, n: int = 1, top_logprobs: int = 0,
                 tool_plan: ToolCallPlan | None = None, role: str = "assistant", echo_text: str = "",
                 reasoning: ReasoningRule | None = None, tool_parser: ToolParser | None = None,
                 kimi_call_index: int | None = None, options: RenderOptions = RenderOptions()) -> None:
        super().__init__(request_id, model_name, tokenizer, n=n, options=options)
        self.top_logprobs = top_logprobs
        self.kimi_call_index = kimi_call_index
        self._kimi_next: dict[int, int] = {}  # choice index -> the index of its next call (kimi_k2 ids)
        self.role = role
        self.echo_text = echo_text
        self.tool_plan = tool_plan  # the output is tool calls (constrained by the plan's grammar)
        self._call_ids: dict[int, str] = {}  # choice index -> id of its streamed named call
        self.reasoning = reasoning
        self._reasoning_streams: dict[int, ReasoningStream] = {}  # choice index -> its streamed split
        self.tool_parser = tool_parser
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its streamed tool calls
        self._auto_called: set[int] = set()  # choices whose reply made tool calls (tool_parser)

    def stream_start(self, prompt_token_ids: list[list[int]]) -> list[dict[str, Any]]:
        # OpenAI opens every streamed choice with the role and empty content; vLLM adds the prompt's ids to these
        # chunks, and an echo chunk after them.
        (prompt,) = prompt_token_ids
        extra: dict[str, Any] = {}
        if self.options.return_token_ids:
            extra["prompt_token_ids"] = list(prompt)
        if self.options.continuous_usage:
            extra["usage"] = usage(len(prompt), 0)
        chunks = [{**self._envelope(self.object_chunk), **extra,
                   "choices": [{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                                "finish_reason": None}]} for i in range(self.n)]
        extra.pop("prompt_token_ids", None)
        if self.echo_text:
            chunks += [{**self._envelope(self.object_chunk), **extra,
                        "choices": [{"index": i, "delta": {"content": self.echo_text}, "logprobs": None,
                                     "finish_reason": None}]} for i in range(self.n)]
        return chunks

    def full_response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        response = super().full_response(outs)
        response["prompt_token_ids"] = list(outs[0].prompt_token_ids) if self.options.return_token_ids else None
        response["prompt_logprobs"] = self._prompt_logprobs(outs[0])  # vLLM's place: the response, not a choice
        return response

    def choice(self, c: CompletionOutput, index: int, out: RequestOutput) -> dict[str, Any]:
        lp = self.logprobs(c, 0, len(c.token_ids)) if c.logprobs is not None else None
        split = self.reasoning.split(c.text) if self.reasoning is not None else None
        if split is not None:  # vLLM's order: reasoning first; what follows only sees the content
            c = dataclasses.replace(c, text=split.content or "")
        message: dict[str, Any] = {"role": self.role, "content": c.text}
        if split is not None:
            message.update(content=split.content, reasoning=split.reasoning, reasoning_content=split.reasoning)
        if self.tool_plan is not None:
            message = self._tool_message(c)
            if split is not None:  # the reasoning before the call (its grammar held only after the reasoning)
                message.update(reasoning=split.reasoning, reasoning_content=split.reasoning)
        elif self.tool_parser is not None:
            message = self._auto_tool_message(c, message)
        if self.echo_text:  # vLLM's: prepended whatever the reply is
            message["content"] = self.echo_text + (message["content"] or "")
        self._kimi_ids(index, message.get("tool_calls") or ())
        token_ids = list(c.token_ids) if self.options.return_token_ids else None
        choice = {"index": index, "message": message, "logprobs": lp, "finish_reason": self.finish_reason(c),
                  "stop_reason": c.stop_reason, "token_ids": token_ids}
        return choice

    def _tool_message(self, c: CompletionOutput) -> dict[str, Any]:
        """The message of a forced tool call (content "", as vLLM's; OpenAI sends null). A call cut short
        (max_tokens) is neither content nor a call: no tool calls, finish_reason "length" (OpenAI's answer, which
        vLLM's test asserts for "required" and named calls alike). A stream sent the partial arguments already."""
        return {"role": "assistant", "content": "", "tool_calls": tool_calls(self.tool_plan, c.text)}

    def _auto_tool_message(self, c: CompletionOutput, message: dict[str, Any]) -> dict[str, Any]:
        """tool_choice "auto": the calls the parser finds in the reply, and the rest as content (None when empty);
        a reply without calls keeps its content."""
        found = self.tool_parser.extract(c.text)
        if not found.tool_calls:
            return {**message, "tool_calls": []}
        self._auto_called.add(c.index)
        return {**message, "content": found.content, "tool_calls": found.tool_calls}

    def finish_reason(self, c: CompletionOutput) -> str | None:
        if self.tool_parser is not None and c.index in self._auto_called and c.finish_reason == "stop":
            return "tool_calls"  # vLLM's, when the model called tools; "length" stays (the reply was cut short)
        # A completed call is "tool_calls" (or "stop" for a named function, as OpenAI answers); "length" stays.
        if self.tool_plan is not None and c.finish_reason == "stop":
            return self.tool_plan.finish_reason
        return c.finish_reason

    def delta_choice(self, c: CompletionOutput, index: int, text: str,
                     logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.reasoning is None and self.tool_parser is None and self.tool_plan is None:
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs}  # "" too, as vLLM sends it
        if self.reasoning is not None:
            delta = self._reasoning_delta(c, index, text)
            if self.tool_parser is not None:  # calls are parsed from the content, after the reasoning (vLLM's order)
                delta.update(self._auto_tool_delta(c, index, delta.pop("content", "")))
            elif self.tool_plan is not None:  # a forced call: the content after the reasoning is the call
                delta.update(self._tool_delta(c, index, delta.pop("content", "")))
        elif self.tool_parser is not None:
            delta = self._auto_tool_delta(c, index, text)
        else:
            delta = self._tool_delta(c, index, text)
        self._kimi_ids(index, [call for call in delta.get("tool_calls", ()) if "id" in call])
        return {"index": index, "delta": delta, "logprobs": logprobs} if delta else None

    def _kimi_ids(self, index: int, new_calls: Sequence[dict[str, Any]]) -> None:
        """Kimi-K2's ids for choice `index`'s new calls (in place), when kimi_call_index is set."""
        if self.kimi_call_index is None:
            return
        for call in new_calls:
            k = self._kimi_next.get(index, self.kimi_call_index)
            call["id"] = kimi_k2_call_id(call["function"]["name"], k)
            self._kimi_next[index] = k + 1

    def empty_choice(self, index: int, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": logprobs}  # vLLM's DeltaMessage()

    def _reasoning_delta(self, c: CompletionOutput, index: int, text: str) -> dict[str, Any]:
        """A streamed reply's new text, split: reasoning_content and/or content (a tail that may still be a tag
        waits for the next chunk, or for the reply's end)."""
        stream = self._reasoning_streams.setdefault(index, self.reasoning.stream())
        new = stream.feed(text)
        if c.finished:
            end = stream.finish()
            new = ReasoningDelta(new.reasoning + end.reasoning, new.content + end.content)
        delta: dict[str, Any] = {}
        if new.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = new.reasoning
        if new.content:
            delta["content"] = new.content
        return delta

    def _auto_tool_delta(self, c: CompletionOutput, index: int, text: str) -> dict[str, Any]:
        """tool_choice "auto", streamed: content and tool-call deltas, as ToolCallStream finds them in the text."""
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tool_parser))
        delta = stream.feed(text, final=c.finished)
        if stream.called:
            self._auto_called.add(c.index)
        return delta

    def _tool_delta(self, c: CompletionOutput, index: int, text: str) -> dict[str, Any]:
        """OpenAI's streamed tool calls. A named function streams its arguments as they are generated (the first
        delta carries the call's id and name); "required" sends each call whole once the array is complete,
        because which function a call names is only known when its object has been read."""
        plan = self.tool_plan
        if plan.named is None:
            calls = tool_calls(plan, self._content(c.text)) if c.finished else []
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls else {}
        if index not in self._call_ids and not text and not c.finished and self.reasoning is not None:
            return {}  # still reasoning: the call starts with its first argument text (or at the end, empty)
        if index not in self._call_ids:
            self._call_ids[index] = f"call_{uuid.uuid4().hex[:24]}"
            return {"tool_calls": [{"index": 0, "id": self._call_ids[index], "type": "function",
                                    "function": {"name": plan.named, "arguments": text}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def _content(self, text: str) -> str:
        """A whole reply's content: what follows its reasoning (all of it without a reasoning split)."""
        return text if self.reasoning is None else (self.reasoning.split(text).content or "")

    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        content = []
        for tid, lp, ranked in self._token_logprobs(c, start, end):
            top = ranked if self.top_logprobs == ALL_LOGPROBS else ranked[: self.top_logprobs]  # -1: the vocabulary
            content.append({**self._entry(tid, lp), "top_logprobs": [self._entry(t, v) for t, v in top]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.logprob_token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class BatchChatRenderer(Renderer):
    """vLLM's /v1/chat/completions/batch response: one chat.completion whose choice k is the reply to conversation
    k, rendered by that conversation's own ChatRenderer (its echo and role are its own); usage sums them all.
    Never streamed."""

    object_full = "chat.completion"

    def __init__(self, parts: list[ChatRenderer]) -> None:
        first = parts[0]
        assert all(p.n == 1 for p in parts), "a batch has one choice per conversation"
        super().__init__(first.request_id, first.model_name, first._tokenizer, options=first.options)
        self.parts = parts

    def full_response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        assert len(outs) == len(self.parts), "one output per conversation"
        return {**super().full_response(outs), "prompt_logprobs": None, "prompt_token_ids": None}

    def choice(self, c: CompletionOutput, index: int, out: RequestOutput) -> dict[str, Any]:
        return self.parts[index].choice(c, index, out)  # n = 1: choice k is conversation k's

    def delta_choice(self, c: CompletionOutput, index: int, text: str,
                     logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        raise AssertionError("the batch endpoint refuses stream=true")

    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        raise AssertionError("each conversation's ChatRenderer renders its own logprobs")
