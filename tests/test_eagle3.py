"""EAGLE-3: layer ids, draft vocabulary (d2t / t2d), training-time test = inference chain, TTT loss,
per-request state, losslessness, training, checkpoints."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import engine_lossless_pvalue, random_prompts, tiny_target

from dcoco import SamplingParams
from dcoco.drafters.base import DraftInput
from dcoco.drafters.checkpoint import load_checkpoint, save_checkpoint
from dcoco.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Model,
    default_eagle_layer_ids,
    save_eagle3,
)
from dcoco.drafters.lookup_first import LookupFirst
from dcoco.engine import SpeculativeEngine
from dcoco.families import load_trained
from dcoco.speculative import SpeculativeConfig, load_drafter
from dcoco.train.batch import top_tokens
from dcoco.train.config import load_config
from dcoco.train.data import Prompt, RegeneratedData, regenerate
from dcoco.train.losses import TargetHead
from dcoco.train.losses.eagle3 import Eagle3Loss, make_eagle3_batch, ttt_weights
from dcoco.train.trainer import Trainer

LAYERS = 6
IDS = [0, 2, 4]  # 0-based decoder-layer ids -> taps 1, 3, 5


def tiny(**over):
    return tiny_target("llama", seed=11, num_hidden_layers=LAYERS, initializer_range=0.15, **over)


def eagle_model(target, seed=0, draft_vocab=64, vocab_seed=1) -> Eagle3Model:
    torch.manual_seed(seed)
    model = Eagle3Model(Eagle3Config.for_target(target, IDS, draft_vocab_size=draft_vocab)).float().eval()
    g = torch.Generator().manual_seed(vocab_seed)
    model.set_vocab(torch.randperm(target.vocab_size, generator=g)[: model.cfg.draft_vocab_size])
    for p in model.parameters():  # larger weights: the drafter's choices depend on its inputs
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.15)
    return model


def features(target, ids: list[int]) -> torch.Tensor:
    """(len, 4H): taps 1, 3, 5 and the last layer's output (before the final norm), as regenerated data."""
    cap = {}
    h = target.model.model.layers[-1].register_forward_hook(
        lambda m, i, o: cap.setdefault("x", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    h.remove()
    return torch.cat([out.hidden_states[t] for t in (1, 3, 5)] + [cap["x"]], -1)[0]


def test_layer_ids_and_config_fields():
    assert default_eagle_layer_ids(30) == [1, 14, 26]  # SpecForge's default [1, L/2 - 1, L - 4]
    assert default_eagle_layer_ids(30, [2, 9, 15, 21, 28, 30]) == [1, 14, 27]  # regenerated SmolLM2 taps
    assert default_eagle_layer_ids(36, [2, 10, 18, 26, 34, 36]) == [1, 17, 33]
    with pytest.raises(ValueError):
        default_eagle_layer_ids(30, [2, 30])
    target = tiny()
    cfg = Eagle3Config.for_target(target, IDS, draft_vocab_size=64)
    assert cfg.taps == (1, 3, 5)
    hf = cfg.to_hf()
    assert (
        hf["architectures"] == ["LlamaForCausalLMEagle3"]
        and hf["draft_vocab_size"] == 64
        and hf["num_hidden_layers"] == 1
    )
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # SpecForge / SGLang: output of layer i
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # vLLM: input of layer i = hidden_states[i]
    assert Eagle3Config.from_hf(hf) == cfg
    vllm_only = {k: v for k, v in hf.items() if k != "eagle_config"}
    assert Eagle3Config.from_hf(vllm_only).layer_ids == IDS


def test_draft_vocabulary_d2t_t2d():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    ids = top_tokens(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]  # most frequent, ties by lower id, sorted by id
    target = tiny()
    model = Eagle3Model(Eagle3Config.for_target(target, IDS, draft_vocab_size=4))
    model.set_vocab(torch.tensor([50, 3, 17, 90]))
    assert model.d2t.tolist() == [3 - 0, 17 - 1, 50 - 2, 90 - 3]  # target = draft + d2t[draft]
    assert model.draft_to_target.tolist() == [3, 17, 50, 90]
    assert model.t2d.nonzero().squeeze(1).tolist() == [3, 17, 50, 90] and model.t2d.sum() == 4
    assert model.d2t.dtype == torch.long and model.t2d.dtype == torch.bool
    model.init_lm_head_from(target.model.get_output_embeddings())
    assert torch.equal(model.lm_head.weight[1], target.model.get_output_embeddings().weight[17])
    with pytest.raises(ValueError):
        model.set_vocab(torch.tensor([1, 1, 2, 3]))


def test_training_time_test_equals_inference_chain():
    """Step j of the unroll at the last committed slot is exactly drafting step j: same q."""
    target = tiny()
    model = eagle_model(target)
    prompt = [(3 * i + 1) % target.vocab_size for i in range(9)]
    f = features(target, prompt)
    H = target.hidden_size
    k = 6
    inp = DraftInput(
        [0], [prompt], [f[:-1, : 3 * H]], k, [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(4)]
    )
    out = Eagle3Drafter(model, target).propose(inp)
    ids = prompt + out.tokens[0].tolist()
    feats = torch.zeros(len(ids), 4 * H)
    feats[: len(prompt)] = f
    b = make_eagle3_batch([{"input_ids": ids, "prompt_len": 2}], [feats], k)
    embed = target.model.get_input_embeddings()
    t = len(prompt) - 2
    with torch.no_grad():
        outs = model.unroll(embed, b.ids, b.feats[..., : 3 * H], k)
    for j in range(k):
        q = torch.softmax(model.logits(outs[j][0, t]), -1)
        assert torch.allclose(q, out.probs[0, j, model.draft_to_target], atol=1e-5), j
    # sampled start slots give the same chains as unrolling every slot
    slots = torch.tensor([[t, 2, -1, 5]])
    with torch.no_grad():
        sub = model.unroll(embed, b.ids, b.feats[..., : 3 * H], k, slots)
    for j in range(k):
        for a, st in enumerate([t, 2, 0, 5]):
            assert torch.allclose(sub[j][0, a], outs[j][0, st], atol=1e-5)
    # no slot sees the future: features after slot t and tokens after t + k leave slots <= t unchanged
    b.feats[0, t + 1 :] += 3.0
    b.ids[0, t + 1 + k :] = (b.ids[0, t + 1 + k :] + 1) % target.vocab_size
    with torch.no_grad():
        outs2 = model.unroll(embed, b.ids, b.feats[..., : 3 * H], k)
    for j in range(k):
        assert torch.allclose(outs[j][0, : t + 1], outs2[j][0, : t + 1], atol=1e-5)


def test_ttt_loss_restricted_soft_ce_and_decay():
    target = tiny()
    model = eagle_model(target)
    model.train()
    H = target.hidden_size
    ids = [(5 * i + 2) % target.vocab_size for i in range(24)]
    loss_fn = Eagle3Loss(
        model, target.model.get_input_embeddings(), TargetHead(target), split=3 * H, steps=7, decay=0.8
    )
    assert torch.allclose(loss_fn.weights, torch.tensor([0.8**j for j in range(7)]))
    assert torch.allclose(ttt_weights(3, 0.5), torch.tensor([1.0, 0.5, 0.25]))
    b = loss_fn.make_batch([{"input_ids": ids, "prompt_len": 5}], [features(target, ids)[:-1]], 0, None)
    loss, ex = loss_fn(b)
    m = ex["metrics"]
    steps = sorted(int(k.split("_")[-1]) for k in m if k.startswith("ttt_loss_"))
    assert loss.item() == pytest.approx(sum(0.8**j * m[f"ttt_loss_{j}"] for j in steps), rel=1e-5)
    # step 0 by hand: soft CE against the target's distribution restricted to the draft vocabulary
    with torch.no_grad():
        tl = target.model(torch.tensor([ids])).logits[0].float()
        h0 = model.unroll(target.model.get_input_embeddings(), b.ids, b.feats[..., : 3 * H], 1)[0][0]
    rows = model.draft_to_target
    terms = []
    for t in range(len(ids) - 2):
        nxt = ids[t + 2]
        if t + 2 >= 5 and model.t2d[nxt]:
            p = torch.softmax(tl[t + 1, rows], -1)
            logq = torch.log_softmax(model.logits(h0[t]).float(), -1)
            terms.append(-(p * logq).sum())
    assert m["ttt_loss_0"] == pytest.approx(torch.stack(terms).mean().item(), rel=1e-4)
    loss.backward()
    assert model.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0 and model.fc.weight.grad.abs().sum() > 0


def _inp(target, lens, k, params=None, rids=None):
    torch.manual_seed(1)
    seqs = [[(7 * i + 3 + n) % target.vocab_size for i in range(n + 1)] for n in lens]
    feats = [features(target, s)[:-1, : 3 * target.hidden_size] for s in seqs]
    params = params or [SamplingParams()] * len(lens)
    return DraftInput(
        rids or list(range(len(lens))),
        seqs,
        feats,
        k,
        params,
        [torch.Generator().manual_seed(i) for i in range(len(lens))],
    )


def test_requests_batched_incremental_and_released():
    target = tiny()
    model = eagle_model(target)
    inp = _inp(target, [4, 11, 7], 5)
    d = Eagle3Drafter(model, target)
    batch = d.propose(inp)
    assert batch.tokens.shape == (3, 5) and batch.lengths.tolist() == [5, 5, 5] and batch.probs is None
    for i in range(3):
        solo = DraftInput([7], [inp.token_ids[i]], [inp.new_features[i]], 5, inp.params[:1], inp.generators[:1])
        assert torch.equal(Eagle3Drafter(model, target).propose(solo).tokens[0], batch.tokens[i])
    # features arriving in two calls give the state one call would
    seq, f = inp.token_ids[1], inp.new_features[1]
    inc = Eagle3Drafter(model, target)
    inc.propose(DraftInput([3], [seq[:6]], [f[:5]], 2, inp.params[:1], inp.generators[:1]))
    two = inc.propose(DraftInput([3], [seq], [f[5:]], 5, inp.params[:1], inp.generators[:1]))
    assert torch.equal(two.tokens[0], batch.tokens[1])
    assert torch.allclose(inc.state[3].k, d.state[1].k, atol=1e-5) and inc.state[3].n == d.state[1].n == 11
    with pytest.raises(RuntimeError):
        inc.propose(DraftInput([3], [seq + [1, 2]], [f[:1]], 2, inp.params[:1], inp.generators[:1]))
    d.release(1)
    assert set(d.state) == {0, 2}


def test_q_is_a_full_vocabulary_distribution():
    target = tiny()
    model = eagle_model(target)
    params = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(), SamplingParams(temperature=1.3, top_p=0.8)]
    out = Eagle3Drafter(model, target).propose(_inp(target, [4, 11, 7], 4, params))
    assert out.probs.shape == (3, 4, target.vocab_size)
    assert torch.allclose(out.probs.sum(-1), torch.ones(3, 4))
    assert (out.probs[:, :, ~model.t2d] == 0).all()  # nothing outside the draft vocabulary
    assert model.t2d[out.tokens].all()
    picked = out.probs.gather(2, out.tokens.unsqueeze(2)).squeeze(2)
    assert (picked > 0).all() and (out.probs[1] == torch.nn.functional.one_hot(out.tokens[1], target.vocab_size)).all()
    assert ((out.probs[0] > 0).sum(-1) <= 20).all()  # the request's own top-k applies to q


def test_greedy_equality_with_vanilla():
    target = tiny()
    prompts = random_prompts(3, target.vocab_size, seed=3)
    sp = SamplingParams(max_tokens=24)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    outs, st = SpeculativeEngine(target, Eagle3Drafter(eagle_model(target, seed=5), target), 4).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and st.drafted > 0
    # with prompt lookup first: the steps it drafts still feed the drafter's state (absorb), whose
    # own check (one committed feature per token) would fail on a gap
    first = LookupFirst(Eagle3Drafter(eagle_model(target, seed=5), target), min_match=2)
    repeated = [p + p for p in prompts]
    vanilla, _ = SpeculativeEngine(target).generate(repeated, sp)
    outs, _ = SpeculativeEngine(target, first, 4).generate(repeated, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and first.looked_up and first.drafted


V = 5


def test_sampling_is_lossless():
    target = tiny_target("llama", seed=21, num_hidden_layers=LAYERS, vocab_size=V, initializer_range=0.08)
    torch.manual_seed(3)
    model = Eagle3Model(Eagle3Config.for_target(target, IDS, draft_vocab_size=4)).float().eval()
    model.set_vocab(torch.tensor([0, 1, 2, 4]))  # token 3 can never be drafted: q(3) = 0
    for p in model.parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.3)
    drafter = Eagle3Drafter(model, target)
    pvalue, stats = engine_lossless_pvalue(target, drafter, SamplingParams(temperature=1.0), seed=3)
    assert 0 < stats.accepted < stats.drafted and not drafter.state
    assert pvalue > 1e-3


def test_checkpoint_round_trip_and_vllm_layout(tmp_path):
    target = tiny()
    model = eagle_model(target)
    save_eagle3(tmp_path / "ck", model, dtype=torch.float32)
    loaded, raw = load_trained(tmp_path / "ck")[1:]
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    _, state = load_checkpoint(tmp_path / "ck")
    assert (
        state["d2t"].dtype == torch.int64
        and state["t2d"].dtype == torch.bool
        and "midlayer.hidden_norm.weight" in state
    )
    assert state["midlayer.self_attn.q_proj.weight"].shape == (
        model.cfg.num_attention_heads * model.cfg.head_dim,
        2 * target.hidden_size,
    )
    # a vLLM-style directory: layers.0.* names, no t2d, only the top-level layer ids
    cfg = {k: v for k, v in raw.items() if k != "eagle_config"}
    st = {
        ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
        for k, v in state.items()
        if k != "t2d"
    }
    save_checkpoint(tmp_path / "vllm", cfg, st, torch.float32)
    again, _ = load_trained(tmp_path / "vllm")[1:]
    assert again.cfg.layer_ids == IDS and torch.equal(again.t2d, model.t2d)
    assert torch.equal(again.midlayer.mlp.up_proj.weight, model.midlayer.mlp.up_proj.weight)
    assert isinstance(
        load_drafter(SpeculativeConfig(method="eagle3", model=str(tmp_path / "ck")), target), Eagle3Drafter
    )


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = tiny()
    root = tmp_path_factory.mktemp("regen-eagle3")
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
        taps=[1, 3, 5, 6],
        sampling=SamplingParams(max_tokens=24),
        batch_size=20,
        shard_size=20,
        progress=False,
    )
    return target, root


