"""Starting distributed jobs: the commands' own (`torchrun`, `join_launched_job`, `launched_rank`) and a local
gloo job on loopback for tests and the CPU benchmark (`spawn_local`).

`dcoco train` / `dcoco rl` with `parallel.context` > 1 start themselves again under torch's own
launcher (`torch.distributed.run`), one process per rank; each process then joins the job from the
launcher's environment (gloo on CPU).

Why not plain ``mp.spawn`` for tests: it joins forever, so one rank stuck in a receive
hangs the caller.  :func:`spawn_local` joins with a deadline, kills only the
processes it started, and returns each rank's return value.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import WorldSizeMismatchError

__all__ = ["free_port", "join_launched_job", "launched", "launched_rank", "spawn_local", "torchrun"]


def launched() -> bool:
    """Whether this process is a rank of a job started by torch's launcher."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def torchrun(nproc: int, argv: Sequence[str], log_dir: str, module: str = "dcoco.cli") -> int:
    """Run `python -m module argv...` as `nproc` ranks of one job on this machine through torch's
    own launcher (`torch.distributed.run`'s `elastic_launch`, standalone rendezvous). Rank 0 keeps
    the terminal; the other ranks' output goes to `log_dir/<job>/attempt_0/<rank>/`. Returns 0, or
    the exit status of the first rank that failed (a rank prints its own one-line error)."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.disable(logging.CRITICAL)  # the launcher's own log lines and tracebacks: the ranks report
    os.makedirs(log_dir, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nproc)}),
    )
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if rank != 0:
            print(f"dcoco: error: rank {rank} failed (exit {failure.exitcode}); its output is under {log_dir}",
                  file=sys.stderr)  # fmt: skip
        return failure.exitcode if failure.exitcode > 0 else 1
    except (KeyboardInterrupt, SignalException):  # passed on to the ranks: they stopped at their last checkpoint
        print("dcoco: interrupted", file=sys.stderr)
        return 130
    return 0


def join_launched_job(world_size: int, timeout_s: float = 1800.0) -> None:
    """Join the job this process was launched in (gloo, CPU tensors): it must have `world_size` ranks."""
    if dist.is_initialized():
        size = dist.get_world_size()
    elif not launched():
        raise WorldSizeMismatchError(
            f"{world_size} context-parallel ranks are needed; run the dcoco command itself (it starts them) "
            f"or torchrun --nproc-per-node {world_size}"
        )
    else:
        size = int(os.environ["WORLD_SIZE"])
    if size != world_size:
        raise WorldSizeMismatchError(f"the job has {size} processes, the config asks for {world_size}")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def launched_rank() -> Iterator[None]:
    """A command's work as a rank of a launched job: the rank leaves its process group before it
    exits. Left to the interpreter's exit, gloo's threads are torn down in no set order, and now and
    then the process aborts after its work is done ('terminate called without an active exception',
    exit -6), which fails the whole job."""
    try:
        yield
    finally:
        if launched() and dist.is_initialized():
            dist.destroy_process_group()


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
