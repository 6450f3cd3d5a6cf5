"""Device-correct by construction: every tensor the inference path creates is made on the device of
the target, the drafter or its inputs, never on the process default (CPU), so the same code runs on
CUDA. No GPU is needed to check it.

The trick: the target and the drafters are built normally on CPU, then generation runs inside
`with torch.device("meta")`. A tensor created *without* an explicit device (`torch.zeros(n)`,
`torch.tensor(rows)`, `torch.arange(T)`, ...) then lands on the meta device, and the first operation
that mixes it with the CPU model's tensors, or reads its values (`.tolist()`, `if t.any()`), raises:
the same bug that breaks a CUDA run (a CPU tensor where a CUDA one is expected), caught on CPU.
Tensors made with `device=x.device`, `x.new_zeros`, `torch.zeros_like`, ... are unaffected, so a
device-correct run gives exactly the tokens of a plain run, which the test checks too.

The meta run fails where a stray tensor is *used*; to name where it was *made*, the same run records
every tensor factory called from dcoco's own source without a `device` argument (a
`TorchFunctionMode` that sees each factory call before the meta default is filled in) and fails
with that list. Hugging Face's model code is not held to this (only calls made directly from
`src/dcoco` count); it runs under the meta default too, and passes.

Covered: vanilla, ngram and the shipped dflash / dcoco (its vocabulary and shortlist T > 0 walks) /
dspark (with confidence truncation) / eagle3 checkpoints on the embedded SmolLM2 (float32), a batch of two prompts
of different lengths (padding masks, ragged drafter contexts), greedy, sampled and a mixed batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dcoco
from dcoco import SamplingParams
from dcoco.engine import SpeculativeEngine
from dcoco.speculative import SpeculativeConfig, load_drafter

pytestmark = pytest.mark.smollm

SRC = Path(dcoco.__file__).resolve().parent
PROMPTS = [
    "Repeat this list exactly, then sort it: pear, apple, fig, plum, kiwi.",
    "What is the capital of France?",
]
MAX_NEW = 12
PARAMS = {
    "greedy": [SamplingParams(max_tokens=MAX_NEW), SamplingParams(max_tokens=MAX_NEW)],
    "sampled": [
        SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_NEW),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, max_tokens=MAX_NEW),
    ],
    "mixed": [SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_NEW), SamplingParams(max_tokens=MAX_NEW)],
}
VARIANTS = {
    "vanilla": {"method": "vanilla"},
    "ngram": {"method": "ngram"},
    "dflash": {"method": "dflash"},
    "dcoco": {"method": "dcoco"},  # the shipped checkpoint's T > 0 walk (vocab)
    "dcoco-sampled": {"method": "dcoco", "dcoco_walk": "sampled"},  # (the one-hot walk is its greedy path)
    "dspark": {"method": "dspark"},  # with confidence truncation, see below
    "eagle3": {"method": "eagle3"},
}

# tensor factories that take a `device` (torch's own list is private: torch.utils._device)
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.range,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tril_indices,
    torch.triu_indices,
}


class DevicelessFactories(TorchFunctionMode):
    """Records `file:line (function)` of every factory call made from dcoco's source without `device`."""

    def __init__(self):
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            f = sys._getframe(1)
            while f is not None and "/torch/" in f.f_code.co_filename:
                f = f.f_back
            if f is not None and Path(f.f_code.co_filename).resolve().is_relative_to(SRC):
                rel = Path(f.f_code.co_filename).resolve().relative_to(SRC.parent)
                self.sites.add(f"{rel}:{f.f_lineno} ({f.f_code.co_name})")
        return func(*args, **kwargs)


def run(target, drafter, prompts, params):
    """Token ids and (drafted, accepted) of one batch through the engine."""
    outs, stats = SpeculativeEngine(target, drafter).generate(prompts, params)
    return [o.token_ids for o in outs], (stats.drafted, stats.accepted)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_inference_creates_no_tensor_off_device(smollm, variant):
    prompts = [smollm.encode(p) for p in PROMPTS]
    drafter = load_drafter(SpeculativeConfig(**VARIANTS[variant]), smollm)
    if variant == "dspark":
        drafter.confidence_threshold = 0.5  # also cut blocks by the confidence head's survival estimate
    for name, params in PARAMS.items():
        plain = run(smollm, drafter, prompts, params)
        recorder = DevicelessFactories()
        try:
            with torch.device("meta"), recorder:
                tricked = run(smollm, drafter, prompts, params)
        except Exception as e:  # noqa: BLE001 - report where the stray tensors were made
            sites = "\n  ".join(sorted(recorder.sites)) or "(none recorded)"
            raise AssertionError(
                f"{variant}/{name}: a tensor was created off the model's device ({type(e).__name__}: {e});\n"
                f"factory calls without device=:\n  {sites}"
            ) from e
        assert not recorder.sites, f"{variant}/{name}: factory calls without device=:\n  " + "\n  ".join(
            sorted(recorder.sites)
        )
        assert tricked == plain, f"{variant}/{name}: outputs differ under the meta default device"
        if variant != "vanilla" and name == "greedy":
            assert plain[1][0] > 0, "the drafter drafted nothing: the test would not exercise it"
