"""The server's structured-output fields -> StructuredOutputsParams, and constrained output -> OpenAI `tool_calls`.

Sources, at most one per request (two would silently fight over the grammar):
  - OpenAI `response_format`: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}} (chat and completions, as in vLLM);
  - vLLM's `structured_outputs` object (json / regex / choice / grammar / json_object), and its older spellings
    `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
  - `tools` with `tool_choice` "required" or {"type": "function", "function": {"name": ...}}: the output is
    constrained to a JSON array of {"name", "parameters"} objects (one of the tools each, at least one), or to the
    named function's parameters object, and returned as `tool_calls`. These calls are valid by construction: the
    grammar admits nothing else. `tool_choice` "auto" (the default when tools are sent) needs the server's
    --enable-auto-tool-choice --tool-call-parser NAME: the model then generates freely and the parser
    (trtopt.serving.tool_parsers) finds its calls; without them "auto" is refused. "none" ignores the tools.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                          guided: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None. RequestError (a 400) for malformed or conflicting fields."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = _response_format(response_format)
    if rf is not None:
        found.append(("response_format", rf))
    if structured_outputs:
        allowed = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(structured_outputs) - allowed)
        if unknown:
            raise RequestError(f"structured_outputs has unknown fields {unknown}; use {sorted(allowed)}.")
        found.append(("structured_outputs", StructuredOutputsParams(**structured_outputs)))
    for field, value in guided.items():
        if value is not None:
            found.append((field, StructuredOutputsParams(**{_GUIDED[field]: value})))
    if len(found) > 1:
        raise RequestError(f"set one structured-output field, not {[name for name, _ in found]}.")
    return found[0][1] if found else None


def _response_format(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if rf is None or rf.get("type") == "text":
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}.")
        return StructuredOutputsParams(json=schema)
    raise RequestError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'.")


# ---- tools ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCallPlan:
    """How a request's output becomes tool calls. named: the output is the function's arguments object;
    required: the output is a JSON array of {"name": ..., "parameters": {...}}."""

    named: str | None  # the function's name for a named tool_choice; None for "required"
    constraint: StructuredOutputsParams

    @property
    def finish_reason(self) -> str:
        # OpenAI's values: "tool_calls" when the model chose to call tools, "stop" when one was forced by name.
        return "stop" if self.named else "tool_calls"


def is_auto_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> bool:
    """Whether the model decides itself whether to call a tool: tools sent, and tool_choice "auto" or unset."""
    return bool(tools) and tool_choice in (None, "auto")


def tool_call_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, *,
                   auto_tool_choice: bool = False) -> ToolCallPlan | None:
    """None when the request has no tools, tool_choice "none", or "auto" with auto_tool_choice (the server's
    --enable-auto-tool-choice: no grammar, a parser reads the calls); RequestError for "auto" without it and for
    malformed tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs a non-empty tools list.")
        return None
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        if auto_tool_choice:
            _functions(tools)  # well-formed tools, even though no grammar is built from them
            return None
        raise RequestError(
            "tool_choice 'auto' (the default when tools are given) requires the server to run with "
            "--enable-auto-tool-choice --tool-call-parser NAME (for a model trained to call tools; vLLM's flags). "
            "Or use tool_choice 'required' or {'type': 'function', 'function': {'name': ...}}, which constrain the "
            "output to a valid call.")
    functions = _functions(tools)
    if tool_choice == "required":
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": _hoist_refs(name, params, defs)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if defs:
            schema["$defs"] = defs
        return ToolCallPlan(None, StructuredOutputsParams(json=schema))
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise RequestError(f"tool_choice {tool_choice!r} must be 'none', 'required' or {{'type': 'function', "
                           "'function': {'name': ...}}.")
    if name not in functions:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools {sorted(functions)}.")
    return ToolCallPlan(name, StructuredOutputsParams(json=functions[name]))


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}.")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise RequestError(f"tool {fn['name']!r}: parameters must be a JSON schema object.")
        out[fn["name"]] = params
    return out


def _hoist_refs(function: str, params: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``params`` rewritten to sit inside the "required" array schema: a local ``$ref`` ("#/$defs/X",
    "#/definitions/X", "#", "#/properties/...") resolves against the document root, which is no longer the
    function's schema, so its definitions move to the root's ``$defs`` under a per-function prefix and every local
    reference is rewritten to match (pydantic writes ``$defs`` for every nested model)."""
    prefix = f"{function}__"
    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    own = {**(params.get("definitions") or {}), **(params.get("$defs") or {})}
    needs_root = False

    def ref(target: str) -> str:
        nonlocal needs_root
        for head in ("#/$defs/", "#/definitions/"):
            if target.startswith(head):
                return f"#/$defs/{prefix}{target[len(head):]}"
        needs_root = True  # "#" or a path into the function's own schema
        return f"#/$defs/{prefix}_root{target[1:]}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    out = rewrite(body)
    for key, value in own.items():
        defs[prefix + key] = rewrite(value)
    if needs_root:
        defs[prefix + "_root"] = out
        return {"$ref": f"#/$defs/{prefix}_root"}
    return out


def tool_calls(plan: ToolCallPlan, text: str) -> list[dict[str, Any]]:
    """The OpenAI `tool_calls` of a finished output. The grammar admitted only valid calls, so a text that does not
    parse was cut short (max_tokens): RequestError-free, it yields no calls and the caller keeps finish_reason."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if plan.named is not None:
        return [_call(plan.named, value)]
    return [_call(c["name"], c["parameters"]) for c in value]


def partial_call(name: str, arguments_text: str) -> dict[str, Any]:
    """A named call cut short (max_tokens): its arguments as generated, the JSON unfinished, as they were streamed."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments_text}}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
