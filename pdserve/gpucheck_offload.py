"""The KV offload rows of `make gpu-check` (pdserve.gpucheck calls `run`; on CPUs `--quick` runs
them on tiny shapes as a smoke test):

  bandwidth   a Llama-3-8B-shaped pool (bf16, 32 layers, 8 KV heads of 128, blocks of 16
              tokens: 2 MiB a block): blocks stored into the host tier (engine.kv_offload, the
              path an eviction takes: checksum, copy into page-locked memory) and restored into
              other pool blocks (copy, checksum compared), against a plain copy of as many
              bytes between the device and page-locked memory. Target: >= 70% of it each way.
  race        stores and restores on the tiers' stream in the engine's order (begin, poll,
              finish) while the compute stream runs matmuls and rewrites the blocks: every
              checksum compared, every restored block equal to what was stored
"""

from __future__ import annotations

import time

import torch

from pdserve.gpucheck_device import sync

TARGET_SHARE = 0.7


def _offload(kv: torch.Tensor, blocks: int):
    from engine.kv_offload import KVOffload, OffloadSettings

    shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
    return KVOffload(OffloadSettings(host_blocks=blocks), lambda: kv, shape, kv.dtype, kv.device)


def _store_all(off, kv: torch.Tensor, ids: list[int]) -> float:
    sync(kv.device)
    t0 = time.perf_counter()
    for b in ids:
        off.seen(1000 + b)
    off.store([(b, 1000 + b, (b,)) for b in ids])       # one allocation's evictions
    sync(kv.device)
    return time.perf_counter() - t0


def _restore_all(off, kv: torch.Tensor, ids: list[int], into: list[int]) -> tuple[float, int]:
    hashes = [1000 + b for b in ids]
    sync(kv.device)
    t0 = time.perf_counter()
    run = off.find_run(hashes, [(b,) for b in ids])
    good = off.restore(run, into)
    sync(kv.device)
    return time.perf_counter() - t0, good


