"""The KV transfer contract.

Sender side (prefill): `await sender.send(request_id, kv, src_blocks, target, first_token,
first_logprob)` copies the KV of `src_blocks` (pool tensor `kv[layer, k_or_v, block, ...]`) into
the decode worker's `target.block_ids`, in order, then delivers the first token. `src_blocks` are
the prompt's blocks after the first `target.num_cached_blocks` (those the decode worker already
holds from its prefix cache), so they pair with `target.missing`. It returns once
the receiver has everything, and raises KVTransferError otherwise.

Receiver side (decode): a KVReceiver writes arriving blocks through a `KVSink`, which the decode
service implements: it knows which blocks each request reserved, writes into its pool, and is told
when a request's transfer is complete.

Both sides check the KV layout (dtype, block size, layers, KV heads, head size) before any byte
moves, and refuse a mismatch with a message naming the differing fields.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from engine.engine import KVLayout
from engine.request import TokenLogprob


class KVTransferError(RuntimeError):
    pass


class LayoutMismatch(KVTransferError):
    pass


def check_layout(ours: KVLayout, theirs: KVLayout) -> None:
    if ours != theirs:
        a, b = asdict(ours), asdict(theirs)
        diff = ", ".join(f"{k}: ours {a[k]} vs theirs {b[k]}" for k in a if a[k] != b[k])
        raise LayoutMismatch(f"KV layout mismatch ({diff}); start both workers with the same "
                             "model, --dtype and --block-size")


@dataclass(frozen=True)
class TransferTarget:
    """Where a request's KV goes: reserved blocks on a decode worker."""

    transport: str
    address: str
    engine_id: str
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_cached_blocks: int = 0    # leading blocks the decode worker holds already: not sent

    @property
    def missing(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks:]


class KVSink(Protocol):
    """Implemented by the decode service; called by receivers on the decode worker's loop."""

    layout: KVLayout

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """Blocks reserved for the request, or None if it is not (or no longer) expected."""

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """data: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""

    async def complete(self, request_id: str, first_token: int,
                       first_logprob: TokenLogprob | None) -> None:
        """All blocks written; the request may start decoding."""


class KVSender(abc.ABC):
    name: str

    @abc.abstractmethod
    async def send(self, request_id: str, kv: torch.Tensor, src_blocks: list[int],
                   target: TransferTarget, first_token: int,
                   first_logprob: TokenLogprob | None) -> None: ...

    async def close(self) -> None:
        pass


class KVReceiver(abc.ABC):
    name: str

    @abc.abstractmethod
    def address(self) -> str:
        """Endpoint senders use to reach this receiver."""

    async def close(self) -> None:
        pass


# name -> "module:SenderClass:ReceiverClass"; modules are imported only when chosen.
_TRANSPORTS: dict[str, str] = {"grpc": "kvtransfer.grpc_transport:GrpcKVSender:GrpcKVReceiver"}


def register_transport(name: str, spec: str) -> None:
    """Register a transport as "module:SenderClass:ReceiverClass" (imported lazily)."""
    if spec.count(":") != 2:
        raise ValueError(f"transport spec must be 'module:Sender:Receiver', got {spec!r}")
    _TRANSPORTS[name] = spec


def transports() -> list[str]:
    return sorted(_TRANSPORTS)


def _load(name: str, which: int):
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {transports()}")
    module, *classes = _TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(module), classes[which])


def create_sender(name: str, layout: KVLayout, **kw) -> KVSender:
    return _load(name, 0)(layout=layout, **kw)


def create_receiver(name: str, sink: KVSink, **kw) -> KVReceiver:
    return _load(name, 1)(sink=sink, **kw)
