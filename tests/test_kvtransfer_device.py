"""KV transfer on devices, each branch on a CPU: the host staging of the grpc transport (device ->
host bytes -> device, buffers reused, the CPU path that skips pinning), used by the grpc sender and
the decode service's sink; the torch transport's message tensors all on the pool's device (torch's
`meta` device stands in for a GPU); nixl posting a WRITE only once the step's `ready` event has
completed (an event whose query() turns true after a few polls stands in for a CUDA event; the NIXL
agents are real), and not waiting without one; grpc and torch leaving `ready` alone."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest
import torch

from engine.request import TokenLogprob
from kvtransfer import KVTransferError, TransferTarget, block_bytes
from kvtransfer.base import poll_until
from kvtransfer.integrity import block_checksums
from kvtransfer.loopback import MemorySink, receiving
from kvtransfer.staging import HostStaging
from kvtransfer.torch_transport import MessageTensors, TorchKVReceiver, TorchKVSender
from kvtransfer.wire import tensor_from_bytes
from tests.conftest import free_port
from tests.test_kvtransfer import LAYOUT, endpoints, pool, target

META = torch.device("meta")


def shape(n: int) -> tuple[int, ...]:
    return (LAYOUT.num_layers, 2, n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


class StepEvent:
    """Stands in for the CUDA event recorded after a prefill step: complete once query() has been
    asked `polls` times, when the step's kernels are done writing (`on_complete`). A blocking
    wait on it is a test failure."""

    def __init__(self, polls: int, on_complete=lambda: None) -> None:
        self.polls = polls
        self.on_complete = on_complete
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.queries == self.polls:
            self.on_complete()
        return self.queries >= self.polls

    def synchronize(self) -> None:
        raise AssertionError("blocked on the step's event")


class Untouchable:
    """A `ready` for transports that are ordered behind the step and must leave it alone."""

    def query(self) -> bool:
        raise AssertionError("a stream-ordered transport polled the step's event")

    def synchronize(self) -> None:
        raise AssertionError("a stream-ordered transport waited for the step's event")


# ----------------------------------------------------------------------------- host staging
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staging_round_trip_device_to_host_bytes_to_device(dtype):
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    src = pool(8, seed=5).to(getattr(torch, dtype))
    dst = torch.zeros_like(src)
    sender, receiver = HostStaging(src.device), HostStaging(dst.device)
    assert not sender.pinned and not receiver.pinned     # CPU pools: pageable buffers, no events
    data = sender.blocks_to_bytes(src, [5, 2, 7])
    assert len(data) == 3 * block_bytes(layout)
    receiver.write_blocks(dst, [1, 0, 6], tensor_from_bytes(data, layout, 3))
    for s, d in [(5, 1), (2, 0), (7, 6)]:
        assert torch.equal(dst[:, :, d], src[:, :, s]), (s, d)
    assert dst[:, :, [2, 3, 4, 5, 7]].abs().sum() == 0
    assert sender.capacity == receiver.capacity == len(data)


def test_staging_reuses_its_buffer_across_messages_of_different_sizes():
    src = pool(16, seed=6)
    dst = torch.zeros_like(src)
    staging = HostStaging("cpu")                 # one staging both ways: the buffers are shared
    bb = block_bytes(LAYOUT)
    for blocks, held in [([1, 2, 3], 3), ([9], 3), ([4, 5], 3), ([10, 11, 12, 13, 14], 5),
                         ([0], 5)]:
        data = staging.blocks_to_bytes(src, blocks)
        assert staging.capacity == held * bb, blocks      # reused while it fits, else replaced
        staging.write_blocks(dst, blocks, tensor_from_bytes(data, LAYOUT, len(blocks)))
        assert staging.capacity == held * bb, blocks
        assert torch.equal(dst[:, :, blocks], src[:, :, blocks]), blocks


def test_staging_gives_each_thread_a_buffer_of_its_own():
    src = pool(32, seed=7)
    dst = torch.zeros_like(src)
    staging = HostStaging("cpu")
    errors = []

    def worker(seed: int):
        rng = random.Random(seed)
        for _ in range(40):
            blocks = rng.sample(range(32), rng.randint(1, 6))
            got = tensor_from_bytes(staging.blocks_to_bytes(src, blocks), LAYOUT, len(blocks))
            if not torch.equal(got, src[:, :, blocks]):
                errors.append(blocks)
            staging.write_blocks(dst, blocks, got)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and torch.equal(dst, src)
    assert staging.capacity <= 6 * 6 * block_bytes(LAYOUT)   # a buffer per thread at most


def test_data_already_on_the_device_goes_into_the_pool_without_staging():
    staging = HostStaging(META)                  # stands in for a CUDA pool (an NCCL receive)
    kv = torch.empty(shape(8), device=META)
    staging.write_blocks(kv, [3, 4], torch.empty(shape(2), device=META))
    assert staging.capacity == 0


# ------------------------------------------------------------- grpc sender, decode service sink
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.test_model_parity import make_model

    d = tmp_path_factory.mktemp("tiny")
    make_model(d, "llama")
    return d


def test_grpc_sender_and_decode_sink_move_blocks_through_staging(model_dir):
    """grpc sender -> PushKV -> the decode engine's sink (kvtransfer.connector) -> a real engine
    that decodes."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from kvtransfer.connector import EngineSink
    from engine.engine import Engine
    from engine.request import Request, SamplingParams
    from kvtransfer import create_sender
    from pdserve.metrics import WorkerMetrics

    engine = Engine(model_dir, EngineConfig(role="decode", num_blocks=16, block_size=4,
                                            max_num_batched_tokens=16))
    lay = engine.layout
    g = torch.Generator().manual_seed(8)
    src = torch.randn(lay.num_layers, 2, 8, lay.block_size, lay.num_kv_heads, lay.head_dim,
                      generator=g)

    async def body():
        aengine = AsyncEngine(engine)
        aengine.start()
        metrics = WorkerMetrics("decode", "d1", engine.pool.num_blocks, lambda: (0, 0, 0))
        refused = []

        async def refuse(rid, why):
            refused.append((rid, why))

        sink = EngineSink(aengine, metrics.transfers("grpc"), refuse)
        req = Request("r", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=3,
                                                             ignore_eos=True))
        queue = aengine.open_stream("r")
        try:
            blocks = await aengine.reserve(req)             # 8 prompt tokens: 2 blocks
            async with receiving("grpc", sink, f"127.0.0.1:{free_port()}") as receiver:
                sender = create_sender("grpc", lay, kv=src, blocks_per_message=1)
                t = TransferTarget("grpc", receiver.address(), "d1", lay, tuple(blocks), 0)
                await sender.send("r", src, [6, 3], t, 42, None)
                tokens = []
                while not (out := await asyncio.wait_for(queue.get(), 60)).finished:
                    tokens += out.new_token_ids
                await sender.close()
        finally:
            aengine.close_stream("r")
            aengine.stop()
        return blocks, tokens + out.new_token_ids, sender, sink, refused

    blocks, tokens, sender, sink, refused = asyncio.run(body())
    assert not refused                                  # the checksums matched
    assert len(blocks) == 2 and tokens[0] == 42 and len(tokens) == 3   # decoded on our KV
    for s, d in zip([6, 3], blocks):
        assert torch.equal(engine.kv[:, :, d], src[:, :, s]), (s, d)
    one = block_bytes(lay)                              # one block a message, one buffer reused
    assert sender.staging(src.device).capacity == one and sink.staging.capacity == one


