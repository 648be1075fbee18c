"""The processes of tensor parallelism: ranks 1..N-1 of an engine, started, followed, stopped.

Rank 0 is the worker process itself (its Engine and ModelRunner). `start_runner` starts ranks
1..N-1, joins their group and builds rank 0's runner; each of the others runs `_follower`: a
fresh interpreter (not a fork, and not multiprocessing's spawn, which imports the caller's main
module again) that reads its orders from a pipe, builds a ModelRunner over its shards and
follows rank 0's commands (ModelRunner.follow) until told to stop. The pipe stays open while
rank 0 lives: its closing (rank 0 exited, or was killed) ends the rank too.

The group and its collectives are engine.parallel's; this module sits above the runner and owns
only the processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading

import torch

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import check_split, free_port, init_group, rank_device

log = logging.getLogger(__name__)


class Ranks:
    """Ranks 1..N-1 of one engine, as processes (`procs`, rank order)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = list(procs)

    @classmethod
    def start(cls, model_dir, model_cfg: ModelConfig, cfg: EngineConfig, threads: int,
              random_weights: bool = False) -> tuple["Ranks", int]:
        """Start ranks 1..N-1 of `cfg.tensor_parallel_size`; -> (them, the port rank 0 joins
        at with init_group(0, N, port, device))."""
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        procs = []
        for rank in range(1, cfg.tensor_parallel_size):
            orders = pickle.dumps(dict(model_dir=str(model_dir) if model_dir else None,
                                       model_cfg=model_cfg, cfg=cfg, rank=rank, port=port,
                                       threads=threads, random_weights=random_weights))
            p = subprocess.Popen([sys.executable, "-c",
                                  "import engine.tp_ranks as r; r._follower()"],
                                 stdin=subprocess.PIPE, env=env)
            p.stdin.write(len(orders).to_bytes(8, "little") + orders)
            p.stdin.flush()                   # stays open: closed when rank 0 exits
            procs.append(p)
        return cls(procs), port

    def kill(self) -> None:
        for p in self.procs:
            p.kill()

    def wait(self, timeout_s: float = 10.0) -> None:
        """Close their pipes (a rank that missed the stop command exits on EOF), wait, kill what
        is left."""
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except Exception:
                p.kill()
                p.wait()

    def close(self, runner: ModelRunner) -> None:
        """Stop the ranks (rank 0's `runner` sends the stop command; a broken group's ranks,
        which may never take it, are killed instead), wait for them, and leave the group."""
        try:
            if runner.broken is not None:
                self.kill()
            else:
                runner.send_stop()
        except RuntimeError as exc:           # a rank is gone: the others see it too
            log.warning("tensor-parallel ranks did not all take the stop command: %s", exc)
        finally:
            self.wait()
            runner.leave_group()


def build_runner(model_dir, model_cfg: ModelConfig, cfg: EngineConfig,
                 model: torch.nn.Module | None = None, random_weights: bool = False
                 ) -> tuple[ModelRunner, Ranks | None]:
    """An engine's runner: with tensor_parallel_size 1 the process's own (over `model` when
    given), else rank 0's, with ranks 1..N-1 started (start_runner)."""
    if cfg.tensor_parallel_size == 1:
        return ModelRunner(model_dir, model_cfg, cfg, model, random_weights), None
    check_split(model_cfg, cfg.tensor_parallel_size, cfg.expert_parallel)
    if model is not None:
        raise ValueError("a model object cannot be split over tensor-parallel ranks: give "
                         "its folder")
    return start_runner(model_dir, model_cfg, cfg, random_weights)


def start_runner(model_dir, model_cfg: ModelConfig, cfg: EngineConfig,
                 random_weights: bool = False) -> tuple[ModelRunner, Ranks]:
    """Rank 0's runner of a tensor-parallel engine, once ranks 1..N-1 are started and joined."""
    n = cfg.tensor_parallel_size
    check_split(model_cfg, n, cfg.expert_parallel)
    ranks, port = Ranks.start(model_dir, model_cfg, cfg, torch.get_num_threads(), random_weights)
    try:
        tp = init_group(0, n, port, rank_device(cfg.device, 0), peers=ranks.procs)
        runner = ModelRunner(model_dir, model_cfg, cfg, None, random_weights, tp=tp)
    except BaseException:
        ranks.kill()
        ranks.wait()
        import torch.distributed as dist
        if dist.is_initialized():          # so that this process can start another group
            dist.destroy_process_group()
        raise
    log.info("tensor parallel: %d ranks (%s), KV heads per rank %d", n,
             ", ".join(rank_device(cfg.device, r) for r in range(n)),
             runner.local_cfg.num_kv_heads)
    return runner, ranks


def _watch_parent(pipe) -> None:
    """A rank whose rank 0 is gone exits (a killed rank 0 leaves no one to say stop)."""
    pipe.read()                              # returns at EOF: the other end closed
    os._exit(0)


def _follower() -> None:
    """Main of ranks 1..N-1: orders from the pipe, a runner over this rank's shards, then rank
    0's commands until it says stop."""
    import torch.distributed as dist

    pipe = sys.stdin.buffer
    size = int.from_bytes(pipe.read(8), "little")
    o = pickle.loads(pipe.read(size))
    threading.Thread(target=_watch_parent, args=(pipe,), daemon=True).start()
    rank, cfg = o["rank"], o["cfg"]
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        if o["threads"] > 0:
            torch.set_num_threads(o["threads"])
        device = rank_device(cfg.device, rank)
        tp = init_group(rank, cfg.tensor_parallel_size, o["port"], device)
        runner = ModelRunner(o["model_dir"], o["model_cfg"],
                             dataclasses.replace(cfg, device=device),
                             random_weights=o["random_weights"], tp=tp)
        runner.follow()
        dist.destroy_process_group()
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)      # not through finalization: the watcher thread is inside a read
