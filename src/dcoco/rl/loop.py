"""The RL loop: GRPO on the policy, rollouts from dcoco's speculative engine with the live draft,
and draft co-training on the same step (`cotrain.py`).

One step:
  1. sync      policy (and draft) weights into the rollout engine's copies (nothing to do when the
               engine runs on the trained modules themselves, `policy.rollout_dtype: null`)
  2. rollout   `prompts_per_step` training problems x `group_size` seeded samples at the rollout
               temperature through a fresh `SpeculativeEngine` (fresh KV cache and draft state):
               lossless, so the samples are the policy's; the engine also returns each token's
               log-probability under the rollout's sampling distribution (`logprobs=True`)
  3. reward    task rewards -> group-relative advantages
  4. policy    forward / backward of the GRPO loss in micro-batches; the first forward also taps the
               drafter's layers (`Target.tapping`) and keeps those features, detached
  5. draft     lambda * draft loss on the same rollout tokens and features, backward into the draft
  6. update    clip and step each optimizer separately

Why not TRL's `GRPOTrainer`: see docs/rl.md. Exact resume: every source of randomness is a
function of (seed, step) -- training problems, rollout seeds, draft anchors -- and `state.pt`
holds both models and both optimizers, so a killed run continues to the same weights.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch

from ..draft_policy import LoadAwarePolicy
from ..engine import SpeculativeEngine
from ..errors import ConfigError
from ..metrics import SpecStats
from ..sampling import SamplingParams
from ..target import Target, resolve_dtype
from ..train.runstate import append_log, save_state, truncate_log
from .config import RLConfig
from .cotrain import DraftCoTrainer
from .grpo import completion_logprobs, group_advantages, grpo_loss
from .task import Problem, Task, build_task


def pad_batch(seqs: list[list[int]], prompt_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T), attention mask (B, T), and `targets` (B, T-1): position t predicts a
    completion token."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    targets = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for b, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[b, : len(s)] = 1
        targets[b, p - 1 : len(s) - 1] = True
    return ids, attn, targets


def _seeds(*key) -> random.Random:
    return random.Random(":".join(str(k) for k in key))


class RLRun:
    """A GRPO run with an optional co-trained draft, on `policy` (a `Target` around the HF model to
    train); `task` defaults to the one the config names."""

    def __init__(self, cfg: RLConfig, policy: Target, task: Optional[Task] = None):
        self.cfg = cfg
        g = cfg.grpo
        torch.manual_seed(g.seed)
        self.policy, self.model = policy, policy.model
        policy.set_taps(())  # no engine hooks travel into the copies below
        self.model.requires_grad_(True)
        self.task = task if task is not None else build_task(cfg.task)
        self.out = Path(cfg.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ref = copy.deepcopy(self.model).requires_grad_(False) if g.beta > 0 else None
        self.draft = DraftCoTrainer(cfg.draft, policy) if cfg.draft.method != "none" else None
        rd = cfg.policy.rollout_dtype
        if rd is None or resolve_dtype(rd) == policy.dtype:
            self.rollout_target, self.rollout_draft = policy, (self.draft.model if self.draft else None)
        else:
            dtype = resolve_dtype(rd)
            self.rollout_target = Target(copy.deepcopy(self.model).to(dtype), policy.tokenizer)
            self.rollout_draft = copy.deepcopy(self.draft.model).to(dtype) if self.draft else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=g.lr, weight_decay=g.weight_decay, betas=(0.9, 0.99))
        self.step = 0
        self.log_path = self.out / "log.jsonl"
        self._resume()
        (self.out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")

    # -- rollouts ----------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self) -> None:
        """Policy (and draft) weights into the rollout engine's copies, if it has its own."""
        if self.rollout_target is not self.policy:
            self.rollout_target.model.load_state_dict(self.model.state_dict())
        if self.draft is not None and self.rollout_draft is not self.draft.model:
            self.rollout_draft.load_state_dict(self.draft.model.state_dict())

    def rollout(self, prompts: list[list[int]], params: list[SamplingParams], token_budget: Optional[int] = None):
        """Generate through a fresh engine with the current draft (load-aware within `token_budget`
        tokens per pass when given); returns outputs, stats, seconds."""
        self.sync()
        drafter = self.draft.family.drafter(self.rollout_draft, self.rollout_target) if self.draft else None
        engine = SpeculativeEngine(
            self.rollout_target,
            drafter,
            self.cfg.rollout.num_speculative_tokens,
            max_batch_size=len(prompts),
            draft_policy=None if token_budget is None else LoadAwarePolicy(token_budget),
            logprobs=True,
        )
        t0 = time.perf_counter()
        outs, stats = engine.generate(prompts, params)
        return outs, stats, time.perf_counter() - t0

    def _encode(self, problems: list[Problem]) -> list[list[int]]:
        return [self.policy.encode(p.prompt) for p in problems]

    # -- one step ------------------------------------------------------------------------------------
    def collect(self, step: int) -> dict:
        """Rollouts and rewards for `step` (a pure function of the seed, the step and the weights)."""
        r, g = self.cfg.rollout, self.cfg.grpo
        problems = [p for p in self.task.train_problems(step, r.prompts_per_step) for _ in range(r.group_size)]
        prompts = self._encode(problems)
        rng = _seeds("rollout", g.seed, step)
        params = [
            SamplingParams(temperature=r.temperature, max_tokens=r.max_new_tokens, seed=rng.getrandbits(63))
            for _ in prompts
        ]
        outs, stats, secs = self.rollout(prompts, params, r.draft_token_budget)
        rewards = torch.tensor([self.task.reward(p, o.token_ids, o.text) for p, o in zip(problems, outs)])
        return {
            "outs": outs,
            "stats": stats,
            "rollout_s": secs,
            "rewards": rewards,
            "adv": group_advantages(rewards, r.group_size, g.scale_rewards),
        }

    def policy_pass(self, ro: dict, old: Optional[torch.Tensor], capture: bool):
        """Forward + backward of the GRPO loss over micro-batches. Returns the completion tokens'
        log-probs (flat, detached), the tapped features per sequence (when `capture`) and sums."""
        g, T = self.cfg.grpo, self.cfg.rollout.temperature
        outs = ro["outs"]
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        plens = [len(o.prompt_token_ids) for o in outs]
        n_seq, n_tok = len(seqs), sum(len(o.token_ids) for o in outs)
        taps = self.draft.feature_taps if capture else []
        lps, feats = [], []
        sums = {"clipped_tokens": 0.0, "tokens": 0.0, "kl_sum": 0.0, "loss": 0.0}
        done = 0
        for i in range(0, n_seq, g.micro_batch):
            ids, attn, tg = pad_batch(seqs[i : i + g.micro_batch], plens[i : i + g.micro_batch])
            with self.policy.tapping(taps) if taps else nullcontext():
                lp = completion_logprobs(self.model, ids, attn, tg, T)
                if taps:
                    f = self.policy.captured(taps).detach()
                    feats += [f[b, : len(s)] for b, s in enumerate(seqs[i : i + g.micro_batch])]
            k = int(tg.sum())
            old_mb = lp.detach() if old is None else lp.new_zeros(tg.shape).masked_scatter(tg, old[done : done + k])
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = completion_logprobs(self.ref, ids, attn, tg, T)
            loss, s = grpo_loss(
                lp,
                old_mb,
                ro["adv"][i : i + g.micro_batch],
                tg,
                g.clip_eps,
                g.clip_eps_high,
                ref,
                g.beta,
                g.loss_type,
                n_seq,
                n_tok,
            )
            loss.backward()
            lps.append(lp.detach()[tg])
            done += k
            sums["loss"] += loss.item()
            for key in ("clipped_tokens", "tokens", "kl_sum"):
                sums[key] += s[key]
        return torch.cat(lps), feats, sums

    def train_step(self) -> dict:
        g = self.cfg.grpo
        t0 = time.perf_counter()
        ro = self.collect(self.step)
        outs, stats = ro["outs"], ro["stats"]
        m = self._rollout_metrics(ro)
        t1 = time.perf_counter()
        old = None
        for it in range(g.iterations):
            capture = it == 0 and self.draft is not None
            lp, feats, sums = self.policy_pass(ro, old, capture)
            if it == 0:
                old = lp
                m.update(self._mismatch(lp, outs))
                m.update(policy_loss=sums["loss"], clip_frac=sums["clipped_tokens"] / max(1.0, sums["tokens"]))
                if self.ref is not None:
                    m["kl_ref"] = sums["kl_sum"] / max(1.0, sums["tokens"])
            if capture:
                td = time.perf_counter()
                samples = [
                    {"input_ids": o.prompt_token_ids + o.token_ids, "prompt_len": len(o.prompt_token_ids)} for o in outs
                ]
                gen = torch.Generator().manual_seed(_seeds("draft", g.seed, self.step).getrandbits(63))
                m.update(self.draft.backward(samples, feats, gen))
                m.update(self.draft.update())
                m["draft_s"] = round(time.perf_counter() - td, 3)
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if it == 0:
                m["policy_grad_norm"] = gnorm.item()
        self.step += 1
        now = time.perf_counter()
        m.update(step=self.step, update_s=round(now - t1, 3), step_s=round(now - t0, 3))
        m["step_tps"] = round(stats.output_tokens / max(now - t0, 1e-9), 3)
        return m

    def _rollout_metrics(self, ro: dict) -> dict:
        stats: SpecStats = ro["stats"]
        r = ro["rewards"].view(-1, self.cfg.rollout.group_size)
        return {
            "reward": round(ro["rewards"].mean().item(), 4),
            "reward_std": round(ro["rewards"].std().item(), 4) if ro["rewards"].numel() > 1 else 0.0,
            "solved": round((ro["rewards"] == 1.0).float().mean().item(), 4),
            "zero_std_groups": round((r.std(dim=1) == 0).float().mean().item(), 4),
            "completion_len": round(stats.output_tokens / len(ro["outs"]), 2),
            "rollout_tokens": stats.output_tokens,
            "rollout_s": round(ro["rollout_s"], 3),
            "rollout_tps": round(stats.output_tokens / max(ro["rollout_s"], 1e-9), 3),
            "acceptance_length": round(stats.acceptance_length, 4),
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance],
        }

    @staticmethod
    def _mismatch(policy_lp: torch.Tensor, outs) -> dict:
        """Training-inference mismatch on the rollout tokens: KL(rollout || policy), k3 estimate, and
        the largest per-token log-prob gap."""
        roll = torch.tensor([x for o in outs for x in o.logprobs], dtype=torch.float32)
        d = policy_lp - roll
        return {
            "train_infer_kl": float((torch.exp(d) - d - 1).mean()),
            "train_infer_max_logp_diff": float(d.abs().max()),
        }

    # -- validation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        """Greedy answers to the held-out problems: exact-match accuracy, mean reward, and the
        draft's acceptance at T = 0."""
        problems = self.task.val_problems()
        params = [SamplingParams(temperature=0.0, max_tokens=self.cfg.rollout.max_new_tokens, seed=0)] * len(problems)
        outs, stats, secs = self.rollout(self._encode(problems), params)
        acc = sum(self.task.correct(p, o.token_ids, o.text) for p, o in zip(problems, outs)) / len(problems)
        rew = sum(self.task.reward(p, o.token_ids, o.text) for p, o in zip(problems, outs)) / len(problems)
        return {
            "val_acc": round(acc, 4),
            "val_reward": round(rew, 4),
            "val_acceptance_length": round(stats.acceptance_length, 4),
            "val_tps": round(stats.output_tokens / max(secs, 1e-9), 3),
        }

    # -- the run --------------------------------------------------------------------------------------
    def run(self, progress: bool = True) -> None:
        from tqdm import tqdm

        g, r = self.cfg.grpo, self.cfg.run
        bar = tqdm(
            total=g.steps,
            initial=self.step,
            desc=f"rl ({self.cfg.draft.method})",
            unit="step",
            file=sys.stderr,
            disable=not progress,
        )
        last_val = None
        try:
            if self.step == 0 and not self.log_path.exists():
                last_val = self.validate()
                self._log({"step": 0, **last_val})
            while self.step < g.steps:
                m = self.train_step()
                if self.step % r.val_every == 0 or self.step == g.steps:
                    last_val = self.validate()
                    m.update(last_val)
                self._log(m)
                bar.set_postfix(
                    reward=f"{m['reward']:.2f}",
                    tau=f"{m['acceptance_length']:.2f}",
                    val=f"{last_val['val_acc']:.2f}" if last_val else "-",
                )
                bar.update(1)
                if self.step % r.checkpoint_every == 0 or self.step == g.steps:
                    self.save()
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {self.step}; rerun the same command to resume", file=sys.stderr)
            raise
        finally:
            bar.close()
        if r.save_policy:
            self.export_policy(self.out / "policy")
        self.plot()

    # -- persistence --------------------------------------------------------------------------------------
    def _log(self, m: dict) -> None:
        append_log(self.log_path, m)

    def state(self) -> dict:
        st = {
            "step": self.step,
            "policy": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "config": self.cfg.model_dump(),
        }
        if self.draft is not None:
            st.update(draft=self.draft.model.state_dict(), draft_opt=self.draft.opt.state_dict())
        return st

    def save(self) -> None:
        """`state.pt` replaced atomically, then the draft exported (`run.out/draft`)."""
        save_state(self.out, self.state())
        if self.draft is not None:
            self.draft.export(self.out / "draft", extra={"dcoco_rl": {"step": self.step}})

    def _resume(self) -> None:
        path = self.out / "state.pt"
        if not path.exists():
            if self.log_path.exists():  # lines of a run killed before its first checkpoint
                self.log_path.unlink()
            return
        st = torch.load(path, weights_only=False)
        old = st["config"]["draft"]["method"]
        if old != self.cfg.draft.method:
            raise ConfigError(f"{self.out} holds a run with draft.method {old}; choose another run.out")
        self.model.load_state_dict(st["policy"])
        self.opt.load_state_dict(st["opt"])
        if self.draft is not None:
            self.draft.model.load_state_dict(st["draft"])
            self.draft.opt.load_state_dict(st["draft_opt"])
        self.step = st["step"]
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        truncate_log(self.log_path, self.step)
        print(f"resumed from step {self.step}", file=sys.stderr)

    def export_policy(self, path: Path) -> None:
        """The trained policy as an HF directory (`dcoco generate --model DIR`), renamed into place."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            self.model.save_pretrained(tmp)
            if self.policy.tokenizer is not None:
                self.policy.tokenizer.save_pretrained(tmp)
            os.chmod(tmp, 0o755)
            if path.exists():
                shutil.rmtree(path)
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def plot(self) -> Optional[Path]:
        from .report import plot_run

        return plot_run(
            self.log_path,
            self.out / "curve.png",
            title=f"GRPO, draft {self.cfg.draft.method}"
            + ("" if self.cfg.draft.cotrain or self.draft is None else " (frozen)"),
        )
