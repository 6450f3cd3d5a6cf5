"""DFlash: masks, anchors, loss weights, training, checkpoints, resume, and lossless drafting."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from conftest import random_prompts, tiny_target

from dcoco import ConfigError, DrafterMismatchError, SamplingParams
from dcoco.drafters.dflash import (
    AnchorGroupAttention,
    BlockDrafter,
    DFlashConfig,
    DFlashModel,
    default_target_layer_ids,
    save_dflash,
    training_mask,
)
from dcoco.engine import SpeculativeEngine
from dcoco.families import load_trained
from dcoco.train.acceptance import decode_acceptance
from dcoco.train.batch import make_batch, pair_counts, position_weights, sample_anchors
from dcoco.train.config import load_config
from dcoco.train.data import Prompt, RegeneratedData, regenerate
from dcoco.train.trainer import Trainer

LAYERS = 6


def tiny():
    return tiny_target("llama", seed=11, num_hidden_layers=LAYERS, initializer_range=0.15)


def tiny_dflash(target, seed=0, **kw) -> DFlashModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(target, num_layers=1, block_size=kw.pop("block_size", 6), num_features=2, **kw)
    return DFlashModel(cfg).float().eval()


def test_default_layer_ids_match_published_rule():
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]


def test_training_mask_structure():
    anchors = torch.tensor([[3, 6, -1]])
    m = training_mask(anchors, T=8, B=2)[0, 0]  # (6, 8 + 6)
    ctx, blk = m[:, :8], m[:, 8:]
    assert ctx[0].tolist() == [True] * 3 + [False] * 5  # block at anchor 3 sees positions 0..2 only
    assert ctx[2].tolist() == [True] * 6 + [False] * 2
    assert not ctx[4:].any()  # padding block sees no context
    expected = torch.block_diag(*[torch.ones(2, 2, dtype=torch.bool)] * 3)
    assert torch.equal(blk, expected)  # bidirectional inside a block, nothing across blocks


@pytest.mark.parametrize("anchors", [[[3, 9, 10, 17, 25, -1], [2, 4, 30, -1, -1, -1]], [[17, 3, 25, 9, 10, 2]]])
def test_anchor_groups_attend_as_the_full_mask(anchors):
    """Group by group (3 blocks each, here) the same attention, values and gradients, as one pass
    under `training_mask`: sorted anchors with padding blocks, and unsorted ones."""
    torch.manual_seed(0)
    anchors = torch.tensor(anchors)
    S, A = anchors.shape
    B, T, H, Hkv, D = 2, 32, 6, 2, 8
    q = torch.randn(S, H, A * B, D, dtype=torch.float64, requires_grad=True)
    kb, vb = (torch.randn(S, Hkv, A * B, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ck, cv = (torch.randn(S, Hkv, T, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    full = torch.nn.functional.scaled_dot_product_attention(
        q,
        torch.cat([ck, kb], 2).repeat_interleave(H // Hkv, 1),
        torch.cat([cv, vb], 2).repeat_interleave(H // Hkv, 1),
        attn_mask=training_mask(anchors, T, B),
    )
    attend = AnchorGroupAttention(anchors, B, group_queries=3 * B)
    assert len(attend.groups) == 2
    grouped = attend(q, kb, vb, ck, cv)
    assert torch.allclose(grouped, full, atol=1e-12)
    w = torch.randn_like(full)
    g_full = torch.autograd.grad((full * w).sum(), (q, kb, vb, ck, cv))
    g_grouped = torch.autograd.grad((grouped * w).sum(), (q, kb, vb, ck, cv))
    for a, b in zip(g_grouped, g_full):
        assert torch.allclose(a, b, atol=1e-12)


def test_no_label_leaks_into_its_block():
    """Block outputs depend only on context before the anchor and the anchor token itself."""
    target = tiny()
    model = tiny_dflash(target)
    from dcoco.train.losses import DrafterLoss

    loss = DrafterLoss(model, target.model.get_input_embeddings(), target.model.get_output_embeddings(), 7.0)
    T, Fd = 20, 2 * target.hidden_size
    ids = torch.randint(0, target.vocab_size, (1, T))
    feats = torch.randn(1, T, Fd)
    anchors = torch.tensor([[5, 12]])
    labels = torch.full((1, 2, 5), -100)
    from dcoco.train.batch import Batch

    with torch.no_grad():
        h = loss.hidden(Batch(ids, feats, anchors, labels))
        ids2, feats2 = ids.clone(), feats.clone()
        ids2[0, 13:] = (ids2[0, 13:] + 1) % target.vocab_size  # tokens after the second anchor (its labels)
        feats2[0, 12:] += 5.0  # features at and after the second anchor
        h2 = loss.hidden(Batch(ids2, feats2, anchors, labels))
        assert torch.allclose(h[0, 1], h2[0, 1], atol=1e-5)
        ids3 = ids.clone()
        ids3[0, 12] = (ids3[0, 12] + 1) % target.vocab_size  # the anchor token itself matters
        assert not torch.allclose(loss.hidden(Batch(ids3, feats, anchors, labels))[0, 1], h[0, 1])


def test_anchors_and_weights():
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=10, length=30, n=8, gen=g)
    assert len(a) == len(set(a)) == 8 and all(10 <= x <= 28 for x in a)
    assert sample_anchors(10, 13, 8, g) == [10, 11]
    assert sample_anchors(10, 11, 8, g) == []
    w = position_weights(5, 2.0)
    assert torch.allclose(w, torch.exp(-torch.arange(4) / 2.0))
    b = make_batch([{"input_ids": list(range(20)), "prompt_len": 5}], [torch.zeros(20, 4)], [[5, 17]], 5)
    assert b.labels[0, 0].tolist() == [6, 7, 8, 9] and b.labels[0, 1].tolist() == [18, 19, -100, -100]


def test_decode_acceptance_walks_blocks_like_greedy_decoding():
    """Blocks open where the previous one ended, accept their matching prefix of k drafts and add
    the target's token, which never runs past the answer."""
    x = list(range(100, 112))  # an answer of 12 tokens; anchors at its first 11
    b = make_batch([{"input_ids": [0, 1] + x, "prompt_len": 2}], [torch.zeros(14, 4)], [list(range(2, 13))], 5)
    pred = b.labels[0].clone()  # every draft right ...
    pred[0, 1] = pred[3, 0] = -1  # ... but slot 2 at anchor 0 and slot 1 at anchor 3
    # anchor 0: 1 accepted (+1) -> anchor 2: 3 of k=3 (+1) -> anchor 6: 3 (+1) -> anchor 10: capped at 0 (+1)
    assert decode_acceptance(pred, b.labels[0], 3) == (4, 11)
    assert decode_acceptance(pred, b.labels[0], 4) == (3, 11)  # anchors 0, 2 (4 + 1), 7 (3 left + 1)
    pred[:] = -1
    assert decode_acceptance(pred, b.labels[0], 3) == (11, 11)


def test_checkpoint_round_trip(tmp_path):
    target = tiny()
    model = tiny_dflash(target, seed=3)
    save_dflash(tmp_path / "ck", model, dtype=torch.float32)
    loaded, raw = load_trained(tmp_path / "ck")[1:]
    assert raw["dflash_config"]["target_layer_ids"] == model.cfg.target_layer_ids
    assert raw["dflash_config"]["block_size"] == raw["block_size"] == 6
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_mismatched_target_is_rejected():
    model = tiny_dflash(tiny())
    other = tiny_target("llama", seed=1, num_hidden_layers=LAYERS, vocab_size=80)
    with pytest.raises(DrafterMismatchError):
        BlockDrafter(model, other).check_target(other)
    other = tiny_target("llama", seed=1, num_hidden_layers=4)
    with pytest.raises(DrafterMismatchError):
        BlockDrafter(model, other).check_target(other)


