"""Typed configuration of `dcoco rl`: a YAML file plus `section.key=value` overrides, parsed like
`dcoco train`'s (unknown keys and wrong types are `ConfigError`s)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, Field, model_validator

from ..errors import ConfigError
from ..families import DEFAULT_TRAINED
from ..train.config import (
    DrafterSection,
    ParallelSection,
    _Section,
    check_trained_method,
    parse_config,
)


class PolicySection(_Section):
    model: Optional[str] = None  # HF directory; None = embedded SmolLM2-135M-Instruct
    dtype: Literal["float32", "bfloat16"] = "float32"  # the trained weights (and the policy forward)
    # rollout engine's copy: None = the very module being trained (weight sync is free, rollout and
    # trainer numerics agree); a dtype = a copy in that dtype, refreshed with load_state_dict after
    # every update (faster bf16 rollouts; the training-inference KL then shows the mismatch)
    rollout_dtype: Optional[Literal["float32", "bfloat16"]] = None


class TaskSection(_Section):
    name: Literal["arithmetic"] = "arithmetic"
    ops: list[Literal["+", "-", "*"]] = ["+", "-"]
    min_operand: int = 0
    max_operand: int = 20
    val_size: int = Field(64, ge=1)  # held-out problems scored every `run.val_every` steps
    val_permille: int = Field(100, ge=1, le=999)  # share of all problems reserved for validation (by hash)
    partial_credit: float = Field(0.5, ge=0.0, le=1.0)  # reward of a right last number in an answer with other text
    seed: int = 0

    @model_validator(mode="after")
    def _range(self):
        if self.min_operand > self.max_operand:
            raise ValueError("min_operand must be <= max_operand")
        return self


class RolloutSection(_Section):
    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(4, ge=2)  # completions per prompt (GRPO group)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0.0)  # rollouts must sample; validation decodes greedily
    num_speculative_tokens: Optional[int] = Field(None, ge=0)  # None: the drafter's default block
    # load-aware drafting of the training rollouts: at most this many tokens per verification pass
    # (a full batch decodes plainly, the draft block grows as completions finish; validation keeps
    # the full block, so its τ still measures the draft); None: every pass drafts the full block
    draft_token_budget: Optional[int] = Field(None, ge=1)


class GRPOSection(_Section):
    steps: int = Field(100, ge=1)
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = 0.0
    grad_clip: float = Field(1.0, gt=0.0)
    clip_eps: float = Field(0.2, gt=0.0)  # ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: Optional[float] = Field(None, gt=0.0)  # None: clip_eps
    beta: float = Field(0.0, ge=0.0)  # KL(policy || reference) coefficient; 0 = no reference model
    scale_rewards: bool = True  # advantages divided by the group's reward std (GRPO); False: Dr. GRPO
    loss_type: Literal["grpo", "token"] = "grpo"  # grpo: mean over tokens, then sequences; token: over all tokens
    iterations: int = Field(1, ge=1)  # policy updates per batch of rollouts (mu)
    micro_batch: int = Field(8, ge=1)  # sequences per forward / backward (gradients accumulate)
    seed: int = 0
    threads: Optional[int] = Field(None, ge=1)


class DraftSection(_Section):
    # "none": no draft; else a trained family
    method: Annotated[str, AfterValidator(lambda v: v if v == "none" else check_trained_method(v))] = (
        DEFAULT_TRAINED.name
    )
    # a drafter checkpoint directory; None: the checkpoint shipped for the embedded target if there is
    # one, else a fresh drafter built from `arch` (DFlash family: from the target's last layers;
    # EAGLE-3: over the whole target vocabulary); "fresh" forces the fresh one
    init_from: Optional[str] = None
    cotrain: bool = True  # False: the draft stays frozen (the "stale draft" baseline)
    weight: float = Field(1.0, ge=0.0)  # lambda in L = L_RL + lambda * L_draft
    lr: float = Field(3e-4, gt=0.0)
    weight_decay: float = 0.01
    grad_clip: float = Field(1.0, gt=0.0)
    anchors_per_seq: int = Field(
        8, ge=1
    )  # DFlash-family blocks per rollout sequence (EAGLE-3: see arch.eagle3.ttt_slots)
    loss_decay_gamma: float = Field(7.0, gt=0.0)
    arch: DrafterSection = DrafterSection()  # the shape of a fresh drafter, as in `dcoco train`


class RunSection(_Section):
    out: str = "runs/rl-smollm2"
    checkpoint_every: int = Field(10, ge=1)
    val_every: int = Field(10, ge=1)
    save_policy: bool = True  # export the final policy as an HF directory (run.out/policy)


class RLParallelSection(ParallelSection):
    # pipeline stages of the policy: its decoder layers split over this many processes (each runs
    # `parallel.context` of them, zigzag over the sequences); the drafter's tapped layers reach the
    # last stage's ranks, where the draft loss runs, through TapChannels (docs/rl.md)
    pipeline: int = Field(1, ge=1)
    # longest prompt a rollout may have: sizes the TapChannels' slots (a longer one is an error)
    max_prompt_tokens: int = Field(256, ge=1)


class RLConfig(_Section):
    policy: PolicySection = PolicySection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    grpo: GRPOSection = GRPOSection()
    draft: DraftSection = DraftSection()
    run: RunSection = RunSection()
    parallel: RLParallelSection = RLParallelSection()

    @property
    def processes(self) -> int:
        return self.parallel.pipeline * self.parallel.context


def check_rl_parallel(cfg: RLConfig) -> None:
    """A one-line `ConfigError` where the process grid cannot run this config (before it starts)."""
    if cfg.processes == 1:
        return
    if cfg.grpo.iterations != 1 or cfg.grpo.beta > 0:
        raise ConfigError("parallel.pipeline / parallel.context run grpo.iterations=1 with grpo.beta=0 only")


def load_rl_config(path: Optional[str], overrides: tuple[str, ...] | list[str] = ()) -> RLConfig:
    return parse_config(RLConfig, path, overrides)
