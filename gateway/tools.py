"""OpenAI tool calling for /v1/chat/completions: validation, prompt rendering, output parsing.

The pieces, in the order a request meets them:

1. `check_tools(tools, tool_choice, parallel_tool_calls, parser)` validates the request fields
   and resolves them into a `ToolPlan` (mode "none" | "auto" | "required" | "named").
2. Rendering: `Tokenizer.render_chat(messages, tools=plan.template_tools,
   tool_parser=plan.parser)`. When the model's chat template uses tools (its source mentions
   `tools`), the template gets `tools` (the OpenAI list, as transformers passes it) and messages
   whose assistant `tool_calls` carry `arguments` as a dict (`template_messages`). Otherwise the
   documented default (`fallback_messages`, below) rewrites the conversation into plain turns.
3. Constrained decoding for "required" and a named function: `plan.schema()` (=
   `required_schema` / `named_schema`) is a JSON schema for the grammar engine, so the output
   always parses.
4. Parsing the output: `plan.output_parser()` gives a parser with `parse(text) -> ParsedOutput`
   for the whole output and `streamer()` for streaming (`feed(delta) -> list[delta dict]`,
   `finish() -> list[delta dict]`); the delta dicts are OpenAI chat-chunk `delta` objects.
5. `plan.finish_reason(engine_reason, num_calls)`: the rule is below.

Output formats (`--tool-call-parser`):

- `hermes` (Hermes / Qwen): calls are `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>` blocks anywhere in the text, as many as the model writes; `</tool_call>` may be
  missing after the last one. Text around the blocks is the message content.
- `llama3_json` (Llama 3.x JSON tool calling): the whole output is the call(s): optional
  whitespace and `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects ("arguments"
  is accepted too) separated by `;`. Output that does not start like that is plain content; text
  after the last call is content.

In both, a call object's "arguments" may also be a JSON string holding an object; a missing one
means `{}`; other keys are ignored; when "name" or the arguments key repeats, the first wins. A
call whose text is malformed (not JSON, not an object, a name that is not among the request's
tools, arguments that are not an object) stays in the content, as the model wrote it.
Content: with no call the whole output, verbatim; with calls, the text around them, leaving out
stretches that are only whitespace (the newlines between blocks); None when nothing is left.
`arguments` is always the JSON text `json.dumps(value, ensure_ascii=False)`.

Streaming: the streamer emits content while the text cannot be part of a call and holds back
what might be (a partial `<tool_call>`, a whitespace-only stretch before a call). A call is
announced (`{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}]}`) once its name is known to be valid and its arguments have begun (an
object) or are complete; then its arguments follow as `{"tool_calls": [{"index", "function":
{"arguments": piece}}]}`, re-serialised on the fly in the `json.dumps` form, so for any split of
the same text the streamed content and the concatenated arguments equal `parse(text)` (the
arguments as parsed JSON; as text too unless an object repeats a key). The exception, which no
streaming parser can avoid: a call already announced whose text then breaks (invalid JSON past
the name, or the output cut short) cannot be taken back; the rest of its text is appended raw to
its arguments, while `parse` keeps the whole block as content.

`parallel_tool_calls: false` in auto mode keeps the first call only (later calls are dropped,
as other servers do); for "required" the schema allows one call.

finish_reason: an engine finish of "stop" becomes "tool_calls" when the output holds at least one
call (auto) and always for "required" / named; "length" (a call cut short) and other reasons
pass through unchanged; mode "none" never changes it.

Default rendering, for templates that know nothing of tools (e.g. SmolLM2's), through the
model's own template so its special tokens stay right (parser "hermes" when none is set):

- the tools and the call format of the parser are described in a text put in front of the
  system message's content (a system message holding only that text is added first when the
  conversation has none; for such a template that replaces its built-in default system prompt);
- an assistant message's `tool_calls` become the parser's own text form of those calls, after
  the message's content (a newline between), so the model sees its past calls as it writes them;
- `tool` messages become user turns holding the parser's tool-response text (hermes:
  `<tool_response>\\n...\\n</tool_response>`; llama3_json: `Function result (name): ...`); a
  run of consecutive tool messages shares one user turn, one response per line.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from gateway.errors import bad_request

__all__ = [
    "ToolCall", "ParsedOutput", "ToolPlan", "ToolCallStreamer", "ToolParser", "HermesToolParser",
    "Llama3JsonToolParser", "RequiredCallsParser", "NamedCallParser", "TOOL_CALL_PARSERS",
    "get_tool_parser", "check_tools", "required_schema", "named_schema", "calls_from_required",
    "call_from_named", "template_messages", "fallback_messages", "template_uses_tools",
    "tool_finish_reason", "new_call_id", "has_tool_content",
]

_WS = " \t\n\r"              # JSON whitespace; also what "whitespace-only content" means here
_ALNUM = string.ascii_letters + string.digits
TOOL_CHOICES = ("none", "auto", "required")


def new_call_id() -> str:
    """`call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that is a proper beginning of `tag`."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


# ---------------------------------------------------------------------------------------------
# results


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


def _assemble(text: str, segments: list[str], calls: list[ToolCall]) -> ParsedOutput:
    if not calls:
        return ParsedOutput(text, [])
    content = "".join(s for s in segments if s.strip(_WS))
    return ParsedOutput(content or None, calls)


# ---------------------------------------------------------------------------------------------
# incremental JSON


class _JsonError(ValueError):
    """The text is not JSON, or not the JSON a call needs."""


_OPEN, _CLOSE, _KEY, _STR_START, _STR_CHUNK, _STR_END, _SCALAR = range(7)
_NUMBER_CHARS = frozenset("+-0123456789.eE")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class _JsonLexer:
    """Reads one JSON object or array a character at a time and accepts exactly what `json.loads`
    accepts (NaN and Infinity included, control characters in strings refused, surrogate pairs
    of \\u escapes joined).

    `push(ch)` returns events `(kind, depth, payload)`: _OPEN / _CLOSE ("{" "[" / "}" "]"),
    _KEY (the whole key), _STR_START / _STR_CHUNK (decoded text) / _STR_END for string values,
    _SCALAR (a number or literal in `json.dumps` form). `depth` counts the containers around the
    event (an opening bracket is outside its own container, a closing one too). `done` turns true
    on the character that closes the top-level value; raises _JsonError on invalid text.
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
            raise _JsonError("text after the end of the value")
        self.raw_pending += ch
        self._out = []
        self._char(ch)
        if self._out:
            self.raw_pending = ""
        return self._out

    def _emit(self, kind: int, payload: Any = None) -> None:
        self._out.append((kind, len(self.stack), payload))

    def _char(self, ch: str) -> None:          # noqa: C901 - one state machine
        state = self.state
        if state == "string":
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self.state = "escape"
            elif ch < " ":
                raise _JsonError("control character in a string")
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
                raise _JsonError("invalid escape")
        elif state in ("unicode", "pair_digits"):
            if ch not in _HEX:
                raise _JsonError("invalid \\u escape")
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
        elif state == "pair_u":
            if ch == "u":
                self._hexbuf = ""
                self.state = "pair_digits"
            else:
                self._string_text(chr(self._high))
                self.state = "escape"
                self._char(ch)
        elif state == "number":
            if ch in _NUMBER_CHARS:
                self._buf += ch
            elif ch == "I" and self._buf == "-":
                self._buf += ch
                self.state = "literal"
            else:
                if not _NUMBER_RE.fullmatch(self._buf):
                    raise _JsonError("invalid number")
                try:
                    canon = _dumps(json.loads(self._buf))
                except ValueError as exc:          # e.g. an integer too long to convert
                    raise _JsonError(str(exc)) from None
                self._emit(_SCALAR, canon)
                self.state = "after"
                self._char(ch)
        elif state == "literal":
            self._buf += ch
            if self._buf in _LITERALS:
                self._emit(_SCALAR, self._buf)
                self.state = "after"
            elif not any(lit.startswith(self._buf) for lit in _LITERALS):
                raise _JsonError("invalid literal")
        elif ch in _WS and state != "start":
            return
        elif state == "start":
            if ch != self.top:
                raise _JsonError(f"expected {self.top!r}")
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
                raise _JsonError("expected a key")
        elif state == "colon":
            if ch != ":":
                raise _JsonError("expected ':'")
            self.state = "value"
        elif state == "after":
            top = self.stack[-1]
            if ch == ",":
                self.state = "key" if top == "{" else "value"
            elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                self._close(ch)
            else:
                raise _JsonError("expected ',' or the end of the container")
        else:  # pragma: no cover - every state is handled above
            raise AssertionError(state)

    def _value(self, ch: str) -> None:
        if ch in "{[":
            self._open(ch)
        elif ch == '"':
            self._emit(_STR_START)
            self._key, self.state = False, "string"
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self._buf, self.state, self.raw_pending = ch, "number", ch
        elif any(lit.startswith(ch) for lit in _LITERALS):
            self._buf, self.state, self.raw_pending = ch, "literal", ch
        else:
            raise _JsonError("expected a value")

    def _open(self, ch: str) -> None:
        self._emit(_OPEN, ch)
        self.stack.append(ch)
        self.state = "key_or_end" if ch == "{" else "value_or_end"

    def _close(self, ch: str) -> None:
        self.stack.pop()
        self._emit(_CLOSE, ch)
        if self.stack:
            self.state = "after"
        else:
            self.state, self.done = "done", True

    def _string_text(self, text: str) -> None:
        if self._key:
            self._buf += text
        else:
            self._emit(_STR_CHUNK, text)

    def _end_string(self) -> None:
        if self._key:
            self._emit(_KEY, self._buf)
            self.state = "colon"
        else:
            self._emit(_STR_END)
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


class _Canon:
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
        if kind == _OPEN:
            text = self._sep() + payload
            self._stack.append([payload, 0])
            return text
        if kind == _CLOSE:
            self._stack.pop()
            return payload
        if kind == _KEY:
            top = self._stack[-1]
            top[1] += 1
            return (", " if top[1] > 1 else "") + _dumps(payload) + ": "
        if kind == _STR_START:
            return self._sep() + '"'
        if kind == _STR_CHUNK:
            return _dumps(payload)[1:-1]
        if kind == _STR_END:
            return '"'
        return self._sep() + payload         # _SCALAR


_MISSING = object()


class _CallReader:
    """Follows the lexer events of one call object {"name": ..., <arguments key>: {...}} whose
    opening brace sits at depth `base`; raises _JsonError when it cannot be a valid call.

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
        self._canon: _Canon | None = None
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
            if kind == _OPEN:
                if payload != "{":
                    raise _JsonError("a call must be a JSON object")
                return
            if kind == _CLOSE:
                if self.name is None:
                    raise _JsonError("the call has no name")
                if not self._seen_args:
                    self._pending.append("{}")
                    self.args_done = True
                self.closed = True
                return
            raise _JsonError("a call must be a JSON object")
        if depth == base + 1 and kind == _KEY:
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
        if kind == _STR_START:
            self._name_buf = ""
        elif kind == _STR_CHUNK:
            self._name_buf += payload
        elif kind == _STR_END:
            name, self._name_buf, self._role = self._name_buf, None, None
            if not name or (self.names is not None and name not in self.names):
                raise _JsonError(f"unknown function {name!r}")
            self.name = name
        else:
            raise _JsonError("the name must be a string")

    def _args_event(self, kind: int, depth: int, payload: Any) -> None:
        if self._canon is not None:                       # inside the arguments object
            self._pending.append(self._canon.event(kind, payload))
            if kind == _CLOSE and depth == self.base + 1:
                self._canon, self._role = None, None
                self.args_open, self.args_done = False, True
            return
        if self._arg_str is not None:                     # arguments given as a JSON string
            if kind == _STR_CHUNK:
                self._arg_str.append(payload)
                return
            text, self._arg_str, self._role = "".join(self._arg_str), None, None
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise _JsonError("the arguments string is not JSON") from None
            if not isinstance(value, dict):
                raise _JsonError("the arguments must be an object")
            self._pending.append(_dumps(value))
            self.args_done = True
            return
        if kind == _OPEN and payload == "{":
            self._canon = _Canon()
            self._pending.append(self._canon.event(kind, payload))
            self.args_open = True
        elif kind == _STR_START:
            self._arg_str = []
        else:
            raise _JsonError("the arguments must be an object")


class _Pairs(dict):
    """A decoded JSON object that remembers its key/value pairs in order (first key wins)."""

    __slots__ = ("pairs",)


def _pairs_hook(pairs: list) -> _Pairs:
    obj = _Pairs(pairs)
    obj.pairs = pairs
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_hook)


def _call_fields(obj: Any, names: frozenset[str] | None,
                 arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded call object, or None when it is not a valid
    call: the same rules as _CallReader."""
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
    return name, _dumps(args)


def _decode_call(text: str, pos: int, names: frozenset[str] | None,
                 arg_keys: tuple[str, ...]) -> tuple[ToolCall, int] | None:
    """The call object starting at text[pos] ("{") and where it ends, or None."""
    if not text.startswith("{", pos):
        return None
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    got = _call_fields(obj, names, arg_keys)
    return None if got is None else (ToolCall.new(*got), end)


# ---------------------------------------------------------------------------------------------
# streaming


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
            if not text.strip(_WS):
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


class _ObjectCallMixin:
    """The part of a streamer that reads one call object through _CallReader."""

    _names: frozenset[str] | None
    _arg_keys: tuple[str, ...]

    def _start_object(self) -> None:
        self._lexer: _JsonLexer | None = None
        self._reader: _CallReader | None = None
        self._raw = ""                    # raw text since the call began (for a rollback)
        self._committed = False

    def _object_chars(self, text: str) -> tuple[str, str]:
        """Feed characters of the call object. Returns (outcome, rest): outcome "more" (all
        consumed), "done", "malformed" (before the call was announced: roll back) or "broken"
        (after: `rest` and later text are raw arguments)."""
        for i, ch in enumerate(text):
            self._raw += ch
            if self._lexer is None:
                if ch in _WS:
                    continue
                self._lexer = _JsonLexer("{")
                self._reader = _CallReader(self._names, self._arg_keys)
            try:
                for kind, depth, payload in self._lexer.push(ch):
                    self._reader.event(kind, depth, payload)
            except _JsonError:
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


class _HermesStreamer(_ObjectCallMixin, ToolCallStreamer):
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
            keep = _partial_suffix(buf, self.OPEN)
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
            j = _skip_ws(buf, 0)
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
        keep = _partial_suffix(buf, self.CLOSE)
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


class _Llama3Streamer(_ObjectCallMixin, ToolCallStreamer):
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
            j = _skip_ws(buf, 0)
            if buf.startswith(self.TAG, j):
                j = _skip_ws(buf, j + len(self.TAG))
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
            j = _skip_ws(buf, 0)
            if j == len(buf):
                self._hold = buf
                return ""
            if buf[j] == ";":
                self._since, self._state = buf[:j + 1], "semi"
                return buf[j + 1:]
            self._state = "plain"
            return buf
        if state == "semi":
            j = _skip_ws(text, 0)
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


class _RequiredStreamer(ToolCallStreamer):
    """Streams `[{"name": ..., "parameters": {...}}, ...]` (the "required" constrained form).
    Text that cannot be read as calls (only when the output was cut short) is content while no
    call was announced for it, else raw arguments of the announced call."""

    def __init__(self, names: frozenset[str] | None) -> None:
        super().__init__()
        self._names = names
        self._lexer = _JsonLexer("[")
        self._reader: _CallReader | None = None
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
            if self._lexer.state == "start" and ch in _WS:
                continue
            try:
                for kind, depth, payload in self._lexer.push(ch):
                    self._event(kind, depth, payload)
            except _JsonError:
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
        if depth == 1 and kind == _OPEN:
            self._reader = _CallReader(self._names, ("parameters", "arguments"), base=1)
            self._committed = False
            if self._seen_calls:
                self._raw = payload
        elif self._reader is None:
            raise _JsonError("each call must be an object")
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
        elif self._state == "after" and self._raw.strip(_WS):
            self._content(self._raw)
        self._raw = ""


class _NamedStreamer(ToolCallStreamer):
    """Streams a named function's arguments object (the named constrained form)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._lexer = _JsonLexer("{")
        self._canon = _Canon()
        self._broken = False

    def _step(self, text: str) -> str:
        if not self._calls:
            self._open_call(self._name)
        if self._broken:
            self._args(text)
            return ""
        if self._lexer.done:         # past the object: whitespace is dropped
            if text.strip(_WS):
                self._broken = True
                self._args(text)
            return ""
        for i, ch in enumerate(text):
            if self._lexer.state == "start" and ch in _WS:
                continue
            try:
                events = self._lexer.push(ch)
            except _JsonError:
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


# ---------------------------------------------------------------------------------------------
# parsers


def _tool_names(tools: Iterable[Mapping] | None) -> frozenset[str] | None:
    if tools is None:
        return None
    return frozenset(_function(t).get("name") for t in tools)


def _function(tool: Mapping) -> Mapping:
    """The function object of an OpenAI tool (a bare function object is accepted too)."""
    fn = tool.get("function")
    return fn if isinstance(fn, Mapping) else tool


def _arguments_value(arguments: Any) -> Any:
    """A call's arguments as a template wants them: a JSON-object string becomes a dict."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


class ToolParser:
    """A `--tool-call-parser` output format: parsing plus the text forms the default rendering
    uses. `tools` (the request's tools) restricts valid names; None accepts any name;
    `max_calls` keeps only the first calls (parallel_tool_calls=false: 1)."""

    name = ""

    def __init__(self, tools: Sequence[Mapping] | None = None,
                 max_calls: int | None = None) -> None:
        self.names = _tool_names(tools)
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


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = _HermesStreamer.OPEN, _HermesStreamer.CLOSE

    def parse(self, text: str) -> ParsedOutput:
        segments, calls, pos, current = [], [], 0, []
        while True:
            k = text.find(self.OPEN, pos)
            if k < 0:
                current.append(text[pos:])
                break
            current.append(text[pos:k])
            got = _decode_call(text, _skip_ws(text, k + len(self.OPEN)), self.names,
                               ("arguments", "parameters"))
            if got is None:
                current.append(self.OPEN)
                pos = k + len(self.OPEN)
                continue
            calls.append(got[0])
            segments.append("".join(current))
            current = []
            m = _skip_ws(text, got[1])
            pos = m + len(self.CLOSE) if text.startswith(self.CLOSE, m) else got[1]
        segments.append("".join(current))
        return _assemble(text, segments, self._limit(calls) if calls else calls)

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer(self.names, self.max_calls)

    @classmethod
    def system_prompt(cls, tools: Sequence[Mapping]) -> str:
        listing = "\n".join(_dumps(dict(t)) for t in tools)
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
                         + _dumps({"name": name, "arguments": _arguments_value(args)})
                         + f"\n{cls.CLOSE}" for name, args in calls)

    @classmethod
    def response_text(cls, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = _Llama3Streamer.TAG

    def parse(self, text: str) -> ParsedOutput:
        keys = ("parameters", "arguments")
        i = _skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_ws(text, i + len(self.TAG))
        got = _decode_call(text, i, self.names, keys)
        if got is None:
            return ParsedOutput(text, [])
        calls, pos = [got[0]], got[1]
        while True:
            j = _skip_ws(text, pos)
            if not text.startswith(";", j):
                break
            k = _skip_ws(text, j + 1)
            if k == len(text):
                pos = k                   # a trailing ';' is dropped
                break
            got = _decode_call(text, k, self.names, keys)
            if got is None:
                break
            calls.append(got[0])
            pos = got[1]
        return _assemble(text, [text[pos:]], self._limit(calls))

    def streamer(self) -> ToolCallStreamer:
        return _Llama3Streamer(self.names, self.max_calls)

    @classmethod
    def system_prompt(cls, tools: Sequence[Mapping]) -> str:
        listing = "\n".join(_dumps(dict(t)) for t in tools)
        return ("You can call functions to help with the request. They are described below, "
                f"one JSON object per line:\n{listing}\n\n"
                "To call a function, answer with only a JSON object of the form "
                '{"name": "<function name>", "parameters": {"<argument>": <value>}} and '
                'nothing else; for several calls, separate the objects with "; ". '
                'Results come back in user messages starting with "Function result".')

    @classmethod
    def calls_text(cls, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(_dumps({"name": name, "parameters": _arguments_value(args)})
                         for name, args in calls)

    @classmethod
    def response_text(cls, content: str, name: str | None) -> str:
        return f"Function result ({name}): {content}" if name else f"Function result: {content}"


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
DEFAULT_RENDER_PARSER = "hermes"


def get_tool_parser(name: str, tools: Sequence[Mapping] | None = None,
                    max_calls: int | None = None) -> ToolParser:
    """The parser registered as `name` (ValueError for an unknown one)."""
    try:
        cls = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}") from None
    return cls(tools, max_calls)


# ---------------------------------------------------------------------------------------------
# constrained forms


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
        fn = _function(tool)
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
    return _parameters(_function(tool))


def calls_from_required(text: str, tools: Sequence[Mapping] | None = None) -> list[ToolCall]:
    """The calls of a whole "required" output; ValueError when the text is not that array
    (only possible when generation was cut short)."""
    try:
        value = _DECODER.decode(text)
    except RecursionError:
        raise ValueError("the output is nested too deeply") from None
    if not isinstance(value, list) or not value:
        raise ValueError("the output is not a non-empty JSON array of calls")
    names, calls = _tool_names(tools), []
    for item in value:
        got = _call_fields(item, names, ("parameters", "arguments"))
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
    return ToolCall.new(name, _dumps(value))


class RequiredCallsParser:
    """Output parser for tool_choice="required" (constrained by `required_schema`). A whole
    output that does not parse (cut short) is returned as content."""

    def __init__(self, tools: Sequence[Mapping]) -> None:
        self.tools = list(tools)
        self.names = _tool_names(self.tools)

    def parse(self, text: str) -> ParsedOutput:
        try:
            return ParsedOutput(None, calls_from_required(text, self.tools))
        except ValueError:
            return ParsedOutput(text, [])

    def streamer(self) -> ToolCallStreamer:
        return _RequiredStreamer(self.names)


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
        return _NamedStreamer(self.name)


# ---------------------------------------------------------------------------------------------
# validation


def _plain(value: Any) -> Any:
    """A pydantic model (or anything with model_dump) as plain data; others unchanged."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value


def tool_finish_reason(mode: str, finish_reason: str | None, num_calls: int) -> str | None:
    """The response's finish_reason (the rule in the module docstring)."""
    if finish_reason != "stop":
        return finish_reason
    if mode in ("required", "named") or (mode == "auto" and num_calls > 0):
        return "tool_calls"
    return finish_reason


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tool calling, validated (made by `check_tools`).

    mode: "none" (no tools, or tool_choice "none": the output is plain content), "auto" (the
    model may call; parse with the server's parser), "required" / "named" (constrained by
    `schema()`). `function`: the named function. `parser`: the server's --tool-call-parser.
    """

    mode: str
    tools: tuple[dict, ...] = ()
    function: str | None = None
    parallel: bool = True
    parser: str = ""

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools to render into the prompt (None for mode "none")."""
        return list(self.tools) if self.mode != "none" and self.tools else None

    def schema(self) -> dict | None:
        """The JSON schema constraining the output ("required" / "named"), else None."""
        if self.mode == "required":
            return required_schema(self.tools, self.parallel)
        if self.mode == "named":
            return named_schema(next(t for t in self.tools
                                     if _function(t).get("name") == self.function))
        return None

    def output_parser(self) -> ToolParser | RequiredCallsParser | NamedCallParser | None:
        """The parser of the output (None for mode "none": the output is content as is)."""
        if self.mode == "auto":
            return get_tool_parser(self.parser, self.tools, None if self.parallel else 1)
        if self.mode == "required":
            return RequiredCallsParser(self.tools)
        if self.mode == "named":
            return NamedCallParser(self.function)
        return None

    def finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        return tool_finish_reason(self.mode, finish_reason, num_calls)


def _check_parameters(params: Any, param: str) -> None:
    if not isinstance(params, Mapping):
        raise bad_request("function parameters must be a JSON Schema object", param)
    kind = params.get("type", "object")
    if kind != "object":
        raise bad_request(f"function parameters must be a JSON Schema of type \"object\", "
                          f"got type {kind!r}", param)
    if not isinstance(params.get("properties", {}), Mapping):
        raise bad_request("function parameters: \"properties\" must be an object",
                          f"{param}.properties")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad_request("function parameters: \"required\" must be a list of names",
                          f"{param}.required")


def _resolve_choice(tool_choice: Any) -> tuple[str, str | None]:
    choice = _plain(tool_choice)
    if choice is None:
        return "", None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                              f"got {choice!r}", "tool_choice")
        return choice, None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type", "function") == "function" and isinstance(name, str) and name:
            return "named", name
    raise bad_request("tool_choice must be a string or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")


def check_tools(tools: Sequence[Any] | None, tool_choice: Any = None,
                parallel_tool_calls: bool | None = None, parser: str = "") -> ToolPlan:
    """Validate the tool fields of a chat request; raise GatewayError (400, naming the field)
    or return the resolved ToolPlan. Tools and tool_choice may be dicts or pydantic models.
    `parser` is the server's --tool-call-parser ("" when tool calling is off; ValueError for
    a name that is not registered, a configuration error)."""
    if parser and parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {parser!r}")
    plain: list[dict] = []
    names: set[str] = set()
    for i, raw in enumerate(tools or ()):
        tool, where = _plain(raw), f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise bad_request("each tool must be an object", where)
        if tool.get("type", "function") != "function":
            raise bad_request(f"unsupported tool type {tool.get('type')!r}; only \"function\" "
                              "tools are supported", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise bad_request("a tool must carry a \"function\" object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("every function needs a name", f"{where}.function.name")
        if name in names:
            raise bad_request(f"duplicate function name {name!r} in tools", "tools")
        names.add(name)
        if fn.get("parameters") is not None:
            _check_parameters(fn["parameters"], f"{where}.function.parameters")
        plain.append({"type": "function", "function": dict(fn)})
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    mode, function = _resolve_choice(tool_choice)
    if mode in ("required", "named") and not plain:
        what = "\"required\"" if mode == "required" else f"naming the function {function!r}"
        raise bad_request(f"tool_choice {what} needs tools", "tool_choice")
    if mode == "named" and function not in names:
        raise bad_request(f"tool_choice names the function {function!r}, which is not in tools",
                          "tool_choice")
    if not mode:
        mode = "auto" if plain else "none"
    if mode == "auto" and not plain:
        mode = "none"
    if plain and mode != "none" and not parser:
        raise bad_request("tool calling is not enabled on this server: start the gateway with "
                          f"--tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)})", "tools")
    return ToolPlan(mode, tuple(plain), function, parallel_tool_calls is not False, parser)


# ---------------------------------------------------------------------------------------------
# rendering

_TOOLS_WORD = re.compile(r"\btools\b")


def template_uses_tools(source: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (its source mentions it)."""
    return bool(source) and _TOOLS_WORD.search(source) is not None


def _calls_of(message: Mapping) -> list[dict]:
    calls = []
    for call in message.get("tool_calls") or ():
        call = _plain(call)
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
        calls.append({"id": call.get("id"), "name": fn.get("name"),
                      "arguments": fn.get("arguments")})
    return calls


def has_tool_content(messages: Iterable[Mapping]) -> bool:
    """Whether a conversation holds assistant tool calls or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def template_messages(messages: Iterable[Mapping]) -> list[dict]:
    """Messages as a tools-aware chat template expects them (transformers' convention): keys
    whose value is None dropped; assistant `tool_calls` as [{"id", "type": "function",
    "function": {"name", "arguments"}}] with `arguments` a dict when it is a JSON object."""
    out = []
    for message in messages:
        msg = {k: v for k, v in _plain(message).items() if v is not None}
        if msg.get("tool_calls"):
            msg["tool_calls"] = [
                {**({"id": c["id"]} if c["id"] else {}), "type": "function",
                 "function": {"name": c["name"], "arguments": _arguments_value(c["arguments"])}}
                for c in _calls_of(msg)]
        out.append(msg)
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):          # OpenAI text parts
        return "\n".join(p.get("text", "") if isinstance(p, Mapping) else str(p)
                         for p in content)
    return str(content)


def fallback_messages(messages: Iterable[Mapping], tools: Sequence[Mapping] | None,
                      parser: str | None = None) -> list[dict]:
    """The conversation rewritten for a template that knows nothing of tools (the default
    rendering in the module docstring), with the text forms of `parser` (default hermes)."""
    fmt = type(get_tool_parser(parser or DEFAULT_RENDER_PARSER))
    msgs = [{k: v for k, v in _plain(m).items() if v is not None} for m in messages]
    out: list[dict] = []
    if tools:
        prompt = fmt.system_prompt([_plain(t) for t in tools])
        if msgs and msgs[0].get("role") == "system":
            first = msgs.pop(0)
            own = _text(first.get("content"))
            out.append({**first, "content": prompt + ("\n\n" + own if own else "")})
        else:
            out.append({"role": "system", "content": prompt})
    names_by_id: dict[str, str] = {}
    in_results = False
    for msg in msgs:
        role = msg.get("role")
        if role == "tool":
            name = msg.get("name") or names_by_id.get(msg.get("tool_call_id") or "")
            text = fmt.response_text(_text(msg.get("content")), name)
            if in_results:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
                in_results = True
            continue
        in_results = False
        calls = _calls_of(msg) if role == "assistant" else []
        for call in calls:
            if call["id"]:
                names_by_id[call["id"]] = call["name"]
        msg = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id")}
        content = _text(msg.get("content"))
        if calls:
            text = fmt.calls_text([(c["name"], c["arguments"]) for c in calls])
            content = content + "\n" + text if content else text
        msg["content"] = content
        out.append(msg)
    return out
