"""Zigzag ring attention and branch attention against a dense single-process reference.

One job of 4 gloo processes runs every check for W = 1, 2, 3, 4 on sub-groups
(W=2 uses global ranks [2, 3] and W=3 uses [1, 2, 3], so group ranks differ from
global ranks), in float64, with GQA (4 query heads, 2 kv heads) and packed
sequences whose lengths are not multiples of 2W (W=4 has empty chunks).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from parallel_harness import guarded, merge_ranks, metrics_of, run_job

GROUPS = {1: [3], 2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}
SEQLENS = [13, 7, 20]
H, HKV, D = 4, 2, 8
TOL = 1e-10
SCALE = 1.0 / math.sqrt(D)


# ----------------------------------------------------------------- reference
def dense_reference(q, k, v, mask):
    """Masked softmax attention written from scratch; rows without keys give 0."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * SCALE
    s = s.masked_fill(~mask, float("-inf"))
    mx = s.amax(-1, keepdim=True).detach()
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("hqk,khd->qhd", p, vv)
    lse = (torch.log(den) + mx).squeeze(-1).transpose(0, 1)
    return out, lse


def packed_meta():
    lens = torch.tensor(SEQLENS)
    seq = torch.repeat_interleave(torch.arange(len(SEQLENS)), lens)
    pos = torch.cat([torch.arange(n) for n in SEQLENS])
    return seq, pos


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def max_err(a, b):
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


# -------------------------------------------------------------------- checks
def check_causal(W, r, group, seed):
    from dcoco.parallel import ZigzagLayout, zigzag_ring_attention

    gen = torch.Generator().manual_seed(seed)
    T = sum(SEQLENS)
    q, k, v = rand(gen, T, H, D), rand(gen, T, HKV, D), rand(gen, T, HKV, D)
    wgt = rand(gen, T, H, D)
    seq, pos = packed_meta()
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    gq, gk, gv = leaf(q), leaf(k), leaf(v)
    ref, ref_lse = dense_reference(gq, gk, gv, mask)
    ref_g = grads((ref * wgt).sum(), (gq, gk, gv))

    layout = ZigzagLayout(SEQLENS, W)
    ix = layout.local_indices(r)
    lq, lk, lv = leaf(q[ix]), leaf(k[ix]), leaf(v[ix])
    out, lse = zigzag_ring_attention(lq, lk, lv, layout, group=group)
    got_g = grads((out * wgt[ix]).sum(), (lq, lk, lv))
    return {
        "fwd": max_err(out, ref[ix]),
        "lse": max_err(lse, ref_lse[ix]),
        "grad": max(max_err(a, b[ix]) for a, b in zip(got_g, ref_g)),
        "finite": bool(torch.isfinite(out).all()),
    }


DFLASH_BLOCKS = [  # (sequence, anchor, valid tokens)
    (0, 0, 0),  # fully masked: strict prefix of position 0 is empty and no valid token
    (0, 5, 4),
    (0, 12, 1),
    (1, 3, 4),
    (1, 6, 2),
    (2, 0, 4),  # no main keys with a strict prefix, only its own block
    (2, 10, 3),
    (2, 19, 4),
    (2, 15, 0),  # padding-only block
]
B = 4


# both blocks anchored in chunk 0 of sequence 2: rank 0 owns every query, the
# other ranks hold none and must still relay K/V and dK/dV
SPARSE_BLOCKS = [(2, 1, 4), (2, 1, 2)]


