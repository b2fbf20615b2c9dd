"""Tool-call parsers for tool_choice "auto" (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`): the
model generates freely, and its own tool-call syntax in the reply becomes OpenAI `tool_calls`.

Parsers, with vLLM's names and the syntax of the models they serve:
  - hermes (Hermes 2/3, Qwen2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them,
    with text around them; the last closing tag may be missing (the reply ended there).
  - llama3_json (Llama 3.1/3.2 JSON calls): the reply is `<|python_tag|>`? `{"name": ..., "parameters": {...}}`
    (or "arguments"), several separated by `;`.
  - mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects (tokenizers before v11), or
    `[TOOL_CALLS]name{arguments}` once per call (v11+, `[ARGS]` may sit between name and arguments); text before
    the first `[TOOL_CALLS]` is content. Call ids are 9 letters and digits, as Mistral's templates require.
  - pythonic (Llama 3.2/4, ToolACE): the whole reply is a Python list of calls with literal keyword arguments,
    `[get_weather(city="Paris"), get_time(tz='UTC')]`.
  - granite (Granite 3.0/3.1): the whole reply is `<|tool_call|>`? `<tool_call>`? then a JSON array of
    {"name", "arguments"} objects and nothing after it.
  - granite-20b-fc (granite-20b-functioncalling): `<function_call> {"name", "arguments"}` once per call; text before
    the first marker is content, text after a call's object is dropped (vLLM's raw_decode).
  - internlm (InternLM2/2.5): content, then one call `<|action_start|><|plugin|>{"name": ..., "parameters": {...}}`
    (or "arguments") `<|action_end|>`; anything between the marker and the object's "{" and after the end marker
    is dropped (InternLM2 makes one call per reply).

A reply that does not follow its parser's syntax (malformed JSON, a call without a name, text where a call must be)
is plain content with no calls, as in vLLM. Content is the text outside the calls (whitespace right after a call is
dropped), None when empty.

Each parser is one function of the text so far: `parse(text, final=False)` returns the content and the calls that no
continuation of the text can change (a tail that may still become a marker is held back, a call appears once its
name is complete, its arguments grow as they are generated). A whole reply is `parse(text, final=True)`; a streamed
one sends, at each step, what the parse of the longer text adds (ToolCallStream), so the two agree by construction.
Streamed pieces are never taken back: a call found malformed after its name was sent stays sent.

Arguments are JSON text: the model's JSON with insignificant whitespace normalized to json.dumps' spacing
(", " and ": "), which is prefix-stable, so it can be streamed as it is generated; pythonic calls' arguments are
json.dumps of the literal values. Mistral's v11 arguments are passed through as generated (vLLM's rule).
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import json
import random
import re
import string
import uuid
from typing import Any, ClassVar

from trtopt.errors import ConfigError


class NotToolCalls(Exception):
    """The text is not, and no continuation of it can be, a well-formed tool-call reply: it is all content."""


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One call as far as the text goes (its name is complete)."""

    name: str
    arguments: str  # JSON text; while not done, a prefix that only grows
    done: bool = True


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a text commits to: content (outside calls) and the calls, both prefixes of what a longer text gives."""

    content: str
    calls: tuple[ParsedCall, ...]


@dataclasses.dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole reply: OpenAI's message content (None when empty and calls were made) and `tool_calls`."""

    content: str | None
    tool_calls: list[dict[str, Any]]


