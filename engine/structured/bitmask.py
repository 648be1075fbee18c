"""Token bitmasks: bit j of row r (word j // 32, bit j % 32, little end first) is 1 when token j
is allowed for row r. int32 words, the layout xgrammar fills. Pure torch: the same code masks
logits on CPUs and on CUDA (no xgrammar kernels, no host syncs, so it can sit in a CUDA graph
when the bitmask lives in a persistent buffer)."""

from __future__ import annotations

import torch

def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for vocab_size tokens."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """int32 [rows, words] on the CPU with every bit set (every token allowed). pin_memory:
    page-locked, for an asynchronous copy to the device."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32,
                      pin_memory=pin_memory)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [R, V] float, bitmask [R, words >= ceil(V / 32)] int32 on the same
    device; logits[r, j] = -inf where bit j of row r is 0. Rows with every bit set are
    unchanged; words beyond V are ignored."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)}")
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits "
                         f"{tuple(logits.shape)} (need [{rows}, >= {bitmask_words(vocab)}])")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask on {bitmask.device}, logits on {logits.device}")
    # built on the device each call (no cached tensors, no host copies: capturable in a graph)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(rows, -1)[:, :vocab]
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    # where(out=logits) rather than masked_fill_: branch-free, ~2x faster on CPUs
    torch.where(allowed, logits, neg_inf, out=logits)