def test_greedy_equality_and_batch_consistency():
    target = tiny()
    model = tiny_dflash(target, seed=5)
    prompts = random_prompts(4, target.vocab_size, seed=3)
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    outs, stats = SpeculativeEngine(target, BlockDrafter(model, target), 5).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
    assert stats.drafted > 0
    # drafts for a batch equal drafts made one request at a time (context masking at inference)
    from dcoco.drafters.base import DraftInput

    feats = [torch.randn(n, 2 * target.hidden_size) for n in (3, 9, 5)]
    seqs = [list(range(1, n + 2)) for n in (3, 9, 5)]
    sps = [SamplingParams()] * 3
    gens = [torch.Generator() for _ in range(3)]
    d = BlockDrafter(model, target)
    batch = d.propose(DraftInput([0, 1, 2], seqs, feats, 5, sps, gens)).tokens
    for i in range(3):
        solo = BlockDrafter(model, target).propose(DraftInput([9], [seqs[i]], [feats[i]], 5, sps[:1], gens[:1])).tokens
        assert torch.equal(batch[i], solo[0])


def test_draft_vocabulary_limits_proposals_and_stays_lossless(tmp_path):
    """With a draft vocabulary only its rows of the LM head are scored: drafts (greedy and sampled)
    come from it, q is zero elsewhere, greedy output still equals the target's, and the vocabulary
    survives a checkpoint round trip."""
    from dcoco.drafters.base import DraftInput

    target = tiny()
    model = tiny_dflash(target, seed=5)
    with pytest.raises(ValueError, match="distinct"):
        model.set_draft_vocab(torch.tensor([3, 3, 4]))
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    model.set_draft_vocab(ids)
    save_dflash(tmp_path / "ck", model, dtype=torch.float32)
    loaded, raw = load_trained(tmp_path / "ck")[1:]
    assert raw["dcoco_draft_vocab_size"] == 40 and torch.equal(loaded.draft_ids, ids.sort().values)
    d = BlockDrafter(loaded, target)
    feats = [torch.randn(n, 2 * target.hidden_size) for n in (3, 9)]
    seqs = [list(range(1, n + 2)) for n in (3, 9)]
    sps = [SamplingParams(), SamplingParams(temperature=1.0)]
    out = d.propose(DraftInput([0, 1], seqs, feats, 5, sps, [torch.Generator().manual_seed(i) for i in range(2)]))
    allowed = torch.zeros(target.vocab_size, dtype=torch.bool)
    allowed[ids] = True
    assert allowed[out.tokens].all() and out.probs[:, :, ~allowed].sum() == 0
    assert torch.allclose(out.probs[1].sum(-1), torch.ones(5))
    prompts = random_prompts(3, target.vocab_size, seed=4)
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    outs, stats = SpeculativeEngine(target, BlockDrafter(loaded, target), 5).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and stats.drafted > 0


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = tiny()
    root = tmp_path_factory.mktemp("regen")
    rng = random.Random(0)
    prompts = [
        Prompt(id=f"p{i}", messages=[rng.randrange(target.vocab_size) for _ in range(rng.randint(4, 12))])
        for i in range(40)
    ]
    taps = [i + 1 for i in default_target_layer_ids(LAYERS, 2)]
    regenerate(
        target,
        prompts,
        root,
        num_samples=40,
        taps=taps,
        sampling=SamplingParams(max_tokens=24),
        batch_size=16,
        shard_size=8,
        progress=False,
    )
    return target, root