class ToolParser(abc.ABC):
    """One model family's tool-call syntax. Parsers are stateless; ToolCallStream keeps a stream's progress."""

    name: ClassVar[str]
    # Marker strings the parser must see in the text: when the tokenizer makes them special tokens, the server
    # decodes with skip_special_tokens=False (vLLM's adjust_request for hermes, mistral and internlm).
    markers: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def parse(self, text: str, *, final: bool) -> Parsed:
        """The content and calls `text` commits to (final: the reply is complete). NotToolCalls when it is content."""

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's make_tool_call_id

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole reply's content and tool calls."""
        try:
            parsed = self.parse(text, final=True)
        except NotToolCalls:
            return ExtractedToolCalls(text, [])
        if not parsed.calls:
            return ExtractedToolCalls(parsed.content, [])
        calls = [_tool_call(self.new_call_id(), c.name, c.arguments) for c in parsed.calls]
        return ExtractedToolCalls(parsed.content or None, calls)

    def needs_special_tokens(self, tokenizer: Any) -> bool:
        """Whether `tokenizer` marks one of this parser's markers special (so skipping special tokens hides it)."""
        if tokenizer is None or not self.markers:
            return False
        special = set(getattr(tokenizer, "all_special_tokens", None) or ())
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
        return any(m in special for m in self.markers)


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """One streamed reply (one choice): feed() each new piece of text, get OpenAI's delta fields for it."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._content = ""  # content sent
        self._calls: list[tuple[str, int]] = []  # (name, characters of arguments sent) per call sent

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return bool(self._calls)

    def feed(self, text: str, *, final: bool = False) -> dict[str, Any]:
        """{"content": ..., "tool_calls": [...]} for what `text` adds (keys only when non-empty); final: the reply
        ended with this piece. The first delta of a call carries index, id, type and function.name (and the
        arguments so far), later ones function.arguments pieces (vLLM's and OpenAI's shape)."""
        self._text += text
        try:
            parsed = self.parser.parse(self._text, final=final)
        except NotToolCalls:
            if self._calls:
                return {}  # calls were sent and cannot be taken back
            parsed = Parsed(self._text, ())
        delta: dict[str, Any] = {}
        assert parsed.content.startswith(self._content), "committed content only grows"
        if len(parsed.content) > len(self._content):
            delta["content"] = parsed.content[len(self._content):]
            self._content = parsed.content
        calls = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._calls):
                self._calls.append((call.name, len(call.arguments)))
                calls.append({"index": index, "id": self.parser.new_call_id(), "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
                continue
            name, sent = self._calls[index]
            if len(call.arguments) > sent:
                self._calls[index] = (name, len(call.arguments))
                calls.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
        if calls:
            delta["tool_calls"] = calls
        return delta


# ---- the parsers ------------------------------------------------------------------------------------------------


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                out.text(text[pos:] if final else _hold_marker(text[pos:], self.START))
                return out.result()
            out.text(text[pos:start])
            e = _object_call(text, _skip_ws(text, start + len(self.START)), out, final, ("arguments",))
            if isinstance(e, Parsed):
                return e
            if text.startswith(self.END, e):
                pos = e + len(self.END)
                continue
            if e == len(text) or (not final and self.END.startswith(text[e:])):
                return out.result()  # the reply ended inside the call (vLLM takes it), or its tag is coming
            raise NotToolCalls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        i = _skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_ws(text, i + len(self.TAG))
        elif not final and i < len(text) and self.TAG.startswith(text[i:]):
            return out.result()
        while True:
            e = _object_call(text, i, out, final, ("arguments", "parameters"))
            if isinstance(e, Parsed):
                return e
            if e < len(text) and text[e] == ";":
                i = _skip_ws(text, e + 1)
                if i == len(text):
                    return out.result()
                continue
            out.text(text[e:])  # text after the calls is content
            return out.result()


class MistralToolParser(ToolParser):
    name = "mistral"
    BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (BOT,)
    _NAME = re.compile(r"[\w.\-]+")

    def new_call_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        start = text.find(self.BOT)
        if start < 0:
            out.text(text if final else _hold_marker(text, self.BOT))
            return out.result()
        out.text(text[:start])
        i = _skip_ws(text, start + len(self.BOT))
        if i == len(text):
            if final:
                raise NotToolCalls
            return out.result()
        if text[i] == "[" and not text.startswith(self.ARGS, i):
            return self._array(text, i, out, final)
        return self._named(text, start, out, final)

    def _array(self, text: str, i: int, out: _Builder, final: bool) -> Parsed:
        """Before v11: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""
        end = _call_array(text, i, out, final)
        if isinstance(end, Parsed):
            return end
        out.text(text[end:])
        return out.result()

    def _named(self, text: str, pos: int, out: _Builder, final: bool) -> Parsed:
        """v11+: `[TOOL_CALLS]name{arguments}` per call (`[ARGS]` may follow the name)."""
        while True:
            brace = text.find("{", pos + len(self.BOT))
            head = text[pos + len(self.BOT): len(text) if brace < 0 else brace]
            if self.BOT in head:  # a marker with no arguments before the next one
                raise NotToolCalls
            if brace < 0:  # the name is not complete yet
                name = _hold_marker(head, self.ARGS).replace(self.ARGS, "").strip()
                if final or (name and not self._NAME.fullmatch(name)):
                    raise NotToolCalls
                return out.result()
            name = head.replace(self.ARGS, "").strip()
            if not self._NAME.fullmatch(name):
                raise NotToolCalls
            end = _json_value_end(text, brace)
            if end is None:
                arguments = text[brace:]
                out.call(ParsedCall(name, arguments, done=final))
                return out.result()
            out.call(ParsedCall(name, text[brace:end]))
            after = text.find(self.BOT, end)
            if after >= 0:  # text between two calls is content
                out.text(text[end:after])
                pos = after
                continue
            out.text(text[end:] if final else _hold_marker(text[end:], self.BOT))
            return out.result()


