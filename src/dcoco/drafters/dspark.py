"""DSpark: the DFlash backbone plus a low-rank Markov head and a confidence head.

Published design (Cheng et al., "DSpark: Confidence-Scheduled Speculative Decoding with
Semi-Autoregressive Generation", DeepSeek-AI / PKU; the DeepSpec code base):

- the parallel DFlash backbone (`DFlashModel`, shared with DFlash and DCOCO) gives base logits U_j for
  every draft slot of the block in one pass;
- a sequential Markov head makes each slot depend on the token drafted before it:

      p_j(v) ∝ exp(U_j(v) + (W2 · W1[x_{j-1}])(v)),   W1: V x r embedding,  W2: r x V

  applied left to right at inference (x_0 is the anchor, then each drafted token); at training
  time x_{j-1} is the teacher-forced previous target token. W2 starts at zero, so an untrained head
  reproduces DFlash exactly. The two matrices hold 2·V·r parameters (r = 64: 6.3M for V = 49152);
- a confidence head c_j = sigmoid(w^T [h_j ; W1[x_{j-1}]] + b) estimates the probability that the
  target accepts draft slot j given that the slots before it were accepted.

Anchor slot (`anchor_slot`, the published layout, default): slot j = 0..B-1 of the block
[anchor, MASK, ..., MASK] predicts x_{a+j+1}, so a block of B slots drafts up to B tokens (the
anchor slot's output is a next-token prediction, as in an AR head). With `anchor_slot: false` the
slots follow DFlash (slot k = 1..B-1 predicts x_{a+k}; the anchor slot's output is unused).

Sampling (inference): greedy requests take argmax_v p_j(v) left to right; sampled requests draw
x_j from probabilities(U_j + bias(x_{j-1}); T, top-k, top-p) -- the request's own transform of the
Markov-adjusted logits -- and that exact distribution is reported as q_j, so rejection sampling is
lossless.

Confidence truncation (optional; off unless `confidence_threshold` is set, in the checkpoint's
`dspark_config` or given to `DSparkDrafter`): the block is cut after the last slot j whose
estimated survival prod_{i<=j} c_i is still >= the threshold (at least one token is always kept).
c_j depends only on h_j and the previous token, never on the token drafted at j, so the cut is a
stopping rule on the draft prefix and verification stays lossless (greedy and sampled).

Checkpoint: the DFlash fields (`dflash_config`, ...) plus `dspark_config` (`markov_rank`,
`anchor_slot`, `confidence_head`, `confidence_threshold`), `architectures: ["DSparkDraftModel"]`,
`dcoco_method: "dspark"`. Weights: the backbone's names plus `markov_head.w1.weight` (V x r),
`markov_head.w2.weight` (V x r, i.e. W2 transposed, as nn.Linear stores it) and
`confidence_head.proj.{weight,bias}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict

from ..nn.layers import at_least_float32
from ..verify import draw_uniforms, sample_from, target_probs
from .base import DraftInput, DraftOutput
from .checkpoint import save_checkpoint
from .dflash import BlockDrafter, DFlashConfig, DFlashModel


class DSparkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    markov_rank: int = 64
    anchor_slot: bool = True  # slot j predicts x_{a+j+1} (published); False: DFlash slots (k -> x_{a+k})
    confidence_head: bool = True
    confidence_threshold: Optional[float] = None  # inference: cut the block where prod c_i < threshold


class MarkovHead(nn.Module):
    """bias(x_prev) = W2 · W1[x_prev], a rank-r transition bias over the vocabulary."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.w1.weight, std=rank**-0.5)
        nn.init.zeros_(self.w2.weight)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias (..., V), W1[prev] (..., r)) for previous tokens `prev` (...)."""
        e = self.w1(prev)
        return self.w2(e), e


class ConfidenceHead(nn.Module):
    """Logit of c_j from [h_j ; W1[x_{j-1}]]."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)).squeeze(-1)


