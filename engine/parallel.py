"""Tensor parallelism: one model split over N ranks (processes), one scheduler on rank 0.

A worker started with --tensor-parallel-size N is rank 0: it runs the engine (scheduler, KV
connector, sampler) and starts ranks 1..N-1 (engine.tp_ranks), each a process holding its
shards of the model and of the KV pool. This module holds the group and its collectives only. The ranks form the default torch.distributed process
group (NCCL on GPUs, gloo on CPUs, the same code) plus a gloo group for the host-side commands.
Each step, rank 0 broadcasts the step's inputs (`TPGroup.command`); every rank runs the same
forward pass; sampling happens on rank 0 only.

How the model splits (engine.layers): q/k/v and gate/up are column-parallel (each checkpoint
projection split on its own), o and down row-parallel with an all-reduce; the embedding and
lm_head are vocabulary-parallel (rows split, an all-reduce after the lookup and an all-gather of
the logits) rather than replicated: for a 128k vocabulary at hidden 8192 they are 2 GiB each in
bf16, which replication would keep N times. KV heads are split across ranks; with fewer KV heads
than ranks, each is replicated on N / KVH consecutive ranks (`head_range`).

The KV pool as rank 0's transports see it is `ShardedKV`: the whole model's heads, assembled
from every rank when blocks are read, split to every rank when they are written. On the wire a
block is always the whole model's heads in order, so a prefill worker with one TP size feeds a
decode worker with another: each decode rank receives its heads from the prefill ranks that held
them (through both rank 0s).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

INIT_TIMEOUT_S = 600.0        # joining the group, and any one collective of a step
COMMAND_TIMEOUT_S = 10 * 365 * 86400.0   # ranks wait for rank 0's next command while idle


class RankFailure(RuntimeError):
    """A tensor-parallel operation failed on this rank (a rank died, or raised after rank 0's
    command went out): the ranks may no longer agree on what comes next, so the engine stops
    (its worker goes NOT_SERVING) rather than running on."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group. size 1: no group, every collective
    is the identity."""

    rank: int = 0
    size: int = 1
    cpu_group: object = None       # gloo group for rank 0's commands (no timeout to speak of)
    shm: "ShmComm | None" = None   # CPU ranks of one x86 host: collectives in shared memory

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.shm is not None and t.device.type == "cpu":
                self.shm.all_reduce(t)
            else:
                dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim`, rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        if self.shm is not None and t.device.type == "cpu" and self.shm.fits(t):
            parts = self.shm.all_gather(t)
        else:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """Rows of `t` split by `in_splits` (even: None) go to ranks 0..N-1; `out` receives
        each rank's rows for this one, `out_splits` from each (expert parallelism)."""
        if self.size == 1:
            return out.copy_(t)
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits)
        return out

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(t, src=0)
        return t

    def command(self, cmd: tuple | None = None) -> tuple:
        """Rank 0 sends `cmd` to every rank; the others return what it sent."""
        box = [cmd]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


SINGLE = TPGroup()