def check_dflash(W, r, group, seed, include_anchor, blocks=DFLASH_BLOCKS):
    from dcoco.parallel import ZigzagLayout, branch_attention, branch_owners, dflash_spec, expand_blocks

    gen = torch.Generator().manual_seed(seed)
    T = sum(SEQLENS)
    nb = len(blocks)
    k, v = rand(gen, T, HKV, D), rand(gen, T, HKV, D)
    bq, bk, bv = rand(gen, nb * B, H, D), rand(gen, nb * B, HKV, D), rand(gen, nb * B, HKV, D)
    wgt = rand(gen, nb * B, H, D)
    bseq = torch.tensor([b[0] for b in blocks])
    anch = torch.tensor([b[1] for b in blocks])
    valid = torch.tensor([b[2] for b in blocks])

    # reference mask from the definition, keys = [main | branch]
    seq, pos = packed_meta()
    blk = torch.arange(nb).repeat_interleave(B)
    j = torch.arange(B).repeat(nb)
    qvalid = j < valid[blk]
    lim = anch[blk] if include_anchor else anch[blk] - 1
    m_main = (seq[None, :] == bseq[blk][:, None]) & (pos[None, :] <= lim[:, None]) & qvalid[:, None]
    m_br = (blk[None, :] == blk[:, None]) & qvalid[None, :] & qvalid[:, None]
    mask = torch.cat([m_main, m_br], 1)
    gk, gv, gbq, gbk, gbv = map(leaf, (k, v, bq, bk, bv))
    ref, ref_lse = dense_reference(gbq, torch.cat([gk, gbk]), torch.cat([gv, gbv]), mask)
    ref_g = grads((ref * wgt).sum(), (gk, gv, gbq, gbk, gbv))
    empty_rows = ~mask.any(1)

    layout = ZigzagLayout(SEQLENS, W)
    ix = layout.local_indices(r)
    mine = (branch_owners(layout, bseq, anch) == r).nonzero().squeeze(1)
    tix = expand_blocks(mine, B)
    spec = dflash_spec(bseq[mine], anch[mine], B, valid_lens=valid[mine], include_anchor=include_anchor)
    lk, lv, lbq, lbk, lbv = leaf(k[ix]), leaf(v[ix]), leaf(bq[tix]), leaf(bk[tix]), leaf(bv[tix])
    out = branch_attention(lbq, lbk, lbv, lk, lv, spec, layout, group=group)
    got_g = grads((out * wgt[tix]).sum(), (lk, lv, lbq, lbk, lbv))
    idx = [ix, ix, tix, tix, tix]
    er = empty_rows[tix]
    return {
        "fwd": max_err(out, ref[tix]),
        "grad": max(max_err(a, b[i]) for a, b, i in zip(got_g, ref_g, idx)),
        "finite": bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in got_g),
        "masked_rows_max_abs": float(out.detach()[er].abs().max()) if er.any() else 0.0,
        "masked_rows_grad_max_abs": float(got_g[2][er].abs().max()) if er.any() else 0.0,
        "n_masked_rows": int(er.sum()),
        "n_blocks": int(mine.numel()),
        "min_blocks": -int(mine.numel()),  # merge_ranks keeps the max, i.e. minus the minimum
    }


K_STEPS = 2


def check_eagle3(W, r, group, seed):
    from dcoco.parallel import ZigzagLayout, branch_attention, eagle3_ttt_spec, expand_blocks

    gen = torch.Generator().manual_seed(seed)
    T = sum(SEQLENS)
    q, k, v = rand(gen, T, H, D), rand(gen, T, HKV, D), rand(gen, T, HKV, D)
    bq, bk, bv = rand(gen, T * K_STEPS, H, D), rand(gen, T * K_STEPS, HKV, D), rand(gen, T * K_STEPS, HKV, D)
    wm, wb = rand(gen, T, H, D), rand(gen, T * K_STEPS, H, D)
    seq, pos = packed_meta()
    # queries = [main tokens | branch tokens (position-major)], keys = [main | branch]
    g_of = torch.arange(T).repeat_interleave(K_STEPS)  # packed position of each branch token
    step = torch.arange(1, K_STEPS + 1).repeat(T)
    q_seq = torch.cat([seq, seq[g_of]])
    q_pos = torch.cat([pos, pos[g_of]])
    m_main = (q_seq[:, None] == seq[None, :]) & (pos[None, :] <= q_pos[:, None])
    is_branch = torch.cat([torch.zeros(T, dtype=torch.bool), torch.ones(T * K_STEPS, dtype=torch.bool)])
    q_g = torch.cat([torch.arange(T), g_of])
    q_step = torch.cat([torch.zeros(T, dtype=torch.long), step])
    m_br = is_branch[:, None] & (g_of[None, :] == q_g[:, None]) & (step[None, :] <= q_step[:, None])
    mask = torch.cat([m_main, m_br], 1)
    gq, gk, gv, gbq, gbk, gbv = map(leaf, (q, k, v, bq, bk, bv))
    ref, _ = dense_reference(torch.cat([gq, gbq]), torch.cat([gk, gbk]), torch.cat([gv, gbv]), mask)
    ref_g = grads((ref[:T] * wm).sum() + (ref[T:] * wb).sum(), (gq, gk, gv, gbq, gbk, gbv))

    layout = ZigzagLayout(SEQLENS, W)
    ix = layout.local_indices(r)
    tix = expand_blocks(ix, K_STEPS)
    spec = eagle3_ttt_spec(layout.local_seq_ids(r), layout.local_positions(r), K_STEPS)
    lq, lk, lv, lbq, lbk, lbv = leaf(q[ix]), leaf(k[ix]), leaf(v[ix]), leaf(bq[tix]), leaf(bk[tix]), leaf(bv[tix])
    main_out, br_out = branch_attention(lbq, lbk, lbv, lk, lv, spec, layout, q_main=lq, group=group)
    got_g = grads((main_out * wm[ix]).sum() + (br_out * wb[tix]).sum(), (lq, lk, lv, lbq, lbk, lbv))
    idx = [ix, ix, ix, tix, tix, tix]
    return {
        "fwd_main": max_err(main_out, ref[:T][ix]),
        "fwd_branch": max_err(br_out, ref[T:][tix]),
        "grad": max(max_err(a, b[i]) for a, b, i in zip(got_g, ref_g, idx)),
    }


