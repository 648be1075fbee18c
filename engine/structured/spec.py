"""What a request asks its output to be (StructuredSpec), and the error for a spec that cannot
be compiled (GrammarError). No xgrammar here: the gateway side can build and check specs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """kind: one of KINDS. value: json_schema: the schema as JSON text; regex: the pattern;
    choice: a JSON list of strings; grammar: EBNF in xgrammar's (GBNF-like) syntax with a rule
    named `root`; json_object: "" (any JSON object). Hashable: compiled grammars are cached by
    spec, so the same text is one cache entry."""

    kind: str
    value: str = ""
    compact: bool = False     # JSON kinds: one line, no whitespace but ", " and ": "

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}; "
                             f"got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output value must be a string (kind {self.kind}), "
                             f"got {type(self.value).__name__}")
        if self.kind == "json_object" and self.value:
            raise ValueError("structured output kind json_object takes no value")


class GrammarError(ValueError):
    """A spec the engine cannot compile. The message names the kind and gives the reason
    (xgrammar's, without its source-location prefix)."""

    def __init__(self, kind: str, reason: str):
        self.kind = kind
        self.reason = reason
        super().__init__(f"invalid {kind}: {reason}")


_XGR_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")          # "[14:13:08] /x/y.cc:83: "
_XGR_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_MAX_REASON = 600


def clean_reason(err: BaseException) -> str:
    """xgrammar's message without its timestamp, C++ location and `Check failed` preamble."""
    text = str(err).strip()
    text = _XGR_CHECK.sub("", _XGR_PREFIX.sub("", text)).strip()
    if not text:
        text = type(err).__name__
    if len(text) > _MAX_REASON:
        text = text[:_MAX_REASON] + "..."
    return text


def regex_newlines_escaped(rx: str) -> str:
    """rx with literal CR / LF characters written as \\r / \\n (the same regex): xgrammar
    rejects a raw newline inside a character class, e.g. "[^<LF>]"."""
    out, i = [], 0
    while i < len(rx):
        c = rx[i]
        if c == "\\" and i + 1 < len(rx):
            nxt = rx[i + 1]
            out.append({"\n": "\\n", "\r": "\\r"}.get(nxt, c + nxt))   # "\<LF>" is LF too
            i += 2
            continue
        out.append({"\n": "\\n", "\r": "\\r"}.get(c, c))
        i += 1
    return "".join(out)


def schema_newlines_escaped(schema):
    """The schema with regex_newlines_escaped applied to every "pattern" string; the same
    object when nothing changed."""
    if isinstance(schema, list):
        items = [schema_newlines_escaped(x) for x in schema]
        return schema if all(a is b for a, b in zip(items, schema)) else items
    if not isinstance(schema, dict):
        return schema
    out, changed = {}, False
    for k, v in schema.items():
        if k == "pattern" and isinstance(v, str):
            w = regex_newlines_escaped(v)
        else:
            w = schema_newlines_escaped(v)
        changed = changed or w is not v and w != v
        out[k] = w
    return out if changed else schema


def ebnf_literal(s: str) -> str:
    """s as an xgrammar EBNF string literal: quotes and backslashes escaped, control
    characters as \\xHH, everything else (UTF-8 included) kept as is."""
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def choice_options(value: str) -> list[str]:
    """The options of a choice spec (a JSON list of strings), duplicates dropped, in order."""
    try:
        options = json.loads(value)
    except json.JSONDecodeError as e:
        raise GrammarError("choice", f"value is not a JSON list of strings: {e}") from None
    if not isinstance(options, list) or not options:
        raise GrammarError("choice", "value must be a non-empty JSON list of strings")
    if not all(isinstance(o, str) for o in options):
        raise GrammarError("choice", "every option must be a string")
    return list(dict.fromkeys(options))


def choice_ebnf(options: list[str]) -> str:
    """A grammar whose only sentences are the options."""
    return "root ::= " + " | ".join(ebnf_literal(o) for o in options)
