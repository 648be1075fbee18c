"""Forced calls: tool_choice "required" and a named function. The output is constrained by a
JSON schema for the grammar engine (`required_schema`, `named_schema`), so it always parses
unless generation was cut short; these parsers and streamers read that constrained form.

- "required": `[{"name": <a tool's name>, "parameters": {...}}, ...]`, at least one call (one
  at most when parallel_tool_calls is false);
- named: the function's arguments object itself.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from gateway.tools.base import (ParsedOutput, ToolCall, ToolCallStreamer, function_of,
                                tool_names)
from gateway.tools.call_object import PAIRS_DECODER, CallReader, call_fields
from gateway.tools.json_stream import OPEN, WS, Canon, JsonError, JsonLexer, dumps


def _parameters(fn: Mapping) -> dict:
    params = fn.get("parameters")
    if not params:
        return {"type": "object", "properties": {}}
    params = dict(params)
    params.setdefault("type", "object")
    return params


_DEFS_KEYS = ("$defs", "definitions")


def _pointer_token(text: str) -> str:
    return text.replace("~", "~0").replace("/", "~1")


def _rehome_refs(node: Any, prefix_of: dict[str, str]) -> Any:
    """A copy of `node` whose local "$ref"s into its $defs/definitions point at the shared
    root $defs under the tool's prefix."""
    if isinstance(node, list):
        return [_rehome_refs(v, prefix_of) for v in node]
    if not isinstance(node, Mapping):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            for defs_key, prefix in prefix_of.items():
                head = f"#/{defs_key}/"
                if value.startswith(head):
                    value = f"#/$defs/{prefix}" + value[len(head):]
                    break
        out[key] = _rehome_refs(value, prefix_of)
    return out


def required_schema(tools: Sequence[Mapping], parallel_tool_calls: bool | None = True) -> dict:
    """The JSON schema of tool_choice="required" output: an array of at least one
    {"name": <a tool's name>, "parameters": <that tool's parameters>} (at most one when
    parallel_tool_calls is false). Each tool's own $defs move to the root under
    "<name>." so its "$ref"s still resolve."""
    items, root_defs = [], {}
    for tool in tools:
        fn = function_of(tool)
        name = fn["name"]
        params = _parameters(fn)
        own = {key: params.pop(key) for key in _DEFS_KEYS
               if isinstance(params.get(key), Mapping)}
        if own:
            prefix_of = {key: _pointer_token(f"{name}.") for key in own}
            params = _rehome_refs(params, prefix_of)
            for defs in own.values():
                for def_name, sub in defs.items():
                    root_defs[f"{name}.{def_name}"] = _rehome_refs(sub, prefix_of)
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                    "minItems": 1}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if root_defs:
        schema["$defs"] = root_defs
    return schema


def named_schema(tool: Mapping) -> dict:
    """The JSON schema of a named tool_choice's output: the function's parameters (an object
    with no properties when it has none)."""
    return _parameters(function_of(tool))


def calls_from_required(text: str, tools: Sequence[Mapping] | None = None) -> list[ToolCall]:
    """The calls of a whole "required" output; ValueError when the text is not that array
    (only possible when generation was cut short)."""
    try:
        value = PAIRS_DECODER.decode(text)
    except RecursionError:
        raise ValueError("the output is nested too deeply") from None
    if not isinstance(value, list) or not value:
        raise ValueError("the output is not a non-empty JSON array of calls")
    names, calls = tool_names(tools), []
    for item in value:
        got = call_fields(item, names, ("parameters", "arguments"))
        if got is None:
            raise ValueError("an element of the output is not a call of one of the tools")
        calls.append(ToolCall.new(*got))
    return calls


