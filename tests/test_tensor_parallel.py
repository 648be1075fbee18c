"""Tensor parallelism on CPU: two (or four) real processes over gloo against one, on tiny random
Llama, Qwen2 and Qwen3 checkpoints written as HF folders (fp32): the same logits and greedy
tokens, KV heads replicated when there are fewer than ranks, the sharded pool read and written
with every head in order, and the refusals of what cannot be split."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_layout import KVLayout
from engine.layers.linear import linear_method_for
from engine.parallel import check_split, head_range
from engine.request import Request, SamplingParams
from kvtransfer.base import LayoutMismatch, check_layout
from pdserve.gpucheck import engine_generate, engine_logits
from tests.conftest import make_engine
from tests.cpu_paths import linear_params
from tests.test_model_parity import make_model
from tests.waiting import wait_until, wait_until_async

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3]]


def _greedy(eng: Engine) -> list[list[int]]:
    got = engine_generate(eng, PROMPTS, 12)
    assert eng.pool.num_free == eng.pool.num_blocks
    return got


def _run(path, tp: int, ids: list[int], **kw):
    """(logits of every position of `ids`, greedy tokens of PROMPTS, the prompt's KV blocks
    with every head) from an engine of `tp` ranks."""
    eng = make_engine(path, tensor_parallel_size=tp, **kw)
    try:
        assert eng.layout.tensor_parallel_size == tp
        logits = engine_logits(eng, ids)
        blocks = list(range(-(-len(ids) // 4)))      # the first request took blocks 0..
        kv = eng.kv.index_select(2, torch.tensor(blocks)).clone()
        return logits, kv, _greedy(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("family,tp", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 4)])
def test_tp_matches_one_rank(tmp_path, family, tp):
    """tp=4 over 2 KV heads: each KV head on two ranks."""
    make_model(tmp_path, family)
    ids = torch.randint(0, 128, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_logits, ref_kv, ref_tokens = _run(tmp_path, 1, ids)
    logits, kv, tokens = _run(tmp_path, tp, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert kv.shape == ref_kv.shape                  # every KV head, in order
    torch.testing.assert_close(kv, ref_kv, rtol=1e-5, atol=1e-5)
    assert tokens == ref_tokens


@pytest.mark.parametrize("linear", linear_params())
def test_tp_matches_one_rank_on_every_linear_path(tmp_path, linear):
    """--linear-method under tensor parallelism: each rank packs its own shards (the path
    auto picks here is test_tp_matches_one_rank's)."""
    auto = linear_method_for(torch.device("cpu"), torch.float32).name
    if {"dense": "torch"}.get(auto, auto) == linear:
        pytest.skip(f"{linear} is this host's auto choice: test_tp_matches_one_rank runs it")
    make_model(tmp_path, "llama")
    ids = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    ref_logits, _, ref_tokens = _run(tmp_path, 1, ids, linear_method=linear)
    logits, _, tokens = _run(tmp_path, 2, ids, linear_method=linear)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert tokens == ref_tokens


def test_sharded_pool_writes_each_rank_its_heads(tiny_model_dir):
    """Blocks written with every head land on their ranks and read back whole; the checksum of
    the sharded pool is the checksum of the same blocks in one piece."""
    from kvtransfer.integrity import block_checksums

    eng = make_engine(tiny_model_dir, tensor_parallel_size=2)
    try:
        data = torch.randn(2, 2, 3, 4, 2, 16, generator=torch.Generator().manual_seed(3))
        ids = torch.tensor([7, 2, 30])
        eng.kv.index_copy_(2, ids, data)
        assert torch.equal(eng.kv.index_select(2, ids), data)
        assert torch.equal(eng.runner.kv[:, :, ids], data[:, :, :, :, 0:1])   # rank 0: head 0
        whole = torch.zeros(2, 2, 32, 4, 2, 16)
        whole[:, :, ids] = data
        assert block_checksums(eng.kv, ids.tolist()).tolist() == \
            block_checksums(whole, ids.tolist()).tolist()
    finally:
        eng.close()


def test_int8_under_tp_close_to_fp32(tmp_path):
    make_model(tmp_path, "qwen2")
    ids = list(range(3, 40))
    ref, _, _ = _run(tmp_path, 1, ids)
    got, _, _ = _run(tmp_path, 2, ids, quantization="int8")
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.03, err


def test_head_ranges_and_refusals():
    assert [head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    smol = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 2048, True)
    check_split(smol, 3)
    with pytest.raises(ValueError, match=r"9 attention heads.*3 KV heads.*this model: 1, 3\)"):
        check_split(smol, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_layout_handshake_maps_unequal_tp_and_refuses_other_heads():
    check_layout(KVLayout("float32", 16, 30, 3, 64, 1), KVLayout("float32", 16, 30, 3, 64, 3))
    with pytest.raises(LayoutMismatch, match=r"num_kv_heads: ours 3 vs theirs 6\)"):
        check_layout(KVLayout("float32", 16, 30, 3, 64, 3), KVLayout("float32", 16, 30, 6, 64, 3))


def test_a_dead_rank_stops_the_engine_at_once(tiny_model_dir):
    """No hang, no running on: the next step fails as a RankFailure, which ends the engine
    thread (its worker goes NOT_SERVING), and the request gets the error."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.parallel import RankFailure

    eng = make_engine(tiny_model_dir, tensor_parallel_size=2)

    async def run():
        deaths = []
        aengine = AsyncEngine(eng, on_death=deaths.append)
        aengine.start()
        rank1 = eng.ranks.procs[0]
        rank1.kill()
        rank1.wait()
        t0 = time.monotonic()
        q = await aengine.add(Request("r", [1, 2, 3], SamplingParams(max_tokens=4)))
        out = await asyncio.wait_for(q.get(), 10)
        assert out.finish_reason == "error" and "tensor-parallel rank failure" in out.error
        await wait_until_async(lambda: deaths and aengine.dead, 10, "the engine thread's end")
        assert time.monotonic() - t0 < 10
        with pytest.raises(RankFailure):          # and nothing runs on it any more
            eng.runner.read_blocks([0])
        aengine.stop()
    try:
        asyncio.run(run())
    finally:
        eng.close()


def test_ranks_exit_when_rank_0_is_killed(tiny_model_dir):
    script = ("import sys, time\n"
              "from engine.config import EngineConfig\n"
              "from engine.engine import Engine\n"
              f"eng = Engine({str(tiny_model_dir)!r}, EngineConfig(num_blocks=8, block_size=4, "
              "tensor_parallel_size=2))\n"
              "print(eng.ranks.procs[0].pid, flush=True)\n"
              "time.sleep(120)\n")                 # until the test kills it
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    try:
        pid = int(rank0.stdout.readline())
        rank0.kill()
        rank0.wait()
        wait_until(lambda: not _alive(pid), 10, "rank 1 to exit after rank 0",
                   interval_s=0.1)
    finally:
        rank0.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _collectives(rank: int, port: int, out) -> None:
    """One rank: all-reduces and all-gathers through the group's shared memory, pieces of a
    tensor larger than a slot included; what it got goes to `out`."""
    from engine.parallel import ShmComm, init_group

    torch.set_num_threads(1)
    tp = init_group(rank, 2, port, "cpu")
    assert tp.shm is not None
    big = torch.full((3 * ShmComm.SLOT // 4 + 5,), float(rank + 1))      # 3+ pieces
    small = torch.arange(6, dtype=torch.bfloat16).view(2, 3) * (rank + 1)
    tp.all_reduce(big)
    tp.all_reduce(small)
    gathered = tp.all_gather(torch.tensor([[rank, 10 + rank]]), dim=-1)
    out.put((rank, bool((big == 3.0).all()), small.tolist(), gathered.tolist()))
    torch.distributed.destroy_process_group()


def test_shared_memory_collectives():
    import multiprocessing as mp

    from engine.parallel import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collectives, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    for rank, big_ok, small, gathered in got:
        assert big_ok
        assert small == [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0]]
        assert gathered == [[0, 10, 1, 11]]


def test_a_rank_that_exits_mid_collective_ends_the_wait():
    from engine.parallel import ShmComm

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    shm = ShmComm(f"pdserve-test-{gone.pid}", 0, 2, peers=[gone])
    shm.unlink()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank exited"):
        shm.all_reduce(torch.ones(8))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("family", ["phi3", "gemma3_text"])
def test_tp_matches_one_rank_for_layers_that_differ(tmp_path, family):
    """Phi-3's fused qkv and gate_up tensors split per rank at load; Gemma 3's sliding layers,
    per-head q/k norms and local rotary: two ranks give one rank's logits and tokens."""
    from tests.test_attention_families import make_model as make_by_layer

    make_by_layer(tmp_path, family)
    ids = torch.randint(0, 128, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_logits, ref_kv, ref_tokens = _run(tmp_path, 1, ids)
    logits, kv, tokens = _run(tmp_path, 2, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, ref_kv, rtol=1e-5, atol=1e-5)
    assert tokens == ref_tokens


def test_lora_adapters_over_two_ranks_give_one_ranks_tokens(tmp_path):
    """Each rank holds its share of every slot (merged projections' B rows, row-parallel
    ones' A columns, their h summed before the expand); rank 0 hands the adapters it writes
    into slots to the other rank. Base + two adapters (one fused-free, one on every MLP
    projection), batched, with --max-loras 1 too (slots rewritten while serving)."""
    from engine.request import Request, SamplingParams
    from tests.test_lora import PROMPTS, make_base, write_adapter

    make_base(tmp_path)
    write_adapter(tmp_path / "a1", ["q_proj", "k_proj", "v_proj", "o_proj"], 4, 8, seed=1)
    write_adapter(tmp_path / "a2", ["gate_proj", "up_proj", "down_proj"], 8, 16, seed=2)

    def run(tp, max_loras):
        eng = make_engine(tmp_path, tensor_parallel_size=tp, enable_lora=True,
                          max_loras=max_loras, max_lora_rank=8, num_blocks=64, block_size=4)
        try:
            eng.add_lora("a1", str(tmp_path / "a1"))
            eng.add_lora("a2", str(tmp_path / "a2"))
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            got = {}
            for i, (prompt, lora) in enumerate(zip(PROMPTS * 2, ["a1", "", "a2", "a2", "a1",
                                                                   ""])):
                req = Request(str(i), prompt, params)
                req.lora_name = lora
                eng.add_request(req)
                got[str(i)] = []
            while eng.has_work():
                for o in eng.step():
                    got[o.request_id].extend(o.new_token_ids)
            return got
        finally:
            eng.close()

    want = run(1, 2)
    assert run(2, 2) == want
    assert run(2, 1) == want
