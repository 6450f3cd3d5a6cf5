"""Single-process tests: zigzag layout, key ranges, varlen runs, LSE merge, local kernel, branch specs."""

from __future__ import annotations

import math

import pytest
import torch

from dcoco.parallel import (
    BranchSpecError,
    LayoutError,
    ShapeMismatchError,
    TorchAttentionKernel,
    WorldSizeMismatchError,
    ZigzagLayout,
    branch_attention,
    dflash_spec,
    eagle3_ttt_spec,
    key_ranges,
    merge_partials,
    ring_attention,
    select_kernel,
    varlen_runs,
    zigzag_ring_attention,
)
from dcoco.parallel.attention import ranges_to_mask

SEQLENS = [13, 7, 20]


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_zigzag_shards_are_a_permutation_and_roundtrip(W):
    layout = ZigzagLayout(SEQLENS, W)
    x = torch.arange(layout.total * 2).view(layout.total, 2)
    shards = [layout.shard(x, r) for r in range(W)]
    assert torch.equal(layout.unshard(shards), x)
    allix = torch.cat([layout.local_indices(r) for r in range(W)])
    assert torch.equal(allix.sort().values, torch.arange(layout.total))
    for r in range(W):
        keys = layout.sort_keys(r)
        assert bool((keys[1:] > keys[:-1]).all())
        assert layout.local_cu_seqlens(r)[-1] == layout.local_len(r)


def test_zigzag_chunk_assignment_single_sequence():
    layout = ZigzagLayout([16], 4)  # 8 chunks of 2 tokens
    assert layout.local_positions(0).tolist() == [0, 1, 14, 15]
    assert layout.local_positions(1).tolist() == [2, 3, 12, 13]
    assert layout.local_positions(3).tolist() == [6, 7, 8, 9]
    assert layout.chunks_of(1) == (1, 6)


