"""The `triton` attention backend: Triton kernels over the paged cache (the default on CUDA).

Per layer, two launches (three for split-KV decodes): pdkernels.triton_kv_store stores the step's
K/V into their slots with rotary applied to k (and to q, in place), and
pdkernels.triton_attention attends every sequence of the ragged batch (prompt chunks after cached
context, decodes, speculative verification) in one call, reading blocks in place through the
block table. Metadata lives in the runner's StepBuffers (one H2D copy per step), at addresses
that never change, so a decode-only step can be captured once per batch-size bucket and replayed.

Staged per step (int32): slot_mapping [T], query_start_loc [B + 1], seq_lens [B], the attention
tiles (tile_seq, tile_start: one per sequence and run of up to block_q queries), seq_rows [B]
(each sequence's row of the device-resident block tables) and the block-table entries the step
adds (engine.attention.block_tables). After the upload the entries are scattered into the
resident tables and the step's rows gathered into step_tables [max_seqs, max_blocks], the
fixed-address table the kernels read. A padded sequence (CUDA-graph buckets) has one row,
slot -1 (nothing stored), seq_len 0 (zero output).

KV groups (engine.kv_groups): the resident tables hold each group's table side by side in a
sequence's row, and each group has its own slot mapping; the metadata is a TritonMetadata per
group, sharing everything else (a group's block_tables is its columns of step_tables).

A layer's sliding window, soft-capping and sinks (engine.config.LayerAttention) go to the
kernel as launch arguments.

Decode-only batches with few sequences split each sequence's context across programs
(split-KV) so the GPU fills up: the split count is fixed per batch size, so a graph replays
with the launch it was captured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.block_tables import DeviceBlockTables
from engine.config import FULL, LayerAttention
from pdkernels import triton_attention as ta
from pdkernels.triton_attention import MAX_SPLITS
from pdkernels.triton_kv_store import store_kv


@dataclass(frozen=True)
class TritonMetadata:
    slot_mapping: torch.Tensor       # [T] int32
    query_start_loc: torch.Tensor    # [max_seqs + 1] int32
    seq_lens: torch.Tensor           # [max_seqs] int32
    block_tables: torch.Tensor       # [max_seqs, max_blocks] int32 (filled by prepare)
    tile_seq: torch.Tensor           # [max_tiles] int32
    tile_start: torch.Tensor         # [max_tiles] int32
    num_tiles: int
    block_m: int
    num_splits: int
    seq_rows: torch.Tensor           # [n] int32: each real sequence's resident row
    table_pairs: torch.Tensor        # [capacity, 2] int32: (flat index, block id) added
    num_pairs: int
    block_tables_all: torch.Tensor   # [max_seqs, groups * max_blocks]: every group's columns


class TritonBackend(AttentionBackend):
    name = "triton"
    kernels = "triton"
    cuda_graphs = True

    def __init__(self, *args) -> None:
        super().__init__(*args)
        m, s = self.model, self.sizes
        self.qpk = m.num_heads // m.num_kv_heads
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 1)
        self.split_tokens = s.max_seqs                  # split-KV: decode-only steps
        self.partial_out, self.partial_lse = ta.split_scratch(
            self.split_tokens, m.num_heads, m.head_dim, MAX_SPLITS, self.device)
        g = self.num_groups
        self.tables = DeviceBlockTables(2 * s.max_seqs, s.max_blocks, self.device, g)
        # what the kernels read: never reallocated (CUDA graphs hold its address)
        self.step_tables = torch.zeros(s.max_seqs, g * s.max_blocks, dtype=torch.int32,
                                       device=self.device)

    def _slot_region(self, g: int) -> str:
        return "slot_mapping" if g == 0 else f"slot_mapping_{g}"

    def regions(self, sizes):
        i32 = torch.int32
        tiles = sizes.max_tokens + sizes.max_seqs       # every sequence's tiles, block_q >= 1
        slots = [(self._slot_region(g), sizes.max_tokens, i32) for g in range(self.num_groups)]
        return slots + [("query_start_loc", sizes.max_seqs + 1, i32),
                ("seq_lens", sizes.max_seqs, i32), ("tile_seq", tiles, i32),
                ("tile_start", tiles, i32), ("seq_rows", sizes.max_seqs, i32)]

    def tail_region(self, sizes):
        # every sequence new to the device, its whole tables: (flat index, block id) pairs
        return ("table_pairs", 2 * sizes.max_seqs * sizes.max_blocks * self.num_groups,
                torch.int32)

    def staged(self, meta: tuple[TritonMetadata, ...]) -> int:
        return 2 * meta[0].num_pairs

    def prepare(self, meta: tuple[TritonMetadata, ...]) -> None:
        m = meta[0]
        self.tables.apply(m.table_pairs, m.num_pairs, m.seq_rows, m.block_tables_all)

    def splits_for(self, num_seqs: int) -> int:
        return ta.num_splits_for(num_seqs, self.model.num_kv_heads, self.num_sms, MAX_SPLITS)

    def build(self, batch: BatchLayout, buffers, pad_to: int | None = None
              ) -> tuple[TritonMetadata, ...]:
        bs, width = self.block_size, self.sizes.max_blocks
        q_lens = list(batch.q_lens)
        n = len(q_lens)
        if pad_to is not None:
            if not batch.decode_only or pad_to < n:
                raise ValueError(f"only decode-only batches of <= {pad_to} sequences are padded")
            q_lens += [1] * (pad_to - n)
        b = len(q_lens)
        h = buffers.host
        if b > len(h["seq_lens"]):
            raise ValueError(f"{b} sequences exceed the {len(h['seq_lens'])} staged")
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        rows = int(qsl[b])
        if rows > len(h["slot_mapping"]):
            raise ValueError(f"{rows} rows exceed the {len(h['slot_mapping'])} staged")
        h["query_start_loc"][:b + 1] = qsl
        num_pairs = self._stage_sequences(batch, n, qsl, h)
        h["seq_lens"][n:b] = 0
        for g in range(self.num_groups):
            h[self._slot_region(g)][qsl[n]:rows] = -1
        block_m, block_q = ta.attention_tile_shape(self.qpk, max(q_lens) if q_lens else 1)
        decode = all(q == 1 for q in q_lens)
        if decode:                      # one tile per sequence, from its first (only) query
            h["tile_seq"][:b] = np.arange(b)
            h["tile_start"][:b] = 0
            num_tiles = b
        else:
            tile_seq, tile_start = ta.plan_tiles(q_lens, block_q)
            h["tile_seq"][:len(tile_seq)] = tile_seq
            h["tile_start"][:len(tile_start)] = tile_start
            num_tiles = len(tile_seq)
        splits = self.splits_for(b) if decode and b <= self.split_tokens else 1
        d = buffers.dev
        tables = self.step_tables
        if b > tables.shape[0]:          # a one-off step larger than the buffers: eager only
            tables = torch.zeros(b, self.num_groups * width, dtype=torch.int32,
                                 device=self.device)
        return tuple(TritonMetadata(d[self._slot_region(g)][:rows], d["query_start_loc"],
                                    d["seq_lens"], tables[:, g * width:(g + 1) * width],
                                    d["tile_seq"], d["tile_start"], num_tiles, block_m, splits,
                                    d["seq_rows"][:n], d["table_pairs"].view(-1, 2), num_pairs,
                                    tables)
                     for g in range(self.num_groups))

    def _stage_sequences(self, batch: BatchLayout, n: int, qsl: np.ndarray, h) -> int:
        """Block-table entries new to the device, context lengths and slot mapping of the n
        real sequences, vectorized over the batch (no per-token Python). Returns the number
        of table entries staged."""
        if not n:
            return 0
        bs, width = self.block_size, self.sizes.max_blocks
        starts = np.asarray(batch.starts, dtype=np.int64)
        q = np.diff(qsl[:n + 1])
        ends = starts + q
        used = -(-ends // bs)
        have = np.fromiter((len(t) for t in batch.block_tables), dtype=np.int64, count=n)
        short = np.nonzero(have < used)[0]
        if len(short):
            i = int(short[0])
            raise ValueError(f"sequence {i}: {int(ends[i])} tokens need {int(used[i])} blocks, "
                             f"its table has {int(have[i])}")
        if int(used.max()) > width:
            raise ValueError(f"a sequence needs {int(used.max())} blocks; tables hold {width}")
        more = [batch.tables(g)[:n] for g in range(1, self.num_groups)]
        seq_rows, count = self.tables.stage(batch.block_tables[:n], used, have, batch.table_ids,
                                            h["table_pairs"].reshape(-1, 2), more)
        h["seq_rows"][:n] = seq_rows
        h["seq_lens"][:n] = ends
        seq_row = np.repeat(seq_rows, q)
        pos = np.arange(int(qsl[n])) - np.repeat(qsl[:n], q) + np.repeat(starts, q)
        for g in range(self.num_groups):
            block = self.tables.host[seq_row, g * width + pos // bs].astype(np.int64)
            h[self._slot_region(g)][:int(qsl[n])] = block * bs + pos % bs
        return count

    def forward(self, q, k, v, rope, cache, meta: TritonMetadata, scale: float,
                spec: LayerAttention = FULL, sinks=None):
        cos, sin = rope
        k_cache, v_cache = cache[0], cache[1]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, q=q, cos=cos[:, 0], sin=sin[:, 0])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)        # [T, H, D]
        split = meta.num_splits > 1
        ta.paged_attention(q, k_cache, v_cache, out, block_tables=meta.block_tables,
                           seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc,
                           tile_seq=meta.tile_seq, tile_start=meta.tile_start,
                           num_tiles=meta.num_tiles, block_m=meta.block_m, scale=scale,
                           num_splits=meta.num_splits,
                           partial_out=self.partial_out if split else None,
                           partial_lse=self.partial_lse if split else None,
                           window=spec.window, softcap=spec.softcap,
                           sinks=sinks.float() if sinks is not None else None)
        return out
