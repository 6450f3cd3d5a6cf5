"""Dataset loaders on the real package files, the fixed ShareGPT split, and user JSONL files."""

from __future__ import annotations

import hashlib
import json

import pytest

from dcoco import DcocoError
from dcoco.datasets import (
    HUMANEVAL_TEMPLATE,
    DatasetError,
    Prompt,
    dataset_name,
    humaneval_prompts,
    jsonl_prompts,
    load_prompts,
    mtbench_questions,
    mtbench_turn1_prompts,
    mtbench_turn2_prompts,
    sharegpt_prompts,
    sharegpt_records,
    sharegpt_split,
    take,
)


def test_mtbench_has_80_two_turn_questions():
    qs = mtbench_questions()
    assert len(qs) == 80
    assert all(len(q["turns"]) == 2 and all(t.strip() for t in q["turns"]) for q in qs)
    assert len({q["question_id"] for q in qs}) == 80
    assert len({q["category"] for q in qs}) == 8
    assert qs[0]["question_id"] == 81  # file order


def test_mtbench_turn2_uses_the_given_first_answer():
    qs = mtbench_questions()[:3]
    seen = []

    def answer(p: Prompt) -> str:
        seen.append(p.id)
        return f"answer to {p.meta['question_id']}"

    t2 = mtbench_turn2_prompts(qs, answer)
    assert seen == [f"{q['question_id']}/turn1" for q in qs]  # once per question, in order
    m = t2[1].messages
    assert [x["role"] for x in m] == ["user", "assistant", "user"]
    assert m[0]["content"] == qs[1]["turns"][0] and m[2]["content"] == qs[1]["turns"][1]
    assert m[1]["content"] == f"answer to {qs[1]['question_id']}"
    t1 = mtbench_turn1_prompts(qs)
    assert t1[0].messages == [{"role": "user", "content": qs[0]["turns"][0]}]

    both = load_prompts("mtbench", 3, mtbench_answer=answer)
    assert [p.id for p in both] == [p.id for p in t1] + [p.id for p in t2]
    assert [p.id for p in load_prompts("mtbench", 3)] == [p.id for p in t1]
    assert [p.id for p in load_prompts("mtbench_turn1", 3, mtbench_answer=answer)] == [p.id for p in t1]


def test_humaneval_has_164_prompts_in_the_documented_wording():
    ps = humaneval_prompts()
    assert len(ps) == 164
    assert ps[0].id == "HumanEval/0" and ps[-1].id == "HumanEval/163"
    text = ps[0].messages[0]["content"]
    assert text.startswith("Complete the following Python function.")
    assert "def has_close_elements(" in text and text.endswith("```")
    assert text == HUMANEVAL_TEMPLATE.format(prompt=text.split("```python\n", 1)[1][:-3])


def test_sharegpt_records_and_the_fixed_split():
    every = sharegpt_records()
    assert len(every) == 17671  # complete records before the file's truncated tail
    train, ev = sharegpt_records("train"), sharegpt_records("eval")
    assert len(train) + len(ev) == len(every)
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in ev})
    assert 0.015 < len(ev) / len(every) < 0.025 and len(ev) == 365
    # the rule, restated independently, and stable across calls
    for r in ev[:50] + train[:50]:
        expect = "eval" if int(hashlib.sha1(r["id"].encode()).hexdigest(), 16) % 100 < 2 else "train"
        assert sharegpt_split(r["id"]) == expect
    assert [r["id"] for r in sharegpt_records("eval")] == [r["id"] for r in ev]
    roles = {t["role"] for r in every for t in r["conversations"]}
    assert roles <= {"user", "assistant", "system"}
    assert every[0]["id"] == "QWJhYvA_0" and every[0]["conversations"][0]["role"] == "user"
    with pytest.raises(DatasetError):
        sharegpt_records("test")


def test_sharegpt_bench_prompts_are_first_user_turns_of_eval_records():
    ps = sharegpt_prompts()
    assert len(ps) == 229
    ev_ids = {r["id"] for r in sharegpt_records("eval")}
    assert all(p.id in ev_ids and p.messages[0]["role"] == "user" and p.messages[0]["content"].strip() for p in ps)
    assert [p.id for p in load_prompts("sharegpt", 5)] == [p.id for p in ps[:5]]


def test_jsonl_formats(tmp_path):
    f = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "Write a haiku."},
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]},
        {"id": "c3", "conversations": [{"role": "user", "content": "role style"}]},
        {"prompt_token_ids": [1, 2, 3]},
    ]
    f.write_text(
        "\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[2:]) + "\n"
    )
    ps = jsonl_prompts(f)
    assert [p.id for p in ps] == ["line1", "line2", "c3", "line5"]
    assert ps[0].messages == [{"role": "user", "content": "Write a haiku."}]
    assert ps[1].messages[0]["content"] == "hello" and ps[2].messages[0]["content"] == "role style"
    assert ps[3].token_ids == [1, 2, 3] and ps[3].content == [1, 2, 3]
    assert all(p.dataset == "mine" for p in ps) and dataset_name(str(f)) == "mine"
    assert [p.id for p in load_prompts(str(f), 2)] == ["line1", "line2"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ('{"prompt": "ok"}\n{"prompt": "broken"\n', ":2: malformed JSON"),
        ('{"prompt": "ok"}\n[1, 2]\n', ":2: expected a JSON object"),
        ('{"text": "no prompt field"}\n', ":1: expected a 'prompt'"),
        ('{"prompt": "   "}\n', ":1: 'prompt' must be a non-empty string"),
        ('{"conversations": [{"from": "gpt", "value": "assistant first"}]}\n', ":1: the first turn"),
        ('{"prompt_token_ids": [1, -2]}\n', ":1: 'prompt_token_ids'"),
        ("\n\n", "no prompts"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, body, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(body)
    with pytest.raises(DatasetError) as e:
        jsonl_prompts(f)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    if needle.startswith(":"):
        assert str(f) + needle.split(" ")[0] in msg


def test_unknown_and_missing_datasets():
    with pytest.raises(DatasetError, match="unknown dataset 'mmlu'"):
        load_prompts("mmlu")
    with pytest.raises(DatasetError, match="not found"):
        load_prompts("/nonexistent/prompts.jsonl")
    with pytest.raises(DatasetError):
        load_prompts("humaneval", 0)
    assert issubclass(DatasetError, DcocoError)
    assert take([1, 2, 3], None) == [1, 2, 3] and take([1, 2, 3], 2) == [1, 2]
