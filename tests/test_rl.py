"""RL post-training with online draft co-training: GRPO math, rewards, task split, stop-gradient,
lossless rollouts with the live draft, co-training, exact resume, config and CLI errors."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from dcoco import ConfigError
from dcoco.cli import main
from dcoco.engine import SpeculativeEngine
from dcoco.rl.config import load_rl_config
from dcoco.rl.grpo import group_advantages, grpo_loss
from dcoco.rl.loop import RLRun
from dcoco.rl.report import compare
from dcoco.rl.task import ArithmeticTask, Problem, arithmetic_reward, last_integer, strict_answer
from dcoco.sampling import SamplingParams
from dcoco.speculative import SpeculativeConfig, load_drafter

LAYERS = 6
FAMILIES = ["dflash", "dcoco", "dspark", "eagle3"]


def tiny():
    return tiny_target("llama", seed=11, num_hidden_layers=LAYERS, initializer_range=0.15)


class ToyTask:
    """Token-level task for tiny targets (no tokenizer): a pool of four training prompts (revisited, as
    an RL dataset is), reward 1 when the first completion token is even."""

    def __init__(self):
        rng = random.Random("toy")
        self.pool = [Problem([rng.randrange(96) for _ in range(rng.randint(4, 8))], None) for _ in range(4)]

    def train_problems(self, step, n):
        rng = random.Random(f"toy:{step}")
        return [rng.choice(self.pool) for _ in range(n)]

    def val_problems(self):
        rng = random.Random("toy-val")
        return [Problem([rng.randrange(96) for _ in range(6)], None) for _ in range(4)]

    def reward(self, problem, token_ids, text):
        return float(token_ids[0] % 2 == 0)

    def correct(self, problem, token_ids, text):
        return token_ids[0] % 2 == 0


def cfg_for(out, method="dflash", **over):
    base = {
        "run.out": str(out),
        "grpo.steps": 4,
        "grpo.lr": 1e-4,
        "grpo.micro_batch": 3,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 12,
        "draft.method": method,
        "draft.init_from": "fresh",
        "draft.lr": 3e-3,
        "draft.anchors_per_seq": 4,
        "draft.arch.num_layers": 1,
        "draft.arch.block_size": 6,
        "draft.arch.num_features": 2,
        "draft.arch.eagle3.ttt_steps": 3,
        "draft.arch.dspark.markov_rank": 8,
        "run.val_every": 2,
        "run.checkpoint_every": 2,
        "run.save_policy": False,
    }
    base.update(over)
    return load_rl_config(None, [f"{k}={v}" for k, v in base.items()])


def make_run(tmp_path, method="dflash", name="run", **over) -> RLRun:
    return RLRun(cfg_for(tmp_path / name, method, **over), tiny(), ToyTask())


# -- GRPO math ------------------------------------------------------------------------------------------
def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of the first group
    a = group_advantages(r, 4)
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))  # a solved group teaches nothing
    assert torch.allclose(group_advantages(r, 4, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_grpo_loss_matches_hand_computation():
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, 0.0]])
    old = torch.tensor([[-1.5, -0.4, -2.0], [-0.2, -2.0, 0.0]])
    ref = torch.tensor([[-1.2, -0.7, -1.0], [-0.1, -2.5, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([2.0, -1.0])
    eps, beta = 0.2, 0.1

    def by_hand(loss_type, with_kl):
        per_seq, total, count = [], 0.0, 0
        for b in range(2):
            terms = []
            for t in range(3):
                if not mask[b, t]:
                    continue
                ratio = math.exp(logp[b, t] - old[b, t])
                clipped = min(max(ratio, 1 - eps), 1 + eps)
                x = -min(ratio * adv[b].item(), clipped * adv[b].item())
                if with_kl:
                    d = (ref[b, t] - logp[b, t]).item()
                    x += beta * (math.exp(d) - d - 1)
                terms.append(x)
            per_seq.append(sum(terms) / len(terms))
            total, count = total + sum(terms), count + len(terms)
        return sum(per_seq) / 2 if loss_type == "grpo" else total / count

    for loss_type in ("grpo", "token"):
        loss, s = grpo_loss(logp, old, adv, mask, eps, loss_type=loss_type)
        assert loss.item() == pytest.approx(by_hand(loss_type, False), rel=1e-6)
        loss, s = grpo_loss(logp, old, adv, mask, eps, ref_logp=ref, beta=beta, loss_type=loss_type)
        assert loss.item() == pytest.approx(by_hand(loss_type, True), rel=1e-6)
    # clipped: row 0 token 0 (ratio e^0.5 > 1.2, A > 0) and row 1 token 1 (ratio e^-1 < 0.8, A < 0)
    assert s["clipped_tokens"] == 2 and s["tokens"] == 5
    # on-policy (old = logp): the gradient is -A * grad logp per token
    lp = logp.clone().requires_grad_(True)
    grpo_loss(lp, lp.detach(), adv, mask, eps, loss_type="token")[0].backward()
    assert torch.allclose(lp.grad, -adv.view(2, 1) * mask / 5)


# -- task ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,reward",
    [
        ("85", 1.0),
        (" 85.\n", 1.0),
        ("85 apples", 0.5),
        ("37 + 48 = 85", 0.5),
        ("The answer is 85.", 0.5),
        ("86", 0.0),
        ("", 0.0),
        ("eighty-five", 0.0),
        ("-85", 0.0),
        ("8 5", 0.0),
        ("85.5", 0.0),
        ("85, or 86", 0.0),
    ],
)
def test_arithmetic_reward(text, reward):
    assert arithmetic_reward(text, 85, partial_credit=0.5) == reward


def test_answer_extraction():
    assert strict_answer("42") == 42 and strict_answer("  -7 ") == -7 and strict_answer("42!") is None
    assert strict_answer("4 2") is None and last_integer("no digits") is None and last_integer("1, 2 and 30") == 30


def test_arithmetic_task_split_is_fixed_and_disjoint():
    task = ArithmeticTask(ops=("+", "-", "*"), min_operand=0, max_operand=30, val_size=40, seed=3)
    val = task.val_problems()
    assert len(val) == 40 and len(set(val)) == 40
    assert val == ArithmeticTask(ops=("+", "-", "*"), min_operand=0, max_operand=30, val_size=40, seed=3).val_problems()
    train = [p for s in range(200) for p in task.train_problems(s, 8)]
    assert not set(train) & set(val)
    assert task.train_problems(7, 8) == task.train_problems(7, 8) != task.train_problems(8, 8)
    for p in train[:200] + val:
        a, op, b = p.prompt.split("What is ")[1].split("?")[0].split()
        assert p.answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] and p.answer >= 0
        assert task.reward(p, [], str(p.answer)) == 1.0 and task.correct(p, [], f" {p.answer}.")


# -- config and CLI -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["grpo.stepz=3"], "unknown key"),
        (["grpo.steps=abc"], "grpo.steps"),
        (["nonsense"], "section.key=value"),
        (["draft.method=medusa"], "draft.method"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["task.min_operand=9", "task.max_operand=3"], "min_operand"),
        (["draft.arch.bogus=1"], "unknown key"),
    ],
)
def test_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_rl_config(None, overrides)


def test_shipped_config_parses():
    path = Path(__file__).resolve().parent.parent / "configs" / "rl_smollm2.yaml"
    cfg = load_rl_config(str(path), ["draft.method=none"])
    assert cfg.rollout.group_size == 4 and cfg.rollout.prompts_per_step == 8 and cfg.rollout.max_new_tokens == 32


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--config", "/nonexistent/rl.yaml"], "not found"),
        (["grpo.stepz=3"], "unknown key"),
        (["rollout.temperature=-1"], "temperature"),
        (["compare"], "at least one run"),
        (["compare", "/nonexistent/run"], "not an RL run"),
        (["--out", "x", "grpo.steps=1"], "--out is for"),
        (["parallel.pipeline=2", "grpo.iterations=2"], "grpo.iterations=1"),
        (["parallel.pipeline=0"], "parallel.pipeline"),
    ],
)
def test_cli_bad_input(capsys, args, needle):
    code = main(["rl", *args])
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if l]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dcoco: error:") and needle in lines[0], err


# -- stop-gradient --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", FAMILIES)
def test_draft_term_leaves_policy_gradients_bitwise_identical(tmp_path, method):
    run = make_run(tmp_path, method)
    ro = run.collect(0)
    _, feats, _ = run.policy_pass(ro, None, capture=True)
    before = {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}
    assert before and feats and feats[0].shape[1] == len(run.draft.feature_taps) * run.policy.hidden_size
    assert not any(f.requires_grad for f in feats)
    samples = [
        {"input_ids": o.prompt_token_ids + o.token_ids, "prompt_len": len(o.prompt_token_ids)} for o in ro["outs"]
    ]
    m = run.draft.backward(samples, feats, torch.Generator().manual_seed(0))
    assert math.isfinite(m["draft_loss"]) and any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in run.draft.params
    )
    after = {n: p.grad for n, p in run.model.named_parameters() if p.grad is not None}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)

    # end to end: one step with the draft co-trained and one with it frozen give the same policy
    frozen = make_run(tmp_path, method, name="frozen", **{"draft.cotrain": False})
    cotrained = make_run(tmp_path, method, name="cotrained")
    d0 = {k: v.clone() for k, v in cotrained.draft.model.state_dict().items()}
    cotrained.train_step(), frozen.train_step()
    for (k, v), (_, w) in zip(cotrained.model.state_dict().items(), frozen.model.state_dict().items()):
        assert torch.equal(v, w), k
    assert any(not torch.equal(d0[k], v) for k, v in cotrained.draft.model.state_dict().items())
    assert all(torch.equal(d0[k], v) for k, v in frozen.draft.model.state_dict().items())


# -- rollouts -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", FAMILIES)
def test_rollouts_with_the_live_draft_are_lossless(tmp_path, method):
    run = make_run(tmp_path, method, **{"grpo.lr": 1e-3})
    for _ in range(2):  # policy and draft both move
        m = run.train_step()
        # float32, engine on the trained module: the rollout log-probs are the trainer's
        assert m["train_infer_max_logp_diff"] < 1e-4
    prompts = [run.policy.encode(p.prompt) for p in ToyTask().val_problems()]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    outs, stats, _ = run.rollout(prompts, [sp] * len(prompts))
    vanilla, _ = SpeculativeEngine(run.policy).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
    assert stats.drafted > 0


def test_load_aware_rollouts_draft_only_within_the_token_budget(tmp_path):
    """`rollout.draft_token_budget`: B running requests draft budget // B - 1 tokens per pass, so a
    budget of 1 never drafts and samples exactly the no-draft run's rollouts; validation drafts the full
    block."""
    never = make_run(tmp_path, "dflash", name="never", **{"rollout.draft_token_budget": 1}).collect(0)
    plain = make_run(tmp_path, "none", name="plain").collect(0)
    assert never["stats"].drafted == 0
    assert [o.token_ids for o in never["outs"]] == [o.token_ids for o in plain["outs"]]
    run = make_run(tmp_path, "dflash", name="val", **{"rollout.draft_token_budget": 1})
    prompts = [run.policy.encode(p.prompt) for p in ToyTask().val_problems()]
    with torch.no_grad():  # as `validate` calls it: no budget
        _, stats, _ = run.rollout(prompts, [SamplingParams(temperature=0.0, max_tokens=12)] * len(prompts))
    assert stats.drafted == stats.verify_passes * run.draft.model.max_draft  # every request, every pass


def test_engine_logprobs_are_the_sampling_distribution():
    """The engine's per-token log-probs equal log p of the request's own transform of the target logits
    (temperature, top-k, top-p), for the prefill token and the verified ones, with a draft or without."""
    from dcoco.drafters.ngram import NgramDrafter
    from dcoco.sampling import probabilities

    target = tiny()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4]]
    for sp in (
        SamplingParams(temperature=0.7, max_tokens=10, seed=1),
        SamplingParams(temperature=1.3, top_k=7, top_p=0.9, max_tokens=10, seed=2),
    ):
        for drafter in (None, NgramDrafter()):
            outs, _ = SpeculativeEngine(target, drafter, 3, logprobs=True).generate(prompts, sp)
            for o in outs:
                assert len(o.logprobs) == len(o.token_ids)
                with torch.no_grad():
                    logits = target.model(torch.tensor([o.prompt_token_ids + o.token_ids])).logits[0]
                p = probabilities(logits[len(o.prompt_token_ids) - 1 : -1], sp.temperature, sp.top_k, sp.top_p)
                ref = p.gather(1, torch.tensor(o.token_ids).unsqueeze(1)).squeeze(1).log()
                assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-4)
    assert SpeculativeEngine(target).generate(prompts, SamplingParams(max_tokens=3))[0][0].logprobs is None


def test_bf16_rollout_copy_is_synced(tmp_path):
    run = make_run(tmp_path, "dflash", **{"policy.rollout_dtype": "bfloat16", "grpo.lr": 1e-3, "grpo.steps": 2})
    assert run.rollout_target is not run.policy and run.rollout_draft is not run.draft.model
    m = run.train_step()
    run.sync()
    for (k, v), (_, w) in zip(run.model.state_dict().items(), run.rollout_target.model.state_dict().items()):
        assert w.dtype == torch.bfloat16 and torch.equal(v.to(torch.bfloat16), w), k
    for (k, v), (_, w) in zip(run.draft.model.state_dict().items(), run.rollout_draft.state_dict().items()):
        assert torch.equal(v.to(w.dtype), w), k
    assert m["train_infer_max_logp_diff"] > 0 and m["acceptance_length"] >= 1.0
    # the rollout copy computes with the synced weights (its prepacked CPU linears follow them too)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(
            run.rollout_target.model(ids).logits, copy.deepcopy(run.model).to(torch.bfloat16)(ids).logits
        )


# -- co-training --------------------------------------------------------------------------------------------
def test_draft_loss_falls_and_outputs(tmp_path):
    run = make_run(
        tmp_path,
        "dflash",
        **{
            "grpo.steps": 14,
            "grpo.lr": 1e-6,
            "run.val_every": 7,
            "rollout.temperature": 0.5,
            "run.checkpoint_every": 7,
            "rollout.prompts_per_step": 3,
        },
    )
    run.run(progress=False)
    rows = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert rows[0]["step"] == 0 and "val_acc" in rows[0] and len(steps) == 14
    first = sum(r["draft_loss"] for r in steps[:4]) / 4
    last = sum(r["draft_loss"] for r in steps[-4:]) / 4
    assert last < 0.92 * first, (first, last)
    for key in (
        "reward",
        "acceptance_length",
        "rollout_s",
        "step_s",
        "train_infer_kl",
        "draft_grad_norm",
        "policy_grad_norm",
    ):
        assert key in steps[-1], key
    assert (tmp_path / "run" / "curve.png").exists() and (tmp_path / "run" / "state.pt").exists()
    # the exported draft loads as a normal drafter of this target
    drafter = load_drafter(SpeculativeConfig(method="dflash", model=str(tmp_path / "run" / "draft")), run.policy)
    assert drafter.tap_layers == run.draft.model.cfg.taps
    # a no-draft baseline, then the comparison table with speedups against it
    base = make_run(tmp_path, "none", name="base", **{"grpo.steps": 2})
    base.run(progress=False)
    md = compare([str(tmp_path / "base"), str(tmp_path / "run")], str(tmp_path / "cmp")).read_text()
    assert "| base | none |" in md and "| run | dflash | yes |" in md and "1.00x" in md
    assert (tmp_path / "cmp" / "compare.png").exists()


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    over = {"grpo.steps": 4, "run.checkpoint_every": 2, "grpo.lr": 1e-3, "grpo.iterations": 2}
    full = make_run(tmp_path, "dspark", name="a", **over)
    full.run(progress=False)

    killed = make_run(tmp_path, "dspark", name="b", **over)
    real = RLRun.train_step

    def dying(self):
        if self.step == 3:  # checkpoint at 2, one more step done and lost
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(RLRun, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        killed.run(progress=False)
    monkeypatch.setattr(RLRun, "train_step", real)
    resumed = make_run(tmp_path, "dspark", name="b", **over)
    assert resumed.step == 2
    resumed.run(progress=False)
    for a, b in ((full.model, resumed.model), (full.draft.model, resumed.draft.model)):
        for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(v, w), k
    timing = ("rollout_s", "rollout_tps", "step_s", "update_s", "draft_s", "step_tps", "val_tps")

    def rows(d):
        lines = (tmp_path / d / "log.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(l).items() if k not in timing} for l in lines]

    assert rows("a") == rows("b")
    with pytest.raises(ConfigError, match="draft.method"):
        make_run(tmp_path, "dflash", name="b", **over)
