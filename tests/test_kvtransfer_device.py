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
from kvtransfer import KVTransferError, TransferTarget, block_bytes, create_sender
from kvtransfer.base import poll_until
from kvtransfer.integrity import block_checksums
from kvtransfer.loopback import MemorySink, receiving
from kvtransfer.staging import Gathered, HostStaging
from kvtransfer.torch_transport import MessageTensors, TorchKVReceiver, TorchKVSender
from kvtransfer.wire import tensor_from_bytes
from tests.conftest import free_port, make_engine
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
    assert receiver.capacity == len(data)
    assert sender.capacity == 0                 # CPUs: the bytes are the gathered copy's


def test_staging_reuses_its_buffer_across_messages_of_different_sizes():
    src = pool(16, seed=6)
    dst = torch.zeros_like(src)
    staging = HostStaging("cpu")
    bb = block_bytes(LAYOUT)
    for blocks, held in [([1, 2, 3], 3), ([9], 3), ([4, 5], 3), ([10, 11, 12, 13, 14], 5),
                         ([0], 5)]:
        data = tensor_from_bytes(staging.blocks_to_bytes(src, blocks), LAYOUT, len(blocks))
        staging.write_blocks(dst, blocks, data)
        assert staging.capacity == held * bb, blocks      # reused while it fits, else replaced
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


def test_a_gather_on_cpus_is_the_blocks_copied_out_and_the_rest_waits_for_on_host():
    src = pool(8, seed=16)
    staging = HostStaging("cpu")
    assert staging.reserve(4 * block_bytes(LAYOUT)) is None      # no buffers on CPUs
    digested = []

    def digest(blocks):
        digested.append(blocks.shape[2])
        return block_checksums(blocks, range(blocks.shape[2]))
    gathered = staging.gather(src, [5, 2], digest)
    assert gathered.buffer is None and not digested               # the gather only, so far
    assert torch.equal(gathered.blocks, src[:, :, [5, 2]])
    src[:, :, [5, 2]] = 0.0                  # the pool's blocks freed and reused: not read again
    with gathered.on_host() as (data, sums):
        assert data.dtype == torch.uint8 and data.numel() == 2 * block_bytes(LAYOUT)
        assert torch.equal(data.view(torch.float32).view(shape(2)), gathered.blocks)
        assert sums == block_checksums(gathered.blocks, [0, 1]).tolist() and digested == [2]
    assert staging.capacity == 0


def test_data_already_on_the_device_goes_into_the_pool_without_staging():
    staging = HostStaging(META)                  # stands in for a CUDA pool (an NCCL receive)
    kv = torch.empty(shape(8), device=META)
    staging.write_blocks(kv, [3, 4], torch.empty(shape(2), device=META))
    assert staging.capacity == 0


# ------------------------------------------------------------- grpc sender, decode service sink
def test_grpc_sender_and_decode_sink_move_blocks_through_staging(tiny_model_dir):
    """grpc sender -> PushKV -> the decode engine's sink (kvtransfer.connector) -> a real engine
    that decodes."""
    from engine.async_engine import AsyncEngine
    from kvtransfer.connector import EngineSink
    from engine.request import Request, SamplingParams
    from kvtransfer import create_sender
    from cluster.metrics import WorkerMetrics

    engine = make_engine(tiny_model_dir, role="decode", num_blocks=16)
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
    assert sink.staging.capacity == one
    assert sender.staging(src.device).capacity == 0     # CPU: messages are made from the gathers


def test_a_grpc_message_is_encoded_with_its_data_from_host_memory():
    from proto import pdserve_pb2 as pb
    from kvtransfer.wire import chunk_bytes

    blocks = pool(2, seed=17).to(torch.bfloat16)
    data = blocks.reshape(-1).view(torch.uint8)
    head = pb.KVChunk(request_id="r", block_ids=[3, 9], checksums=[-1, 2 ** 62], last=True)
    whole = pb.KVChunk()
    whole.CopyFrom(head)
    whole.data = data.numpy().tobytes()
    assert pb.KVChunk.FromString(chunk_bytes(head, data.numpy())) == whole
    assert len(chunk_bytes(head, data.numpy())) == whole.ByteSize()
    assert pb.KVChunk.FromString(chunk_bytes(head, b"")) == head


