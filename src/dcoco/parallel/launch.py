"""Spawn a local gloo job on loopback (tests and the CPU benchmark).

Why not plain ``mp.spawn``: it joins forever, so one rank stuck in a receive
hangs the caller.  :func:`spawn_local` joins with a deadline, kills only the
processes it started, and returns each rank's return value.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_local"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, result_dir, backend, pg_timeout_s, threads, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn_local(
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return their results.

    ``fn`` must be importable (module level).  Raises ``TimeoutError`` (after
    killing the workers) if the job does not finish within ``timeout_s``, and
    re-raises a worker's exception otherwise.
    """
    with tempfile.TemporaryDirectory(prefix="dcoco_spawn_") as result_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), result_dir, backend, pg_timeout_s, threads, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise TimeoutError(f"distributed job with {world_size} ranks did not finish in {timeout_s:.0f}s")
        results = []
        for r in range(world_size):
            with open(os.path.join(result_dir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
