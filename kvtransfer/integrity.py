"""KV integrity: block checksums, and the rules a receiver applies before a request may run.

Checksums: engine.kv_checksum (`block_checksums`, `checksums`), shared with the KV offload tiers.

Receiving (`Intake`). Nothing a receiver gets is trusted. Per request, against the sink's
reservation: every block id must be one the request reserved, none may arrive twice, a piece's
data must be exactly len(block_ids) blocks of the layout, checksums (when required) must come
with every block; the completion is accepted only once every reserved block has arrived, with a
first token inside the vocabulary, and (checksums on) the pool's blocks, checksummed after they
were written, equal what the sender computed. A broken rule raises `Refused` before anything is
written; the receiver then rejects the request through the sink, which fails it or computes its
prompt on the decode worker. Both sides must agree: a receiver that requires checksums refuses a
sender that sends none; one that does not (--kv-checksum off) ignores those it is sent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.kv_checksum import block_checksums, checksums, gathered_checksums
from kvtransfer.base import KVSink, KVTransferError, block_bytes, poll_until

__all__ = ["Intake", "Refused", "block_checksums", "checksums", "gathered_checksums",
           "host_values"]


async def host_values(sums: torch.Tensor, timeout_s: float, stream=None) -> list[int]:
    """A device tensor of checksums on the host without blocking the event loop: on CUDA a
    copy into page-locked memory on `stream` (default: the current one, where they were
    computed) and an event polled for; elsewhere at once."""
    if sums.device.type != "cuda":
        return sums.tolist()
    stream = stream or torch.cuda.current_stream(sums.device)
    host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(sums, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    await poll_until(copied.query, timeout_s, lambda: "KV checksums were not computed")
    return host.tolist()


class Refused(KVTransferError):
    """A transfer broke a rule. kind: "unknown" (no reservation: nothing to fail), "invalid"
    (malformed, out of bounds, incomplete) or "checksum" (corrupted KV)."""

    def __init__(self, request_id: str, kind: str, message: str) -> None:
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id
        self.kind = kind


@dataclass
class _Transfer:
    reserved: list[int]        # the sink's own list: another object means a new reservation
    arrived: list[int] = field(default_factory=list)
    claimed: list[int] = field(default_factory=list)     # the sender's checksums of `arrived`


class Intake:
    """What one receiver has accepted of each request's transfer so far (see the module's
    docstring for the rules). Calls come from the receiver's event loop.

    checksums: require and verify them (--kv-checksum on)."""

    def __init__(self, sink: KVSink, checksums: bool = True) -> None:
        self.sink = sink
        self.checksums = checksums
        self.block_bytes = block_bytes(sink.layout)
        self._transfers: dict[str, _Transfer] = {}

    def _transfer(self, request_id: str) -> _Transfer:
        reserved = self.sink.reserved_blocks(request_id)
        if reserved is None:
            self._transfers.pop(request_id, None)
            raise Refused(request_id, "unknown", "no KV reservation here (aborted, finished, or "
                                                 "never reserved)")
        t = self._transfers.get(request_id)
        if t is None or t.reserved is not reserved:
            # a new transfer: forget those whose reservation has ended (timeouts, aborts)
            for rid in [r for r, old in self._transfers.items()
                        if self.sink.reserved_blocks(r) is not old.reserved]:
                del self._transfers[rid]
            t = self._transfers[request_id] = _Transfer(reserved)
        return t

    def admit(self, request_id: str, block_ids, nbytes: int | None, claimed) -> list[int]:
        """Check a piece of `block_ids` with `nbytes` of data (None: written one-sidedly, not
        seen) and the sender's checksums `claimed` of them; -> the ids, recorded as arrived.
        Raises Refused before anything is written."""
        t = self._transfer(request_id)
        ids = [int(b) for b in block_ids]
        claimed = [int(c) for c in claimed]
        reserved = set(t.reserved)
        foreign = [b for b in ids if b not in reserved]
        if foreign:
            self._refuse(request_id, "invalid", f"blocks {foreign[:8]} are not reserved for it")
        repeated = sorted({b for b, n in Counter(ids).items() if n > 1}
                          | (set(ids) & set(t.arrived)))
        if repeated:
            self._refuse(request_id, "invalid", f"blocks {repeated[:8]} written twice")
        if nbytes is not None and nbytes != len(ids) * self.block_bytes:
            self._refuse(request_id, "invalid",
                         f"{nbytes} bytes of KV for {len(ids)} blocks of {self.block_bytes}")
        if self.checksums and ids:
            if not claimed:
                self._refuse(request_id, "invalid",
                             "the sender sends no KV checksums and this decode worker requires "
                             "them: run every worker with --kv-checksum on (the default), or "
                             "every worker with --kv-checksum off")
            if len(claimed) != len(ids):
                self._refuse(request_id, "invalid",
                             f"{len(claimed)} checksums for {len(ids)} blocks")
        t.arrived += ids
        if self.checksums:
            t.claimed += claimed
        return ids

    async def complete(self, request_id: str, first_token: int, first_logprob) -> None:
        """Accept the completion, or raise Refused: every reserved block must have arrived and
        the first token must be in the vocabulary; then the sink checks the pool's blocks
        against the sender's checksums (checksums on) and lets the request run, or refuses.
        The transfer is forgotten either way."""
        t = self._transfer(request_id)
        missing = sorted(set(t.reserved) - set(t.arrived))
        if missing:
            self._refuse(request_id, "invalid",
                         f"the transfer completed with {len(missing)} of its "
                         f"{len(t.reserved)} KV blocks missing (e.g. {missing[:8]})")
        if not 0 <= first_token < self.sink.vocab_size:
            self._refuse(request_id, "invalid", f"first token {first_token} is outside the "
                                                f"vocabulary ({self.sink.vocab_size} tokens)")
        self._transfers.pop(request_id, None)
        refused = await self.sink.complete(request_id, first_token, first_logprob, t.arrived,
                                           t.claimed if self.checksums else None)
        if refused is not None:
            raise Refused(request_id, *refused)

    def _refuse(self, request_id: str, kind: str, message: str):
        self._transfers.pop(request_id, None)
        raise Refused(request_id, kind, message)

    async def reject(self, exc: Refused) -> None:
        """Hand a refused request to the sink (nothing to do for one it does not expect)."""
        if exc.kind != "unknown":
            await self.sink.reject(exc.request_id, str(exc), exc.kind)
