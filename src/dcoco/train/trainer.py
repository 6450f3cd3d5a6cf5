"""The drafter training loop: AdamW + warm-up + cosine (or warm-up, stable, decay: `optim.schedule`),
gradient clipping, periodic held-out evaluation (`Evaluator`), a time budget, atomic checkpoints and
exact resume. What is trained comes from the family registry: the model (`Family.build_model`), the
loss (`Family.build_loss`, one per family in `dcoco.train.losses`) and the export (`Family.save`).

One step takes `batch_size` sequences and `anchors_per_seq` anchor positions in each (sampled
uniformly over response positions; `dcoco.train.batch`). Every step logs its pace (`samples_per_s`:
sequences, `tokens_per_s`: their tokens); every `run.flops_every` steps also the matmul work it did
(`gflop`, `dcoco.train.flops`) and the TFLOPS achieved.

Context parallelism (`parallel.context` = W > 1): W processes run this loop in step (same seed,
data order and anchors); each trains its share of every batch (`dcoco.parallel.ContextShard`), the
gradients are summed over the processes before clipping, so every process takes the same update.
Process 0 alone evaluates, logs and saves.

Resume: `run.out/state.pt` holds the model, optimizer, scheduler, step, data order and every RNG
state; it is replaced atomically every `checkpoint_every` steps, so a killed run continues from
there and reaches the same weights as an uninterrupted one.
"""

from __future__ import annotations

import math
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..bench.system import device_label
from ..errors import ConfigError
from ..families import LossParts, ModelSource, build_model, get_family
from ..memory import resident_gb, trim_heap
from .batch import Batch, held_out, loss_batch, token_counts, truncate
from .config import TrainConfig, check_context_parallel
from .data import RegeneratedUnion
from .evaluate import Evaluator
from .features import FeatureSource, check_data
from .flops import StepFlops
from .losses import TargetHead
from .runstate import append_log, read_log, save_state, truncate_log, write_log

#: in an exported drafter: the log rows of every stage behind it, each with its `stage` (1, 2, ...),
#: so that a stage continued from it (`drafter.init_from`) extends one training curve
CURVE_LOG = "training_log.jsonl"


def samples_seen(checkpoint: str) -> int:
    """Training sequences behind a drafter checkpoint, from its provenance (`dcoco_training`): the
    recorded count, else steps x sequences per step of the run that exported it; 0 if unknown."""
    import json

    try:
        prov = json.loads((Path(checkpoint) / "config.json").read_text()).get("dcoco_training") or {}
    except (OSError, ValueError):
        return 0
    if "samples_seen" in prov:
        return int(prov["samples_seen"])
    batch = ((prov.get("config") or {}).get("optim") or {}).get("batch_size", 0)
    return int(prov.get("step", 0)) * int(batch)


def training_answers(target, paths: list[str], permille: int) -> list[dict]:
    """Every answer of the directories `paths` that is not held out (by the same hash as the data's)."""
    union = RegeneratedUnion(paths)
    check_data(target, union, online=True)  # token ids only
    return held_out(union.samples(), permille, held=False)


def carried_evaluations(rows: list[dict]) -> list[dict]:
    """The corrected evaluations of a checkpoint's curve (those it carried and its own), marked
    `carried`: the part they measured continues on another backbone, whose own rows make the line."""
    keep = ("samples_seen", "step", "decayed")
    return [
        {**{k: v for k, v in r.items() if k.startswith("eval_") or k in keep}, "carried": True}
        for r in rows
        if "eval_tau_dflash" in r
    ]


def drawn_subset(n: int, seed: int, count: int) -> list[int]:
    """The indices (sorted) of the `count` of `n` training samples that `data.train_samples=count`
    draws with `optim.seed=seed` (all of them when count >= n): what a later stage leaves out with
    `data.exclude_subsets` is exactly what an earlier one trained on."""
    if count >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), count))