# ------------------------------------------------------------------------- torch transport
def test_torch_transport_keeps_every_message_tensor_on_the_pool_device():
    kv = torch.empty(shape(8), device=META)
    tensors = MessageTensors(LAYOUT, META)
    header, meta, data, sums = tensors.outgoing(b"a KVChunk", kv, [1, 5])
    assert header.dtype == torch.int64 and header.shape == (3,) and meta.shape == (9,)
    assert data.shape == shape(2) and sums.shape == (2,) and sums.dtype == torch.int64
    received = [tensors.header(), tensors.meta(9), tensors.data(3), tensors.sums(3),
                tensors.goodbye()]
    assert {t.device for t in [header, meta, data, sums, *received]} == {META}
    assert received[2].shape == shape(3) and received[2].dtype == torch.float32
    assert len(tensors.outgoing(b"last", kv, [])) == 2            # no blocks: no data tensor
    assert len(tensors.outgoing(b"off", kv, [1], checksum=False)) == 3    # no checksums

    # the sender's channels and the receiver build their tensors for the pool's device
    async def devices():
        sender = TorchKVSender(LAYOUT, kv)
        receiver = TorchKVReceiver(MemorySink(LAYOUT, 4, device=META),
                                   f"127.0.0.1:{free_port()}")
        try:
            stream = sender.open("r", kv, target(receiver, [0]))
            with pytest.raises(KVTransferError, match="channels are on meta, the pool on cpu"):
                sender.open("r", pool(8, 1), target(receiver, [0]))
            return stream.channel.tensors.device, receiver.tensors.device
        finally:
            await sender.close()
            await receiver.close()

    assert asyncio.run(devices()) == (META, META)