class PythonicToolParser(ToolParser):
    name = "pythonic"
    _IDENT = re.compile(r"[A-Za-z_]\w*")

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        i = _skip_ws(text, 0)
        if i == len(text):
            if final:
                raise NotToolCalls
            return out.result()
        if text[i] != "[":
            raise NotToolCalls
        i = _skip_ws(text, i + 1)
        while True:
            m = self._IDENT.match(text, i)
            if m is None and i < len(text):
                raise NotToolCalls
            if m is None or m.end() == len(text):  # the text ends before the name does
                if final:
                    raise NotToolCalls
                return out.result()
            i = _skip_ws(text, m.end())
            if i == len(text) and not final:
                return out.result()
            if i == len(text) or text[i] != "(":
                raise NotToolCalls
            i, call = self._call(text, m.group(), _skip_ws(text, i + 1))
            if not call.done:
                if final:
                    raise NotToolCalls
                return out.result(call)
            out.call(call)
            i = _skip_ws(text, i)
            if i == len(text):
                if final:
                    raise NotToolCalls
                return out.result()
            if text[i] == ",":
                i = _skip_ws(text, i + 1)
                continue
            if text[i] != "]" or text[i + 1:].strip():
                raise NotToolCalls
            return out.result()

    def _call(self, text: str, name: str, i: int) -> tuple[int, ParsedCall]:
        """(index after the call's ")", the call) from its first argument at text[i]; done=False while open."""
        pairs: list[str] = []
        keys: set[str] = set()

        def partial() -> tuple[int, ParsedCall]:
            return len(text), ParsedCall(name, "{" + ", ".join(pairs), done=False)

        while True:
            if i == len(text):
                return partial()
            if text[i] == ")":
                return i + 1, ParsedCall(name, "{" + ", ".join(pairs) + "}")
            m = self._IDENT.match(text, i)
            if m is None:
                raise NotToolCalls
            j = _skip_ws(text, m.end())
            if j == len(text):
                return partial()
            if text[j] != "=" or m.group() in keys:
                raise NotToolCalls
            v = _skip_ws(text, j + 1)
            end = _py_value_end(text, v)
            if end is None:
                return partial()
            try:
                value = json.dumps(ast.literal_eval(text[v:end].strip()), ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise NotToolCalls from None
            keys.add(m.group())
            pairs.append(f"{json.dumps(m.group())}: {value}")
            i = _skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)


class GraniteToolParser(ToolParser):
    name = "granite"
    TOKEN, STRING = "<|tool_call|>", "<tool_call>"  # Granite 3.0's special token, Granite 3.1's text

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        i = _skip_ws(text, 0)
        for marker in (self.TOKEN, self.STRING):
            if text.startswith(marker, i):
                i = _skip_ws(text, i + len(marker))
        if i == len(text):
            if final:
                raise NotToolCalls
            return out.result()
        if text[i] != "[":
            if not final and any(m.startswith(text[i:]) for m in (self.TOKEN, self.STRING)):
                return out.result()  # a marker is forming
            raise NotToolCalls
        end = _call_array(text, i, out, final, need_arguments=True)
        if isinstance(end, Parsed):
            return end
        if text[end:].strip():  # the whole reply is the array (vLLM's json.loads)
            raise NotToolCalls
        return out.result()


class Granite20bFCToolParser(ToolParser):
    name = "granite-20b-fc"
    BOT = "<function_call>"
    markers = (BOT,)

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        start = text.find(self.BOT)
        if start < 0:
            out.text(text if final else _hold_marker(text, self.BOT))
            return out.result()
        out.text(text[:start])
        while True:
            i = _skip_ws(text, start + len(self.BOT))
            e = _object_call(text, i, out, final, ("arguments",), need_arguments=True)
            if isinstance(e, Parsed):
                return e
            start = text.find(self.BOT, e)
            if start < 0:
                return out.result()  # text after a call's object is not content (vLLM decodes the object only)


