"""`dcoco train`: build the target, the data and the trainer for a config, then run."""

from __future__ import annotations

import os

import torch

from ..target import Target
from .config import TrainConfig
from .data import RegeneratedUnion
from .trainer import Trainer


def train(cfg: TrainConfig) -> Trainer:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    threads = cfg.optim.threads
    if cfg.parallel.context > 1:  # optim.threads is the job's: the processes share the cores
        threads = max(1, (threads or os.cpu_count() or 1) // cfg.parallel.context)
    if threads:
        torch.set_num_threads(threads)
    target = Target.from_pretrained(cfg.target.model, dtype=cfg.target.dtype, device=cfg.target.device)
    trainer = Trainer(cfg, target, RegeneratedUnion(cfg.data.path))
    trainer.run()
    return trainer
