"""Prefix caching and prefix-aware routing through the real stack: redis-server, two prefill
workers, one decode worker and the gateway, on the real model in fp32.

Requests run one after another, so the routing decisions are deterministic: the second request
with a shared system prompt goes to the prefill worker that computed it, cache hits give the same
greedy tokens as HF, a conversation's second turn reuses the decode worker's blocks, and losing
Redis mid-run loses no request (routing falls back to load, then recovers)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis as redis_client

from cluster.registry import KEY_PREFIX

from tests.stack import Stack, metric, standard_stack, wait_idle, wait_until
from tests.test_e2e import hf, hf_greedy, prompt_ids  # noqa: F401  (module fixture)

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small bookshop. Answer in one short sentence. "
          "The shop opens at nine in the morning and closes at six in the evening, every day "
          "except Sunday. It sells new and used books, maps, and postcards, and it has a reading "
          "corner with two armchairs near the window. Orders can be picked up at the counter.")
QUESTIONS = ["When does the shop open?", "Does it sell maps?", "Where is the reading corner?"]
NEW = 16
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("stack"),
                        prefills=("prefill-a", "prefill-b")) as s:
        yield s


def _registered(s: Stack, role: str) -> int:
    client = redis_client.Redis.from_url(s.redis_url, socket_timeout=2)
    try:
        return sum(client.hget(key, "role") == role.encode()
                   for key in client.scan_iter(KEY_PREFIX + "*"))
    except redis_client.ConnectionError:      # the restarted server is not listening yet
        return 0
    finally:
        client.close()


def ask(stack, question: str, n=NEW) -> str:
    return ask_messages(stack, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": question}], n)


def hits(stack, name) -> float:
    return metric(stack.proc(name).metrics, "pdserve_prefix_cache_hits_tokens_total")


def test_hits_give_hf_tokens_and_routing_follows_the_prefix(stack, hf):  # noqa: F811
    tok = hf[0]
    first = ask(stack, QUESTIONS[0])                          # computed in full somewhere
    holder = max(("prefill-a", "prefill-b"),
                 key=lambda n: metric(stack.proc(n).metrics,
                                      "pdserve_prefix_cache_queries_tokens_total"))
    other = "prefill-b" if holder == "prefill-a" else "prefill-a"
    assert hits(stack, holder) == 0
    again = ask(stack, QUESTIONS[0])
    answers = [ask(stack, q) for q in QUESTIONS[1:]]
    assert again == first
    for q, answer in zip(QUESTIONS, [first] + answers):
        ids = prompt_ids(hf, chat=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": q}])
        assert answer == tok.decode(hf_greedy(hf, ids, NEW), skip_special_tokens=True)
    system_blocks = len(prompt_ids(hf, chat=[{"role": "system", "content": SYSTEM}])) // 16
    assert hits(stack, holder) >= 3 * system_blocks * 16      # every later request hit there
    assert hits(stack, other) == 0
    gw = f"{stack.procs[-1].http}/metrics"
    assert metric(gw, "pdserve_routing_reasons_total", reason="cached_prefix") >= 3
    assert metric(gw, "pdserve_prefix_directory_blocks") > 0


def test_second_turn_reuses_the_decode_workers_blocks(stack, hf):  # noqa: F811
    turn1 = [{"role": "system", "content": "You answer with one word."},
             {"role": "user", "content": "Name a color of the sky on a clear day, then explain "
                                         "in detail why the sky has that color at noon."}]
    before = hits(stack, "decode")
    reply = ask_messages(stack, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "And at sunset?"}]
    ask_messages(stack, turn2)
    shared = len(prompt_ids(hf, chat=turn1)) // 16 * 16
    assert hits(stack, "decode") - before >= shared


def ask_messages(stack, messages, n=NEW) -> str:
    r = httpx.post(f"{stack.procs[-1].http}/v1/chat/completions", timeout=180, json={
        "model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_losing_redis_loses_no_request_and_routing_recovers(stack):
    gw = f"{stack.procs[-1].http}/metrics"
    redis = stack.proc("redis")
    port = redis.address.rsplit(":", 1)[1]
    redis.popen.terminate()
    redis.popen.wait(10)
    with ThreadPoolExecutor(4) as ex:
        answers = list(ex.map(lambda q: ask(stack, q, 8), QUESTIONS + ["Is it open on Sunday?"]))
    assert all(answers)
    assert metric(gw, "pdserve_routing_reasons_total", reason="no_directory") >= 1
    restarted = subprocess.Popen(["redis-server", "--port", port, "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # workers register again and republish their full sets; the gateway routes by prefix,
        # and keeps routing to the decode worker whether or not it has registered again yet
        wait_until(lambda: _registered(stack, "prefill") == 2, 30, "prefill workers back")
        before = metric(gw, "pdserve_routing_reasons_total", reason="cached_prefix")

        def routed_by_prefix() -> bool:           # else one more request
            if metric(gw, "pdserve_routing_reasons_total", reason="cached_prefix") > before:
                return True
            ask(stack, QUESTIONS[1], 2)
            return False
        wait_until(routed_by_prefix, 30, "routing by the directory again", interval_s=0.5)
    finally:
        restarted.terminate()
        restarted.wait(10)


def test_pools_are_all_free_afterwards(stack):
    wait_idle(*(stack.proc(name) for name in ("prefill-a", "prefill-b", "decode")), timeout_s=10)
