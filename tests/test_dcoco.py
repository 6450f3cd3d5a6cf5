"""DCOCO: zero-init equivalence, pair scores, selection walk, loss masking, losslessness, checkpoints."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_lossless_pvalue, random_prompts, tiny_target

from dcoco import SamplingParams
from dcoco.drafters.base import DraftInput
from dcoco.drafters.dcoco import Corrector, DCOCOConfig, DCOCODrafter, DCOCOModel, walk_greedy
from dcoco.drafters.dflash import BlockDrafter, DFlashConfig
from dcoco.engine import SpeculativeEngine
from dcoco.families import get_family, load_trained
from dcoco.train.losses import DCOCOLoss

LAYERS = 6


def tiny(**over):
    return tiny_target("llama", seed=11, num_hidden_layers=LAYERS, initializer_range=0.15, **over)


def dcoco_model(target, seed=0, randomize=False, top_k=4, **dkw) -> DCOCOModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(target, num_layers=1, block_size=6, num_features=2)
    model = DCOCOModel(cfg, DCOCOConfig(top_k=top_k, proj_dim=16, hidden=32, **dkw)).float().eval()
    if randomize:  # a corrector that actually changes choices (checked below for this seed)
        torch.manual_seed(103)
        torch.nn.init.normal_(model.corrector.out.weight, std=30.0)
    return model


def _draft_input(target, n=3, k=5, params=None):
    torch.manual_seed(1)
    feats = [torch.randn(m, 2 * target.hidden_size) for m in (4, 9, 6)[:n]]
    seqs = [list(range(1, m + 2)) for m in (4, 9, 6)[:n]]
    params = params or [SamplingParams()] * n
    return DraftInput(list(range(n)), seqs, feats, k, params, [torch.Generator().manual_seed(i) for i in range(n)])


def test_zero_init_reproduces_dflash():
    target = tiny()
    model = dcoco_model(target)
    a = DCOCODrafter(model, target).propose(_draft_input(target)).tokens
    b = BlockDrafter(model, target).propose(_draft_input(target)).tokens
    assert torch.equal(a, b)
    c = DCOCODrafter(dcoco_model(target, randomize=True), target).propose(_draft_input(target)).tokens
    assert not torch.equal(c, b)  # a trained-looking corrector does change choices


def test_pair_scores_match_slow_reference():
    target = tiny()
    model = dcoco_model(target, randomize=True)
    corr = model.corrector
    torch.nn.init.normal_(corr.w_a.bias)
    N, P, K, H = 2, 4, 3, target.hidden_size
    emb, hid, logits = torch.randn(N, P, K, H), torch.randn(N, P, H), torch.randn(N, P, K)
    fast, same = corr(emb, hid, logits)
    assert same is fast  # no sampled head: the T > 0 walks use the greedy scores
    z = corr.candidates(emb, hid)
    # one concatenated first layer, applied pair by pair
    W = torch.cat([corr.w_a.weight, corr.w_b.weight, corr.w_ab.weight, corr.w_s.weight, corr.w_l.weight], dim=1)
    lsm = logits - torch.logsumexp(logits, -1, keepdim=True)
    for n, p, a, b in itertools.product(range(N), range(P - 1), range(K), range(K)):
        s = corr.norm_pair(corr.proj_pair(torch.cat([hid[n, p], hid[n, p + 1]])))
        x = torch.cat(
            [
                z[n, p, a],
                z[n, p + 1, b],
                z[n, p, a] * z[n, p + 1, b],
                s,
                torch.stack([logits[n, p, a], logits[n, p + 1, b], lsm[n, p, a], lsm[n, p + 1, b]]),
            ]
        )
        delta = corr.out(F.silu(W @ x + corr.w_a.bias))
        assert torch.allclose(fast[n, p, a, b], logits[n, p + 1, b] + delta[0], atol=1e-4)


def test_widened_corrector_scores_as_before_and_every_new_weight_learns():
    """`Corrector.take`: a wider corrector (proj_dim 16 -> 24, hidden 32 -> 48, a sampled head added)
    scores exactly as the trained one it loads, and its new weights learn."""
    target = tiny()
    small = dcoco_model(target, randomize=True).corrector
    with torch.no_grad():
        for p in small.parameters():  # every weight trained-looking, norms and biases included
            p.normal_(float(p.mean()), 0.3)
    wide = Corrector(target.hidden_size, DCOCOConfig(top_k=4, proj_dim=24, hidden=48, sampled_head=True))
    with torch.no_grad():  # its outputs too: `take` sets what must start at zero
        wide.out.weight.normal_(), wide.out_sampled.weight.normal_()
    wide.take(small)
    N, P, K, H = 2, 4, 3, target.hidden_size
    emb, hid, logits = torch.randn(N, P, K, H), torch.randn(N, P, H), torch.randn(N, P, K)
    before = small(emb, hid, logits)[0]
    greedy, sampled = wide(emb, hid, logits)
    assert torch.allclose(greedy, before, rtol=1e-5, atol=1e-5) and torch.equal(
        sampled, logits[:, 1:].unsqueeze(2).expand_as(sampled)
    )
    opt = torch.optim.SGD(wide.parameters(), lr=0.01)
    for _ in range(2):  # new hidden units' inputs learn once their zero output weights have moved
        opt.zero_grad()
        greedy, sampled = wide(emb, hid, logits)
        (greedy.pow(2).mean() + sampled.pow(2).mean()).backward()
        opt.step()
    new = {
        "proj_emb.weight": (slice(16, None),),
        "proj_pair.weight": (slice(16, None),),
        "w_ab.weight": (slice(None, 32), slice(16, None)),
        "w_a.weight": (slice(32, None),),
        "out.weight": (slice(None), slice(32, None)),
        "out_sampled.weight": (slice(None),),
    }
    grads = {n: p.grad for n, p in wide.named_parameters()}
    for name, part in new.items():
        assert grads[name][part].abs().sum() > 0, name
    with pytest.raises(ValueError, match="does not fit"):
        small.take(wide)


def test_bigram_table_is_read_exactly_and_travels_with_the_corrector(tmp_path):
    """A bigram table: its features are log c(a, b) / (c(a) + 1) (an unseen pair counted as half) and
    log(c(a) + 1), scaled; with its input weights at zero the corrector scores exactly as without it,
    with them trained it scores otherwise; a checkpoint and a widened corrector keep it exactly."""
    target = tiny()
    model = dcoco_model(target, randomize=True)
    V = target.vocab_size
    N, P, K, H = 2, 4, 3, target.hidden_size
    ids = torch.randint(0, V, (N, P, K))
    emb, hid, logits = torch.randn(N, P, K, H), torch.randn(N, P, H), torch.randn(N, P, K)
    before = model.corrector(emb, hid, logits)[0]
    a0, b0, a1, b1 = int(ids[0, 0, 1]), int(ids[0, 1, 2]), int(ids[1, 2, 0]), int(ids[1, 3, 1])
    table = {(a0, b0): 6, (a1, b1): 2, (a0, (b0 + 1) % V): 3}
    table = {k: v for k, v in table.items() if k != (a1, b1) or a1 != a0}  # keys distinct whatever was drawn
    keys = torch.tensor([a * V + b for a, b in table])
    model.corrector.set_bigrams(keys.flip(0), torch.tensor(list(table.values())).flip(0))  # any order
    assert model.dcfg.bigram_pairs == len(table)
    f = model.corrector.bigram_features(ids)
    total = sum(v for (a, _), v in table.items() if a == a0)
    assert f[0, 0, 1, 2].tolist() == pytest.approx([math.log(6 / (total + 1)) / 4, math.log(total + 1) / 8])
    unseen = (int(ids[0, 0, 0]), int(ids[0, 1, 0]))
    if unseen not in table:
        c = sum(v for (a, _), v in table.items() if a == unseen[0])
        assert f[0, 0, 0, 0, 0] == pytest.approx(math.log(0.5 / (c + 1)) / 4)
    assert torch.equal(model.corrector(emb, hid, logits, ids)[0], before)  # its weights start at zero
    with pytest.raises(ValueError, match="token ids"):
        model.corrector(emb, hid, logits)
    torch.nn.init.normal_(model.corrector.w_g.weight, std=3.0)
    after = model.corrector(emb, hid, logits, ids)[0]
    assert not torch.allclose(after, before)
    get_family("dcoco").save(tmp_path / "ck", model, dtype=torch.float32)
    loaded = load_trained(tmp_path / "ck")[1]
    assert loaded.dcfg.bigram_pairs == len(table)
    assert torch.equal(loaded.corrector.bigram_keys, model.corrector.bigram_keys)
    assert torch.equal(loaded.corrector(emb, hid, logits, ids)[0], after)
    wide = Corrector(H, DCOCOConfig(**{**model.dcfg.model_dump(), "hidden": 48}), vocab_size=V)
    wide.take(model.corrector)
    assert torch.allclose(wide(emb, hid, logits, ids)[0], after, rtol=1e-5, atol=1e-5)


def test_walk_matches_brute_force():
    torch.manual_seed(0)
    scores = torch.randn(5, 6, 4, 4)
    idx = walk_greedy(scores)
    for n in range(5):
        k = [0]
        for p in range(6):
            k.append(max(range(4), key=lambda b: float(scores[n, p, k[-1], b])))
        assert idx[n].tolist() == k


def test_excluded_pairs_contribute_no_loss():
    target = tiny()
    model = dcoco_model(target, randomize=True)
    loss = DCOCOLoss(model, target.model.get_input_embeddings(), target.model.get_output_embeddings(), 7.0)
    ids = torch.tensor([[[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]])  # (1, P=4, K=3)
    labels = torch.tensor([[6, 10, 99, 14]])  # position 2's label is not shortlisted
    scores = torch.randn(1, 3, 3, 3, requires_grad=True)
    l, _, _, m = loss.corrector_loss(ids, scores, labels)
    l.backward()
    # pairs (1,2) and (2,3) touch position 2: no gradient reaches their scores
    assert scores.grad[0, 1].abs().sum() == 0 and scores.grad[0, 2].abs().sum() == 0
    assert scores.grad[0, 0].abs().sum() > 0
    assert m["recall_at_k"] == pytest.approx(0.75)


def test_greedy_equality_with_correction():
    target = tiny()
    prompts = random_prompts(3, target.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    outs, st = SpeculativeEngine(target, DCOCODrafter(dcoco_model(target, randomize=True), target), 5).generate(
        prompts, sp
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and st.drafted > 0


V = 5


@pytest.mark.parametrize("walk,anchor_pair", [("onehot", False), ("sampled", False), ("vocab", False), ("vocab", True)])
def test_sampling_is_lossless(walk, anchor_pair):
    target = tiny_target("llama", seed=21, num_hidden_layers=LAYERS, vocab_size=V, initializer_range=0.08)
    model = dcoco_model(target, randomize=True, top_k=3, anchor_pair=anchor_pair, sampled_head=anchor_pair)
    if anchor_pair:  # the T > 0 walk on its own output
        torch.nn.init.normal_(model.corrector.out_sampled.weight, std=3.0)
    drafter = DCOCODrafter(model, target).configure(walk=walk)
    pvalue, stats = engine_lossless_pvalue(target, drafter, SamplingParams(temperature=1.0), seed=7)
    assert 0 < stats.accepted < stats.drafted
    assert pvalue > 1e-3


def test_checkpoint_round_trip(tmp_path):
    target = tiny()
    model = dcoco_model(target, randomize=True)
    get_family("dcoco").save(tmp_path / "ck", model, dtype=torch.float32)
    loaded, raw = load_trained(tmp_path / "ck")[1:]
    assert isinstance(loaded, DCOCOModel) and raw["dcoco_config"]["top_k"] == 4 and raw["dcoco_method"] == "dcoco"
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_inference_variants(tmp_path):
    """Ablation options: shortlist size, correction off (= DFlash choices of the same backbone),
    and the variant labels the bench accepts."""
    from dcoco.errors import ConfigError
    from dcoco.speculative import SpeculativeConfig, load_drafter, variant_options

    target = tiny()
    model = dcoco_model(target, randomize=True)
    get_family("dcoco").save(tmp_path / "ck", model, dtype=torch.float32)
    k2 = load_drafter(SpeculativeConfig(method="dcoco", model=str(tmp_path / "ck"), dcoco_top_k=2), target)
    assert k2.top_k == 2 and k2.correct
    hid, logits = torch.randn(3, 5, target.hidden_size), torch.randn(3, 5, target.vocab_size)
    assert model.pair_scores(hid, logits, target.model.get_input_embeddings(), k2.top_k)[2].shape == (3, 4, 2, 2)
    off = load_drafter(SpeculativeConfig(method="dcoco", model=str(tmp_path / "ck"), dcoco_correct=False), target)
    plain = BlockDrafter(model, target).propose(_draft_input(target)).tokens
    assert torch.equal(off.propose(_draft_input(target)).tokens, plain) and off.select_seconds > 0
    assert variant_options("dcoco/k16") == {"dcoco_top_k": 16} and variant_options("dcoco/nocorrect") == {
        "dcoco_correct": False
    }
    assert variant_options("dcoco/sampled") == {"dcoco_walk": "sampled"} and variant_options("dcoco/noemb") == {}
    assert variant_options("dcoco/vocab") == {"dcoco_walk": "vocab"}
    vw = load_drafter(SpeculativeConfig(method="dcoco", model=str(tmp_path / "ck"), dcoco_walk="vocab"), target)
    assert vw.walk == "vocab" and DCOCODrafter(model, target).walk == "onehot"  # the checkpoint's default
    with pytest.raises(ConfigError, match="apply to method dcoco"):
        load_drafter(SpeculativeConfig(method="dflash", model=str(tmp_path / "ck"), dcoco_top_k=2), target)


def test_bench_accepts_variant_labels(tmp_path):
    from dcoco.bench import make_config
    from dcoco.errors import UnknownMethodError

    ck = tmp_path / "ck"
    get_family("dcoco").save(ck, dcoco_model(tiny()), dtype=torch.float32)
    cfg = make_config(
        {"methods": "vanilla,dcoco,dcoco/k4,dcoco/nocorrect,dcoco/noemb", "drafters": f"dcoco={ck},dcoco/noemb={ck}"}
    )
    assert cfg.methods == ["vanilla", "dcoco", "dcoco/k4", "dcoco/nocorrect", "dcoco/noemb"]
    with pytest.raises(UnknownMethodError, match="unknown variant"):
        make_config({"methods": "dcoco/noemb", "drafters": f"dcoco={ck}"})


def test_anchor_pair_starts_as_dflash_and_corrects_the_first_slot():
    """anchor_pair adds the pair (anchor, slot 1): zero-initialised it still drafts DFlash's tokens; a
    non-zero corrector can change the first slot (the published walk keeps it); greedy output and
    sampling stay lossless."""
    target = tiny()
    plain = BlockDrafter(dcoco_model(target), target).propose(_draft_input(target)).tokens
    assert torch.equal(
        DCOCODrafter(dcoco_model(target, anchor_pair=True), target).propose(_draft_input(target)).tokens, plain
    )
    spec = DCOCODrafter(dcoco_model(target, randomize=True), target).propose(_draft_input(target)).tokens
    anchored = (
        DCOCODrafter(dcoco_model(target, randomize=True, anchor_pair=True), target).propose(_draft_input(target)).tokens
    )
    assert torch.equal(spec[:, 0], plain[:, 0]) and not torch.equal(anchored[:, 0], plain[:, 0])
    model = dcoco_model(target, randomize=True, anchor_pair=True)
    hid, logits = torch.randn(3, 5, target.hidden_size), torch.randn(3, 5, target.vocab_size)
    anchor = torch.tensor([7, 8, 9])
    ids, vals, scores, _ = model.pair_scores(
        hid,
        logits,
        target.model.get_input_embeddings(),
        anchor=anchor,
        anchor_hidden=torch.randn(3, target.hidden_size),
    )
    assert ids.shape == (3, 6, 4) and scores.shape == (3, 5, 4, 4) and (ids[:, 0] == anchor.view(3, 1)).all()
    with pytest.raises(ValueError, match="anchor"):
        model.pair_scores(hid, logits, target.model.get_input_embeddings())
    prompts = random_prompts(3, target.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    outs, st = SpeculativeEngine(target, DCOCODrafter(model, target), 5).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and st.drafted > 0
    small = tiny_target("llama", seed=21, num_hidden_layers=LAYERS, vocab_size=V, initializer_range=0.08)
    m = dcoco_model(small, randomize=True, top_k=3, sampled_walk=True, anchor_pair=True)
    pvalue, stats = engine_lossless_pvalue(small, DCOCODrafter(m, small), SamplingParams(temperature=1.0), seed=7)
    assert 0 < stats.accepted < stats.drafted and pvalue > 1e-3


def test_anchor_pair_trains_with_the_anchor_as_position_zero():
    target = tiny()
    model = dcoco_model(target, randomize=True, anchor_pair=True, top_k=target.vocab_size).train()  # every label listed
    loss = DCOCOLoss(model, target.model.get_input_embeddings(), target.model.get_output_embeddings(), 7.0)
    from dcoco.train.batch import make_batch

    ids = torch.randint(0, target.vocab_size, (30,)).tolist()
    b = make_batch([{"input_ids": ids, "prompt_len": 4}], [torch.randn(30, 2 * target.hidden_size)], [[5, 12, 20]], 6)
    total, extras = loss(b)
    assert extras["ids"].shape[1] == 6 and (extras["ids"][:, 0, 0] == torch.tensor([ids[5], ids[12], ids[20]])).all()
    total.backward()
    assert model.corrector.out.weight.grad.abs().sum() > 0
    assert extras["metrics"]["recall_at_k"] == 1.0
    m = loss.eval_metrics(extras, b.labels)
    assert 1.0 <= m["eval_tau"] <= m["eval_tau_oracle"] == 6.0


def test_shortlist_within_a_draft_vocabulary_equals_masking_the_rest():
    from dcoco.drafters.dcoco import shortlist

    logits = torch.randn(2, 3, 50)
    vocab = torch.tensor([1, 4, 9, 16, 25, 36, 49])
    masked = torch.full_like(logits, float("-inf"))
    masked[..., vocab] = logits[..., vocab]
    v1, i1 = shortlist(masked, 4)
    v2, i2 = shortlist(logits, 4, vocab)
    assert torch.equal(v1, v2) and torch.equal(i1, i2) and torch.isin(i2, vocab).all()


@pytest.mark.parametrize(
    "anchor_pair,top_k,vocab_walk,sampled_head",
    [(True, 3, False, False), (False, 32, False, False), (True, 3, True, False), (True, 32, True, True)],
)
def test_distribution_term_matches_hand_computation(anchor_pair, top_k, vocab_walk, sampled_head):
    """The corrector's L1 term: sum_b |softmax(S_p(a*, .))_b - p_target(c_b)| over the pairs that reach
    the first num_speculative_tokens slots, p_target recomputed from the last layer; it needs the
    predecessor shortlisted, not the target token, and its complement is the T=1 acceptance."""
    from test_dspark import _features

    from dcoco.train.batch import make_batch
    from dcoco.train.losses import TargetHead

    target = tiny()
    model = dcoco_model(
        target, randomize=True, anchor_pair=anchor_pair, top_k=top_k, vocab_walk=vocab_walk, sampled_head=sampled_head
    ).train()
    if sampled_head:
        torch.nn.init.normal_(model.corrector.out_sampled.weight, std=3.0)
    model.cfg.num_speculative_tokens = 3
    H, taps = target.hidden_size, list(model.cfg.taps) + [LAYERS]
    cols = torch.cat([torch.arange((t - 1) * H, t * H) for t in taps])
    split = (len(taps) - 1) * H
    emb, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    loss = DCOCOLoss(model, emb, head, 7.0, split, TargetHead(target), l1_weight=0.5)
    plain = DCOCOLoss(model, emb, head, 7.0)
    ids = [(7 * i + 3) % target.vocab_size for i in range(24)]
    feats, tlogits = _features(target, ids)
    anchors = [4, 9, 15]
    b = make_batch([{"input_ids": ids, "prompt_len": 4}], [feats[:, cols]], [anchors], 6)
    total, ex = loss(b)
    m = ex["metrics"]
    base, _ = plain(make_batch([{"input_ids": ids, "prompt_len": 4}], [feats[:, cols[:split]]], [anchors], 6))
    assert total.item() == pytest.approx(base.item() + 0.5 * m["corrector_l1"], rel=1e-4)
    lead = model.lead
    walk = [[ids[a]] * lead + ids[a + 1 : a + 6] for a in anchors]  # labels along the walk
    num = den = acc = n_acc = 0.0
    for n, a in enumerate(anchors):
        for p in range(3 - 1 + lead):  # pairs ending at slots 1..3 (2..3 without the anchor pair)
            cand_prev, cand = ex["ids"][n, p].tolist(), ex["ids"][n, p + 1]
            if walk[n][p] not in cand_prev:
                continue
            s_row = ex["sampled_scores"][n, p, cand_prev.index(walk[n][p])].detach().float()
            pt = torch.softmax(tlogits[a + p + 1 - lead], -1)  # the slot's own distribution
            if vocab_walk:  # the drafter's softmax with the shortlist rescored
                q = torch.softmax(ex["logits"][0, n, p + 1 - lead].detach().float().index_put((cand,), s_row), -1)
            else:
                q, pt = torch.softmax(s_row, -1), pt[cand]
            w = math.exp(-p / 7.0)
            num, den = num + w * float((q - pt).abs().sum()), den + w
            acc, n_acc = acc + float(torch.minimum(q, pt).sum()), n_acc + 1
    assert den > 0 and m["corrector_l1"] == pytest.approx(num / den, rel=1e-4)
    assert m["t1_accept_est"] == pytest.approx(acc / n_acc, rel=1e-4)
    assert sampled_head or torch.equal(ex["sampled_scores"], ex["scores"])
    total.backward()
    assert model.corrector.out.weight.grad.abs().sum() > 0
    if sampled_head:  # cross-entropy trains the greedy output, the L1 term the sampled one
        assert model.corrector.out_sampled.weight.grad.abs().sum() > 0
        model.zero_grad()
        plain(make_batch([{"input_ids": ids, "prompt_len": 4}], [feats[:, cols[:split]]], [anchors], 6))[0].backward()
        assert (
            model.corrector.out_sampled.weight.grad is None or model.corrector.out_sampled.weight.grad.abs().sum() == 0
        )
    with pytest.raises(ValueError, match="target head"):
        DCOCOLoss(model, emb, head, 7.0, l1_weight=0.5)


@pytest.mark.parametrize("anchor_pair,draft_vocab", [(False, False), (True, False), (True, True)])
def test_vocab_walk_starts_as_dflash_sampling(anchor_pair, draft_vocab):
    """The vocabulary walk with a zero corrector draws DFlash's tokens from DFlash's q (same request
    generators), with or without a draft vocabulary; a trained corrector moves q only on the
    shortlist of a slot whose predecessor was drawn from its own shortlist."""
    target = tiny()
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams()]
    vocab = torch.arange(0, target.vocab_size, 2)

    def make(**kw):
        m = dcoco_model(target, **kw)
        if draft_vocab:
            m.set_draft_vocab(vocab)
        return m

    plain = BlockDrafter(make(), target).propose(_draft_input(target, params=params))
    zero = DCOCODrafter(make(anchor_pair=anchor_pair), target).configure(walk="vocab")
    out = zero.propose(_draft_input(target, params=params))
    assert torch.equal(out.tokens, plain.tokens) and torch.allclose(out.probs, plain.probs)
    assert not draft_vocab or (torch.isin(out.tokens, vocab).all() and out.probs[..., 1::2].sum() == 0)
    model = make(randomize=True, anchor_pair=anchor_pair, sampled_head=True)
    d = DCOCODrafter(model, target).configure(
        walk="vocab"
    )  # a zero sampled head: DFlash's sampling, greedy rows corrected
    mixed = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=1.0)]
    out = d.propose(_draft_input(target, params=mixed))
    ref = BlockDrafter(model, target).propose(_draft_input(target, params=mixed))
    greedy_walk = DCOCODrafter(model, target).propose(_draft_input(target)).tokens
    assert torch.equal(out.tokens[[0, 2]], ref.tokens[[0, 2]]) and torch.equal(out.tokens[1], greedy_walk[1])
    torch.nn.init.normal_(model.corrector.out_sampled.weight, std=3.0)
    inp = _draft_input(target, params=[SamplingParams(temperature=1.0)] * 3)
    out = d.propose(inp)
    assert (
        torch.allclose(out.probs.sum(-1), torch.ones(3, 5)) and (out.probs.gather(2, out.tokens.unsqueeze(2)) > 0).all()
    )
    base = BlockDrafter(model, target).propose(_draft_input(target, params=[SamplingParams(temperature=1.0)] * 3))
    assert not torch.allclose(out.probs, base.probs)  # the corrector changed q somewhere


@pytest.mark.parametrize("anchor_pair", [False, True])
def test_t1_acceptance_of_a_zero_corrector_is_dflash(anchor_pair):
    """`dcoco eval` at T=1: with the corrector at zero the vocabulary walk samples exactly DFlash's
    q, so every slot's expected acceptance is DFlash's; a corrector that changes the scores changes
    it; and the one-hot walk's slot is accepted with p_target of the token it picks."""
    from test_dspark import _features

    from dcoco.train.batch import make_batch
    from dcoco.train.losses import DrafterLoss, TargetHead

    target = tiny()
    H = target.hidden_size
    emb, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    ids = [(7 * i + 3) % target.vocab_size for i in range(24)]
    feats, tlogits = _features(target, ids)

    def alpha(model, cls=DCOCOLoss, with_extras=False):
        taps = list(model.cfg.taps) + [LAYERS]
        cols = torch.cat([torch.arange((t - 1) * H, t * H) for t in taps])
        loss = cls(model, emb, head, 7.0, (len(taps) - 1) * H, TargetHead(target))
        b = make_batch([{"input_ids": ids, "prompt_len": 4}], [feats[:, cols]], [[4, 9, 15]], 6)
        with torch.no_grad():
            extras = loss(b)[1]
            a, valid = loss.slot_acceptance(b, extras)
        assert valid.all() and ((a >= 0) & (a <= 1 + 1e-6)).all()
        return (a, extras) if with_extras else a

    zero = dcoco_model(target, anchor_pair=anchor_pair, vocab_walk=True, sampled_walk=True)
    assert torch.allclose(alpha(zero), alpha(zero, DrafterLoss), atol=1e-6)
    trained = dcoco_model(target, randomize=True, anchor_pair=anchor_pair, top_k=32, vocab_walk=True, sampled_walk=True)
    assert not torch.allclose(alpha(trained), alpha(trained, DrafterLoss), atol=1e-4)
    onehot = dcoco_model(target, randomize=True, anchor_pair=anchor_pair)
    a, extras = alpha(onehot, with_extras=True)
    p = torch.softmax(tlogits[4], -1)  # slot 1 of the first block (anchor 4) predicts token 5
    shortlists = extras["ids"][0]  # (walk positions, K) of the first block
    if anchor_pair:  # walk position 0 is the anchor: slot 1 is its best-scored successor
        picked = shortlists[1, extras["scores"][0, 0, 0].argmax()]
    else:  # slot 1 is the drafter's first choice
        picked = shortlists[0, 0]
    assert a[0, 0, 0].item() == pytest.approx(p[picked].item(), abs=1e-6)
