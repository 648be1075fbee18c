"""`pdserve kvbench`: how fast each KV transport moves blocks between two processes, against a
plain memcpy, a plain TCP socket and the kernel's cross-process copy on the same machine.

The receiver is a child process with a pool in memory (kvtransfer.loopback); it prints its
transfer target, then a line per completed request. The parent owns a pool of the same layout
(the default model's: 30 layers, 3 KV heads, head size 64, blocks of 16 tokens, fp32) and sends
`--mib` of blocks per request the way a prefill worker does: `--chunk-blocks` blocks per send,
the last ones with the first token. A request's time runs from the first send to the moment the
receiver knows it is complete (both read CLOCK_MONOTONIC, which is shared by all processes).

Every transport runs with KV checksums (kvtransfer.integrity: the default, computed by the
sender, verified by the receiver on its pool) and without ("<name> no checksum", both sides
--kv-checksum off), against two receiver processes that take requests in turn (a receiver
waits idle, reading its stdin, until its turn), so load from elsewhere falls on both alike; the
row "checksum" is the checksum of one request's blocks on one side, in this process. "pool ms"
is the time the sender's reads of the pool (`run_on_pool`: on a GPU prefill worker its engine
thread, between its steps; on a CPU one a worker thread) take per request.

Baselines: memcpy = copying the same bytes between two tensors in one process (the floor for
any transport); TCP = the same bytes through one socket to the child; cma = the same regions
the nixl transport writes (one per layer, K/V and chunk), copied straight into the child's
memory with process_vm_writev, one call per chunk: the kernel's single-copy path between two
processes, which UCX uses for host memory on one machine when no xpmem/knem module is loaded
(the floor for nixl on such a host).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from engine.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch

LAYOUT = KVLayout("float32", 16, 30, 3, 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the receiver process
async def _receive(name: str, num_blocks: int, requests: int, checksum: bool) -> None:
    from kvtransfer.base import TransferTarget
    from kvtransfer.loopback import MemorySink, receiving
    from kvtransfer.wire import target_to_pb

    sink = MemorySink(LAYOUT, num_blocks)
    async with receiving(name, sink, f"127.0.0.1:{_free_port()}",
                         checksum=checksum) as receiver:
        blocks = tuple(range(num_blocks))
        target = TransferTarget(name, receiver.address(), "kvbench", LAYOUT, blocks, 0,
                                receiver.metadata())
        print("target", base64.b64encode(target_to_pb(target).SerializeToString()).decode(),
              flush=True)
        for i in range(requests):
            if not await asyncio.to_thread(sys.stdin.readline):    # our turn, or the end
                return
            sink.reservations[f"r{i}"] = list(blocks)
            print(f"ready r{i}", flush=True)
            while f"r{i}" not in sink.completed:
                if f"r{i}" in sink.rejected:
                    print(f"done r{i} rejected: {sink.rejected[f'r{i}']}", flush=True)
                    return
                await asyncio.sleep(0.0002)
            print(f"done r{i} {sink.completed_at[f'r{i}']!r} {_fingerprint(sink.kv)}", flush=True)
        # the last call may not have had its reply yet (the sink completes the request first):
        # keep serving until the parent is done (stdin closes)
        await asyncio.to_thread(sys.stdin.read)


def _fingerprint(kv: torch.Tensor) -> str:
    return f"{kv[-1, -1, -1].sum().item():.6f}"


def _tcp_receive(port: int, nbytes: int, requests: int) -> None:
    with socket.create_server(("127.0.0.1", port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        for _ in range(requests):
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            conn.sendall(struct.pack("d", time.monotonic()))


def _cma_receive(num_blocks: int) -> None:
    """A pool the parent writes into with process_vm_writev; its checksum on request."""
    import torch

    kv = torch.ones(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                    LAYOUT.head_dim)         # ones, not zeros: every page is touched
    print("cma", os.getpid(), kv.data_ptr(), flush=True)
    for line in sys.stdin:
        if line.strip() == "sum":
            print("sum", _fingerprint(kv), flush=True)
        else:
            return


# ---------------------------------------------------------------------- the sender
def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.bench.kvbench", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(child: subprocess.Popen, word: str) -> list[str]:
    """The child's next stdout line that starts with `word` (libraries print there too)."""
    while True:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver process ended before saying {word!r}")
        if line.startswith(word + " ") or line.strip() == word:
            return line.split()


