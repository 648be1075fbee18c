"""Which exceptions of an engine step leave the device unusable.

Some CUDA errors are sticky: after an illegal memory access, a device-side assert or a launch
failure the process's CUDA context is corrupted and every later CUDA call fails with the same
error. An engine that failed the batch and went on would fail every later step while its health
said SERVING. `sticky_error` tells them apart: the known sticky errors by their message (in the
exception or its causes), and any other error of a CUDA engine by a probe of the device (a
synchronize and a tiny kernel) that fails when the context is gone. A plain per-request error
(bad input, a bug in one request's path) passes the probe and fails only its batch.
"""

from __future__ import annotations

import torch

# the messages of CUDA's sticky errors (cudaErrorIllegalAddress, cudaErrorAssert,
# cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction,
# cudaErrorInvalidPc, cudaErrorHardwareStackError, cudaErrorECCUncorrectable, ...)
STICKY_MESSAGES = ("illegal memory access", "device-side assert", "unspecified launch failure",
                   "misaligned address", "illegal instruction", "invalid program counter",
                   "hardware stack error", "uncorrectable ecc error", "launch timed out",
                   "cudaerrorillegaladdress", "cudaerrorassert", "cudaerrorlaunchfailure")


class DeviceFailure(RuntimeError):
    """The device is unusable after an error: the engine stops (its worker goes NOT_SERVING
    and is restarted) instead of failing every later step."""


def probe_device(device: torch.device) -> None:
    """Raises when `device` no longer runs work (a CUDA device's context after a sticky
    error); nothing to probe on CPUs."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.ones(1, device=device).add_(1).item()


def sticky_error(exc: BaseException, device: torch.device) -> str | None:
    """Why the device is unusable after `exc`, or None when only the step failed."""
    seen, e = [], exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    text = " | ".join(f"{type(e).__name__}: {e}" for e in seen)
    if any(m in text.lower() for m in STICKY_MESSAGES):
        return text
    try:
        probe_device(device)
    except Exception as probe:       # noqa: BLE001 (any failure of the probe says it)
        return f"{text} (then the device itself failed: {type(probe).__name__}: {probe})"
    return None
