"""Tool calling pieces (gateway/tools/, gateway/chat_template.py): rendering, output parsers
(whole and streamed, on every split of the same text), the constrained forms and request
validation."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest

from gateway.chat_template import fallback_messages
from gateway.errors import GatewayError
from gateway.tokenizer import Tokenizer
from gateway.tools.base import ToolCall
from gateway.tools.forced import (NamedCallParser, RequiredCallsParser, call_from_named,
                                  calls_from_required, named_schema, required_schema)
from gateway.tools.hermes import HermesToolParser
from gateway.tools.json_stream import Canon, JsonError, JsonLexer
from gateway.tools.llama3_json import Llama3JsonToolParser
from gateway.tools.registry import get_tool_parser
from gateway.tools.validation import check_tools, tool_finish_reason

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                  "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, ADD, PING]

CALL_RE = re.compile(r"^call_[A-Za-z0-9]{24}$")


# ------------------------------------------------------------------------------ streaming helpers
def _stream(parser, chunks):
    """Feed the chunks; check every delta's shape; return (content, [(name, arguments)])."""
    st = parser.streamer()
    deltas = [d for c in chunks for d in st.feed(c)] + st.finish()
    content, calls = [], []
    for d in deltas:
        assert len(d) == 1, d
        if "content" in d:
            assert isinstance(d["content"], str) and d["content"]
            content.append(d["content"])
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:
            assert tc["index"] == len(calls) and CALL_RE.match(tc["id"])
            assert tc["type"] == "function" and tc["function"]["arguments"] == ""
            calls.append([tc["function"]["name"], ""])
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["index"] == len(calls) - 1 and tc["function"]["arguments"]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    assert [(c.name, c.arguments) for c in st.tool_calls] == [tuple(c) for c in calls]
    return "".join(content), [tuple(c) for c in calls]


def _splits(text, rng, random_chunkings=6):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for _ in range(random_chunkings):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _assert_stream_matches(parser, text, seed=0):
    parsed = parser.parse(text)
    for chunks in _splits(text, random.Random(seed)):
        content, calls = _stream(parser, chunks)
        assert content == (parsed.content or ""), (chunks, content)
        assert [n for n, _ in calls] == [c.name for c in parsed.tool_calls], chunks
        for (_, args), call in zip(calls, parsed.tool_calls):
            assert json.loads(args) == json.loads(call.arguments)
            assert args == call.arguments          # no repeated keys in these texts
    return parsed


# ------------------------------------------------------------------------------ hermes
def _hermes(name, args, arg_key="arguments"):
    return f'<tool_call>\n{{"name": "{name}", "{arg_key}": {json.dumps(args)}}}\n</tool_call>'