def drafter_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, scale: Optional[Callable[[str], float]] = None
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, weight decay on matrices only (not norms and biases).
    `scale(name)` sets a parameter's rate as a fraction of `lr` (`Family.lr_scale`: a warm backbone
    that a fresh head trains with keeps a lower one); the schedule multiplies every group alike."""
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, scale(name) if scale else 1.0), []).append(p)
    # matrices first, then by rate: with one rate, the two groups of every earlier run (resumable)
    order = sorted(groups, key=lambda k: (not k[0], -k[1]))
    return torch.optim.AdamW(
        [{"params": groups[k], "weight_decay": weight_decay if k[0] else 0.0, "lr": lr * k[1]} for k in order],
        lr=lr,
        betas=(0.9, 0.95),
    )


class Trainer:
    def __init__(self, cfg: TrainConfig, target, data: RegeneratedUnion):
        self.cfg = cfg
        self.target = target
        self.data = data
        self.family = get_family(cfg.method)
        self.out = Path(cfg.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        o, d = cfg.optim, cfg.drafter
        torch.manual_seed(o.seed)
        online = cfg.data.features != "stored"
        check_data(target, data, online)
        # at least two response tokens within data.max_length: an anchor and its label
        cut = cfg.data.max_length

        def usable(union: RegeneratedUnion) -> list[dict]:
            return [s for s in union.samples() if min(len(s["input_ids"]), cut) - s["prompt_len"] >= 2]

        samples = usable(data)
        self.train_samples = held_out(samples, cfg.data.eval_permille, held=False)
        eval_data = data if cfg.data.eval_path is None else RegeneratedUnion(cfg.data.eval_path)
        # an eval_path of token ids alone (the packed corpus) has its features recomputed, whatever
        # data.features reads for training (stored: new answers regenerated with their features)
        eval_online = online or not eval_data.has_features
        if eval_data is not data:
            check_data(target, eval_data, eval_online)
        pool = samples if eval_data is data else usable(eval_data)
        self.eval_samples = held_out(pool, cfg.data.eval_permille)[: cfg.data.eval_samples]
        if not self.train_samples:
            raise ConfigError(f"no training samples in {data.root}")
        every_answer, n = self.train_samples, len(self.train_samples)
        for seed, count, *first in cfg.data.exclude_subsets:  # in stage order: each drew from what was left
            pool = first[0] if first else len(self.train_samples)
            if pool > len(self.train_samples):
                raise ConfigError(
                    f"data.exclude_subsets: the stage of optim.seed={seed} drew from {pool} answers, "
                    f"but {len(self.train_samples)} are left here (is data.path the one it trained on?)"
                )
            left_out = set(drawn_subset(pool, seed, count))
            self.train_samples = [s for i, s in enumerate(self.train_samples) if i not in left_out]
        if not self.train_samples:
            raise ConfigError(f"data.exclude_subsets leaves none of the {n} training samples")
        if cfg.data.drawn_from is not None:
            left = len(self.train_samples)
            if cfg.data.drawn_from > left:
                raise ConfigError(f"data.drawn_from={cfg.data.drawn_from}, but {left} training answers are left here")
            self.train_samples = self.train_samples[: cfg.data.drawn_from]
        self.drawn_from = len(self.train_samples)  # a later stage's third number in data.exclude_subsets
        if cfg.data.train_samples is not None:
            picked = drawn_subset(len(self.train_samples), o.seed, cfg.data.train_samples)
            self.train_samples = [self.train_samples[i] for i in picked]
        self.device = target.device
        source = ModelSource(
            counts=lambda: token_counts(self.train_samples, target.vocab_size, cfg.data.max_length),
            taps=list(data.manifest["taps"]),
            answers=lambda paths: (
                every_answer if paths is None else training_answers(target, paths, cfg.data.eval_permille)
            ),
        )
        with torch.device(self.device):  # the drafter, its heads and the loss buffers live by the target
            self.model = build_model(self.family, d, target, source).to(self.device)
        last = self.family.reads_last_layer(d)
        cache = cfg.data.feature_cache if cfg.data.features == "cached" else None
        self.features = FeatureSource(target, data, self.model.cfg.taps, last, online, cache)
        eval_features = self.features
        if eval_data is not data:  # stored features are read from the directory that holds the sample
            eval_features = FeatureSource(target, eval_data, self.model.cfg.taps, last, eval_online, cache)
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.get_output_embeddings()
        for p in target.model.parameters():
            p.requires_grad_(False)
        parts = LossParts(
            self.embed, self.lm_head, TargetHead(target) if last else None, self.features.split, o.loss_decay_gamma
        )
        with torch.device(self.device):
            self.loss = self.family.build_loss(self.model, parts, d)
        p = cfg.parallel
        self.context, self.rank = p.context, 0  # context-parallel processes, and this one's rank
        if p.context > 1:
            from ..parallel.launch import join_launched_job

            check_context_parallel(p, str(self.device))
            join_launched_job(p.context)
            self.rank = dist.get_rank()
        self.evaluator = Evaluator(self.loss, eval_features, self.eval_samples, cfg.data.max_length, self.autocast)
        self.opt = drafter_optimizer(self.model, o.lr, o.weight_decay, self.family.lr_scale(d))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.lr_lambda)
        self.step = 0
        self.gen = torch.Generator().manual_seed(o.seed)
        self.epoch, self.order, self.cursor = 0, None, 0
        self.train_seconds = 0.0  # wall time of the training steps so far (kept across resumes)
        self.batch_tokens = 0  # tokens of the last batch's sequences (its pace in the log)
        # sequences seen before this run: a stage continued from a checkpoint extends its curve
        self.samples_before = samples_seen(d.init_from) if d.init_from else 0
        self.earlier = read_log(Path(d.init_from) / CURVE_LOG) if d.init_from else []
        part = self.family.continued_part(d)  # e.g. a corrector moved onto this backbone: its history comes along
        self.carried = carried_evaluations(read_log(Path(part) / CURVE_LOG)) if part else []
        self.stage = 1 + max((r.get("stage", 0) for r in self.earlier), default=0)
        self.budget_fixed = False  # optim.time_budget_s: steps already set from the measured pace
        self.log_path = self.out / "log.jsonl"
        self.restart_requested = False  # run() stopped at a `run.restart_every` step, state saved
        self._resume()

    def export(self, path: Path) -> None:
        self.family.save(path, self.model, {**self.family.checkpoint_extra(self.cfg.drafter), **self.provenance()})
        write_log(Path(path) / CURVE_LOG, self.curve_rows())

    def curve_rows(self) -> list[dict]:
        """The earlier stages' log rows, a continued part's carried evaluations and this run's rows,
        marked with its stage."""
        return self.earlier + self.carried + [{**r, "stage": self.stage} for r in read_log(self.log_path)]

    def provenance(self) -> dict:
        return {
            "dcoco_training": {
                "step": self.step,
                "train_samples": len(self.train_samples),
                "drawn_from": self.drawn_from,
                "train_seconds": round(self.train_seconds),
                "samples_seen": self.samples_seen,
                "threads": torch.get_num_threads(),
                "device": device_label(str(self.device)),
                "data": str(self.cfg.data.path),
                "eval_data": str(self.cfg.data.eval_path or self.cfg.data.path),
                "config": self.cfg.model_dump(),
            }
        }

    @property
    def samples_seen(self) -> int:
        """Training sequences seen by this drafter, earlier stages (`drafter.init_from`) included."""
        return self.samples_before + self.step * self.cfg.optim.batch_size

    # -- schedule and data -------------------------------------------------------------------
    def lr_lambda(self, step: int) -> float:
        o = self.cfg.optim
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "wsd":  # 1 until decay_start, then linearly down to min_lr_ratio
            start = self.decay_start
            t = max(0, step - start + 1) / max(1, o.steps - start)
            return 1 - (1 - o.min_lr_ratio) * min(1.0, t)
        t = (step - o.warmup_steps) / max(1, o.steps - o.warmup_steps)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    @property
    def decay_start(self) -> int:
        """`optim.schedule=wsd`: the first step taken at a decayed learning rate (the stable phase and
        the warm-up are the steps before it)."""
        o = self.cfg.optim
        return max(o.warmup_steps, o.steps - round(o.decay_fraction * o.steps))

    def next_batch(self) -> Batch:
        o = self.cfg.optim
        chosen = []
        while len(chosen) < o.batch_size:
            if self.order is None or self.cursor >= len(self.order):
                self.order = torch.randperm(len(self.train_samples), generator=self.gen, device="cpu").tolist()
                self.cursor = 0
                if chosen or self.step:
                    self.epoch += 1
            chosen.append(self.train_samples[self.order[self.cursor]])
            self.cursor += 1
        samples = [truncate(s, self.cfg.data.max_length) for s in chosen]
        self.batch_tokens = sum(len(s["input_ids"]) for s in samples)
        if self.context > 1:
            from ..parallel import ContextShard, ZigzagLayout

            layout = ZigzagLayout([len(s["input_ids"]) for s in samples], self.context)
            ContextShard(layout, attention=self.cfg.parallel.attention).attach(self.loss)
        return loss_batch(self.loss, samples, self.features(samples), o.anchors_per_seq, self.gen)

    # -- loop --------------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.optim.autocast_bf16)

    def train_step(self) -> dict:
        with torch.device(self.device):  # tensors the batch and the loss create go where the model is
            return self._train_step()

    def _train_step(self) -> dict:
        self.model.train()
        batch = self.next_batch()
        with self.autocast():
            loss, extras = self.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        metrics = extras.get("metrics", {})
        if self.context > 1:
            from ..parallel import allreduce_gradients

            allreduce_gradients(self.model)
            loss, metrics = self._summed(loss, metrics)
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        out = {"loss": loss.item(), "grad_norm": gnorm.item(), "lr": self.sched.get_last_lr()[0]}
        out.update(metrics)
        return out

    @staticmethod
    def _summed(loss: torch.Tensor, metrics: dict) -> tuple[torch.Tensor, dict]:
        """The loss and its logged terms (`*_loss`) summed over the context-parallel processes (each
        holds its share); the other metrics are ratios of one process's blocks and are left out."""
        keys = [k for k in metrics if k.endswith("_loss")]
        total = torch.tensor([float(loss.detach())] + [float(metrics[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(total)
        return total[0], dict(zip(keys, total[1:].tolist()))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out figures (`Evaluator`): random anchors and τ as greedy decoding realizes it."""
        self.model.eval()
        self.loss.shard = None  # one process evaluates alone
        try:
            with torch.device(self.device):
                return {**self.evaluator.random_anchors(), **self.evaluator.decoded()}
        finally:
            self.model.train()

    def run(self, progress: bool = True) -> None:
        from tqdm import tqdm

        o, r = self.cfg.optim, self.cfg.run
        bar = tqdm(
            total=o.steps,
            initial=self.step,
            desc=f"train {self.cfg.method}",
            unit="step",
            file=sys.stderr,
            disable=not progress or not self.lead,
        )
        last_eval = None
        evaluates = bool(self.eval_samples) and self.lead
        if self.step == 0 and self.cfg.drafter.init_from and not self.earlier and evaluates:
            # a warm start whose checkpoint carries no curve: its held-out figures open this one
            opening = {"stage": self.stage - 1, "step": 0, "samples_seen": self.samples_before}
            self.earlier = [{**opening, **self.evaluate()}]
        flops = StepFlops()
        finished_on_start = self.step >= o.steps
        budget_from = (
            (self.step, time.time()) if o.time_budget_s and not self.budget_fixed and not finished_on_start else None
        )
        try:
            while self.step < o.steps:
                counted = bool(r.flops_every) and self.step % r.flops_every == 0
                t0 = time.time()
                with flops.counting() if counted else nullcontext():
                    m = self.train_step()
                trim_heap()
                dt = time.time() - t0
                self.train_seconds += dt
                m.update(step=self.step, epoch=self.epoch, samples_seen=self.samples_seen, step_s=round(dt, 3))
                m.update(samples_per_s=round(o.batch_size / dt, 3), tokens_per_s=round(self.batch_tokens / dt, 1))
                m.update(rss_gb=resident_gb())
                if counted:  # the counter's own overhead is in dt: a lower bound
                    m.update(gflop=round(flops.total / 1e9, 1), tflops=round(flops.total / dt / 1e12, 4))
                if budget_from is not None and self.step - budget_from[0] >= o.time_budget_probe:
                    self._fit_time_budget(budget_from)
                    m["steps_from_time_budget"] = o.steps
                    bar.total, budget_from = o.steps, None
                if evaluates and (self.step % r.eval_every == 0 or self.step == o.steps):
                    last_eval = self.evaluate()
                    m.update(last_eval)
                self._log(m)
                bar.set_postfix(
                    loss=f"{m['loss']:.3f}",
                    tau=f"{last_eval['eval_tau']:.2f}" if last_eval else "-",
                    seq_s=f"{m['samples_per_s']:.2f}",
                )
                bar.update(1)
                if o.schedule == "wsd" and self.step == self.decay_start and self.lead:
                    self.export(self.out / "stable")  # what the next stage continues from
                restart = self.context == 1 and r.restart_every > 0 and self.step % r.restart_every == 0
                restart = restart and self.step < o.steps
                if self.step % r.checkpoint_every == 0 or self.step == o.steps or restart:
                    self.save()
                if restart:
                    self.restart_requested = True  # the caller starts a fresh process, which resumes here
                    return
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {self.step}; resume with the same command", file=sys.stderr)
            raise
        finally:
            bar.close()
        if finished_on_start and self.lead:  # started again after the last step: re-export (e.g. new defaults)
            self.export(self.out / "drafter")
        if self.lead:
            self.keep_decayed_end()
            self.plot()

    def keep_decayed_end(self) -> None:
        """`run.out/stable`'s curve also carries this stage's evaluations past it, marked `decayed`: the
        next stage continues from `stable/`, and its curve would otherwise lose the evaluated end of
        every stage before it (the drafter each stage shipped)."""
        stable = self.out / "stable" / CURVE_LOG
        if not stable.exists():
            return
        kept = [r for r in read_log(stable) if not (r.get("decayed") and r.get("stage") == self.stage)]
        ends = [{**r, "stage": self.stage, "decayed": True} for r in read_log(self.log_path)]
        write_log(stable, kept + [r for r in ends if r["step"] > self.decay_start and "eval_loss" in r])

    @property
    def lead(self) -> bool:
        """Whether this process evaluates, logs and saves (the only one, or rank 0 of the job)."""
        return self.rank == 0

    def _fit_time_budget(self, since: tuple[int, float]) -> None:
        """Set `optim.steps` so that training ends about `time_budget_s` after it started (evaluation
        and checkpoints included), from the pace of the steps since `since` (step, wall time)."""
        o = self.cfg.optim
        elapsed = time.time() - since[1]
        pace = elapsed / (self.step - since[0])
        o.steps = max(self.step + 1, self.step + int((o.time_budget_s - elapsed) / pace))
        if self.context > 1:  # every process stops at rank 0's count
            steps = torch.tensor([o.steps])
            dist.broadcast(steps, 0)
            o.steps = int(steps)
        self.budget_fixed = True
        print(f"time budget {o.time_budget_s:.0f}s at {pace:.3f}s/step: training for {o.steps} steps", file=sys.stderr)

    # -- persistence -----------------------------------------------------------------------------
    def _log(self, m: dict) -> None:
        if self.lead:
            append_log(self.log_path, m)

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "order": self.order,
            "cursor": self.cursor,
            "train_seconds": self.train_seconds,
            "earlier": self.earlier,
            "budget_steps": self.cfg.optim.steps if self.budget_fixed else None,
            "gen": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "config": self.cfg.model_dump(),
        }

    def save(self) -> None:
        if self.lead:
            save_state(self.out, self.state())
            self.export(self.out / "drafter")

    def _resume(self) -> None:
        path = self.out / "state.pt"
        if not path.exists():
            return
        st = torch.load(path, weights_only=False, map_location="cpu")
        try:
            missing, unexpected = self.model.load_state_dict(st["model"], strict=False)
        except RuntimeError as e:  # a weight of another shape: the config changed since the run started
            reason = str(e).splitlines()[-1].strip()
            raise ConfigError(f"{path}: saved model does not match the config ({reason})") from None
        if set(missing) - {"draft_ids"} or unexpected:  # runs saved before draft vocabularies keep the new one
            raise ConfigError(
                f"{path}: saved model does not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        try:
            self.opt.load_state_dict(st["opt"])
        except ValueError as e:  # other groups: the trainable parameters or their rates changed
            raise ConfigError(f"{path}: saved optimizer does not match the config ({e})") from None
        self.sched.load_state_dict(st["sched"])
        self.step, self.epoch, self.order, self.cursor = st["step"], st["epoch"], st["order"], st["cursor"]
        self.train_seconds = st.get("train_seconds", 0.0)
        self.earlier = st.get("earlier", self.earlier)
        if self.cfg.optim.time_budget_s and st.get("budget_steps"):  # the steps fixed before the stop
            self.cfg.optim.steps, self.budget_fixed = st["budget_steps"], True
        self.gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        if self.lead:
            truncate_log(self.log_path, self.step)
            print(f"resumed from step {self.step}", file=sys.stderr)

    def plot(self) -> Optional[Path]:
        from .plots import training_curve

        return training_curve(self.curve_rows(), self.out / "curve.png", title=f"{self.cfg.method} training")
