"""DSpark: Markov walk, confidence truncation, loss terms, training = inference, losslessness, checkpoints."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_lossless_pvalue, random_prompts, tiny_target

from dcoco import ConfigError, SamplingParams
from dcoco.drafters.base import DraftInput
from dcoco.drafters.dflash import BlockDrafter, DFlashConfig
from dcoco.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel, save_dspark
from dcoco.engine import SpeculativeEngine
from dcoco.families import load_trained
from dcoco.speculative import SpeculativeConfig, load_drafter
from dcoco.train.batch import Batch, loss_batch
from dcoco.train.config import load_config
from dcoco.train.data import Prompt, RegeneratedData, regenerate
from dcoco.train.losses import DSparkLoss, TargetHead
from dcoco.train.trainer import Trainer

LAYERS = 6


def tiny(**over):
    return tiny_target("llama", seed=11, num_hidden_layers=LAYERS, initializer_range=0.15, **over)


def dspark_model(target, seed=0, anchor_slot=True, randomize=True, block_size=6, **kw) -> DSparkModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(target, num_layers=1, block_size=block_size, num_features=2)
    model = DSparkModel(cfg, DSparkConfig(markov_rank=8, anchor_slot=anchor_slot, **kw)).float().eval()
    if randomize:  # a Markov head that matters (W2 starts at zero)
        torch.nn.init.normal_(model.markov_head.w2.weight, std=1.0)
        if model.confidence_head is not None:
            torch.nn.init.normal_(model.confidence_head.proj.weight, std=0.3)
    return model


def draft_input(target, k=5, params=None, n=3):
    torch.manual_seed(1)
    feats = [torch.randn(m, 2 * target.hidden_size) for m in (4, 9, 6)[:n]]
    seqs = [[(7 * i + 3) % target.vocab_size for i in range(m + 1)] for m in (4, 9, 6)[:n]]
    params = params or [SamplingParams()] * n
    return DraftInput(list(range(n)), seqs, feats, k, params, [torch.Generator().manual_seed(i) for i in range(n)])


def test_untrained_markov_head_reproduces_dflash():
    target = tiny()
    model = dspark_model(target, anchor_slot=False, randomize=False, confidence_head=False)
    a = DSparkDrafter(model, target).propose(draft_input(target))
    b = BlockDrafter(model, target).propose(draft_input(target))
    assert a.tokens.shape == (3, 5) and a.lengths.tolist() == [5, 5, 5]
    assert torch.equal(a.tokens, b.tokens)
    assert DSparkDrafter(model, target).default_num_tokens == 5  # B - 1 DFlash slots
    assert DSparkDrafter(dspark_model(target), target).default_num_tokens == 6  # anchor slot drafts too


@pytest.mark.parametrize("anchor_slot", [True, False])
def test_markov_walk_matches_reference(anchor_slot):
    """Greedy tokens are argmax_v U_j(v) + (W2 W1[x_{j-1}])(v), left to right from the anchor."""
    target = tiny()
    model = dspark_model(target, anchor_slot=anchor_slot)
    drafter = DSparkDrafter(model, target)
    captured = {}
    real_select = drafter.select

    def spy(hidden, logits, inp, **kw):
        captured["logits"] = logits.clone()
        return real_select(hidden, logits, inp, **kw)

    drafter.select = spy
    inp = draft_input(target)
    out = drafter.propose(inp)
    U = captured["logits"]
    W1, W2 = model.markov_head.w1.weight, model.markov_head.w2.weight  # (V, r), (V, r)
    for b in range(3):
        prev = inp.token_ids[b][-1]
        for j in range(5):
            z = U[b, j] + W2 @ W1[prev]
            assert int(out.tokens[b, j]) == int(z.argmax())
            prev = int(out.tokens[b, j])
    # the head changes the backbone's own choices (argmax of U alone) somewhere
    assert not torch.equal(out.tokens[:, :5], U[:, :5].argmax(-1))


def test_confidence_truncation_policy():
    target = tiny()
    model = dspark_model(target)
    full = DSparkDrafter(model, target).propose(draft_input(target, k=6))
    for thr in (0.0, 0.2, 0.5, 1.0):
        d = DSparkDrafter(model, target, confidence_threshold=thr)
        conf = []
        real_step = model.step_logits

        def spy(base, hidden, prev, real_step=real_step, conf=conf):
            z, c = real_step(base, hidden, prev)
            conf.append(torch.sigmoid(c))
            return z, c

        model.step_logits = spy
        out = d.propose(draft_input(target, k=6))
        del model.step_logits
        surv = torch.cumprod(torch.stack(conf, 1), 1)
        expected = (surv >= thr).sum(1).clamp(min=1)
        assert torch.equal(out.lengths, expected)
        assert torch.equal(out.tokens, full.tokens)  # truncation only shortens the block
    assert (
        DSparkDrafter(model, target, confidence_threshold=0.0).propose(draft_input(target)).lengths.tolist() == [5] * 3
    )
    with pytest.raises(ValueError):
        DSparkDrafter(dspark_model(target, confidence_head=False), target, confidence_threshold=0.5)


def _features(target, ids: list[int]) -> torch.Tensor:
    """Features of every token as regenerated data holds them: taps 1..L (all layers)."""
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    # HF applies the final norm to the last entry of hidden_states; tap L is the layer output before it
    hs = list(out.hidden_states[1:LAYERS])
    cap = {}
    h = target.model.model.layers[-1].register_forward_hook(
        lambda m, i, o: cap.setdefault("x", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        target.model(torch.tensor([ids]))
    h.remove()
    return torch.cat(hs + [cap["x"]], -1)[0], out.logits[0].float()


def _loss(target, model, taps, gamma=3.0):
    H = target.hidden_size
    cols = torch.cat([torch.arange((t - 1) * H, t * H) for t in taps])
    return DSparkLoss(
        model,
        target.model.get_input_embeddings(),
        target.model.get_output_embeddings(),
        gamma,
        TargetHead(target),
        split=len(taps) * H - H,
    ), cols


def test_loss_terms_match_hand_computation():
    target = tiny()
    model = dspark_model(target)
    model.train()
    taps = list(model.cfg.taps) + [LAYERS]
    loss_fn, cols = _loss(target, model, taps)
    ids = [(5 * i + 2) % target.vocab_size for i in range(20)]
    feats, tlogits = _features(target, ids)
    sample = {"input_ids": ids, "prompt_len": 4}
    b = loss_batch(loss_fn, [sample], [feats[:, cols]], 3, torch.Generator().manual_seed(0))
    assert b.labels.shape == (1, 3, 6)  # anchor slot: one label per slot (B = 6)
    a = b.anchors[0].tolist()
    assert b.labels[0, 0].tolist() == ids[a[0] + 1 : a[0] + 7]
    loss, ex = loss_fn(b)
    z, conf, m = ex["logits"].detach(), ex["confidence"].detach(), ex["metrics"]
    # the target distribution recomputed from tap L equals the target's own next-token distribution
    pt = loss_fn.head.next_token_probs(b, loss_fn.split, 6)
    for j, anc in enumerate(a):
        for s in range(6):
            if anc + s < len(ids) - 1:
                assert torch.allclose(pt[0, j, s], torch.softmax(tlogits[anc + s], -1), atol=1e-5)
    valid = b.labels != -100
    w = torch.exp(-torch.arange(6.0) / 3.0) * valid
    q = torch.softmax(z, -1)
    l1 = (q - pt).abs().sum(-1)
    ce = F.cross_entropy(z.view(-1, z.shape[-1]), b.labels.view(-1), ignore_index=-100, reduction="none").view(
        valid.shape
    )
    y = 1 - 0.5 * l1
    s = torch.sigmoid(conf)
    bce = -(y * torch.log(s) + (1 - y) * torch.log(1 - s))
    hand = [(t * w).sum() / w.sum() for t in (ce, l1, bce)]
    assert m["ce_loss"] == pytest.approx(float(hand[0]), rel=1e-4)
    assert m["l1_loss"] == pytest.approx(float(hand[1]), rel=1e-4)
    assert m["confidence_loss"] == pytest.approx(float(hand[2]), rel=1e-4)
    assert torch.allclose(ex["accept"], y.detach().clamp(0, 1))
    assert loss.item() == pytest.approx(float(0.1 * hand[0] + 0.9 * hand[1] + hand[2]), rel=1e-4)
    loss.backward()
    assert model.markov_head.w2.weight.grad.abs().sum() > 0 and model.confidence_head.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("anchor_slot", [True, False])
def test_teacher_forced_training_equals_inference(anchor_slot):
    """The training pass with the drafted tokens as labels gives exactly the q the drafter sampled from."""
    target = tiny()
    model = dspark_model(target, anchor_slot=anchor_slot)
    taps = list(model.cfg.taps) + [LAYERS]
    loss_fn, cols = _loss(target, model, taps)
    prompt = [(3 * i + 1) % target.vocab_size for i in range(9)]
    feats, _ = _features(target, prompt)
    k = model.max_draft
    inp = DraftInput(
        [0],
        [prompt],
        [feats[:-1, cols[: 2 * target.hidden_size]]],
        k,
        [SamplingParams(temperature=1.0)],
        [torch.Generator().manual_seed(3)],
    )
    out = DSparkDrafter(model, target).propose(inp)
    ids = prompt + out.tokens[0].tolist()
    full = torch.zeros(len(ids), len(cols))
    full[: len(prompt)] = feats[:, cols]
    b = Batch(torch.tensor([ids]), full.unsqueeze(0), torch.tensor([[len(prompt) - 1]]), out.tokens.view(1, 1, k))
    with torch.no_grad():
        _, ex = loss_fn(b)
    assert torch.allclose(torch.softmax(ex["logits"][0, 0], -1), out.probs[0], atol=1e-5)


def test_greedy_equality_and_batch_consistency():
    target = tiny()
    prompts = random_prompts(4, target.vocab_size, seed=3)
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    for model, thr in ((dspark_model(target, seed=5), None), (dspark_model(target, seed=6, anchor_slot=False), 0.3)):
        outs, st = SpeculativeEngine(target, DSparkDrafter(model, target, thr), 5).generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and st.drafted > 0
    model = dspark_model(target, seed=5)
    batch = DSparkDrafter(model, target).propose(draft_input(target)).tokens
    for i in range(3):
        solo = draft_input(target)
        solo = DraftInput([9], [solo.token_ids[i]], [solo.new_features[i]], 5, solo.params[:1], solo.generators[:1])
        assert torch.equal(batch[i], DSparkDrafter(model, target).propose(solo).tokens[0])


V = 5


def test_sampling_is_lossless():
    target = tiny_target("llama", seed=21, num_hidden_layers=LAYERS, vocab_size=V, initializer_range=0.08)
    drafter = DSparkDrafter(dspark_model(target, seed=2), target, confidence_threshold=0.4)
    pvalue, stats = engine_lossless_pvalue(target, drafter, SamplingParams(temperature=1.0), seed=5)
    assert 0 < stats.accepted < stats.drafted
    assert pvalue > 1e-3


def test_checkpoint_round_trip(tmp_path):
    target = tiny()
    model = dspark_model(target, confidence_threshold=0.25)
    save_dspark(tmp_path / "ck", model, dtype=torch.float32)
    loaded, raw = load_trained(tmp_path / "ck")[1:]
    assert raw["dspark_config"]["markov_rank"] == 8 and raw["dspark_config"]["anchor_slot"] is True
    assert raw["dcoco_method"] == "dspark" and raw["dflash_config"]["target_layer_ids"] == model.cfg.target_layer_ids
    assert raw["architectures"] == ["DSparkDraftModel"]
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert model.state_dict()["markov_head.w1.weight"].shape == (target.vocab_size, 8)
    drafter = load_drafter(SpeculativeConfig(method="dspark", model=str(tmp_path / "ck")), target)
    assert isinstance(drafter, DSparkDrafter) and drafter.confidence_threshold == 0.25
    assert drafter.default_num_tokens == model.max_draft  # no stored default: every slot
    model.cfg.num_speculative_tokens = 2  # the stored default draft length is the drafter's
    save_dspark(tmp_path / "ck2", model)
    assert load_drafter(SpeculativeConfig(method="dspark", model=str(tmp_path / "ck2")), target).default_num_tokens == 2


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = tiny()
    root = tmp_path_factory.mktemp("regen-dspark")
    rng = random.Random(0)
    prompts = [
        Prompt(id=f"p{i}", messages=[rng.randrange(target.vocab_size) for _ in range(rng.randint(4, 12))])
        for i in range(40)
    ]
    regenerate(
        target,
        prompts,
        root,
        num_samples=40,
        taps=list(range(1, LAYERS + 1)),
        sampling=SamplingParams(max_tokens=24),
        batch_size=20,
        shard_size=20,
        progress=False,
    )
    return target, root


def _cfg(root, out, **over):
    base = {
        "method": "dspark",
        "data.path": str(root),
        "run.out": str(out),
        "optim.steps": 30,
        "optim.batch_size": 4,
        "optim.anchors_per_seq": 6,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 5,
        "optim.autocast_bf16": False,
        "drafter.num_layers": 1,
        "drafter.block_size": 6,
        "drafter.num_features": 2,
        "drafter.dspark.markov_rank": 8,
        "data.eval_samples": 6,
        "data.eval_permille": 200,
        "run.eval_every": 15,
        "run.checkpoint_every": 30,
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_training_loss_falls_and_exports(tiny_data, tmp_path):
    target, root = tiny_data
    tr = Trainer(_cfg(root, tmp_path / "run"), target, RegeneratedData(root))
    assert isinstance(tr.model, DSparkModel)
    tr.run(progress=False)
    rows = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert {"ce_loss", "l1_loss", "confidence_loss"} <= set(rows[-1])
    ev = [r for r in rows if "eval_tau" in r]
    assert ev and ev[-1]["eval_tau"] >= 1.0 and "eval_confidence_mae" in ev[-1]
    ck = tmp_path / "run" / "drafter"
    assert json.loads((ck / "config.json").read_text())["dspark_config"]["markov_rank"] == 8
    drafter = load_drafter(SpeculativeConfig(method="dspark", model=str(ck)), target)
    outs, _ = SpeculativeEngine(target, drafter).generate(
        random_prompts(2, target.vocab_size), SamplingParams(max_tokens=8)
    )
    assert all(len(o.token_ids) == 8 for o in outs)


def test_data_without_the_last_layer_is_rejected(tmp_path):
    target = tiny()
    root = tmp_path / "d"
    prompts = [Prompt(id=f"p{i}", messages=[1 + i, 2, 3, 4]) for i in range(4)]
    regenerate(target, prompts, root, num_samples=4, taps=[2, 4], sampling=SamplingParams(max_tokens=6), progress=False)
    with pytest.raises(ConfigError, match="last layer"):
        Trainer(_cfg(root, tmp_path / "run", **{"data.eval_permille": 0}), target, RegeneratedData(root))


def test_online_features_train_like_stored(tiny_data, tmp_path):
    """data.features=online (target forward per batch) gives the first step's loss of stored features."""
    target, root = tiny_data
    losses = [
        Trainer(
            _cfg(root, tmp_path / mode, **{"data.features": mode, "optim.steps": 1}), target, RegeneratedData(root)
        ).train_step()["loss"]
        for mode in ("stored", "online")
    ]
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)


