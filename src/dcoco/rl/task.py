"""RL tasks with a verifiable reward. A task hands out training problems per step (a pure function of
its seed and the step, so a resumed run sees the same prompts), a fixed held-out validation set
disjoint from them, and scores completions.

`ArithmeticTask`: "What is 37 + 48? Answer with just the number." Problems are (a, op, b) with
operands in [min_operand, max_operand] (for "-" the larger operand comes first, so answers are never
negative). A problem is held out for validation iff sha1("a op b") mod 1000 < val_permille, so the
split does not depend on the seed or the operand range, and training never draws a held-out problem.

Reward (exact match on integers): 1 if the completion is just the answer (surrounding whitespace and
one trailing period allowed); `partial_credit` if the completion has other text but its last integer
is the answer ("37 + 48 = 85"); else 0. Validation accuracy counts the first case only. Partial
credit gives a small model a learning signal before it has learned the format (SmolLM2-135M at T = 1
answers in the bare format almost never, but gets the last number right ~20% of the time).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Protocol

_STRICT = re.compile(r"\s*(-?\d+)\s*\.?\s*")
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    prompt: Any  # text (wrapped in the chat template) or token ids
    answer: Any


class Task(Protocol):
    def train_problems(self, step: int, n: int) -> list[Problem]: ...

    def val_problems(self) -> list[Problem]: ...

    def reward(self, problem: Problem, token_ids: list[int], text: str) -> float: ...

    def correct(self, problem: Problem, token_ids: list[int], text: str) -> bool: ...


def strict_answer(text: str) -> int | None:
    """The integer a completion consists of, or None when it holds anything else."""
    m = _STRICT.fullmatch(text)
    return int(m.group(1)) if m else None


def last_integer(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def arithmetic_reward(text: str, answer: int, partial_credit: float) -> float:
    if strict_answer(text) == answer:
        return 1.0
    return partial_credit if last_integer(text) == answer else 0.0


class ArithmeticTask:
    OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

    def __init__(
        self,
        ops=("+", "-"),
        min_operand: int = 0,
        max_operand: int = 20,
        val_size: int = 64,
        val_permille: int = 100,
        partial_credit: float = 0.5,
        seed: int = 0,
    ):
        self.ops, self.lo, self.hi = tuple(ops), min_operand, max_operand
        self.val_size, self.val_permille, self.partial_credit, self.seed = val_size, val_permille, partial_credit, seed
        self._val = self._draw(random.Random(f"val:{seed}"), val_size, held_out=True, distinct=True)

    @classmethod
    def from_config(cls, t) -> "ArithmeticTask":
        return cls(t.ops, t.min_operand, t.max_operand, t.val_size, t.val_permille, t.partial_credit, t.seed)

    def is_held_out(self, a: int, op: str, b: int) -> bool:
        return int(hashlib.sha1(f"{a} {op} {b}".encode()).hexdigest(), 16) % 1000 < self.val_permille

    def problem(self, a: int, op: str, b: int) -> Problem:
        return Problem(f"What is {a} {op} {b}? Answer with just the number.", self.OPS[op](a, b))

    def _draw(self, rng: random.Random, n: int, held_out: bool, distinct: bool = False) -> list[Problem]:
        out: list[Problem] = []
        seen: set = set()
        for _ in range(1000 * n):  # bounded: a tiny problem space may hold fewer than n held-out problems
            if len(out) == n:
                break
            op = rng.choice(self.ops)
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            if op == "-" and a < b:
                a, b = b, a
            if self.is_held_out(a, op, b) != held_out or (distinct and (a, op, b) in seen):
                continue
            seen.add((a, op, b))
            out.append(self.problem(a, op, b))
        if not out or (not distinct and len(out) < n):
            from ..errors import ConfigError

            raise ConfigError(f"no {'validation' if held_out else 'training'} problems in this operand range")
        return out

    def train_problems(self, step: int, n: int) -> list[Problem]:
        return self._draw(random.Random(f"train:{self.seed}:{step}"), n, held_out=False)

    def val_problems(self) -> list[Problem]:
        return list(self._val)

    def reward(self, problem: Problem, token_ids: list[int], text: str) -> float:
        return arithmetic_reward(text, problem.answer, self.partial_credit)

    def correct(self, problem: Problem, token_ids: list[int], text: str) -> bool:
        return strict_answer(text) == problem.answer


def build_task(cfg) -> Task:
    """The task a `TaskSection` names."""
    if cfg.name == "arithmetic":
        return ArithmeticTask.from_config(cfg)
    raise ValueError(f"unknown task {cfg.name!r}")
