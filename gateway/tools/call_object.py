"""One call object `{"name": ..., <arguments key>: {...}}`, read whole (`decode_call`,
`call_fields`) or streamed (`CallReader` over lexer events, `ObjectCallMixin` for streamers).

The rules, the same both ways: "arguments" may also be a JSON string holding an object; a
missing one means `{}`; other keys are ignored; when "name" or the arguments key repeats, the
first wins. A call is malformed (and stays in the content, as the model wrote it) when its text
is not JSON, not an object, has a name that is not among the request's tools, or arguments that
are not an object.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.tools.base import ToolCall
from gateway.tools.json_stream import (CLOSE, KEY, OPEN, STR_CHUNK, STR_END, STR_START, WS, Canon,
                                       JsonError, JsonLexer, dumps)

_MISSING = object()


class CallReader:
    """Follows the lexer events of one call object {"name": ..., <arguments key>: {...}} whose
    opening brace sits at depth `base`; raises JsonError when it cannot be a valid call.

    `ready`: the name is valid and the arguments have begun as an object or are complete, so the
    call may be announced. `take()` returns the arguments text (json.dumps form) read since the
    last take. `closed`: the object ended."""

    def __init__(self, names: frozenset[str] | None, arg_keys: tuple[str, ...],
                 base: int = 0) -> None:
        self.names = names
        self.arg_keys = arg_keys
        self.base = base
        self.name: str | None = None
        self.closed = False
        self.args_open = False       # the arguments object is being read
        self.args_done = False
        self._seen_name = self._seen_args = False
        self._role: str | None = None
        self._name_buf: str | None = None
        self._arg_str: list[str] | None = None
        self._canon: Canon | None = None
        self._pending: list[str] = []

    @property
    def ready(self) -> bool:
        return self.name is not None and (self.args_open or self.args_done)

    def take(self) -> str:
        text = "".join(self._pending)
        self._pending.clear()
        return text

    def event(self, kind: int, depth: int, payload: Any) -> None:
        base = self.base
        if depth == base:
            if kind == OPEN:
                if payload != "{":
                    raise JsonError("a call must be a JSON object")
                return
            if kind == CLOSE:
                if self.name is None:
                    raise JsonError("the call has no name")
                if not self._seen_args:
                    self._pending.append("{}")
                    self.args_done = True
                self.closed = True
                return
            raise JsonError("a call must be a JSON object")
        if depth == base + 1 and kind == KEY:
            if payload == "name" and not self._seen_name:
                self._seen_name, self._role = True, "name"
            elif payload in self.arg_keys and not self._seen_args:
                self._seen_args, self._role = True, "args"
            else:
                self._role = "skip"
            return
        role = self._role
        if role == "name":
            self._name_event(kind, depth, payload)
        elif role == "args":
            self._args_event(kind, depth, payload)

    def _name_event(self, kind: int, depth: int, payload: Any) -> None:
        if kind == STR_START:
            self._name_buf = ""
        elif kind == STR_CHUNK:
            self._name_buf += payload
        elif kind == STR_END:
            name, self._name_buf, self._role = self._name_buf, None, None
            if not name or (self.names is not None and name not in self.names):
                raise JsonError(f"unknown function {name!r}")
            self.name = name
        else:
            raise JsonError("the name must be a string")

    def _args_event(self, kind: int, depth: int, payload: Any) -> None:
        if self._canon is not None:                       # inside the arguments object
            self._pending.append(self._canon.event(kind, payload))
            if kind == CLOSE and depth == self.base + 1:
                self._canon, self._role = None, None
                self.args_open, self.args_done = False, True
            return
        if self._arg_str is not None:                     # arguments given as a JSON string
            if kind == STR_CHUNK:
                self._arg_str.append(payload)
                return
            text, self._arg_str, self._role = "".join(self._arg_str), None, None
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise JsonError("the arguments string is not JSON") from None
            if not isinstance(value, dict):
                raise JsonError("the arguments must be an object")
            self._pending.append(dumps(value))
            self.args_done = True
            return
        if kind == OPEN and payload == "{":
            self._canon = Canon()
            self._pending.append(self._canon.event(kind, payload))
            self.args_open = True
        elif kind == STR_START:
            self._arg_str = []
        else:
            raise JsonError("the arguments must be an object")


class _Pairs(dict):
    """A decoded JSON object that remembers its key/value pairs in order (first key wins)."""

    __slots__ = ("pairs",)


def _pairs_hook(pairs: list) -> _Pairs:
    obj = _Pairs(pairs)
    obj.pairs = pairs
    return obj


PAIRS_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_hook)


def call_fields(obj: Any, names: frozenset[str] | None,
                arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded call object, or None when it is not a valid
    call: the same rules as CallReader."""
    if not isinstance(obj, _Pairs):
        return None
    name = args = _MISSING
    for key, value in obj.pairs:
        if key == "name":
            if name is _MISSING:
                name = value
        elif key in arg_keys and args is _MISSING:
            args = value
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    if args is _MISSING:
        return name, "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return name, dumps(args)


def decode_call(text: str, pos: int, names: frozenset[str] | None,
                arg_keys: tuple[str, ...]) -> tuple[ToolCall, int] | None:
    """The call object starting at text[pos] ("{") and where it ends, or None."""
    if not text.startswith("{", pos):
        return None
    try:
        obj, end = PAIRS_DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    got = call_fields(obj, names, arg_keys)
    return None if got is None else (ToolCall.new(*got), end)


class ObjectCallMixin:
    """The part of a streamer that reads one call object through CallReader."""

    _names: frozenset[str] | None
    _arg_keys: tuple[str, ...]

    def _start_object(self) -> None:
        self._lexer: JsonLexer | None = None
        self._reader: CallReader | None = None
        self._raw = ""                    # raw text since the call began (for a rollback)
        self._committed = False

    def _object_chars(self, text: str) -> tuple[str, str]:
        """Feed characters of the call object. Returns (outcome, rest): outcome "more" (all
        consumed), "done", "malformed" (before the call was announced: roll back) or "broken"
        (after: `rest` and later text are raw arguments)."""
        for i, ch in enumerate(text):
            self._raw += ch
            if self._lexer is None:
                if ch in WS:
                    continue
                self._lexer = JsonLexer("{")
                self._reader = CallReader(self._names, self._arg_keys)
            try:
                for kind, depth, payload in self._lexer.push(ch):
                    self._reader.event(kind, depth, payload)
            except JsonError:
                if not self._committed:
                    return "malformed", text[i + 1:]
                self._args(self._lexer.raw_pending)
                return "broken", text[i + 1:]
            if not self._committed and self._reader.ready:
                self._committed = True
                self._open_call(self._reader.name)
            if self._committed:
                self._args(self._reader.take())
            if self._lexer.done:
                return "done", text[i + 1:]
        return "more", ""

    def _object_eof(self) -> bool:
        """The output ended inside a call object: True when it had been announced (its held raw
        text is appended to the arguments), False when it must roll back."""
        if self._committed and self._lexer is not None:
            self._args(self._lexer.raw_pending)
            return True
        return False
