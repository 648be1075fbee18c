"""The KV layout: what one block of the pool holds, the contract both ends of a KV transfer check.

A module of its own (torch-free, no engine imports) so that transports, wire code and benches
import the layout without the Engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block across the pool (num_layers: its layer planes, every layer for a
    model of one KV group); both ends of a KV transfer must agree on it, all
    but `tensor_parallel_size`: on the wire a block always holds every KV head in order, and each
    side's rank 0 assembles them from (or splits them to) its ranks, rank r holding heads
    engine.parallel.head_range(num_kv_heads, tensor_parallel_size, r)."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int = field(default=1, compare=False)
    # the KV groups' windows (engine.kv_groups; 0: full): a block holds num_layers layer planes,
    # of one group's layers, and a transfer lists the entries each group needs
    groups: tuple[int, ...] = (0,)