def test_regenerate_resumes_without_loss_or_duplicates(tiny_data, tmp_path):
    target, root = tiny_data
    data = RegeneratedData(root)
    samples = data.samples()
    assert len(samples) == 40 and len({s["id"] for s in samples}) == 40
    s = samples[0]
    assert data.features(s).shape == (len(s["input_ids"]) - 1, 2 * target.hidden_size)
    # a torn last line and an orphan shard (crash mid-write) are discarded, then the run completes
    text = data.samples_path.read_text().splitlines()
    data.samples_path.write_text("\n".join(text[:-3]) + "\n" + text[-3][: len(text[-3]) // 2])
    (data.features_dir / "shard-00099.safetensors").write_bytes(b"partial")
    prompts = [Prompt(id=x["id"], messages=x["input_ids"][: x["prompt_len"]]) for x in samples]
    regenerate(
        target,
        prompts,
        root,
        num_samples=40,
        taps=data.manifest["taps"],
        sampling=SamplingParams(max_tokens=24),
        batch_size=16,
        shard_size=8,
        progress=False,
    )
    again = RegeneratedData(root).samples()
    assert sorted(x["id"] for x in again) == sorted(x["id"] for x in samples)
    assert {x["id"]: x["input_ids"] for x in again} == {x["id"]: x["input_ids"] for x in samples}
    assert not (data.features_dir / "shard-00099.safetensors").exists()
    with pytest.raises(ConfigError):  # other settings into the same directory
        regenerate(
            target, prompts, root, num_samples=41, taps=[1], sampling=SamplingParams(max_tokens=24), progress=False
        )


def test_regenerate_skips_prompts_answered_in_excluded_directories(tiny_data, tmp_path):
    """A fresh directory extends a corpus (regenerated or packed) with new prompts only: what the
    corpus answered is skipped, and packing the new directory into it appends only new samples."""
    from dcoco.train.packed import PackedData, pack

    target, root = tiny_data
    samples = RegeneratedData(root).samples()
    packed = tmp_path / "packed"
    pack([RegeneratedData(root)], packed)
    prompts = [Prompt(id=x["id"], messages=x["input_ids"][: x["prompt_len"]]) for x in samples[:6]]
    prompts += [Prompt(id=f"new{i}", messages=[3 + i, 4, 5]) for i in range(3)]
    taps = RegeneratedData(root).manifest["taps"]
    more = tmp_path / "more"
    kw = dict(taps=taps, sampling=SamplingParams(max_tokens=24), batch_size=16, shard_size=8, progress=False)
    regenerate(target, prompts, more, num_samples=9, exclude=[packed], **kw)
    assert sorted(s["id"] for s in RegeneratedData(more).samples()) == ["new0", "new1", "new2"]
    pack([RegeneratedData(more)], packed)
    assert len(PackedData(packed).samples()) == len(samples) + 3
    with pytest.raises(ConfigError, match="not a regenerated or packed"):
        regenerate(target, prompts, tmp_path / "x", num_samples=1, exclude=[tmp_path / "missing"], **kw)
    assert not (tmp_path / "x").exists()  # nothing written


def test_prompts_are_answered_in_length_sorted_windows():
    """Regeneration sorts each window of prompts by length (less padding in flight) but answers the
    same prompts: a window never reaches past the prompts it was asked for."""
    from dcoco.train.data import _by_length

    prompts = [(Prompt(id=str(i), messages=[]), [0] * n) for i, n in enumerate([5, 2, 9, 1, 7, 3, 8])]
    got = list(_by_length(iter(prompts), 3))
    assert [len(ids) for _, ids in got] == [2, 5, 9, 1, 3, 7, 8]
    assert sorted(p.id for p, _ in got) == [str(i) for i in range(7)]


def test_union_of_regenerated_sets(tiny_data, tmp_path):
    """Two directories regenerated side by side train as one set; a duplicate id is read once unless
    answered at another temperature, and directories with other taps are refused."""
    from dcoco.train.data import RegeneratedUnion

    target, root = tiny_data
    samples = RegeneratedData(root).samples()
    prompts = [Prompt(id=x["id"], messages=x["input_ids"][: x["prompt_len"]]) for x in samples[:5]]
    prompts.append(Prompt(id="extra", messages=[3, 4, 5]))
    other = tmp_path / "other"
    taps = RegeneratedData(root).manifest["taps"]
    regenerate(target, prompts, other, num_samples=6, taps=taps, sampling=SamplingParams(max_tokens=24), progress=False)
    union = RegeneratedUnion([str(root), str(other)])
    got = union.samples()
    assert sorted(s["id"] for s in got) == sorted([s["id"] for s in samples] + ["extra"])
    extra = next(s for s in got if s["id"] == "extra")
    assert union.features(extra).shape == (len(extra["input_ids"]) - 1, 2 * target.hidden_size)
    Trainer(_cfg([str(root), str(other)], tmp_path / "run", **{"optim.steps": 2}), target, union).run(progress=False)
    # the target's T=1 answers to the same prompts are other samples (same ids, held out alike)
    hot = tmp_path / "hot"
    regenerate(
        target,
        prompts[:2],
        hot,
        num_samples=2,
        taps=taps,
        sampling=SamplingParams(temperature=1.0, max_tokens=7),
        progress=False,
    )
    both = RegeneratedUnion([root, hot])
    assert both.manifest["taps"] == taps and len(both.samples()) == len(samples) + 2
    odd = tmp_path / "odd"
    regenerate(
        target, prompts[:1], odd, num_samples=1, taps=taps[:1], sampling=SamplingParams(max_tokens=7), progress=False
    )
    with pytest.raises(ConfigError, match="taps"):
        _ = RegeneratedUnion([root, odd]).manifest


def test_token_ids_of_another_dtype_train_together_and_eval_path_keeps_the_hold_out(tiny_data, tmp_path):
    """Token ids answered in another dtype (a CPU without bf16 matrix units answers in float32) train
    with the others on online features, while stored features of two dtypes are refused; and
    `data.eval_path` evaluates another set's hold-out, which is never trained on, recomputing its
    features when it holds token ids alone."""
    import json
    import shutil

    from dcoco.train.batch import is_eval_sample
    from dcoco.train.data import RegeneratedUnion

    target, root = tiny_data

    def as_dtype(d, dtype):
        m = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps({**m, "dtype": dtype}))

    other = "bfloat16" if RegeneratedData(root).manifest["dtype"] != "bfloat16" else "float32"
    new = tmp_path / "new"
    rng = random.Random(1)
    prompts = [Prompt(id=f"n{i}", messages=[rng.randrange(target.vocab_size) for _ in range(6)]) for i in range(20)]
    taps = RegeneratedData(root).manifest["taps"]
    regenerate(
        target,
        prompts,
        new,
        num_samples=20,
        taps=taps,
        sampling=SamplingParams(max_tokens=16),
        progress=False,
        features=False,
    )
    as_dtype(new, other)
    assert RegeneratedUnion([root, new]).manifest["taps"] == taps
    odd = tmp_path / "odd"
    shutil.copytree(root, odd)
    as_dtype(odd, other)
    with pytest.raises(ConfigError, match="dtype"):
        _ = RegeneratedUnion([root, odd]).manifest

    over = {"data.features": "online", "data.eval_path": str(root), "optim.steps": 2, "run.eval_every": 2}
    tr = Trainer(_cfg(str(new), tmp_path / "run", **over), target, RegeneratedUnion([new]))
    held = [s["id"] for s in RegeneratedData(root).samples() if is_eval_sample(s["id"], 200)]
    assert held and [s["id"] for s in tr.eval_samples] == held[:6]
    assert tr.train_samples and all(s["id"].startswith("n") for s in tr.train_samples)
    tr.run(progress=False)
    assert any("eval_loss" in r for r in tr.curve_rows())
    # stored features train beside an eval_path of token ids alone, whose features are recomputed
    over = {"data.features": "stored", "data.eval_path": str(new), "optim.steps": 2, "run.eval_every": 2}
    tr = Trainer(_cfg(str(root), tmp_path / "stored", **over), target, RegeneratedData(root))
    tr.run(progress=False)
    assert any("eval_loss" in r for r in tr.curve_rows())


#: a corrector small enough for the tiny target
SMALL_CORRECTOR = {"drafter.dcoco.top_k": 3, "drafter.dcoco.proj_dim": 8, "drafter.dcoco.hidden": 16}


def _cfg(root, out, **over):
    base = {
        "data.path": str(root),
        "run.out": str(out),
        "optim.steps": 40,
        "optim.batch_size": 4,
        "optim.anchors_per_seq": 6,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 5,
        "optim.autocast_bf16": False,
        "drafter.num_layers": 1,
        "drafter.block_size": 6,
        "drafter.num_features": 2,
        "data.eval_samples": 6,
        "data.eval_permille": 200,
        "run.eval_every": 20,
        "run.checkpoint_every": 10,
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_samples_with_no_response_within_max_length_are_left_out(tiny_data, tmp_path):
    """A sample cut by data.max_length to (almost) its prompt has nothing to train or evaluate."""
    target, root = tiny_data
    tr = Trainer(_cfg(root, tmp_path / "run", **{"data.max_length": 12}), target, RegeneratedData(root))
    kept = tr.train_samples + tr.eval_samples
    assert any(s["prompt_len"] > 10 for s in RegeneratedData(root).samples())
    assert kept and all(s["prompt_len"] <= 10 for s in kept)


def test_train_samples_draws_a_seeded_subset_and_trains_only_on_it(tiny_data, tmp_path):
    """data.train_samples=N keeps N training samples drawn by optim.seed (the same N on a resume, another
    N for another seed), never a held-out one, and the steps read nothing else."""
    target, root = tiny_data
    over = {"data.train_samples": 3, "optim.steps": 4, "optim.seed": 1}
    full = Trainer(_cfg(root, tmp_path / "all"), target, RegeneratedData(root))
    tr = Trainer(_cfg(root, tmp_path / "a", **over), target, RegeneratedData(root))
    ids = [s["id"] for s in tr.train_samples]
    assert len(ids) == 3 and set(ids) <= {s["id"] for s in full.train_samples}
    again = Trainer(_cfg(root, tmp_path / "b", **over), target, RegeneratedData(root))
    assert ids == [s["id"] for s in again.train_samples]
    other = Trainer(_cfg(root, tmp_path / "c", **{**over, "optim.seed": 2}), target, RegeneratedData(root))
    assert [s["id"] for s in other.train_samples] != ids
    seen, read = set(), tr.features
    tr.features = lambda samples: seen.update(s["id"] for s in samples) or read(samples)
    tr.run(progress=False)
    assert seen == set(ids)


def test_exclude_subsets_leaves_out_what_earlier_stages_drew(tiny_data, tmp_path):
    """data.exclude_subsets=[[seed, N], ...] leaves out exactly the N samples that data.train_samples=N
    drew with that seed, stage after stage: the rest without data.train_samples, a new draw among the
    rest with it, and a one-line error when nothing is left."""
    target, root = tiny_data
    full = {s["id"] for s in Trainer(_cfg(root, tmp_path / "all"), target, RegeneratedData(root)).train_samples}
    drawn = Trainer(
        _cfg(root, tmp_path / "a", **{"data.train_samples": 3, "optim.seed": 1}), target, RegeneratedData(root)
    )
    first = {s["id"] for s in drawn.train_samples}
    rest = Trainer(_cfg(root, tmp_path / "b", **{"data.exclude_subsets": [[1, 3]]}), target, RegeneratedData(root))
    assert {s["id"] for s in rest.train_samples} == full - first
    over = {"data.exclude_subsets": [[1, 3]], "data.train_samples": 2, "optim.seed": 1}
    second = {s["id"] for s in Trainer(_cfg(root, tmp_path / "c", **over), target, RegeneratedData(root)).train_samples}
    assert len(second) == 2 and second <= full - first
    # a third stage leaves out both: each pair is a draw from what the pairs before it left
    chained = {"data.exclude_subsets": [[1, 3], [1, 2]]}
    third = Trainer(_cfg(root, tmp_path / "e", **chained), target, RegeneratedData(root)).train_samples
    assert {s["id"] for s in third} == full - first - second
    with pytest.raises(ConfigError, match="leaves none"):
        Trainer(
            _cfg(root, tmp_path / "d", **{"data.exclude_subsets": [[1, 3], [2, len(full)]]}),
            target,
            RegeneratedData(root),
        )


def test_exclude_subsets_with_drawn_from_survives_appended_answers(tiny_data, tmp_path):
    """[seed, N, drawn_from] (the stage's provenance) names the same answers after the directory has
    grown by appended answers, where a draw among all of them would name others, and data.drawn_from
    draws them again; a drawn_from larger than what is there is a one-line error."""
    target, root = tiny_data
    before = tmp_path / "before"  # the directory as the earlier stage saw it: its first 24 answers
    shutil.copytree(root, before)
    lines = (root / "samples.jsonl").read_text().splitlines(keepends=True)
    (before / "samples.jsonl").write_text("".join(lines[:24]))
    stage = Trainer(
        _cfg(before, tmp_path / "a", **{"data.train_samples": 5, "optim.seed": 3}), target, RegeneratedData(before)
    )
    drawn, pool = {s["id"] for s in stage.train_samples}, stage.provenance()["dcoco_training"]["drawn_from"]
    full = {s["id"] for s in Trainer(_cfg(root, tmp_path / "all"), target, RegeneratedData(root)).train_samples}
    assert pool < len(full)
    later = Trainer(
        _cfg(root, tmp_path / "b", **{"data.exclude_subsets": [[3, 5, pool]]}), target, RegeneratedData(root)
    )
    assert {s["id"] for s in later.train_samples} == full - drawn
    unnamed = Trainer(_cfg(root, tmp_path / "d", **{"data.exclude_subsets": [[3, 5]]}), target, RegeneratedData(root))
    assert {s["id"] for s in unnamed.train_samples} != full - drawn  # the same draw among all of them
    again = {"data.train_samples": 5, "optim.seed": 3, "data.drawn_from": pool}  # that stage's own draw again
    redrawn = Trainer(_cfg(root, tmp_path / "e", **again), target, RegeneratedData(root))
    assert {s["id"] for s in redrawn.train_samples} == drawn
    with pytest.raises(ConfigError, match="data.drawn_from"):
        Trainer(_cfg(before, tmp_path / "f", **{"data.drawn_from": pool + 1}), target, RegeneratedData(before))
    with pytest.raises(ConfigError, match="drew from"):
        Trainer(
            _cfg(before, tmp_path / "c", **{"data.exclude_subsets": [[3, 5, pool + 1]]}),
            target,
            RegeneratedData(before),
        )


def test_training_loss_falls(tiny_data, tmp_path):
    target, root = tiny_data
    tr = Trainer(_cfg(root, tmp_path / "run"), target, RegeneratedData(root))
    tr.run(progress=False)
    import json

    rows = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert all(0 < r["rss_gb"] < 1024 for r in rows)  # each step's resident memory, in GB
    assert (tmp_path / "run" / "drafter" / "config.json").exists() and (tmp_path / "run" / "curve.png").exists()
    ev = [r for r in rows if "eval_tau" in r]
    assert ev and ev[-1]["eval_tau"] >= 1.0


def test_resume_equals_uninterrupted(tiny_data, tmp_path, monkeypatch):
    target, root = tiny_data
    over = {"optim.steps": 8, "run.checkpoint_every": 3, "run.eval_every": 100}
    full = Trainer(_cfg(root, tmp_path / "a", **over), target, RegeneratedData(root))
    full.run(progress=False)

    killed = Trainer(_cfg(root, tmp_path / "b", **over), target, RegeneratedData(root))
    real_step = Trainer.train_step

    def dying_step(self):
        if self.step == 4:  # checkpoint at 3, one more step done and lost
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        killed.run(progress=False)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = Trainer(_cfg(root, tmp_path / "b", **over), target, RegeneratedData(root))
    assert resumed.step == 3
    resumed.run(progress=False)
    for (k, v), (_, v2) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(v, v2), k


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["optim.stepz=3"], "unknown key"),
        (["optim.steps=abc"], "optim.steps"),
        (["nonsense"], "section.key=value"),
        (["method=medusa"], "method"),
        (["method=dcoco", "drafter.distill_weight=0.5"], "does not read it"),
        (["drafter.distill_weight=-1"], "distill_weight"),
    ],
)
def test_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


