"""Block pool, KV cache manager and scheduler on tiny configs, with exact expected block ids."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, NoFreeBlocks
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams, Status
from engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def make(num_blocks=8, block_size=4, budget=8, max_seqs=4, role="decode", cap=0):
    cfg = EngineConfig(role=role, block_size=block_size, num_blocks=num_blocks,
                       max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                       long_prefill_tokens=cap or budget)
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(cfg, kv, eos_token_ids=(0,), max_model_len=64), kv


def test_pool_allocates_in_order_and_frees_tail_first():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([0, 1, 2])
    assert pool.allocate(4) == [3, 2, 1, 0]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free([3])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([3])


def test_chunked_prefill_respects_budget_and_block_ids():
    s, kv = make(budget=8)
    a = Request("a", list(range(1, 11)), GREEDY)      # 10 tokens
    b = Request("b", [5, 6, 7], GREEDY)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == \
        [("a", 8, False)]
    assert kv.block_table("a") == [0, 1]
    s.update(out, [], [])
    out = s.schedule()                                # a finishes its prompt, b fits behind it
    assert [(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == \
        [("a", 2, True), ("b", 3, True)]
    assert kv.block_table("a") == [0, 1, 2] and kv.block_table("b") == [3]
    outs = s.update(out, [9, 9], [None, None])
    assert [o.new_token_ids for o in outs] == [[9], [9]]
    out = s.schedule()                                # decode: one token each
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1)]


def test_long_prompt_spans_steps_and_shares_the_last_one():
    s, _ = make(num_blocks=16, budget=8)
    s.add(Request("long", list(range(1, 31)), GREEDY))
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append([(x.request.request_id, x.num_new_tokens) for x in out.scheduled])
        s.update(out, [3] * sum(x.sample for x in out.scheduled), [None] * 2)
        if len(steps) == 3:
            s.add(Request("short", [1, 2], GREEDY))
    assert steps == [[("long", 8)], [("long", 8)], [("long", 8)], [("long", 6), ("short", 2)]]


def test_short_prompt_is_not_held_behind_a_long_one():
    s, _ = make(num_blocks=16, budget=8, cap=2)
    s.add(Request("long", list(range(1, 31)), GREEDY))
    s.add(Request("short", [1, 2], GREEDY))
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append([(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled])
        s.update(out, [3] * sum(x.sample for x in out.scheduled), [None] * 2)
    # while the short one waits, the long chunk is capped; then decodes go first, the long
    # prompt takes the rest of the budget
    assert steps == [[("long", 2, False), ("short", 2, True)],
                     [("short", 1, True), ("long", 7, False)],
                     [("short", 1, True), ("long", 7, False)]]


def test_prompts_that_fit_the_budget_are_taken_whole():
    # each longer than the cap but both within the budget: both sample in the first step, where a
    # capped chunk each would have taken two steps; the third waits for the next
    s, _ = make(num_blocks=16, budget=8, cap=2)
    for name in "abc":
        s.add(Request(name, [1, 2, 3, 4], GREEDY))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [
        ("a", 4, True), ("b", 4, True)]


def test_eos_and_length_finish_and_free():
    s, kv = make()
    s.add(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2)))
    s.add(Request("b", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5)))
    outs = s.update(s.schedule(), [7, 0], [None, None])   # b samples EOS
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", None), ("b", "stop")]
    outs = s.update(s.schedule(), [7], [None])
    assert outs[0].finish_reason == "length"
    assert kv.pool.num_free == kv.pool.num_blocks and not s.running


def test_preempts_newest_and_recomputes():
    s, kv = make(num_blocks=3, block_size=4, budget=16)
    a = Request("a", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8))
    b = Request("b", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8))
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [9, 9], [None, None])       # both prefilled: blocks a=[0], b=[1]
    out = s.schedule()                                  # a needs block 2, b needs another: none
    assert out.preempted == ["b"]
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert kv.block_table("a") == [0, 2]
    s.update(out, [9], [None])
    s.abort("a")
    out = s.schedule()                                  # b recomputes prompt + its token
    assert [(x.request.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == \
        [("b", 5, True)]


def test_prefill_role_holds_blocks_until_the_send_is_done():
    s, kv = make(role="prefill")
    s.add(Request("a", [1, 2, 3, 4, 5], GREEDY))
    outs = s.update(s.schedule(), [7], [None])
    assert outs[0].finish_reason == "prefilled" and outs[0].kv_blocks == [0, 1]
    assert kv.block_table("a") == [0, 1] and s.connector.is_held("a")
    assert [kv.pool.ref_count(b) for b in (0, 1)] == [2, 2]   # the table's, the transfer's
    s.abort("a")                                # cancelled mid-send: the table goes, but
    assert kv.pool.num_free == kv.pool.num_blocks - 2      # a transport may still read them
    s.save_done("a")
    assert kv.pool.num_free == kv.pool.num_blocks
    assert s.connector.references() == {"saving": 0, "held": 0, "quarantined": 0, "loading": 0}


def test_prefill_save_done_gives_back_the_table_and_every_reference_at_once():
    s, kv = make(role="prefill")
    s.add(Request("a", [1, 2, 3, 4, 5], GREEDY))
    s.update(s.schedule(), [7], [None])
    assert s.connector.references()["saving"] == 2
    s.save_done("a")
    s.save_done("a")                            # a second time: nothing left to give back
    assert kv.pool.num_free == kv.pool.num_blocks and not kv.block_table("a")


def test_prefill_role_hands_out_each_chunks_blocks_once():
    s, kv = make(role="prefill", num_blocks=16, budget=6)
    s.add(Request("a", list(range(1, 15)), GREEDY))     # 14 tokens: chunks of 6, 6, 2
    got = []
    while s.has_work():
        sched = s.schedule()
        for o in s.update(sched, [7] * sum(x.sample for x in sched.scheduled), [None]):
            got.append((o.kv_blocks, o.finish_reason))
    assert got == [([0], None), ([1, 2], None), ([3], "prefilled")]
    s.save_done("a")
    assert kv.pool.num_free == 16


def test_remote_reservation_joins_running_with_first_token():
    s, kv = make()
    req = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=3))
    assert s.reserve_remote(req) == [0, 1]
    assert req.status is Status.WAITING_FOR_REMOTE_KV and not s.has_work()
    out = s.remote_ready("r", 42, None)
    assert out.new_token_ids == [42] and not out.finished
    sched = s.schedule()
    assert [(x.num_new_tokens, x.sample) for x in sched.scheduled] == [(1, True)]
    assert req.num_computed_tokens == 6
    assert s.abort("r") and kv.pool.num_free == kv.pool.num_blocks


def test_remote_reservation_refused_when_full_and_first_token_can_finish():
    s, kv = make(num_blocks=2)
    assert s.reserve_remote(Request("big", list(range(1, 10)), GREEDY)) is None
    assert kv.pool.num_free == 2 and kv.num_requests == 0
    req = Request("one", [1, 2], SamplingParams(temperature=0, max_tokens=1))
    s.reserve_remote(req)
    assert s.remote_ready("one", 5, None).finish_reason == "length"
    assert kv.pool.num_free == 2


def test_preempting_a_request_already_placed_in_the_step_undoes_it():
    s, kv = make(num_blocks=2, block_size=4, budget=7, cap=4)
    a = Request("a", list(range(1, 9)), GREEDY)           # 8 tokens: more than the budget, chunked
    c = Request("c", [5, 6, 7], GREEDY)
    s.add(a)
    s.add(c)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 4), ("c", 3)]
    s.update(out, [9], [None])
    out = s.schedule()      # c decodes first (fits block 1), then a needs a block: c gives way
    assert out.preempted == ["c"]
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 4)]
    assert kv.block_table("a") == [0, 1] and kv.block_table("c") == []


def test_remote_requests_respect_the_running_limit():
    s, kv = make(num_blocks=8, max_seqs=2)
    reqs = [Request(str(i), [1, 2, 3], SamplingParams(temperature=0, max_tokens=4)) for i in range(3)]
    for r in reqs:
        assert s.reserve_remote(r) is not None
        s.remote_ready(r.request_id, 7, None)
    assert [r.request_id for r in s.running] == ["0", "1"] and s.waiting[0] is reqs[2]
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("0", 1), ("1", 1)]
    s.abort("0")
    out = s.schedule()      # the queued one joins with its blocks and one token to compute
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("1", 1), ("2", 1)]
    assert kv.block_table("2") == [2]


def test_longrope_sequences_are_computed_again_past_the_original_context():
    """LongRoPE (engine.layers.rotary): proposals never carry a short-factor step past the
    original context (12 here); a sequence that grows past it is computed again, long."""
    cfg = EngineConfig(role="decode", block_size=4, num_blocks=16, max_num_batched_tokens=32,
                       max_num_seqs=4)
    kv = KVCacheManager(BlockPool(16), 4)
    s = Scheduler(cfg, kv, eos_token_ids=(0,), max_model_len=64, long_rope_after=12)
    r = Request("r", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=20))
    s.add(r)
    s.update(s.schedule(), [50], [None])                 # the prompt, then its first token
    assert r.num_tokens == 11 and not r.long_rope
    r.spec_token_ids = [7, 7, 7, 7]
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 2 and r.spec_token_ids == [7]   # up to 12
    s.update(out, [[7, 51]], [[None, None]])            # the proposal accepted: 13 tokens
    assert r.num_tokens == 13
    out = s.schedule()
    assert r.long_rope and out.scheduled[0].num_new_tokens == 13     # all of it again
    assert kv.blocks_needed(13) == len(kv.block_table("r"))
