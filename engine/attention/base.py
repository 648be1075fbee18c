"""The attention backend interface: metadata built once per step, one call per layer.

    runner, once per step:  meta = backend.build(batch, buffers, pad_to)   (host work + staging)
                            buffers.upload(..., backend.staged(meta))      (one H2D copy)
                            backend.prepare(meta)                          (device-side setup)
    each layer:             out = backend.forward(q, k, v, rope, cache, meta[g], scale)

`meta` holds one part per KV group (engine.kv_groups): layer l of group g passes meta[g] and its
cache plane kv[slot]; the parts differ in the block tables and the slots new tokens go to.

`forward` stores the step's new K/V (rotary applied to q and k) into their slots of the layer's
cache [2, num_blocks, block_size, kv_heads, head_dim] and attends each sequence's new queries
over its whole context, causally: query j of a sequence with `start` cached tokens sits at
position start + j. The model never branches on the device or the backend; a backend also says
which kernels the model's other layers (norms, activation) use with it (`kernels`).

Backends: `torch` (engine.attention.torch_backend: pure torch, the CPU path and the reference)
and `triton` (engine.attention.triton_backend: Triton kernels, the default on CUDA, the only
one CUDA graphs can capture).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.config import FULL, LayerAttention, ModelConfig


@dataclass(frozen=True)
class BatchLayout:
    """A step's sequences as the host knows them. Sequence i has `starts[i]` tokens in the cache
    before this step and `q_lens[i]` new ones (rows sum(q_lens[:i]) .. of the step);
    `block_tables[i]` holds at least ceil((starts[i] + q_lens[i]) / block_size) block ids.
    `table_ids[i]` (optional) names table i for as long as it lives: a table only grows under
    its id (or releases entries no query reads any more), so a backend may keep it on the
    device and upload only what it adds (engine.attention.block_tables); a table that changes
    otherwise needs a new id. `block_tables` are KV group 0's, `more_tables[g - 1]` group g's
    (none: group 0's tables serve every group, as in a profiling step). `rope_long[i]`: a
    LongRoPE model's sequence i takes the long factors at every position
    (engine.layers.rotary)."""

    block_tables: Sequence[Sequence[int]]
    starts: Sequence[int]
    q_lens: Sequence[int]
    table_ids: Sequence[int | None] | None = None
    more_tables: tuple[Sequence[Sequence[int]], ...] = ()
    rope_long: Sequence[bool] | None = None
    lora_slots: Sequence[int] | None = None    # each sequence's LoRA slot (-1: the base model)

    def tables(self, group: int) -> Sequence[Sequence[int]]:
        if group == 0 or not self.more_tables:
            return self.block_tables
        return self.more_tables[group - 1]

    @classmethod
    def of_groups(cls, tables: Sequence[Sequence[Sequence[int]]], starts, q_lens,
                  table_ids=None, rope_long=None, lora_slots=None) -> "BatchLayout":
        """From each sequence's tables per group (KVCacheManager.group_tables)."""
        groups = len(tables[0]) if tables else 1
        return cls([t[0] for t in tables], starts, q_lens, table_ids,
                   tuple([t[g] for t in tables] for g in range(1, groups)),
                   rope_long if rope_long and any(rope_long) else None,
                   lora_slots if lora_slots and any(s >= 0 for s in lora_slots) else None)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.q_lens)


@dataclass(frozen=True)
class BufferSizes:
    """Capacities the runner's StepBuffers are allocated for."""

    max_tokens: int        # rows of one step
    max_seqs: int          # sequences of one step
    max_blocks: int        # blocks of one sequence (block table width)


class AttentionBackend(abc.ABC):
    name: str
    kernels = "torch"            # what RMSNorm / SiluAndMul (and rotary) use: torch, cpu, triton
    cuda_graphs = False          # whether build()'s metadata can be captured and replayed

    def __init__(self, model: ModelConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device, sizes: BufferSizes, num_groups: int = 1) -> None:
        self.model = model
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.sizes = sizes
        self.num_groups = num_groups        # KV groups: a part of the metadata each

    def regions(self, sizes: BufferSizes) -> list[tuple[str, int, torch.dtype]]:
        """StepBuffers regions this backend stages its metadata in, for buffers of `sizes`
        (declared before the block tables)."""
        return []

    def tail_region(self, sizes: BufferSizes) -> tuple[str, int, torch.dtype] | None:
        """A region declared last, of which a step uploads only `staged(meta)` elements (the
        block-table entries it adds); None if the backend builds its own metadata tensors."""
        return None

    def staged(self, meta) -> int:
        """Elements of the tail region this step's metadata uses."""
        return 0

    def prepare(self, meta) -> None:
        """Device-side setup after the step's upload, before the model runs (or its graph
        replays)."""

    @abc.abstractmethod
    def build(self, batch: BatchLayout, buffers, pad_to: int | None = None) -> tuple:
        """This step's metadata: a part per KV group. With `pad_to` (CUDA graphs: decode-only
        batches), the batch is padded with empty sequences (one row each, no context, KV not
        stored) up to `pad_to`."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, meta,
                scale: float, spec: LayerAttention = FULL, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] (views of the fused qkv projection), rope: cos and
        sin [T, 1, D]; cache: one layer's [2, N, block_size, KVH, D]; spec: what the layer's
        attention adds (a window, soft-capping, sinks [H] given in `sinks`). Returns
        [T, H, D]."""


_BACKENDS = {
    "torch": "engine.attention.torch_backend:TorchBackend",
    "triton": "engine.attention.triton_backend:TritonBackend",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto": triton on CUDA, torch elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be 'auto' or one of {backend_names()}, "
                         f"got {name!r}")
    return name


def create_backend(name: str, model: ModelConfig, block_size: int, dtype: torch.dtype,
                   device: torch.device, sizes: BufferSizes, cpu_attention: str = "auto",
                   num_groups: int = 1) -> AttentionBackend:
    """The backend `name` ("auto", "torch", "triton"); its module is imported only now (the
    triton one imports triton). `cpu_attention` is the torch backend's path on CPUs
    (torch_backend.CPU_ATTENTION); another backend takes only "auto"."""
    import importlib

    resolved = resolve_backend_name(name, device)
    module, cls = _BACKENDS[resolved].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    if resolved == "torch":
        return backend_cls(model, block_size, dtype, device, sizes, num_groups,
                           cpu_attention=cpu_attention)
    if cpu_attention != "auto":
        raise ValueError(f"--cpu-attention {cpu_attention} is a path of the torch attention "
                         f"backend on CPUs, not of {resolved!r}")
    return backend_cls(model, block_size, dtype, device, sizes, num_groups)
