"""A model's chat template: loaded from its folder, compiled in a sandboxed jinja2 environment
set up the way transformers sets up its own (trim_blocks, lstrip_blocks, loopcontrols, a
non-escaping `tojson`, `raise_exception`, `strftime_now`), and the conversation it renders,
tools included.

Tools reach the prompt one of two ways. When the model's chat template uses tools (its source
mentions `tools`), the template gets `tools` (the OpenAI list, as transformers passes it) and
messages whose assistant `tool_calls` carry `arguments` as a dict (`template_messages`).
Otherwise the default rendering (`fallback_messages`) rewrites the conversation into plain
turns, through the model's own template so its special tokens stay right, in the text forms of
the server's --tool-call-parser (hermes when none is set):

- the tools and the call format of the parser are described in a text put in front of the
  system message's content (a system message holding only that text is added first when the
  conversation has none; for such a template that replaces its built-in default system prompt);
- an assistant message's `tool_calls` become the parser's own text form of those calls, after
  the message's content (a newline between), so the model sees its past calls as it writes them;
- `tool` messages become user turns holding the parser's tool-response text (hermes:
  `<tool_response>\\n...\\n</tool_response>`; llama3_json: `Function result (name): ...`); a
  run of consecutive tool messages shares one user turn, one response per line.

A message's `name` (and a custom role) must show in the prompt: a template that leaves it out
is refused by name (`_check_names`, `_check_custom_roles`) rather than dropped without a word.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.tools.base import arguments_value, plain
from gateway.tools.registry import DEFAULT_RENDER_PARSER, get_tool_parser


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")   # others: custom roles


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or the model has none), or
    the template would leave part of it out; `param` is the request field to name."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def load_chat_template(model_dir: Path, tok_config: dict) -> str | None:
    """The template's source: chat_template.jinja, else tokenizer_config.json's (the "default"
    one of a list of named templates); None when the model has none."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(template: jinja2.Template | None, messages: list[dict], *, supports_tools: bool,
                variables: Mapping[str, str], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, tool_parser: str | None = None) -> str:
    """The prompt text of a conversation (`Tokenizer.render_chat` documents the arguments);
    ChatTemplateError carries the template's message, or says which custom role or message
    `name` the template leaves out. `supports_tools`: the template reads `tools` itself
    (`template_uses_tools`), else the default rendering is used."""
    if template is None:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")

    def render(conversation: list[dict]) -> str:
        return _render(template, conversation, supports_tools=supports_tools,
                       variables=variables, add_generation_prompt=add_generation_prompt,
                       tools=tools, tool_parser=tool_parser)

    text = render(messages)
    _check_names(render, messages)
    return text


def _render(template: jinja2.Template, messages: list[dict], *, supports_tools: bool,
            variables: Mapping[str, str], add_generation_prompt: bool,
            tools: list[dict] | None, tool_parser: str | None) -> str:
    tools = list(tools) if tools else None
    if not supports_tools and (tools or has_tool_content(messages)):
        messages, tools = fallback_messages(messages, tools, tool_parser), None
    else:
        messages = template_messages(messages)
    try:
        text = template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    _check_custom_roles(messages, text)
    return text


def _name_probe(index: int) -> str:
    """A name no template or conversation holds by chance (lower case letters and digits, so a
    template's case and whitespace filters keep it as it is; its end marks where it ends)."""
    return f"pdservenameprobe{index}x"


def _check_names(render: Callable[[list], str], messages: Sequence[Mapping]) -> None:
    """A message's `name` must reach the prompt: a template that does not read it drops it
    without a word, and the model would never see it. The conversation is rendered again with
    each given name replaced by a probe (the real name could show in the text by chance, e.g.
    a name that is also a role); a probe missing from that text is a ChatTemplateError naming
    the message's name. A conversation without names is not rendered again."""
    named = [i for i, m in enumerate(messages) if m.get("name") is not None]
    if not named:
        return
    probe = [dict(m, name=_name_probe(i)) if i in named else m for i, m in enumerate(messages)]
    text = render(probe)
    for i in named:
        if _name_probe(i) not in text:
            raise ChatTemplateError(f"this model's chat template does not render a message's "
                                    f"name (messages[{i}].name): the model would never see it; "
                                    f"leave name out", f"messages[{i}].name")


def _check_custom_roles(messages: Iterable[Mapping], text: str) -> None:
    """A message of a custom role must show in the prompt: a template that knows only its own
    roles drops the others without a word, and the model would never see that message."""
    for i, message in enumerate(messages):
        role, content = message.get("role"), _text(message.get("content"))
        if role not in CHAT_ROLES and (role not in text or content not in text):
            raise ChatTemplateError(f"this model's chat template does not render messages of "
                                    f"role {role!r} (messages[{i}])")


_TOOLS_WORD = re.compile(r"\btools\b")


def template_uses_tools(source: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (its source mentions it)."""
    return bool(source) and _TOOLS_WORD.search(source) is not None


def _calls_of(message: Mapping) -> list[dict]:
    calls = []
    for call in message.get("tool_calls") or ():
        call = plain(call)
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
        msg = {k: v for k, v in plain(message).items() if v is not None}
        if msg.get("tool_calls"):
            msg["tool_calls"] = [
                {**({"id": c["id"]} if c["id"] else {}), "type": "function",
                 "function": {"name": c["name"], "arguments": arguments_value(c["arguments"])}}
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
    msgs = [{k: v for k, v in plain(m).items() if v is not None} for m in messages]
    out: list[dict] = []
    if tools:
        prompt = fmt.system_prompt([plain(t) for t in tools])
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
