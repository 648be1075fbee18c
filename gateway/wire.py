"""What a request must be for the gateway to put it on the wire: text that is valid Unicode, and
integers within the type of the proto field they travel in.

Text: a JSON body can spell a lone surrogate (`"\\ud800"`, or its three UTF-8-like bytes, which
Python's JSON reader lets through); no tokenizer, proto string or JSON response can hold one.
`bad_text` finds the first such string (or object key) anywhere in a parsed body, so the REST
models check every field at once before anything reads them. gRPC requests cannot carry one:
the proto parser refuses a string that is not UTF-8 (`parse_lenient` turns that into an
INVALID_ARGUMENT rather than grpc's UNKNOWN).

Integers: `check_ints` holds every integer of a GenerationParams to the range of its SamplingParams
field's type (int32, uint32, int64, uint64), read from the proto descriptor, so a new field is
covered without a list kept by hand. REST integers are unbounded JSON numbers; gRPC ones are in
range by construction (the parser truncates a varint to its field's width). Token ids are held
to the vocabulary as well, which is tighter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from gateway.errors import bad_request, printable
from proto import pdserve_pb2

_INT_TYPES = {FieldDescriptor.CPPTYPE_INT32: ("int32", -2 ** 31, 2 ** 31 - 1),
              FieldDescriptor.CPPTYPE_UINT32: ("uint32", 0, 2 ** 32 - 1),
              FieldDescriptor.CPPTYPE_INT64: ("int64", -2 ** 63, 2 ** 63 - 1),
              FieldDescriptor.CPPTYPE_UINT64: ("uint64", 0, 2 ** 64 - 1)}


def int_type(field: FieldDescriptor) -> tuple[str, int, int] | None:
    """(type name, least, greatest) of an integer proto field, else None (a map too: its keys
    and values are fields of their own entry message)."""
    return _INT_TYPES.get(field.cpp_type)


def sampling_int_fields() -> dict[str, tuple[str, int, int]]:
    """SamplingParams' integer fields (repeated ones included): name -> int_type."""
    out = {}
    for field in pdserve_pb2.SamplingParams.DESCRIPTOR.fields:
        kind = int_type(field)
        if kind is not None:
            out[field.name] = kind
    return out


_SAMPLING_INTS = sampling_int_fields()


def check_ints(raw: Any, names: dict[str, str] | None = None) -> None:
    """Every integer field of the dataclass RAW that SamplingParams has too (a value or a
    sequence of them) fits that field's type; GatewayError 400 naming the field otherwise.
    `names`: the request field a GenerationParams field came from, where it differs."""
    for f in fields(raw):
        kind = _SAMPLING_INTS.get(f.name)
        value = getattr(raw, f.name)
        if kind is None or value is None:
            continue
        name, lo, hi = kind
        param = (names or {}).get(f.name, f.name)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, int) and not lo <= v <= hi:
                bound = f"at most {hi}" if v > hi else f"at least {lo}"
                raise bad_request(f"{param} must be {bound} (its wire type is {name}), got {v}",
                                  param)


# ------------------------------------------------------------------------------------- text

def _surrogate(text: str) -> int | None:
    """The index of TEXT's first lone surrogate (the one thing a str can hold that is not
    Unicode text), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def json_path(where: Sequence[str | int]) -> str:
    """`messages[0].content` from ("messages", 0, "content")."""
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class BadText:
    """Where a string that is not valid Unicode sits in a body, and what is wrong with it."""

    param: str | None       # its JSON path (None: the body itself is that string)
    message: str


def bad_text(value: Any) -> BadText | None:
    """The first string or object key in VALUE (parsed JSON: dicts, lists, scalars) that holds
    a lone surrogate, or None. Iterative: nesting as deep as the JSON reader allows is fine."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            at = _surrogate(v)
            if at is not None:
                return BadText(json_path(where) or None,
                               f"{json_path(where) or 'the request body'} {_why(v, at)}")
        elif isinstance(v, dict):
            for key in v:
                at = _surrogate(key) if isinstance(key, str) else None
                if at is not None:
                    return BadText(json_path(where + (printable(key),)),
                                   f"the key '{printable(key)}' in "
                                   f"{json_path(where) or 'the request body'} {_why(key, at)}")
            stack.extend((where + (k,), item) for k, item in reversed(v.items())
                         if isinstance(item, (str, dict, list)))
        elif isinstance(v, list):
            stack.extend((where + (i,), v[i]) for i in reversed(range(len(v)))
                         if isinstance(v[i], (str, dict, list)))
    return None


def _why(text: str, at: int) -> str:
    return (f"is not valid Unicode text: it holds a lone surrogate (U+{ord(text[at]):04X} at "
            f"character {at}), which UTF-8 cannot encode (a JSON \\u escape of a high "
            "surrogate must be followed by a low one)")


# ------------------------------------------------------------------------------------- gRPC

@dataclass(frozen=True)
class Undecodable:
    """A request message the proto parser refused (e.g. a string that is not UTF-8)."""

    reason: str


def parse_lenient(message_type):
    """A gRPC request deserializer for MESSAGE_TYPE that returns Undecodable instead of
    raising, so the servicer can answer INVALID_ARGUMENT (a raising one gets UNKNOWN)."""
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))
    return parse
