"""The engine: a model, its KV pool and a scheduler, advanced one step at a time.

Not thread-safe: one thread owns an Engine (see engine.async_engine for the threaded wrapper).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.batch_builder import BatchBuilder
from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig, parse_speculative
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import Load
from engine.kv_layout import KVLayout
from engine.kv_offload import KVOffload, OffloadSettings
from engine.request import MAX_CHOICES, Request, RequestOutput, Status, TokenLogprob
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec import DraftProposer, NgramProposer, Proposal, SpecController
from engine.tp_ranks import build_runner

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    spec_proposed: int = 0       # speculative tokens verified
    spec_accepted: int = 0       # of which accepted
    spec_seq_steps: int = 0      # (sequence, step) pairs that verified proposals
    prompt_tokens: int = 0       # prompt tokens computed
    generated_tokens: int = 0    # tokens sampled
    busy_s: float = 0.0          # wall time of the steps that ran a batch


@dataclass(frozen=True)
class StepStats:
    """What one engine step did."""

    num_seqs: int
    num_tokens: int
    num_prompt_tokens: int       # tokens of prompt chunks (prefill work) in the step
    num_generated: int           # tokens sampled in the step
    num_preempted: int
    duration_s: float
    num_spec_proposed: int = 0   # speculative tokens verified in the step
    num_spec_accepted: int = 0
    num_spec_seqs: int = 0       # sequences that verified proposals


class Engine:
    """Orchestration: requests in, outputs out. Owns the scheduler (and through it the KV cache
    manager and block pool), speculation, and a ModelRunner that does the device work."""

    def __init__(self, model_dir: str | Path | None, cfg: EngineConfig,
                 model_cfg: ModelConfig | None = None, model: torch.nn.Module | None = None,
                 draft_model: torch.nn.Module | None = None, random_weights: bool = False):
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.model_cfg = model_cfg or ModelConfig.from_dir(model_dir)
        if cfg.max_model_len == 0:
            cfg = replace(cfg, max_model_len=self.model_cfg.max_position_embeddings)
        self.device = torch.device(cfg.device)
        if (cfg.num_blocks == 0 and cfg.role == "decode"
                and parse_speculative(cfg.speculative)[0] == "draft"):
            raise ValueError("a draft model's KV pool is not budgeted when the pool is sized "
                             "from GPU memory: give --kv-cache-gib or --num-blocks with "
                             "--speculative draft:PATH")
        # tensor parallel: rank 0's runner, and ranks 1..N-1 (engine.tp_ranks)
        self.runner, self.ranks = build_runner(model_dir, self.model_cfg, cfg, model,
                                               random_weights)
        try:
            self._setup(replace(cfg, num_blocks=self.runner.num_blocks), draft_model)
        except BaseException:
            self.close()                  # tensor parallel: the other ranks stop too
            raise

    def _setup(self, cfg: EngineConfig, draft_model) -> None:
        self.cfg = cfg
        m = self.model_cfg
        groups = self.runner.groups
        self.layout = KVLayout(cfg.compute_dtype, cfg.block_size, groups.slots, m.num_kv_heads,
                               m.head_dim, cfg.tensor_parallel_size, groups.windows)
        self.pool = BlockPool(cfg.num_blocks)
        hasher = BlockHasher(cfg.block_size, cfg.hash_seed) if cfg.enable_prefix_caching else None
        self.kv_manager = KVCacheManager(self.pool, cfg.block_size, hasher, groups)
        if cfg.offload_enabled and groups.sliding:
            raise ValueError(f"the KV offload tiers (--kv-offload-gib, --kv-offload-disk-gib) "
                             f"do not serve models with sliding-window KV groups yet "
                             f"({m.family}: {groups.describe()})")
        self.offload = self._offload() if cfg.offload_enabled else None
        self.scheduler = Scheduler(cfg, self.kv_manager, m.eos_token_ids, cfg.max_model_len,
                                   long_rope_after=m.long_rope_after)
        self.stats = EngineStats()
        self.last_step: StepStats | None = None
        self.proposer, self.spec = self._speculation(draft_model)
        self._proposals: dict[str, Proposal] = {}    # this step's, by request id
        self.batch = BatchBuilder(self.kv_manager.group_tables, m.vocab_size,
                                  self.kv_manager.table_id)
        self._timed: dict[str, Request] = {}         # requests with a Timeline, until they end

    def _offload(self) -> KVOffload:
        """The KV offload tiers below the pool (engine.kv_offload), wired to the pool's
        evictions and the prefix cache's lookups."""
        cfg, lay, kv = self.cfg, self.layout, self.runner.pool
        shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        per_block = math.prod(shape) * kv.element_size()
        identity = {"role": cfg.role,         # one folder may serve both roles: apart
                    "model": self.model_dir.name if self.model_dir else "random",
                    "model_config": repr(self.model_cfg), "weights": cfg.dtype,
                    "quantization": cfg.quantization, "dtype": lay.dtype,
                    "block_size": lay.block_size, "num_layers": lay.num_layers,
                    "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
                    "hash_seed": str(cfg.hash_seed)}
        offload = KVOffload(OffloadSettings(
            host_blocks=int(cfg.kv_offload_gib * (1 << 30)) // per_block,
            disk_dir=cfg.kv_offload_dir,
            disk_blocks=int(cfg.kv_offload_disk_gib * (1 << 30)) // per_block,
            min_seen=cfg.kv_offload_min_seen, identity=identity),
            lambda: self.runner.pool, shape, kv.dtype, self.device)
        if not offload.tiers:
            raise ValueError(f"--kv-offload-gib / --kv-offload-disk-gib hold no block of "
                             f"{per_block} bytes")
        self.pool.on_evict = offload.store
        self.kv_manager.offload = offload
        return offload

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one); with a disk offload
        tier, write the host tier's and the pool's cached blocks to it (a restarted worker finds
        them); idempotent."""
        offload, self.offload = getattr(self, "offload", None), None
        if offload is not None:
            written = offload.flush(self.pool.cached_blocks())
            if written:
                log.info("KV offload: %d blocks written to the disk tier for the next start",
                         written)
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close(self.runner)

    def _speculation(self, draft_model):
        kind, path = parse_speculative(self.cfg.speculative)
        if kind == "off" or self.cfg.role == "prefill":
            return None, None
        if kind == "ngram":
            proposer = NgramProposer(self.cfg.spec_ngram_min, self.cfg.spec_ngram_max)
        else:       # the draft never holds more tokens than the target: as many blocks
            proposer = DraftProposer(path, self.model_cfg, self.cfg, self.cfg.num_blocks,
                                     model=draft_model)
        return proposer, SpecController(self.cfg.num_speculative_tokens,
                                        self.cfg.spec_disable_batch_size,
                                        max_step_growth=self.cfg.spec_max_step_growth)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def kv(self) -> torch.Tensor:
        """kv[layer, k_or_v, block, slot, kv_head, head_dim]; see engine.block_pool. Tensor
        parallel: the pool as rank 0's transports see it (engine.parallel.ShardedKV)."""
        return self.runner.pool

    # ------------------------------------------------------------------ requests
    def check_fits(self, req: Request) -> None:
        # prefill: the tokens it computes (a resumed request's output too) and the one it samples
        total = req.num_tokens + 1 if self.cfg.role == "prefill" \
            else req.num_prompt_tokens + req.params.max_tokens
        if total > self.cfg.max_model_len:
            raise ValueError(f"request {req.request_id}: {req.num_prompt_tokens} prompt tokens + "
                             f"{req.params.max_tokens} max_tokens exceed max_model_len "
                             f"{self.cfg.max_model_len}")
        need = self.kv_manager.blocks_needed(total)   # per choice: they may take turns
        if need > self.pool.num_blocks:
            raise ValueError(f"request {req.request_id} needs {need} KV blocks; the pool has "
                             f"{self.pool.num_blocks} (raise --kv-cache-gib or --num-blocks)")
        # all choices at their longest: the prompt's full blocks are shared, the rest is theirs
        # (without a share bound, choices that do not fit together take turns)
        shared = req.num_prompt_tokens // self.cfg.block_size
        whole = need + (req.params.n - 1) * (need - shared)
        if req.params.beam_width and whole > self.pool.num_blocks:
            raise ValueError(f"request {req.request_id}: a beam search of width "
                             f"{req.params.beam_width} may need {whole} KV blocks at once (its "
                             f"beams cannot take turns); the pool has {self.pool.num_blocks}: "
                             "lower max_tokens or n")
        cap = int(self.cfg.max_request_kv_share * self.pool.num_blocks)
        if self.cfg.max_request_kv_share < 1 and whole > cap:
            raise ValueError(f"request {req.request_id} may need {whole} KV blocks "
                             f"({req.num_prompt_tokens} prompt tokens, max_tokens "
                             f"{req.params.max_tokens}, n {req.params.n}); one request may use "
                             f"at most {cap} of this worker's {self.pool.num_blocks} "
                             f"(--max-request-kv-share {self.cfg.max_request_kv_share:g}): "
                             "lower max_tokens or n")
        self.check_token_ids(req)

    def check_token_ids(self, req: Request) -> None:
        """Every token id the request carries is in the model's vocabulary (a worker takes
        requests from the network: an id past the embedding table must not reach it)."""
        vocab = self.model_cfg.vocab_size
        p = req.params
        for what, ids in (("prompt", req.prompt_token_ids), ("output", req.output_token_ids),
                          ("stop_token_ids", p.stop_token_ids),
                          ("logit_bias", [t for t, _ in p.logit_bias])):
            if ids and not (0 <= min(ids) and max(ids) < vocab):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(f"request {req.request_id}: token id {bad} in {what} is out of "
                                 f"the vocabulary [0, {vocab})")

    # ------------------------------------------------------------------ LoRA adapters
    def _lora(self):
        if self.runner.lora is None:
            raise ValueError("this worker serves no LoRA adapters (start it with --enable-lora)")
        return self.runner.lora

    def add_lora(self, name: str, path: str):
        """Load a LoRA adapter (engine.lora.adapter.AdapterError: why it cannot be served)."""
        return self._lora().add(name, path)

    def remove_lora(self, name: str) -> None:
        self._lora().remove(name)

    def list_loras(self) -> list[str]:
        return [] if self.runner.lora is None else self.runner.lora.names()

    def _admit(self, req: Request) -> None:
        """What admission fixes for a request's life: LongRoPE's factors (engine.layers.rotary)
        and its LoRA adapter (engine.lora: the weights loaded now, whatever later loads under
        the name), which its prefix cache keys follow."""
        after = self.model_cfg.long_rope_after
        req.long_rope = bool(after) and req.num_tokens > after
        if req.lora_name and req.lora is None:
            if self.runner.lora is None:
                raise ValueError(f"LoRA adapter {req.lora_name!r} asked for; this worker "
                                 "serves no adapters (--enable-lora)")
            req.lora = self.runner.lora.get(req.lora_name)    # AdapterError: not loaded

    def add_request(self, req: Request) -> None:
        self.check_fits(req)
        self._admit(req)
        self.scheduler.add(req)
        if req.timeline is not None:
            self._timed[req.request_id] = req

    def reserve_remote(self, req: Request) -> list[int] | None:
        self.check_fits(req)
        self._admit(req)
        blocks = self.scheduler.reserve_remote(req)
        if req.timeline is not None and blocks is not None:
            req.timeline.reserved_ns = time.time_ns()
            self._timed[req.request_id] = req
        return blocks

    def remote_ready(self, request_id: str, first_token: int,
                     logprob: TokenLogprob | None) -> RequestOutput | None:
        timed = self._timed.get(request_id)
        out = self.scheduler.remote_ready(request_id, first_token, logprob)
        if timed is not None and out is not None:
            tl = timed.timeline
            tl.loaded_ns = tl.first_token_ns = time.time_ns()
            tl.output_tokens += len(out.new_token_ids)
        return out

    def abort(self, request_id: str) -> bool:
        """Abort a request and every choice of it."""
        for i in range(MAX_CHOICES):
            self._forget(request_id if i == 0 else f"{request_id}#{i}")
        self._timed.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def abort_choice(self, request_id: str, choice: int) -> RequestOutput | None:
        """Abort one choice of an n > 1 request (the others go on); its "abort" output, or None
        when it was not running."""
        rid = request_id if choice == 0 else f"{request_id}#{choice}"
        self._forget(rid)
        self._timed.pop(rid, None)
        if not self.scheduler.abort(rid, group=False):
            return None
        return RequestOutput(rid, [], [], "abort", choice=choice,
                             group=request_id if choice else "")

    def _forget(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.release(request_id)
            self.spec.release(request_id)

    # ------------------------------------------------------------------ KV transfers
    @property
    def connector(self):
        """engine.kv_connector.KVConnector, for reading what KV transfers hold
        (`references()`); changes go through the methods below."""
        return self.scheduler.connector

    def save_done(self, request_id: str) -> None:
        """Prefill role: the request's KV transfer has ended; its blocks go back."""
        self.scheduler.save_done(request_id)

    def configure_loads(self, one_sided: bool, load_timeout_s: float, lease_s: float) -> None:
        """Decode role, before the first reservation: the receiver's senders write into the
        pool themselves (`one_sided`), how long a load may take, how long blocks kept aside
        wait for their sender's word (engine.kv_connector)."""
        self.scheduler.connector.configure(one_sided, load_timeout_s, lease_s)

    def load(self, request_id: str) -> Load | None:
        """Decode role: the request's open load (the blocks still to arrive), or None."""
        return self.scheduler.connector.load(request_id)

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """Any thread: the blocks a sender may write for the request, or None."""
        return self.scheduler.connector.reserved_blocks(request_id)

    def expecting_kv(self) -> bool:
        """Any thread: whether a load or a quarantine is open."""
        return self.scheduler.connector.expecting()

    def is_loading(self, request_id: str, block_ids: list[int]) -> bool:
        """Whether these blocks may be written now: still the request's, expected."""
        return self.scheduler.connector.is_loading(request_id, block_ids)

    def fail_load(self, request_id: str, why: str) -> None:
        """Writing the request's received KV failed: it must not run on it."""
        self.scheduler.connector.fail_load(request_id, why)

    def end_load(self, request_id: str, sender_stopped: bool) -> Load | None:
        return self.scheduler.end_load(request_id, sender_stopped)

    def sender_done(self, request_id: str) -> None:
        self.scheduler.sender_done(request_id)

    def expire_loads(self) -> list[str]:
        """Loads past their deadline end; -> their request ids (engine.kv_connector.expire)."""
        return self.scheduler.expire_loads()

    def block_table(self, request_id: str) -> list[int]:
        return list(self.kv_manager.block_table(request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the step on the runner (inputs built, forward pass, sampling, the
        tokens of verified proposals), apply the results."""
        t0 = time.perf_counter()
        self._copy_forks()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if not sched.scheduled:
            self.last_step = StepStats(0, 0, 0, 0, len(sched.preempted), 0.0)
            if not sched.preempted:
                self.kv_manager.wait_restore()   # only restores in flight: wait, do not spin
            return []
        prompt = sum(min(s.num_new_tokens, max(s.request.num_prompt_tokens
                                               - s.request.num_computed_tokens, 0))
                     for s in sched.scheduled)          # before update() advances them
        timed = self._timed_in(sched) if self._timed else None
        t_fwd = time.perf_counter()
        if self.runner.lora is not None:       # the step's adapters into the slots
            self.batch.lora_slots = self.runner.lora.activate(
                [s.request.lora for s in sched.scheduled if s.request.lora is not None])
        inputs = self.batch.inputs(sched, self._proposals)
        result = self.runner.execute(inputs)
        if inputs.prompt_owners:
            self.batch.add_prompt_logprobs(inputs, result)
        tokens, logprobs = self.batch.tokens(sched, result, self._proposals)
        forward_s = time.perf_counter() - t_fwd
        outputs = self.scheduler.update(sched, tokens, logprobs)
        if self.offload is not None and prompt:
            self.offload.note_prompt_rate(prompt, forward_s)
        self._after_step(sched, tokens, outputs, prompt, t0, forward_s)
        if timed is not None:
            self._record_timelines(timed, sched, outputs)
        return outputs

    def _timed_in(self, sched: SchedulerOutput) -> list[tuple[Request, int, int]]:
        """Before the step: its requests that have a Timeline, with the prompt tokens it
        computes for each and when it started (epoch ns)."""
        now = time.time_ns()
        out = []
        for s in sched.scheduled:
            req = self._timed.get(s.request.request_id)
            if req is s.request:
                prompt = min(s.num_new_tokens,
                             max(req.num_prompt_tokens - req.num_computed_tokens, 0))
                out.append((req, prompt, now))
        return out

    def _record_timelines(self, timed: list[tuple[Request, int, int]], sched: SchedulerOutput,
                          outputs: list[RequestOutput]) -> None:
        """After the step: what it did for each request with a Timeline (see Timeline)."""
        now = time.time_ns()
        for req, prompt, start in timed:
            tl = req.timeline
            tl.scheduled_ns = tl.scheduled_ns or start
            if prompt:
                tl.chunks.append((start, now, prompt))
            else:
                tl.decode_steps += 1
        for rid in sched.preempted:
            if rid in self._timed:
                self._timed[rid].timeline.preempted_ns.append(now)
        for o in outputs:
            req = self._timed.get(o.request_id)
            if req is None:
                continue
            tl = req.timeline
            if o.new_token_ids:
                tl.output_tokens += len(o.new_token_ids)
                tl.first_token_ns = tl.first_token_ns or now
            if o.finished:
                tl.finished_ns = now
                del self._timed[o.request_id]

    def _copy_forks(self) -> None:
        """The block copies of forked choices (n > 1), before the step that reads them."""
        pairs = self.kv_manager.take_copies()
        if pairs:
            self.runner.copy_blocks(pairs)
            self.kv_manager.copies_done(pairs)

    def _after_step(self, sched: SchedulerOutput, tokens: list[list[int]],
                    outputs: list[RequestOutput], prompt: int, t0: float,
                    forward_s: float) -> None:
        """A step's outputs and statistics: KV-ready events (prefill), what speculation
        learns, the step's StepStats (`prompt`: its prompt tokens)."""
        if self.cfg.role == "prefill" and any(o.kv_blocks for o in outputs):
            ready = self.runner.record_event()
            for o in outputs:
                if o.kv_blocks:
                    o.kv_ready = ready
        sampled = (s for s in sched.scheduled if s.sample)
        spec = [(s, len(t) - 1) for s, t in zip(sampled, tokens) if s.num_spec]
        if self.proposer is not None:
            self.spec.observe_step(sched.num_tokens, len(spec), forward_s)
            for s, accepted in spec:
                rid = s.request.request_id
                self.spec.record(rid, s.num_spec, accepted, self._proposals[rid].kind)
                timed = self._timed.get(rid)
                if timed is not None:
                    timed.timeline.spec_proposed += s.num_spec
                    timed.timeline.spec_accepted += accepted
                self.proposer.verified(s.request)
            for o in outputs:
                if o.finished:
                    self._forget(o.request_id)
        proposed = sum(s.num_spec for s, _ in spec)
        accepted = sum(a for _, a in spec)
        st = self.stats
        st.steps += 1
        st.tokens += sched.num_tokens
        st.spec_proposed += proposed
        st.spec_accepted += accepted
        st.spec_seq_steps += len(spec)
        generated, duration = sum(len(t) for t in tokens), time.perf_counter() - t0
        st.prompt_tokens += prompt
        st.generated_tokens += generated
        st.busy_s += duration
        self.last_step = StepStats(len(sched.scheduled), sched.num_tokens, prompt, generated,
                                   len(sched.preempted), duration, proposed, accepted, len(spec))

    def _propose(self) -> None:
        """Proposals for the running sequences that decode this step (req.spec_token_ids)."""
        reqs = [r for r in self.scheduler.running
                if r.status is Status.RUNNING and r.num_tokens - r.num_computed_tokens == 1
                and not r.params.beam_width]      # a beam's next token is the group's choice
        if not reqs:
            return
        k = self.cfg.num_speculative_tokens
        limits = [max(0, min(k, r.params.max_tokens - len(r.output_token_ids) - 1,
                             self.cfg.max_model_len - r.num_tokens - 1)) for r in reqs]
        others = min(sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.running
                         if r.num_tokens - r.num_computed_tokens > 1),
                     self.cfg.max_num_batched_tokens)
        if self.proposer.free:              # cheap: see what is on offer, then choose
            offers = self.proposer.propose(reqs, limits)
            ks = self.spec.plan([r.request_id for r in reqs], [len(o.tokens) for o in offers],
                                others, [o.kind for o in offers])
            props = [o.truncated(kk) for o, kk in zip(offers, ks)]
        else:
            ks = self.spec.plan([r.request_id for r in reqs], limits, others)
            t0 = time.perf_counter()
            props = self.proposer.propose(reqs, ks)
            self.spec.observe_draft(time.perf_counter() - t0, sum(len(p.tokens) for p in props))
        self._proposals = {}
        for r, p in zip(reqs, props):
            if r.structured_state is not None and p.tokens:    # what the grammar allows
                p = p.truncated(r.structured_state.valid_prefix(list(p.tokens)))
            r.spec_token_ids = list(p.tokens)
            self._proposals[r.request_id] = p