def check_baseline(W, r, group, seed):
    from dcoco.parallel import CommStats, ZigzagLayout, allgather_attention

    gen = torch.Generator().manual_seed(seed)
    T = sum(SEQLENS)
    q, k, v = rand(gen, T, H, D), rand(gen, T, HKV, D), rand(gen, T, HKV, D)
    wgt = rand(gen, T, H, D)
    seq, pos = packed_meta()
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    gq, gk, gv = leaf(q), leaf(k), leaf(v)
    ref, _ = dense_reference(gq, gk, gv, mask)
    ref_g = grads((ref * wgt).sum(), (gq, gk, gv))
    layout = ZigzagLayout(SEQLENS, W)
    ix = layout.local_indices(r)
    lq, lk, lv = leaf(q[ix]), leaf(k[ix]), leaf(v[ix])
    stats = CommStats()
    out, _ = allgather_attention(
        lq, lk, lv, layout, layout.local_seq_ids(r), layout.local_positions(r), group=group, stats=stats
    )
    got_g = grads((out * wgt[ix]).sum(), (lq, lk, lv))
    padded = 2 * max(layout.local_lens()) * HKV * D * 8
    return {
        "fwd": max_err(out, ref[ix]),
        "grad": max(max_err(a, b[ix]) for a, b in zip(got_g, ref_g)),
        "bytes_ok": stats.total("fwd") == (W - 1) * padded and stats.total("bwd") == (W - 1) * padded,
    }


def check_ring_volume(W, r, group, seed):
    """Bytes posted by the ring equal the closed form (uneven shards: each shard travels W-1 hops)."""
    from dcoco.parallel import CommStats, ZigzagLayout, zigzag_ring_attention

    gen = torch.Generator().manual_seed(seed)
    layout = ZigzagLayout(SEQLENS, W)
    n = layout.local_len(r)
    q, k, v = leaf(rand(gen, n, H, D)), leaf(rand(gen, n, HKV, D)), leaf(rand(gen, n, HKV, D))
    stats = CommStats()
    out, _ = zigzag_ring_attention(q, k, v, layout, group=group, stats=stats)
    out.sum().backward()
    lens = layout.local_lens()
    row = 2 * HKV * D * 8  # K and V of one token, float64
    # rank r forwards the shards of ranks r, r-1, ..., r-W+2 (W-1 sends)
    fwd = sum(lens[(r - s) % W] for s in range(W - 1)) * row
    # K/V again, plus the dK/dV accumulators: W hops each (none at W = 1)
    bwd = fwd + (sum(lens[(r - s) % W] for s in range(W)) * row if W > 1 else 0)
    return {"fwd_ok": stats.total("fwd") == fwd, "bwd_ok": stats.total("bwd") == bwd}


