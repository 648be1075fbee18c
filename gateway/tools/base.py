"""What every tool-call format shares: the results (`ToolCall`, `ParsedOutput`), the streamer
base (`ToolCallStreamer`) and the parser base (`ToolParser`), and small helpers on OpenAI tool
objects.

Results: content is, with no call, the whole output verbatim; with calls, the text around
them, leaving out stretches that are only whitespace (the newlines between blocks); None when
nothing is left. `arguments` is always the JSON text `json.dumps(value, ensure_ascii=False)`.

Streaming: a streamer emits content while the text cannot be part of a call and holds back
what might be (a partial opening tag, a whitespace-only stretch before a call). A call is
announced (`{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}]}`) once its name is known to be valid and its arguments have begun (an
object) or are complete; then its arguments follow as `{"tool_calls": [{"index", "function":
{"arguments": piece}}]}`, re-serialised on the fly in the `json.dumps` form, so for any split of
the same text the streamed content and the concatenated arguments equal `parse(text)` (the
arguments as parsed JSON; as text too unless an object repeats a key). The exception, which no
streaming parser can avoid: a call already announced whose text then breaks (invalid JSON past
the name, or the output cut short) cannot be taken back; the rest of its text is appended raw to
its arguments, while `parse` keeps the whole block as content.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from gateway.tools.json_stream import WS

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that is a proper beginning of `tag`."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def plain(value: Any) -> Any:
    """A pydantic model (or anything with model_dump) as plain data; others unchanged."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value


@dataclass(frozen=True)
class ToolCall:
    """One function call: `arguments` is JSON text (an object, `json.dumps` form)."""

    id: str
    name: str
    arguments: str

    @classmethod
    def new(cls, name: str, arguments: str) -> "ToolCall":
        return cls(new_call_id(), name, arguments)

    def to_openai(self) -> dict:
        """The `tool_calls` entry of an OpenAI assistant message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into message content and calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_message(self) -> dict:
        """The OpenAI response `message`: role, content and `tool_calls` when there are any."""
        out: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out


def assemble(text: str, segments: list[str], calls: list[ToolCall]) -> ParsedOutput:
    if not calls:
        return ParsedOutput(text, [])
    content = "".join(s for s in segments if s.strip(WS))
    return ParsedOutput(content or None, calls)


def tool_names(tools: Iterable[Mapping] | None) -> frozenset[str] | None:
    if tools is None:
        return None
    return frozenset(function_of(t).get("name") for t in tools)


def function_of(tool: Mapping) -> Mapping:
    """The function object of an OpenAI tool (a bare function object is accepted too)."""
    fn = tool.get("function")
    return fn if isinstance(fn, Mapping) else tool


def arguments_value(arguments: Any) -> Any:
    """A call's arguments as a template wants them: a JSON-object string becomes a dict."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


class ToolCallStreamer:
    """Incremental parsing of one output: `feed(text_delta)` and, once, `finish()` return lists
    of OpenAI chat-chunk `delta` dicts ({"content": ...} or {"tool_calls": [...]}); `tool_calls`
    lists the calls announced so far with their arguments as streamed."""

    def __init__(self, max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        self._deltas: list[dict] = []
        self._calls: list[list] = []        # [id, name, [argument pieces]]
        self._seen_calls = 0                # calls in the text, dropped ones included
        self._current: int | None = None    # index of the call receiving arguments
        self._seg_text = False              # the current content stretch has non-whitespace
        self._seg_ws = ""                   # its whitespace so far, while it has nothing else
        self._finished = False

    # -- what subclasses call
    def _content(self, text: str) -> None:
        if not text:
            return
        if not self._seg_text:
            if not text.strip(WS):
                self._seg_ws += text
                return
            text, self._seg_ws, self._seg_text = self._seg_ws + text, "", True
        self._push({"content": text})

    def _open_call(self, name: str) -> None:
        """A call begins: the content stretch before it ends (dropped if only whitespace)."""
        self._seg_ws, self._seg_text = "", False
        self._seen_calls += 1
        if self._max_calls is not None and self._seen_calls > self._max_calls:
            self._current = None
            return
        call_id = new_call_id()
        self._current = len(self._calls)
        self._calls.append([call_id, name, []])
        self._deltas.append({"tool_calls": [{"index": self._current, "id": call_id,
                                             "type": "function",
                                             "function": {"name": name, "arguments": ""}}]})

    def _args(self, text: str) -> None:
        if not text or self._current is None:
            return
        self._calls[self._current][2].append(text)
        self._push({"tool_calls": [{"index": self._current, "function": {"arguments": text}}]})

    def _push(self, delta: dict) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif (last is not None and "tool_calls" in delta and "tool_calls" in last
              and "id" not in last["tool_calls"][0]
              and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]):
            last["tool_calls"][0]["function"]["arguments"] += (
                delta["tool_calls"][0]["function"]["arguments"])
        else:
            self._deltas.append(delta)

    def _take(self) -> list[dict]:
        out, self._deltas = self._deltas, []
        return out

    # -- the interface
    def feed(self, text: str) -> list[dict]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        rest = text
        while rest:
            rest = self._step(rest)
        return self._take()

    def finish(self) -> list[dict]:
        if not self._finished:
            self._finished = True
            self._flush()
            if self._seg_ws and not self._seen_calls:
                self._push({"content": self._seg_ws})
            self._seg_ws = ""
        return self._take()

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(i, name, "".join(parts)) for i, name, parts in self._calls]

    # -- what subclasses implement
    def _step(self, text: str) -> str:
        """Consume a beginning of `text`; return what is left (maybe with held text re-queued)."""
        raise NotImplementedError

    def _flush(self) -> None:
        """The output has ended: settle whatever is held."""
        raise NotImplementedError


class ToolParser:
    """A `--tool-call-parser` output format: parsing plus the text forms the default rendering
    uses. `tools` (the request's tools) restricts valid names; None accepts any name;
    `max_calls` keeps only the first calls (parallel_tool_calls=false: 1)."""

    name = ""

    def __init__(self, tools: Sequence[Mapping] | None = None,
                 max_calls: int | None = None) -> None:
        self.names = tool_names(tools)
        self.max_calls = max_calls

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def streamer(self) -> ToolCallStreamer:
        raise NotImplementedError

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.max_calls is None else calls[:self.max_calls]

    # -- text forms for the default rendering
    @classmethod
    def system_prompt(cls, tools: Sequence[Mapping]) -> str:
        raise NotImplementedError

    @classmethod
    def calls_text(cls, calls: Sequence[tuple[str, Any]]) -> str:
        """The text the model writes for these (name, arguments) calls."""
        raise NotImplementedError

    @classmethod
    def response_text(cls, content: str, name: str | None) -> str:
        """How one tool result is shown to the model."""
        raise NotImplementedError
