"""`dcoco rl`: load the policy, build the run (one process, or this process's rank of the grid), train."""

from __future__ import annotations

import os

import torch

from ..target import Target
from .config import RLConfig
from .loop import RLRun


def run_rl(cfg: RLConfig, progress: bool = True) -> RLRun:
    """`dcoco rl`: load the policy, build the run (resuming from `run.out`), train. With
    `parallel.pipeline` x `parallel.context` > 1 this process is one rank of the grid (`GridRLRun`)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    threads = cfg.grpo.threads
    if cfg.processes > 1:  # grpo.threads is the job's: the processes share the cores
        threads = max(1, (threads or os.cpu_count() or 1) // cfg.processes)
    if threads:
        torch.set_num_threads(threads)
    policy = Target.from_pretrained(cfg.policy.model, dtype=cfg.policy.dtype)
    if cfg.processes == 1:
        run = RLRun(cfg, policy)
    else:
        from ..parallel.launch import join_launched_job
        from .grid import GridRLRun

        join_launched_job(cfg.processes)
        run = GridRLRun(cfg, policy)
        progress = progress and run.lead
    run.run(progress=progress)
    return run