def check_errors(W, r, group, seed):
    from dcoco.parallel import ShapeMismatchError, WorldSizeMismatchError, ZigzagLayout, zigzag_ring_attention

    layout = ZigzagLayout(SEQLENS, W)
    n = layout.local_len(r)
    x, kv = torch.zeros(n, H, D, dtype=torch.float64), torch.zeros(n, HKV, D, dtype=torch.float64)
    outcome = {}
    try:
        zigzag_ring_attention(x, kv[:-1], kv[:-1], layout, group=group)
        outcome["shape"] = False
    except ShapeMismatchError:
        outcome["shape"] = True
    try:
        zigzag_ring_attention(x, kv, kv, ZigzagLayout(SEQLENS, W + 1), group=group)
        outcome["world"] = False
    except WorldSizeMismatchError:
        outcome["world"] = True
    return outcome


def worker(rank, world_size):
    groups = {w: dist.new_group(ranks) for w, ranks in GROUPS.items()}
    results: dict = {}
    for W, ranks in GROUPS.items():
        if rank not in ranks:
            continue
        g, r = groups[W], ranks.index(rank)
        guarded(results, f"causal/{W}", check_causal, W, r, g, 100 + W)
        guarded(results, f"dflash_strict/{W}", check_dflash, W, r, g, 200 + W, False)
        guarded(results, f"dflash_inclusive/{W}", check_dflash, W, r, g, 300 + W, True)
        guarded(results, f"dflash_sparse/{W}", check_dflash, W, r, g, 700 + W, False, SPARSE_BLOCKS)
        guarded(results, f"eagle3/{W}", check_eagle3, W, r, g, 400 + W)
        guarded(results, f"baseline/{W}", check_baseline, W, r, g, 500 + W)
        guarded(results, f"volume/{W}", check_ring_volume, W, r, g, 600 + W)
        guarded(results, f"errors/{W}", check_errors, W, r, g, 0)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def results():
    return merge_ranks(run_job(worker, 4))


WS = [1, 2, 3, 4]


@pytest.mark.parametrize("W", WS)
def test_causal_packed_forward_backward(results, W):
    m = metrics_of(results, f"causal/{W}")
    assert m["finite"]
    assert m["fwd"] <= TOL and m["lse"] <= TOL and m["grad"] <= TOL, m


@pytest.mark.parametrize("include_anchor", [False, True])
@pytest.mark.parametrize("W", WS)
def test_dflash_blocks(results, W, include_anchor):
    m = metrics_of(results, f"dflash_{'inclusive' if include_anchor else 'strict'}/{W}")
    assert m["fwd"] <= TOL and m["grad"] <= TOL, m


@pytest.mark.parametrize("W", WS)
def test_ranks_without_branch_queries_still_relay(results, W):
    m = metrics_of(results, f"dflash_sparse/{W}")
    assert m["fwd"] <= TOL and m["grad"] <= TOL, m
    assert W == 1 or m["min_blocks"] == 0  # some rank really had no query


@pytest.mark.parametrize("W", WS)
def test_fully_masked_rows_are_zero_without_nan(results, W):
    m = metrics_of(results, f"dflash_strict/{W}")
    assert m["n_masked_rows"] >= 1  # at least one rank holds a fully masked block
    assert m["finite"]
    assert m["masked_rows_max_abs"] == 0.0 and m["masked_rows_grad_max_abs"] == 0.0


@pytest.mark.parametrize("W", WS)
def test_eagle3_ttt_with_main_in_same_ring(results, W):
    m = metrics_of(results, f"eagle3/{W}")
    assert m["fwd_main"] <= TOL and m["fwd_branch"] <= TOL and m["grad"] <= TOL, m


@pytest.mark.parametrize("W", WS)
def test_allgather_baseline_matches_and_counts_padding(results, W):
    m = metrics_of(results, f"baseline/{W}")
    assert m["fwd"] <= TOL and m["grad"] <= TOL, m
    assert m["bytes_ok"]


@pytest.mark.parametrize("W", WS)
def test_ring_communication_volume(results, W):
    m = metrics_of(results, f"volume/{W}")
    assert m["fwd_ok"] and m["bwd_ok"]


@pytest.mark.parametrize("W", WS)
def test_typed_errors(results, W):
    m = metrics_of(results, f"errors/{W}")
    assert m["shape"] and m["world"]
