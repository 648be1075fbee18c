"""The KV connector: the one owner of a transfer's block references (engine.kv_connector) and
the decode engine's sink, which touches the pool only on the engine thread
(kvtransfer.connector)."""

import asyncio

import torch

from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler
from tests.conftest import make_engine
from tests.waiting import wait_until_async

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
NONE_HELD = {"saving": 0, "held": 0, "quarantined": 0, "loading": 0}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decode_side(num_blocks=12, one_sided=True):
    cfg = EngineConfig(role="decode", block_size=4, num_blocks=num_blocks,
                       max_num_batched_tokens=32)
    kv = KVCacheManager(BlockPool(num_blocks), 4, BlockHasher(4))
    clock = Clock()
    s = Scheduler(cfg, kv, eos_token_ids=(0,), max_model_len=64, clock=clock)
    s.connector.configure(one_sided, load_timeout_s=10.0, lease_s=30.0)
    return s, kv, clock


def test_a_load_expects_only_the_blocks_after_the_cached_prefix():
    s, kv, _ = decode_side()
    first = Request("t1", list(range(1, 13)), GREEDY)
    s.reserve_remote(first)
    s.remote_ready("t1", 5, None)                   # blocks 0-2 computed: cached
    s.abort("t1")
    second = Request("t2", list(range(1, 13)) + [5, 6, 7, 8, 9], GREEDY)
    blocks = s.reserve_remote(second)
    c = s.connector
    assert c.reserved_blocks("t2") == blocks[3:] and c.is_loading("t2", blocks[3:])
    assert not c.is_loading("t2", blocks[:1])       # the prefix cache's: never written
    assert not c.is_loading("t1", blocks[3:])       # no load for another request
    s.remote_ready("t2", 9, None)
    assert c.reserved_blocks("t2") is None and c.references() == NONE_HELD


def test_an_abort_keeps_a_one_sided_senders_blocks_aside_until_it_is_done():
    s, kv, _ = decode_side()
    s.reserve_remote(Request("r", list(range(1, 9)), GREEDY))      # blocks 0, 1
    s.abort("r")                                    # the client went away mid-transfer
    assert s.connector.references()["quarantined"] == 2
    assert kv.pool.num_free == kv.pool.num_blocks - 2      # nobody else gets them yet
    s.sender_done("r")                    # its abort notice came
    assert kv.pool.num_free == kv.pool.num_blocks and s.connector.references() == NONE_HELD


def test_a_two_sided_senders_blocks_go_back_at_once():
    s, kv, _ = decode_side(one_sided=False)
    s.reserve_remote(Request("r", list(range(1, 9)), GREEDY))
    s.abort("r")                                    # its writes run on the engine thread:
    assert kv.pool.num_free == kv.pool.num_blocks   # none can land after this
    assert s.connector.references() == NONE_HELD


def test_a_late_load_expires_and_a_silent_senders_lease_runs_out():
    s, kv, clock = decode_side()
    s.reserve_remote(Request("late", list(range(1, 9)), GREEDY))
    clock.now = 5.0
    assert s.expire_loads() == []
    clock.now = 11.0
    assert s.expire_loads() == ["late"]         # ended, blocks kept aside
    assert s.connector.reserved_blocks("late") is None
    s.abort("late")                                 # the service fails it: the table goes
    assert kv.pool.num_free == kv.pool.num_blocks - 2
    clock.now = 42.0
    s.expire_loads()                            # no word from the sender in 30 s
    assert kv.pool.num_free == kv.pool.num_blocks and s.connector.references() == NONE_HELD


def test_recomputing_after_a_timeout_never_writes_into_blocks_kept_aside():
    s, kv, clock = decode_side()
    reserved = s.reserve_remote(Request("r", list(range(1, 9)), GREEDY))
    clock.now = 11.0
    assert s.expire_loads() == ["r"]
    assert s.compute_locally("r")                   # --kv-load-failure recompute
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r"]
    assert not set(kv.block_table("r")) & set(reserved)   # a one-sided WRITE may still land
    s.sender_done("r")
    s.abort("r")
    assert kv.pool.num_free == kv.pool.num_blocks


def test_prefill_blocks_stay_until_save_done_whatever_ends_the_request_first():
    cfg = EngineConfig(role="prefill", block_size=4, num_blocks=8, max_num_batched_tokens=4)
    kv = KVCacheManager(BlockPool(8), 4, BlockHasher(4))
    s = Scheduler(cfg, kv, eos_token_ids=(0,), max_model_len=64)
    s.add(Request("a", list(range(1, 11)), GREEDY))            # 10 tokens: chunks 4, 4, 2
    out = s.schedule()
    (o,) = s.update(out, [], [])
    assert o.kv_blocks == [0]                       # first chunk final: handed out
    s.abort("a")                                    # cancelled before its prefill ended
    assert kv.pool.ref_count(0) == 1                # a transport may still read block 0
    s.save_done("a")
    assert kv.pool.num_free == 8 and s.connector.references() == NONE_HELD


