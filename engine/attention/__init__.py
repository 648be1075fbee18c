"""Attention backends (engine.attention.base): `torch` (pure torch, CPUs, the reference) and
`triton` (Triton kernels, CUDA). Importing this package imports neither backend's module."""

from engine.attention.base import (AttentionBackend, BatchLayout, BufferSizes, backend_names,
                                   create_backend, resolve_backend_name)

__all__ = ["AttentionBackend", "BatchLayout", "BufferSizes", "backend_names", "create_backend",
           "resolve_backend_name"]
