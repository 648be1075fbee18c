"""Page-locked host memory of exactly the size asked for.

torch's pinned allocator (`pin_memory=True`) rounds each allocation up to the next power of
two and keeps it for reuse: a 40 GiB host tier pins 64 GiB, for the life of the process.
`pinned_empty` instead allocates ordinary memory and registers it with the CUDA runtime
(cudaHostRegister): exactly its bytes are page-locked, copies from and to it run asynchronously
as from any pinned buffer, and the registration ends when the tensor is freed. Without CUDA it
is plain memory. `pinned_bytes()` is what this process has registered (logged at start).
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = 0


def pinned_bytes() -> int:
    return _registered


def _unregister(ptr: int, nbytes: int) -> None:
    global _registered
    torch.cuda.cudart().cudaHostUnregister(ptr)
    with _lock:
        _registered -= nbytes


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor, page-locked (registered) when `pin` and CUDA is here."""
    global _registered
    t = torch.empty(shape, dtype=dtype)
    if not pin or t.numel() == 0 or not torch.cuda.is_available():
        return t
    ptr, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
    # portable: pinned for every device's context, as a pinned allocation is
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (error "
                           f"{int(err)}): the host's locked-memory limit (ulimit -l) or memory")
    with _lock:
        _registered += nbytes
    weakref.finalize(t.untyped_storage(), _unregister, ptr, nbytes)
    return t
