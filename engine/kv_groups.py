"""KV groups: which layers share a block table, and how much of the context each group keeps.

A model whose layers all attend the whole context has one group: every layer, one block table
per sequence. A model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral, Qwen2 with
sliding layers) splits its layers by attention kind: the full layers, and the layers of each
window size, each kind cut into groups of at most `slots` layers. Every group has a block
table per sequence; a sliding group's table releases the blocks that fell wholly out of the
window of every query still to come (their entries become NULL_BLOCK), so what a sequence
holds for that group is bounded by the window, not by the context.

The pool is one tensor of `slots` layer planes: kv[slot, k_or_v, block, ...]. A block id is a
page of those planes and any group may hold it (one free queue, one budget): layer l reads and
writes kv[slot_of(l)] at the blocks of group_of(l)'s table. A group of fewer layers than
`slots` leaves the rest of its pages unused (the padding a group plan weighs).

    Gemma 3, 26 layers (every 6th global): slots 4, groups [full x4] [w512 x4] x5 [w512 x2]
    gpt-oss, 24 layers alternating:        slots 12, groups [w128 x12] [full x12]
    a dense model:                          slots = layers, one full group

On the wire a block is the same page; a transfer lists the (group, block index) entries the
receiver needs in `transfer_order` (engine.kv_cache_manager), the same on both ends.

Torch-free (the KV layout imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = 0          # a released sliding entry's id in a table: never read by a kernel
MAX_GROUPS = 8          # more than this and sliding layers keep the whole context instead


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]                 # per group: 0 (full) or the sliding window
    layers: tuple[tuple[int, ...], ...]      # per group: its layers, in order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def slots(self) -> int:
        """Layer planes of a block: the largest group's layer count."""
        return max(len(g) for g in self.layers)

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.layers)

    @property
    def sliding(self) -> bool:
        return any(self.windows)

    def placement(self) -> list[tuple[int, int]]:
        """(group, slot) of each layer."""
        out = [(0, 0)] * self.num_layers
        for g, layers in enumerate(self.layers):
            for s, layer in enumerate(layers):
                out[layer] = (g, s)
        return out

    def first_needed(self, group: int, position: int, block_size: int) -> int:
        """The first block of the group's table that queries at `position` or later read: the
        window of a query at p starts at p - window + 1."""
        w = self.windows[group]
        if not w:
            return 0
        return max(position - w + 1, 0) // block_size

    def describe(self) -> str:
        parts = [f"{len(layers)} {'full' if not w else f'sliding {w}'}"
                 for w, layers in zip(self.windows, self.layers)]
        return f"{self.num_groups} KV groups of {self.slots} layer slots ({', '.join(parts)})"


def dense(num_layers: int) -> KVGroups:
    return KVGroups((0,), (tuple(range(num_layers)),))


def plan(windows: list[int], max_model_len: int) -> KVGroups:
    """The groups for layers of these windows (0: full). A window that covers max_model_len is
    full attention as far as the cache goes. Kinds are cut into groups of the smallest kind's
    layer count (a group of each kind, padding the last), full layers first; when that makes
    more than MAX_GROUPS groups the layers keep the whole context in one group (each still
    attends its window)."""
    kinds: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        w = w if 0 < w < max_model_len else 0
        kinds.setdefault(w, []).append(layer)
    if len(kinds) <= 1:
        return KVGroups((next(iter(kinds), 0),), (tuple(range(len(windows))),))
    size = min(len(v) for v in kinds.values())
    out_w: list[int] = []
    out_l: list[tuple[int, ...]] = []
    for w in sorted(kinds):                         # full (0) first, then by window
        layers = kinds[w]
        for i in range(0, len(layers), size):
            out_w.append(w)
            out_l.append(tuple(layers[i:i + size]))
    if len(out_w) > MAX_GROUPS:
        return dense(len(windows))
    return KVGroups(tuple(out_w), tuple(out_l))


def of_engine(model_cfg, engine_cfg) -> KVGroups:
    """The groups a ModelConfig's layers get under an EngineConfig (its max_model_len, 0: the
    model's)."""
    return for_model(model_cfg, engine_cfg.max_model_len or model_cfg.max_position_embeddings)


def for_model(model_cfg, max_model_len: int) -> KVGroups:
    """The groups of a ModelConfig's layers (engine.config.LayerAttention windows)."""
    return plan([model_cfg.attention_of(i).window for i in range(model_cfg.num_layers)],
                max_model_len)