def test_dcoco_distribution_term_trains_from_the_last_layer(tiny_data, tmp_path):
    """method dcoco with optim.corrector_l1_weight reads p_target from the last layer as DSpark does,
    logs the term and its T=1 acceptance estimate; a warm start from that DCOCO keeps the corrector
    and takes the walk defaults from the config."""
    target, root = tiny_data
    over = {
        "method": "dcoco",
        "optim.steps": 4,
        "drafter.dcoco.corrector_l1_weight": 1.0,
        "drafter.dcoco.top_k": 3,
        "drafter.dcoco.proj_dim": 8,
        "drafter.dcoco.hidden": 16,
        "drafter.dcoco.anchor_pair": True,
        "drafter.dcoco.sampled_walk": True,
        "drafter.dcoco.vocab_walk": True,
    }
    tr = Trainer(_cfg(root, tmp_path / "a", **over), target, RegeneratedData(root))
    tr.run(progress=False)
    rows = [json.loads(l) for l in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert all(r["corrector_l1"] > 0 and 0 <= r["t1_accept_est"] <= 1 for r in rows)
    warm = {
        **over,
        "drafter.init_from": str(tmp_path / "a" / "drafter"),
        "drafter.dcoco.vocab_walk": False,
        "drafter.dcoco.corrector_l1_weight": 0.0,
    }
    tr2 = Trainer(_cfg(root, tmp_path / "b", **warm), target, RegeneratedData(root))
    assert torch.allclose(
        tr2.model.corrector.out.weight, tr.model.corrector.out.weight, rtol=1e-2, atol=1e-4
    )  # bf16 export
    assert tr2.model.corrector.out.weight.abs().sum() > 0
    assert tr2.model.dcfg.sampled_walk and not tr2.model.dcfg.vocab_walk
