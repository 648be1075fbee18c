"""Paged attention on x86 CPUs with AVX2 (fp32), for decodes and short queries after cached
context: blocks read in place through the block table, the query heads of one KV head sharing
every K/V row (csrc/cpu_attention.cpp, compiled on first use by pdkernels.cpu_build).

The contract is pdkernels/triton_attention.py's (sequence i: q_lens[i] queries at rows
q_start[i].., seq_lens[i] tokens of context including them, causal), without tiles or splits;
its torch reference is triton_attention.paged_attention_ref. `available()` is false where it
cannot run (an x86 CPU without AVX2 and FMA, or not x86, no compiler, a failed build); the torch
attention backend then keeps its gather + SDPA path. It runs on AVX-512 hosts too; whether the
backend uses it by default is engine.attention.torch_backend's choice (`--cpu-attention`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdkernels import cpu_build

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not cpu_build.avx2_capable():
        return None
    lib = cpu_build.load(SOURCE, cpu_build.AVX2_FLAGS,
                         "CPU attention kernel (torch's attention used instead)")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_paged_attention.argtypes = [
        ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64,
        i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, i64, ctypes.c_float, ptr]
    lib.pdserve_paged_attention.restype = ctypes.c_int
    lib.pdserve_attention_max_block.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def max_block() -> int:
    """The longest block (tokens) the kernel takes; 0 where it cannot run."""
    lib = _library()
    return lib.pdserve_attention_max_block() if lib is not None else 0


def supports(head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Shapes the kernel takes (else the caller uses torch's attention)."""
    lib = _library()
    return (lib is not None and dtype == torch.float32 and head_dim % 8 == 0
            and 1 <= block_size <= lib.pdserve_attention_max_block())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    q_start: torch.Tensor, q_lens: torch.Tensor, scale: float,
                    window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> None:
    """Rows of the listed sequences of out [T, heads, head_dim] = their causal attention
    (within the last `window` positions, scores soft-capped, a sink logit per head [heads]
    fp32: where given).

    q [T, heads, head_dim] (last dim contiguous), k_cache / v_cache [num_blocks, block_size,
    kv_heads, head_dim] (same strides, last dim contiguous), block_tables [n, W] int32 (row i:
    sequence i's blocks), seq_lens, q_start, q_lens [n] int32: all fp32 / int32 CPU tensors."""
    lib = _library()
    if lib is None:
        raise RuntimeError("CPU attention kernel unavailable (see available())")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"{name}: a float32 CPU tensor with a contiguous last dim "
                             f"expected, got {t.dtype} on {t.device}, strides {t.stride()}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache need the same strides")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("q_start", q_start), ("q_lens", q_lens)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor, got {t.dtype}")
    if sinks is not None:
        sinks = sinks.float().contiguous()
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"sinks: [{q.shape[1]}] expected, got {tuple(sinks.shape)}")
    n = seq_lens.numel()
    if not n:
        return
    _, block_size, kv_heads, head_dim = k_cache.shape
    rc = lib.pdserve_paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), q_start.data_ptr(), q_lens.data_ptr(), n,
        out.data_ptr(), out.stride(0), out.stride(1), q.shape[1], kv_heads, head_dim,
        block_size, scale, torch.get_num_threads(), window, softcap,
        sinks.data_ptr() if sinks is not None else None)
    if rc != 0:
        raise ValueError(f"CPU attention kernel: unsupported shape (head_dim {head_dim}, "
                         f"block_size {block_size}); see supports()")