class _PoolClock:
    """A sender's run_on_pool: fn on a worker thread, as without an engine, timed: what a prefill
    engine's thread would spend on the transfer between its steps."""

    def __init__(self) -> None:
        self.seconds = 0.0

    async def __call__(self, fn, *args):
        def timed():
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return await asyncio.to_thread(timed)


async def _send(name: str, src: torch.Tensor, chunk: int,
                requests: int) -> tuple[dict[bool, list[float]], dict[bool, list[float]]]:
    """-> request times with checksums (True) and without (False), the two taking turns, and
    the pool's thread's seconds of each request."""
    from kvtransfer.base import create_sender
    from kvtransfer.wire import target_from_pb
    from proto import pdserve_pb2 as pb

    n = src.shape[2]
    children, targets, senders, clocks = {}, {}, {}, {}
    try:
        for checksum in (True, False):
            children[checksum] = child = _spawn(
                "--serve", name, "--num-blocks", str(n), "--requests", str(requests),
                "--checksum", "on" if checksum else "off")
            targets[checksum] = target_from_pb(pb.KVDescriptor.FromString(
                base64.b64decode(_line(child, "target")[1])))
            clocks[checksum] = _PoolClock()
            senders[checksum] = create_sender(name, LAYOUT, run_on_pool=clocks[checksum],
                                              kv=src, checksum=checksum)
        times: dict[bool, list[float]] = {True: [], False: []}
        pool: dict[bool, list[float]] = {True: [], False: []}
        for i in range(requests):
            for checksum in (True, False) if i % 2 == 0 else (False, True):
                clocks[checksum].seconds = 0.0
                times[checksum].append(await _request(
                    name, children[checksum], senders[checksum], targets[checksum], src, chunk,
                    f"r{i}"))
                pool[checksum].append(clocks[checksum].seconds)
        for sender in senders.values():
            await sender.close()
        return times, pool
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=30)