def _plain_copies(kv: torch.Tensor, n: int) -> tuple[float, float]:
    """Seconds of a device -> page-locked copy of n blocks' bytes, and back."""
    per = kv[:, :, 0].numel()
    src = torch.empty(n * per, dtype=kv.dtype, device=kv.device)
    host = torch.empty(n * per, dtype=kv.dtype, pin_memory=kv.device.type == "cuda")
    times = []
    for dst, source in ((host, src), (src, host)):
        dst.copy_(source, non_blocking=True)        # warm
        sync(kv.device)
        t0 = time.perf_counter()
        dst.copy_(source, non_blocking=True)
        sync(kv.device)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def run(report, device: str, quick: bool) -> None:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    layers, heads, dim, blocks = (2, 2, 16, 16) if quick else (32, 8, 128, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    kv = torch.randn(layers, 2, 2 * blocks, 16, heads, dim, device=dev).to(dtype)
    per_block = kv[:, :, 0].numel() * kv.element_size()
    ids, into = list(range(blocks)), list(range(blocks, 2 * blocks))
    want = kv[:, :, :blocks].clone()
    off = _offload(kv, blocks)
    _store_all(_offload(kv, blocks), kv, ids[:4])          # warm the paths
    store_s = _store_all(off, kv, ids)
    restore_s, good = _restore_all(off, kv, ids, into)
    d2h_s, h2d_s = _plain_copies(kv, blocks)
    nbytes = blocks * per_block
    intact = good == blocks and torch.equal(kv[:, :, blocks:], want)
    for what, secs, plain in (("store (device -> host tier)", store_s, d2h_s),
                              ("restore (host tier -> device)", restore_s, h2d_s)):
        share = plain / secs if secs > 0 else 0.0
        report.add("kv offload", f"{what}, {blocks} blocks of {per_block / 2**20:.2f} MiB",
                   f"{nbytes / secs / 1e9:.2f} GB/s, {share:.0%} of a plain page-locked copy "
                   f"({nbytes / plain / 1e9:.2f} GB/s){'' if intact else ', CORRUPTED'}",
                   f">= {TARGET_SHARE:.0%}, intact",
                   intact if quick or not cuda else intact and share >= TARGET_SHARE)
    race(report, kv, off, ids, into, want, cuda)
    if cuda:
        exact_pinning(report, kv)


def exact_pinning(report, kv: torch.Tensor) -> None:
    """A host tier of an odd size locks exactly its bytes (engine.pinned), outside torch's
    pinned allocator (which would round it up to a power of two and keep it)."""
    from engine.pinned import pinned_bytes

    blocks = 300                                   # not a power of two of anything
    per = kv[:, :, 0].numel() * kv.element_size()
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before, cached = pinned_bytes(), stats().get("allocated_bytes.all.current", 0)
    tier = _offload(kv, blocks)
    locked = pinned_bytes() - before
    grew = stats().get("allocated_bytes.all.current", 0) - cached
    ok = locked == blocks * per and grew < blocks * per and tier.tiers[0].data.is_pinned()
    report.add("kv offload", f"host tier of {blocks} blocks ({blocks * per / 2**20:.0f} MiB)",
               f"{locked / 2**20:.0f} MiB page-locked by registration, torch's pinned "
               f"allocator grew {grew / 2**20:.0f} MiB, is_pinned "
               f"{tier.tiers[0].data.is_pinned()}", "exactly its bytes", ok)
    from kvtransfer.staging import HostStaging

    nbytes = 3 * 2**20 + 4096                      # the grpc transport's staging buffer
    before, cached = pinned_bytes(), stats().get("allocated_bytes.all.current", 0)
    buf = HostStaging(kv.device).reserve(nbytes)
    locked = pinned_bytes() - before
    grew = stats().get("allocated_bytes.all.current", 0) - cached
    report.add("kv offload", f"grpc staging buffer of {nbytes} bytes",
               f"{locked} bytes page-locked, torch's pinned allocator grew {grew}, is_pinned "
               f"{buf.data.is_pinned()}", "exactly its bytes",
               locked == nbytes and grew < nbytes and buf.data.is_pinned())


def race(report, kv: torch.Tensor, off, ids: list[int], into: list[int], want: torch.Tensor,
         cuda: bool) -> None:
    """The engine's order, on its streams, with the compute stream kept busy: each round the
    compute stream queues matmuls and writes a new pattern into the source blocks; they are
    stored under new hashes (the tiers' stream waits for that work); the sources are zeroed at
    once (the compute stream waits for the store's copies); a restore into other blocks is
    begun, more matmuls queued, and the restore polled until done, then finished and compared.
    Every checksum must match and every restored block equal its round's pattern."""
    kv[:, :, into[0]:into[-1] + 1] = 0
    n = 64 if not cuda else 4096
    x = torch.randn(n, n, device=kv.device, dtype=kv.dtype) / n ** 0.5
    rounds, failures, polls, intact, begin_s = 4, 0, 0, True, 0.0
    src = slice(ids[0], ids[-1] + 1)
    dst = slice(into[0], into[-1] + 1)
    for r in range(rounds):
        for _ in range(16):
            x = torch.tanh(x @ x)
        pattern = torch.roll(want, r + 1, dims=-1)
        kv[:, :, src] = pattern
        hashes = [(r + 1) * 100_000 + b for b in ids]
        for h in hashes:
            off.seen(h)
        off.store([(b, h, (h,)) for b, h in zip(ids, hashes)])
        kv[:, :, src] = 0                       # the blocks' next owner writes them
        t0 = time.perf_counter()
        job = off.begin_restore(off.find_run(hashes, [(h,) for h in hashes]), into)
        begin_s += time.perf_counter() - t0
        for _ in range(16):
            x = torch.tanh(x @ x)
        while not job.done():
            polls += 1
            time.sleep(1e-4)
        good = off.finish_restore(job)
        failures += len(ids) - good
        intact = intact and torch.equal(kv[:, :, dst], pattern)
        kv[:, :, dst] = 0
    sync(kv.device)
    sums = sum(t.stats.checksum_failures for t in off.tiers)
    report.add("kv offload", f"stores and restores on the tiers' stream beside compute "
               f"({rounds} rounds of {len(ids)} blocks)",
               f"{failures} blocks refused, {sums} checksum failures, "
               f"{'intact' if intact else 'CORRUPTED'}; begin_restore returned in "
               f"{begin_s / rounds * 1e3:.2f} ms a round, {polls} polls until done",
               "none, intact", intact and failures == 0 and sums == 0)