def test_grpc_sender_only_gathers_on_the_pool_thread(monkeypatch):
    """What a send runs on the pool's thread (run_on_pool: a prefill engine's, between steps) is
    the blocks' gather, one command per send: tensors out, copies of the sender's own (the
    blocks may be reused at once); the checksums and the encoding of the messages run on the
    sender's thread."""
    import concurrent.futures

    import kvtransfer.grpc_transport as grpc_transport

    threads: dict[str, list[str]] = {"digest": [], "encode": []}

    def spy(what, fn):
        def run(*args):
            threads[what].append(threading.current_thread().name)
            return fn(*args)
        return run
    monkeypatch.setattr(grpc_transport, "checksums", spy("digest", grpc_transport.checksums))
    monkeypatch.setattr(grpc_transport, "chunk_bytes", spy("encode", grpc_transport.chunk_bytes))
    src = pool(8, seed=18)
    want = src.clone()
    engine = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
    commands = []

    async def on_pool(fn, *args):
        def run():
            out = fn(*args)
            commands.append(out)
            read = [b for piece in args[0] for b in piece]
            src[:, :, read] = -7.0            # the blocks freed and reused right after
            return out
        return await asyncio.get_running_loop().run_in_executor(engine, run)

    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with endpoints("grpc", sink, src) as (sender, receiver):
            sender.run_on_pool = on_pool
            sender.blocks_per_message = 2
            sink.reservations["r"] = [1, 2, 3, 4]
            stream = sender.open("r", src, target(receiver, [1, 2, 3, 4]))
            await stream.send([5, 0, 7], [1, 2, 3])
            await stream.finish(9, None, [6], [4])
            await asyncio.wait_for(sink.done.wait(), 10)
        return sink

    sink = asyncio.run(body())
    engine.shutdown()
    assert [[g.blocks.shape[2] for g in out] for out in commands] == [[2, 1], [1]]
    for out in commands:
        for g in out:
            assert isinstance(g, Gathered) and g.buffer is None     # CPU: no staging copy
            assert g.blocks.data_ptr() != src.data_ptr()
    assert sink.completed["r"] == (9, None)
    for s, d in [(5, 1), (0, 2), (7, 3), (6, 4)]:
        assert torch.equal(sink.kv[:, :, d], want[:, :, s]), (s, d)
    assert len(threads["digest"]) == len(threads["encode"]) == 3
    assert all(t.startswith("kv-grpc") for t in threads["digest"] + threads["encode"]), threads


# ------------------------------------------------------------------------- torch transport
def test_torch_transport_keeps_headers_on_the_host_and_payloads_on_the_pool_device():
    kv = torch.empty(shape(8), device=META)
    tensors = MessageTensors(LAYOUT, META)
    out = tensors.outgoing(b"a KVChunk", kv, [1, 5])
    (header, meta), (data, sums) = out.control, out.payload
    assert header.dtype == torch.int64 and header.shape == (3,) and meta.shape == (9,)
    assert data.shape == shape(2) and sums.shape == (2,) and sums.dtype == torch.int64
    assert out.ready is None                             # events only on CUDA
    control = [header, meta, tensors.header(), tensors.meta(9), tensors.goodbye()]
    assert {t.device.type for t in control} == {"cpu"}   # the gloo group's, on any pool
    assert {t.device for t in [data, sums, tensors.data(3), tensors.sums(3)]} == {META}
    assert tensors.data(3).shape == shape(3) and tensors.data(3).dtype == torch.float32
    assert tensors.outgoing(b"last", kv, []).payload == []        # no blocks: no payload
    assert len(tensors.outgoing(b"off", kv, [1], checksum=False).payload) == 1  # no checksums

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
    out = tensors.outgoing(b"\x00meta\xff", src, [3])
    (header, meta), (data, sums) = out.control, out.payload
    assert tensors.read_header(header) == (6, 1, True)
    assert tensors.read_meta(meta) == b"\x00meta\xff"
    assert torch.equal(data[:, :, 0], src[:, :, 3])
    assert sums.tolist() == block_checksums(src, [3]).tolist()
    assert tensors.read_header(tensors.goodbye())[0] < 0


def test_a_torch_channel_stays_up_while_idle_longer_than_its_timeout():
    """Between messages the receiving thread waits for the next header on the host, with no
    operation posted (an NCCL receive posted there would trip the watchdog): a channel idle for
    longer than the configured timeout still carries the next request, on the same groups.
    A receiver closed while its channel is idle does not wait for it."""
    import time

    from kvtransfer import create_receiver

    src = pool(8, seed=14)

    async def body():
        sink = MemorySink(LAYOUT, 8)
        receiver = create_receiver("torch", sink, address=f"127.0.0.1:{free_port()}",
                                   timeout_s=0.5)
        sender = create_sender("torch", LAYOUT, kv=src, timeout_s=0.5)
        try:
            for rid, s, d, idle in [("a", [2], [1], 1.5), ("b", [6, 7], [4, 5], 0)]:
                sink.reservations[rid] = d
                await sender.send(rid, src, s, target(receiver, d), 3, None)
                await asyncio.wait_for(sink.done.wait(), 10)
                sink.done.clear()
                await asyncio.sleep(idle)           # idle past the timeout: under test
            t0 = time.monotonic()
            await receiver.close()               # its channel's thread waits for a header
            closed_in = time.monotonic() - t0
        finally:
            await sender.close()                 # the goodbye ends that thread
        for thread in receiver._threads:
            await asyncio.to_thread(thread.join, 10)
        return sink, receiver, closed_in

    sink, receiver, closed_in = asyncio.run(body())
    assert set(sink.completed) == {"a", "b"} and not sink.rejected
    for s, d in [(2, 1), (6, 4), (7, 5)]:
        assert torch.equal(sink.kv[:, :, d], src[:, :, s]), (s, d)
    assert len(receiver._threads) == 1 and not receiver._threads[0].is_alive()
    assert closed_in < 1.0


# ------------------------------------------------------------------ waiting for the device
def test_poll_until_waits_without_blocking_the_loop_and_times_out():
    async def body():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.0005)          # the loop's pace, counted
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