def head_range(num_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(first head, count) of `num_heads` this rank holds: an even split, or (fewer heads than
    ranks) one head replicated on size / num_heads consecutive ranks."""
    if num_heads >= size:
        per = num_heads // size
        return rank * per, per
    return rank * num_heads // size, 1


def _split_problems(cfg, n: int, expert_parallel: bool = False) -> list[str]:
    """What in `cfg` cannot be split `n` ways (empty: it can)."""
    h, kvh, moe = cfg.num_heads, cfg.num_kv_heads, getattr(cfg, "moe", None)
    bad = []
    if h % n:
        bad.append(f"{h} attention heads")
    if (kvh >= n and kvh % n) or (kvh < n and n % kvh):
        bad.append(f"{kvh} KV heads (split evenly, or replicated when fewer than ranks)")
    dense = moe is None or len(moe.layers) < cfg.num_layers
    if dense and cfg.intermediate_size % n:
        bad.append(f"intermediate size {cfg.intermediate_size}")
    if moe is not None:
        if expert_parallel and moe.num_experts < n:
            bad.append(f"{moe.num_experts} experts (expert parallel: one or more per rank)")
        if not expert_parallel and moe.intermediate_size % n:
            bad.append(f"expert intermediate size {moe.intermediate_size} (or use "
                       "--expert-parallel)")
        if not expert_parallel and moe.shared_intermediate_size % n:
            bad.append(f"shared expert intermediate size {moe.shared_intermediate_size}")
    return bad


def check_split(cfg, size: int, expert_parallel: bool = False) -> None:
    """ValueError naming what cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    bad = _split_problems(cfg, size, expert_parallel)
    if bad:
        raise ValueError(f"tensor parallel size {size} does not divide the model's "
                         f"{', '.join(bad)}; pick a size that does (this model: "
                         f"{', '.join(str(n) for n in _even_sizes(cfg, expert_parallel))})")


def _even_sizes(cfg, expert_parallel: bool = False) -> list[int]:
    return [n for n in range(1, cfg.num_heads + 1)
            if not _split_problems(cfg, n, expert_parallel)]


def local_config(cfg, tp: TPGroup):
    """The model config as one rank's attention and KV pool see it: its own heads."""
    if tp.size == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size,
                               num_kv_heads=head_range(cfg.num_kv_heads, tp.size, tp.rank)[1])


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(base + r) on GPUs, the CPU elsewhere."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + rank}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, port: int, device: str, peers: list | None = None
               ) -> TPGroup:
    """Join the group of `size` ranks rendezvousing at 127.0.0.1:port. `peers`: rank 0's
    processes of ranks 1..N-1, watched while it waits for them in a collective."""
    from datetime import timedelta

    if size == 1:
        return SINGLE
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    timeout = timedelta(seconds=INIT_TIMEOUT_S)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=timeout)
    # a group of its own for commands: an idle worker's ranks wait for the next one for as long
    # as it takes (a gloo operation fails after its group's timeout)
    cpu = dist.new_group(backend="gloo", timeout=timedelta(seconds=COMMAND_TIMEOUT_S))
    shm = None
    if not cuda and ShmComm.supported():
        box = [f"pdserve-tp-{os.getpid()}-{port}" if rank == 0 else None]
        if rank == 0:
            shm = ShmComm(box[0], rank, size, peers)
        try:
            dist.broadcast_object_list(box, src=0)     # made, and named: the others open it
            if rank:
                shm = ShmComm(box[0], rank, size)
            dist.barrier()                  # every rank has it mapped: the name can go
        finally:
            if rank == 0:
                shm.unlink()
    return TPGroup(rank, size, cpu, shm)


