"""Block tables that stay on the device between steps: only the entries a step adds go up.

A sequence's block table only grows while it lives (the KV cache manager appends blocks; a
preempted or finished request's table goes, and a new table gets a new id). So each table the
engine names by its id (`BatchLayout.table_ids`, the manager's `table_id`) keeps a row of a
device-resident table [rows, width] across steps, with a host mirror of what the row holds.
A step stages, as (flat index, block id) pairs, only the entries its sequences use that the
device does not have yet: one per sequence at a block boundary of a decode, a chunk's worth for
a prefill, a whole table for a sequence new to the device. On the device the pairs are
scattered into the resident table and the step's rows gathered into the fixed-address table the
kernels (and CUDA graphs) read.

With KV groups (engine.kv_groups) a row holds each group's table side by side: group g's
entries at columns g * width .. (g + 1) * width - 1. A sliding group's table releases entries
(NULL_BLOCK) that no query reads any more; the device keeps what it had there, unread.

Rows go least recently used first when a new table needs one; the table grows when one step
has more sequences than it has rows. A sequence without an id (None) gets a row for that step
only and is written whole, which is what every step cost before.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch


class DeviceBlockTables:
    def __init__(self, rows: int, width: int, device: torch.device, groups: int = 1) -> None:
        self.width = width                   # per group
        self.groups = groups
        self.device = device
        # what each device row holds
        self.host = np.zeros((rows, groups * width), dtype=np.int32)
        self.dev = torch.zeros(rows, groups * width, dtype=torch.int32, device=device)
        self._known = np.zeros((rows, groups), dtype=np.int64)   # entries valid per row, group
        self._row_of: OrderedDict[object, int] = OrderedDict()   # table id -> row, LRU first
        self._free = list(range(rows - 1, -1, -1))
        self._anonymous = itertools.count()
        self.entries_staged = 0        # entries uploaded over the tables' life (tests, metrics)

    @property
    def rows(self) -> int:
        return self.host.shape[0]

    def _grow(self, rows: int) -> None:
        old, cols = self.rows, self.host.shape[1]
        host = np.zeros((rows, cols), dtype=np.int32)
        host[:old] = self.host
        dev = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        dev[:old] = self.dev
        self.host, self.dev = host, dev
        self._known = np.concatenate([self._known,
                                      np.zeros((rows - old, self.groups), dtype=np.int64)])
        self._free = list(range(rows - 1, old - 1, -1)) + self._free

    def _row(self, key: object, this_step: set[int]) -> int:
        row = self._row_of.get(key)
        if row is not None:
            self._row_of.move_to_end(key)
            return row
        if not self._free:
            for old, r in self._row_of.items():          # least recently used first
                if r not in this_step:
                    del self._row_of[old]
                    self._free.append(r)
                    break
            else:
                self._grow(2 * self.rows)
        row = self._free.pop()
        self._known[row] = 0
        self._row_of[key] = row
        return row

    def stage(self, tables: Sequence[Sequence[int]], used: np.ndarray, have: np.ndarray,
              table_ids: Sequence[object] | None, pairs: np.ndarray,
              more: Sequence[Sequence[Sequence[int]]] = ()) -> tuple[np.ndarray, int]:
        """Rows of the step's sequences [n] and the number of (flat index, block id) pairs
        written into `pairs` [capacity, 2] int32: the first used[i] entries of each table
        (have[i] long) that its row does not hold yet; `tables` are group 0's, `more` the
        other groups' (as long)."""
        n = len(used)
        rows = np.empty(n, dtype=np.int64)
        this_step: set[int] = set()
        anonymous = []
        for i in range(n):
            if table_ids is None or table_ids[i] is None:
                key = ("anonymous", next(self._anonymous))
                anonymous.append(key)
            else:
                key = table_ids[i]
            row = self._row(key, this_step)
            this_step.add(row)
            rows[i] = row
        total = 0
        stride = self.host.shape[1]
        for g, group in enumerate([tables, *more]):
            known = self._known[rows, g]
            known = np.where(have < known, 0, known)    # never shrinks; rewritten if it did
            new = np.maximum(used - known, 0)
            count = int(new.sum())
            if total + count > len(pairs):
                raise ValueError(f"{total + count} block-table entries exceed the "
                                 f"{len(pairs)} staged")
            if count:
                lo = known.tolist()
                values = np.fromiter(itertools.chain.from_iterable(
                    group[i][lo[i]:lo[i] + k] for i, k in enumerate(new.tolist()) if k),
                    dtype=np.int64, count=count)
                cols = (np.arange(count) - np.repeat(np.cumsum(new) - new, new)
                        + np.repeat(known, new) + g * self.width)
                flat_rows = np.repeat(rows, new)
                self.host[flat_rows, cols] = values
                pairs[total:total + count, 0] = flat_rows * stride + cols
                pairs[total:total + count, 1] = values
                total += count
            self._known[rows, g] = np.maximum(known, used)
        count = total
        self.entries_staged += count
        for key in anonymous:                            # first to go
            self._row_of.move_to_end(key, last=False)
        return rows, count

    def apply(self, pairs: torch.Tensor, count: int, rows: torch.Tensor,
              out: torch.Tensor) -> None:
        """On the device, after the step's upload: the staged pairs [>= count, 2] into the
        resident table, then the step's rows [n] gathered into out [>= n, width]."""
        if count:
            p = pairs[:count].long()
            self.dev.view(-1).index_copy_(0, p[:, 0], p[:, 1].to(torch.int32))
        n = rows.shape[0]
        if n:
            torch.index_select(self.dev, 0, rows.long(), out=out[:n])
