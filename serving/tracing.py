"""A worker's part of a request's trace and timing block, from what its engine recorded.

A worker traces a request when its tracing is on and the RPC's metadata carries a trace
context (the gateway's span), or times it when the request asks (return_timing); either way the
request gets an engine Timeline (engine.request.Timeline), and once the call has ended the
timeline becomes spans (`prefill_phase`, `decode_phase`, emitted with cluster.tracing's
Tracing.record) and a proto WorkerTiming (`worker_timing`). Nothing is built for a request that
is neither: no per-step work.

Phase names are the timing block's (docs/api.md#timing-and-tracing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.tracing import (GEN_AI_COMPLETION_TOKENS, GEN_AI_PROMPT_TOKENS, GEN_AI_REQUEST_ID,
                             GEN_AI_TIME_IN_QUEUE, GEN_AI_TTFT, Phase)
from engine.request import Request, Timeline
from proto import pdserve_pb2 as pb


def traced_call(tracing, context, want_timing: bool):
    """(parent context or None, whether the request needs a Timeline)."""
    parent = tracing.extract(context.invocation_metadata() or ()) if tracing.enabled else None
    return parent, parent is not None or want_timing


def start_timeline(req: Request) -> None:
    req.timeline = Timeline(arrived_ns=time.time_ns())


@dataclass
class Transfer:
    """What a prefill worker's KV transfer did for one request."""

    transport: str
    checksum: str                  # "on", "off", or "failed"
    blocks: int = 0
    bytes: int = 0
    first_block_ns: int = 0
    last_ns: int = 0               # the last KV message acknowledged
    error: str = ""
    extra: dict = field(default_factory=dict)


def _s(a_ns: int, b_ns: int) -> float:
    return max(b_ns - a_ns, 0) / 1e9 if a_ns and b_ns else 0.0


def prefill_phase(req: Request, transfer: Transfer, ended_ns: int, error: str = "") -> Phase:
    tl = req.timeline
    sched = tl.scheduled_ns or ended_ns
    first = tl.first_token_ns or ended_ns
    chunks = [("chunk", a, {"tokens": n, "seconds": (b - a) / 1e9}) for a, b, n in tl.chunks]
    kv_end = transfer.last_ns or ended_ns
    kv_start = transfer.first_block_ns or first
    secs = max(kv_end - kv_start, 0) / 1e9
    kv = Phase("kv.transfer", kv_start, kv_end, {
        "kv.transport": transfer.transport, "kv.blocks": transfer.blocks,
        "kv.bytes": transfer.bytes, "kv.checksum": transfer.checksum,
        "kv.gbps": round(transfer.bytes / secs / 1e9, 3) if secs > 0 else None,
        "kv.time_to_last_block_s": _s(first, kv_end)}, error=transfer.error)
    return Phase("prefill.request", tl.arrived_ns, ended_ns, {
        GEN_AI_REQUEST_ID: req.request_id, GEN_AI_PROMPT_TOKENS: req.num_prompt_tokens,
        "pdserve.cached_tokens": req.num_cached_tokens, "pdserve.chunks": len(tl.chunks),
        GEN_AI_TIME_IN_QUEUE: _s(tl.arrived_ns, sched)}, children=(
        Phase("prefill.queue", tl.arrived_ns, sched),
        Phase("prefill.compute", sched, first, {"pdserve.chunks": len(tl.chunks)},
              events=chunks),
        kv), error=error)


def decode_phase(req: Request, local: bool, ended_ns: int, error: str = "",
                 cancelled: bool = False) -> Phase:
    tl = req.timeline
    sched = tl.scheduled_ns or ended_ns
    first = tl.first_token_ns or ended_ns
    children = []
    if not local:
        reserved = tl.reserved_ns or ended_ns
        loaded = tl.loaded_ns or ended_ns
        children += [Phase("decode.reservation", tl.arrived_ns, reserved),
                     Phase("decode.kv_wait", reserved, loaded),
                     Phase("decode.admission", loaded, max(sched, loaded))]
    else:
        children += [Phase("decode.admission", tl.arrived_ns, sched)]
    children.append(Phase("decode.generate", first, tl.finished_ns or ended_ns, {
        GEN_AI_COMPLETION_TOKENS: tl.output_tokens, "pdserve.decode_steps": tl.decode_steps,
        "pdserve.spec_proposed": tl.spec_proposed, "pdserve.spec_accepted": tl.spec_accepted,
        "pdserve.preemptions": len(tl.preempted_ns)},
        events=[("preempted", t, {}) for t in tl.preempted_ns]))
    return Phase("decode.request", tl.arrived_ns, ended_ns, {
        GEN_AI_REQUEST_ID: req.request_id, GEN_AI_PROMPT_TOKENS: req.num_prompt_tokens,
        GEN_AI_COMPLETION_TOKENS: tl.output_tokens, GEN_AI_TTFT: _s(tl.arrived_ns, first),
        "pdserve.local_prefill": local, "pdserve.cancelled": cancelled,
        "pdserve.cached_tokens": req.num_cached_tokens}, children=tuple(children), error=error)


def prefill_timing(worker_id: str, req: Request, transfer: Transfer,
                   ended_ns: int) -> pb.WorkerTiming:
    tl = req.timeline
    sched = tl.scheduled_ns or ended_ns
    first = tl.first_token_ns or ended_ns
    return pb.WorkerTiming(worker_id=worker_id, role="prefill", seconds={
        "queue": _s(tl.arrived_ns, sched), "compute": _s(sched, first),
        "kv_transfer_tail": _s(first, transfer.last_ns or ended_ns),
        "total": _s(tl.arrived_ns, ended_ns)}, counts={
        "prompt_tokens": req.num_prompt_tokens, "cached_tokens": req.num_cached_tokens,
        "chunks": len(tl.chunks), "blocks_sent": transfer.blocks,
        "bytes_sent": transfer.bytes})


def decode_timing(worker_id: str, req: Request, local: bool, ended_ns: int) -> pb.WorkerTiming:
    tl = req.timeline
    sched = tl.scheduled_ns or ended_ns
    first = tl.first_token_ns or ended_ns
    seconds = {"first_token": _s(tl.arrived_ns, first),
               "decode": _s(first, tl.finished_ns or ended_ns),
               "total": _s(tl.arrived_ns, ended_ns)}
    if local:
        seconds["admission"] = _s(tl.arrived_ns, sched)
    else:
        reserved, loaded = tl.reserved_ns or ended_ns, tl.loaded_ns or ended_ns
        seconds.update(reservation=_s(tl.arrived_ns, reserved), kv_wait=_s(reserved, loaded),
                       admission=_s(loaded, max(sched, loaded)))
    return pb.WorkerTiming(worker_id=worker_id, role="decode", seconds=seconds, counts={
        "output_tokens": tl.output_tokens, "decode_steps": tl.decode_steps,
        "preemptions": len(tl.preempted_ns), "spec_proposed": tl.spec_proposed,
        "spec_accepted": tl.spec_accepted, "cached_tokens": req.num_cached_tokens,
        "local_prefill": int(local)})