@pytest.mark.parametrize("bf16_units", [True, False])
def test_bf16_training_warns_on_a_cpu_without_bf16_matrix_units(monkeypatch, recwarn, bf16_units):
    """bf16 training on a CPU without AVX-512 BF16 or AMX gets a warning naming the float32 overrides;
    a float32 config, or a CPU with them, gets none."""
    from dcoco.train.run import warn_slow_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    warn_slow_bf16(load_config(None, []))
    warned = [str(w.message) for w in recwarn if "bf16 matrix" in str(w.message)]
    assert bool(warned) != bf16_units
    assert all("target.dtype=float32 optim.autocast_bf16=false" in m for m in warned)
    recwarn.clear()
    warn_slow_bf16(load_config(None, ["target.dtype=float32", "optim.autocast_bf16=false"]))
    assert not any("bf16 matrix" in str(w.message) for w in recwarn)


def test_every_training_config_loads_and_stage_configs_name_committed_paths():
    """configs/*.yaml (the RL one has its own schema) parse; a stage config continues committed
    checkpoints on the committed corpus, so every path it names is in the repository."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    configs = sorted(p for p in (root / "configs").glob("*.yaml") if not p.name.startswith("rl_"))
    assert len(configs) >= 8
    for path in configs:
        cfg = load_config(str(path))
        if path.stem.endswith("_stage"):
            data = cfg.data.path if isinstance(cfg.data.path, list) else [cfg.data.path]
            named = [*data, cfg.drafter.init_from, cfg.drafter.dcoco.corrector_from]
            for rel in filter(None, named):
                assert (root / rel).exists(), (path.name, rel)


def test_dcoco_warm_start_trains_the_corrector_alone(tiny_data, tmp_path):
    """method: dcoco from a DFlash checkpoint with train_backbone: false keeps the backbone exactly
    (so DCOCO without correction is that DFlash) and moves only the corrector."""
    target, root = tiny_data
    Trainer(_cfg(root, tmp_path / "dflash", **{"optim.steps": 3}), target, RegeneratedData(root)).run(progress=False)
    base, _ = load_trained(tmp_path / "dflash" / "drafter", dtype=torch.float32)[1:]
    over = {
        "optim.steps": 4,
        "drafter.init_from": str(tmp_path / "dflash" / "drafter"),
        "drafter.dcoco.train_backbone": False,
        **SMALL_CORRECTOR,
    }
    tr = Trainer(_cfg(root, tmp_path / "dcoco", method="dcoco", **over), target, RegeneratedData(root))
    tr.run(progress=False)
    got = tr.model.state_dict()
    for k, v in base.state_dict().items():
        assert torch.equal(got[k], v), k
    assert tr.model.corrector.out.weight.abs().sum() > 0
    # an inference default changed on the finished run is re-exported with the same weights
    Trainer(
        _cfg(root, tmp_path / "dcoco", method="dcoco", **over, **{"drafter.dcoco.sampled_walk": True}),
        target,
        RegeneratedData(root),
    ).run(progress=False)
    again, raw = load_trained(tmp_path / "dcoco" / "drafter")[1:]
    assert raw["dcoco_config"]["sampled_walk"] and again.dcfg.sampled_walk


def test_dcoco_backbone_trains_at_its_own_rate(tiny_data, tmp_path):
    """drafter.dcoco.backbone_lr_scale: joint training moves the backbone at that fraction of the
    corrector's rate all along the schedule, the groups survive a resume, and a frozen backbone
    with a rate of its own is refused."""
    target, root = tiny_data
    Trainer(_cfg(root, tmp_path / "dflash", **{"optim.steps": 2}), target, RegeneratedData(root)).run(progress=False)
    over = {
        "drafter.init_from": str(tmp_path / "dflash" / "drafter"),
        "drafter.dcoco.backbone_lr_scale": 0.1,
        **SMALL_CORRECTOR,
    }

    def check(tr: Trainer) -> None:
        rate = {id(p): (g["initial_lr"], g["lr"] / g["initial_lr"]) for g in tr.opt.param_groups for p in g["params"]}
        for name, p in tr.model.named_parameters():
            want = 3e-3 if name.startswith("corrector.") else 3e-4
            assert rate[id(p)][0] == pytest.approx(want), name
        assert len({round(r[1], 12) for r in rate.values()}) == 1  # the schedule scales every group alike

    out, data = tmp_path / "dcoco", RegeneratedData(root)
    tr = Trainer(_cfg(root, out, method="dcoco", **{"optim.steps": 10, **over}), target, data)
    check(tr)
    tr.run(progress=False)
    check(tr)
    tr = Trainer(_cfg(root, out, method="dcoco", **{"optim.steps": 12, **over}), target, data)
    assert tr.step == 10
    check(tr)
    with pytest.raises(ConfigError, match="backbone is frozen"):
        _cfg(root, out, method="dcoco", **over, **{"drafter.dcoco.train_backbone": False})
    with pytest.raises(ConfigError, match="saved optimizer does not match"):  # one rate now: two groups, not four
        Trainer(_cfg(root, out, method="dcoco", **{**over, "drafter.dcoco.backbone_lr_scale": 1.0}), target, data)


def test_dcoco_bigram_table_counts_every_training_answer_and_no_held_out_one(tiny_data, tmp_path):
    """drafter.dcoco.bigram: the table counts the neighbouring pairs of every training answer of
    data.path (not only the subset data.train_samples draws), none of a held-out one; a run
    continued from the checkpoint keeps it; it cannot be set by hand."""
    target, root = tiny_data
    Trainer(_cfg(root, tmp_path / "a", **{"optim.steps": 2}), target, RegeneratedData(root)).run(progress=False)
    over = {
        "optim.steps": 6,
        "data.train_samples": 3,
        "drafter.init_from": str(tmp_path / "a" / "drafter"),
        "drafter.dcoco.bigram": True,
        **SMALL_CORRECTOR,
    }
    tr = Trainer(_cfg(root, tmp_path / "c", method="dcoco", **over), target, RegeneratedData(root))
    full = Trainer(_cfg(root, tmp_path / "all"), target, RegeneratedData(root)).train_samples
    keys, counts = pair_counts(full, target.vocab_size)
    corr = tr.model.corrector
    assert (
        len(tr.train_samples) == 3
        and torch.equal(corr.bigram_keys, keys)
        and torch.equal(corr.bigram_counts, counts.int())
    )
    held = [s for s in RegeneratedData(root).samples() if s not in full]
    assert held and counts.sum() == sum(len(s["input_ids"]) - s["prompt_len"] for s in full)
    tr.run(progress=False)
    assert tr.model.corrector.w_g.weight.abs().sum() > 0  # it learns to read the table (from zero)
    more = {**over, "drafter.init_from": str(tmp_path / "c" / "drafter"), "data.train_samples": 2}
    again = Trainer(_cfg(root, tmp_path / "d", method="dcoco", **more), target, RegeneratedData(root)).model.corrector
    saved = load_trained(tmp_path / "c" / "drafter", dtype=torch.float32)[1].corrector
    assert torch.equal(again.bigram_keys, keys) and torch.equal(again.w_g.weight, saved.w_g.weight)
    with pytest.raises(ConfigError, match="set by training"):
        _cfg(root, tmp_path / "x", method="dcoco", **{"drafter.dcoco.bigram_pairs": 5})


def test_dcoco_corrector_moves_onto_the_next_stages_backbone(tiny_data, tmp_path):
    """drafter.dcoco.corrector_from puts a trained corrector on another DFlash (drafter.init_from):
    the backbone's weights come from the one, the corrector's from the other, widened where the
    settings ask, with its bigram table, and its evaluations onto the curve; a DCOCO checkpoint as
    the backbone, a DFlash one as the corrector, or a narrower shape is refused."""
    from dcoco.train.runstate import read_log
    from dcoco.train.trainer import CURVE_LOG

    target, root = tiny_data
    Trainer(_cfg(root, tmp_path / "a", **{"optim.steps": 2}), target, RegeneratedData(root)).run(progress=False)
    first = {
        "optim.steps": 3,
        "drafter.init_from": str(tmp_path / "a" / "drafter"),
        "drafter.dcoco.bigram": True,
        **SMALL_CORRECTOR,
    }
    Trainer(_cfg(root, tmp_path / "c", method="dcoco", **first), target, RegeneratedData(root)).run(progress=False)
    more = {"optim.steps": 2, "drafter.init_from": str(tmp_path / "a" / "drafter")}
    Trainer(_cfg(root, tmp_path / "b", **more), target, RegeneratedData(root)).run(progress=False)
    backbone, corrected = (load_trained(tmp_path / x / "drafter")[1] for x in ("b", "c"))
    moved = {
        "drafter.init_from": str(tmp_path / "b" / "drafter"),
        "drafter.dcoco.corrector_from": str(tmp_path / "c" / "drafter"),
    }
    on_next = Trainer(_cfg(root, tmp_path / "m", method="dcoco", **moved), target, RegeneratedData(root))
    got = on_next.model.state_dict()
    for k, v in backbone.state_dict().items():
        assert torch.equal(got[k], v), k
    # the corrector's evaluations come along onto the new backbone's curve, marked carried; the
    # backbone's own rows (here without a corrector) make the line
    own = [r for r in read_log(tmp_path / "c" / "drafter" / CURVE_LOG) if "eval_tau_dflash" in r]
    carried = [r for r in on_next.curve_rows() if r.get("carried")]
    assert own and [r["eval_tau_decode"] for r in carried] == [r["eval_tau_decode"] for r in own]
    assert all("stage" not in r and "loss" not in r for r in carried)
    assert not any("eval_tau_dflash" in r for r in on_next.curve_rows() if not r.get("carried"))
    assert corrected.dcfg.bigram_pairs > 0 and "bigram_keys" in dict(corrected.corrector.named_buffers())
    for k, v in corrected.corrector.state_dict().items():  # the table's buffers included
        assert torch.equal(got[f"corrector.{k}"], v), k
    assert not torch.equal(got["layers.0.mlp.up_proj.weight"], corrected.state_dict()["layers.0.mlp.up_proj.weight"])
    wider = {"drafter.dcoco.proj_dim": 12, "drafter.dcoco.hidden": 24}  # widened on the way (`Corrector.take`)
    wide = Trainer(_cfg(root, tmp_path / "w", method="dcoco", **moved, **wider), target, RegeneratedData(root)).model
    assert (wide.dcfg.proj_dim, wide.dcfg.hidden) == (12, 24)
    assert torch.equal(wide.corrector.w_ab.weight[:16, :8], corrected.corrector.w_ab.weight)
    assert torch.equal(wide.corrector.bigram_counts, corrected.corrector.bigram_counts)
    for bad in (
        {**moved, "drafter.init_from": moved["drafter.dcoco.corrector_from"]},
        {**moved, "drafter.dcoco.corrector_from": moved["drafter.init_from"]},
    ):
        with pytest.raises(ConfigError, match="corrector_from"):
            Trainer(_cfg(root, tmp_path / "x", method="dcoco", **bad), target, RegeneratedData(root))
    with pytest.raises(ConfigError, match="can widen, not narrow"):
        Trainer(
            _cfg(root, tmp_path / "x", method="dcoco", **moved, **{"drafter.dcoco.hidden": 8}),
            target,
            RegeneratedData(root),
        )


def test_default_draft_length_round_trips(tmp_path):
    target = tiny()
    cfg = DFlashConfig.for_target(target, num_layers=1, block_size=6, num_features=2)
    assert BlockDrafter(DFlashModel(cfg), target).default_num_tokens == 5
    cfg.num_speculative_tokens = 2
    save_dflash(tmp_path / "ck", DFlashModel(cfg))
    model, raw = load_trained(tmp_path / "ck")[1:]
    assert raw["dcoco_num_speculative_tokens"] == 2 and BlockDrafter(model, target).default_num_tokens == 2


def test_finished_run_started_again_reexports(tiny_data, tmp_path):
    target, root = tiny_data
    Trainer(_cfg(root, tmp_path / "run", **{"optim.steps": 2}), target, RegeneratedData(root)).run(progress=False)
    over = {"optim.steps": 2, "drafter.num_speculative_tokens": 3}
    tr = Trainer(_cfg(root, tmp_path / "run", **over), target, RegeneratedData(root))
    tr.run(progress=False)
    model, raw = load_trained(tmp_path / "run" / "drafter")[1:]
    assert tr.step == 2 and raw["dcoco_num_speculative_tokens"] == 3
    assert "dcoco_draft_vocab_size" not in raw and model.draft_ids is None  # vocabulary (96) <= 8192: none
    # a run saved without a draft vocabulary gets one on re-export: the most frequent response tokens
    tr = Trainer(
        _cfg(root, tmp_path / "run", **over, **{"drafter.draft_vocab_size": 20}), target, RegeneratedData(root)
    )
    tr.run(progress=False)
    model, raw = load_trained(tmp_path / "run" / "drafter")[1:]
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for s in tr.train_samples:
        counts += torch.bincount(torch.tensor(s["input_ids"][s["prompt_len"] :]), minlength=target.vocab_size)
    assert raw["dcoco_draft_vocab_size"] == 20 and model.draft_ids.numel() == 20
    assert counts[model.draft_ids].min() >= counts.sort(descending=True).values[19]


def test_online_features_match_stored_and_token_only_data_trains(tiny_data, tmp_path):
    """`data.features: online` recomputes, with one batched target forward, the features that
    regeneration stored (float32: equal up to rounding), so it trains on token-only data
    (`--no-features`) that stored mode refuses."""
    target, root = tiny_data
    stored = Trainer(_cfg(root, tmp_path / "s", **{"optim.steps": 1}), target, RegeneratedData(root))
    online = Trainer(
        _cfg(root, tmp_path / "o", **{"optim.steps": 1, "data.features": "online"}), target, RegeneratedData(root)
    )
    samples = stored.train_samples[:5]
    for a, b, s in zip(stored.features(samples), online.features(samples), samples):
        n = len(s["input_ids"]) - 1  # stored: every token but the last; online: every token
        assert a.shape == (n, b.shape[1]) and b.shape[0] == n + 1
        assert torch.allclose(a.float(), b[:n].float(), rtol=1e-2, atol=1e-2), (a - b[:n]).abs().max()  # stored in bf16

    tokens = tmp_path / "tokens"
    prompts = [Prompt(id=x["id"], messages=x["input_ids"][: x["prompt_len"]]) for x in RegeneratedData(root).samples()]
    regenerate(
        target,
        prompts,
        tokens,
        num_samples=40,
        taps=RegeneratedData(root).manifest["taps"],
        sampling=SamplingParams(max_tokens=24),
        batch_size=16,
        shard_size=8,
        progress=False,
        features=False,
    )
    data = RegeneratedData(tokens)
    assert not data.has_features and not list(data.features_dir.glob("*.safetensors"))
    assert {s["id"]: s["input_ids"] for s in data.samples()} == {
        s["id"]: s["input_ids"] for s in RegeneratedData(root).samples()
    }
    with pytest.raises(ConfigError, match="data.features=online"):
        Trainer(_cfg(tokens, tmp_path / "t"), target, data)
    from dcoco.train.data import RegeneratedUnion  # token-only and stored directories mix online

    tr = Trainer(
        _cfg([str(root), str(tokens)], tmp_path / "t", **{"optim.steps": 3, "data.features": "online"}),
        target,
        RegeneratedUnion([root, tokens]),
    )
    tr.run(progress=False)
    assert (tmp_path / "t" / "drafter" / "model.safetensors").exists()


def test_cached_features_are_the_online_ones_and_are_read_back(tiny_data, tmp_path, monkeypatch):
    """`data.features: cached` computes a sequence's features once, as online mode does, and later
    reads them from the cache directory (no target forward), in this run and in any later one."""
    target, root = tiny_data
    over = {"optim.steps": 1, "data.features": "cached", "data.feature_cache": str(tmp_path / "cache")}
    online_cfg = _cfg(root, tmp_path / "o", **{"optim.steps": 1, "data.features": "online"})
    online = Trainer(online_cfg, target, RegeneratedData(root))
    cached = Trainer(_cfg(root, tmp_path / "c", **over), target, RegeneratedData(root))
    samples = online.train_samples[:5]
    want = online.features(samples)
    for a, b in zip(want, cached.features(samples)):
        assert torch.equal(a, b)
    assert len(list((tmp_path / "cache").glob("*/*/*.safetensors"))) == 5

    def no_forward(*a, **k):
        raise AssertionError("the target ran on a cached sequence")

    monkeypatch.setattr(target, "prefill", no_forward)
    again = Trainer(_cfg(root, tmp_path / "d", **over), target, RegeneratedData(root))
    for a, b in zip(want, again.features(samples)):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="cached sequence"):
        again.features(online.train_samples[5:6])
    # a loss that also reads the target's last layer (DCOCO's T > 0 output) is served the same entries
    l1 = {"method": "dcoco", "drafter.dcoco.corrector_l1_weight": 1.0}
    with_last = Trainer(_cfg(root, tmp_path / "l", **over, **l1), target, RegeneratedData(root)).features(samples)
    monkeypatch.undo()
    online_over = {"optim.steps": 1, "data.features": "online"}
    online_last = Trainer(_cfg(root, tmp_path / "m", **online_over, **l1), target, RegeneratedData(root))
    for a, b in zip(with_last, online_last.features(samples)):
        assert a.shape[1] == b.shape[1] > want[0].shape[1] and torch.equal(a, b)


def test_packed_tokens_round_trip_append_and_train(tiny_data, tmp_path):
    """`dcoco data pack` keeps every sample's ids, prompt length and ending in 2 bytes per token;
    packing again appends only new samples as a new chunk (committed chunks never change); other
    sampling settings are refused; training reads the packed directory with online features."""
    from dcoco.train.data import RegeneratedUnion
    from dcoco.train.packed import PackedData, pack

    target, root = tiny_data
    first = tmp_path / "first"
    samples = RegeneratedData(root).samples()
    prompts = [Prompt(id=x["id"], messages=x["input_ids"][: x["prompt_len"]]) for x in samples]
    taps = RegeneratedData(root).manifest["taps"]
    regen = dict(taps=taps, sampling=SamplingParams(max_tokens=24), progress=False, features=False)
    regenerate(target, prompts, first, num_samples=25, **regen)
    out = tmp_path / "packed"
    m = pack([RegeneratedData(first)], out)
    assert len(m["chunks"]) == 1 and m["totals"]["samples"] == 25
    chunk0 = (out / "chunk-00000.safetensors").read_bytes()
    regenerate(target, prompts, first, num_samples=40, **regen)  # the regeneration goes on
    m = pack([RegeneratedData(first)], out)
    assert [c["samples"] for c in m["chunks"]] == [25, 15] and (out / "chunk-00000.safetensors").read_bytes() == chunk0
    assert pack([RegeneratedData(first)], out)["chunks"] == m["chunks"]  # nothing new: nothing appended
    with pytest.raises(ConfigError, match="packed already"):
        pack([RegeneratedData(out)], tmp_path / "twice")
    PackedData(out).verify()
    got = {s["id"]: s for s in PackedData(out).samples()}
    want = {s["id"]: s for s in RegeneratedData(first).samples()}
    assert got.keys() == want.keys()
    for k, s in want.items():
        assert got[k]["input_ids"] == s["input_ids"] and got[k]["prompt_len"] == s["prompt_len"]
        assert got[k]["finish_reason"] == s["finish_reason"]
    assert m["totals"]["prompt_tokens"] + m["totals"]["response_tokens"] == sum(
        len(s["input_ids"]) for s in want.values()
    )
    hot = tmp_path / "hot"
    regenerate(
        target, prompts[:2], hot, num_samples=2, **{**regen, "sampling": SamplingParams(temperature=1.0, max_tokens=24)}
    )
    with pytest.raises(ConfigError, match="temperature"):
        pack([RegeneratedData(hot)], out)
    (out / "chunk-00001.safetensors").write_bytes(b"changed")
    with pytest.raises(ConfigError, match="sha256"):
        PackedData(out).verify()
    (out / "chunk-00001.safetensors").unlink()
    pack([RegeneratedData(first)], tmp_path / "again")
    tr = Trainer(
        _cfg(str(tmp_path / "again"), tmp_path / "t", **{"optim.steps": 2, "data.features": "online"}),
        target,
        RegeneratedUnion([tmp_path / "again"]),
    )
    tr.run(progress=False)
    with pytest.raises(ConfigError, match="data.features=online"):
        Trainer(_cfg(str(tmp_path / "again"), tmp_path / "s"), target, RegeneratedUnion([tmp_path / "again"]))


def test_resume_with_a_reshaped_drafter_is_a_config_error(tiny_data, tmp_path):
    """A run resumed with a config that changes a weight's shape says so in one line."""
    target, root = tiny_data
    out = tmp_path / "run"
    Trainer(_cfg(root, out, **{"optim.steps": 1}), target, RegeneratedData(root)).run(progress=False)
    with pytest.raises(ConfigError, match="does not match the config"):
        Trainer(_cfg(root, out, **{"optim.steps": 2, "drafter.intermediate_size": 24}), target, RegeneratedData(root))