async def _request(name: str, child: subprocess.Popen, sender, target, src: torch.Tensor,
                   chunk: int, rid: str) -> float:
    """One request the way a prefill worker sends it; -> seconds until the receiver has it."""
    n = src.shape[2]
    child.stdin.write("go\n")
    child.stdin.flush()
    _line(child, "ready")
    t0 = time.monotonic()
    stream = sender.open(rid, src, target)
    ids = list(range(n))
    for start in range(0, n - chunk, chunk):
        await stream.send(ids[start:start + chunk], ids[start:start + chunk])
    last = ids[(max(n - 1, 0) // chunk) * chunk:]
    await stream.finish(1, None, last, last)
    words = await asyncio.to_thread(_line, child, "done")
    if words[2] == "rejected:":
        raise RuntimeError(f"{name}: the receiver refused the transfer: {words}")
    if words[3] != _fingerprint(src):
        raise RuntimeError(f"{name}: the receiver's last block differs ({words})")
    return float(words[2]) - t0


def _memcpy(src: torch.Tensor, requests: int) -> list[float]:
    import torch

    dst = torch.empty_like(src)
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def _tcp(nbytes: int, requests: int) -> list[float]:
    import torch

    port = _free_port()
    child = _spawn("--serve-tcp", str(port), "--nbytes", str(nbytes), "--requests", str(requests))
    try:
        _line(child, "listening")
        payload = memoryview(bytearray(torch.randn(nbytes // 4).numpy().tobytes()))
        times = []
        with socket.create_connection(("127.0.0.1", port)) as conn:
            for _ in range(requests):
                t0 = time.monotonic()
                conn.sendall(payload)
                times.append(struct.unpack("d", conn.recv(8, socket.MSG_WAITALL))[0] - t0)
        return times
    finally:
        child.wait(timeout=30)


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma(src: torch.Tensor, chunk: int, requests: int) -> list[float]:
    from kvtransfer.nixl_transport import block_regions

    n = src.shape[2]
    child = subprocess.Popen([sys.executable, "-m", "pdserve.bench.kvbench", "--serve-cma",
                              "--num-blocks", str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        _, pid, base = _line(child, "cma")
        writev = ctypes.CDLL(None, use_errno=True).process_vm_writev
        calls = []
        for start in range(0, n, chunk):
            ids = list(range(start, min(start + chunk, n)))
            local = block_regions(src.data_ptr(), n, LAYOUT, src.element_size(), ids)
            remote = block_regions(int(base), n, LAYOUT, src.element_size(), ids)
            calls.append(((_IOVec * len(local))(*local), (_IOVec * len(remote))(*remote),
                          len(local), sum(size for _, size in local)))
        times = []
        for _ in range(requests):
            t0 = time.monotonic()
            for local, remote, count, size in calls:
                if writev(int(pid), local, count, remote, count, 0) != size:
                    raise OSError(ctypes.get_errno(), "process_vm_writev: "
                                  + os.strerror(ctypes.get_errno()))
            times.append(time.monotonic() - t0)
        child.stdin.write("sum\n")
        child.stdin.flush()
        if _line(child, "sum")[1] != _fingerprint(src):
            raise RuntimeError("cma: the receiver's last block differs")
        return times
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def _checksums(src: torch.Tensor, requests: int) -> list[float]:
    from kvtransfer.integrity import block_checksums

    blocks = range(src.shape[2])
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        block_checksums(src, blocks)
        times.append(time.perf_counter() - t0)
    return times


def run(args) -> dict:
    import torch

    from kvtransfer.base import block_bytes

    bb = block_bytes(LAYOUT)
    num_blocks = max(1, int(args.mib * (1 << 20)) // bb)
    nbytes = num_blocks * bb
    torch.set_num_threads(1)
    src = torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                      LAYOUT.head_dim)
    results = {"memcpy": _memcpy(src, args.repeat), "checksum": _checksums(src, args.repeat),
               "tcp socket": _tcp(nbytes, args.repeat)}
    try:
        results["cma"] = _cma(src, args.chunk_blocks, args.repeat)
    except OSError as exc:      # ptrace restrictions (Yama) or a kernel without CMA
        print(f"cma baseline skipped: {exc}")
    names = args.transports.split(",")
    pool = {}
    for name in names:
        times, spent = asyncio.run(_send(name, src, args.chunk_blocks, args.repeat))
        results[name], results[f"{name} no checksum"] = times[True], times[False]
        pool[name], pool[f"{name} no checksum"] = spent[True], spent[False]
    base = statistics.median(results["memcpy"])
    print(f"{num_blocks} blocks of {bb} bytes = {nbytes / (1 << 20):.1f} MiB per request, "
          f"{args.repeat} requests, {args.chunk_blocks} blocks per send; pool ms: the time the "
          "pool's thread (a prefill engine's) spends per request")
    print(f"{'path':<22} {'median ms':>10} {'GB/s':>8} {'x memcpy':>9} {'checksum cost':>14} "
          f"{'pool ms':>8}")
    summary = {}
    for name, times in results.items():
        med = statistics.median(times)
        summary[name] = {"median_s": med, "gb_per_s": nbytes / med / 1e9, "x_memcpy": med / base,
                         "times_s": times}
        cost = spent = ""
        if name in names:
            off = statistics.median(results[f"{name} no checksum"])
            summary[name]["checksum_cost"] = med / off - 1
            cost = f"{(med / off - 1) * 100:+.1f}%"
        if name in pool:
            summary[name]["pool_s"] = statistics.median(pool[name])
            spent = f"{summary[name]['pool_s'] * 1e3:.2f}"
        print(f"{name:<22} {med * 1e3:>10.2f} {nbytes / med / 1e9:>8.2f} {med / base:>9.2f} "
              f"{cost:>14} {spent:>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bytes": nbytes, "blocks": num_blocks, "results": summary}, f, indent=1)
    return summary


def register(sub) -> None:
    p = sub.add_parser(
        "kvbench", help="KV transfer bandwidth of each transport vs memcpy and a TCP socket",
        description="Move --mib of KV blocks (the default model's layout) per request from this "
                    "process to a receiver process, --chunk-blocks per send as a prefill worker "
                    "does, over each transport; compare with memcpy and a plain TCP socket.")
    p.add_argument("--mib", type=float, default=64.0, help="KV bytes per request, in MiB")
    p.add_argument("--transports", default="grpc,torch,nixl", help="comma list")
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per send")
    p.add_argument("--repeat", type=int, default=5, help="requests per path")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.kvbench:main")


def main(args) -> int:
    run(args)
    return 0


def _child(argv: list[str]) -> None:
    import torch

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--serve")
    p.add_argument("--serve-tcp", type=int)
    p.add_argument("--serve-cma", action="store_true")
    p.add_argument("--num-blocks", type=int, default=0)
    p.add_argument("--nbytes", type=int, default=0)
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--checksum", default="on", choices=["on", "off"])
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.serve_cma:
        _cma_receive(a.num_blocks)
    elif a.serve_tcp:
        _tcp_receive(a.serve_tcp, a.nbytes, a.requests)
    else:
        asyncio.run(_receive(a.serve, a.num_blocks, a.requests, a.checksum == "on"))


if __name__ == "__main__":
    _child(sys.argv[1:])
