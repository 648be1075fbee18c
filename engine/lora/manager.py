"""The adapters a worker knows, and which of them sit in the model's slots.

    add(name, path)      load and check an adapter (engine.lora.adapter); known from then on
    remove(name)         forget it (requests already admitted with it keep their copy)
    activate(names)      before a step: every adapter the step uses in a slot -> name -> slot

`--max-loras` slots hold adapters on the device (engine.lora.layers: stacks in every adapted
projection). Under tensor parallelism every rank holds its share of each slot: a merged
(column-parallel) projection the rows of B its output rows are, a row-parallel one the columns
of A its input features are (its h summed over the ranks before the expand); rank 0 decides,
and hands each adapter it writes into a slot to the other ranks (`on_write`). A step uses at most that many adapters (the scheduler admits no request whose
adapter would make more among the running ones); `activate` writes a missing one into a slot
no adapter of the step holds, the least recently used first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from engine.lora.adapter import TARGETS, AdapterError, LoRAAdapter, load_adapter
from engine.lora.layers import LoRABatch, LoRALinear, LoRAState

log = logging.getLogger(__name__)

# the wrapped projections of a decoder layer: (path in the layer, shards' checkpoint names)
_MODULES = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            ("self_attn.o_proj", ("o_proj",), None),
            ("mlp.gate_up_proj", ("gate_proj", "up_proj"), "gate_up_proj"),
            ("mlp.down_proj", ("down_proj",), None))


def _get(root, path: str):
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


class LoRAManager:
    def __init__(self, model: torch.nn.Module, model_cfg, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, triton: bool = False) -> None:
        """Rank 0 of a tensor-parallel engine sets `on_write(slot, adapter)`: the other ranks
        write the same adapter into the same slot."""
        self.on_write = None
        if max_loras < 1 or max_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        self.model_cfg = model_cfg
        self.max_loras, self.max_rank = max_loras, max_rank
        self.state = LoRAState(device, dtype, triton)
        self.layers: dict[tuple[int, str], tuple[LoRALinear, tuple[str, ...], str | None]] = {}
        for i, layer in enumerate(model.model.layers):
            for path, parts, fused in _MODULES:
                base = _get(layer, path)
                if base is None or not hasattr(base, "weight_loader"):
                    continue                      # (an MoE layer's experts: not adapted)
                shards = ([base.shard_rows(j) for j in range(len(parts))]
                          if len(parts) > 1 else [(0, base.out_features)])
                tp = getattr(base, "tp", None)
                row = len(parts) == 1 and hasattr(base, "full_in")       # row-parallel
                reduce = tp.all_reduce if row and tp is not None and tp.size > 1 else None
                wrapped = LoRALinear(base, base.in_features, shards, max_loras, max_rank,
                                     self.state, reduce)
                owner, attr = path.rsplit(".", 1)
                setattr(_get(layer, owner), attr, wrapped)
                self.layers[i, path] = (wrapped, parts, fused)
        self._lock = threading.Lock()          # add/remove (any thread) vs activate (engine)
        self.adapters: dict[str, LoRAAdapter] = {}
        self._slots: OrderedDict[int, LoRAAdapter | None] = OrderedDict(
            (s, None) for s in range(max_loras))            # least recently used first

    # ------------------------------------------------------------------ the registry
    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load an adapter under `name` (AdapterError: why it cannot be served)."""
        if not name or not name.strip():
            raise AdapterError(f"LoRA adapter name {name!r} is not valid")
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        adapter = load_adapter(name, path, self.model_cfg, self.max_rank)
        for layer, proj in adapter.weights:
            path_ = TARGETS[proj][0]
            if (layer, path_) not in self.layers:
                raise AdapterError(f"LoRA adapter {name!r}: layer {layer} has no {proj} this "
                                   f"server adapts ({self.model_cfg.family}: an MoE layer's "
                                   "experts are not adapted)")
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
            self.adapters[name] = adapter
        log.info("LoRA adapter %s loaded from %s: rank %d, %d projections, digest %s", name,
                 path, adapter.rank, len(adapter.weights), adapter.digest)
        return adapter

    def remove(self, name: str) -> None:
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        log.info("LoRA adapter %s unloaded", name)

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        return adapter

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.adapters)

    # ------------------------------------------------------------------ the slots
    def activate(self, adapters: list[LoRAAdapter]) -> dict[str, int]:
        """Slots for a step's adapters (at most max_loras distinct), writing in those missing.
        Keys are digests: two loads of one name are two adapters."""
        want = {a.digest: a for a in adapters}
        if len(want) > self.max_loras:
            raise RuntimeError(f"a step of {len(want)} LoRA adapters; --max-loras is "
                               f"{self.max_loras}")
        out: dict[str, int] = {}
        for slot, held in self._slots.items():
            if held is not None and held.digest in want:
                out[held.digest] = slot
        for digest, adapter in want.items():
            if digest in out:
                continue
            slot = next(s for s, held in self._slots.items()
                        if held is None or held.digest not in want)
            if self.on_write is not None:
                self.on_write(slot, adapter)
            self.write(slot, adapter)
            self._slots[slot] = adapter
            out[digest] = slot
        for slot in out.values():
            self._slots.move_to_end(slot)
        return out

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """The adapter's weights into `slot`: this rank's share of each."""
        for (layer, path), (wrapped, parts, fused) in self.layers.items():
            base = wrapped.base
            if fused is not None and (layer, fused) in adapter.weights:
                a, b = adapter.weights[layer, fused]           # split B by the projections
                starts = [sum(base.full_sizes[:j]) for j in range(len(parts))]
                pieces = [(a, b[s:s + n]) for s, n in zip(starts, base.full_sizes)]
            else:
                pieces = [adapter.weights.get((layer, p)) for p in parts]
            if hasattr(base, "splits"):                 # merged: this rank's rows of each B
                pieces = [None if pc is None else (pc[0], pc[1][s:s + n])
                          for pc, (s, n) in zip(pieces, base.splits)]
            elif hasattr(base, "full_in") and base.tp.size > 1:   # row-parallel: A's columns
                w, r = base.in_features, base.tp.rank
                pieces = [None if pc is None else (pc[0][:, r * w:(r + 1) * w], pc[1])
                          for pc in pieces]
            wrapped.set_slot(slot, pieces, adapter.scaling)

    def set_batch(self, slots: list[int] | None, q_lens: list[int]) -> None:
        """The step's rows per slot (None: every row the base model's)."""
        self.state.batch = (LoRABatch.of(list(slots), list(q_lens), self.state.device,
                                         self.state.triton)
                            if slots is not None else LoRABatch())
