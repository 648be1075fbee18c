"""CUDA graphs of the model's forward pass for decode-only steps, one per batch-size bucket.

A decode step of B sequences replays the graph of the smallest bucket >= B: the runner stages
the B sequences and pads the rest (one row each, no context, nothing stored), so each graph
always launches the same kernels on the same buffers (engine.step_buffers). Graphs are captured
at start, largest bucket first, sharing one memory pool; each is warmed up eagerly first (the
Triton kernels compile then, outside capture). Logits and sampling run eagerly after the replay
(only the real rows). Steps with prompt chunks or speculative verification run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond; max_batch last."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)
    out.append(max_batch)
    return out


class DecodeGraphs:
    """`runner` provides model, kv, buffers and stage_empty_decode(rows)."""

    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The bucket a decode step of num_seqs sequences replays, or None (run it eagerly)."""
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def capture(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(r.device)
        pool = None
        with torch.inference_mode():
            for b in reversed(self.buckets):
                meta = r.stage_empty_decode(b)
                ids, pos = r.buffers.dev["input_ids"][:b], r.buffers.dev["positions"][:b]
                for _ in range(2):
                    r.model(ids, pos, r.kv, meta)
                torch.cuda.synchronize(r.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = r.model(ids, pos, r.kv, meta)
                pool = graph.pool()
                self._graphs[b] = (graph, out)
        torch.cuda.synchronize(r.device)
        self.memory_bytes = torch.cuda.memory_reserved(r.device) - before
        log.info("captured %d CUDA graphs (decode batches %s) in %.1f s, %.0f MiB",
                 len(self.buckets), ",".join(map(str, self.buckets)), time.perf_counter() - t0,
                 self.memory_bytes / 2**20)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the captured forward over the staged inputs; hidden states [bucket, hidden]."""
        graph, out = self._graphs[bucket]
        graph.replay()
        return out


__all__ = ["DecodeGraphs", "graph_buckets"]
