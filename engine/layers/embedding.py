"""The token embedding, vocabulary-parallel under tensor parallelism: each rank holds
ceil(vocab / N) rows (the last partition padded with zeros), looks up the ids that fall in its
rows, zeros the rest, and an all-reduce sums the ranks' lookups."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import _check_shape, _rows
from engine.parallel import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.per = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per
        self.weight = nn.Parameter(torch.empty(self.per, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None = None) -> None:
        if shard is not None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} takes no shards")
        _check_shape(loaded, (self.vocab_size, param.shape[1]))
        param.data.copy_(_rows(loaded, self.start, self.per))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(out * mine[:, None].to(out.dtype))

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows={self.start}..{self.start + self.per}"