# ------------------------------------------------------------------ the engine's sink
def test_the_engine_sink_writes_only_live_loads_and_checks_before_the_request_runs(model_dir):
    from engine.async_engine import AsyncEngine
    from kvtransfer.connector import EngineSink
    from kvtransfer.integrity import checksums
    from cluster.metrics import WorkerMetrics

    engine = make_engine(model_dir, role="decode", num_blocks=16)
    data = _two_blocks(engine, seed=3)

    async def body():
        aengine = AsyncEngine(engine)
        aengine.start()
        refused = []

        async def refuse(rid, why):
            refused.append(rid)
            aengine.fail(rid, why)

        sink = EngineSink(aengine, WorkerMetrics("decode", "d", 16, lambda: (0, 0, 0))
                          .transfers("grpc"), refuse)
        try:
            gone = Request("gone", list(range(1, 9)), GREEDY)
            q_gone = aengine.open_stream("gone")
            blocks = await aengine.reserve(gone)
            await aengine.abort("gone")
            before = engine.kv[:, :, blocks].clone()
            await sink.write("gone", blocks, data)          # aborted first: dropped
            await aengine.run(lambda: None)                 # (the write's command has run)
            assert q_gone.empty() and torch.equal(engine.kv[:, :, blocks], before)

            bad = Request("bad", list(range(1, 9)), GREEDY)
            q_bad = aengine.open_stream("bad")
            blocks = await aengine.reserve(bad)
            await sink.write("bad", blocks, data)
            sums = checksums(data).tolist()
            sums[1] ^= 1                                            # what the sender claims
            kind, why = await sink.complete("bad", 7, None, blocks, sums)
            assert kind == "checksum" and "checksum mismatch" in why
            await sink.reject("bad", why, "checksum")
            out = await asyncio.wait_for(q_bad.get(), 10)
            assert out.error and refused == ["bad"] and not out.new_token_ids  # never ran
            await wait_until_async(lambda: engine.pool.num_free == engine.pool.num_blocks, 5,
                                   "every block free")
            return engine.pool.num_free, engine.connector.references()
        finally:
            aengine.stop()

    free, refs = asyncio.run(body())
    assert free == 16 and refs == NONE_HELD


def test_a_senders_word_before_the_abort_keeps_nothing_aside():
    s, kv, _ = decode_side()
    s.reserve_remote(Request("r", list(range(1, 9)), GREEDY))
    s.sender_done("r")                    # its abort notice overtook the client's
    s.abort("r")
    assert kv.pool.num_free == kv.pool.num_blocks and s.connector.references() == NONE_HELD


def _two_blocks(engine, seed: int) -> torch.Tensor:
    """Random KV of two blocks in the engine's layout, as a sender would send it."""
    lay = engine.layout
    return torch.randn(lay.num_layers, 2, 2, lay.block_size, lay.num_kv_heads, lay.head_dim,
                       generator=torch.Generator().manual_seed(seed))


def test_writes_past_the_bound_wait_their_turn_and_the_request_runs_on_them(model_dir,
                                                                              monkeypatch):
    import kvtransfer.connector as connector
    from engine.async_engine import AsyncEngine
    from kvtransfer.integrity import checksums
    from cluster.metrics import WorkerMetrics

    monkeypatch.setattr(connector, "MAX_PENDING_BYTES", 1)     # every write waits for the last
    engine = make_engine(model_dir, role="decode", num_blocks=16)
    data = _two_blocks(engine, seed=5)

    async def body():
        aengine = AsyncEngine(engine)
        aengine.start()
        sink = connector.EngineSink(aengine, WorkerMetrics("decode", "d", 16, lambda: (0, 0, 0))
                                    .transfers("grpc"), None)
        try:
            q = aengine.open_stream("r")
            blocks = await aengine.reserve(Request("r", list(range(1, 9)), GREEDY))
            await asyncio.gather(sink.write("r", blocks[:1], data[:, :, :1].clone()),
                                 sink.write("r", blocks[1:], data[:, :, 1:].clone()))
            assert await sink.complete("r", 7, None, blocks, checksums(data).tolist()) is None
            tokens = []
            while not (out := await asyncio.wait_for(q.get(), 30)).finished:
                tokens += out.new_token_ids
            return blocks, tokens + out.new_token_ids, sink._pending_bytes
        finally:
            aengine.stop()

    blocks, tokens, pending = asyncio.run(body())
    assert tokens[0] == 7 and len(tokens) == GREEDY.max_tokens and pending == 0
    assert torch.equal(engine.kv[:, :, blocks], data)