class Internlm2ToolParser(ToolParser):
    name = "internlm"
    START, END = "<|action_start|><|plugin|>", "<|action_end|>"
    markers = ("<|action_start|>", "<|plugin|>", END)

    def parse(self, text: str, *, final: bool) -> Parsed:
        out = _Builder()
        start = text.find(self.START)
        if start < 0:
            out.text(text if final else _hold_marker(text, self.START))
            return out.result()
        out.text(text[:start])
        brace = text.find("{", start + len(self.START))
        if self.END in text[start + len(self.START): len(text) if brace < 0 else brace]:
            raise NotToolCalls  # the action ended before its object began
        if brace < 0:
            if final:
                raise NotToolCalls
            return out.result()
        e = _object_call(text, brace, out, final, ("parameters", "arguments"))
        if isinstance(e, Parsed):
            return e
        if text.startswith(self.END, e) or e == len(text) or (not final and self.END.startswith(text[e:])):
            return out.result()  # one call per reply: what follows its end marker is dropped
        raise NotToolCalls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
                        GraniteToolParser, Granite20bFCToolParser, Internlm2ToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ConfigError for an unknown one."""
    if name not in TOOL_PARSERS:
        raise ConfigError(f"--tool-call-parser {name!r} is not one of {sorted(TOOL_PARSERS)}.")
    return TOOL_PARSERS[name]()


TOOL_CALL_ID_TYPES = ("random", "kimi_k2")
_KIMI_MODEL_TYPES = ("kimi_k2", "kimi_k25")  # vLLM's: these models' templates read ids as functions.<name>:<index>


def tool_call_id_type(model_type: str) -> str:
    """vLLM's get_tool_call_id_type: "kimi_k2" for Kimi-K2 models (by config model_type), else "random"."""
    return "kimi_k2" if model_type in _KIMI_MODEL_TYPES else "random"


def kimi_k2_call_id(name: str, index: int) -> str:
    """Kimi-K2's tool call id: functions.<name>:<index>, index counting every call of the conversation (vLLM's
    make_tool_call_id)."""
    return f"functions.{name}:{index}"


