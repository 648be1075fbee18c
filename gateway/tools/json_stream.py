"""An incremental JSON lexer, and the `json.dumps` form of what it reads, piece by piece.

Streamed tool calls are read a character at a time: `JsonLexer` accepts exactly what
`json.loads` accepts and reports what it read as events; `Canon` turns those events back into
`json.dumps` text as they come, so streamed arguments equal those a whole parse produces.
"""

from __future__ import annotations

import json
import re
from typing import Any

WS = " \t\n\r"              # JSON whitespace; also what "whitespace-only content" means here


def dumps(value: Any) -> str:
    """The one text form of JSON values here: `json.dumps` without ASCII escapes."""
    return json.dumps(value, ensure_ascii=False)


def skip_ws(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in WS:
        pos += 1
    return pos


class JsonError(ValueError):
    """The text is not JSON, or not the JSON a call needs."""


OPEN, CLOSE, KEY, STR_START, STR_CHUNK, STR_END, SCALAR = range(7)
_NUMBER_CHARS = frozenset("+-0123456789.eE")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_STRING_STATES = frozenset(("string", "escape", "unicode", "pair_digits", "pair_backslash",
                            "pair_u"))


class JsonLexer:
    """Reads one JSON object or array a character at a time and accepts exactly what `json.loads`
    accepts (NaN and Infinity included, control characters in strings refused, surrogate pairs
    of \\u escapes joined).

    `push(ch)` returns events `(kind, depth, payload)`: OPEN / CLOSE ("{" "[" / "}" "]"),
    KEY (the whole key), STR_START / STR_CHUNK (decoded text) / STR_END for string values,
    SCALAR (a number or literal in `json.dumps` form). `depth` counts the containers around the
    event (an opening bracket is outside its own container, a closing one too). `done` turns true
    on the character that closes the top-level value; raises JsonError on invalid text.
    `raw_pending` is raw text not yet shown by an event (the token being read, at least).
    """

    def __init__(self, top: str = "{") -> None:
        self.top = top
        self.stack: list[str] = []
        self.state = "start"
        self.done = False
        self.raw_pending = ""
        self._buf = ""            # number / literal / key text
        self._hexbuf = ""         # \u digits
        self._key = False         # the string being read is a key
        self._high = 0            # a high surrogate waiting for its pair
        self._out: list[tuple] = []

    def push(self, ch: str) -> list[tuple]:
        if self.done:
            raise JsonError("text after the end of the value")
        self.raw_pending += ch
        self._out = []
        self._char(ch)
        if self._out:
            self.raw_pending = ""
        return self._out

    def _emit(self, kind: int, payload: Any = None) -> None:
        self._out.append((kind, len(self.stack), payload))

    def _char(self, ch: str) -> None:
        """One character, by what is being read: a string, a number, a literal, or the
        structure between tokens (where whitespace is skipped)."""
        state = self.state
        if state in _STRING_STATES:
            self._string_char(ch, state)
        elif state == "number":
            self._number_char(ch)
        elif state == "literal":
            self._buf += ch
            if self._buf in _LITERALS:
                self._emit(SCALAR, self._buf)
                self.state = "after"
            elif not any(lit.startswith(self._buf) for lit in _LITERALS):
                raise JsonError("invalid literal")
        elif ch in WS and state != "start":
            return
        else:
            self._structure_char(ch, state)

    def _string_char(self, ch: str, state: str) -> None:
        if state == "string":
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self.state = "escape"
            elif ch < " ":
                raise JsonError("control character in a string")
            else:
                self._string_text(ch)
        elif state == "escape":
            if ch in _ESCAPES:
                self._string_text(_ESCAPES[ch])
                self.state = "string"
            elif ch == "u":
                self._hexbuf = ""
                self.state = "unicode"
            else:
                raise JsonError("invalid escape")
        elif state in ("unicode", "pair_digits"):
            if ch not in _HEX:
                raise JsonError("invalid \\u escape")
            self._hexbuf += ch
            if len(self._hexbuf) == 4:
                self._code(int(self._hexbuf, 16), state == "pair_digits")
        elif state == "pair_backslash":          # after a high surrogate: "\\u" may pair it
            if ch == "\\":
                self.state = "pair_u"
            else:
                self._string_text(chr(self._high))
                self.state = "string"
                self._char(ch)
        else:                                    # pair_u
            if ch == "u":
                self._hexbuf = ""
                self.state = "pair_digits"
            else:
                self._string_text(chr(self._high))
                self.state = "escape"
                self._char(ch)

    def _number_char(self, ch: str) -> None:
        if ch in _NUMBER_CHARS:
            self._buf += ch
        elif ch == "I" and self._buf == "-":
            self._buf += ch
            self.state = "literal"
        else:
            if not _NUMBER_RE.fullmatch(self._buf):
                raise JsonError("invalid number")
            try:
                canon = dumps(json.loads(self._buf))
            except ValueError as exc:          # e.g. an integer too long to convert
                raise JsonError(str(exc)) from None
            self._emit(SCALAR, canon)
            self.state = "after"
            self._char(ch)

    def _structure_char(self, ch: str, state: str) -> None:
        if state == "start":
            if ch != self.top:
                raise JsonError(f"expected {self.top!r}")
            self._open(ch)
        elif state == "value":
            self._value(ch)
        elif state == "value_or_end":
            if ch == "]":
                self._close(ch)
            else:
                self._value(ch)
        elif state in ("key_or_end", "key"):
            if ch == "}" and state == "key_or_end":
                self._close(ch)
            elif ch == '"':
                self._key, self._buf, self.state, self.raw_pending = True, "", "string", ch
            else:
                raise JsonError("expected a key")
        elif state == "colon":
            if ch != ":":
                raise JsonError("expected ':'")
            self.state = "value"
        elif state == "after":
            top = self.stack[-1]
            if ch == ",":
                self.state = "key" if top == "{" else "value"
            elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                self._close(ch)
            else:
                raise JsonError("expected ',' or the end of the container")
        else:  # pragma: no cover - every state is handled above
            raise AssertionError(state)

    def _value(self, ch: str) -> None:
        if ch in "{[":
            self._open(ch)
        elif ch == '"':
            self._emit(STR_START)
            self._key, self.state = False, "string"
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self._buf, self.state, self.raw_pending = ch, "number", ch
        elif any(lit.startswith(ch) for lit in _LITERALS):
            self._buf, self.state, self.raw_pending = ch, "literal", ch
        else:
            raise JsonError("expected a value")

    def _open(self, ch: str) -> None:
        self._emit(OPEN, ch)
        self.stack.append(ch)
        self.state = "key_or_end" if ch == "{" else "value_or_end"

    def _close(self, ch: str) -> None:
        self.stack.pop()
        self._emit(CLOSE, ch)
        if self.stack:
            self.state = "after"
        else:
            self.state, self.done = "done", True

    def _string_text(self, text: str) -> None:
        if self._key:
            self._buf += text
        else:
            self._emit(STR_CHUNK, text)

    def _end_string(self) -> None:
        if self._key:
            self._emit(KEY, self._buf)
            self.state = "colon"
        else:
            self._emit(STR_END)
            self.state = "after"

    def _code(self, code: int, second: bool) -> None:
        """A complete \\uXXXX escape (`second`: the one after a high surrogate)."""
        if second:
            high, self._high = self._high, 0
            if 0xDC00 <= code <= 0xDFFF:
                self._string_text(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                self.state = "string"
                return
            self._string_text(chr(high))      # not a pair: the first stays alone
        if 0xD800 <= code <= 0xDBFF:
            self._high = code
            self.state = "pair_backslash"
        else:
            self._string_text(chr(code))
            self.state = "string"


class Canon:
    """Turns lexer events of one JSON value into `json.dumps` text, piece by piece."""

    def __init__(self) -> None:
        self._stack: list[list] = []         # [bracket, items so far]

    def _sep(self) -> str:
        if not self._stack or self._stack[-1][0] == "{":
            return ""                        # in an object the key wrote the separator
        top = self._stack[-1]
        top[1] += 1
        return ", " if top[1] > 1 else ""

    def event(self, kind: int, payload: Any) -> str:
        if kind == OPEN:
            text = self._sep() + payload
            self._stack.append([payload, 0])
            return text
        if kind == CLOSE:
            self._stack.pop()
            return payload
        if kind == KEY:
            top = self._stack[-1]
            top[1] += 1
            return (", " if top[1] > 1 else "") + dumps(payload) + ": "
        if kind == STR_START:
            return self._sep() + '"'
        if kind == STR_CHUNK:
            return dumps(payload)[1:-1]
        if kind == STR_END:
            return '"'
        return self._sep() + payload         # SCALAR