def test_time_budget_sets_the_steps_and_survives_resume(tiny_data, tmp_path):
    import json

    target, root = tiny_data
    over = {"optim.steps": 10_000, "optim.time_budget_s": 0.5, "optim.time_budget_probe": 3, "run.checkpoint_every": 2}
    tr = Trainer(_cfg(root, tmp_path / "r", **over), target, RegeneratedData(root))
    tr.run(progress=False)
    rows = [json.loads(l) for l in (tmp_path / "r" / "log.jsonl").read_text().splitlines()]
    fixed = [r["steps_from_time_budget"] for r in rows if "steps_from_time_budget" in r]
    assert len(fixed) == 1 and rows[-1]["step"] == fixed[0] == tr.cfg.optim.steps < 10_000
    cfg = json.loads((tmp_path / "r" / "drafter" / "config.json").read_text())["dcoco_training"]["config"]
    assert cfg["optim"]["steps"] == fixed[0]  # the provenance says how to repeat it: optim.steps=N
    again = Trainer(_cfg(root, tmp_path / "r", **over), target, RegeneratedData(root))
    assert again.cfg.optim.steps == fixed[0] and again.budget_fixed


@pytest.mark.parametrize("method", ["dflash", "dcoco"])
def test_drafter_overfits_every_slot_of_a_few_samples(tiny_data, tmp_path, method):
    """The pipeline can learn every drafted slot, not only the first: trained on 8 answers, the drafter
    drafts them back as decoding would walk them (blocks opened where the last one ended), nearly all
    of every block accepted (the small version of the 100-answer experiment in docs/experiments)."""
    from dcoco.train.evaluate import Evaluator, eval_markdown

    target, root = tiny_data
    few = tmp_path / "few"
    samples = RegeneratedData(root).samples()[:8]
    prompts = [Prompt(id=x["id"], messages=x["input_ids"][: x["prompt_len"]]) for x in samples]
    taps = RegeneratedData(root).manifest["taps"]
    regenerate(target, prompts, few, num_samples=8, taps=taps, sampling=SamplingParams(max_tokens=24), progress=False)
    over = {
        "method": method,
        "optim.steps": 150,
        "optim.batch_size": 8,
        "optim.anchors_per_seq": 32,
        "optim.lr": 1e-2,
        "optim.warmup_steps": 10,
        "optim.weight_decay": 0.0,
        "data.eval_permille": 0,
        "run.eval_every": 1000,
        "run.flops_every": 0,
        "drafter.draft_vocab_size": 100000,
    }
    if method == "dcoco":  # DCOCO trained jointly, a corrector sized for the tiny target
        over.update({"drafter.dcoco.proj_dim": 16, "drafter.dcoco.hidden": 32, "drafter.dcoco.top_k": 4})
    tr = Trainer(_cfg(few, tmp_path / "run", **over), target, RegeneratedData(few))
    tr.run(progress=False)
    tr.model.eval()
    got = Evaluator(tr.loss, tr.features, tr.train_samples, 1024).decoded(k=5, lengths=(2,))
    # at most 6 (5 drafts + the bonus token); a sample's last block is cut short by its end
    assert got["eval_tau_decode"] >= 5.4, got
    # the same drafts walked 2 at a time (at most 3 a pass), and the default length among the lengths
    by_length = got["decode_lengths"]
    assert by_length["5"] == {k: v for k, v in got.items() if k != "decode_lengths"}
    assert 2.6 <= by_length["2"]["eval_tau_decode"] <= 3.0 and len(by_length["2"]["eval_per_position_decode"]) == 2
    assert ("eval_tau_decode_dflash" in by_length["2"]) == (method == "dcoco")
    result = {"checkpoint": "c", "method": method, "samples": 8, "split": "all", "t0": {**got, "eval_tau": 1}}
    md = eval_markdown(result)
    assert f"| 2 | {by_length['2']['eval_tau_decode']:.3f} |" in md and "| 5 |" in md


