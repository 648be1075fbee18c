"""Each KV transport moves real blocks between two pools (one process, one event loop; the
receivers' own threads and NIXL agents are real): data lands in the reserved blocks, the first
token arrives last, layouts are checked, late data of an aborted request is kept out."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from kvtransfer import KVTransferError, LayoutMismatch, TransferTarget, create_sender
from kvtransfer.loopback import MemorySink, receiving
from tests.conftest import free_port
from tests.waiting import wait_until_async

LAYOUT = KVLayout("float32", 4, 2, 2, 8)
TRANSPORTS = ["grpc", "torch", "nixl"]


def pool(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                       LAYOUT.head_dim, generator=g)


def Sink(num_blocks: int) -> MemorySink:
    return MemorySink(LAYOUT, num_blocks)


@contextlib.asynccontextmanager
async def endpoints(name: str, sink: MemorySink, src: torch.Tensor):
    async with receiving(name, sink, f"127.0.0.1:{free_port()}") as receiver:
        sender = create_sender(name, LAYOUT, kv=src)
        try:
            yield sender, receiver
        finally:
            await sender.close()


def target(receiver, blocks, cached=0, layout=LAYOUT) -> TransferTarget:
    return TransferTarget(receiver.name, receiver.address(), "d1", layout, tuple(blocks), cached,
                          receiver.metadata())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_blocks_land_in_the_reserved_blocks_in_chunks(name):
    src = pool(16, seed=1)

    async def body():
        sink = Sink(24)
        async with endpoints(name, sink, src) as (sender, receiver):
            dst = [20, 3, 4, 5, 11]                     # the first one is cached on the receiver
            sink.reservations["r1"] = dst[1:]
            stream = sender.open("r1", src, target(receiver, dst, cached=1))
            await stream.send([7, 8], [3, 4])           # chunk 1 (src blocks 6 is the cached one)
            await stream.send([9], [5])                 # chunk 2
            await stream.finish(42, TokenLogprob(42, -0.5, [(42, -0.5), (7, -1.5)]), [2], [11])
            await asyncio.wait_for(sink.done.wait(), 10)
            # the whole transfer at once through the convenience API
            sink.done.clear()
            sink.reservations["r2"] = [0, 1]
            await sender.send("r2", src, [12, 13], target(receiver, [0, 1]), 9, None)
            await asyncio.wait_for(sink.done.wait(), 10)
        return sink

    sink = asyncio.run(body())
    for s, d in [(7, 3), (8, 4), (9, 5), (2, 11), (12, 0), (13, 1)]:
        assert torch.equal(sink.kv[:, :, d], src[:, :, s]), (s, d)
    assert sink.kv[:, :, 20].abs().sum() == 0           # the cached block is never written
    first, lp = sink.completed["r1"]
    assert first == 42 and lp.logprob == pytest.approx(-0.5) and lp.top[1] == (7, -1.5)
    assert sink.completed["r2"] == (9, None)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_layout_mismatch_is_refused_before_any_byte_moves(name):
    src = pool(8, 2)

    async def body():
        async with endpoints(name, Sink(8), src) as (sender, receiver):
            other = KVLayout("float32", 8, 2, 2, 8)
            with pytest.raises(LayoutMismatch, match="block_size: ours 4 vs theirs 8"):
                sender.open("r", src, target(receiver, [0], layout=other))

    asyncio.run(body())


@pytest.mark.parametrize("name", ["grpc", "torch"])
def test_data_for_a_request_no_longer_reserved_is_dropped(name):
    src = pool(8, seed=3)

    async def body():
        sink = Sink(8)
        async with endpoints(name, sink, src) as (sender, receiver):
            sink.reservations["gone"] = [1]
            stream = sender.open("gone", src, target(receiver, [1]))
            del sink.reservations["gone"]               # aborted on the decode side
            if name == "grpc":
                with pytest.raises(KVTransferError, match="NOT_FOUND"):
                    await stream.finish(5, None, [2], [1])
            else:
                await stream.finish(5, None, [2], [1])  # torch drops it without an answer
            # the next request on the same path: once it has landed, the receiver has handled
            # every message of the one before
            sink.reservations["next"] = [3]
            await sender.send("next", src, [4], target(receiver, [3]), 6, None)
            await asyncio.wait_for(sink.done.wait(), 10)
        return sink

    sink = asyncio.run(body())
    assert sink.completed == {"next": (6, None)} and torch.equal(sink.kv[:, :, 3], src[:, :, 4])
    sink.kv[:, :, 3] = 0
    assert sink.kv.abs().sum() == 0


def test_refusals_in_the_middle_of_a_push_reach_the_sender_with_their_own_status():
    """200 pushes refused while the sender still has messages queued behind the refused one:
    every sender sees the receiver's code and message (NOT_FOUND for a request no longer
    reserved, INVALID_ARGUMENT for a block it did not reserve), never INTERNAL, which a status
    racing the sender's writes used to become (grpc/grpc#36066); each refused request is
    rejected once and the receiver goes on taking pushes."""
    src = pool(8, seed=5)

    async def body():
        sink = Sink(8)
        got = []
        async with receiving("grpc", sink, f"127.0.0.1:{free_port()}") as receiver:
            sender = create_sender("grpc", LAYOUT, kv=src, blocks_per_message=1)
            try:
                for i in range(200):
                    rid = f"r{i}"
                    sink.reservations[rid] = [1, 2]
                    if i % 2 == 0:
                        del sink.reservations[rid]       # aborted on the decode side
                    stream = sender.open(rid, src, target(receiver, [1, 2]))
                    with pytest.raises(KVTransferError) as info:
                        await stream.send([3, 4, 5, 6, 7], [1, 6, 2, 0, 3])
                        await stream.finish(5, None)
                    got.append((i, str(info.value), info.value.refused))
                sink.reservations["next"] = [3]
                await sender.send("next", src, [4], target(receiver, [3]), 6, None)
            finally:
                await sender.close()
        return sink, got

    sink, got = asyncio.run(body())
    for i, message, refused in got:
        assert refused, (i, message)
        if i % 2 == 0:
            assert "refused: NOT_FOUND: request r" in message and "no KV reservation" in message
        else:
            assert "refused: INVALID_ARGUMENT:" in message and "[6] are not reserved" in message
    assert sorted(sink.rejected) == sorted(f"r{i}" for i in range(1, 200, 2))
    assert sink.completed == {"next": (6, None)}


def test_nixl_keeps_aborted_blocks_aside_until_the_sender_is_done():
    src = pool(8, seed=4)

    async def body():
        sink = Sink(8)
        async with endpoints("nixl", sink, src) as (sender, receiver):
            sink.reservations["r"] = [1, 2]
            stream = sender.open("r", src, target(receiver, [1, 2]))
            await stream.send([3], [1])
            del sink.reservations["r"]                  # the client went away
            assert not sink.senders_done
            await stream.abort()                        # the sender's notice tells the sink
            await wait_until_async(lambda: sink.senders_done, 10, "the sender's notice")
        return sink.senders_done

    assert asyncio.run(body()) == ["r"]


def test_kvbench_measures_every_transport_between_two_processes(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "kvbench", "--mib", "2", "--repeat",
                    "2", "--out", str(out)], check=True, timeout=300, capture_output=True)
    results = json.loads(out.read_text())["results"]
    # cma needs ptrace rights over the child (Yama scope 0 or 1: it is our child)
    transports = {"grpc", "torch", "nixl"}
    assert set(results) - {"cma"} == {"memcpy", "checksum", "tcp socket", *transports,
                                      *(f"{t} no checksum" for t in transports)}
    assert all("checksum_cost" in results[t] for t in transports)
    assert all(results[t]["pool_s"] >= 0 for t in transports)    # the pool's thread's share
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 2 for r in results.values())
