"""`dcoco train ... parallel.context=2` end to end: the command starts itself again as 2 gloo processes
through torch's launcher, and trains to the same drafter as one process.

A tiny HF target is saved to disk and answers 24 prompts (`regenerate`); both runs train DCOCO (its
DFlash backbone and corrector) and EAGLE-3 on its answers with online features, float32, for a few
steps. Every step's loss and the final weights must agree: the processes' losses and gradients add
up to the one-process ones (tested to 1e-10 in float64 in test_drafter_context_parallel.py); here
float32 rounding differs in order only.

`run.restart_every` makes the same command start itself again in a fresh process (a plain exec, no
launcher), which resumes where the last one saved: it must end at the uninterrupted run's drafter.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model

from dcoco.sampling import SamplingParams
from dcoco.target import Target
from dcoco.train.data import Prompt, regenerate

LAYERS = 4
STEPS = 4
LR = 1e-3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target saved as an HF directory, and its answers to 24 prompts."""
    root = tmp_path_factory.mktemp("train_cp")
    model = tiny_model("llama", seed=5, num_hidden_layers=LAYERS, initializer_range=0.15)
    model.save_pretrained(root / "target")
    target = Target(model)
    rng = random.Random(0)
    prompts = [
        Prompt(id=f"p{i}", messages=[rng.randrange(target.vocab_size) for _ in range(rng.randint(4, 14))])
        for i in range(24)
    ]
    taps = list(range(1, LAYERS + 1))  # every layer's output: DFlash's two taps and EAGLE-3's three
    sp = SamplingParams(max_tokens=20)
    regenerate(target, prompts, root / "data", num_samples=24, taps=taps, sampling=sp, batch_size=12, progress=False)
    (root / "train.yaml").write_text("# every setting is on the command line\n")
    return root


def train(root, out, method, *extra):
    """`dcoco train` in a fresh process; returns (exit status, stderr)."""
    over = {
        "method": method,
        "target.model": root / "target",
        "target.dtype": "float32",
        "data.path": root / "data",
        "data.features": "online",
        "data.eval_permille": 0,
        "optim.steps": STEPS,
        "optim.batch_size": 3,
        "optim.anchors_per_seq": 5,
        "optim.lr": LR,
        "optim.warmup_steps": 1,
        "optim.autocast_bf16": False,
        "optim.threads": 2,
        "drafter.num_layers": 1,
        "drafter.block_size": 4,
        "drafter.num_features": 2,
        "drafter.draft_vocab_size": 64,
        "run.out": out,
        "run.checkpoint_every": STEPS,
        "run.flops_every": 0,
    }
    argv = [f"{k}={v}" for k, v in over.items()] + list(extra)
    p = subprocess.run(
        [sys.executable, "-m", "dcoco.cli", "train", "--config", str(root / "train.yaml"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return p.returncode, p.stderr


@pytest.mark.parametrize("method", ["dcoco", "eagle3"])
def test_two_processes_train_the_one_process_drafter(tiny_run, tmp_path, method):
    rc, err = train(tiny_run, tmp_path / "one", method)
    assert rc == 0, err
    rc, err = train(tiny_run, tmp_path / "two", method, "parallel.context=2")
    assert rc == 0, err
    logs = [[json.loads(x) for x in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("one", "two")]
    assert [r["step"] for r in logs[1]] == list(range(1, STEPS + 1))
    for a, b in zip(*logs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, b)
    one, two = (torch.load(tmp_path / d / "state.pt", weights_only=False)["model"] for d in ("one", "two"))
    # AdamW divides each element's gradient by its own running scale, so an element whose gradient
    # nearly cancels moves on rounding noise: the corrector's output bias (it shifts every candidate's
    # score alike, so its gradient is noise) by about +-lr a step, and on an Intel AMX machine one of
    # 8,192 MLP weights by 1.1e-5 (the rest by < 1e-6). A lost or doubled shard moves whole tensors:
    # almost every element must agree to 1e-5, and none by more than AdamW's largest travel.
    for k in one:
        d = (one[k].float() - two[k].float()).abs()
        off = (d > 1e-5).float().mean()
        assert d.max() <= 2 * LR * STEPS and (k == "corrector.out.bias" or off <= 1e-3), (k, float(d.max()), float(off))
    assert list((tmp_path / "two" / "drafter").iterdir())  # rank 0 exported the drafter


def test_bad_parallel_settings_are_one_line_errors_before_launch(tiny_run, tmp_path):
    rc, err = train(tiny_run, tmp_path / "x", "dflash", "parallel.context=0")
    assert rc == 2 and err.strip().count("\n") == 0 and "parallel.context" in err, err
    rc, err = train(tiny_run, tmp_path / "x", "dflash", "parallel.context=2", "target.device=cuda")
    assert rc == 2 and err.strip().count("\n") == 0 and "gloo" in err, err


def test_restart_every_resumes_in_a_fresh_process_to_the_same_drafter(tiny_run, tmp_path):
    """...and the command's warnings (bf16 autocast on a CPU without bf16 matrix units) come once, not
    once per fresh process."""
    from dcoco.target import cpu_bf16_matrix_units

    bf16 = "optim.autocast_bf16=true"
    rc, err = train(tiny_run, tmp_path / "straight", "dflash", bf16)
    assert rc == 0, err
    rc, err = train(tiny_run, tmp_path / "restarted", "dflash", bf16, "run.restart_every=1", "run.checkpoint_every=2")
    assert rc == 0, err
    assert [f"resumed from step {s}" in err for s in range(1, STEPS)] == [True] * (STEPS - 1), err
    assert err.count("no bf16 matrix instructions") == (0 if cpu_bf16_matrix_units() else 1), err
    logs = [
        [json.loads(x) for x in (tmp_path / d / "log.jsonl").read_text().splitlines()]
        for d in ("straight", "restarted")
    ]
    assert [r["step"] for r in logs[1]] == list(range(1, STEPS + 1))
    a, b = (torch.load(tmp_path / d / "state.pt", weights_only=False)["model"] for d in ("straight", "restarted"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
