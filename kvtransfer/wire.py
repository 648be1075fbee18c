"""Conversions between engine types and proto messages used by transfers and services."""

from __future__ import annotations

import torch

from engine.config import DTYPES
from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from kvtransfer import staging
from kvtransfer.base import TransferTarget
from proto import pdserve_pb2 as pb


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(dtype=layout.dtype, block_size=layout.block_size,
                       num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim,
                       tensor_parallel_size=layout.tensor_parallel_size,
                       group_windows=list(layout.groups))


def layout_from_pb(m: pb.KVLayout) -> KVLayout:
    return KVLayout(m.dtype, m.block_size, m.num_layers, m.num_kv_heads, m.head_dim,
                    m.tensor_parallel_size or 1, tuple(m.group_windows) or (0,))


def logprob_to_pb(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                           rank=lp.rank or 0)


def logprob_from_pb(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top],
                        m.rank or None)


def prompt_logprobs_to_pb(lps) -> list[pb.TokenLogprob]:
    """A request's prompt logprobs (engine: first None) as the wire carries them: the rest."""
    return [logprob_to_pb(lp) for lp in lps[1:]]


def target_to_pb(t: TransferTarget) -> pb.KVDescriptor:
    return pb.KVDescriptor(transport=t.transport, address=t.address, engine_id=t.engine_id,
                           layout=layout_to_pb(t.layout), block_ids=list(t.block_ids),
                           num_cached_blocks=t.num_cached_blocks,
                           transport_metadata=t.metadata)


def target_from_pb(m: pb.KVDescriptor) -> TransferTarget:
    if m.num_cached_blocks > len(m.block_ids):
        raise ValueError(f"KV descriptor: {m.num_cached_blocks} cached blocks of "
                         f"{len(m.block_ids)}")
    return TransferTarget(m.transport, m.address, m.engine_id, layout_from_pb(m.layout),
                          tuple(m.block_ids), m.num_cached_blocks, m.transport_metadata)


def tensor_from_bytes(data: bytes, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """-> [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] in the layout's dtype, on
    the host (the bytes of HostStaging.blocks_to_bytes)."""
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)
    return staging.tensor_from_bytes(data, DTYPES[layout.dtype], shape)


_DATA_FIELD = pb.KVChunk.DESCRIPTOR.fields_by_name["data"].number


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_DATA_TAG = _varint(_DATA_FIELD << 3 | 2)          # field `data`, length-delimited


def chunk_bytes(chunk: pb.KVChunk, data) -> bytes:
    """The encoding of `chunk` with `data` (any buffer: a memoryview of host memory) as its
    data field, copied once, straight into the result: a message's encoding is the
    concatenation of its fields' encodings in any order, so the field follows the others
    (chunk's own data must be empty), with no bytes object of the data made first."""
    data = memoryview(data).cast("B")
    return b"".join((chunk.SerializeToString(), _DATA_TAG, _varint(data.nbytes), data))


def completion_chunk(request_id: str, layout: KVLayout, first_token: int,
                     first_logprob: TokenLogprob | None, block_ids=(),
                     checksums=()) -> pb.KVChunk:
    """The last message of a transfer (last=True): the first token, and blocks (with their
    checksums) if any."""
    msg = pb.KVChunk(request_id=request_id, layout=layout_to_pb(layout), last=True,
                     first_token_id=first_token, block_ids=list(block_ids),
                     checksums=list(checksums))
    if first_logprob is not None:
        msg.first_logprob.CopyFrom(logprob_to_pb(first_logprob))
    return msg


def first_logprob_of(chunk: pb.KVChunk) -> TokenLogprob | None:
    return logprob_from_pb(chunk.first_logprob) if chunk.HasField("first_logprob") else None


def notice_fields(chunk: pb.KVChunk) -> dict[str, str]:
    """What ClusterAuth signs of a control message sent as opaque bytes (NIXL notifications):
    everything a receiver acts on."""
    first = chunk.first_logprob.SerializeToString() if chunk.HasField("first_logprob") else b""
    return {"purpose": "kv-notice", "request": chunk.request_id, "last": str(int(chunk.last)),
            "layout": chunk.layout.SerializeToString().hex(),
            "blocks": ",".join(map(str, chunk.block_ids)),
            "checksums": ",".join(map(str, chunk.checksums)),
            "first_token": str(chunk.first_token_id), "first_logprob": first.hex()}


def chunk_from_bytes(data: bytes) -> pb.KVChunk:
    return pb.KVChunk.FromString(data)
