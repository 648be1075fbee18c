"""Tokenization for the gateway, from an HF model folder, without transformers.

Reads tokenizer.json with the `tokenizers` library, renders the chat template
(gateway/chat_template.py), and reads the EOS ids from generation_config.json and config.json.

`IncrementalDetokenizer` turns a stream of generated token ids into text deltas whose
concatenation is exactly `decode(all ids)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer

from gateway.chat_template import (compile_chat_template, load_chat_template, render_chat,
                                   template_uses_tools)

REPLACEMENT_CHAR = "\ufffd"
SPECIAL_TOKEN_VARS = ("bos_token", "eos_token", "unk_token", "pad_token")


LONG_TEXT_CHARS = 16384


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _build_byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: each of the 256 bytes is shown as one printable
    character; printable Latin-1 bytes map to themselves, the rest to code points from 256 up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    chars = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _build_byte_decoder()  # a constant table, never mutated


def _uses_byte_level(spec: dict) -> bool:
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return True
    return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) or [])


class Tokenizer:
    """The model's tokenizer and chat template, read from an HF model folder.

    `encode(text)` matches transformers' `tokenizer(text)["input_ids"]` (special tokens in the
    text are recognised; the post-processor adds what it is configured to add).
    `render_chat(messages)` matches `apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)`, with `tools` too when the template uses them
    (`supports_tools`); for a template that does not, tools and tool messages are rendered the
    default way described in gateway/chat_template.py. Decoding skips special tokens and applies
    no clean-up.
    """

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} is missing: the gateway needs a fast tokenizer")
        self._tok = HFTokenizer.from_file(str(tok_file))
        self._byte_level = _uses_byte_level(_read_json(tok_file))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        self.special_tokens = {name: _token_content(tok_config.get(name))
                               for name in SPECIAL_TOKEN_VARS}
        self.eos_token_ids = frozenset(_as_id_list(gen_config.get("eos_token_id"))
                                       + _as_id_list(config.get("eos_token_id")))
        self.vocab_size = int(config.get("vocab_size") or self._tok.get_vocab_size(True))
        self.chat_template_source = load_chat_template(model_dir, tok_config)
        self._template = (compile_chat_template(self.chat_template_source)
                          if self.chat_template_source else None)
        # the template reads `tools` itself; else tools are rendered the default way
        self.supports_tools = template_uses_tools(self.chat_template_source)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            # the batch call releases the GIL while it works (the single one holds it): a long
            # prompt tokenized on a thread leaves the event loop serving the other streams
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (special tokens included), as logprobs report it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes of one token (a partial UTF-8 character stays partial)."""
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and self._tok.token_to_id(piece) == token_id:
            if all(ch in _BYTE_DECODER for ch in piece):
                return [_BYTE_DECODER[ch] for ch in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, tool_parser: str | None = None) -> str:
        """The prompt text of a conversation; a ChatTemplateError (gateway/chat_template.py)
        carries the template's message.

        `tools`: the OpenAI tool list ({"type": "function", "function": {...}}); messages may
        carry assistant `tool_calls` and tool-role `tool_call_id`. `tool_parser` (the server's
        --tool-call-parser) picks the text forms of the default rendering, which is used when
        the template does not use tools (gateway/chat_template.py describes it)."""
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        return render_chat(self._template, messages, supports_tools=self.supports_tools,
                           variables=variables, add_generation_prompt=add_generation_prompt,
                           tools=tools, tool_parser=tool_parser)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    tool_parser: str | None = None) -> list[int]:
        """Token ids of a rendered conversation (the template already holds the special tokens)."""
        return self.encode(self.render_chat(messages, tools=tools, tool_parser=tool_parser),
                           add_special_tokens=False)

    def detokenizer(self, context_ids: Sequence[int] = (),
                    skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, context_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Per-request incremental decoding of generated tokens.

    Contract: the deltas returned by `add()` followed by `flush()` concatenate to the text of all
    added ids decoded together (special tokens skipped unless skip_special_tokens is false).
    Text that ends in U+FFFD (an incomplete UTF-8 character spread over several tokens) is held
    back until it completes, or until flush().

    Decoding works on a window `ids[prefix:]`: the text of `ids[prefix:read]` was already emitted,
    so the delta is what the window adds past it. Decoding a window rather than single tokens keeps
    context-dependent decoders (leading-space rules, byte fallback) right. `context_ids` (e.g. the
    last prompt tokens) only seed that context; their text is never emitted.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(context_ids)
        context_text = tokenizer.decode(context) if context else ""
        if not context_text or context_text.endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def _window_texts(self) -> tuple[str, str]:
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix:], self._skip)
        return done, full

    def add(self, ids: Iterable[int]) -> str:
        """Append generated ids; return the new complete text (may be empty)."""
        self._ids.extend(ids)
        done, full = self._window_texts()
        if len(full) <= len(done) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done):]

    def flush(self) -> str:
        """Emit whatever is still held back; call once, when generation has finished."""
        done, full = self._window_texts()
        self._prefix = self._read = len(self._ids)
        return full[len(done):]
