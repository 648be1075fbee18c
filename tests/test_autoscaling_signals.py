"""The autoscaling signals: a worker's backlog and measured rates (serving.worker.Signals, sent
with each heartbeat), and the gateway's per-pool gauges and SLO counters built from them
(cluster.metrics.GatewayMetrics: what deploy/k8s's KEDA ScaledObjects query)."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import GatewayMetrics
from cluster.registry import WorkerInfo
from engine.async_engine import AsyncEngine
from engine.request import Request, SamplingParams
from serving.worker import Signals
from tests.conftest import make_engine


def samples(m: GatewayMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(m.exposition()[0].decode())
            for s in f.samples}


def worker(wid: str, role: str, **load) -> WorkerInfo:
    return dataclasses.replace(WorkerInfo(wid, role, "h:1", "m", 16, 0, "float32", 1, 1, 1, 100),
                               **load)


def test_pool_gauges_sum_the_workers_and_divide_the_backlog_by_their_rates():
    m = GatewayMetrics()
    m.set_pools({
        "prefill": [worker("p1", "prefill", queued_prompt_tokens=3000, prompt_tokens_per_s=500,
                           running=2, waiting=5, free_blocks=60),
                    worker("p2", "prefill", queued_prompt_tokens=1000, prompt_tokens_per_s=500,
                           free_blocks=100)],
        "decode": [worker("d1", "decode", remaining_decode_tokens=900, decode_tokens_per_s=30,
                          running=9, free_blocks=10)]})
    s = samples(m)
    pool = lambda name, p: s[(name, (("pool", p),))]          # noqa: E731
    assert pool("pdserve_pool_workers", "prefill") == 2
    assert pool("pdserve_pool_requests_running", "prefill") == 2
    assert pool("pdserve_pool_requests_waiting", "prefill") == 5
    assert pool("pdserve_pool_kv_utilization", "prefill") == 40 / 200
    assert pool("pdserve_pool_backlog_tokens", "prefill") == 4000
    assert pool("pdserve_pool_backlog_seconds", "prefill") == 4000 / 1000
    assert pool("pdserve_pool_backlog_seconds", "decode") == 900 / 30
    assert pool("pdserve_pool_kv_utilization", "decode") == 0.9
    m.set_pools({"prefill": [], "decode": [worker("d1", "decode", remaining_decode_tokens=5)]})
    s = samples(m)
    assert pool("pdserve_pool_workers", "prefill") == 0
    assert pool("pdserve_pool_backlog_seconds", "decode") == 0     # no rate measured yet


def test_slo_counters_count_met_and_missed_only_when_set():
    m = GatewayMetrics()
    m.observe_slo("ttft", 9.0)
    assert not [k for k in samples(m) if k[0] == "pdserve_slo_requests_total"]
    m.set_slo(ttft_s=1.0, tpot_s=0.1)
    for seconds in (0.5, 1.0, 2.0):
        m.observe_slo("ttft", seconds)
    m.observe_slo("tpot", 0.2)
    s = samples(m)
    got = lambda kind, outcome: s[("pdserve_slo_requests_total",            # noqa: E731
                                   (("kind", kind), ("outcome", outcome)))]
    assert got("ttft", "met") == 2 and got("ttft", "missed") == 1 and got("tpot", "missed") == 1
    assert s[("pdserve_slo_target_seconds", (("kind", "tpot"),))] == 0.1


def test_a_workers_backlog_and_rates(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8)
    aengine = AsyncEngine(engine)
    signals = Signals(aengine)
    assert signals() == dict(queued_prompt_tokens=0, remaining_decode_tokens=0,
                             prompt_tokens_per_s=0.0, decode_tokens_per_s=0.0)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i in range(2):
        engine.add_request(Request(f"r{i}", list(range(1, 13)), params))
    first = signals()
    assert first["queued_prompt_tokens"] == 24 and first["remaining_decode_tokens"] == 10
    engine.step()                                    # 8 prompt tokens of the 24
    after = signals()
    assert after["queued_prompt_tokens"] == 16 and after["remaining_decode_tokens"] == 10
    assert after["prompt_tokens_per_s"] > 0 and after["decode_tokens_per_s"] == 0
    while engine.has_work():
        engine.step()
    done = signals()
    assert done["queued_prompt_tokens"] == 0 and done["remaining_decode_tokens"] == 0
    assert done["decode_tokens_per_s"] > 0 and done["prompt_tokens_per_s"] > 0
