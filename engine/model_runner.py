"""The model runner: everything an engine step does on the device.

It owns the model, the KV pool, the attention backend, the per-step input buffers
(engine.step_buffers: token ids, positions, the backend's metadata such as slot mapping, query
and sequence lengths and block tables [max_seqs, max_blocks], the sampler's per-row parameters),
the CUDA graphs of decode-only steps (engine.cuda_graphs) and the sampler. One step:

    stage on the host -> one H2D copy -> forward (graph replay, or eager) -> logits of the
    sampled rows -> batched sampling -> one transfer back (tokens and logprobs)

The Engine keeps orchestration (scheduler, speculation, outputs); engine.batch_builder turns
the scheduler's output into the `StepInputs` the runner executes, and its `StepResult` into
tokens per request. On CUDA without a given pool size the KV pool takes what `gpu_memory_utilization`
leaves after the weights, a profiled forward pass at the step's token budget and the graphs.

Tensor parallel (engine.parallel; the rank processes: engine.tp_ranks): every rank builds a
runner over its shards; rank 0's runner is the engine's and sends each step, block copy, read and write of the pool to the others as a
command (`follow` is the other ranks' loop), so all ranks run the same collectives in the same
order. Decode steps run eagerly there (no CUDA graphs across ranks yet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.attention.base import BatchLayout, BufferSizes, create_backend
from engine import kv_groups
from engine.config import EngineConfig, ModelConfig, kv_bytes_per_block
from engine.cuda_graphs import DecodeGraphs
from engine.device_memory import DeviceMemory, MemorySnapshot, check_start, kv_budget
from engine.layers import LayerOptions
from engine.layers import quant_formats
from engine.layers.linear import linear_method_for
from engine.layers.moe import graph_safe as moe_graph_safe
from engine.layers.quant_formats import QuantScheme
from engine.layers.rotary import LONG_ROPE
from engine.parallel import (SINGLE, RankFailure, ShardedKV, TPGroup, check_split, head_range,
                             local_config)
from engine.request import SamplingParams, TokenLogprob
from engine.sampler import RowSampling, Sampler
from engine.step_buffers import StepBuffers
from engine.weights import load_model, random_model

log = logging.getLogger(__name__)

PROMPT_LOGITS_SLICE = 128   # prompt rows whose logits [rows, vocab] are scored at a time


@dataclass(frozen=True)
class StepInputs:
    """One step as the host knows it: the new tokens of every sequence, in order, their layout,
    and which rows are sampled (with how)."""

    token_ids: list[int]            # [T]
    batch: BatchLayout
    sample_rows: list[int]          # [S] rows of the step whose logits are sampled
    sampling: list[RowSampling]     # [S], or empty: logits only, nothing sampled
    bitmask: torch.Tensor | None = None   # [S, words] int32 grammar masks (engine.structured)
    # prompt logprobs (engine.batch_builder.PromptRows): rows [P] of the step scored against
    # the prompt tokens that follow them, with this many top alternatives; whose they are
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top: int = 0
    prompt_owners: list = field(default_factory=list)


@dataclass
class StepResult:
    tokens: list[int]                       # [S] a token per sampled row
    logprobs: list[TokenLogprob | None]     # [S]
    logits: torch.Tensor                    # [S, vocab] float32, on the device
    processed: torch.Tensor | None = None   # [S, vocab] after logits processing (penalties,
    #                                         bias, bans, grammar): what tokens are chosen from
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # [P], with ranks


class ModelRunner:
    def __init__(self, model_dir: str | Path | None, model_cfg: ModelConfig, cfg: EngineConfig,
                 model: torch.nn.Module | None = None, random_weights: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        check_split(model_cfg, tp.size, cfg.expert_parallel)
        self.tp = tp
        self.device = torch.device(cfg.device)
        self.bind_thread()
        self.memory_start = None
        if self.device.type == "cuda" and not cfg.num_blocks:   # before anything loads
            self.memory = DeviceMemory(self.device)
            self.memory_start = MemorySnapshot.take(self.memory)
            check_start(self.memory_start, cfg.gpu_memory_utilization)
        self.dtype = cfg.torch_dtype
        m = local_config(model_cfg, tp)          # this rank's heads
        self.max_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.sizes = BufferSizes(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_blocks)
        self.groups = kv_groups.of_engine(model_cfg, cfg)
        self.backend = create_backend(cfg.attention_backend, m, cfg.block_size, self.dtype,
                                      self.device, self.sizes, cfg.cpu_attention,
                                      self.groups.num_groups)
        quant = quant_formats.resolve(cfg.quantization, None if random_weights else model_dir)
        self.quant_scheme = quant if isinstance(quant, QuantScheme) else None
        if model_cfg.moe is not None and self.quant_scheme is not None:
            raise ValueError(f"{self.quant_scheme.name} checkpoints of MoE models "
                             f"({model_cfg.family}) are not supported yet: serve the "
                             "full-precision checkpoint (--quantization int8 quantizes its "
                             "experts at load)")
        if cfg.expert_parallel and model_cfg.moe is None:
            raise ValueError(f"--expert-parallel needs an MoE model; {model_cfg.family} is dense")
        method = cfg.linear_method
        opts = LayerOptions(self.backend,
                            linear_method_for(self.device, self.dtype, quant, method), tp,
                            # lm_head stays in the model's precision (as vLLM keeps it)
                            head=linear_method_for(self.device, self.dtype, "none", method)
                            if self.quant_scheme or quant == "int8" else None,
                            expert_parallel=cfg.expert_parallel, moe_backend=cfg.moe_backend)
        self.local_cfg, m_full = m, model_cfg
        if model is not None:
            self.model = model
        elif random_weights:
            self.model = random_model(m_full, opts, self.dtype, self.device, seed=tp.rank)
        else:
            self.model = load_model(model_dir, self.dtype, self.device, m_full, opts,
                                    round_to=cfg.weight_dtype, scheme=self.quant_scheme)
        if hasattr(self.model, "kv_placement"):
            self.model.kv_placement = self.groups.placement()
        self.lora = None
        if cfg.enable_lora:
            from engine.lora.manager import LoRAManager
            self.lora = LoRAManager(self.model, model_cfg, cfg.max_loras, cfg.max_lora_rank,
                                    self.device, self.dtype,
                                    triton=self.backend.kernels == "triton")
            if tp.size > 1 and tp.rank == 0:        # the other ranks write the same slots
                self.lora.on_write = lambda slot, adapter: self._tp_op(
                    self.tp.command, ("lora", slot, adapter))
        self.sampler = Sampler(m.eos_token_ids)
        self.buffers = self._new_buffers(self.sizes)
        self.num_blocks = cfg.num_blocks or self._blocks_from_memory()
        self.kv = torch.zeros(self.groups.slots, 2, self.num_blocks, cfg.block_size,
                              m.num_kv_heads, m.head_dim, dtype=self.dtype, device=self.device)
        self.pool = self.kv if tp.size == 1 else ShardedKV(self, model_cfg.num_kv_heads)
        self.graphs = None
        if (self.device.type == "cuda" and self.backend.cuda_graphs and not cfg.enforce_eager
                and tp.size == 1 and moe_graph_safe(self.model) and self.lora is None):
            self.graphs = DecodeGraphs(self, self.max_graph_batch)
            self.graphs.capture()
        self._plan = None
        self.broken: str | None = None           # why a tensor-parallel operation failed
        self._synced = False

    @property
    def max_graph_batch(self) -> int:
        """The largest decode batch a graph is captured for: a step's rows are staged in
        max_num_batched_tokens rows."""
        return min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)

    # ------------------------------------------------------------------ buffers
    def _new_buffers(self, sizes: BufferSizes) -> StepBuffers:
        i32 = torch.int32
        regions = [("input_ids", sizes.max_tokens, i32), ("positions", sizes.max_tokens, i32),
                   ("sample_rows", sizes.max_tokens, i32)]
        regions += self.backend.regions(sizes) + Sampler.regions(sizes.max_tokens)
        tail = self.backend.tail_region(sizes)
        if tail is not None:
            regions.append(tail)
        return StepBuffers(regions, self.device)

    def _buffers_for(self, num_tokens: int, num_seqs: int) -> StepBuffers:
        """The persistent buffers, or (a step larger than they hold: a draft model catching up
        on whole prompts) buffers of its own, eager only."""
        s = self.sizes
        if num_tokens <= s.max_tokens and num_seqs <= s.max_seqs:
            return self.buffers
        return self._new_buffers(BufferSizes(max(num_tokens, s.max_tokens),
                                             max(num_seqs, s.max_seqs), s.max_blocks))

    def _stage_tokens(self, buf: StepBuffers, token_ids, batch: BatchLayout, rows: int) -> None:
        """Token ids and positions of the step's rows (rows beyond T: padding, zeros)."""
        buf.wait_writable()
        h = buf.host
        t = len(token_ids)
        if rows > len(h["input_ids"]):
            raise ValueError(f"{rows} rows exceed the {len(h['input_ids'])} staged")
        h["input_ids"][:t] = token_ids
        q = np.asarray(batch.q_lens, dtype=np.int64)
        if t:
            first = np.asarray(batch.starts, dtype=np.int64) - (np.cumsum(q) - q)
            if batch.rope_long is not None:     # LongRoPE: long factors at every position
                first = first + LONG_ROPE * np.asarray(batch.rope_long, dtype=np.int64)
            h["positions"][:t] = np.arange(t) + np.repeat(first, q)
        h["input_ids"][t:rows] = 0
        h["positions"][t:rows] = 0

    def _upload(self, buf: StepBuffers, meta) -> None:
        """The step's one H2D copy, then the backend's device-side setup."""
        tail = self.backend.tail_region(self.sizes)
        if tail is None:
            buf.upload()
        else:
            buf.upload(tail[0], self.backend.staged(meta))
        self.backend.prepare(meta)

    def stage_empty_decode(self, rows: int):
        """Stage a decode step of `rows` padding sequences (graph capture); its metadata."""
        batch = BatchLayout([], [], [])
        self._stage_tokens(self.buffers, [], batch, rows)
        meta = self.backend.build(batch, self.buffers, pad_to=rows)
        self._upload(self.buffers, meta)
        return meta

    # ------------------------------------------------------------------ one step
    def execute(self, inp: StepInputs) -> StepResult:
        """Forward pass over the step and sampling of its sampled rows (tensor parallel: every
        rank runs the forward pass; rank 0 samples)."""
        if self.tp.size > 1:
            return self._tp_op(self._lead_step, inp)
        return self._execute(inp)

    def _lead_step(self, inp: StepInputs) -> StepResult:
        self.tp.command(("step", inp.token_ids, inp.batch, inp.sample_rows, inp.prompt_rows,
                         inp.prompt_targets, inp.prompt_top))
        return self._execute(inp)

    def _tp_op(self, fn, *args):
        """Rank 0's side of a tensor-parallel operation: any failure is a RankFailure, and
        every later operation fails the same way (the ranks may be out of step)."""
        if self.broken is not None:
            raise RankFailure(self.broken)
        self._synced = False
        try:
            return fn(*args)
        except Exception as exc:
            if self._synced:     # rank 0's own work after the ranks' last collective (sampling)
                raise
            self.broken = f"tensor-parallel rank failure: {type(exc).__name__}: {exc}"
            raise RankFailure(self.broken) from exc

    def _execute(self, inp: StepInputs) -> StepResult:
        batch = inp.batch
        t, b = len(inp.token_ids), len(batch.q_lens)
        bucket = None
        if self.graphs is not None and batch.decode_only:
            bucket = self.graphs.bucket(b)
        buf = self._buffers_for(t, b) if bucket is None else self.buffers
        rows = bucket or t
        self._stage_tokens(buf, inp.token_ids, batch, rows)
        s = len(inp.sample_rows)
        contiguous = inp.sample_rows == list(range(s))
        if not contiguous:
            buf.host["sample_rows"][:s] = inp.sample_rows
        plan = self.sampler.stage(inp.sampling, buf.host, inp.bitmask)
        meta = self.backend.build(batch, buf, pad_to=bucket)
        if self.lora is not None:
            self.lora.set_batch(batch.lora_slots, batch.q_lens)
        self._upload(buf, meta)                         # the step's one H2D copy
        with torch.inference_mode():
            if bucket is not None:
                hidden = self.graphs.replay(bucket)                      # [bucket, hidden]
            else:
                d = buf.dev
                hidden = self.model(d["input_ids"][:t], d["positions"][:t], self.kv, meta)
            sel = hidden[:s] if contiguous else hidden[buf.dev["sample_rows"][:s].long()]
            logits = self.model.compute_logits(sel)                      # [S, vocab]
            prompt = self._prompt_logprobs(hidden, inp) if inp.prompt_rows else []
            self._synced = True          # tensor parallel: the step's last collective is done
            tokens, logprobs, processed = ([], [], logits) if not inp.sampling else \
                self.sampler.sample(logits, plan, buf.dev)
        return StepResult(tokens, logprobs, logits, processed, prompt)

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> list[TokenLogprob]:
        """Each prompt row's target under the model's distribution there: logprob, rank, top
        alternatives. The rows' logits come from this step's hidden states (no second pass),
        a slice at a time so a long chunk never holds [rows, vocab] all at once."""
        out: list[TokenLogprob] = []
        k = inp.prompt_top
        for lo in range(0, len(inp.prompt_rows), PROMPT_LOGITS_SLICE):
            rows = inp.prompt_rows[lo:lo + PROMPT_LOGITS_SLICE]
            idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
            target = torch.tensor(inp.prompt_targets[lo:lo + PROMPT_LOGITS_SLICE],
                                  dtype=torch.long, device=hidden.device)
            lp = self.model.compute_logits(hidden[idx]).float().log_softmax(-1)
            chosen = lp.gather(1, target[:, None])                    # [r, 1]
            rank = (lp > chosen).sum(-1) + 1
            top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
            chosen, rank = chosen[:, 0].tolist(), rank.tolist()
            tv = top_vals.tolist() if k else [[]] * len(rows)
            ti = top_ids.tolist() if k else [[]] * len(rows)
            for j, tok in enumerate(inp.prompt_targets[lo:lo + PROMPT_LOGITS_SLICE]):
                out.append(TokenLogprob(tok, chosen[j], list(zip(ti[j], tv[j])), rank[j]))
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in every layer plane (forked choices), on the current
        stream."""
        if self.tp.size == 1:
            self._copy_blocks(pairs)
            return

        def copy():
            self.tp.command(("copy", pairs))
            self._copy_blocks(pairs)
        self._tp_op(copy)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        self.kv[:, :, dst] = self.kv[:, :, src]

    # ------------------------------------------------------------------ tensor parallel
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Rank 0: kv[:, :, block_ids] with every rank's heads, in head order
        [layers, 2, n, block_size, all KV heads, head_dim] (a replicated head taken once)."""
        def read():
            self.tp.command(("read", block_ids))
            return self._read_blocks(block_ids)
        return self._tp_op(read)

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor | None:
        import torch.distributed as dist

        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        local = self.kv.index_select(2, index).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)] if self.tp.leader \
            else None
        dist.gather(local, parts, dst=0)
        if not self.tp.leader:
            return None
        kvh, covered, heads = self.model_cfg.num_kv_heads, 0, []
        for rank, part in enumerate(parts):
            first, _ = head_range(kvh, self.tp.size, rank)
            if first == covered:                  # the first rank holding these heads
                heads.append(part)
                covered += part.shape[4]
        return torch.cat(heads, dim=4)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Rank 0: kv[:, :, block_ids] = data (all KV heads), each rank taking its own."""
        full = data.to(self.device, self.dtype).contiguous()     # before the command

        def write():
            self.tp.command(("write", block_ids, tuple(full.shape)))
            self._write_blocks(block_ids, full)
        self._tp_op(write)

    def _write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.tp.broadcast(data)
        first, n = head_range(self.model_cfg.num_kv_heads, self.tp.size, self.tp.rank)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv.index_copy_(2, index, data[:, :, :, :, first:first + n])

    def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's commands until it says stop."""
        while True:
            op, *args = self.tp.command()
            if op == "step":
                self._execute(StepInputs(args[0], args[1], args[2], [], prompt_rows=args[3],
                                         prompt_targets=args[4], prompt_top=args[5]))
            elif op == "copy":
                self._copy_blocks(args[0])
            elif op == "lora":
                self.lora.write(args[0], args[1])
            elif op == "read":
                self._read_blocks(args[0])
            elif op == "write":
                shape = args[1]
                self._write_blocks(args[0], torch.empty(shape, dtype=self.dtype,
                                                        device=self.device))
            elif op == "stop":
                return

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to leave their command loop (engine.tp_ranks)."""
        self.tp.command(("stop",))

    def leave_group(self) -> None:
        """Rank 0, once the other ranks are gone: leave the group (this process may start
        another); the runner works on alone no more."""
        if self.tp.size == 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.tp = SINGLE

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current device (CUDA's current device is
        per thread: the engine's own thread calls this before its first step)."""
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)

    def record_event(self):
        """A device event after everything issued so far on this device's current stream (None
        on CPUs: already done)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    # ------------------------------------------------------------------ KV pool sizing
    def _blocks_from_memory(self) -> int:
        """CUDA: blocks that fit in gpu_memory_utilization x the device's memory after this
        process's weights, the peak of a profiled step at the full token budget (forward,
        logits and sampling of as many rows as a step samples), its memory outside torch and
        the CUDA graphs' estimated pool (engine.device_memory: other processes' memory does not
        count)."""
        if self.device.type != "cuda":
            raise ValueError("num_blocks must be given on CPUs (--kv-cache-gib or --num-blocks)")
        dev, cfg = self.device, self.cfg
        self.memory.settle()
        before = MemorySnapshot.take(self.memory)
        weights = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        m = self.local_cfg
        kv = torch.zeros(self.groups.slots, 2, 1, cfg.block_size, m.num_kv_heads, m.head_dim,
                         dtype=self.dtype, device=dev)
        self._profile_step(kv, cfg.max_num_batched_tokens)
        peak = torch.cuda.max_memory_allocated(dev)
        graph_reserve = 0
        if self.backend.cuda_graphs and not cfg.enforce_eager and self.tp.size == 1:
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            self._profile_decode(kv, self.max_graph_batch)
            graph_reserve = torch.cuda.max_memory_allocated(dev) - base
        del kv
        self.memory.settle()
        got = kv_budget(self.memory, before, cfg.gpu_memory_utilization, peak, graph_reserve)
        budget, non_torch, total = got.kv_bytes, got.non_torch, before.total
        if got.ignored:
            log.info("the device's use grew %.2f GiB outside this process's torch memory while "
                     "it profiled: another process's (not counted against this worker)",
                     got.ignored / 2**30)
        per_block = kv_bytes_per_block(self.model_cfg, cfg)
        blocks = budget // per_block
        if self.tp.size > 1:                     # every rank holds as many blocks
            import torch.distributed as dist

            least = torch.tensor([blocks], dtype=torch.long, device=dev)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            blocks = int(least.item())
        if blocks < 1:
            raise ValueError(f"no room for KV blocks: {cfg.gpu_memory_utilization:.2f} of "
                             f"{total / 2**30:.1f} GiB minus weights {weights / 2**30:.2f} GiB, "
                             f"activations {(peak - weights) / 2**30:.2f} GiB and "
                             f"{non_torch / 2**30:.2f} GiB outside torch; raise "
                             "--gpu-memory-utilization or lower --max-num-batched-tokens")
        log.info("KV pool from memory: %d blocks x %d tokens = %d tokens (%.2f GiB); device "
                 "%.1f GiB x %.2f, weights %.2f GiB, activation peak %.2f GiB, graphs ~%.0f MiB, "
                 "outside torch %.2f GiB", blocks, cfg.block_size, blocks * cfg.block_size,
                 blocks * per_block / 2**30, total / 2**30, cfg.gpu_memory_utilization,
                 weights / 2**30, (peak - weights) / 2**30, graph_reserve / 2**20,
                 non_torch / 2**30)
        return int(blocks)

    def _profile_step(self, kv: torch.Tensor, num_tokens: int) -> None:
        """The largest eager step: num_tokens fresh prompt tokens (in sequences of at most
        max_model_len), logits and top-p/top-k sampling with logprobs for max_num_seqs rows."""
        cap = self.cfg.max_model_len
        q_lens = [min(cap, num_tokens - i) for i in range(0, num_tokens, cap)]
        batch = BatchLayout([[0] * self.max_blocks] * len(q_lens), [0] * len(q_lens), q_lens)
        # sampled rows: one per sequence, or with speculation one per verified proposal too
        per_seq = 1 + (self.cfg.num_speculative_tokens if self.cfg.speculative != "off" else 0)
        rows = min(self.cfg.max_num_seqs * per_seq, num_tokens)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=True,
                                top_logprobs=20)
        inp = StepInputs([0] * num_tokens, batch, list(range(rows)),
                         [RowSampling(params, 0)] * rows)
        real_kv, self.kv = getattr(self, "kv", None), kv
        graphs, self.graphs = getattr(self, "graphs", None), None
        self.sampler.sort_all = True      # top-p rows sorted in full: its most memory
        try:
            self._execute(inp)
        finally:
            self.kv, self.graphs = real_kv, graphs
            self.sampler.sort_all = False
        torch.cuda.synchronize(self.device)

    def _profile_decode(self, kv: torch.Tensor, rows: int) -> None:
        meta = self.stage_empty_decode(rows)
        d = self.buffers.dev
        with torch.inference_mode():
            self.model(d["input_ids"][:rows], d["positions"][:rows], kv, meta)
        torch.cuda.synchronize(self.device)
