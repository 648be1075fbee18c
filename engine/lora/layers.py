"""LoRA on the decoder's projections, many adapters in one batch.

Each adapted projection (qkv_proj, o_proj, gate_up_proj, down_proj of every layer) is wrapped in
a `LoRALinear` holding stacks over the resident adapters' slots, its shards' (q, k, v of
qkv_proj; gate, up of gate_up_proj; the whole output otherwise, the shards tiling it) side by
side:

    A [slots, shards * R, in]     B[s] [slots, R, out_s] per shard s (B^T: h B^T is h @ B[s])
                                  (R = --max-lora-rank; a lower rank and a projection an adapter
                                   leaves alone: zeros; B already times the adapter's scaling)

A step's rows come grouped by slot (`LoRABatch`, built once per step by the runner from each
sequence's slot): the base output, then for each slot present h = x[rows] A^T once, each
shard's h_s B_s^T side by side, added into y[rows] (`lora_delta`: the reference faster paths
are checked against). Rows of the base model (slot -1) take nothing. With the Triton attention
backend (CUDA), pdkernels.triton_lora does it: rows grouped by slot once a step (its plan), a
shrink and an expand launch per projection.

A step of several adapters takes `lora_delta_masked` instead (up to MASKED_SLOTS slots): every
row against every slot's A at once (one matmul), the products of slots not the row's zeroed by
a mask built once a step, then one matmul per shard against every slot's B stacked: no
gathers or scatters, whose per-call cost dominated (`pdserve stepbench --loras 4`: a decode
step of 32 sequences 149 -> 125 ms, the base step ~90; docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


MASKED_SLOTS = 8          # most slots lora_delta_masked computes every row against


@dataclass
class LoRABatch:
    """A step's rows per resident adapter: (slot, row indices [n] long) for each slot used;
    `row_slot` [T] long: each row's slot (-1: the base model)."""

    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    row_slot: torch.Tensor | None = None
    plan: object = None            # the Triton path's rows by slot (pdkernels.triton_lora)
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, slots: list[int], q_lens: list[int], device: torch.device,
           triton: bool = False) -> "LoRABatch":
        """From each sequence's slot (-1: the base model) and its rows this step; `triton`:
        with the plan of pdkernels.triton_lora."""
        rows: dict[int, list[int]] = {}
        r = 0
        for slot, n in zip(slots, q_lens):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(r, r + n))
            r += n
        row_slot = torch.tensor([s for s, n in zip(slots, q_lens) for _ in range(n)],
                                dtype=torch.long, device=device)
        segments = sorted(rows.items())
        plan = None
        if triton:
            from pdkernels import triton_lora
            plan = triton_lora.plan(segments, device)
        return cls([(s, torch.tensor(idx, dtype=torch.long, device=device))
                    for s, idx in segments], row_slot, plan)

    def mask(self, slots: int, shards: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots, shards, rank]: 1 where the column's slot is the row's (built once)."""
        key = (slots, shards, rank, dtype)
        if key not in self._masks:
            own = self.row_slot[:, None] == torch.arange(slots, device=self.row_slot.device)
            self._masks[key] = own[:, :, None, None].expand(-1, -1, shards, rank).to(dtype)
        return self._masks[key]


def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor],
               batch: LoRABatch, reduce=None) -> None:
    """y[rows] += [h_s @ b[s][slot] for each shard s] with h = x[rows] @ A[slot]^T, for each
    slot's rows (in place). x [T, in], y [T, out]; a [slots, shards * R, in], b[s] [slots, R,
    out_s] (the out_s summing to out). `reduce` (tensor parallelism, a row-parallel layer: x
    and A hold this rank's input features): sums h over the ranks between shrink and expand."""
    rank = b[0].shape[1]
    whole = len(batch.segments) == 1 and batch.segments[0][1].numel() == x.shape[0]
    if whole:
        slot = batch.segments[0][0]
        h = x @ a[slot].t()                                       # [T, shards * R]
    else:
        h = x.new_zeros(x.shape[0], a.shape[1])
        for slot, rows in batch.segments:
            h.index_copy_(0, rows, x.index_select(0, rows) @ a[slot].t())
    if reduce is not None:
        h = reduce(h)
    for slot, rows in batch.segments:
        hs = h if whole else h.index_select(0, rows)
        parts = [hs[:, i * rank:(i + 1) * rank] @ bs[slot] for i, bs in enumerate(b)]
        d = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)      # [n, out]
        if whole:
            y.add_(d.to(y.dtype))
        else:
            y.index_add_(0, rows, d.to(y.dtype))


def lora_delta_masked(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
                      b: list[torch.Tensor], batch: LoRABatch, reduce=None) -> None:
    """lora_delta's result (up to rounding) with every row against every slot: a [L, S*R, in],
    b[s] [L, R, out_s] -> y += [((x A_all^T) * mask)_s B_s,all for each shard s]."""
    slots, width, fan_in = a.shape
    shards, rank = len(b), b[0].shape[1]
    h = x @ a.view(slots * width, fan_in).t()
    if reduce is not None:
        h = reduce(h)
    h = h.view(-1, slots, shards, rank) * batch.mask(slots, shards, rank, h.dtype)
    parts = [h[:, :, i, :].reshape(-1, slots * rank)
             @ bs.view(slots * rank, -1) for i, bs in enumerate(b)]
    y.add_((parts[0] if shards == 1 else torch.cat(parts, dim=1)).to(y.dtype))


class LoRALinear(nn.Module):
    """A projection and its adapters' stacks (see the module docstring). `shards`: the output
    columns each adaptable part fills (one part: the whole output)."""

    def __init__(self, base: nn.Module, in_features: int, shards: list[tuple[int, int]],
                 slots: int, rank: int, state: "LoRAState", reduce=None) -> None:
        """`reduce`: a row-parallel layer's all-reduce (its input split over the ranks)."""
        super().__init__()
        self.base = base
        self.shards = shards
        self.state = state
        self.reduce = reduce
        dtype, device = state.dtype, state.device
        if [lo for lo, _ in shards] != [0] + [hi for _, hi in shards[:-1]]:
            raise ValueError(f"LoRA shards {shards} do not tile the output")
        self.rank = rank
        self.a = torch.zeros(slots, len(shards) * rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, rank, hi - lo, dtype=dtype, device=device)
                  for lo, hi in shards]

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
                 scaling: float) -> None:
        """Write an adapter's A and B (per shard; None: that part not adapted) into `slot`."""
        self.a[slot].zero_()
        for i, part in enumerate(parts):
            self.b[i][slot].zero_()
            if part is None:
                continue
            a, b = part
            r = a.shape[0]
            self.a[slot, i * self.rank:i * self.rank + r].copy_(a)
            self.b[i][slot, :r].copy_((b * scaling).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch.plan is not None:                    # the Triton kernels
            from pdkernels import triton_lora
            triton_lora.lora_delta(y, x, self.a, self.b, batch.plan, self.reduce)
        elif len(batch.segments) > 1 and self.a.shape[0] <= MASKED_SLOTS:
            lora_delta_masked(y, x, self.a, self.b, batch, self.reduce)
        elif batch.segments:
            lora_delta(y, x, self.a, self.b, batch, self.reduce)
        return y


@dataclass
class LoRAState:
    """What every LoRALinear of a model shares: the step's rows per slot; `triton`: the
    attention backend's kernels are Triton's (the LoRA products then are too)."""

    device: torch.device
    dtype: torch.dtype
    triton: bool = False
    batch: LoRABatch = field(default_factory=LoRABatch)
