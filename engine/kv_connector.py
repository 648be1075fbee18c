"""The KV connector, scheduler side: the bookkeeping of every block reference a KV transfer holds.

Engine thread only (the AsyncEngine runs transports' requests as engine commands), except the
reads marked "any thread". The worker side (kvtransfer.connector) moves the bytes: it writes
received blocks into the pool and checks them, on the engine thread, when this side says the
blocks are still the request's.

Decode role (loads: KV that another worker computes and this one receives)::

    reserve_remote -> start_load(req): the request's blocks after its cached prefix are expected
    a transport's piece -> is_loading(rid, ids): write them (worker side) only while true
    every block in -> end_load(rid, sender_stopped=True), then the request joins the batch
    abort, timeout (expire), Decode stream gone -> end_load(rid, sender_stopped=False):
        a one-sided sender (NIXL WRITEs) may still be writing into the blocks: they stay out of
        use, one reference each (quarantine), until sender_done(rid) or the lease runs out

Prefill role (saves: KV this worker computes and sends)::

    after each step -> blocks_final(req): blocks whose KV became final, one reference each,
        recorded under the request (the transport may read them until the send is done)
    prefill finished -> hold(req): the request's table stays too (delay-free)
    the send ended (sent, failed, cancelled) -> save_done(rid): every reference goes back

The connector decides; it changes no reference itself. Each call that gives a transfer blocks or
takes them back returns a `RefChange` (engine.kv_cache_manager), which the scheduler hands to
the KV cache manager, the one owner of references and tables. A request's table belongs to the
manager; the matched prefix blocks of a reservation are the prefix cache's, shared, and never
written by a transfer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.kv_cache_manager import RefChange
from engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class Load:
    """One reservation's blocks still to arrive."""

    request_id: str
    blocks: list[int]
    started: float
    deadline: float
    failed: str | None = None           # a write into the pool failed: the KV is unusable
    sender_stopped: bool = False        # a one-sided sender said it writes no more


@dataclass
class _Quarantine:
    blocks: list[int]
    until: float


@dataclass
class _Save:
    blocks: list[int] = field(default_factory=list)      # one reference each
    request: Request | None = None                       # held: the table stays until done


