"""KV integrity (kvtransfer.integrity): the checksum's properties on fp32, fp16 and bf16 pools;
every receiver refusing what breaks the rules (blocks not reserved, written twice, data of the
wrong size, a completion before every block, a first token outside the vocabulary, missing or
wrong checksums) before it writes a byte, over real transports; the deployment token on the
grpc stream, the torch rendezvous and NIXL notices; NIXL descriptors bounded on both sides; and
corrupted KV through a real decode servicer: the request fails with a clear error, the metric
counts it, the pool is all free again; with --kv-load-failure recompute the request completes
with the tokens a local prefill gives."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest
import torch

from engine import kv_checksum
from engine.config import DTYPES
from engine.kv_layout import KVLayout
from kvtransfer import KVTransferError, TransferTarget, block_bytes, create_sender
from kvtransfer import integrity
from kvtransfer.grpc_transport import GrpcKVSender
from kvtransfer.integrity import block_checksums, checksums
from kvtransfer.loopback import MemorySink, receiving
from kvtransfer.staging import HostStaging
from kvtransfer.torch_transport import MessageTensors
from kvtransfer.wire import completion_chunk, layout_to_pb, notice_fields
from cluster.auth import ClusterAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.conftest import free_port, make_engine
from tests.test_kvtransfer import LAYOUT, endpoints, pool, target
from tests.waiting import wait_until_async


def kv_pool(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
                       layout.head_dim, generator=g).to(DTYPES[layout.dtype])


# ------------------------------------------------------------------------------ the checksum
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_checksums_are_equal_on_equal_data_and_on_either_path(dtype):
    lay = dataclasses.replace(LAYOUT, dtype=dtype)
    kv = kv_pool(lay, 8, seed=1)
    ids = [5, 0, 3]
    sums = block_checksums(kv, ids)
    assert sums.dtype == torch.int64 and sums.shape == (3,)
    assert torch.equal(sums, block_checksums(kv.clone(), ids))
    assert torch.equal(sums, checksums(kv[:, :, ids]))       # a gather, as senders compute it
    assert torch.equal(sums[1:], block_checksums(kv, ids[1:]))
    assert len(set(block_checksums(kv, range(8)).tolist())) == 8
    assert block_checksums(kv, []).shape == (0,)


def test_checksums_of_odd_rows_and_gathered_in_slices(monkeypatch):
    lay = KVLayout("float16", 2, 1, 1, 3)                    # 6-byte rows: int16 words
    kv = kv_pool(lay, 4, seed=2)
    before = block_checksums(kv, [1])
    kv.view(torch.int16)[0, 1, 1, 1, 0, 2] ^= 1 << 15
    assert not torch.equal(before, block_checksums(kv, [1]))
    kv = kv_pool(LAYOUT, 8, seed=2)
    ids = [3, 1, 7, 0, 5]
    monkeypatch.setattr(kv_checksum, "GATHER_BYTES", 2 * block_bytes(LAYOUT))
    assert torch.equal(integrity.gathered_checksums(kv, ids), block_checksums(kv, ids))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_flipped_bit_anywhere_changes_that_block_s_checksum_only(dtype):
    lay = dataclasses.replace(LAYOUT, dtype=dtype)
    kv = kv_pool(lay, 4, seed=3)
    before = block_checksums(kv, range(4))
    raw = kv.view(-1).view(torch.uint8)
    block_plane = kv[0, 0, 0].numel() * kv.element_size()    # bytes of a block in one plane
    rng = random.Random(dtype)
    spots = [(0, 0), (raw.numel() - 1, 7)] + [(rng.randrange(raw.numel()), rng.randrange(8))
                                              for _ in range(62)]
    for pos, bit in spots:
        raw[pos] ^= 1 << bit
        block = pos // block_plane % 4
        after = block_checksums(kv, range(4))
        changed = [i for i in range(4) if after[i] != before[i]]
        assert changed == [block], (pos, bit)
        raw[pos] ^= 1 << bit
    assert torch.equal(block_checksums(kv, range(4)), before)


def test_moved_rows_swapped_stale_and_foreign_blocks_are_detected():
    src = kv_pool(LAYOUT, 8, seed=4)
    claimed = block_checksums(src, [1, 2, 3, 4]).tolist()   # the sender's, for dst 4, 5, 6, 7
    dst = torch.zeros_like(src)
    dst[:, :, [4, 5]] = src[:, :, [2, 1]]                    # two blocks swapped in flight
    # block 6 never written (stale zeros); block 7 from another request
    dst[:, :, 7] = kv_pool(LAYOUT, 8, seed=5)[:, :, 4]
    assert [a == b for a, b in zip(claimed, block_checksums(dst, [4, 5, 6, 7]).tolist())] == \
        [False, False, False, False]
    block = src[:, :, 1]                                     # [layers, 2, slots, heads, dim]
    for moved in (block[:, [1, 0]],                          # K and V swapped
                  block[[1, 0]],                             # layers swapped
                  block.roll(1, dims=2)):                    # token slots shifted
        other = src.clone()
        other[:, :, 1] = moved
        assert block_checksums(other, [1]) != block_checksums(src, [1])


# ---------------------------------------------------------- grpc receiver: malformed streams
BB = block_bytes(LAYOUT)


def _chunk(src, rid, dst, src_ids, **kw) -> pb.KVChunk:
    data = HostStaging("cpu").blocks_to_bytes(src, src_ids) if src_ids else b""
    fields = dict(request_id=rid, layout=layout_to_pb(LAYOUT), block_ids=dst, data=data,
                  checksums=block_checksums(src, src_ids).tolist())
    fields.update(kw)
    return pb.KVChunk(**fields)


def _last(rid, token=7) -> pb.KVChunk:
    return completion_chunk(rid, LAYOUT, token, None)


SRC = pool(8, seed=6)
# case -> (chunks, status, message, {destination block: source block} the accepted pieces wrote)
MALFORMED = {
    "unreserved": ([_chunk(SRC, "r", [1, 6], [0, 1])], "INVALID_ARGUMENT",
                   "blocks [6] are not reserved", {}),
    "twice in one": ([_chunk(SRC, "r", [1, 1], [0, 1])], "INVALID_ARGUMENT", "written twice",
                     {}),
    "twice in two": ([_chunk(SRC, "r", [1], [0]), _chunk(SRC, "r", [1], [1])],
                     "INVALID_ARGUMENT", "blocks [1] written twice", {1: 0}),
    "short data": ([_chunk(SRC, "r", [1, 2], [0, 1], data=b"\0" * (2 * BB - 1))],
                   "INVALID_ARGUMENT", f"{2 * BB - 1} bytes of KV for 2 blocks", {}),
    "long data": ([_chunk(SRC, "r", [1], [0], data=b"\0" * (BB + 4))], "INVALID_ARGUMENT",
                  f"{BB + 4} bytes of KV for 1 blocks", {}),
    "data, no ids": ([_chunk(SRC, "r", [], [], data=b"\0" * BB)], "INVALID_ARGUMENT",
                     f"{BB} bytes of KV for 0 blocks", {}),
    "last too early": ([_chunk(SRC, "r", [1, 2], [0, 1]), _last("r")], "INVALID_ARGUMENT",
                       "1 of its 3 KV blocks missing", {1: 0, 2: 1}),
    "token out of vocab": ([_chunk(SRC, "r", [1, 2, 3], [0, 1, 2]), _last("r", 1000)],
                           "INVALID_ARGUMENT", "first token 1000 is outside the vocabulary",
                           {1: 0, 2: 1, 3: 2}),
    "no checksums": ([_chunk(SRC, "r", [1], [0], checksums=[])], "INVALID_ARGUMENT",
                     "sends no KV checksums", {}),
    "too few checksums": ([_chunk(SRC, "r", [1, 2], [0, 1], checksums=[1])],
                          "INVALID_ARGUMENT", "1 checksums for 2 blocks", {}),
    "corrupted": ([_chunk(SRC, "r", [1, 2, 3], [0, 1, 2], checksums=[1, 2, 3]), _last("r")],
                  "DATA_LOSS", "checksum mismatch in 3 of 3 blocks", {1: 0, 2: 1, 3: 2}),
    "not reserved at all": ([_chunk(SRC, "other", [1], [0])], "NOT_FOUND",
                            "no KV reservation here", {}),
}


async def _push(address: str, chunks) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            async for _ in pb_grpc.DecodeWorkerStub(ch).PushKV(iter(chunks)):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_grpc_receiver_refuses_malformed_streams_before_writing(case):
    chunks, code, message, written = MALFORMED[case]

    async def body():
        sink = MemorySink(LAYOUT, 8, vocab_size=1000)
        sink.reservations["r"] = [1, 2, 3]
        async with receiving("grpc", sink, f"127.0.0.1:{free_port()}") as receiver:
            err = await _push(receiver.address(), chunks)
        return sink, err

    sink, err = asyncio.run(body())
    assert err is not None and err.code().name == code and message in err.details(), err
    assert not sink.completed
    if code == "NOT_FOUND":
        assert "r" in sink.reservations and not sink.rejected      # nothing to fail
    else:
        kind, why = sink.rejected["r"]
        assert kind == ("checksum" if code == "DATA_LOSS" else "invalid") and message in why
    for block in range(8):                  # the refused piece wrote nothing
        want = SRC[:, :, written[block]] if block in written else torch.zeros_like(SRC[:, :, 0])
        assert torch.equal(sink.kv[:, :, block], want), block


def test_a_receiver_with_checksums_off_accepts_a_sender_without_them():
    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with receiving("grpc", sink, f"127.0.0.1:{free_port()}",
                             checksum=False) as receiver:
            sink.reservations["r"] = [1, 2]
            sender = create_sender("grpc", LAYOUT, kv=SRC, checksum=False)
            await sender.send("r", SRC, [4, 5], target(receiver, [1, 2]), 3, None)
            await sender.close()
        return sink

    sink = asyncio.run(body())
    assert sink.completed["r"] == (3, None) and torch.equal(sink.kv[:, :, 1], SRC[:, :, 4])


# ------------------------------------------------------------- torch and nixl receivers
@pytest.mark.parametrize("name", ["torch", "nixl"])
def test_torch_and_nixl_receivers_refuse_what_breaks_the_rules(name):
    """Through each transport's own streams: a completion before every block, a token outside
    the vocabulary, a sender without checksums, corrupted blocks; and (torch) pieces of the
    wrong size or not reserved, (nixl) notices whose claims do not cover the reservation."""
    src = pool(8, seed=7)

    async def body():
        sink = MemorySink(LAYOUT, 16, vocab_size=1000)
        async with endpoints(name, sink, src) as (sender, receiver):
            async def run(rid, reserved, steps, by=sender):
                sink.reservations[rid] = list(reserved)
                stream = by.open(rid, src, target(receiver, reserved))
                try:
                    await steps(stream)
                except KVTransferError:
                    pass                            # refused: what was refused is asserted
                await wait_until_async(lambda: rid in sink.rejected or rid in sink.completed,
                                       10, f"request {rid} refused or completed")
                return sink.rejected.get(rid)

            async def early(s):
                await s.send([1], [1])
                await s.finish(5, None)

            async def vocab(s):
                await s.finish(1000, None, [1], [3])

            async def corrupted(s):
                await s.send([1], [5])
                await wait_until_async(lambda: torch.equal(sink.kv[:, :, 5], src[:, :, 1]), 10,
                                       "the WRITE landing")
                sink.kv[0, 1, 5, 2, 1, 3] += 1.0            # and a stray write after it
                await s.finish(5, None)

            unsummed = create_sender(name, LAYOUT, kv=src, checksum=False)
            try:
                got = {"early": await run("a", [1, 2], early),
                       "vocab": await run("b", [3], vocab),
                       "unsummed": await run("c", [4], lambda s: s.finish(5, None, [1], [4]),
                                             by=unsummed)}
            finally:
                await unsummed.close()
            if name == "torch":                 # two-sided: the corruption is on the wire
                flip = FlipTensors(sender.layout, src.device)
                got["corrupted"] = await run("d", [5], lambda s: _flipped(s, flip))
                got["size"] = await run("e", [6, 7], lambda s: _raw(s, [6, 7], [1]))
                got["unreserved"] = await run("f", [8], lambda s: _raw(s, [9], [1]))
                got["twice"] = await run("g", [10, 11], lambda s: _raw(s, [10, 10], [1, 2]))
            else:
                got["corrupted"] = await run("d", [5], corrupted)
                got["unreserved"] = await run("f", [8], lambda s: _notice(s, [9], [0]))
                got["twice"] = await run("g", [10, 11], lambda s: _notice(s, [10, 10], [0, 0]))
                got["uncovered"] = await run("h", [12, 13], lambda s: _notice(s, [12], [0]))
        return got, sink

    got, sink = asyncio.run(body())
    expect = {"early": "1 of its 2 KV blocks missing",
              "vocab": "first token 1000 is outside the vocabulary",
              "unsummed": "sends no KV checksums",
              "corrupted": "KV checksum mismatch in 1 of 1 blocks",
              "size": f"{BB} bytes of KV for 2 blocks",
              "unreserved": "blocks [9] are not reserved",
              "twice": "blocks [10] written twice",
              "uncovered": "1 of its 2 KV blocks missing"}
    for case, refusal in got.items():
        assert refusal is not None, case
        kind, message = refusal
        assert expect[case] in message and kind == ("checksum" if case == "corrupted"
                                                    else "invalid"), (case, message)
    assert not sink.completed
    if name == "torch":                         # refused pieces wrote nothing
        assert sink.kv[:, :, [4, 6, 7, 8, 9, 10, 11]].abs().sum() == 0


class FlipTensors(MessageTensors):
    """The torch transport's message tensors, with one bit of the data flipped after the
    checksums were computed: what a bad link would do."""

    def outgoing(self, meta, kv, src_blocks, checksum=True):
        out = super().outgoing(meta, kv, src_blocks, checksum)
        if out.payload:
            out.payload[0].view(-1).view(torch.uint8)[5] ^= 0x10
        return out


async def _flipped(stream, flip):
    plain = stream.channel.tensors
    stream.channel.tensors = flip
    try:
        await stream.finish(5, None, [1], [5])
    finally:
        stream.channel.tensors = plain


async def _raw(stream, dst, src):
    """A torch message whose meta says `dst` while its data holds the blocks `src`."""
    chunk = completion_chunk(stream.request_id, LAYOUT, 5, None, dst)
    ch = stream.channel
    tensors = ch.message(chunk.SerializeToString(), stream.kv, src)
    await asyncio.get_running_loop().run_in_executor(ch.pool, ch.send, tensors)


async def _notice(stream, dst, sums):
    """A NIXL completion notice that claims `dst` (signed: the claims are what is checked)."""
    chunk = completion_chunk(stream.request_id, LAYOUT, 5, None, dst, sums)
    chunk.signature = stream.sender.auth.sign(notice_fields(chunk))
    stream.sender.agent.send_notif(stream.remote, chunk.SerializeToString())


# ------------------------------------------------------------------- the deployment token
SECRET = ClusterAuth("s3cret")                          # the deployment's token


def test_grpc_pushes_carry_the_deployment_token():
    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with receiving("grpc", sink, f"127.0.0.1:{free_port()}", auth=SECRET) as receiver:
            sink.reservations["r"] = [1]
            sender = create_sender("grpc", LAYOUT, kv=SRC, auth=SECRET)
            await sender.send("r", SRC, [2], target(receiver, [1]), 3, None)
            await sender.close()
            sink.reservations["s"] = [2]
            stranger = create_sender("grpc", LAYOUT, kv=SRC)    # a sender without the token
            with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
                await stranger.send("s", SRC, [3], target(receiver, [2]), 3, None)
            await stranger.close()
        return sink

    sink = asyncio.run(body())
    assert sink.completed["r"] == (3, None) and "s" not in sink.completed
    assert sink.kv[:, :, 2].abs().sum() == 0


def test_torch_refuses_a_channel_announced_without_the_token():
    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with receiving("torch", sink, f"127.0.0.1:{free_port()}", auth=SECRET) as receiver:
            sender = create_sender("torch", LAYOUT, kv=SRC, timeout_s=1.5,
                                   auth=ClusterAuth("another"))
            sink.reservations["r"] = [1]
            with pytest.raises(KVTransferError):
                await sender.send("r", SRC, [2], target(receiver, [1]), 3, None)
            await sender.close()
        return sink

    sink = asyncio.run(body())
    assert not sink.completed and sink.kv.abs().sum() == 0


def test_nixl_ignores_notices_without_the_token(caplog):
    refused = "request r: ignoring a NIXL notification without the deployment's signature"

    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with receiving("nixl", sink, f"127.0.0.1:{free_port()}", auth=SECRET) as receiver:
            sender = create_sender("nixl", LAYOUT, kv=SRC, auth=SECRET)
            sink.reservations["r"] = [1]
            stranger = create_sender("nixl", LAYOUT, kv=SRC,    # a stranger's notice
                                     auth=ClusterAuth("another"))
            await stranger.send("r", SRC, [2], target(receiver, [1]), 3, None)
            await wait_until_async(lambda: refused in caplog.messages, 10,
                                   "the receiver reading the stranger's notice")
            await stranger.close()
            ignored = "r" not in sink.completed and "r" in sink.reservations
            sink.reservations["s"] = [2]
            await sender.send("s", SRC, [3], target(receiver, [2]), 4, None)
            await asyncio.wait_for(sink.done.wait(), 10)
            await sender.close()
        return ignored, sink

    ignored, sink = asyncio.run(body())
    assert ignored and sink.completed["s"] == (4, None)


# ------------------------------------------------------------------------ NIXL descriptors
def test_nixl_descriptors_are_bounded_on_both_sides():
    src = pool(8, seed=8)

    async def body():
        sink = MemorySink(LAYOUT, 8)
        async with endpoints("nixl", sink, src) as (sender, receiver):
            # the receiver registered exactly its pool tensor, nothing around it
            kv = sink.kv
            assert receiver.region == (kv.data_ptr(), kv.numel() * kv.element_size(), 0)
            assert list(receiver._registration[0])[:3] == list(receiver.region)
            peer = pb.NixlPeer.FromString(receiver.metadata())
            assert peer.region_bytes == kv.nbytes and peer.num_blocks == 8

            def opened(blocks, **change):
                bad = pb.NixlPeer.FromString(receiver.metadata())
                for k, v in change.items():
                    setattr(bad, k, v)
                t = dataclasses.replace(target(receiver, blocks),
                                        metadata=bad.SerializeToString())
                return sender.open("r", src, t)

            with pytest.raises(KVTransferError, match="advertises a KV region of 1 bytes"):
                opened([1], region_bytes=1)
            with pytest.raises(KVTransferError, match="a KV region of .* for 9 blocks"):
                opened([1], num_blocks=9)                # larger than what it registered
            with pytest.raises(KVTransferError, match=r"blocks \[8\] outside its pool of 8"):
                opened([1, 8])
            with pytest.raises(KVTransferError, match="unknown NIXL memory type"):
                opened([1], memory_type="DISK")
            sink.reservations["r"] = [1, 2]
            stream = opened([1, 2])
            with pytest.raises(KVTransferError, match=r"source blocks \[8\] outside this"):
                await stream.send([8], [1])
            with pytest.raises(KVTransferError, match=r"destination blocks \[8\] outside"):
                await stream.send([1], [8])
        return sink

    sink = asyncio.run(body())
    assert sink.kv.abs().sum() == 0


# ---------------------------------------------------------- corrupted KV, decode servicer
class FlipStaging(HostStaging):
    """Flips one bit of the first message's blocks after their checksums were computed (on
    CPUs the sender's thread computes them from the gathered copy, then reads its bytes)."""

    flipped = False

    def gather(self, kv, block_ids, digest=None, buffer=None):
        gathered = super().gather(kv, block_ids, digest, buffer)
        if not FlipStaging.flipped:
            FlipStaging.flipped = True

            def then_flip(blocks):
                sums = digest(blocks)
                flat = blocks.view(-1).view(torch.uint8)
                flat[flat.numel() // 3] ^= 0x04
                return sums
            gathered.digest = then_flip
        return gathered


class CorruptingSender(GrpcKVSender):
    def staging(self, device):
        return FlipStaging(device)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_corrupted_kv_fails_the_request_or_is_recomputed(tiny_model_dir, policy):
    from decode_service.server import DecodeServicer
    from engine.async_engine import AsyncEngine
    from kvtransfer.wire import target_from_pb
    from cluster.metrics import WorkerMetrics
    from serving.worker import WorkerIdentity

    engine = make_engine(tiny_model_dir, role="decode", num_blocks=16)
    lay = engine.layout
    src = torch.randn(lay.num_layers, 2, 8, lay.block_size, lay.num_kv_heads, lay.head_dim,
                      generator=torch.Generator().manual_seed(9))
    prompt = list(range(1, 10))                         # 9 tokens: 3 blocks
    params = pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    FlipStaging.flipped = False

    async def decode(stub, rid, local=False):
        """-> (reservation or None, tokens, error or None)"""
        call = stub.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                            params=params, local_prefill=local))
        reservation, tokens = None, []
        try:
            async for event in call:
                if event.HasField("reservation"):
                    reservation = target_from_pb(event.reservation)
                    asyncio.ensure_future(send(reservation, rid))
                tokens += event.tokens.token_ids
        except grpc.aio.AioRpcError as exc:
            return reservation, tokens, exc
        return reservation, tokens, None

    async def send(t: TransferTarget, rid):
        sender = CorruptingSender(lay, kv=src, blocks_per_message=2)
        try:
            await sender.send(rid, src, [5, 1, 6], t, 42, None)
        except KVTransferError:
            pass                                        # the decode worker refused it
        await sender.close()

    async def body():
        aengine = AsyncEngine(engine)
        aengine.start()
        port = free_port()
        ident = WorkerIdentity("d1", f"127.0.0.1:{port}", "tiny")
        metrics = WorkerMetrics("decode", "d1", engine.pool.num_blocks, aengine.load)
        server = grpc.aio.server()
        servicer = DecodeServicer(aengine, ident, "grpc", metrics, on_timeout=policy)
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        server.add_insecure_port(ident.address)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(ident.address) as ch:
                stub = pb_grpc.DecodeWorkerStub(ch)
                got = await asyncio.wait_for(decode(stub, "r"), 60)
                local = await asyncio.wait_for(decode(stub, "local", local=True), 60)
            await wait_until_async(lambda: engine.pool.num_free == engine.pool.num_blocks, 10,
                                   "the stream's end freeing the blocks")
        finally:
            await servicer.close()
            await server.stop(None)
            aengine.stop()
        return got, local, metrics

    (reservation, tokens, err), (_, local_tokens, local_err), metrics = asyncio.run(body())
    assert reservation is not None and len(reservation.missing) == 3 and local_err is None
    failures = metrics.registry.get_sample_value(
        "pdserve_kv_checksum_failures_total", {"role": "decode", "worker": "d1",
                                               "transport": "grpc"})
    assert failures == 1
    assert engine.pool.num_free == engine.pool.num_blocks
    if policy == "fail":
        assert err is not None and "KV checksum mismatch in 1 of 3 blocks" in err.details()
        assert "corrupted in transfer" in err.details() and not tokens
    else:
        assert err is None and tokens == local_tokens and len(tokens) == 4
