"""The `--tool-call-parser` formats by name."""

from __future__ import annotations

from typing import Mapping, Sequence

from gateway.tools.base import ToolParser
from gateway.tools.hermes import HermesToolParser
from gateway.tools.llama3_json import Llama3JsonToolParser

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