class KVConnector:
    """`role`: "prefill" (saves) or "decode" (loads). The load policy (`configure`, which the
    decode service calls before its first request): `one_sided` (its receiver's senders write
    into the pool themselves), `load_timeout_s` (a load not complete by then is ended by
    `expire`) and `lease_s` (how long quarantined blocks wait for their sender's word)."""

    def __init__(self, role: str, block_size: int,
                 clock: Callable[[], float] = time.monotonic, one_sided: bool = False,
                 load_timeout_s: float = 300.0, lease_s: float = 60.0) -> None:
        self.role = role
        self.block_size = block_size
        self.clock = clock
        self.configure(one_sided, load_timeout_s, lease_s)
        self.loads: dict[str, Load] = {}
        self._quarantine: dict[str, _Quarantine] = {}
        self._saves: dict[str, _Save] = {}

    def configure(self, one_sided: bool, load_timeout_s: float, lease_s: float) -> None:
        """The decode role's load policy (see the class docstring); before the first load."""
        self.one_sided = one_sided
        self.load_timeout_s = load_timeout_s
        self.lease_s = lease_s

    # ------------------------------------------------------------------ decode: loads
    def start_load(self, req: Request, blocks: list[int]) -> Load:
        """The request's `blocks` (those after its cached prefix) are to arrive."""
        now = self.clock()
        load = Load(req.request_id, list(blocks), now, now + self.load_timeout_s)
        self.loads[req.request_id] = load
        return load

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """Any thread (a dict read): the blocks a sender may write for the request, or None.
        A stale answer is safe: writes are checked again on the engine thread (is_loading)."""
        load = self.loads.get(request_id)
        return None if load is None else load.blocks

    def expecting(self) -> bool:
        """Any thread: whether a load or a quarantine is open (receivers poll faster then)."""
        return bool(self.loads or self._quarantine)

    def is_loading(self, request_id: str, block_ids: list[int]) -> bool:
        """Whether these blocks may be written now: they are still this request's, expected."""
        load = self.loads.get(request_id)
        return load is not None and set(block_ids) <= set(load.blocks)

    def load(self, request_id: str) -> Load | None:
        """The request's open load, or None."""
        return self.loads.get(request_id)

    def fail_load(self, request_id: str, why: str) -> None:
        """A write of the request's KV into the pool failed: its KV is unusable."""
        load = self.loads.get(request_id)
        if load is not None:
            load.failed = why

    def end_load(self, request_id: str, sender_stopped: bool
                 ) -> tuple[Load | None, RefChange]:
        """End the request's load. Unless the sender is known to have stopped writing, a
        one-sided sender's blocks are kept aside (the change holds a reference each) until
        sender_done."""
        load = self.loads.pop(request_id, None)
        change = RefChange()
        if load is not None and self.one_sided and not (sender_stopped or load.sender_stopped) \
                and load.blocks:
            change.hold = list(load.blocks)
            until = self.clock() + self.lease_s
            q = self._quarantine.setdefault(request_id, _Quarantine([], until))
            q.blocks += load.blocks           # (an id reserved again: both sets stay aside)
            q.until = until
        return load, change

    def is_quarantined(self, request_id: str) -> bool:
        return request_id in self._quarantine

    def sender_done(self, request_id: str) -> RefChange:
        """A one-sided sender has stopped writing the request's blocks (its completion or abort
        notice): blocks kept aside go back."""
        load = self.loads.get(request_id)
        if load is not None:                  # still open: ending it later keeps none aside
            load.sender_stopped = True
        q = self._quarantine.pop(request_id, None)
        return RefChange(release=q.blocks) if q is not None else RefChange()

    def expire(self) -> tuple[list[str], RefChange]:
        """Loads past their deadline are ended (their blocks kept aside as end_load says);
        quarantines past their lease give their blocks back. -> the ended loads' request ids,
        and the change."""
        now = self.clock()
        late = [rid for rid, load in self.loads.items() if load.deadline < now]
        change = RefChange()
        for rid in late:
            change += self.end_load(rid, sender_stopped=False)[1]
        for rid in [r for r, q in self._quarantine.items() if q.until < now]:
            q = self._quarantine.pop(rid)
            log.warning("request %s: %d KV blocks kept aside after an abort are reused now (no "
                        "word from the sender within %g s)", rid, len(q.blocks), self.lease_s)
            change.release += q.blocks
        return late, change

    # ------------------------------------------------------------------ prefill: saves
    def blocks_final(self, req: Request, ready: list[int], upto: int) -> RefChange:
        """The request's blocks whose KV became final since the last call (`ready`: those of
        block indices num_blocks_streamed .. upto - 1 a transfer moves, in transfer order):
        the change's `hold`, a reference each until save_done. Streaming survives preemption:
        block indices already handed out are not handed out again."""
        req.num_blocks_streamed = max(req.num_blocks_streamed, upto)
        if ready:
            self._saves.setdefault(req.request_id, _Save()).blocks.extend(ready)
        return RefChange(hold=ready)

    def hold(self, req: Request) -> None:
        """A finished prefill: its table stays until save_done (or an abort) too."""
        self._saves.setdefault(req.request_id, _Save()).request = req

    def is_held(self, request_id: str) -> bool:
        save = self._saves.get(request_id)
        return save is not None and save.request is not None

    def unhold(self, request_id: str) -> RefChange | None:
        """An aborted prefill: its table goes (the references of blocks handed out stay until
        save_done: a transport may still be reading them). None when it was not held."""
        save = self._saves.get(request_id)
        if save is None or save.request is None:
            return None
        save.request = None
        if not save.blocks:
            del self._saves[request_id]
        return RefChange(free_tables=[request_id])

    def save_done(self, request_id: str) -> RefChange:
        """The request's send has ended (every block sent, or given up): its references and
        its held table go back."""
        save = self._saves.pop(request_id, None)
        if save is None:
            return RefChange()
        return RefChange(free_tables=[request_id] if save.request is not None else [],
                         release=save.blocks)

    # ------------------------------------------------------------------ accounting
    def references(self) -> dict[str, int]:
        """Block references held for transfers now, by kind (tests, metrics). Any thread: it
        reads snapshots (list() of a dict is one step under the GIL)."""
        saves = list(self._saves.values())
        return {"saving": sum(len(s.blocks) for s in saves),
                "held": sum(1 for s in saves if s.request is not None),
                "quarantined": sum(len(q.blocks) for q in list(self._quarantine.values())),
                "loading": len(self.loads)}
