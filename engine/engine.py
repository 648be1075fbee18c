"""The engine: a model, its KV pool and a scheduler, advanced one step at a time.

Not thread-safe: one thread owns an Engine (see engine.async_engine for the threaded wrapper).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.attention import AttentionMetadata
from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool, KVCacheManager
from engine.config import EngineConfig, ModelConfig
from engine.request import Request, RequestOutput, TokenLogprob
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.weights import load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block across the pool; both ends of a KV transfer must agree on it."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0


@dataclass(frozen=True)
class StepStats:
    """What one engine step did."""

    num_seqs: int
    num_tokens: int
    num_prompt_tokens: int       # tokens of prompt chunks (prefill work) in the step
    num_generated: int           # tokens sampled in the step
    num_preempted: int
    duration_s: float


class Engine:
    def __init__(self, model_dir: str | Path, cfg: EngineConfig,
                 model_cfg: ModelConfig | None = None, model: torch.nn.Module | None = None):
        self.model_cfg = model_cfg or ModelConfig.from_dir(model_dir)
        if cfg.num_blocks <= 0:
            raise ValueError("EngineConfig.num_blocks must be resolved before building an Engine")
        if cfg.max_model_len == 0:
            cfg = replace(cfg, max_model_len=self.model_cfg.max_position_embeddings)
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = model or load_model(model_dir, cfg.torch_dtype, cfg.device, self.model_cfg,
                                           round_to=cfg.weight_dtype)
        m = self.model_cfg
        # kv[layer, k_or_v, block, slot, kv_head, head_dim]; see engine.block_pool for the picture
        self.kv = torch.zeros(m.num_layers, 2, cfg.num_blocks, cfg.block_size, m.num_kv_heads,
                              m.head_dim, dtype=cfg.torch_dtype, device=self.device)
        self.layout = KVLayout(cfg.compute_dtype, cfg.block_size, m.num_layers, m.num_kv_heads, m.head_dim)
        self.pool = BlockPool(cfg.num_blocks)
        hasher = BlockHasher(cfg.block_size, cfg.hash_seed) if cfg.enable_prefix_caching else None
        self.kv_manager = KVCacheManager(self.pool, cfg.block_size, hasher)
        self.scheduler = Scheduler(cfg, self.kv_manager, m.eos_token_ids, cfg.max_model_len)
        self.stats = EngineStats()
        self.last_step: StepStats | None = None

    # ------------------------------------------------------------------ requests
    def check_fits(self, req: Request) -> None:
        total = req.num_prompt_tokens + (1 if self.cfg.role == "prefill" else req.params.max_tokens)
        if total > self.cfg.max_model_len:
            raise ValueError(f"request {req.request_id}: {req.num_prompt_tokens} prompt tokens + "
                             f"{req.params.max_tokens} max_tokens exceed max_model_len "
                             f"{self.cfg.max_model_len}")
        need = self.kv_manager.blocks_needed(total)
        if need > self.pool.num_blocks:
            raise ValueError(f"request {req.request_id} needs {need} KV blocks; the pool has "
                             f"{self.pool.num_blocks} (raise --kv-cache-gib or --num-blocks)")

    def add_request(self, req: Request) -> None:
        self.check_fits(req)
        self.scheduler.add(req)

    def reserve_remote(self, req: Request) -> list[int] | None:
        self.check_fits(req)
        return self.scheduler.reserve_remote(req)

    def remote_ready(self, request_id: str, first_token: int,
                     logprob: TokenLogprob | None) -> RequestOutput | None:
        return self.scheduler.remote_ready(request_id, first_token, logprob)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        self.scheduler.release(request_id)

    def pin(self, block_ids: list[int]) -> None:
        """An extra reference on blocks in use, for a transfer that may still touch them."""
        self.pool.take(block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        """Give back a transfer reference (pin, or RequestOutput.kv_blocks)."""
        self.pool.free(block_ids)

    def block_table(self, request_id: str) -> list[int]:
        return list(self.kv_manager.block_table(request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if not sched.scheduled:
            self.last_step = StepStats(0, 0, 0, 0, len(sched.preempted), 0.0)
            return []
        prompt = sum(min(s.num_new_tokens, max(s.request.num_prompt_tokens
                                               - s.request.num_computed_tokens, 0))
                     for s in sched.scheduled)
        input_ids, positions, meta, sample_rows = self._prepare(sched)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv, meta)          # [T, hidden]
            logits = self.model.compute_logits(hidden[sample_rows])           # [S, vocab]
        reqs = [s.request for s in sched.scheduled if s.sample]
        tokens, logprobs = sample(logits, [r.params for r in reqs],
                                  [len(r.output_token_ids) for r in reqs])
        self.stats.steps += 1
        self.stats.tokens += sched.num_tokens
        outputs = self.scheduler.update(sched, tokens, logprobs)
        self.last_step = StepStats(len(sched.scheduled), sched.num_tokens, prompt, len(tokens),
                                   len(sched.preempted), time.perf_counter() - t0)
        return outputs

    def _prepare(self, sched: SchedulerOutput):
        """Flatten the scheduled requests into the step's inputs: token ids [T], positions [T],
        attention metadata, and the rows [S] whose logits are sampled."""
        ids, pos, tables, starts, q_lens, sample_rows = [], [], [], [], [], []
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            ids.extend(req.all_token_ids[start:end])
            pos.extend(range(start, end))
            tables.append(self.kv_manager.block_table(req.request_id))
            starts.append(start)
            q_lens.append(s.num_new_tokens)
            if s.sample:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMetadata.build(tables, starts, q_lens, self.cfg.block_size, dev)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta,
                torch.tensor(sample_rows, dtype=torch.long, device=dev))
