"""Point-to-point ring plumbing shared by ring attention and the baseline.

Kept separate so the byte counting that the benchmark reports is the same code
path that actually posts the sends (the "measured" volume is what was handed to
``torch.distributed``, not a formula).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import WorldSizeMismatchError

__all__ = ["CommStats", "RingGroup"]


@dataclass
class CommStats:
    """Bytes and messages this rank sent, per phase (e.g. ``"fwd"``, ``"bwd"``)."""

    bytes_sent: dict = field(default_factory=lambda: defaultdict(int))
    messages: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, phase: str, nbytes: int) -> None:
        self.bytes_sent[phase] += int(nbytes)
        self.messages[phase] += 1

    def total(self, phase: str | None = None) -> int:
        if phase is not None:
            return int(self.bytes_sent.get(phase, 0))
        return int(sum(self.bytes_sent.values()))

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.messages.clear()


class RingGroup:
    """A process group seen as a ring: this rank, its size, and the global ranks of its neighbours.

    ``group=None`` with ``expected_size == 1`` is the single-process mode: no
    ``torch.distributed`` call is ever made, so the same code runs as the
    single-process reference inside or outside a distributed job.
    """

    def __init__(self, group, expected_size: int):
        self.group = group
        if group is None and expected_size == 1:
            self.rank, self.size, self.local = 0, 1, True
            self.next = self.prev = None
            return
        if not dist.is_available() or not dist.is_initialized():
            raise WorldSizeMismatchError(
                f"layout is for {expected_size} ranks but torch.distributed is not initialised"
            )
        self.local = False
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise WorldSizeMismatchError("this process is not a member of the given process group")
        if self.size != expected_size:
            raise WorldSizeMismatchError(
                f"process group has {self.size} ranks but the layout was built for {expected_size}"
            )
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int, stats: CommStats | None, phase: str):
        """Post ``send -> next`` and ``recv <- prev`` without waiting; returns the works.

        Empty tensors are skipped on both sides (every rank knows every shard
        size from the layout, so the decision is symmetric).
        """
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
            if stats is not None:
                stats.add(phase, send.numel() * send.element_size())
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        if not ops:
            return []
        return dist.batch_isend_irecv(ops)


def wait_all(works) -> None:
    for w in works:
        w.wait()