def test_draft_vocab_loss_is_the_cross_entropy_over_the_draft_vocabulary():
    """`drafter.draft_vocab_loss`: while training, the loss equals the cross-entropy of the full
    logits restricted to the draft vocabulary, labels outside it carrying no loss; gradients match;
    in evaluation the full logits come back as before."""
    import torch.nn.functional as F

    from dcoco.train.losses import DrafterLoss

    target = tiny()
    model = tiny_dflash(target, seed=3)
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:30].sort().values
    model.set_draft_vocab(ids)
    S, T = 2, 20
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(target.vocab_size, (S, T), generator=gen)
    seqs[0, 5:12] = ids[torch.randint(len(ids), (7,), generator=gen)]  # some labels inside the draft vocabulary
    samples = [{"input_ids": s.tolist(), "prompt_len": 3} for s in seqs]
    feats = [torch.randn(T, 2 * target.hidden_size, generator=gen) for _ in range(S)]
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    fast = DrafterLoss(model, embed, head, 4.0, draft_vocab_loss=True)
    full = DrafterLoss(model, embed, head, 4.0)
    b = fast.batch_at(samples, feats, [[3, 4, 6, 9], [5, 8]])
    model.train()
    loss, extras = fast(b)
    assert "logits" not in extras
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    h = full.hidden(b)
    logits = F.linear(h[:, :, 1:], head.weight[ids])
    inside = torch.isin(b.labels, ids)
    labels = torch.where(inside, torch.searchsorted(ids, b.labels.clamp(min=0)), torch.full_like(b.labels, -100))
    want = full.loss_from_logits(logits, labels)
    assert inside.any() and (~inside & (b.labels >= 0)).any()
    torch.testing.assert_close(loss, want)
    ref = torch.autograd.grad(want, [p for p in model.parameters() if p.requires_grad])
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
    model.eval()
    assert fast(b)[1]["logits"].shape[-1] == target.vocab_size


