"""Acceptance from teacher-forced drafts: how many drafted tokens greedy verification would keep,
over random anchors and as decoding walks an answer block by block."""

from __future__ import annotations

import torch


def accepted_prefix(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1 at each draft slot (last dim) whose slot and all before it match a label, else 0."""
    return torch.cumprod(((pred == labels) & (labels != -100)).long(), dim=-1)


def acceptance_from_predictions(pred: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[float]]:
    """Simulated acceptance length tau = 1 + mean accepted prefix, and per-position acceptance,
    from greedy predictions (S, A, B-1) against the (greedy) target continuation."""
    acc = accepted_prefix(pred, labels)[labels[..., 0] != -100]  # (n, B-1) over blocks with a label
    if acc.numel() == 0:
        return 1.0, []
    return 1.0 + acc.sum(-1).float().mean().item(), acc.float().mean(0).tolist()


def decode_acceptance_per_slot(pred: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[int, list[int]]:
    """The verification passes of greedy decoding over one answer and, per draft slot j < k, how many
    of them accepted slot j, from drafts (A, P) and labels (A, P) at each of its anchor positions in
    order, the last one's label being the answer's last token: each block opens where the previous
    one ended (anchor + accepted + 1) and drafts k tokens."""
    accepted = accepted_prefix(pred[:, :k], labels[:, :k]).sum(-1).tolist()
    a, passes, per_slot = 0, 0, [0] * k
    while a < len(accepted):
        n = min(accepted[a], len(accepted) - a - 1)
        passes += 1
        for j in range(n):
            per_slot[j] += 1
        a += n + 1
    return passes, per_slot


def expected_acceptance(alpha: torch.Tensor, valid: torch.Tensor) -> tuple[float, list[float]]:
    """Sampled verification's expected tau and per-slot acceptance from the per-slot acceptance
    probabilities alpha (n, P) = sum_x min(p(x), q(x)) of n blocks, teacher-forced on the data: slot j
    is reached with probability prod_{i < j} alpha_i. `valid` (n, P) masks slots without a label."""
    keep = valid[:, 0]
    reach = torch.cumprod(alpha.float() * valid, dim=-1)[keep]
    if reach.numel() == 0:
        return 1.0, []
    return 1.0 + reach.sum(-1).mean().item(), reach.mean(0).tolist()


def decode_acceptance(pred: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[int, int]:
    """(verification passes, tokens) of greedy decoding over one answer (`decode_acceptance_per_slot`):
    each pass yields its accepted prefix plus the target's own token."""
    passes, per_slot = decode_acceptance_per_slot(pred, labels, k)
    return passes, passes + sum(per_slot)