class ShmComm:
    """All-reduce and all-gather between the CPU ranks of one host through shared memory, instead
    of gloo's sockets: a step runs two all-reduces per layer, and gloo's per-call cost dominates
    a small CPU step (the measurement: see docs/performance.md). Each rank writes its part into
    its slot, publishes the call's sequence number, waits (spinning, then yielding the core)
    until every rank has, and sums the slots in rank order (the same result on every rank). Two
    slot sets in turn: a rank can only reach call k + 1 once every rank has finished call k - 1,
    so one barrier per call is enough. The ordering relies on x86's store and load order (hence
    `supported`), with a locked instruction after each copy into a slot (a lock's acquire) so
    that even streaming stores are visible before the flag."""

    SLOT = 1 << 20                  # bytes per rank and slot set; larger tensors go in pieces
    WAIT_S = 120.0                  # a rank later than this is taken for dead

    def __init__(self, name: str, rank: int, size: int, peers: list | None = None) -> None:
        import mmap

        import numpy as np

        self.path = f"/dev/shm/{name}"
        self.rank, self.size = rank, size
        header = 64 * size                                   # a cache line per rank's flag
        total = header + 2 * size * self.SLOT
        fd = os.open(self.path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if rank == 0 else os.O_RDWR,
                     0o600)
        try:
            if rank == 0:         # every page now: a full /dev/shm is ENOSPC here, not a SIGBUS
                os.posix_fallocate(fd, 0, total)
            self._mm = mmap.mmap(fd, total)
        except BaseException:
            if rank == 0:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self._mm, dtype=np.int64, count=8 * size)[::8]
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header)
        self.seq = 0
        self._fence = threading.Lock()
        self.peers = list(peers or [])          # processes whose exit ends a wait at once

    @staticmethod
    def supported() -> bool:
        import platform

        return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.SLOT

    def _slot(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        start = ((self.seq & 1) * self.size + rank) * self.SLOT
        n = t.numel() * t.element_size()
        return self.data[start:start + n].view(t.dtype).view(t.shape)

    def _arrive(self) -> None:
        """Publish this call's number and wait for every rank's."""
        with self._fence:                        # a locked instruction: the slot's stores first
            self.flags[self.rank] = self.seq
        spins, deadline = 0, None
        while (self.flags < self.seq).any():
            spins += 1
            if spins > 64:
                os.sched_yield()                 # more ranks than cores: let the others run
            if spins % 4096 == 0:
                gone = [p for p in self.peers if p.poll() is not None]
                if gone:
                    raise RuntimeError(f"a tensor-parallel rank exited (code "
                                       f"{gone[0].returncode}) during a collective")
                now = time.monotonic()
                deadline = deadline or now + self.WAIT_S
                if now > deadline:
                    late = [r for r in range(self.size) if self.flags[r] < self.seq]
                    raise RuntimeError(f"tensor-parallel ranks {late} did not reach the "
                                       f"collective within {self.WAIT_S:.0f} s")

    def all_reduce(self, t: torch.Tensor) -> None:
        """t (contiguous) = the sum of every rank's t, in place."""
        flat = t.view(-1)
        per = self.SLOT // t.element_size()
        for i in range(0, flat.numel(), per):
            piece = flat[i:i + per]
            self.seq += 1
            self._slot(self.rank, piece).copy_(piece)
            self._arrive()
            total = self._slot(0, piece).clone()
            for r in range(1, self.size):
                total += self._slot(r, piece)
            piece.copy_(total)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (which fits a slot), rank order."""
        self.seq += 1
        self._slot(self.rank, t).copy_(t)
        self._arrive()
        return [self._slot(r, t).clone() for r in range(self.size)]


# ---------------------------------------------------------------------- the sharded pool
class ShardedKV:
    """The KV pool of a tensor-parallel engine as rank 0's transports see it: shape
    [layers, 2, blocks, block_size, all KV heads, head_dim], with the tensor operations they use
    on blocks (dim 2): `index_select` gathers every rank's heads, `index_copy_` gives every rank
    its own. Each call is a command all ranks run (the engine thread only)."""

    def __init__(self, runner, num_kv_heads: int) -> None:
        self.runner = runner
        local = runner.kv
        self.shape = torch.Size((*local.shape[:4], num_kv_heads, local.shape[5]))
        self.dtype, self.device, self.is_cuda = local.dtype, local.device, local.is_cuda

    def element_size(self) -> int:
        return self.runner.kv.element_size()

    def data_ptr(self) -> int:
        raise RuntimeError("a tensor-parallel KV pool is spread over several ranks: no one-sided "
                           "transport can register it (use --kv-transport grpc or torch)")

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 2, "blocks are dim 2"
        return self.runner.read_blocks([int(i) for i in index.tolist()])

    def index_copy_(self, dim: int, index: torch.Tensor, data: torch.Tensor) -> "ShardedKV":
        assert dim == 2, "blocks are dim 2"
        self.runner.write_blocks([int(i) for i in index.tolist()], data)
        return self
