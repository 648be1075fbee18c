"""The pipeline's text handling (stop strings, EOS, detokenization of D's token batches) and the
OpenAI response shapes built from its Deltas."""

from __future__ import annotations

import pytest

from gateway.choice_text import ChoiceText, Delta, StopStrings, TokenLogprob
from gateway.openai_format import OpenAIFormatter
from gateway.params import GenerationParams, Prompt, RequestPreparer, ServedModel
from gateway.tokenizer import Tokenizer
from proto import pdserve_pb2 as pb

EOS = 2


def _feed_all(stops, pieces):
    s = StopStrings(tuple(stops))
    out, stopped = [], False
    for piece in pieces:
        text, stopped = s.feed(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(s.flush())
    return out, stopped


def test_stop_strings_cut_and_hold_back():
    out, stopped = _feed_all(["END"], ["Hello E", "N", "D tail"])
    assert stopped and "".join(out) == "Hello "
    assert out[0] == "Hello "  # "E" held back: it may start "END"
    out, stopped = _feed_all(["END"], ["Hello E", "NX", " done"])
    assert not stopped and out == ["Hello ", "ENX", " done", ""]
    out, stopped = _feed_all(["\n\n", "###"], ["a\n", "#", "##b"])
    assert stopped and "".join(out) == "a\n"
    out, stopped = _feed_all([], ["x", "y"])
    assert out == ["x", "y", ""] and not stopped
    out, stopped = _feed_all(["ab", "b"], ["xab"])  # the earliest match wins
    assert out == ["x"] and stopped


@pytest.fixture(scope="module")
def preparer(model_dir):
    return RequestPreparer(Tokenizer(model_dir), ServedModel("smol", 2048))


def _run(preparer, text: str, batches, **raw):
    prepared = preparer.prepare(Prompt(text="Say:"), GenerationParams.from_client(**raw))
    state = ChoiceText(preparer.tokenizer, prepared)
    tok = preparer.tokenizer
    ids = tok.encode(text)
    deltas, i = [], 0
    for n, finish in batches:
        chunk = ids[i:i + n] if n >= 0 else ids[i:] + [EOS]
        i += max(n, 0)
        deltas.append(state.consume(pb.TokenBatch(token_ids=chunk, finish_reason=finish)))
        if deltas[-1].finish_reason:
            break
    return ids, deltas


def test_eos_is_counted_but_not_shown(preparer):
    ids, deltas = _run(preparer, "Hello 🎉 world", [(1, ""), (1, ""), (-1, "stop")])
    assert "".join(d.text for d in deltas) == "Hello 🎉 world"
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens == len(ids) + 1
    assert deltas[-1].token_ids[-1] == EOS


def test_stop_string_across_tokens(preparer):
    ids, deltas = _run(preparer, "one two three four five", [(1, "")] * 10, stop=("three",))
    assert "".join(d.text for d in deltas) == "one two "
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens < len(ids)


def test_length_finish_flushes_held_text(preparer):
    ids, deltas = _run(preparer, "abc thr", [(1, "")] * 1 + [(10, "length")], stop=("three",))
    assert "".join(d.text for d in deltas) == "abc thr"
    assert deltas[-1].finish_reason == "length"


def _delta(tok, text, finish=None, count=1, logprob=True):
    ids = tuple(tok.encode(text))
    lps = tuple(TokenLogprob(i, -0.5, ((i, -0.5), (7, -1.5), (8, float("-inf")))) for i in ids)
    return Delta(ids, text, lps if logprob else (), finish, count)


def test_chat_stream_and_response_shapes(preparer):
    prepared = preparer.prepare(Prompt(messages=({"role": "user", "content": "Hi"},)),
                                GenerationParams.from_client(logprobs=True, top_logprobs=2))
    fmt = OpenAIFormatter(prepared, preparer.tokenizer, include_usage=True)
    tok = preparer.tokenizer
    role = fmt.role_chunk()
    assert role["object"] == "chat.completion.chunk" and role["usage"] is None
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = fmt.delta_chunks(_delta(tok, "Hi", "stop"))
    # as vLLM: the finish rides on the chunk of the last text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == ["stop"]
    assert chunks[0]["choices"][0]["delta"] == {"content": "Hi"}
    content = chunks[0]["choices"][0]["logprobs"]["content"][0]
    assert set(content) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content["top_logprobs"]) == 2 and content["bytes"] == list(b"Hi")
    ended = OpenAIFormatter(prepared, tok, include_usage=True)      # a last step with no text
    ended.delta_chunks(_delta(tok, "Hi", None))
    last = ended.delta_chunks(Delta((), "", (), "stop", 1))
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in last] \
        == [({}, "stop")]
    usage = fmt.usage_chunk(1)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    full = fmt.response([_delta(tok, "Hi", "stop")])
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert full["usage"]["total_tokens"] == prepared.num_prompt_tokens + 1


def test_completion_logprobs_shape(preparer):
    params = GenerationParams.from_client(logprobs=True, top_logprobs=3)
    prepared = preparer.prepare(Prompt(text="x"), params)
    fmt = OpenAIFormatter(prepared, preparer.tokenizer)
    tok = preparer.tokenizer
    full = fmt.response([_delta(tok, "Hello"), _delta(tok, " world", "length", 2)])
    choice = full["choices"][0]
    assert full["object"] == "text_completion" and choice["text"] == "Hello world"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Hello", " world"] and lp["text_offset"] == [0, 5]
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"][0]["Hello"] == -0.5 and -9999.0 in lp["top_logprobs"][0].values()
    assert choice["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 2
