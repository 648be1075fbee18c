"""OpenAI tool calling for /v1/chat/completions: validation, output parsing, forced calls.

The pieces, in the order a request meets them:

1. `validation.check_tools(tools, tool_choice, parallel_tool_calls, parser)` validates the
   request fields and resolves them into a `ToolPlan` (mode "none" | "auto" | "required" |
   "named").
2. Rendering: `Tokenizer.render_chat(messages, tools=plan.template_tools,
   tool_parser=plan.parser)`; gateway/chat_template.py says how tools reach the prompt (the
   model's own template when it uses tools, else a default rendering in the parser's text
   forms).
3. Constrained decoding for "required" and a named function: `plan.schema()` (`forced.py`) is a
   JSON schema for the grammar engine, so the output always parses.
4. Parsing the output: `plan.output_parser()` gives a parser with `parse(text) -> ParsedOutput`
   for the whole output and `streamer()` for streaming (`feed(delta) -> list[delta dict]`,
   `finish() -> list[delta dict]`); the delta dicts are OpenAI chat-chunk `delta` objects
   (`base.py` states what streaming guarantees).
5. `plan.finish_reason(engine_reason, num_calls)` (the rule is in `validation.py`).

The modules: `json_stream` (an incremental JSON lexer), `base` (results, the parser and
streamer bases), `call_object` (one call object, whole or streamed), one module per
`--tool-call-parser` format (`hermes`, `llama3_json`) and `registry` (the formats by name),
`forced` ("required" and named calls), `validation` (`check_tools`, `ToolPlan`).
"""
