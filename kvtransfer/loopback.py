"""A decode side without an engine: a KV pool in memory behind the KVSink interface, and a gRPC
server that serves only PushKV. Used to measure transports (`pdserve kvbench`) and to test them."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import torch

from engine.config import DTYPES
from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from kvtransfer.base import KVReceiver, create_receiver
from kvtransfer.connector import mismatch
from kvtransfer.staging import HostStaging
from proto import pdserve_pb2_grpc as pb_grpc


class MemorySink:
    """Reservations and a pool of `num_blocks` blocks on `device`; `completed` records first
    tokens, `rejected` the receivers' refusals (kvtransfer.integrity). Writes go through
    HostStaging and checksums are checked as the decode engine's sink does
    (kvtransfer.connector), off the loop (there is no engine thread here). vocab_size: as large as any model's by default."""

    def __init__(self, layout: KVLayout, num_blocks: int,
                 device: torch.device | str = "cpu", vocab_size: int = 1 << 18) -> None:
        self.layout = layout
        self.vocab_size = vocab_size
        self.kv = torch.zeros(layout.num_layers, 2, num_blocks, layout.block_size,
                              layout.num_kv_heads, layout.head_dim, dtype=DTYPES[layout.dtype],
                              device=device)
        self.staging = HostStaging(self.kv.device)
        self.reservations: dict[str, list[int]] = {}
        self.completed: dict[str, tuple[int, TokenLogprob | None]] = {}
        self.completed_at: dict[str, float] = {}     # time.monotonic(), comparable across processes
        self.rejected: dict[str, tuple[str, str]] = {}    # request id -> (kind, message)
        self.senders_done: list[str] = []     # one-sided senders' "no more writes" notices
        self.done = asyncio.Event()

    @property
    def pool(self) -> torch.Tensor:
        return self.kv

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        return self.reservations.get(request_id)

    def expecting(self) -> bool:
        return bool(self.reservations)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, ready=None) -> None:
        self.staging.write_blocks(self.kv, block_ids, data, ready)

    async def write(self, request_id: str, block_ids: list[int], data: torch.Tensor,
                    ready: object | None = None) -> None:
        if request_id in self.reservations:
            await asyncio.to_thread(self.write_blocks, block_ids, data, ready)

    async def complete(self, request_id: str, first_token: int,
                       first_logprob: TokenLogprob | None, block_ids: list[int],
                       claimed: list[int] | None) -> tuple[str, str] | None:
        if claimed is not None:
            why = await asyncio.to_thread(mismatch, self.kv, block_ids, claimed)
            if why is not None:
                return "checksum", why
        self.reservations.pop(request_id)
        self.completed[request_id] = (first_token, first_logprob)
        self.completed_at[request_id] = time.monotonic()
        self.done.set()
        return None

    def sender_done(self, request_id: str) -> None:
        self.senders_done.append(request_id)

    async def reject(self, request_id: str, message: str, kind: str) -> None:
        if self.reservations.pop(request_id, None) is not None:
            self.rejected[request_id] = (kind, message)
            self.done.set()


class _PushKVOnly(pb_grpc.DecodeWorkerServicer):
    def __init__(self, receiver) -> None:
        self.receiver = receiver

    async def PushKV(self, request_iterator, context):
        return await self.receiver.push_kv(request_iterator, context)


@contextlib.asynccontextmanager
async def receiving(name: str, sink: MemorySink, address: str, **kw):
    """A receiver of transport `name` for `sink` (with a PushKV server at `address` for grpc,
    which checks the receiver's deployment token as the workers' servers do); kw: the
    receiver's options (`auth`: the token, None: open)."""
    receiver: KVReceiver = create_receiver(name, sink, address=address, **kw)
    server = None
    if name == "grpc":
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20)],
                                 interceptors=receiver.auth.server_interceptors())
        pb_grpc.add_DecodeWorkerServicer_to_server(_PushKVOnly(receiver), server)
        server.add_insecure_port(address)
        await server.start()
    try:
        yield receiver
    finally:
        await receiver.close()
        if server is not None:
            await server.stop(None)