def test_distill_weight_adds_the_cross_entropy_against_the_targets_t1_distribution():
    """`drafter.distill_weight`: the loss gains w x sum_x -p(x) log q(x) at every labelled slot, p the
    target's T=1 distribution of that slot's token (its final norm and LM head on the last-layer
    feature of the position before), renormalised over the draft vocabulary, weighted like the labels."""
    import torch.nn.functional as F

    from dcoco.train.losses import DrafterLoss, TargetHead

    target = tiny()
    model = tiny_dflash(target, seed=3)
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:30].sort().values
    model.set_draft_vocab(ids)
    H, S, T = target.hidden_size, 2, 20
    gen = torch.Generator().manual_seed(0)
    samples = [
        {"input_ids": s.tolist(), "prompt_len": 3} for s in torch.randint(target.vocab_size, (S, T), generator=gen)
    ]
    feats = [torch.randn(T, 3 * H, generator=gen) for _ in range(S)]  # two taps, then the last layer
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    parts = (model, embed, head, 4.0, 2 * H, TargetHead(target), True)
    plain, distilled = DrafterLoss(*parts), DrafterLoss(*parts, distill_weight=0.7)
    b = plain.batch_at(samples, feats, [[3, 4, 16, 18], [5, 8]])
    model.train()
    h = plain.hidden(plain.drafter_features(b))
    q = torch.log_softmax(F.linear(h[:, :, 1:], head.weight[ids]).float(), -1)  # (S, A, P, n)
    num = den = 0.0
    w = plain.weights
    for s, anchors in enumerate([[3, 4, 16, 18], [5, 8]]):
        for a_i, a in enumerate(anchors):
            for j in range(q.shape[2]):
                if b.labels[s, a_i, j] < 0:
                    continue
                x = target.model.model.norm(feats[s][a + j, 2 * H :])
                p = torch.softmax(F.linear(x, head.weight[ids]).float(), -1)
                num = num - w[j] * (p * q[s, a_i, j]).sum()
                den = den + w[j]
    assert (b.labels < 0).any()  # blocks cut by the sequence's end
    torch.testing.assert_close(distilled(b)[0] - plain(b)[0], 0.7 * num / den)
    with pytest.raises(ConfigError, match="last layer"):
        DrafterLoss(model, embed, head, 4.0, draft_vocab_loss=True, distill_weight=0.5)