class DSparkModel(DFlashModel):
    """The DFlash backbone plus the Markov and confidence heads (trained jointly)."""

    def __init__(self, cfg: DFlashConfig, scfg: DSparkConfig):
        super().__init__(cfg)
        self.scfg = scfg
        self.markov_head = MarkovHead(cfg.vocab_size, scfg.markov_rank)
        self.confidence_head = ConfidenceHead(cfg.hidden_size, scfg.markov_rank) if scfg.confidence_head else None

    @property
    def slot_offset(self) -> int:
        """Index of the block slot that predicts x_{a+1}."""
        return 0 if self.scfg.anchor_slot else 1

    def step_logits(self, base_logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor):
        """Markov-adjusted logits z = U + bias(prev) (float32) and the confidence logit (or None)
        for base logits (..., V), slot hidden states (..., H) and previous tokens (...)."""
        bias, e = self.markov_head(prev)
        z = at_least_float32(base_logits) + at_least_float32(bias)
        conf = self.confidence_head(hidden, e) if self.confidence_head is not None else None
        return z, conf


class DSparkDrafter(BlockDrafter):
    """DFlash block pass, then the Markov walk left to right (`select`), optionally cut by confidence."""

    method = "dspark"

    def __init__(self, model: DSparkModel, target, confidence_threshold: Optional[float] = None):
        super().__init__(model, target)
        thr = model.scfg.confidence_threshold if confidence_threshold is None else confidence_threshold
        if thr is not None and not 0.0 <= thr <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {thr}")
        if thr is not None and model.confidence_head is None:
            raise ValueError("confidence truncation needs a checkpoint trained with the confidence head")
        self.confidence_threshold = thr

    def select(
        self, hidden: torch.Tensor, logits: torch.Tensor, inp: DraftInput, anchor_hidden: Optional[torch.Tensor] = None
    ) -> DraftOutput:
        N, k, V = logits.shape  # logits: the base logits U of the block pass
        dev = logits.device
        prev = torch.tensor([ids[-1] for ids in inp.token_ids], dtype=torch.long, device=dev)
        sampled = [b for b, sp in enumerate(inp.params) if not sp.greedy]
        u = draw_uniforms([inp.generators[b] for b in sampled], k, dev) if sampled else None
        tokens = torch.zeros(N, k, dtype=torch.long, device=dev)
        conf = torch.ones(N, k, device=dev)
        probs = torch.zeros(N, k, V, device=dev) if sampled else None
        for j in range(k):
            z, c = self.model.step_logits(logits[:, j], hidden[:, j], prev)
            if c is not None:
                conf[:, j] = torch.sigmoid(c.float())
            tok = z.argmax(-1)
            if sampled:
                q = target_probs(z[sampled].unsqueeze(1), [inp.params[b] for b in sampled]).squeeze(1)
                tok[sampled] = sample_from(q, u[:, j])
                probs[sampled, j] = q
            tokens[:, j] = tok
            prev = tok
        if probs is not None:
            for b in (b for b, sp in enumerate(inp.params) if sp.greedy):
                probs[b].scatter_(1, tokens[b].unsqueeze(1), 1.0)  # greedy rows: one-hot q
        lengths = torch.full((N,), k, dtype=torch.long, device=dev)
        if self.confidence_threshold is not None and k > 0:
            survive = torch.cumprod(conf, dim=1) >= self.confidence_threshold  # non-increasing in j
            lengths = survive.sum(1).clamp(min=1)
        return DraftOutput(tokens=tokens, lengths=lengths, probs=probs)


# -- checkpoints ---------------------------------------------------------------------------------
def save_dspark(
    path: str | Path, model: DSparkModel, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16
) -> None:
    d = dict(extra or {})
    d["dspark_config"] = model.scfg.model_dump()
    d["architectures"] = ["DSparkDraftModel"]
    save_checkpoint(path, model.cfg.to_hf("dspark", d), model.state_dict(), dtype)
