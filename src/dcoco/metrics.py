"""Speculative-decoding statistics, kept per request and summed over a run.

verify_passes counts every target forward after prefill (a plain decode step is a pass with
nothing drafted), so acceptance length tau = 1 + accepted / passes is the mean number of tokens a
target forward produced, the figure that speed follows. per_position_acceptance[i] is the share of
passes whose i-th draft token was accepted; it sums to tau - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    output_tokens: int = 0
    wall_s: float = 0.0
    verify_passes: int = 0
    num_drafts: int = 0  # passes that verified at least one draft token
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.num_drafts += 1
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.output_tokens += other.output_tokens
        self.verify_passes += other.verify_passes
        self.num_drafts += other.num_drafts
        self.drafted += other.drafted
        self.accepted += other.accepted
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        self.accepted_per_position = [x + y for x, y in zip(a, b)]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.verify_passes if self.verify_passes else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        if not self.verify_passes:
            return []
        return [a / self.verify_passes for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "verify_passes": self.verify_passes,
            "num_drafts": self.num_drafts,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
        }