def test_zigzag_balances_causal_work():
    n, W = 4096, 4
    layout = ZigzagLayout([n], W)
    work = [layout.causal_work(r) for r in range(W)]
    assert max(work) / min(work) < 1.01
    contiguous = [sum(range(r * n // W + 1, (r + 1) * n // W + 1)) for r in range(W)]
    assert max(contiguous) / min(contiguous) > 6  # what zigzag avoids


def test_owners_and_global_index():
    layout = ZigzagLayout(SEQLENS, 3)
    seq = torch.tensor([0, 0, 1, 2, 2])
    pos = torch.tensor([0, 12, 6, 0, 19])
    ranks, local = layout.owners(seq, pos)
    g = layout.global_index(seq, pos)
    for r, li, gi in zip(ranks.tolist(), local.tolist(), g.tolist()):
        assert int(layout.local_indices(r)[li]) == gi


def test_layout_errors():
    with pytest.raises(LayoutError):
        ZigzagLayout([], 2)
    with pytest.raises(LayoutError):
        ZigzagLayout([3, 0], 2)
    with pytest.raises(LayoutError):
        ZigzagLayout([3], 0)
    with pytest.raises(LayoutError):
        ZigzagLayout.from_cu_seqlens([0, 5, 5], 2)
    layout = ZigzagLayout(SEQLENS, 2)
    with pytest.raises(LayoutError):
        layout.local_indices(2)
    with pytest.raises(LayoutError):
        layout.owners(torch.tensor([1]), torch.tensor([7]))
    with pytest.raises(ShapeMismatchError):
        layout.shard(torch.zeros(5), 0)
    with pytest.raises(ShapeMismatchError):
        layout.unshard([torch.zeros(layout.local_len(0))])
    assert ZigzagLayout.from_cu_seqlens(torch.tensor([0, 13, 20, 40]), 2).seqlens == tuple(SEQLENS)


# ------------------------------------------------------------ mask helpers
@pytest.mark.parametrize("W", [1, 3])
def test_key_ranges_match_bruteforce(W):
    gen = torch.Generator().manual_seed(0)
    layout = ZigzagLayout(SEQLENS, W)
    q_seq = torch.randint(0, 3, (50,), generator=gen)
    q_lim = torch.randint(-3, 25, (50,), generator=gen)
    for r in range(W):
        lo, hi = key_ranges(q_seq, q_lim, layout.sort_keys(r), layout.key_stride)
        ks, kp = layout.local_seq_ids(r), layout.local_positions(r)
        brute = (ks[None, :] == q_seq[:, None]) & (kp[None, :] <= q_lim[:, None])
        assert torch.equal(ranges_to_mask(lo, hi, layout.local_len(r)), brute)


def _runs_mask(runs, n_rows, tk):
    m = torch.zeros(n_rows, tk, dtype=torch.bool)
    for st, ln, klo, khi, causal in zip(*(runs[k].tolist() for k in ("start", "length", "k_lo", "k_hi", "causal"))):
        for i in range(ln):
            hi = khi - (ln - 1 - i) if causal else khi  # flash-attn: causal is bottom-right aligned
            m[st + i, klo:hi] = True
    return m


def test_varlen_runs_reproduce_the_ranges():
    gen = torch.Generator().manual_seed(1)
    layout = ZigzagLayout(SEQLENS, 2)
    cases = []
    for r in range(2):  # ring blocks of the causal main sequence
        for o in range(2):
            lo, hi = key_ranges(
                layout.local_seq_ids(r), layout.local_positions(r), layout.sort_keys(o), layout.key_stride
            )
            act = hi > lo
            cases.append((lo[act], hi[act], layout.local_len(o)))
    spec = dflash_spec([0, 2, 2], [5, 0, 10], 4, valid_lens=[4, 2, 3])
    act = spec.hi > spec.lo
    cases.append((spec.lo[act], spec.hi[act], 12))
    spec = eagle3_ttt_spec([0] * 5, list(range(5)), 3)
    cases.append((spec.lo, spec.hi, 15))
    lo = torch.randint(0, 5, (40,), generator=gen)
    cases.append((lo, lo + torch.randint(1, 6, (40,), generator=gen), 11))
    for lo, hi, tk in cases:
        runs = varlen_runs(lo, hi)
        assert torch.equal(_runs_mask(runs, lo.numel(), tk), ranges_to_mask(lo, hi, tk))
    causal_block = varlen_runs(torch.zeros(4, dtype=torch.long), torch.arange(3, 7))
    assert causal_block["causal"].tolist() == [True] and causal_block["length"].tolist() == [4]


# ------------------------------------------------------------------ kernel
def _dense(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1)), lse.transpose(0, 1)


def _random_problem(gen, tq=23, tk=31, h=4, hkv=2, d=8):
    q = torch.randn(tq, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(tk, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(tk, hkv, d, generator=gen, dtype=torch.float64)
    lo = torch.randint(0, tk, (tq,), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, 12, (tq,), generator=gen), torch.tensor(tk))
    hi[::5] = lo[::5]  # some rows see nothing
    return q, k, v, lo, hi


@pytest.mark.parametrize("max_score_elems", [1 << 24, 200])  # one chunk / many row chunks
def test_torch_kernel_forward_backward_against_autograd(max_score_elems):
    gen = torch.Generator().manual_seed(2)
    q, k, v, lo, hi = _random_problem(gen)
    scale = 1 / math.sqrt(q.shape[2])
    kern = TorchAttentionKernel(max_score_elems)
    out, lse = kern.forward(q, k, v, lo, hi, scale)
    mask = ranges_to_mask(lo, hi, k.shape[0])
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, ref_lse = _dense(qq, kk, vv, mask, scale)
    assert (out - ref).abs().max() < 1e-12
    empty = hi <= lo
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()
    assert (lse[~empty] - ref_lse[~empty]).abs().max() < 1e-12
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ref_g = torch.autograd.grad(ref, (qq, kk, vv), dout)
    delta = (dout * out).sum(-1)
    got = kern.backward(dout, q, k, v, lse, delta, lo, hi, scale)
    for a, b in zip(got, ref_g):
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-12


def test_merge_of_disjoint_parts_equals_full_softmax():
    gen = torch.Generator().manual_seed(3)
    q, k, v, _, _ = _random_problem(gen, tq=9, tk=20)
    scale = 0.3
    kern = TorchAttentionKernel()
    lo = torch.zeros(9, dtype=torch.long)
    full = kern.forward(q, k, v, lo, torch.full((9,), 20), scale)
    a = kern.forward(q, k[:8], v[:8], lo, torch.full((9,), 8), scale)
    b = kern.forward(q, k[8:], v[8:], lo, torch.full((9,), 12), scale)
    out, lse = merge_partials(*a, *b)
    assert (out - full[0]).abs().max() < 1e-12 and (lse - full[1]).abs().max() < 1e-12
    none = kern.forward(q, k, v, lo, lo, scale)  # both parts empty
    out, lse = merge_partials(*none, *none)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_kernel_half_precision_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(4)
    q, k, v, lo, hi = _random_problem(gen)
    out, lse = TorchAttentionKernel().forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), lo, hi, 0.35)
    ref, _ = _dense(q, k, v, ranges_to_mask(lo, hi, k.shape[0]), 0.35)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 5e-2


def test_kernel_shape_errors():
    kern = TorchAttentionKernel()
    z = torch.zeros
    with pytest.raises(ShapeMismatchError):
        kern.forward(z(3, 3, 4), z(5, 2, 4), z(5, 2, 4), z(3).long(), z(3).long(), 1.0)  # H % Hkv
    with pytest.raises(ShapeMismatchError):
        kern.forward(z(3, 2, 4), z(5, 2, 4), z(4, 2, 4), z(3).long(), z(3).long(), 1.0)
    assert isinstance(select_kernel("cpu", torch.float64), TorchAttentionKernel)


# ------------------------------------------------------ single-process mode
def test_single_process_mode_and_world_mismatch():
    gen = torch.Generator().manual_seed(5)
    layout = ZigzagLayout(SEQLENS, 1)
    T = layout.total
    q = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(T, 2, 8, generator=gen, dtype=torch.float64)
    out, _ = zigzag_ring_attention(q, k, k, layout)  # no torch.distributed needed
    seq, pos = layout.local_seq_ids(0), layout.local_positions(0)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    assert (out - _dense(q, k, k, mask, 1 / math.sqrt(8))[0]).abs().max() < 1e-12
    with pytest.raises(WorldSizeMismatchError):
        zigzag_ring_attention(q, k, k, ZigzagLayout(SEQLENS, 2))
    with pytest.raises(ShapeMismatchError):
        ring_attention(q, k, k, layout, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------ branch specs
def test_dflash_spec_layout():
    spec = dflash_spec([1, 0], [4, 0], 3, valid_lens=[2, 3])
    assert spec.seq_ids.tolist() == [1, 1, 1, 0, 0, 0]
    assert spec.limits.tolist() == [3, 3, -1, -1, -1, -1]  # strict prefix; padding sees nothing
    assert spec.lo.tolist() == [0, 0, 0, 3, 3, 3]
    assert spec.hi.tolist() == [2, 2, 0, 6, 6, 6]
    assert dflash_spec([1], [4], 2, include_anchor=True).limits.tolist() == [4, 4]


def test_eagle3_spec_layout():
    spec = eagle3_ttt_spec([0, 2], [5, 9], 2)
    assert spec.limits.tolist() == [5, 5, 9, 9]
    assert spec.lo.tolist() == [0, 0, 2, 2]
    assert spec.hi.tolist() == [1, 2, 3, 4]


def test_branch_errors():
    with pytest.raises(BranchSpecError):
        dflash_spec([0, 1], [3], 4)
    with pytest.raises(BranchSpecError):
        dflash_spec([0], [3], 4, valid_lens=[5])
    with pytest.raises(BranchSpecError):
        eagle3_ttt_spec([0], [3], 0)
    layout = ZigzagLayout([6], 1)
    k = torch.zeros(6, 2, 4)
    spec = dflash_spec([0], [3], 2)
    with pytest.raises(ShapeMismatchError):
        branch_attention(torch.zeros(3, 2, 4), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), k, k, spec, layout)
    with pytest.raises(BranchSpecError):
        branch_attention(torch.zeros(2, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), k, k, spec, layout)
