"""The CPU paths a worker can be forced onto, as pytest parameters: every test that goes over
them runs each path this host can run and says why it skips the others (an AVX-512 host runs
the AVX2 kernels, their AVX-512 build and oneDNN; an AVX2-only host runs oneDNN too)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import use_cpu_kernel
from engine.layers.linear import linear_method_for

CPU = torch.device("cpu")


def _why_not(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def linear_params(quantization: str = "none") -> list:
    """--linear-method avx2, avx512, amx, onednn, torch, each skipped (saying why) where it cannot
    run."""
    out = []
    for name in ("avx2", "avx512", "amx", "onednn", "torch"):
        why = _why_not(lambda: linear_method_for(CPU, torch.float32, quantization, name))
        out.append(pytest.param(name, id=f"linear-{name}",
                                marks=pytest.mark.skipif(why is not None, reason=why or "")))
    return out


def attention_params(head_dim: int = 64, block_size: int = 16) -> list:
    """--cpu-attention avx2 and sdpa (for the shapes given), skipped where they cannot run."""
    out = []
    for name in ("avx2", "sdpa"):
        why = _why_not(lambda: use_cpu_kernel(name, CPU, head_dim, block_size, torch.float32))
        out.append(pytest.param(name, id=f"attn-{name}",
                                marks=pytest.mark.skipif(why is not None, reason=why or "")))
    return out
