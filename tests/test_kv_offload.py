"""The KV offload tiers (engine.kv_offload): stores at eviction, restores at admission, the
admission gate, LRU between host and disk, checksums on every restore, the disk tier across a
restart and against another model's files, disk errors; and the engine with a pool too small for
its prompts, token-exact with HF with a tier corrupted."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from engine.kv_offload import DiskTier, KVOffload, OffloadSettings
from engine.request import Request, SamplingParams
from tests.conftest import make_engine
from tests.test_batching import run
from tests.test_e2e import hf, hf_greedy  # noqa: F401 - the module fixture

SHAPE = (2, 2, 4, 1, 3)                  # one block: 2 layers, K/V, 4 slots, 1 head, dim 3
IDENTITY = {"model": "m", "dtype": "float32", "hash_seed": "0"}


def pool(num_blocks=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((SHAPE[0], SHAPE[1], num_blocks, *SHAPE[2:]), generator=g)


def tiers(kv, host=2, disk_dir="", disk=0, min_seen=1):
    return KVOffload(OffloadSettings(host, disk_dir, disk, min_seen, IDENTITY), lambda: kv,
                     SHAPE, torch.float32, torch.device("cpu"))


def toks(h):
    return (h, h, h, h)


def stored(off, kv, h, b):
    off.seen(h)
    off.store([(b, h, toks(h))])


def restore(off, kv, hashes, into):
    run_ = off.find_run(hashes, [toks(h) for h in hashes])
    return off.restore(run_, into[:len(run_)]), len(run_)


def test_host_tier_round_trip_lru_and_admission_gate():
    kv = pool()
    off = tiers(kv, host=2, min_seen=2)
    off.store([(0, 10, toks(10))])                        # seen never: the gate refuses
    assert off.host.stats.rejected_blocks == 1 and not off.host.index
    off.seen(10)
    off.store([(0, 10, toks(10))])                        # seen once: still refused
    assert off.host.stats.rejected_blocks == 2
    for h, b in ((10, 0), (11, 1), (12, 2)):              # 10 now seen twice; 11, 12 too
        off.seen(h)
        off.seen(h)
        off.store([(b, h, toks(h))])
    assert list(off.host.index) == [11, 12] and off.host.stats.evicted_blocks == 1
    want = kv[:, :, 1:3].clone()
    kv[:, :, 1:3] = 0                                    # the pool reused the blocks
    assert restore(off, kv, [11, 12], [5, 6]) == (2, 2)
    assert torch.equal(kv[:, :, 5:7], want)
    assert off.host.stats.restored_blocks == 2 and off.host.stats.hits == 2
    # a run stops at the first block no tier holds, and the tokens must match too
    assert off.find_run([11, 99, 12], [toks(11), toks(99), toks(12)])[-1][0] == 11
    assert off.find_run([11], [(0, 0, 0, 0)]) == []


def test_a_corrupted_host_block_ends_the_run_and_is_counted():
    kv = pool()
    off = tiers(kv, host=4)
    for h, b in ((1, 0), (2, 1), (3, 2)):
        stored(off, kv, h, b)
    e = off.host.index[2]
    off.host.data[e.slot].view(-1)[5] += 1.0             # a bit of memory gone wrong
    assert restore(off, kv, [1, 2, 3], [4, 5, 6]) == (1, 3)
    assert off.host.stats.checksum_failures == 1 and 2 not in off.host.index
    assert off.host.stats.restored_blocks == 1


def test_host_victims_go_to_disk_and_survive_a_restart(tmp_path):
    kv = pool()
    off = tiers(kv, host=1, disk_dir=str(tmp_path), disk=4)
    for h, b in ((1, 0), (2, 1), (3, 2)):
        stored(off, kv, h, b)
    assert list(off.host.index) == [3] and sorted(off.disk.index) == [1, 2]
    want = kv[:, :, 0:3].clone()
    # a new process: the same folder, an empty pool
    kv2 = torch.zeros_like(kv)
    again = tiers(kv2, host=1, disk_dir=str(tmp_path), disk=4)
    assert sorted(again.disk.index) == [1, 2] and again.host.stats.blocks == 0
    assert restore(again, kv2, [1, 2], [0, 1]) == (2, 2)
    assert torch.equal(kv2[:, :, 0:2], want[:, :, 0:2])
    assert again.disk.stats.restored_blocks == 2


def test_disk_files_of_another_model_half_written_or_damaged_are_not_loaded(tmp_path):
    kv = pool()
    off = tiers(kv, host=0, disk_dir=str(tmp_path), disk=4)
    for h, b in ((1, 0), (2, 1)):
        stored(off, kv, h, b)
    root = off.disk.root
    (root / "00000000000000ff.kvb.tmp").write_bytes(b"half")      # killed mid-store
    other = DiskTier(tmp_path, dict(IDENTITY, model="another"), SHAPE, torch.float32, 4)
    assert other.root != root and not other.index               # its own folder: nothing
    f = root / f"{1:016x}.kvb"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40                                            # a flipped bit in the KV
    f.write_bytes(bytes(data))
    again = tiers(torch.zeros_like(kv), host=0, disk_dir=str(tmp_path), disk=4)
    assert not (root / "00000000000000ff.kvb.tmp").exists()
    assert sorted(again.disk.index) == [1, 2]
    assert restore(again, again._pool(), [1, 2], [0, 1]) == (0, 2)   # block 1 fails: none used
    assert again.disk.stats.checksum_failures == 1 and 1 not in again.disk.index
    # the header names the identity: a foreign header in this folder is ignored
    foreign = DiskTier(tmp_path / "x", dict(IDENTITY, dtype="float16"), SHAPE, torch.float32, 4)
    foreign.put(7, toks(7), 0, kv[:, :, 0])
    os.replace(foreign.root / f"{7:016x}.kvb", root / f"{7:016x}.kvb")
    third = tiers(torch.zeros_like(kv), host=0, disk_dir=str(tmp_path), disk=4)
    assert 7 not in third.disk.index and third.disk.stats.ignored_files == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_disk_is_counted_not_raised(tmp_path):
    kv = pool()
    off = tiers(kv, host=0, disk_dir=str(tmp_path), disk=4)
    os.chmod(off.disk.root, 0o500)
    try:
        stored(off, kv, 1, 0)
    finally:
        os.chmod(off.disk.root, 0o700)
    assert off.disk.stats.errors == 1 and not off.disk.index


def test_a_disk_that_fails_writes_is_counted_not_raised(tmp_path, monkeypatch):
    # ENOSPC (or a read-only mount, as root is not stopped by permissions) on write
    kv = pool()
    off = tiers(kv, host=1, disk_dir=str(tmp_path), disk=4)
    import builtins
    real_open = builtins.open

    def full_disk(path, mode="r", *a, **kw):
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", full_disk)
    for h, b in ((1, 0), (2, 1), (3, 2)):
        stored(off, kv, h, b)
    monkeypatch.undo()
    assert off.disk.stats.errors == 2 and not off.disk.index and list(off.host.index) == [3]
    assert not list(off.disk.root.iterdir())                   # no temporary left


def test_the_cost_rule_skips_a_restore_slower_than_computing():
    kv = pool()
    off = tiers(kv, host=4)
    stored(off, kv, 1, 0)
    off._bandwidth["host"] = 1.0                  # 1 byte/s: far slower than computing
    off.note_prompt_rate(1000, 1.0)
    assert off.find_run([1], [toks(1)]) == [] and off.host.stats.skipped_blocks == 1
    off._bandwidth["host"] = 1e12
    assert len(off.find_run([1], [toks(1)])) == 1


# ---------------------------------------------------------------------- in the engine
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 24 blocks of 4 tokens: each 40-token prompt (+ 6) takes 12, so the third evicts the first
small = functools.partial(make_engine, num_blocks=24, block_size=4, max_num_batched_tokens=64)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 120, (40,), generator=g).tolist() for _ in range(3)]


def _turns(engine, prompts):
    """Prompt 0, then 1 and 2 (which push 0's blocks out of the pool), then 0 again."""
    first = run(engine, [Request("a", prompts[0], GREEDY)])["a"]
    run(engine, [Request("b", prompts[1], GREEDY)])
    run(engine, [Request("c", prompts[2], GREEDY)])
    again = run(engine, [Request("a2", prompts[0], GREEDY)])["a2"]
    return first, again


def test_engine_restores_an_evicted_prefix_from_the_host_tier(tiny_model_dir):
    engine = small(tiny_model_dir, kv_offload_gib=0.001)
    first, again = _turns(engine, _prompts())
    s = engine.offload.stats()["host"]
    assert again == first
    assert s["stored_blocks"] >= 10 and s["restored_blocks"] == 9   # 39 tokens: 9 full blocks
    assert engine.kv_manager.hit_tokens == 36
    free = engine.pool.num_free
    assert free == engine.pool.num_blocks                          # nothing leaked
    plain = small(tiny_model_dir)
    _turns(plain, _prompts())
    assert plain.kv_manager.hit_tokens == 0                        # without: computed again


def test_a_restore_never_takes_the_pool_blocks_the_same_prompt_hit(tiny_model_dir):
    # the prompt's first blocks are cached and free at the head of the free queue, its later
    # ones in the host tier: the restore's allocation must take other blocks
    engine = small(tiny_model_dir, kv_offload_gib=0.001, num_blocks=14)
    kvm, pool_ = engine.kv_manager, engine.pool
    prompt = _prompts()[0]
    run(engine, [Request("a", prompt, GREEDY)])            # 10 blocks cached, then free
    hashes = kvm.hasher.hashes(prompt)
    cached = pool_.cached_blocks()
    keep = {h for _, h, _ in cached[-3:]}                   # evict all but 3 (the last freed)
    pool_.free(pool_.allocate(pool_.num_free - 3))
    assert {h for _, h, _ in pool_.cached_blocks()} == keep
    req = Request("again", prompt, GREEDY)
    hits = kvm.cached_prefix(req, len(prompt) - 1).blocks[0]     # (the one KV group's)
    assert len(hits) == 9 and len(set(hits)) == 9
    for i, b in enumerate(hits):                             # each block holds its own hash
        assert pool_.lookup(hashes[i], prompt[i * 4:(i + 1) * 4]) == b


def test_a_restarted_engine_serves_a_returning_prompt_from_its_disk_tier(tiny_model_dir,
                                                                       tmp_path):
    prompts = _prompts()
    disk = dict(kv_offload_gib=0.001, kv_offload_dir=str(tmp_path), kv_offload_disk_gib=0.01)
    engine = small(tiny_model_dir, **disk)
    first = run(engine, [Request("a", prompts[0], GREEDY)])["a"]
    engine.close()                            # the pool's and host tier's blocks go to disk
    again = small(tiny_model_dir, **disk)
    assert len(again.offload.disk.index) >= 9
    second = run(again, [Request("a", prompts[0], GREEDY)])["a"]
    assert second == first and again.offload.stats()["disk"]["restored_blocks"] == 9
    assert again.kv_manager.hit_tokens == 36
    other = small(tiny_model_dir, **disk, hash_seed=1)       # another seed: nothing found
    assert not other.offload.disk.index


def test_engine_answer_stays_hf_exact_with_corrupted_tiers(model_dir, hf, tmp_path):
    engine = make_engine(model_dir, num_blocks=24, block_size=4, max_num_batched_tokens=64,
                         kv_offload_gib=0.005, kv_offload_dir=str(tmp_path),
                         kv_offload_disk_gib=0.05)
    prompts = _prompts()
    want = hf_greedy(hf, prompts[0], GREEDY.max_tokens)
    first = run(engine, [Request("a", prompts[0], GREEDY)])["a"]
    run(engine, [Request("b", prompts[1], GREEDY)])
    run(engine, [Request("c", prompts[2], GREEDY)])
    off = engine.offload
    # a host block and a disk file of prompt 0's prefix go bad
    hashes = engine.kv_manager.hasher.hashes(prompts[0])
    host_hit = next(h for h in hashes if h in off.host.index)
    off.host.data[off.host.index[host_hit].slot].view(-1)[0] += 1.0
    on_disk = [h for h in hashes if h in off.disk.index]
    if on_disk:
        f = off.disk.root / f"{on_disk[0]:016x}.kvb"
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    again = run(engine, [Request("a2", prompts[0], GREEDY)])["a2"]
    stats = off.stats()
    assert first == want and again == want
    assert stats["host"]["checksum_failures"] + stats["disk"]["checksum_failures"] >= 1
    assert engine.pool.num_free == engine.pool.num_blocks


def _evicted_first_prompt(engine, prompts):
    """Prompt 0, then 1 and 2 (its blocks leave the pool for the host tier); -> 0's tokens."""
    first = run(engine, [Request("a", prompts[0], GREEDY)])["a"]
    run(engine, [Request("b", prompts[1], GREEDY)])
    run(engine, [Request("c", prompts[2], GREEDY)])
    return first


def test_a_prompt_waiting_on_a_restore_does_not_stall_the_batch(model_dir, hf):
    # the asynchronous path (CUDA's copies on their own stream) on CPUs: restores report done
    # only after a few polls; meanwhile the requests behind the restoring one are scheduled
    engine = make_engine(model_dir, num_blocks=24, block_size=4, max_num_batched_tokens=64,
                         kv_offload_gib=0.005)
    prompts = _prompts()
    want = hf_greedy(hf, prompts[0], GREEDY.max_tokens)
    assert _evicted_first_prompt(engine, prompts) == want
    engine.offload.copies.min_polls = 3
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(Request("a2", prompts[0], GREEDY))
    engine.add_request(Request("d", [5, 6, 7, 8, 9], short))
    got = {"a2": [], "d": []}
    steps_while_restoring = 0
    while engine.has_work():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        if "a2" in engine.kv_manager._restoring and engine.last_step.num_seqs:
            steps_while_restoring += 1                  # a2 still waits: the step ran d
            assert [r.request_id for r in engine.scheduler.running] in (["d"], [])
    assert steps_while_restoring >= 1 and len(got["d"]) == 2      # d ran meanwhile
    assert got["a2"] == want
    assert engine.offload.stats()["host"]["restored_blocks"] == 9
    assert engine.kv_manager.hit_tokens == 36
    assert not engine.kv_manager._restoring and engine.pool.num_free == engine.pool.num_blocks


def test_only_a_restore_in_flight_waits_for_it_instead_of_spinning(tiny_model_dir):
    engine = small(tiny_model_dir, kv_offload_gib=0.001)
    prompts = _prompts()
    first = _evicted_first_prompt(engine, prompts)
    engine.offload.copies.min_polls = 1000
    engine.add_request(Request("a2", prompts[0], GREEDY))
    assert engine.step() == [] and "a2" in engine.kv_manager._restoring
    # nothing else to run: the step waited for the copies (done, not yet finished: a2 asks)
    assert not engine.kv_manager.restores_in_flight() and "a2" in engine.kv_manager._restoring
    got = []
    while engine.has_work():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == first and engine.pool.num_free == engine.pool.num_blocks


def test_aborting_a_request_mid_restore_leaks_nothing(tiny_model_dir):
    engine = small(tiny_model_dir, kv_offload_gib=0.001)
    prompts = _prompts()
    _evicted_first_prompt(engine, prompts)
    engine.offload.copies.min_polls = 1000
    engine.add_request(Request("a2", prompts[0], GREEDY))
    engine.step()
    job = engine.kv_manager._restoring["a2"]
    assert len(job.block_ids) == 9 and engine.pool.num_free < engine.pool.num_blocks
    assert engine.abort("a2")
    assert not engine.kv_manager._restoring and not engine.has_work()
    assert engine.pool.num_free == engine.pool.num_blocks
    # what arrived intact stays cached: the prompt comes back as a pool hit
    hits = engine.kv_manager.cached_prefix(Request("a3", prompts[0], GREEDY), 39)
    assert len(hits) == 9 and engine.offload.stats()["host"]["restored_blocks"] == 9


def test_a_decode_reservation_waits_for_its_restore(tiny_model_dir):
    engine = small(tiny_model_dir, kv_offload_gib=0.001)
    prompts = _prompts()
    _evicted_first_prompt(engine, prompts)
    engine.offload.copies.min_polls = 1000
    req = Request("r", prompts[0], GREEDY)
    assert engine.reserve_remote(req) is None            # restore begun
    assert engine.has_work() and engine.reserve_remote(req) is None
    engine.kv_manager.wait_restore()
    blocks = engine.reserve_remote(req)
    assert len(blocks) == 10 and req.num_cached_blocks == 10         # the whole prompt
    assert engine.offload.stats()["host"]["restored_blocks"] == 10
    assert engine.abort("r") and engine.pool.num_free == engine.pool.num_blocks


def test_the_engine_loop_serves_a_reservation_whose_prefix_is_restored(tiny_model_dir):
    import asyncio

    from engine.async_engine import AsyncEngine

    engine = small(tiny_model_dir, kv_offload_gib=0.001, role="decode")
    prompts = _prompts()
    _evicted_first_prompt(engine, prompts)
    off, kv = engine.offload, engine.kv_manager
    off.copies.min_polls = 50

    async def body():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            req = Request("r", prompts[0], GREEDY)
            aengine.open_stream("r")
            blocks = await asyncio.wait_for(aengine.reserve(req), 10)
            await aengine.abort("r")
            await aengine.run(lambda: None)
            return len(blocks), req.num_cached_blocks
        finally:
            aengine.stop()

    assert asyncio.run(body()) == (10, 10)
    assert off.stats()["host"]["restored_blocks"] == 10
    assert not kv._restoring and engine.pool.num_free == engine.pool.num_blocks


def test_offload_settings_are_checked(tiny_model_dir):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="both kv_offload_dir"):
        EngineConfig(kv_offload_disk_gib=1)
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(kv_offload_gib=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(kv_offload_gib=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="hold no block"):
        small(tiny_model_dir, kv_offload_gib=1e-9)


def test_one_allocation_stores_its_evictions_together_and_keeps_the_newest():
    kv = pool()
    off = tiers(kv, host=2)
    for h in (1, 2, 3):
        off.seen(h)
    off.store([(0, 1, toks(1)), (1, 2, toks(2)), (2, 3, toks(3))])
    assert list(off.host.index) == [2, 3] and off.host.stats.stored_blocks == 2
    off.store([(1, 2, toks(2))])                         # already kept: not again
    assert off.host.stats.stored_blocks == 2


def test_tier_counters_reach_the_worker_metrics():
    from prometheus_client import generate_latest

    from cluster.metrics import WorkerMetrics

    kv = pool()
    off = tiers(kv, host=2)
    stored(off, kv, 1, 0)
    restore(off, kv, [1], [3])
    m = WorkerMetrics("decode", "d1", 8, lambda: (0, 0, 8), offload=off.stats)
    text = generate_latest(m.registry).decode()
    labels = 'role="decode",tier="host",worker="d1"'
    assert f"pdserve_kv_offload_restored_blocks_total{{{labels}}} 1.0" in text
    assert f"pdserve_kv_offload_stored_bytes_total{{{labels}}} {float(off.block_nbytes)}" in text
    assert f"pdserve_kv_offload_capacity_blocks{{{labels}}} 2.0" in text


_STORE_FOREVER = """
import sys, torch
from engine.kv_offload import KVOffload, OffloadSettings
shape = (2, 2, 4, 1, 3)
kv = torch.randn(shape[0], shape[1], 8, *shape[2:], generator=torch.Generator().manual_seed(0))
off = KVOffload(OffloadSettings(0, sys.argv[1], 64, 1, {"model": "m"}), lambda: kv, shape,
                torch.float32, torch.device("cpu"))
h = 0
while True:
    h += 1
    off.seen(h)
    off.store([(h % 8, h, (h,) * 4)])
"""


def test_a_worker_killed_mid_store_leaves_a_consistent_disk_tier(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.waiting import wait_until

    root = Path(__file__).resolve().parent.parent
    tier, log = tmp_path / "tier", tmp_path / "store.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _STORE_FOREVER, str(tier)], cwd=root,
                                stdout=out, stderr=subprocess.STDOUT)

    def newest() -> int:
        """The highest block hash with a file (the process stores hashes 1, 2, 3...)."""
        return max((int(f.stem, 16) for f in tier.rglob("*.kvb")), default=0)
    try:
        # the tier holds 64 blocks: a 65th means it is replacing its oldest files now
        wait_until(lambda: newest() > 64, 60, lambda: f"block 65 stored (newest {newest()})",
                   [(proc, log)], interval_s=0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    kv = torch.zeros(2, 2, 64, 4, 1, 3)
    again = KVOffload(OffloadSettings(0, str(tier), 64, 1, {"model": "m"}), lambda: kv,
                      SHAPE, torch.float32, torch.device("cpu"))
    found = list(again.disk.index)
    assert len(found) >= 32 and not list(tier.rglob("*.tmp"))
    assert again.disk.stats.ignored_files == 0
    run_ = [(h, again.disk, again.disk.index[h]) for h in found]
    assert again.restore(run_, list(range(len(found)))) == len(found)   # every one intact


def test_pinned_empty_is_plain_memory_without_cuda_and_counts_nothing():
    """engine.pinned registers exactly the bytes asked for on CUDA hosts (the GPU check's
    `kv offload` row); without CUDA it is ordinary memory and nothing is locked."""
    import torch

    from engine.pinned import pinned_bytes, pinned_empty

    before = pinned_bytes()
    t = pinned_empty((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and t.device.type == "cpu"
    assert pinned_bytes() == before and (torch.cuda.is_available() or not t.is_pinned())


def test_grpc_staging_buffers_register_exactly_their_bytes(monkeypatch):
    """The grpc transport's staging buffers (kvtransfer.staging) are page-locked by
    registration, exactly their size (torch's pinned allocator would round 3 MiB + 1 up to
    4 MiB and keep it), and unregistered when they go. The CUDA runtime is stood in for here;
    the GPU check's `kv offload` row measures the real one."""
    import gc

    import torch

    from engine import pinned
    from kvtransfer.staging import HostStaging

    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    staging = HostStaging("cuda")
    before = pinned.pinned_bytes()
    nbytes = 3 * 2**20 + 1
    buf = staging._take(nbytes)
    assert pinned.pinned_bytes() - before == nbytes and staging.capacity == nbytes
    assert calls == [("register", buf.data.data_ptr(), nbytes, 1)]     # portable
    staging._free.clear()
    del buf
    gc.collect()
    assert pinned.pinned_bytes() == before and calls[-1][0] == "unregister"