def check_tool_options(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolParser | None:
    """The server's parser for tool_choice "auto" (None when it is off); ConfigError for a bad flag combination."""
    if tool_call_parser is not None:
        parser = get_tool_parser(tool_call_parser)
        if not enable_auto_tool_choice:
            raise ConfigError("--tool-call-parser is used only with --enable-auto-tool-choice; pass both, or neither.")
        return parser
    if enable_auto_tool_choice:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser NAME, one of {sorted(TOOL_PARSERS)}.")
    return None


# ---- scanning -------------------------------------------------------------------------------------------------


class _Builder:
    """Content and calls, as a parser finds them: whitespace right after a call is not content."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: list[ParsedCall] = []
        self._after_call = False

    def text(self, piece: str) -> None:
        if self._after_call:
            piece = piece.lstrip()
            self._after_call = not piece
        self._content.append(piece)

    def call(self, call: ParsedCall) -> None:
        self._calls.append(call)
        self._after_call = True

    def result(self, open_call: ParsedCall | None = None) -> Parsed:
        calls = self._calls + ([open_call] if open_call is not None else [])
        return Parsed("".join(self._content), tuple(calls))


def _hold_marker(tail: str, marker: str) -> str:
    """`tail` without its longest ending that could be the start of `marker` (it may become the marker)."""
    for k in range(min(len(tail), len(marker) - 1), 0, -1):
        if tail.endswith(marker[:k]):
            return tail[:-k]
    return tail


def _call_array(text: str, i: int, out: _Builder, final: bool, *, need_arguments: bool = False) -> Parsed | int:
    """The `{"name", "arguments"}` calls of the JSON array opened at text[i] == "[", added to ``out``: the index after
    its "]", or the result so far (a Parsed) while the array is unfinished. NotToolCalls when it is no such array."""
    i = _skip_ws(text, i + 1)
    while True:
        e = _object_call(text, i, out, final, ("arguments",), need_arguments=need_arguments)
        if isinstance(e, Parsed):
            return e
        if e == len(text):
            if final:
                raise NotToolCalls  # the array never closed
            return out.result()
        if text[e] == ",":
            i = _skip_ws(text, e + 1)
            continue
        if text[e] != "]":
            raise NotToolCalls
        return e + 1


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


_SCALAR = re.compile(r"[A-Za-z0-9.+\-]+")


def _json_value_end(s: str, i: int) -> int | None:
    """The index just past the JSON value starting at s[i], or None when the text ends inside it. Only the
    structure is checked here (brackets, strings); json.loads judges a complete value."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
            elif s[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = _json_value_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                stack.append(ch)
            elif ch in "}]":
                if "{[".index(stack.pop()) != "}]".index(ch):
                    raise NotToolCalls
                if not stack:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(s, i)
    if m is None:
        raise NotToolCalls
    return None if m.end() == len(s) else m.end()  # a number or literal may still grow


@dataclasses.dataclass(frozen=True)
class _Object:
    members: dict[str, tuple[int, int | None]]  # key -> (start of its value, end or None while open)
    end: int | None  # index past the closing brace; None while open


def _object_call(text: str, i: int, out: _Builder, final: bool, argument_keys: tuple[str, ...], *,
                 need_arguments: bool = False) -> int | Parsed:
    """The JSON call object that must start at text[i]: added to `out`, and the index after it (whitespace
    skipped). While streaming, a reply that ends before the object does is what `out` holds so far, with the
    partial call (a Parsed to return); in a final reply it, or anything but an object here, is NotToolCalls.
    need_arguments: an object without one of argument_keys is not a call (else its arguments are {})."""
    if i == len(text):
        if final:
            raise NotToolCalls
        return out.result()
    if text[i] != "{":
        raise NotToolCalls
    obj = _scan_object(text, i)
    call = _json_call(text, obj, argument_keys, need_arguments=need_arguments)
    if obj.end is None:
        if final:
            raise NotToolCalls
        return out.result(call)
    out.call(call)
    return _skip_ws(text, obj.end)


def _scan_object(s: str, i: int) -> _Object:
    """The members of the JSON object at s[i] == "{", as far as the text goes."""
    members: dict[str, tuple[int, int | None]] = {}
    j = _skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return _Object(members, j + 1)
    while True:
        if j == len(s):
            return _Object(members, None)
        if s[j] != '"':
            raise NotToolCalls
        key_end = _json_value_end(s, j)
        if key_end is None:
            return _Object(members, None)
        key = _loads(s[j:key_end])
        j = _skip_ws(s, key_end)
        if j == len(s):
            return _Object(members, None)
        if s[j] != ":":
            raise NotToolCalls
        j = _skip_ws(s, j + 1)
        if j == len(s):
            return _Object(members, None)
        end = _json_value_end(s, j)
        if key in members:
            raise NotToolCalls  # a duplicate key: json.loads would keep the last, a stream sent the first
        members[key] = (j, end)
        if end is None:
            return _Object(members, None)
        j = _skip_ws(s, end)
        if j == len(s):
            return _Object(members, None)
        if s[j] == "}":
            return _Object(members, j + 1)
        if s[j] != ",":
            raise NotToolCalls
        j = _skip_ws(s, j + 1)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise NotToolCalls from None


def _json_call(s: str, obj: _Object, argument_keys: tuple[str, ...], *,
               need_arguments: bool = False) -> ParsedCall | None:
    """The call a {"name": ..., "arguments": {...}} object commits to: None until its name is complete."""
    if obj.end is not None:
        extra = {k for k in argument_keys if k in obj.members}
        if "name" not in obj.members or len(extra) > 1 or (need_arguments and not extra):
            raise NotToolCalls
    name_span = obj.members.get("name")
    if name_span is None or name_span[1] is None:
        return None
    name = _loads(s[name_span[0]:name_span[1]])
    if not isinstance(name, str):
        raise NotToolCalls
    spans = [obj.members[k] for k in argument_keys if k in obj.members]
    if not spans:
        return ParsedCall(name, "{}" if obj.end is not None else "", done=obj.end is not None)
    start, end = spans[0]
    if end is not None:
        _loads(s[start:end])  # malformed arguments make the reply content
    return ParsedCall(name, _compact(s[start: len(s) if end is None else end]), done=obj.end is not None)


def _compact(raw: str) -> str:
    """JSON text with json.dumps' spacing: whitespace outside strings dropped, ", " and ": " as separators.
    Character by character, so compacting a prefix gives a prefix of compacting the whole."""
    out: list[str] = []
    in_string = escaped = False
    for ch in raw:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch in " \t\r\n":
            continue
        elif ch in ",:":
            out.append(ch + " ")
        else:
            out.append(ch)
            in_string = ch == '"'
    return "".join(out)


def _py_value_end(s: str, i: int) -> int | None:
    """The index of the "," or ")" that ends the Python literal starting at s[i], or None when the text ends first."""
    depth = 0
    j = i
    while j < len(s):
        ch = s[j]
        if ch in "'\"":
            k = j + 1
            while k < len(s) and s[k] != ch:
                k += 2 if s[k] == "\\" else 1
            if k >= len(s):
                return None
            j = k + 1
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth > 0:
                depth -= 1
            elif ch == ")":
                return j
            else:
                raise NotToolCalls
        elif ch == "," and depth == 0:
            return j
        j += 1
    return None
