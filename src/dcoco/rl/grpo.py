"""GRPO (Shao et al. 2024, "DeepSeekMath"): group-relative advantages, the clipped policy-ratio
objective and an optional k3 KL penalty towards a frozen reference policy.

For a prompt with G completions and rewards r_1..r_G, A_i = (r_i - mean(r)) / (std(r) + eps)
(`scale_rewards=False` drops the division, as Dr. GRPO does). Every completion token t of
completion i gets A_i, and

    loss_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) + beta * KL_t,
    rho_t = pi_theta(x_t) / pi_old(x_t),   KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1,

with log-probabilities at the rollout temperature. `grpo` averages over the tokens of each
completion, then over completions; `token` averages over all completion tokens of the batch.
`num_seqs` / `num_tokens` are the batch totals, so micro-batches that each call `grpo_loss` and
backpropagate add up to exactly the full-batch gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..nn.layers import at_least_float32


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """A (N,) for rewards (N,) laid out as consecutive groups of `group_size` completions."""
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def completion_logprobs(
    model, ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log pi(x_{t+1} | x_<=t) / at `temperature`, (B, T-1), zero where `targets` (B, T-1) is False.

    Only the positions that predict completion tokens go through the LM head (the head is a large
    share of a small model's cost, and of its memory with a 49K vocabulary)."""
    h = model.model(input_ids=ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    logits = at_least_float32(model.get_output_embeddings()(h[targets])) / temperature
    tok = ids[:, 1:][targets].unsqueeze(1)
    lp = logits.gather(1, tok).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return lp.new_zeros(targets.shape).masked_scatter(targets, lp)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: Optional[float] = None,
    ref_logp: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    loss_type: str = "grpo",
    num_seqs: Optional[int] = None,
    num_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of a (micro-)batch: logp / old_logp / ref_logp / mask (B, n), adv (B,).
    Returns the loss and detached sums for logging (clipped tokens, KL)."""
    m = mask.float()
    if loss_type == "grpo":
        n = m.shape[0] if num_seqs is None else num_seqs
        weight = m / m.sum(1, keepdim=True).clamp(min=1) / n
    elif loss_type == "token":
        weight = m / (m.sum() if num_tokens is None else num_tokens)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return clipped_surrogate(logp, old_logp, adv.view(-1, 1), weight, clip_low, clip_high, ref_logp, beta)


def token_weights(
    seq: torch.Tensor, completion_lens: torch.Tensor, loss_type: str, num_seqs: int, num_tokens: int
) -> torch.Tensor:
    """Each completion token's weight in `grpo_loss`, for tokens of completions `seq` (n,) with
    `completion_lens` (N,) tokens each: what a subset of a batch's tokens (a context-parallel
    shard) needs for its share of the batch loss."""
    if loss_type == "grpo":
        return 1.0 / (completion_lens[seq].float().clamp(min=1) * num_seqs)
    if loss_type == "token":
        return torch.full(seq.shape, 1.0 / num_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: Optional[float] = None,
    ref_logp: Optional[torch.Tensor] = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """sum_t weight_t loss_t over tokens (any shape; `adv` broadcasts to it, weight 0 = no token),
    and detached sums for logging (clipped tokens, tokens, KL)."""
    clip_high = clip_low if clip_high is None else clip_high
    a = adv.float()
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    per_token = -surrogate
    kl = None
    if ref_logp is not None and beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    loss = (per_token * weight).sum()
    with torch.no_grad():
        m = (weight > 0).float()
        clipped = ((ratio < 1 - clip_low) & (a < 0)) | ((ratio > 1 + clip_high) & (a > 0))
        stats = {
            "clipped_tokens": float((clipped.float() * m).sum()),
            "tokens": float(m.sum()),
            "kl_sum": float((kl * m).sum()) if kl is not None else 0.0,
        }
    return loss, stats