def test_training_loss_falls_and_exports(tiny_data, tmp_path):
    target, root = tiny_data
    over = {
        "method": "eagle3",
        "data.path": str(root),
        "run.out": str(tmp_path / "run"),
        "optim.steps": 30,
        "optim.batch_size": 4,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 5,
        "optim.autocast_bf16": False,
        "drafter.draft_vocab_size": 48,
        "drafter.eagle3.ttt_slots": 8,
        "data.eval_samples": 6,
        "data.eval_permille": 200,
        "run.eval_every": 15,
        "run.checkpoint_every": 30,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    tr = Trainer(cfg, target, RegeneratedData(root))
    assert isinstance(tr.model, Eagle3Model) and tr.model.cfg.layer_ids == [0, 2, 4]  # picked from the data's taps
    # the draft vocabulary holds the most frequent response tokens of the training split
    freq = torch.zeros(target.vocab_size, dtype=torch.long)
    for s in tr.train_samples:
        freq += torch.bincount(torch.tensor(s["input_ids"][s["prompt_len"] :]), minlength=target.vocab_size)
    assert freq[tr.model.t2d].min() >= freq[~tr.model.t2d].max()
    tr.run(progress=False)
    rows = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    ev = [r for r in rows if "eval_tau" in r]
    assert ev and ev[-1]["eval_tau"] >= 1.0 and len(ev[-1]["eval_per_position"]) <= 7
    ck = tmp_path / "run" / "drafter"
    raw = json.loads((ck / "config.json").read_text())
    assert raw["draft_vocab_size"] == 48 and raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    drafter = load_drafter(SpeculativeConfig(method="eagle3", model=str(ck)), target)
    assert drafter.default_num_tokens == 7
    prompts = random_prompts(2, target.vocab_size)
    sp = SamplingParams(max_tokens=12)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    outs, _ = SpeculativeEngine(target, drafter).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]


def test_online_features_train_like_stored(tiny_data, tmp_path):
    """data.features=online (target forward per batch) gives the first step's loss of stored features."""
    target, root = tiny_data
    losses = []
    for mode in ("stored", "online"):
        over = {
            "method": "eagle3",
            "data.path": str(root),
            "run.out": str(tmp_path / mode),
            "optim.steps": 1,
            "optim.autocast_bf16": False,
            "drafter.draft_vocab_size": 48,
            "drafter.eagle3.ttt_slots": 8,
            "data.features": mode,
        }
        cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
        losses.append(Trainer(cfg, target, RegeneratedData(root)).train_step()["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)
