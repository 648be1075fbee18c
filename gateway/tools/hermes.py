"""The `hermes` tool-call format (Hermes, Qwen): calls are `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>` blocks anywhere in the text, as many as the model writes;
`</tool_call>` may be missing after the last one. Text around the blocks is the message content.
Tool results are shown to the model as `<tool_response>\\n...\\n</tool_response>`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gateway.tools.base import (ParsedOutput, ToolCallStreamer, ToolParser, arguments_value,
                                assemble, partial_suffix)
from gateway.tools.call_object import ObjectCallMixin, decode_call
from gateway.tools.json_stream import dumps, skip_ws


class HermesStreamer(ObjectCallMixin, ToolCallStreamer):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str] | None, max_calls: int | None) -> None:
        super().__init__(max_calls)
        self._names, self._arg_keys = names, ("arguments", "parameters")
        self._state = "content"
        self._hold = ""

    def _step(self, text: str) -> str:
        state = self._state
        if state == "content":
            buf, self._hold = self._hold + text, ""
            k = buf.find(self.OPEN)
            if k >= 0:
                self._content(buf[:k])
                self._state = "call"
                self._start_object()
                return buf[k + len(self.OPEN):]
            keep = partial_suffix(buf, self.OPEN)
            self._content(buf[:len(buf) - keep])
            self._hold = buf[len(buf) - keep:]
            return ""
        if state == "call":
            outcome, rest = self._object_chars(text)
            if outcome == "malformed":
                return self._rollback() + rest
            if outcome == "broken":
                self._state = "broken"
            elif outcome == "done":
                self._state = "after"
            return rest
        if state == "after":                  # ws* and an optional </tool_call>
            buf, self._hold = self._hold + text, ""
            j = skip_ws(buf, 0)
            if buf.startswith(self.CLOSE, j):
                self._state = "content"
                return buf[j + len(self.CLOSE):]
            if self.CLOSE.startswith(buf[j:]):
                self._hold = buf
                return ""
            self._state = "content"
            return buf
        # broken: raw arguments up to </tool_call>
        buf, self._hold = self._hold + text, ""
        k = buf.find(self.CLOSE)
        if k >= 0:
            self._args(buf[:k])
            self._state = "content"
            return buf[k + len(self.CLOSE):]
        keep = partial_suffix(buf, self.CLOSE)
        self._args(buf[:len(buf) - keep])
        self._hold = buf[len(buf) - keep:]
        return ""

    def _rollback(self) -> str:
        """The block is not a call: its tag is content; the text after it is read again."""
        raw = self._raw
        self._state = "content"
        self._start_object()
        self._content(self.OPEN)
        return raw

    def _flush(self) -> None:
        while self._state == "call" and not self._object_eof():
            rest = self._rollback()
            while rest:
                rest = self._step(rest)
        if self._state == "broken":
            self._args(self._hold)
        elif self._state in ("content", "after"):
            self._content(self._hold)
        self._hold = ""


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = HermesStreamer.OPEN, HermesStreamer.CLOSE

    def parse(self, text: str) -> ParsedOutput:
        segments, calls, pos, current = [], [], 0, []
        while True:
            k = text.find(self.OPEN, pos)
            if k < 0:
                current.append(text[pos:])
                break
            current.append(text[pos:k])
            got = decode_call(text, skip_ws(text, k + len(self.OPEN)), self.names,
                              ("arguments", "parameters"))
            if got is None:
                current.append(self.OPEN)
                pos = k + len(self.OPEN)
                continue
            calls.append(got[0])
            segments.append("".join(current))
            current = []
            m = skip_ws(text, got[1])
            pos = m + len(self.CLOSE) if text.startswith(self.CLOSE, m) else got[1]
        segments.append("".join(current))
        return assemble(text, segments, self._limit(calls) if calls else calls)

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer(self.names, self.max_calls)

    @classmethod
    def system_prompt(cls, tools: Sequence[Mapping]) -> str:
        listing = "\n".join(dumps(dict(t)) for t in tools)
        return ("# Tools\n\n"
                "You can call functions to help with the request. They are described below, "
                "one JSON object per line, between <tools> and </tools>:\n"
                f"<tools>\n{listing}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and its arguments "
                "between <tool_call> and </tool_call>:\n"
                '<tool_call>\n{"name": "<function name>", "arguments": {"<argument>": <value>}}'
                "\n</tool_call>\n"
                "Write one such block per call; several calls are allowed. Results come back "
                "between <tool_response> and </tool_response>.")

    @classmethod
    def calls_text(cls, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(f"{cls.OPEN}\n"
                         + dumps({"name": name, "arguments": arguments_value(args)})
                         + f"\n{cls.CLOSE}" for name, args in calls)

    @classmethod
    def response_text(cls, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