def call_from_named(name: str, text: str) -> ToolCall:
    """The call of a whole named-function output (its arguments object); ValueError when the
    text is not a JSON object."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("the output is nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError("the output is not a JSON object")
    return ToolCall.new(name, dumps(value))


class RequiredStreamer(ToolCallStreamer):
    """Streams `[{"name": ..., "parameters": {...}}, ...]` (the "required" constrained form).
    Text that cannot be read as calls (only when the output was cut short) is content while no
    call was announced for it, else raw arguments of the announced call."""

    def __init__(self, names: frozenset[str] | None) -> None:
        super().__init__()
        self._names = names
        self._lexer = JsonLexer("[")
        self._reader: CallReader | None = None
        self._committed = False      # the element being read was announced
        self._raw = ""               # raw text that is content if it turns out not to be calls
        self._state = "json"         # json | content | broken | after

    def _step(self, text: str) -> str:
        state = self._state
        if state == "content":
            self._content(text)
            return ""
        if state == "broken":
            self._args(text)
            return ""
        if state == "after":         # past the array: whitespace is dropped, the rest content
            self._raw += text
            return ""
        for i, ch in enumerate(text):
            self._raw += ch
            if self._lexer.state == "start" and ch in WS:
                continue
            try:
                for kind, depth, payload in self._lexer.push(ch):
                    self._event(kind, depth, payload)
            except JsonError:
                if self._committed:
                    self._args(self._lexer.raw_pending)
                    self._state = "broken"
                else:
                    self._state = "content"
                    self._content(self._raw)
                    self._raw = ""
                return text[i + 1:]
            if self._lexer.done:
                self._state, self._raw = "after", ""
                return text[i + 1:]
        return ""

    def _event(self, kind: int, depth: int, payload: Any) -> None:
        if depth == 0:
            return                        # the array's own brackets
        if depth == 1 and kind == OPEN:
            self._reader = CallReader(self._names, ("parameters", "arguments"), base=1)
            self._committed = False
            if self._seen_calls:
                self._raw = payload
        elif self._reader is None:
            raise JsonError("each call must be an object")
        self._reader.event(kind, depth, payload)
        if not self._committed and self._reader.ready:
            self._committed = True
            self._open_call(self._reader.name)
        if self._committed:
            self._args(self._reader.take())
        if self._reader.closed:
            self._reader, self._committed, self._raw = None, False, ""

    def _flush(self) -> None:
        if self._state == "json":
            if self._committed:
                self._args(self._lexer.raw_pending)
            else:
                self._content(self._raw)
        elif self._state == "after" and self._raw.strip(WS):
            self._content(self._raw)
        self._raw = ""


class NamedStreamer(ToolCallStreamer):
    """Streams a named function's arguments object (the named constrained form)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._lexer = JsonLexer("{")
        self._canon = Canon()
        self._broken = False

    def _step(self, text: str) -> str:
        if not self._calls:
            self._open_call(self._name)
        if self._broken:
            self._args(text)
            return ""
        if self._lexer.done:         # past the object: whitespace is dropped
            if text.strip(WS):
                self._broken = True
                self._args(text)
            return ""
        for i, ch in enumerate(text):
            if self._lexer.state == "start" and ch in WS:
                continue
            try:
                events = self._lexer.push(ch)
            except JsonError:
                self._args(self._lexer.raw_pending)
                self._broken = True
                return text[i + 1:]
            self._args("".join(self._canon.event(kind, payload) for kind, _, payload in events))
            if self._lexer.done:
                return text[i + 1:]
        return ""

    def _flush(self) -> None:
        if not self._calls:
            self._open_call(self._name)
        if not self._broken and not self._lexer.done:
            self._args(self._lexer.raw_pending)


class RequiredCallsParser:
    """Output parser for tool_choice="required" (constrained by `required_schema`). A whole
    output that does not parse (cut short) is returned as content."""

    def __init__(self, tools: Sequence[Mapping]) -> None:
        self.tools = list(tools)
        self.names = tool_names(self.tools)

    def parse(self, text: str) -> ParsedOutput:
        try:
            return ParsedOutput(None, calls_from_required(text, self.tools))
        except ValueError:
            return ParsedOutput(text, [])

    def streamer(self) -> ToolCallStreamer:
        return RequiredStreamer(self.names)


class NamedCallParser:
    """Output parser for a named tool_choice (constrained by `named_schema`): always one call;
    an output that does not parse (cut short) keeps its raw text as the arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
        try:
            return ParsedOutput(None, [call_from_named(self.name, text)])
        except ValueError:
            return ParsedOutput(None, [ToolCall.new(self.name, text)])

    def streamer(self) -> ToolCallStreamer:
        return NamedStreamer(self.name)
