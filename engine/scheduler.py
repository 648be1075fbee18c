"""The scheduler: one catch-up rule for prefill and decode.

Each step, every scheduled request advances num_computed_tokens toward num_tokens within the
step's token budget. A prompt longer than the budget is split across steps (chunked prefill); a
decoding request needs one token per step. When a step brings a request level with its tokens,
that step's logits sample its next token.

Order: running requests first (oldest first), then waiting ones (FIFO) while budget, sequence
slots and blocks last. A waiting request with nothing computed starts from its longest cached
prefix (engine.block_pool): those tokens count as computed. When a running request cannot get a block, the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed;
before that, waiting requests that hold blocks (forked choices, received prompts that found the
batch full) give theirs up, newest first, and are recomputed when their turn comes.

n > 1: a request's choices 1..n-1 are forked from it when its first token is out (its prompt
is computed, here or by a prefill worker). Each shares the prompt's blocks up to the one holding
the last prompt token, gets a copy of that block (KVCacheManager.take_copies, done by the engine
before the next step) and recomputes the last prompt token with its own seed: a one-token step, then
it decodes like any other request. Without a free block a choice computes its prompt itself
(prefix cache hits still count).

Beam search (engine.beam_search): a request's beams are sequences of the batch. Each records
its row's candidates and waits (nothing to compute) until every beam of its group has; then the
group's step forks the beams chosen more than once (full blocks shared, the partial one copied)
and ends those chosen by none. A waiting beam that cannot get blocks may preempt a younger
search's waiting beams (to the back of the queue), so searches that do not fit together take
turns instead of waiting for each other.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from engine.beam_search import BeamGroup
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector, Load
from engine.request import Request, RequestOutput, Status, TokenLogprob, choice_seed


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int     # including num_spec proposals
    sample: bool            # this step reaches the end of the request's tokens
    num_spec: int = 0       # speculative tokens (request.spec_token_ids) verified this step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager, eos_token_ids: tuple[int, ...],
                 max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 long_rope_after: int = 0) -> None:
        """`clock`: the KV connector's, for its load deadlines and leases. `long_rope_after`:
        a LongRoPE model's original context (engine.layers.rotary): a sequence longer than it
        takes the long factors at every position, so one that grows past it is computed again
        (HF's rule), and a step's proposals never carry it past it."""
        self.long_rope_after = long_rope_after
        self.cfg = cfg
        self.kv = kv
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}     # decode: waiting for KV from a prefill worker
        # which blocks KV transfers hold (loads, saves, held tables, quarantine); the references
        # themselves are the KV cache manager's, which applies the connector's decisions
        self.connector = KVConnector(cfg.role, kv.block_size, clock)
        self._arrivals = 0

    # ------------------------------------------------------------------ admission
    def add(self, req: Request) -> None:
        if self.cfg.role == "prefill":
            req.kv_tokens = req.num_tokens          # what the decode worker receives the KV of
        req.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        req.status = Status.WAITING
        self.waiting.append(req)

    def reserve_remote(self, req: Request) -> list[int] | None:
        """Decode role: allocate blocks for the prompt (and the output tokens of a resumed
        request), whose KV another worker will write. Blocks of the prefix cached here are
        reused: only the blocks after the first `req.num_cached_blocks` need to arrive. Sliding
        KV groups get only the blocks the window of the first decode reads. Returns the
        blocks a sender writes, in transfer order (KVCacheManager.transfer_entries; the first
        `req.kv_cached_entries` of them are the cached prefix's, not sent), or None when the
        pool cannot hold the tokens now, or while the prefix is being restored from the
        offload tiers (ask again)."""
        hits = self.kv.cached_prefix(req, req.num_tokens)
        if hits is None:                  # its prefix is being restored from the offload tiers
            return None
        n = req.num_tokens
        if self.kv.allocate_slots(req.request_id, n, prefix=hits, start=n - 1) is None:
            return None
        self._note_hits(req, len(hits))
        req.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        req.status = Status.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        entries = self.kv.transfer_entries(req.request_id, 0, self.kv.blocks_needed(n), n)
        req.kv_cached_entries = self.kv.transfer_count(0, len(hits), n)
        self.connector.start_load(req, entries[req.kv_cached_entries:])
        return entries

    def remote_ready(self, request_id: str, first_token: int,
                     logprob: TokenLogprob | None) -> RequestOutput | None:
        """The prompt's KV has arrived with the first token: the request joins the batch, or the
        queue (keeping its blocks) when the batch already has max_num_seqs sequences."""
        req = self.remote.pop(request_id, None)
        if req is None:
            return None                          # aborted meanwhile
        self.end_load(request_id, sender_stopped=True)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_computed_blocks(req)
        if req.params.beam_width:                 # the prefill's candidates start the search
            self._admit(req)
            outs = self._beam_step(req, logprob)
            return outs[0] if outs else None
        if not req.append_token(first_token, logprob):
            out = self._reject(req, first_token)
        else:
            self._fork(req)
            out = self._check_finish(req, [first_token], [logprob] if logprob else [])
        if req.finished:
            self.kv.free(req.request_id)
        else:
            self._admit(req)
        return out

    def _admit(self, req: Request) -> None:
        """A request holding its blocks joins the batch, or the queue when it is full (or its
        LoRA adapter would be one too many)."""
        if len(self.running) < self.cfg.max_num_seqs and self._lora_fits(req):
            req.status = Status.RUNNING
            self.running.append(req)
        else:
            req.status = Status.WAITING
            self.waiting.append(req)

    def compute_locally(self, request_id: str) -> bool:
        """Decode role: the KV of a reserved request will not arrive; compute the prompt here,
        beyond the prefix this worker had cached, in the blocks reserved. Unless a one-sided
        sender may still write into them (the connector keeps them aside): then it starts
        afresh in new blocks (its cached prefix found again)."""
        req = self.remote.pop(request_id, None)
        if req is None:
            return False
        self.end_load(request_id, sender_stopped=False)
        if self.connector.is_quarantined(request_id) or self.kv.groups.sliding:
            # (a sliding group's reservation lacks the blocks the prompt's own windows read)
            self.kv.free(request_id)
            req.num_computed_tokens = req.num_cached_blocks = req.num_cached_tokens = 0
        else:
            req.num_computed_tokens = req.num_cached_tokens
        req.status = Status.WAITING
        self.waiting.append(req)
        return True

    def abort(self, request_id: str, group: bool = True) -> bool:
        """Abort a request, with (group) the choices forked from it."""
        found = False
        if self.remote.pop(request_id, None) is not None:
            self.end_load(request_id, sender_stopped=False)
            found = True
        unheld = self.connector.unhold(request_id)
        if unheld is not None:
            self.kv.apply(unheld)
            found = True

        def hit(r: Request) -> bool:
            return r.request_id == request_id or (group and r.group == request_id)

        gone = [r for r in list(self.waiting) + self.running if hit(r)]
        for req in gone:
            found = True
            req.status, req.finish_reason = Status.FINISHED, "abort"
            self.kv.free(req.request_id)
        if gone:
            self.waiting = deque(r for r in self.waiting if not hit(r))
            self.running = [r for r in self.running if not hit(r)]
        self.kv.free(request_id)
        return found

    def _fork(self, parent: Request) -> None:
        """Choices 1..n-1 of a request whose first token just came out (see the module
        docstring)."""
        n = parent.params.n
        if n <= 1 or parent.forked or parent.group or parent.params.beam_width:
            return                        # (a beam search's width forks as its beams go)
        parent.forked = True
        bs = self.kv.block_size
        shared = (parent.num_prompt_tokens - 1) // bs
        for i in range(1, n):
            p = replace(parent.params, seed=choice_seed(parent.params.seed, i), n=1,
                        prompt_logprobs=None)          # the parent's are every choice's
            child = Request(f"{parent.request_id}#{i}", parent.prompt_token_ids, p,
                            cache_salt=parent.cache_salt, choice=i, group=parent.request_id)
            child.long_rope, child.lora = parent.long_rope, parent.lora
            if parent.structured_state is not None:          # a fresh grammar state
                child.structured_state = parent.structured_state.grammar.matcher()
            if self.kv.fork(parent.request_id, child.request_id, shared) is not None:
                child.num_computed_tokens = parent.num_prompt_tokens - 1
                child.block_hashes = parent.block_hashes[:shared]
                child.num_cached_blocks = min(parent.num_cached_blocks, shared)
            self.add(child)

    # ------------------------------------------------------------------ KV transfers
    # The connector decides which blocks a transfer holds; the KV cache manager applies it.
    def save_done(self, request_id: str) -> None:
        """Prefill role: the request's KV transfer has ended (sent or given up): the blocks it
        held for it go back (engine.kv_connector)."""
        self.kv.apply(self.connector.save_done(request_id))

    def end_load(self, request_id: str, sender_stopped: bool) -> Load | None:
        """Decode role: end the request's load (engine.kv_connector.end_load): a one-sided
        sender's blocks may be kept aside."""
        load, change = self.connector.end_load(request_id, sender_stopped)
        self.kv.apply(change)
        return load

    def sender_done(self, request_id: str) -> None:
        """Decode role: a one-sided sender stopped writing the request's blocks."""
        self.kv.apply(self.connector.sender_done(request_id))

    def expire_loads(self) -> list[str]:
        """Decode role: end the loads past their deadline, give back quarantines past their
        lease; -> the ended loads' request ids."""
        late, change = self.connector.expire()
        self.kv.apply(change)
        return late

    # ------------------------------------------------------------------ scheduling
    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self.kv.restores_in_flight()

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and their token counts; allocate their blocks.

        Decoding requests (one token to go) come first, then prompt chunks, oldest first. A prompt
        whose rest fits the budget left is taken whole, so it samples this step; one that cannot
        finish this step takes at most `long_prefill_tokens` while requests wait, so a short
        prompt queued behind a long one joins within a step instead of after the whole long one.
        """
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        cap = self.cfg.long_prefill_cap if self.waiting else budget
        budget = self._schedule_running(out, budget, cap)
        if not out.preempted:                 # nothing joins a step that had to preempt
            self._schedule_waiting(out, budget, cap)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        """Running requests into `out`, decodes first, preempting the newest when blocks run
        out; -> the budget left."""
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue                          # preempted earlier in this step
            if req.num_tokens == req.num_computed_tokens:
                continue                          # a beam waiting for its group's choice
            if self._long_rope(req):             # grew past LongRoPE's original context
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
            spec = req.spec_token_ids
            if spec and self.long_rope_after and not req.long_rope:   # not past it this step
                del spec[max(self.long_rope_after - req.num_tokens, 0):]
            if spec:        # a decode with proposals: its token and what fits of them
                del spec[max(budget - 1, 0):]
                n = 1 + len(spec)
            else:
                n = _chunk(req.num_tokens - req.num_computed_tokens, budget, cap)
            while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n,
                                         start=req.num_computed_tokens) is None:
                if spec:                            # drop the proposals before preempting
                    spec.clear()
                    n = 1
                    continue
                if self._release_waiting(keep=None) or self._release_idle_beam(keep=req):
                    continue                        # idle holders give way first
                victim = self.running[-1]           # the newest request gives way
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                for j, s in enumerate(out.scheduled):   # already placed in this step: undo
                    if s.request is victim:
                        budget += out.scheduled.pop(j).num_new_tokens
                        break
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue                          # req preempted itself: nothing fits for it
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, cap: int) -> None:
        """Waiting requests into `out`, FIFO, from their cached prefix, while budget, sequence
        slots and blocks last. One whose prefix is being restored from the offload tiers is
        passed over until the restore is done: the requests behind it go first."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[i]
            if not self._lora_fits(req):          # its adapter would be one too many
                i += 1
                continue
            if req.num_computed_tokens == 0 and self._long_rope(req):
                self.kv.free(req.request_id)      # (blocks a fork shared: its KV was short)
            hits = []
            if req.num_computed_tokens == 0 and not self.kv.block_table(req.request_id) \
                    and req.params.prompt_logprobs is None:   # those need every prompt row
                # at least one token is computed, so the step has logits to sample from
                hits = self.kv.cached_prefix(req, req.num_tokens - 1)
                if hits is None:
                    i += 1
                    continue
            computed = req.num_computed_tokens + len(hits) * self.kv.block_size
            n = _chunk(req.num_tokens - computed, budget, cap if len(self.waiting) > 1 else budget)
            if self.kv.allocate_slots(req.request_id, computed + n, prefix=hits,
                                      start=computed) is None:
                if self._release_waiting(keep=req) or self._release_idle_beam(keep=req):
                    continue                         # try the head again
                if req.beam_group is not None:       # an older search's beam may get room
                    i += 1
                    continue
                break
            if req.num_computed_tokens == 0:
                self._note_hits(req, len(hits))
            req.num_computed_tokens = computed
            del self.waiting[i]
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n

    @staticmethod
    def _scheduled(req: Request, n: int) -> ScheduledRequest:
        k = len(req.spec_token_ids)
        return ScheduledRequest(req, n, req.num_computed_tokens + n - k == req.num_tokens, k)

    def _note_hits(self, req: Request, num_blocks: int) -> None:
        """Admission of a request with nothing computed: its cached prefix is `num_blocks`."""
        req.num_cached_blocks = num_blocks
        req.num_cached_tokens = num_blocks * self.kv.block_size
        self.kv.count_query(req.num_tokens, req.num_cached_tokens)

    def _release_waiting(self, keep: Request | None) -> bool:
        """Free the blocks of the newest waiting request (but `keep`) that holds some (a forked
        choice, a received prompt that found the batch full): it computes them again when its
        turn comes. Holding blocks while waiting must never stop the requests ahead of it.
        False when no waiting request holds any."""
        for req in reversed(self.waiting):
            if req is not keep and self.kv.block_table(req.request_id):
                self.kv.free(req.request_id)
                req.num_computed_tokens = req.num_cached_blocks = 0
                req.num_preemptions += 1
                return True
        return False

    def _release_idle_beam(self, keep: Request) -> bool:
        """Preempt the beams of the newest beam search younger than `keep` (by arrival) that
        wait for their group's choice (nothing to compute): they go to the back of the queue,
        and recompute from the prefix cache when their turn comes. Without this, beams holding
        blocks while their group waits for one that cannot get any would wait for each other
        for ever. False when there are none."""
        idle = [r for r in self.running if r.beam_group is not None
                and r.beam_group is not keep.beam_group and r.arrival > keep.arrival
                and r.num_tokens == r.num_computed_tokens]
        if not idle:
            return False
        newest = max(r.arrival for r in idle)
        for req in idle:
            if req.arrival == newest:
                self._preempt(req, front=False)
        return True

    def _lora_fits(self, req: Request) -> bool:
        """Whether the running requests' adapters, with req's, are at most --max-loras."""
        if req.lora is None:
            return True
        used = {r.lora.digest for r in self.running if r.lora is not None}
        return req.lora.digest in used or len(used) < self.cfg.max_loras

    def _long_rope(self, req: Request) -> bool:
        """LongRoPE: whether the request just became longer than the original context (its
        factors turn long: whatever it computed goes, its prefix-cache keys change)."""
        if not self.long_rope_after or req.long_rope or req.num_tokens <= self.long_rope_after:
            return False
        req.long_rope = True
        req.spec_token_ids.clear()
        req.block_hashes, req.num_cached_blocks = [], 0
        return True

    def _preempt(self, req: Request, front: bool = True) -> None:
        req.spec_token_ids.clear()
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = req.num_cached_blocks = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    # ------------------------------------------------------------------ after the forward pass
    def update(self, sched: SchedulerOutput, tokens: list[list[int] | int],
               logprobs: list[list[TokenLogprob | None] | TokenLogprob | None]
               ) -> list[RequestOutput]:
        """Advance the scheduled requests. `tokens` has an entry per request with sample=True:
        the token sampled after its last position (an int, or a list of one), or, for a request
        that verified proposals, the accepted ones followed by the target's own
        (engine.spec.verify); `logprobs` matches it."""
        outputs = []
        it = iter(zip(tokens, logprobs))
        for s in sched.scheduled:
            req = s.request
            if not s.sample:
                req.num_computed_tokens += s.num_new_tokens
                self.kv.cache_computed_blocks(req)
                if self.cfg.role == "prefill":
                    ready = self._blocks_final(req, final=False)
                    if ready:
                        outputs.append(RequestOutput(req.request_id, [], [], kv_blocks=ready))
                continue
            toks, lps = next(it)
            if isinstance(toks, int):
                toks, lps = [toks], [lps]
            if req.params.beam_width and self.cfg.role == "decode":
                req.num_computed_tokens += s.num_new_tokens
                self.kv.cache_computed_blocks(req)
                outputs.extend(self._beam_step(req, lps[0]))
                continue
            first = not req.output_token_ids
            out = self._append(req, toks, lps)
            if first and req.prompt_logprobs is not None:
                out.prompt_logprobs = req.prompt_logprobs
            if first and self.cfg.role == "decode":
                self._fork(req)
            # KV is valid for the request's token and the accepted proposals only (those kept:
            # tokens after a stop are dropped); the slots of rejected ones are written again
            # when their real tokens are computed
            req.num_computed_tokens = min(
                req.num_computed_tokens + s.num_new_tokens - s.num_spec + len(toks) - 1,
                req.num_tokens)
            req.spec_token_ids = []
            self.kv.cache_computed_blocks(req)
            if req.finished:
                self.running.remove(req)
                if self.cfg.role == "prefill":
                    self.connector.hold(req)          # the table stays until save_done
                    out.kv_blocks = self._blocks_final(req, final=True)
                else:
                    self.kv.free(req.request_id)
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ beam search
    def _beam_step(self, beam: Request, logprob: TokenLogprob | None) -> list[RequestOutput]:
        """A beam's candidates this step (its row's top logprobs); once its group has them all,
        the group's step (engine.beam_search): beams forked and ended, and when the search is
        done every beam's blocks freed and the request's choices out, best first."""
        group: BeamGroup | None = beam.beam_group
        if group is None:                       # the request itself, its first candidates
            p = beam.params
            group = beam.beam_group = BeamGroup(
                p.beam_width, p.length_penalty, p.early_stopping,
                frozenset() if p.ignore_eos else self.eos,
                min(p.max_tokens, self.max_model_len - beam.num_prompt_tokens))
            group.start(beam.request_id, beam.output_token_ids)
            group.members = {beam.request_id: beam}
            group.prompt_logprobs = beam.prompt_logprobs
        if logprob is None:                     # a bug: a beam's row reports its candidates
            self.abort(beam.group or beam.request_id)
            return [RequestOutput(beam.group or beam.request_id, [], [], "error",
                                  error="beam search: a beam's step came without candidates")]
        if beam.num_computed_tokens < beam.num_tokens:
            return []     # recomputed after a preemption, chosen meanwhile: its row is stale
        if not group.observe(beam.request_id, logprob.top):
            return []
        members: dict[str, Request] = group.members
        chosen = group.select()
        children: dict[str, list] = {}
        for c in chosen:
            children.setdefault(c.parent, []).append(c)
        kept: dict[str, Request] = {}
        for bid, req in members.items():
            conts = children.get(bid)
            if not conts:
                self._end_beam(req)
                continue
            before = list(req.output_token_ids)
            for c in conts[1:]:
                child = self._fork_beam(req, group)
                child.output_token_ids = before + [c.token]
                group.adopt(child.request_id, c, before)
                kept[child.request_id] = child
            req.append_token(conts[0].token, None)
            group.adopt(bid, conts[0], before)
            kept[bid] = req
        group.members = kept
        if not group.done:
            return []
        root = beam.group or beam.request_id
        results = group.results()
        if len(results) != group.width:
            raise RuntimeError(f"beam search of {root} ended with {len(results)} of "
                               f"{group.width} beams")
        outs = [RequestOutput(root, h.token_ids, [], h.finish_reason, choice=i)
                for i, h in enumerate(results)]
        outs[0].prompt_logprobs = group.prompt_logprobs
        return outs

    def _fork_beam(self, parent: Request, group: BeamGroup) -> Request:
        """A new beam of `parent`'s tokens, sharing its full blocks and a copy of its partial
        one (or, with no block free, computing them itself: its prefix cache hits count)."""
        root = parent.group or parent.request_id
        group.forks += 1
        child = Request(f"{root}#beam{group.forks}", parent.prompt_token_ids,
                        replace(parent.params, prompt_logprobs=None),
                        cache_salt=parent.cache_salt, group=root)
        child.beam_group = group
        child.long_rope, child.lora = parent.long_rope, parent.lora
        bs = self.kv.block_size
        computed = parent.num_computed_tokens
        shared = computed // bs
        if computed == 0:                         # a preempted parent: nothing to share
            forked = False
        elif computed % bs == 0:
            self.kv.share(parent.request_id, child.request_id, shared)
            forked = True
        else:
            forked = self.kv.fork(parent.request_id, child.request_id, shared) is not None
        if forked:
            child.num_computed_tokens = computed
            child.block_hashes = parent.block_hashes[:shared]
            child.num_cached_blocks = min(parent.num_cached_blocks, shared)
        child.arrival = parent.arrival
        if forked and len(self.running) < self.cfg.max_num_seqs:
            child.status = Status.RUNNING
            self.running.append(child)
        else:
            child.status = Status.WAITING
            self.waiting.appendleft(child)       # the group waits for it: it goes next
        return child

    def _end_beam(self, req: Request) -> None:
        """A beam no candidate continues (or the search's end): its blocks go back."""
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)

    def _blocks_final(self, req: Request, final: bool) -> list[int]:
        """Prefill role: the blocks handed to the request's send now, a reference each."""
        blocks = len(self.kv.block_table(req.request_id))
        n = blocks if final else min(req.num_computed_tokens // self.kv.block_size, blocks)
        lo = req.num_blocks_streamed
        ready = self.kv.transfer_entries(req.request_id, lo, n, req.kv_tokens) if n > lo else []
        change = self.connector.blocks_final(req, ready, n)
        self.kv.apply(change)
        return change.hold

    def _append(self, req: Request, toks: list[int], lps: list) -> RequestOutput:
        """Append tokens until one finishes the request (EOS, max_tokens, model length); the
        rest (later accepted proposals) are dropped."""
        kept, kept_lps = [], []
        for tok, lp in zip(toks, lps):
            if not req.append_token(tok, lp):
                return self._reject(req, tok)
            kept.append(tok)
            if lp is not None:
                kept_lps.append(lp)
            out = self._check_finish(req, kept, kept_lps)
            if out.finished:
                return out
        return out

    @staticmethod
    def _reject(req: Request, token: int) -> RequestOutput:
        """The grammar refused a token the sampler chose (a bug: its mask allowed it): end the
        request with an error rather than let its structure drift."""
        req.status, req.finish_reason = Status.FINISHED, "error"
        return RequestOutput(req.request_id, [], [], "error",
                             error=f"request {req.request_id}: token {token} is not allowed by "
                                   "its output's grammar; the structured output is abandoned",
                             choice=req.choice, group=req.group)

    def _check_finish(self, req: Request, toks: list[int], lps: list) -> RequestOutput:
        reason = None
        if self.cfg.role == "prefill":
            reason = "prefilled"
        elif (not req.params.ignore_eos and toks[-1] in self.eos) \
                or toks[-1] in req.params.stop_token_ids \
                or (req.structured_state is not None and req.structured_state.terminated):
            reason = "stop"
        elif len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            req.status, req.finish_reason = Status.FINISHED, reason
        return RequestOutput(req.request_id, toks, lps, reason, choice=req.choice,
                             group=req.group)


def _chunk(left: int, budget: int, cap: int) -> int:
    """A prompt's tokens this step: all `left` when they fit the budget (it samples now), else a
    chunk of at most `cap` (a long prompt leaves room for those behind it)."""
    return left if left <= budget else min(budget, cap)