def test_a_reservation_whose_kv_does_not_come_times_out_on_the_engine(model_dir):
    from engine.async_engine import AsyncEngine

    engine = make_engine(model_dir, role="decode", num_blocks=16)
    c = engine.connector

    async def body():
        timed_out = asyncio.Queue()
        aengine = AsyncEngine(engine)
        aengine.configure_loads(one_sided=True, load_timeout_s=0.2, lease_s=0.5,
                                on_timeout=timed_out.put_nowait)
        aengine.start()
        try:
            aengine.open_stream("r")
            await aengine.reserve(Request("r", list(range(1, 9)), GREEDY))
            rid = await asyncio.wait_for(timed_out.get(), 5)
            kept = c.references()["quarantined"]
            await aengine.abort(rid)                # --kv-load-failure fail
            await wait_until_async(lambda: engine.pool.num_free == engine.pool.num_blocks, 10,
                                   "the silent sender's lease to run out")
            return rid, kept, engine.pool.num_free, c.references()
        finally:
            aengine.stop()

    rid, kept, free, refs = asyncio.run(body())
    assert rid == "r" and kept == 2 and free == 16 and refs == NONE_HELD


def test_a_cpu_senders_read_of_held_blocks_does_not_wait_for_the_step_running(model_dir):
    """A finished prefill's blocks are the connector's until save_done and no step writes them,
    so on a CPU the sender reads them at once (AsyncEngine.read_blocks) instead of queueing
    behind the step the engine thread is in: a busy prefill worker's next step held every
    finished prompt's KV back by a whole step. Whatever the engine thread is doing, the read
    returns the pool's bytes; `run`, the device path, still waits for the engine thread, and so
    does a read of a tensor-parallel pool."""
    import threading

    from engine.async_engine import AsyncEngine
    from engine.parallel import ShardedKV

    engine = make_engine(model_dir, role="prefill", num_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def body():
        aengine = AsyncEngine(engine)
        aengine.start()
        busy, held = threading.Event(), threading.Event()
        order: list[str] = []
        engine_thread = []

        def step():                                     # the engine thread is busy (a step)
            engine_thread[:] = [threading.current_thread()]
            held.set()
            busy.wait(60)
            order.append("step")

        def record(what: str):
            """A command's body: notes it ran; -> the thread it ran on."""
            order.append(what)
            return threading.current_thread()

        async def hold() -> None:
            busy.clear()
            held.clear()
            order.clear()
            aengine.run_nowait(step)
            await wait_until_async(held.is_set, 30, "the engine thread to start its step")

        try:
            q = await aengine.add(Request("p", list(range(1, 11)), params))
            blocks = []
            while True:
                out = await asyncio.wait_for(q.get(), 60)
                blocks += out.kv_blocks or []
                if out.finished:
                    break
            assert blocks and engine.connector.references()["saving"] == len(blocks)
            await hold()
            read = await asyncio.wait_for(
                aengine.read_blocks(lambda: engine.kv[:, :, blocks].clone()), 10)
            assert order == []                          # read while the step still runs
            queued = aengine.run(record, "run")
            busy.set()
            # `run` waited: it ran on the engine thread (so after the step it was busy with)
            assert await asyncio.wait_for(queued, 10) is engine_thread[0]
            assert order == ["step", "run"] and torch.equal(read, engine.kv[:, :, blocks])
            aengine.save_done("p")
            await wait_until_async(lambda: engine.pool.num_free == engine.pool.num_blocks, 5,
                                   "every block free")
            # Tensor parallel: rank 0 sees its pool as a ShardedKV, whose reads are commands
            # every rank runs: they stay on the engine thread, behind what it is doing.
            plain = engine.runner.pool
            engine.runner.pool = ShardedKV(engine.runner, engine.model_cfg.num_kv_heads)
            await hold()
            read = asyncio.ensure_future(aengine.read_blocks(record, "read"))
            busy.set()
            assert await asyncio.wait_for(read, 10) is engine_thread[0]
            assert order == ["step", "read"]
            engine.runner.pool = plain
            return engine.connector.references()
        finally:
            busy.set()
            aengine.stop()

    assert asyncio.run(body()) == NONE_HELD
