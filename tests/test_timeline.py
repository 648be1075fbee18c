"""The engine's per-request Timeline (engine.request.Timeline): recorded for a request that has
one, across chunked prefill, decode, preemption and speculation; a request without one costs no
per-step work (counted calls, not time)."""

import time

import pytest

from engine.engine import Engine
from engine.request import Request, SamplingParams, Timeline
from tests.conftest import make_engine


def _run(engine, reqs, limit=500):
    outs = []
    for _ in range(limit):
        if not engine.has_work():
            break
        outs += engine.step()
    return outs


def test_timeline_records_chunks_first_token_and_decode(tiny_model_dir):
    engine = make_engine(tiny_model_dir)                 # budget 16 tokens a step
    t0 = time.time_ns()
    req = Request("r", list(range(1, 41)), SamplingParams(max_tokens=5, ignore_eos=True),
                  timeline=Timeline(arrived_ns=t0))
    engine.add_request(req)
    _run(engine, [req])
    tl = req.timeline
    assert [c[2] for c in tl.chunks] == [16, 16, 8]      # 40 prompt tokens in three chunks
    assert all(a <= b for a, b, _ in tl.chunks)
    assert t0 <= tl.scheduled_ns == tl.chunks[0][0]
    assert tl.chunks[-1][1] <= tl.first_token_ns <= tl.finished_ns
    assert tl.output_tokens == 5 and tl.decode_steps == 4
    assert not engine._timed                             # nothing kept once finished


def test_timeline_off_adds_no_per_step_work(tiny_model_dir, monkeypatch):
    calls = {"n": 0}
    for name in ("_timed_in", "_record_timelines"):
        orig = getattr(Engine, name)

        def counted(self, *a, _orig=orig, **k):
            calls["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(Engine, name, counted)
    engine = make_engine(tiny_model_dir)
    plain = [Request(f"p{i}", list(range(1, 30)), SamplingParams(max_tokens=4))
             for i in range(3)]
    for r in plain:
        engine.add_request(r)
    _run(engine, plain)
    assert calls["n"] == 0
    timed = Request("t", list(range(1, 30)), SamplingParams(max_tokens=4),
                    timeline=Timeline(arrived_ns=time.time_ns()))
    engine.add_request(timed)
    _run(engine, [timed])
    assert calls["n"] > 0                                # the counter does see the timed path


def test_timeline_counts_preemptions(tiny_model_dir):
    # 32 blocks of 4 tokens: two long requests cannot both grow; the newer one is preempted
    engine = make_engine(tiny_model_dir, num_blocks=12)
    reqs = [Request(f"r{i}", list(range(1, 17)), SamplingParams(max_tokens=24, ignore_eos=True),
                    timeline=Timeline(arrived_ns=time.time_ns())) for i in range(2)]
    for r in reqs:
        engine.add_request(r)
    _run(engine, reqs, limit=2000)
    preempted = [r for r in reqs if r.timeline.preempted_ns]
    assert preempted and all(r.num_preemptions == len(r.timeline.preempted_ns)
                             for r in reqs)
    assert all(r.timeline.output_tokens == 24 for r in reqs)


def test_aborted_timed_request_is_not_kept(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    req = Request("a", list(range(1, 41)), SamplingParams(max_tokens=5),
                  timeline=Timeline(arrived_ns=time.time_ns()))
    engine.add_request(req)
    engine.step()
    assert engine.abort("a")
    assert not engine._timed
