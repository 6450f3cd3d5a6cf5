"""`dcoco train`: build the target, the data and the trainer for a config, then run."""

from __future__ import annotations

import os
import warnings

import torch

from ..target import Target, cpu_bf16_matrix_units
from .config import TrainConfig
from .data import RegeneratedUnion
from .trainer import Trainer

#: oneDNN keeps the kernels it built per input shape (primitives), 1,024 by default. Training runs the
#: target on one sequence at a time at its own length, so most steps add new shapes, and a full cache
#: holds gigabytes the next step rarely reuses; a few entries keep what one step does reuse (55 online
#: DFlash steps: 8% faster, 3.1 GB resident against 4.6; docs/training.md#memory).
TRAIN_PRIMITIVE_CACHE = "8"


def cap_kernel_cache() -> None:
    """Cap oneDNN's kernel cache for training steps. oneDNN reads the setting when it makes its first
    kernel, so call this before the target loads; a value already in the environment wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", TRAIN_PRIMITIVE_CACHE)


def warn_slow_bf16(cfg: TrainConfig) -> None:
    """On a CPU without bf16 matrix instructions a bf16 step runs 2x or more slower than a float32 one
    (an online DFlash step on 2 Ice Lake cores: 17.5 s against 7.5; bf16 products on AVX2 alone run 6-7x
    slower than float32 ones), so say how to train in float32."""
    bf16 = cfg.target.dtype == "bfloat16" or cfg.optim.autocast_bf16
    if cfg.target.device.startswith("cpu") and bf16 and not cpu_bf16_matrix_units():
        warnings.warn(
            "this CPU has no bf16 matrix instructions (AVX-512 BF16 or AMX): bf16 matrix products run 2-7x slower "
            "than float32 here; add target.dtype=float32 optim.autocast_bf16=false",
            stacklevel=2,
        )


def train(cfg: TrainConfig) -> Trainer:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    cap_kernel_cache()
    threads = cfg.optim.threads
    if cfg.parallel.context > 1:  # optim.threads is the job's: the processes share the cores
        threads = max(1, (threads or os.cpu_count() or 1) // cfg.parallel.context)
    if threads:
        torch.set_num_threads(threads)
    target = Target.from_pretrained(cfg.target.model, dtype=cfg.target.dtype, device=cfg.target.device)
    trainer = Trainer(cfg, target, RegeneratedUnion(cfg.data.path))
    trainer.run()
    return trainer
