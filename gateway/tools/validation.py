"""The tool fields of a chat request, validated and resolved into a `ToolPlan`.

`check_tools(tools, tool_choice, parallel_tool_calls, parser)` raises a 400 naming the field,
or gives the plan: mode "none" | "auto" | "required" | "named", which says how the prompt is
rendered (`template_tools`), what constrains the output (`schema()`), how it is parsed
(`output_parser()`) and the response's finish_reason.

`parallel_tool_calls: false` in auto mode keeps the first call only (later calls are dropped,
as other servers do); for "required" the schema allows one call.

finish_reason: an engine finish of "stop" becomes "tool_calls" when the output holds at least one
call (auto) and always for "required" / named; "length" (a call cut short) and other reasons
pass through unchanged; mode "none" never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gateway.errors import bad_request
from gateway.tools.base import ToolParser, function_of, plain
from gateway.tools.forced import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from gateway.tools.registry import TOOL_CALL_PARSERS, get_tool_parser

TOOL_CHOICES = ("none", "auto", "required")


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
                                     if function_of(t).get("name") == self.function))
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
    choice = plain(tool_choice)
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
    checked: list[dict] = []
    names: set[str] = set()
    for i, raw in enumerate(tools or ()):
        tool, where = plain(raw), f"tools.{i}"
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
        checked.append({"type": "function", "function": dict(fn)})
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    mode, function = _resolve_choice(tool_choice)
    if mode in ("required", "named") and not checked:
        what = "\"required\"" if mode == "required" else f"naming the function {function!r}"
        raise bad_request(f"tool_choice {what} needs tools", "tool_choice")
    if mode == "named" and function not in names:
        raise bad_request(f"tool_choice names the function {function!r}, which is not in tools",
                          "tool_choice")
    if not mode:
        mode = "auto" if checked else "none"
    if mode == "auto" and not checked:
        mode = "none"
    if checked and mode != "none" and not parser:
        raise bad_request("tool calling is not enabled on this server: start the gateway with "
                          f"--tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)})", "tools")
    return ToolPlan(mode, tuple(checked), function, parallel_tool_calls is not False, parser)
