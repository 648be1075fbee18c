"""The `llama3_json` tool-call format (Llama 3.x JSON tool calling): the whole output is the
call(s): optional whitespace and `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`
objects ("arguments" is accepted too) separated by `;`. Output that does not start like that is
plain content; text after the last call is content. Tool results are shown to the model as
`Function result (name): ...`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gateway.tools.base import (ParsedOutput, ToolCallStreamer, ToolParser, arguments_value,
                                assemble)
from gateway.tools.call_object import ObjectCallMixin, decode_call
from gateway.tools.json_stream import dumps, skip_ws


class Llama3Streamer(ObjectCallMixin, ToolCallStreamer):
    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str] | None, max_calls: int | None) -> None:
        super().__init__(max_calls)
        self._names, self._arg_keys = names, ("parameters", "arguments")
        self._state = "start"
        self._hold = ""          # start / after: text not yet judged
        self._since = ""         # text since the end of the last call (or the start)

    def _begin_call(self, before: str) -> None:
        self._since += before
        self._state = "call"
        self._start_object()

    def _step(self, text: str) -> str:
        state = self._state
        if state == "start":
            buf, self._hold = self._hold + text, ""
            j = skip_ws(buf, 0)
            if buf.startswith(self.TAG, j):
                j = skip_ws(buf, j + len(self.TAG))
            elif j < len(buf) and self.TAG.startswith(buf[j:]):
                self._hold = buf
                return ""
            if j == len(buf):
                self._hold = buf
                return ""
            if buf[j] == "{":
                self._begin_call(buf[:j])
                return buf[j:]
            self._state = "plain"
            return buf
        if state == "call":
            outcome, rest = self._object_chars(text)
            if outcome == "malformed":
                self._state = "plain"
                raw, self._since = self._since + self._raw, ""
                return raw + rest
            if outcome == "broken":
                self._state = "broken"
            elif outcome == "done":
                self._state, self._since = "after", ""
            return rest
        if state == "after":
            buf, self._hold = self._hold + text, ""
            j = skip_ws(buf, 0)
            if j == len(buf):
                self._hold = buf
                return ""
            if buf[j] == ";":
                self._since, self._state = buf[:j + 1], "semi"
                return buf[j + 1:]
            self._state = "plain"
            return buf
        if state == "semi":
            j = skip_ws(text, 0)
            if j == len(text):
                self._since += text
                return ""
            if text[j] == "{":
                self._begin_call(text[:j])
                return text[j:]
            self._state = "plain"
            since, self._since = self._since, ""
            return since + text
        if state == "plain":
            self._content(text)
            return ""
        self._args(text)                  # broken
        return ""

    def _flush(self) -> None:
        if self._state == "call" and not self._object_eof():
            self._state = "plain"
            self._content(self._since + self._raw)
        elif self._state in ("start", "after"):
            self._content(self._hold)     # "semi": a trailing ';' is dropped
        self._hold = self._since = ""


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = Llama3Streamer.TAG

    def parse(self, text: str) -> ParsedOutput:
        keys = ("parameters", "arguments")
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        got = decode_call(text, i, self.names, keys)
        if got is None:
            return ParsedOutput(text, [])
        calls, pos = [got[0]], got[1]
        while True:
            j = skip_ws(text, pos)
            if not text.startswith(";", j):
                break
            k = skip_ws(text, j + 1)
            if k == len(text):
                pos = k                   # a trailing ';' is dropped
                break
            got = decode_call(text, k, self.names, keys)
            if got is None:
                break
            calls.append(got[0])
            pos = got[1]
        return assemble(text, [text[pos:]], self._limit(calls))

    def streamer(self) -> ToolCallStreamer:
        return Llama3Streamer(self.names, self.max_calls)

    @classmethod
    def system_prompt(cls, tools: Sequence[Mapping]) -> str:
        listing = "\n".join(dumps(dict(t)) for t in tools)
        return ("You can call functions to help with the request. They are described below, "
                f"one JSON object per line:\n{listing}\n\n"
                "To call a function, answer with only a JSON object of the form "
                '{"name": "<function name>", "parameters": {"<argument>": <value>}} and '
                'nothing else; for several calls, separate the objects with "; ". '
                'Results come back in user messages starting with "Function result".')

    @classmethod
    def calls_text(cls, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(dumps({"name": name, "parameters": arguments_value(args)})
                         for name, args in calls)

    @classmethod
    def response_text(cls, content: str, name: str | None) -> str:
        return f"Function result ({name}): {content}" if name else f"Function result: {content}"