def test_a_continued_stage_extends_the_count_of_sequences_seen(tiny_data, tmp_path):
    """A stage warm-started from an exported drafter (`drafter.init_from`) counts the sequences of
    the earlier stage: its log and provenance extend one curve (sequences seen on the x axis), and
    its exported drafter carries both stages' rows (a third stage extends the same curve)."""
    import json

    from dcoco.train.runstate import read_log
    from dcoco.train.trainer import CURVE_LOG

    target, root = tiny_data
    first = Trainer(_cfg(root, tmp_path / "a", **{"optim.steps": 3}), target, RegeneratedData(root))
    first.run(progress=False)
    prov = json.loads((tmp_path / "a" / "drafter" / "config.json").read_text())["dcoco_training"]
    assert prov["samples_seen"] == 3 * 4
    over = {"optim.steps": 2, "drafter.init_from": str(tmp_path / "a" / "drafter")}
    Trainer(_cfg(root, tmp_path / "b", **over), target, RegeneratedData(root)).run(progress=False)
    rows = read_log(tmp_path / "b" / "log.jsonl")
    assert [r["samples_seen"] for r in rows] == [16, 20]
    prov = json.loads((tmp_path / "b" / "drafter" / "config.json").read_text())["dcoco_training"]
    assert prov["samples_seen"] == 20
    curve = read_log(tmp_path / "b" / "drafter" / CURVE_LOG)
    assert [(r["stage"], r["samples_seen"]) for r in curve] == [(1, 4), (1, 8), (1, 12), (2, 16), (2, 20)]
    assert (tmp_path / "b" / "curve.png").stat().st_size > 0
    # a checkpoint without a curve (shipped before curves travelled): its evaluation opens the new one
    (tmp_path / "a" / "drafter" / CURVE_LOG).unlink()
    Trainer(_cfg(root, tmp_path / "c", **over), target, RegeneratedData(root)).run(progress=False)
    curve = read_log(tmp_path / "c" / "drafter" / CURVE_LOG)
    assert [(r["stage"], r["samples_seen"]) for r in curve] == [(0, 12), (1, 16), (1, 20)]
    assert "eval_tau_decode" in curve[0] and "loss" not in curve[0]


def test_a_warm_start_keeps_its_block_unless_the_run_sets_one(tiny_data, tmp_path):
    """The block size shapes no weight: a stage may continue a drafter with a smaller block (more
    anchors for the same work on the slots that are drafted). Unset, the checkpoint's is kept."""
    target, root = tiny_data
    Trainer(_cfg(root, tmp_path / "a", **{"optim.steps": 2}), target, RegeneratedData(root)).run(progress=False)
    start = load_trained(tmp_path / "a" / "drafter", dtype=torch.float32)[1]
    warm = {"optim.steps": 1, "drafter.init_from": str(tmp_path / "a" / "drafter")}
    kept = Trainer(_cfg(root, tmp_path / "b", **warm, **{"drafter.block_size": "null"}), target, RegeneratedData(root))
    assert kept.model.cfg.block_size == 6
    small = Trainer(_cfg(root, tmp_path / "c", **warm, **{"drafter.block_size": 4}), target, RegeneratedData(root))
    assert small.model.cfg.block_size == 4 and small.model.max_draft == 3
    for k, v in start.state_dict().items():
        assert torch.equal(small.model.state_dict()[k], v), k
    small.run(progress=False)
    assert load_trained(tmp_path / "c" / "drafter")[1].cfg.block_size == 4


def test_wsd_schedule_holds_the_rate_then_decays_and_exports_the_drafter_before_the_decay(tiny_data, tmp_path):
    """`optim.schedule=wsd`: warm-up, the peak rate held, a linear decay to `min_lr_ratio` over the last
    `decay_fraction` of the steps; `run.out/stable` holds the drafter as it was when the decay began
    (the point a next stage continues from), with the sequences and curve rows up to that step, and the
    evaluations past it marked `decayed` (so the next stage's curve keeps this stage's evaluated end)."""
    import json

    from dcoco.train.plots import training_curve
    from dcoco.train.runstate import read_log
    from dcoco.train.trainer import CURVE_LOG

    target, root = tiny_data
    over = {"optim.steps": 12, "optim.warmup_steps": 2, "optim.schedule": "wsd", "optim.decay_fraction": 0.25}
    tr = Trainer(_cfg(root, tmp_path / "w", **over), target, RegeneratedData(root))
    tr.run(progress=False)
    lr = [r["lr"] for r in read_log(tmp_path / "w" / "log.jsonl")]  # the rate of the next step
    assert lr[1:8] == pytest.approx([3e-3] * 7)  # steps 2..8 at the peak: the decay starts at step 9
    assert lr[8:11] == pytest.approx([2.1e-3, 1.2e-3, 3e-4])  # steps 9, 10, 11: the last one at the floor
    stable = tmp_path / "w" / "stable"
    assert json.loads((stable / "config.json").read_text())["dcoco_training"]["samples_seen"] == 9 * 4
    curve = read_log(stable / CURVE_LOG)
    assert [r["step"] for r in curve] == list(range(1, 10)) + [12]
    assert [r.get("decayed", False) for r in curve] == [False] * 9 + [True] and "eval_tau_decode" in curve[-1]
    assert training_curve(curve, tmp_path / "curve.png").stat().st_size > 0
    decayed = Trainer(
        _cfg(root, tmp_path / "x", **{"drafter.init_from": str(tmp_path / "w" / "drafter")}),
        target,
        RegeneratedData(root),
    )
    held = Trainer(_cfg(root, tmp_path / "y", **{"drafter.init_from": str(stable)}), target, RegeneratedData(root))
    assert held.samples_before == 36 and decayed.samples_before == 48
    assert held.earlier[-1]["decayed"] and held.earlier[-1]["samples_seen"] == 48  # the next curve keeps the end
    differ = [not torch.equal(a, b) for a, b in zip(held.model.parameters(), decayed.model.parameters())]
    assert any(differ)  # the stable export is not the last step's drafter
