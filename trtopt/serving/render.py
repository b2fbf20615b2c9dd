"""RequestOutput → OpenAI JSON: full responses and SSE chunks for /v1/completions and /v1/chat/completions.

A renderer belongs to one request. For streaming it remembers, per completion, how many tokens' logprobs it
has sent and whether it has sent the finish, because every RequestOutput carries all n completions.
"""

from __future__ import annotations

import abc
import time
import uuid
from typing import Any

from trtopt.runtime.batch import CompletionOutput, RequestOutput
from trtopt.serving.protocol import usage
from trtopt.serving.structured import ToolCallPlan, tool_calls


class Renderer(abc.ABC):
    """What the two endpoints share: ids, token strings, and per-completion stream progress."""

    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, model_name: str, tokenizer: Any, *, n: int = 1) -> None:
        self.request_id = request_id
        self.n = n  # choices per prompt: prompt k's completion i is choice k * n + i
        self.model_name = model_name
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self._sent_tokens: dict[int, int] = {}  # completion index -> tokens whose logprobs were streamed
        self._sent_finish: set[int] = set()

    # ---- subclass hooks ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def choice(self, c: CompletionOutput, index: int) -> dict[str, Any]:
        """One finished choice of a full (non-streamed) response."""

    @abc.abstractmethod
    def delta_choice(self, c: CompletionOutput, index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """One choice of a streamed chunk (finish_reason is filled in by the caller)."""

    @abc.abstractmethod
    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        """The logprobs of generated tokens start..end-1, in this endpoint's format."""

    def stream_start(self) -> list[dict[str, Any]]:
        return []

    def finish_reason(self, c: CompletionOutput) -> str | None:
        return c.finish_reason

    # ---- shared ---------------------------------------------------------------------------------------------

    def full_response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The response to a request whose prompts (one per item of outs, in order) have all finished."""
        choices = [self.choice(c, k * self.n + c.index) for k, out in enumerate(outs) for c in out.outputs]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
        completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
        return {**self._envelope(self.object_full), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def stream_chunks(self, out: RequestOutput, prompt_index: int = 0) -> list[dict[str, Any]]:
        """One chunk per completion that has new text, new logprobs or has just finished."""
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            start, end = self._sent_tokens.get(index, 0), len(c.token_ids)
            newly_finished = c.finished and index not in self._sent_finish
            lp = self.logprobs(c, start, end) if c.logprobs is not None and end > start else None
            if not (c.delta_text or lp or newly_finished):
                continue
            self._sent_tokens[index] = end
            if newly_finished:
                self._sent_finish.add(index)
            choice = self.delta_choice(c, index, c.delta_text, lp)
            choice["finish_reason"] = self.finish_reason(c) if newly_finished else None
            chunks.append({**self._envelope(self.object_chunk), "choices": [choice]})
        return chunks

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk), "choices": [], "usage": counts}

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model_name}

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


class CompletionRenderer(Renderer):
    """The legacy /v1/completions format (logprobs as tokens / token_logprobs / top_logprobs / text_offset)."""

    object_full = "text_completion"
    object_chunk = "text_completion"

    def choice(self, c: CompletionOutput, index: int) -> dict[str, Any]:
        lp = self.logprobs(c, 0, len(c.token_ids)) if c.logprobs is not None else None
        return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def delta_choice(self, c: CompletionOutput, index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs}

    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        rows = self._token_logprobs(c, start, end)
        tokens = [self.token_text(tid) for tid, _, _ in rows]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [{self.token_text(t): v for t, v in ranked} for _, _, ranked in rows],
            "text_offset": offsets,
        }


class ChatRenderer(Renderer):
    """The /v1/chat/completions format."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, request_id: str, model_name: str, tokenizer: Any, *, n: int = 1, top_logprobs: int = 0,
                 tool_plan: ToolCallPlan | None = None) -> None:
        super().__init__(request_id, model_name, tokenizer, n=n)
        self.top_logprobs = top_logprobs
        self.tool_plan = tool_plan  # the output is tool calls (constrained by the plan's grammar)
        self._call_ids: dict[int, str] = {}  # choice index -> id of its streamed named call

    def stream_start(self) -> list[dict[str, Any]]:
        # OpenAI opens every streamed choice with the role and empty content.
        return [{**self._envelope(self.object_chunk),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for i in range(self.n)]

    def choice(self, c: CompletionOutput, index: int) -> dict[str, Any]:
        lp = self.logprobs(c, 0, len(c.token_ids)) if c.logprobs is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        calls = tool_calls(self.tool_plan, c.text) if self.tool_plan is not None else []
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": self.finish_reason(c),
                "stop_reason": c.stop_reason}

    def finish_reason(self, c: CompletionOutput) -> str | None:
        # A completed call is "tool_calls" (or "stop" for a named function, as OpenAI answers); "length" stays.
        if self.tool_plan is not None and c.finish_reason == "stop":
            return self.tool_plan.finish_reason
        return c.finish_reason

    def delta_choice(self, c: CompletionOutput, index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        delta = self._tool_delta(c, index, text) if self.tool_plan is not None else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs}

    def _tool_delta(self, c: CompletionOutput, index: int, text: str) -> dict[str, Any]:
        """OpenAI's streamed tool calls. A named function streams its arguments as they are generated (the first
        delta carries the call's id and name); "required" sends each call whole once the array is complete,
        because which function a call names is only known when its object has been read."""
        plan = self.tool_plan
        if plan.named is None:
            calls = tool_calls(plan, c.text) if c.finished else []
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls else {}
        if index not in self._call_ids:
            self._call_ids[index] = f"call_{uuid.uuid4().hex[:24]}"
            return {"tool_calls": [{"index": 0, "id": self._call_ids[index], "type": "function",
                                    "function": {"name": plan.named, "arguments": text}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any]:
        content = []
        for tid, lp, ranked in self._token_logprobs(c, start, end):
            content.append({**self._entry(tid, lp),
                            "top_logprobs": [self._entry(t, v) for t, v in ranked[: self.top_logprobs]]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
