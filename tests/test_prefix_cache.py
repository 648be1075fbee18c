"""The block hash, the pool's prefix cache (hits, LRU eviction, events) and reuse in the
scheduler and the engine, on tiny configs with exact block ids."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_hash import BlockHasher
from engine.block_pool import EVICTED, STORED, BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler
from tests.conftest import make_engine
from tests.test_batching import run

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# ---------------------------------------------------------------------- the hash
def test_hashes_are_the_same_in_another_process():
    tokens = list(range(1000, 1037))
    here = BlockHasher(16, seed=7).hashes(tokens, b"salt")
    code = ("from engine.block_hash import BlockHasher; "
            f"print(BlockHasher(16, seed=7).hashes({tokens!r}, b'salt'))")
    there = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert len(here) == 2                              # full blocks only: 37 tokens -> 2
    assert eval(there) == here


def test_a_change_in_an_earlier_block_changes_every_later_hash():
    h = BlockHasher(4)
    base = list(range(16))
    ref = h.hashes(base)
    changed = h.hashes([99] + base[1:])
    assert all(a != b for a, b in zip(ref, changed))
    late = h.hashes(base[:9] + [99] + base[10:])       # block 2 changes: blocks 0, 1 keep theirs
    assert late[:2] == ref[:2] and all(a != b for a, b in zip(ref[2:], late[2:]))
    assert h.hashes(base, b"a") != ref and h.hashes(base, b"a")[0] != h.hashes(base, b"b")[0]
    assert BlockHasher(4, seed=1).hashes(base) != ref
    assert h.extend(ref[:2], base) == ref              # incremental = from scratch
    with pytest.raises(ValueError, match="full blocks"):
        h.hash_block(0, [1, 2, 3])


# ---------------------------------------------------------------------- the pool
def test_pool_evicts_least_recently_freed_first_and_reports_events():
    pool = BlockPool(4)
    a = pool.allocate(2)                               # [0, 1]
    b = pool.allocate(2)                               # [2, 3]
    for blk, h in zip(a + b, (10, 11, 20, 21)):
        pool.cache(blk, h, [h])
    pool.free(a)                                       # free queue: 1, 0 (tail block first)
    pool.free(b)                                       # then 3, 2
    assert pool.num_free == 4 and pool.num_cached == 4
    assert pool.lookup(11, [11]) == 1 and pool.lookup(11, [12]) is None   # tokens are checked
    pool.take([0])                                     # a hit takes block 0 off the free queue
    assert pool.allocate(2) == [1, 3]                  # LRU order, skipping the taken block
    assert pool.lookup(11, [11]) is None and pool.lookup(10, [10]) == 0
    events = list(pool.events)
    assert events[:4] == [(STORED, 10), (STORED, 11), (STORED, 20), (STORED, 21)]
    assert events[4:] == [(EVICTED, 11), (EVICTED, 21)]
    pool.cache(2, 10, [10])                            # hash held by block 0 already: ignored
    assert pool.lookup(10, [10]) == 0 and pool.evictions == 2


def make_sched(num_blocks=8, role="prefill", budget=64):
    cfg = EngineConfig(role=role, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget)
    kv = KVCacheManager(BlockPool(num_blocks), 4, BlockHasher(4))
    return Scheduler(cfg, kv, eos_token_ids=(0,), max_model_len=64), kv


def prefill(s: Scheduler, req: Request):
    s.add(req)
    out = s.schedule()
    s.update(out, [7] * sum(x.sample for x in out.scheduled), [None])
    return out


def test_scheduler_reuses_a_cached_prefix_and_computes_only_the_rest():
    s, kv = make_sched()
    prefill(s, Request("a", list(range(1, 11)), GREEDY))          # 10 tokens: blocks 0, 1, (2)
    assert kv.block_table("a") == [0, 1, 2] and kv.pool.num_cached == 2
    s.save_done("a")      # the send is done
    b = Request("b", list(range(1, 9)) + [50, 51, 52], GREEDY)    # shares 2 full blocks
    out = prefill(s, b)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 3)]
    assert kv.block_table("b")[:2] == [0, 1] and b.num_cached_tokens == 8
    s.save_done("b")      # the send is done
    c = Request("c", list(range(1, 9)), GREEDY)                   # all of it cached: the last
    out = prefill(s, c)                                           # block is computed again
    assert out.scheduled[0].num_new_tokens == 4 and kv.block_table("c")[0] == 0
    assert kv.block_table("c")[1] != 1 and c.num_cached_tokens == 4
    assert (kv.query_tokens, kv.hit_tokens) == (10 + 11 + 8, 0 + 8 + 4)
    s.save_done("c")      # the send is done
    assert kv.pool.num_free == 8


def test_decode_reservation_reuses_blocks_it_holds():
    s, kv = make_sched(role="decode")
    first = Request("t1", list(range(1, 13)), GREEDY)             # a conversation's first turn
    assert s.reserve_remote(first) == [0, 1, 2] and first.num_cached_blocks == 0
    s.remote_ready("t1", 5, None)                                 # KV arrived: blocks cached
    s.abort("t1")
    second = Request("t2", list(range(1, 13)) + [5, 60, 61, 62, 63], GREEDY)
    blocks = s.reserve_remote(second)
    assert blocks[:3] == [0, 1, 2] and second.num_cached_blocks == 3
    assert len(blocks) == 5


def test_without_a_hasher_nothing_is_shared():
    cfg = EngineConfig(role="prefill", block_size=4, num_blocks=8, enable_prefix_caching=False)
    kv = KVCacheManager(BlockPool(8), 4, None)
    s = Scheduler(cfg, kv, eos_token_ids=(0,), max_model_len=64)
    prefill(s, Request("a", list(range(1, 11)), GREEDY))
    s.save_done("a")      # the send is done
    out = prefill(s, Request("b", list(range(1, 11)), GREEDY))
    assert out.scheduled[0].num_new_tokens == 10 and kv.pool.num_cached == 0


# ---------------------------------------------------------------------- the engine
def test_cache_hits_give_the_same_tokens_as_misses(tiny_model_dir):
    shared = list(range(30, 50))                                  # 5 blocks of 4
    prompts = [shared + [1, 2, 3], shared + [9, 8], shared[:13] + [4] * 6, shared]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    cold = make_engine(tiny_model_dir, num_blocks=64, enable_prefix_caching=False)
    want = {}
    for i, p in enumerate(prompts):
        want.update(run(cold, [Request(str(i), p, params)]))
    warm = make_engine(tiny_model_dir, num_blocks=64, enable_prefix_caching=True)
    got = {}
    for i, p in enumerate(prompts):                               # one after another: hits
        got.update(run(warm, [Request(str(i), p, params)]))
    assert got == want
    kv = warm.kv_manager
    assert kv.hit_tokens >= 20 + 12 + 16
    again = run(warm, [Request(f"again{i}", p, params) for i, p in enumerate(prompts)])
    assert {k[5:]: v for k, v in again.items()} == want           # and batched together
    assert warm.pool.num_free == 64