HERMES_CASES = [
    # (text, content, [(name, arguments dict)])
    ("Hello there, no tools today.", "Hello there, no tools today.", []),
    ("a < b and <tool or <tool_cal", "a < b and <tool or <tool_cal", []),
    ("  \n ", "  \n ", []),
    (_hermes("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + _hermes("get_weather", {"city": "Zürich", "unit": "C"}) + "\n"
     + _hermes("add", {"a": 1, "b": 2.5}) + "\n",
     "Let me look.\n", [("get_weather", {"city": "Zürich", "unit": "C"}),
                        ("add", {"a": 1, "b": 2.5})]),
    ('<tool_call>{"arguments": {"a": -0.5e3, "b": 1E2}, "name": "add"}</tool_call> done',
     " done", [("add", {"a": -500.0, "b": 100.0})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
     None, [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Caf\\u00e9 \\ud83d\\ude00 '
     '\\"q\\" </tool_call> \\n"}, "extra": [1, {"x": null}]}', None,
     [("get_weather", {"city": 'Café 😀 "q" </tool_call> \n'})]),
    ('<tool_call>{"name": "add", "parameters": {"a": 1, "b": [true, false, null, {"c": []}]}}'
     '</tool_call>', None, [("add", {"a": 1, "b": [True, False, None, {"c": []}]})]),
    # malformed blocks stay content
    ("<tool_call>\nget_weather(city='Paris')\n</tool_call>",
     "<tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    ('<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>',
     '<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ('Cut: <tool_call>\n{"nam', 'Cut: <tool_call>\n{"nam', []),
    ("<tool_call>oops " + _hermes("ping", {}), "<tool_call>oops ", [("ping", {})]),
    (_hermes("ping", {}) + "}} trailing", "}} trailing", [("ping", {})]),
    ("x <tool_call>", "x <tool_call>", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_parse_and_stream(text, content, calls):
    parser = HermesToolParser(TOOLS)
    parsed = _assert_stream_matches(parser, text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    for call in parsed.tool_calls:
        assert CALL_RE.match(call.id)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


def test_hermes_without_tools_accepts_any_name_and_keeps_the_first_key():
    text = '<tool_call>{"name": "anything", "name": "x", "arguments": {"k": "v"}, ' \
           '"parameters": {"other": 1}}</tool_call>'
    parsed = _assert_stream_matches(HermesToolParser(), text)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("anything", '{"k": "v"}')]


# ------------------------------------------------------------------------------ llama3_json
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    (' <|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}} ; '
     '{"name": "get_weather", "parameters": {"city": "Rome"}};', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ('{"name": "ping", "parameters": {}}\n\nThat is all.', "\n\nThat is all.", [("ping", {})]),
    ('{"name": "ping", "parameters": {}}; not json', '; not json', [("ping", {})]),
    ('{"name": "ping", "parameters": {}}; {"name": "nope", "parameters": {}}',
     '; {"name": "nope", "parameters": {}}', [("ping", {})]),
    ("The answer is 4.", "The answer is 4.", []),
    ('I will call {"name": "ping"}', 'I will call {"name": "ping"}', []),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ("{broken", "{broken", []),
    ("<|python_ta", "<|python_ta", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_parse_and_stream(text, content, calls):
    parser = Llama3JsonToolParser(TOOLS)
    parsed = _assert_stream_matches(parser, text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_parallel_tool_calls_false_keeps_the_first_call(name):
    text = (_hermes("add", {"a": 1, "b": 2}) + _hermes("ping", {}) if name == "hermes" else
            '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "ping", "parameters": {}}')
    parser = get_tool_parser(name, TOOLS, max_calls=1)
    parsed = _assert_stream_matches(parser, text)
    assert [c.name for c in parsed.tool_calls] == ["add"] and parsed.content is None


def test_a_call_broken_after_it_was_announced_loses_no_text():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": tru}}</tool_call>after')
    parser = HermesToolParser(TOOLS)
    assert parser.parse(text).content == text            # the whole output: strict
    content, calls = _stream(parser, list(text))
    assert content == "after"
    assert calls[0][0] == "add" and calls[0][1].startswith('{"a": 1, "b": ')
    assert "tru" in calls[0][1]
    content, calls = _stream(parser, ['<tool_call>{"name": "add", "arguments": {"a": 12'])
    assert (content, calls) == ("", [("add", '{"a": 12')])  # cut short: the tail comes raw


def test_many_random_outputs_stream_like_they_parse():
    rng = random.Random(7)
    pieces = ["Sure. ", "\n", " ", "<", "<tool", "x", "é", _hermes("ping", {}),
              _hermes("add", {"a": rng.random(), "b": -3}),
              _hermes("get_weather", {"city": "A\"\\\n\u2028\U0001F600"}),
              '<tool_call>{"name": "bad"}</tool_call>', "</tool_call>", "<tool_call>"]
    parser = HermesToolParser(TOOLS)
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        parsed = parser.parse(text)
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, len(text) + 1), min(len(text), 5)))
            chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            content, calls = _stream(parser, chunks)
            assert content == (parsed.content or "")
            assert calls == [(c.name, c.arguments) for c in parsed.tool_calls]


# ------------------------------------------------------------------------------ the JSON reader
def _lex(text):
    """(canonical text, rest) when text begins with a JSON object, else None."""
    lexer, canon, out = JsonLexer("{"), Canon(), []
    for i, ch in enumerate(text):
        try:
            out.extend(canon.event(k, p) for k, _, p in lexer.push(ch))
        except JsonError:
            return None
        if lexer.done:
            return "".join(out), text[i + 1:]
    return None


def _random_value(rng, depth=0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([0, -1, 7, 10**20, -0.0, 1.5e-7, 3.25, float("inf")])
    if kind == 1:
        return rng.choice([True, False, None])
    if kind in (2, 3, 4):
        return "".join(rng.choice('ab "\\/\n\t\x01é😀\u2028<>') for _ in range(rng.randrange(5)))
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {_random_value(rng, 3) if rng.random() < 0.3 else f"k{i}": _random_value(rng, depth + 1)
            for i in range(rng.randrange(4))}


def test_json_reader_agrees_with_json_loads():
    rng = random.Random(3)
    for _ in range(400):
        value = {"v": _random_value(rng)}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1]), separators=rng.choice([None, (",", ":")]))
        if rng.random() < 0.5:                   # a random edit: often invalid
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice(['', ',', '"', '}', ']', '\\', '0', 'e', '-', ' ',
                                          '\\u', 'tru', 'NaN', '\x00']) + text[i + 1:]
        try:
            obj, end = json.JSONDecoder().raw_decode(text)
            expected = (json.dumps(obj, ensure_ascii=False), text[end:]) \
                if isinstance(obj, dict) else None
        except (ValueError, RecursionError):
            expected = None
        got = _lex(text)
        if expected is None:
            assert got is None or not text.startswith("{"), text
        else:
            assert got is not None, text
            assert json.loads(got[0]) == json.loads(expected[0]) or got[0] == expected[0], text
            assert got[1] == expected[1]


# ------------------------------------------------------------------------------ constrained forms
def _check_schema_shape(schema):
    assert isinstance(schema, dict)
    json.dumps(schema)                                   # plain JSON data


def test_required_schema_and_its_outputs():
    schema = required_schema(TOOLS, parallel_tool_calls=True)
    _check_schema_shape(schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["add"], ["ping"]]
    assert items[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert items[2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert all(i["required"] == ["name", "parameters"] for i in items)
    assert required_schema(TOOLS, parallel_tool_calls=False)["maxItems"] == 1
    assert "anyOf" not in required_schema([ADD])["items"]

    example = [{"name": "get_weather", "parameters": {"city": "Paris"}},
               {"name": "add", "parameters": {"a": 1, "b": 2}}]
    text = json.dumps(example)
    calls = calls_from_required(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (e["name"], e["parameters"]) for e in example]
    parser = RequiredCallsParser(TOOLS)
    parsed = _assert_stream_matches(parser, text)
    assert parsed.content is None and len(parsed.tool_calls) == 2
    _assert_stream_matches(parser, json.dumps(example, indent=2))
    cut = text[:text.index("Paris") + 1]
    assert parser.parse(cut).content == cut
    assert _stream(parser, [text[:20]]) == (text[:20], [])        # cut before a name
    assert _stream(parser, [cut]) == ("", [("get_weather", '{"city": "P')])
    with pytest.raises(ValueError):
        calls_from_required('[{"name": "nope", "parameters": {}}]', TOOLS)
    with pytest.raises(ValueError):
        calls_from_required("[]")


def test_required_schema_moves_defs_to_the_root():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {"$ref": "#/$defs/N"}}},
                  "N": {"type": "number"}}}}}
    schema = required_schema([tool, ADD])
    params = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" not in params and params["properties"]["p"] == {"$ref": "#/$defs/f.Point"}
    assert schema["$defs"]["f.Point"]["properties"]["x"] == {"$ref": "#/$defs/f.N"}
    assert named_schema(tool)["$defs"]["N"] == {"type": "number"}   # named: left as it is


def test_named_schema_and_its_outputs():
    assert named_schema(WEATHER) == WEATHER["function"]["parameters"]
    assert named_schema(PING) == {"type": "object", "properties": {}}
    text = ' {"city": "Köln", "unit": "C"}\n'
    call = call_from_named("get_weather", text)
    assert isinstance(call, ToolCall) and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Köln", "unit": "C"}
    parsed = _assert_stream_matches(NamedCallParser("get_weather"), text)
    assert parsed.content is None and [c.name for c in parsed.tool_calls] == ["get_weather"]
    with pytest.raises(ValueError):
        call_from_named("get_weather", "[1]")
    assert NamedCallParser("add").parse('{"a": 1').tool_calls[0].arguments == '{"a": 1'


def test_schemas_compile_and_accept_their_examples():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    def accepts(schema, value):
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        return _is_grammar_accept_string(grammar, json.dumps(value))

    one = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    two = one + [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    assert accepts(required_schema(TOOLS), two)
    assert accepts(required_schema(TOOLS, False), one)
    assert not accepts(required_schema(TOOLS, False), two)
    assert not accepts(required_schema(TOOLS), [{"name": "add", "parameters": {"city": "x"}}])
    assert accepts(named_schema(WEATHER), {"city": "Paris"})
    assert not accepts(named_schema(WEATHER), {"unit": "C"})


def test_finish_reason_rule():
    assert tool_finish_reason("auto", "stop", 1) == "tool_calls"
    assert tool_finish_reason("auto", "stop", 0) == "stop"
    assert tool_finish_reason("required", "stop", 0) == "tool_calls"
    assert tool_finish_reason("named", "length", 1) == "length"
    assert tool_finish_reason("none", "stop", 0) == "stop"


# ------------------------------------------------------------------------------ validation
def _error(**kwargs):
    kwargs.setdefault("parser", "hermes")
    with pytest.raises(GatewayError) as info:
        check_tools(**kwargs)
    assert info.value.status == 400
    return info.value


def test_check_tools_errors_name_the_param():
    err = _error(tools=TOOLS, parser="")
    assert err.param == "tools" and "--tool-call-parser" in err.message
    assert check_tools(TOOLS, "none", parser="").mode == "none"
    assert _error(tools=TOOLS, tool_choice={"type": "function",
                                            "function": {"name": "nope"}}).param == "tool_choice"
    assert _error(tools=None, tool_choice="required").param == "tool_choice"
    assert _error(tools=[], tool_choice={"type": "function",
                                         "function": {"name": "add"}}).param == "tool_choice"
    assert _error(tools=TOOLS, tool_choice="sometimes").param == "tool_choice"
    assert _error(tools=[ADD, ADD]).param == "tools"
    assert _error(tools=[ADD, {"type": "function", "function": {"description": "x"}}]
                  ).param == "tools.1.function.name"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert _error(tools=[bad]).param == "tools.0.function.parameters"
    bad = {"type": "function", "function": {"name": "f", "parameters": [1]}}
    assert _error(tools=[bad]).param == "tools.0.function.parameters"
    assert _error(tools=[{"type": "retrieval"}]).param == "tools.0.type"
    assert _error(tools=TOOLS, parallel_tool_calls="yes").param == "parallel_tool_calls"
    with pytest.raises(ValueError):
        check_tools(TOOLS, parser="nonsense")


def test_check_tools_plans():
    plan = check_tools(TOOLS, None, None, "llama3_json")
    assert (plan.mode, plan.parallel, plan.schema()) == ("auto", True, None)
    assert isinstance(plan.output_parser(), Llama3JsonToolParser)
    assert plan.template_tools == TOOLS
    plan = check_tools(TOOLS, "required", False, "hermes")
    assert plan.schema() == required_schema(TOOLS, False)
    assert isinstance(plan.output_parser(), RequiredCallsParser)
    assert plan.finish_reason("stop", 0) == "tool_calls"
    plan = check_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, "hermes")
    assert (plan.mode, plan.function, plan.schema()) == ("named", "add", named_schema(ADD))
    assert check_tools(None, None, None, "").mode == "none"
    plan = check_tools(TOOLS, "none", None, "hermes")
    assert plan.template_tools is None and plan.output_parser() is None


# ------------------------------------------------------------------------------ rendering
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 1+2?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "3"},
]


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def test_default_rendering_for_a_template_without_tools(tok):
    assert not tok.supports_tools
    prompt = tok.render_chat(CONVERSATION, tools=TOOLS, tool_parser="hermes")
    system = HermesToolParser.system_prompt(TOOLS)
    assert prompt == (
        f"<|im_start|>system\n{system}\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris, and 1+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert json.dumps(WEATHER) in system
    ids = tok.encode_chat(CONVERSATION, tools=TOOLS, tool_parser="hermes")
    assert ids.count(tok.encode("<|im_start|>", add_special_tokens=False)[0]) == 5
    # the model's own call text parses back to the calls it was shown
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [(c.name, json.loads(c.arguments)) for c in HermesToolParser(TOOLS).parse(
        turn).tool_calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def test_default_rendering_llama3_json_and_no_system_message(tok):
    prompt = tok.render_chat(CONVERSATION[1:], tools=TOOLS, tool_parser="llama3_json")
    assert prompt.startswith("<|im_start|>system\n"
                             + Llama3JsonToolParser.system_prompt(TOOLS) + "<|im_end|>\n")
    assert ('<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "add", "parameters": {"a": 1, "b": 2}}<|im_end|>') in prompt
    assert ("<|im_start|>user\nFunction result (get_weather): sunny\n"
            "Function result (add): 3<|im_end|>") in prompt
    # tool messages without tools (tool_choice none) still render; hermes by default
    plain = tok.render_chat(CONVERSATION[1:])
    assert "You are a helpful AI assistant" in plain and "<tool_response>\nsunny" in plain
    # no tools and no tool messages: exactly what the template renders on its own
    simple = [{"role": "user", "content": "Hi"}]
    assert tok.render_chat(simple, tools=None) == tok._template.render(
        messages=simple, add_generation_prompt=True, **{k: v for k, v in
                                                       tok.special_tokens.items() if v})


TOOLS_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %}{{ t.function.name }}={{ t.function | tojson }}"
    "{% if not loop.last %},{% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}(call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}){% endfor %}"
    "{% elif m.role == 'tool' %}(result {{ m.tool_call_id }} {{ m.content }})"
    "{% else %}{{ m.content }}{% endif %}"
    "{% if m.content is defined and m.content is none %}NONE{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_template_that_uses_tools_gets_them(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tok = Tokenizer(tmp_path)
    assert tok.supports_tools
    prompt = tok.render_chat(CONVERSATION, tools=[ADD, PING])
    assert prompt == (
        "[tools]add=" + json.dumps(ADD["function"]) + ",ping=" + json.dumps(PING["function"])
        + "\n<system>Be brief.\n<user>Weather in Paris, and 1+2?\n"
        '<assistant>(call call_a get_weather {"city": "Paris"})(call call_b add {"a": 1, "b": 2})'
        "\n<tool>(result call_a sunny)\n<tool>(result call_b 3)\n<assistant>")
    assert not tok.render_chat([{"role": "user", "content": "x"}]).startswith("[tools]")


def test_fallback_messages_keeps_non_object_arguments_and_names_results():
    msgs = [{"role": "assistant", "content": "Checking.",
             "tool_calls": [{"id": "c1", "function": {"name": "ping", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "pong"},
            {"role": "user", "content": "thanks"}]
    out = fallback_messages(msgs, None, "llama3_json")
    assert out == [
        {"role": "assistant", "content": 'Checking.\n{"name": "ping", "parameters": "not json"}'},
        {"role": "user", "content": "Function result (ping): pong"},
        {"role": "user", "content": "thanks"}]
