"""The KV transfer rows of `make gpu-check` (pdserve.gpucheck calls these; on CPUs `--quick` runs
what does not need CUDA, as a smoke test): the staging and the grpc transport end to end, and the
transports' stream discipline.

  staging              KV blocks device -> host bytes -> device through the grpc transport's
                       staging (kvtransfer.staging), per dtype, and through the whole grpc
                       transport over loopback when its generated proto code is importable
  grpc engine thread   a grpc send of a 2,048-token Llama-3-8B-shaped prompt (bf16, 268 MB in
                       messages of 16 blocks): what its engine-thread part takes (gathers,
                       checksums and copies to page-locked memory, queued: HostStaging.gather)
                       against the sender thread's wait and encoding, and against the whole of it
                       on one thread, which is what the engine thread did before
  grpc receive         the receiving side of the same prompt on CUDA: the received messages'
                       bytes staged into page-locked memory off the engine thread
                       (HostStaging.stage), then the engine thread's part (the device copies and
                       the index into the pool: write_staged), against write_blocks doing both
                       there, which is what the engine thread did before
  handover             one GPU: a receive held on the device (torch.cuda._sleep standing in for
                       an NCCL receive whose data has not come) on a receiving thread's own
                       stream (kvtransfer.staging.use_own_stream): decode-step-like kernels on the
                       default stream meanwhile, against the same receive on the default stream;
                       then the data handed to the pool with its event (HostStaging.write_blocks:
                       the default stream waits on the device), intact
  torch transport      two processes (NCCL with two GPUs; gloo on CPUs): a channel with a short
                       configured timeout carries a request, stays idle for twice its timeout
                       (NCCL's watchdog would end a posted receive), carries another whose payload
                       the sender holds back after its header; decode-step-like kernels on the
                       receiver's default stream while idle and while its receive is posted.
                       NCCL refuses two ranks on one GPU: skipped with one.

Each child of the torch transport check is its own process, so a watchdog that ends one fails a
row instead of the check.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

from pdserve.gpucheck_device import sync

WORST_STEP_S = 0.05       # a decode step queued behind a held receive takes the whole hold (1 s)


def _steps(dev: torch.device, seconds: float) -> list[float]:
    """Wall times of decode-step-like work on the default stream (32 bf16 matmuls of 16 rows
    over 4096 x 4096, then a sync of that stream, as a step ends with its tokens), for
    `seconds`; [] off CUDA."""
    if dev.type != "cuda":
        time.sleep(seconds)
        return []
    x = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    stream = torch.cuda.current_stream(dev)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(32):
            x @ w
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _worst(steps: list[float], base: list[float]) -> str:
    return (f"worst step {max(steps) * 1e3:.1f} ms of {len(steps)} (alone: median "
            f"{statistics.median(base) * 1e3:.2f} ms)")


def run(report, device: str, quick: bool) -> None:
    """Every row above that the device allows."""
    grpc_engine_thread(report, device, quick)
    if torch.device(device).type == "cuda":
        receive_engine_thread(report, device, quick)
        handover(report, device)
    torch_transport(report, device, quick)


# ---------------------------------------------------------------------------- grpc engine thread
def grpc_engine_thread(report, device: str, quick: bool) -> None:
    from kvtransfer.integrity import checksums
    from kvtransfer.staging import HostStaging

    dev = torch.device(device)
    layers, tokens = (2, 64) if quick else (32, 2048)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kv = torch.randn(layers, 2, tokens // 16, 16, 8, 128, device=dev).to(dtype)
    staging = HostStaging(dev)
    pieces = [list(range(i, min(i + 16, kv.shape[2]))) for i in range(0, kv.shape[2], 16)]
    nbytes = kv.numel() * kv.element_size()
    per_piece = nbytes // kv.shape[2] * 16
    for attempt in range(2):                    # the first one allocates the page-locked buffers
        buffers = [staging.reserve(per_piece) for _ in pieces]
        sync(dev)
        t0 = time.perf_counter()
        gathered = [staging.gather(kv, p, checksums, b) for p, b in zip(pieces, buffers)]
        engine_s = time.perf_counter() - t0
        ok = True
        t0 = time.perf_counter()
        for p, g in zip(pieces, gathered):
            with g.on_host() as (data, sums):
                got = data.view(dtype).view(layers, 2, len(p), 16, 8, 128)
                ok = ok and torch.equal(got, kv[:, :, p].cpu()) and len(sums) == len(p)
                data.numpy().tobytes()          # the message's one host copy
        sender_s = time.perf_counter() - t0
    sync(dev)
    t0 = time.perf_counter()
    for p in pieces:                           # all of it on one thread: the engine's, before
        with staging.gather(kv, p, checksums).on_host() as (data, _):
            data.numpy().tobytes()
    whole_s = time.perf_counter() - t0
    report.add("kv transfer", f"grpc send of {tokens} tokens ({nbytes / 1e6:.0f} MB in "
               f"messages of up to 16 blocks)", f"engine thread {engine_s * 1e3:.2f} ms, sender "
               f"thread {sender_s * 1e3:.1f} ms; all on one thread {whole_s * 1e3:.1f} ms; "
               f"{'intact' if ok else 'CORRUPTED'}", "engine thread <= 5 ms, intact",
               ok if quick or dev.type != "cuda" else ok and engine_s <= 0.005)


def receive_engine_thread(report, device: str, quick: bool) -> None:
    from kvtransfer.staging import HostStaging

    dev = torch.device(device)
    layers, tokens = (2, 64) if quick else (32, 2048)
    dtype = torch.bfloat16
    pool = torch.zeros(layers, 2, 2 * tokens // 16, 16, 8, 128, device=dev, dtype=dtype)
    src = torch.randn(layers, 2, tokens // 16, 16, 8, 128).to(dtype)     # as received, host
    pieces = [list(range(i, min(i + 16, src.shape[2]))) for i in range(0, src.shape[2], 16)]
    msgs = [src[:, :, p[0]:p[-1] + 1].clone() for p in pieces]
    staging = HostStaging(dev)
    for _ in range(2):                          # the first allocates the page-locked buffers
        staged = [staging.stage(m) for m in msgs]
        sync(dev)
        t0 = time.perf_counter()
        for p, st in zip(pieces, staged):
            staging.write_staged(pool, [tokens // 16 + b for b in p], st)
        engine_s = time.perf_counter() - t0
    sync(dev)
    ok = torch.equal(pool[:, :, tokens // 16:].cpu(), src)
    t0 = time.perf_counter()
    for p, m in zip(pieces, msgs):             # both halves on one thread: before
        staging.write_blocks(pool, p, m)
    before_s = time.perf_counter() - t0
    sync(dev)
    nbytes = src.numel() * src.element_size()
    report.add("kv transfer", f"grpc receive of {tokens} tokens ({nbytes / 1e6:.0f} MB)",
               f"engine thread {engine_s * 1e3:.2f} ms (device copies queued); staging and "
               f"copies on one thread {before_s * 1e3:.1f} ms; "
               f"{'intact' if ok else 'CORRUPTED'}", "engine thread <= 5 ms, intact",
               ok if quick else ok and engine_s <= 0.005)


# ---------------------------------------------------------------------------- staging, grpc
def kv_roundtrip(report, device: str) -> None:
    """Blocks device -> host bytes -> device through HostStaging, per dtype; then the whole grpc
    transport over loopback when the proto code is importable."""
    from kvtransfer.staging import HostStaging, tensor_from_bytes

    dev = torch.device(device)
    shape = (4, 2, 40, 16, 8, 128)                          # layers, k/v, blocks, slots, heads
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dev.type == "cpu" and dtype == torch.bfloat16:
            continue
        src = torch.randn(shape, device=dev).to(dtype)
        dst = torch.zeros_like(src)
        send, recv = HostStaging(dev), HostStaging(dev)
        ids, to = [3, 4, 5, 17, 39, 0], [10, 11, 12, 30, 2, 8]
        for i in range(0, len(ids), 4):                     # messages of up to 4 blocks
            data = send.blocks_to_bytes(src, ids[i:i + 4])
            n = len(ids[i:i + 4])
            part = tensor_from_bytes(data, dtype, (shape[0], 2, n, *shape[3:]))
            recv.write_blocks(dst, to[i:i + 4], part)
        sync(dev)
        ok = torch.equal(dst[:, :, to], src[:, :, ids]) and \
            int(dst.count_nonzero()) == int(src[:, :, ids].count_nonzero())
        report.add("kv transfer", f"staging {str(dtype).split('.')[-1]}",
                   f"{len(ids)} blocks device->host->device "
                   f"{'intact' if ok else 'CORRUPTED'} (pinned: {send.pinned})", "intact", ok)
    why = proto_unavailable()
    if why is not None:
        report.add("kv transfer", "grpc transport", f"skipped: {why}; the staging rows above "
                   "are its device path")
        return
    report.add("kv transfer", "grpc transport", *asyncio.run(_grpc_roundtrip(dev)))


def proto_unavailable() -> str | None:
    """Why the generated gRPC code cannot be used here (None: it can): not generated (a
    device machine has no grpcio-tools: generate it with `python -m proto.build` where it is
    installed and carry proto/*_pb2.py and proto/*_pb2_grpc.py), or generated for other
    protobuf / grpcio versions than this machine's."""
    try:
        import proto.pdserve_pb2  # noqa: F401
        import proto.pdserve_pb2_grpc  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("proto."):
            return ("the proto code is not generated here (carry proto/*_pb2.py and "
                    "proto/*_pb2_grpc.py from a machine that ran python -m proto.build)")
        return f"{exc} (the proto code needs it)"
    except Exception as exc:        # protobuf's VersionError, grpc's generated-code check
        return (f"the generated proto code does not match this machine's protobuf / grpcio "
                f"({type(exc).__name__}: {str(exc)[:160]}); regenerate it for these versions")
    return None


async def _grpc_roundtrip(dev):
    import socket

    from engine.kv_layout import KVLayout
    from kvtransfer.base import TransferTarget, create_sender
    from kvtransfer.loopback import MemorySink, receiving

    layout = KVLayout("float16", 16, 4, 8, 128)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    src = torch.randn(4, 2, 32, 16, 8, 128, device=dev).half()
    sink = MemorySink(layout, 32, device=dev)
    sink.reservations["r"] = [5, 6, 7, 8, 9]
    async with receiving("grpc", sink, addr):
        sender = create_sender("grpc", layout, kv=src, blocks_per_message=2)
        target = TransferTarget("grpc", addr, "check", layout, (5, 6, 7, 8, 9))
        await sender.send("r", src, [1, 2, 3, 30, 31], target, 42, None)
        await sender.close()
    sync(dev)
    ok = sink.completed.get("r", (None,))[0] == 42 and torch.equal(
        sink.kv[:, :, [5, 6, 7, 8, 9]].to(dev), src[:, :, [1, 2, 3, 30, 31]])
    return (f"5 blocks, 2 per message, {'intact' if ok else 'CORRUPTED'}", "intact", ok)


# ---------------------------------------------------------------------------- handover
def handover(report, device: str, hold_s: float = 1.0) -> None:
    """One GPU: a held receive on a thread's own stream leaves the default stream alone; its data
    reaches the pool through its event."""
    from kvtransfer.staging import HostStaging, recorded, use_own_stream

    dev = torch.device(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * hold_s * 1e3 / start.elapsed_time(end))
    base = _steps(dev, 1.0)
    payload = torch.randn(2, 2, 4, 16, 8, 128, device=dev)
    pool = torch.zeros(2, 2, 16, 16, 8, 128, device=dev)
    for own in (True, False):
        handed: list = []

        def receive():                          # what a torch receiver's thread does
            if own:
                use_own_stream(dev)
            data = torch.zeros_like(payload)
            torch.cuda._sleep(cycles)           # the receive, its data not come yet
            data.copy_(payload)
            ready = recorded(dev)
            ready.synchronize()                 # this thread waits for it
            handed.append((data, ready))

        sync(dev)                              # `payload` is written: the other stream reads it
        thread = threading.Thread(target=receive)
        thread.start()
        steps = _steps(dev, hold_s * 1.3)
        thread.join()
        if not own:
            report.add("kv transfer", "handover: a held receive on the default stream "
                       "(before)", _worst(steps, base) + f"; held {hold_s:g} s")
            continue
        data, ready = handed[0]
        t0 = time.perf_counter()
        HostStaging(dev).write_blocks(pool, [3, 9, 4, 0], data, ready)
        queued_s = time.perf_counter() - t0
        del data, handed
        sync(dev)
        ok = torch.equal(pool[:, :, [3, 9, 4, 0]], payload)
        fast = max(steps) < WORST_STEP_S
        report.add("kv transfer", "handover: a held receive on its own stream",
                   _worst(steps, base) + f"; held {hold_s:g} s; data into the pool "
                   f"{'intact' if ok else 'CORRUPTED'} (queued in {queued_s * 1e3:.2f} ms)",
                   f"worst step < {WORST_STEP_S * 1e3:.0f} ms, intact", ok and fast)


# ---------------------------------------------------------------------------- torch transport
LAYOUT = dict(dtype="bfloat16", block_size=16, num_layers=4, num_kv_heads=8, head_dim=128)
BLOCKS = 32


def _layout(dev: torch.device):
    from engine.kv_layout import KVLayout

    return KVLayout(**dict(LAYOUT, dtype="bfloat16" if dev.type == "cuda" else "float32"))


def _source(dev: torch.device) -> torch.Tensor:
    lay = _layout(dev)
    g = torch.Generator().manual_seed(7)
    from engine.config import DTYPES

    return torch.randn(lay.num_layers, 2, BLOCKS, lay.block_size, lay.num_kv_heads,
                       lay.head_dim, generator=g).to(DTYPES[lay.dtype]).to(dev)


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.gpucheck_kv", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(child: subprocess.Popen, command: str, reply: str | None = None) -> list[str]:
    if command:
        child.stdin.write(command + "\n")
        child.stdin.flush()
    while reply is not None:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"a child process ended before saying {reply!r}")
        if line.startswith(reply + " "):
            return line.split(" ", 2)[1:]
    return []


def torch_transport(report, device: str, quick: bool) -> None:
    why = proto_unavailable()
    if why is not None:             # its handshake travels as proto messages over gRPC
        report.add("kv transfer", "torch transport", f"skipped: {why}")
        return
    import kvtransfer.torch_transport  # noqa: F401
    dev = torch.device(device)
    if dev.type == "cuda":
        first = dev.index or 0
        if torch.cuda.device_count() < first + 2:
            report.add("kv transfer", "torch transport (NCCL)", "skipped: needs two GPUs from "
                       "--device on (NCCL refuses two ranks on one GPU; the handover row is "
                       "its stream discipline on one)")
            return
        recv_dev, send_dev = f"cuda:{first}", f"cuda:{first + 1}"
    else:
        recv_dev = send_dev = "cpu"
    timeout, hold = (1.0, 0.5) if quick or dev.type != "cuda" else (5.0, 1.0)
    receiver = _child("--receive", recv_dev, str(timeout))
    sender = None
    try:
        address = _ask(receiver, "", "address")[0].strip()
        sender = _child("--send", address, send_dev, str(timeout))
        base = json.loads(_ask(receiver, "steps 1", "steps")[1])
        _ask(receiver, "reserve a", "reserved")
        first_sent = _ask(sender, "send a 0", "sent")[1].strip()
        first = _ask(receiver, "wait a", "done")[1].strip()
        idle = json.loads(_ask(receiver, f"steps {2 * timeout}", "steps")[1])
        _ask(receiver, "reserve b", "reserved")
        _ask(receiver, f"steps {hold + 0.5}")
        second_sent = _ask(sender, f"send b {hold}", "sent")[1].strip()
        held = json.loads(_ask(receiver, "", "steps")[1])
        second = _ask(receiver, "wait b", "done")[1].strip()
    finally:
        for child in (sender, receiver):
            if child is not None:
                _ask(child, "quit")
                child.stdin.close()
                child.wait(timeout=60)
    name = "NCCL" if dev.type == "cuda" else "gloo"
    ok = first == "intact" and second == "intact"
    report.add("kv transfer", f"torch transport ({name}): idle {2 * timeout:g} s, twice its "
               f"timeout, between two requests", f"first {first} ({first_sent}), second "
               f"{second} ({second_sent})", "both intact", ok)
    if dev.type == "cuda":
        report.add("kv transfer", "torch transport: decode steps beside an idle channel",
                   _worst(idle, base), f"worst step < {WORST_STEP_S * 1e3:.0f} ms",
                   max(idle) < WORST_STEP_S)
        report.add("kv transfer", f"torch transport: decode steps beside a posted receive "
                   f"(payload held {hold:g} s)", _worst(held, base),
                   f"worst step < {WORST_STEP_S * 1e3:.0f} ms", max(held) < WORST_STEP_S)


def _receive_child(device: str, timeout_s: float) -> None:
    """The receiving process: a pool in memory behind a torch receiver (its loop on a thread of
    its own), decode-step-like work on the main thread's default stream; orders on stdin."""
    from kvtransfer.loopback import MemorySink
    from kvtransfer.torch_transport import TorchKVReceiver

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    sink = MemorySink(_layout(dev), BLOCKS, device=dev)

    async def start():
        return TorchKVReceiver(sink, "127.0.0.1:0", timeout_s=timeout_s)
    receiver = asyncio.run_coroutine_threadsafe(start(), loop).result()
    want = _source(dev)
    print("address", receiver.address(), flush=True)
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "reserve":
            sink.reservations[rest[0]] = list(range(BLOCKS))
            print("reserved", rest[0], "-", flush=True)
        elif word == "steps":
            print("steps -", json.dumps(_steps(dev, float(rest[0]))), flush=True)
        elif word == "wait":
            deadline = time.monotonic() + 60
            while rest[0] not in sink.completed and rest[0] not in sink.rejected \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            sync(dev)
            state = ("intact" if torch.equal(sink.kv, want) else "CORRUPTED") \
                if rest[0] in sink.completed else f"not-completed:{sink.rejected.get(rest[0])}"
            print("done", rest[0], state.replace(" ", "_"), flush=True)
            sink.kv.zero_()
        elif word == "quit":
            break
    asyncio.run_coroutine_threadsafe(receiver.close(), loop).result(timeout=30)


def _send_child(address: str, device: str, timeout_s: float) -> None:
    """The sending process: `send RID HOLD` sends every block, the payload held back HOLD
    seconds after each message's header."""
    from kvtransfer import torch_transport
    from kvtransfer.base import TransferTarget, create_sender

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    src = _source(dev)
    lay = _layout(dev)
    sender = create_sender("torch", lay, kv=src, timeout_s=timeout_s)
    plain = torch_transport.wait_for
    hold = {"s": 0.0}

    def held(ready, tensors=()):                 # the channel's thread, before the payload
        time.sleep(hold["s"])
        plain(ready, tensors)
    torch_transport.wait_for = held
    ids = list(range(BLOCKS))
    target = TransferTarget("torch", address, "gpucheck", lay, tuple(ids))
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "send":
            hold["s"] = float(rest[1])
            t0 = time.perf_counter()
            try:
                loop.run_until_complete(sender.send(rest[0], src, ids, target, 1, None))
                print("sent", rest[0], f"sent_in_{time.perf_counter() - t0:.2f}_s", flush=True)
            except Exception as exc:
                print("sent", rest[0], f"failed:_{exc}".replace(" ", "_")[:300], flush=True)
        elif word == "quit":
            break
    loop.run_until_complete(sender.close())


if __name__ == "__main__":
    if sys.argv[1] == "--receive":
        _receive_child(sys.argv[2], float(sys.argv[3]))
    else:
        _send_child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