def test_torch_message_header_and_meta_read_back_on_the_host():
    src = pool(4, seed=9)
    tensors = MessageTensors(LAYOUT, src.device)
    header, meta, data, sums = tensors.outgoing(b"\x00meta\xff", src, [3])
    assert tensors.read_header(header) == (6, 1, True)
    assert tensors.read_meta(meta) == b"\x00meta\xff"
    assert torch.equal(data[:, :, 0], src[:, :, 3])
    assert sums.tolist() == block_checksums(src, [3]).tolist()
    assert tensors.read_header(tensors.goodbye())[0] < 0


# ------------------------------------------------------------------ waiting for the device
def test_poll_until_waits_without_blocking_the_loop_and_times_out():
    async def body():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.0005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        event = StepEvent(polls=6)
        await poll_until(event.query, 10, lambda: "never")
        assert event.queries == 6 and ticks > 0          # the loop ran while it waited
        with pytest.raises(KVTransferError, match="still busy within 0.02 s"):
            await poll_until(lambda: False, 0.02, lambda: "still busy")
        ticker.cancel()

    asyncio.run(body())


def test_nixl_posts_a_write_only_once_the_step_has_completed_on_the_device():
    src = pool(8, seed=10)
    final = pool(8, seed=11)
    src[:, :, [3, 4, 6]] = -1.0                 # the step's kernels are still writing these

    def kernels_done(blocks):
        def run():
            src[:, :, blocks] = final[:, :, blocks]
        return run

    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with endpoints("nixl", sink, src) as (sender, receiver):
            sink.reservations["r"] = [1, 2, 5]
            stream = sender.open("r", src, target(receiver, [1, 2, 5]))
            chunk = StepEvent(polls=5, on_complete=kernels_done([3, 4]))
            await stream.send([3, 4], [1, 2], ready=chunk)
            assert chunk.queries == 5                   # returned once the step had completed
            last = StepEvent(polls=3, on_complete=kernels_done([6]))
            await stream.finish(7, TokenLogprob(7, -0.25), [6], [5], ready=last)
            assert last.queries == 3
            await asyncio.wait_for(sink.done.wait(), 10)
            # the whole-transfer helper passes `ready` on too
            sink.done.clear()
            sink.reservations["r2"] = [0]
            src[:, :, 7] = -1.0
            whole = StepEvent(polls=4, on_complete=kernels_done([7]))
            await sender.send("r2", src, [7], target(receiver, [0]), 9, None, ready=whole)
            assert whole.queries == 4
            await asyncio.wait_for(sink.done.wait(), 10)
        return sink

    sink = asyncio.run(body())
    for s, d in [(3, 1), (4, 2), (6, 5), (7, 0)]:
        assert torch.equal(sink.kv[:, :, d], final[:, :, s]), (s, d)
    assert sink.completed["r"][0] == 7 and sink.completed["r2"] == (9, None)


def test_nixl_posts_at_once_without_a_ready_event():
    src = pool(8, seed=12)

    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with endpoints("nixl", sink, src) as (sender, receiver):
            sink.reservations["r"] = [1, 2]

            async def inline(fn, *args):                # the pool's thread, without a hop:
                return fn(*args)                        # what yields is the stream's own
            sender.run_on_pool = inline
            stream = sender.open("r", src, target(receiver, [1, 2]))
            yielded = 0

            async def count():
                nonlocal yielded
                while True:
                    await asyncio.sleep(0)
                    yielded += 1

            counter = asyncio.create_task(count())
            await asyncio.sleep(0)
            before = yielded
            await stream.send([3], [1])                 # ready None: KV final already
            done = StepEvent(polls=1)                   # complete already: asked once
            await stream.send([4], [2], ready=done)
            assert yielded == before and done.queries == 1    # never gave up the loop
            counter.cancel()
            await stream.finish(5, None)
            await asyncio.wait_for(sink.done.wait(), 10)
        return sink

    sink = asyncio.run(body())
    assert torch.equal(sink.kv[:, :, 1], src[:, :, 3]) and torch.equal(sink.kv[:, :, 2],
                                                                       src[:, :, 4])


@pytest.mark.parametrize("name", ["grpc", "torch"])
def test_stream_ordered_transports_leave_the_ready_event_alone(name):
    src = pool(8, seed=13)

    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with endpoints(name, sink, src) as (sender, receiver):
            sink.reservations["r"] = [1, 2]
            stream = sender.open("r", src, target(receiver, [1, 2]))
            await stream.send([5], [1], ready=Untouchable())
            await stream.finish(3, None, [6], [2], ready=Untouchable())
            await asyncio.wait_for(sink.done.wait(), 10)
        return sink

    sink = asyncio.run(body())
    assert torch.equal(sink.kv[:, :, 1], src[:, :, 5]) and torch.equal(sink.kv[:, :, 2],
                                                                       src[:, :, 6])
