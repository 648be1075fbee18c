"""The gateway's torch-free tokenizer against HF transformers on the real model folder."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from gateway.chat_template import ChatTemplateError
from gateway.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "héllo 世界 🎉👨‍👩‍👧 ok — “quotes” 한국어",
    "tabs\tand\n\nnewlines  double  spaces",
    "def f(x):\n    return x ** 2  # code",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🎉 in 日本語"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  \n"}],
]


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, text):
    assert tok.encode(text) == hf(text)["input_ids"]


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf, conv):
    expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(conv) == expected
    ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.encode_chat(conv) == list(ids)


def test_decode_and_eos(tok, hf, model_dir):
    ids = tok.encode(TEXTS[2] + TEXTS[3])
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["eos_token_id"] in tok.eos_token_ids
    assert tok.vocab_size == config["vocab_size"]


def _deltas(tok, ids, sizes, context=()):
    detok = tok.detokenizer(context)
    out, i = [], 0
    for n in sizes:
        out.append(detok.add(ids[i:i + n]))
        i += n
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("context", [(), (1, 4093, 198)])
def test_detokenizer_one_token_at_a_time(tok, context):
    ids = tok.encode("".join(TEXTS) + "<|im_end|>")
    deltas = _deltas(tok, ids, [1] * len(ids), context)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_holds_back_partial_characters(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # a multi-token character in this vocabulary
    detok = tok.detokenizer()
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"
    assert detok.flush() == ""


def test_detokenizer_random_ids_and_batches(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        sizes = [rng.randrange(1, 4) for _ in ids]
        assert "".join(_deltas(tok, ids, sizes, tok.encode("x"))) == tok.decode(ids)


def test_detokenizer_flush_emits_incomplete_tail(tok):
    ids = tok.encode("ok 🎉")[:-1]
    assert "".join(_deltas(tok, ids, [1] * len(ids))) == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_token_bytes_are_raw_bytes(tok):
    text = "a 🎉 日本"
    ids = tok.encode(text)
    assert sum((tok.token_bytes(i) for i in ids), []) == list(text.encode("utf-8"))
    assert tok.token_text(2) == "<|im_end|>"


def _copy_model(model_dir, tmp_path, tok_config_update: dict, files: dict | None = None):
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_config.update(tok_config_update)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_template_sources_and_errors(model_dir, tmp_path):
    listed = [{"name": "tool_use", "template": "T"},
              {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]
    tok = Tokenizer(_copy_model(model_dir, tmp_path, {"chat_template": listed}))
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "<|im_start|>x"

    raising = "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}ok"
    (tmp_path / "chat_template.jinja").write_text(raising)
    tok = Tokenizer(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="only one message"):
        tok.render_chat([{"role": "user", "content": "x"}] * 2)


def test_custom_roles_render_as_transformers_does_or_are_refused(tok, hf, model_dir, tmp_path):
    conv = [{"role": "my-custom-role", "content": "what is 1+1?"}, {"role": "user", "content": "?"}]
    assert tok.render_chat(conv) == hf.apply_chat_template(conv, tokenize=False,
                                                           add_generation_prompt=True)
    # a template that renders only its own roles would drop the message without a word
    only_known = ("{% for m in messages %}{% if m.role in ['user', 'assistant', 'system'] %}"
                  "<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")
    strict = Tokenizer(_copy_model(model_dir, tmp_path, {"chat_template": only_known}))
    assert strict.render_chat(conv[1:]) == "<user>?"
    with pytest.raises(ChatTemplateError, match="does not render messages of role "
                                                "'my-custom-role'"):
        strict.render_chat(conv)


def test_no_template_and_eos_lists(model_dir, tmp_path):
    _copy_model(model_dir, tmp_path, {"chat_template": None})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer(tmp_path)
    assert tok.eos_token_ids == {0, 2}
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_a_name_renders_or_is_refused(tok, model_dir, tmp_path):
    """A message's name must reach the prompt: the default model's template drops every name
    (refused, naming the message, even a name the prompt holds anyway as a role); a template
    that shows a user's name renders it; a tool result's name is the function's in the
    llama3_json rendering, which shows it, and not in hermes'."""
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.name") as err:
        tok.render_chat([{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hey", "name": "assistant"}])
    assert err.value.param == "messages[1].name"
    shows = ("{% for m in messages %}<{{ m.role }}{% if m.role == 'user' and m.name %} "
             "{{ m.name }}{% endif %}>{{ m.content }}{% endfor %}")
    named = Tokenizer(_copy_model(model_dir, tmp_path, {"chat_template": shows}))
    assert named.render_chat([{"role": "user", "content": "Hi", "name": "Ada"}]) == "<user Ada>Hi"
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.name"):
        named.render_chat([{"role": "system", "content": "x", "name": "Ada"}])
    result = [{"role": "user", "content": "Weather?"},
              {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"}]
    assert "Function result (weather): sunny" in tok.render_chat(result,
                                                                 tool_parser="llama3_json")
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.name"):
        tok.render_chat(result, tool_parser="hermes")
