"""Local attention kernels that return (output, log-sum-exp), and the LSE merge.

Why LSE: ring attention sees the keys of a query in pieces (one shard per ring
step, plus rank-local branch keys).  A piece's softmax output ``O_b`` together
with its log-sum-exp ``l_b`` is enough to combine pieces exactly::

    l = log(exp(l_a) + exp(l_b)),   O = exp(l_a - l) * O_a + exp(l_b - l) * O_b

(:func:`merge_partials`), and the same global ``l`` lets every piece compute its
own share of the gradient independently (flash-attention's backward recipe).

Mask model: every query row sees one contiguous range ``[lo, hi)`` of the key
buffer it is given.  That is enough for all masks in this package (causal
main sequence in a sorted shard, draft-block prefixes, bidirectional blocks,
EAGLE-3 diagonals in a position-major buffer) and it is what makes a flash-attn
varlen call possible.  Rows with ``hi <= lo`` see nothing: output 0, LSE -inf.

Layouts: ``q``/``out``/``dq`` are ``[Tq, H, D]``; ``k``/``v``/``dk``/``dv`` are
``[Tk, Hkv, D]`` with ``H % Hkv == 0`` (grouped-query attention: query head
``h`` uses kv head ``h // (H // Hkv)``); ``lse`` and ``delta`` are ``[Tq, H]``.
"""

from __future__ import annotations

import math

import torch

from .errors import ShapeMismatchError

__all__ = [
    "AttentionKernel",
    "TorchAttentionKernel",
    "FlashAttnKernel",
    "flash_attn_available",
    "select_kernel",
    "compute_dtype",
    "default_scale",
    "key_ranges",
    "ranges_to_mask",
    "merge_partials",
    "varlen_runs",
]

try:  # flash-attn is optional: only importable on CUDA machines where it is installed
    from flash_attn import flash_attn_varlen_func as _flash_varlen  # type: ignore

    _FLASH_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    _flash_varlen = None
    _FLASH_IMPORT_ERROR = exc


def flash_attn_available() -> bool:
    """True when flash-attn imported and CUDA is usable."""
    return _flash_varlen is not None and torch.cuda.is_available()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for 16-bit inputs (softmax statistics need it), else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# --------------------------------------------------------------------------- masks
def key_ranges(
    q_seq: torch.Tensor, q_limit: torch.Tensor, k_keys: torch.Tensor, key_stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key range for the rule "same sequence and key position <= q_limit".

    ``k_keys`` are the strictly increasing ``seq * key_stride + pos`` keys of a
    shard (see :meth:`ZigzagLayout.sort_keys`), so the visible keys of a query
    are contiguous; ``q_limit = -1`` means "no key of the main sequence".
    """
    base = q_seq * key_stride
    lim = q_limit.clamp(min=-1, max=key_stride - 1)
    lo = torch.searchsorted(k_keys, base, right=False)
    hi = torch.searchsorted(k_keys, base + lim, right=True)
    return lo, torch.maximum(hi, lo)


def ranges_to_mask(lo: torch.Tensor, hi: torch.Tensor, tk: int) -> torch.Tensor:
    """Dense ``[Tq, tk]`` boolean mask (True = visible) of per-row key ranges."""
    ar = torch.arange(tk, device=lo.device)
    return (ar[None, :] >= lo[:, None]) & (ar[None, :] < hi[:, None])


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets.

    Rows where both parts saw nothing keep LSE -inf and output 0 (no NaN).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def varlen_runs(lo: torch.Tensor, hi: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split consecutive rows (all with ``hi > lo``) into flash-attn varlen batch entries.

    A run is a maximal-ish block of consecutive rows sharing ``lo`` whose ``hi``
    is either constant (full attention over ``[lo, hi)``) or grows by exactly
    one per row (causal, bottom-right aligned, which is flash-attn's convention
    when ``seqlen_q != seqlen_k``).  Returns ``start``/``length`` (rows),
    ``k_lo``/``k_hi`` (keys) and ``causal`` per run.  Vectorised: no Python loop.
    """
    n = lo.numel()
    if n == 0:
        e = lo.new_zeros(0)
        return {"start": e, "length": e, "k_lo": e, "k_hi": e, "causal": e.bool()}
    boundary = torch.ones(n, dtype=torch.bool, device=lo.device)
    if n > 1:
        d = hi[1:] - hi[:-1]
        ok = (lo[1:] == lo[:-1]) & ((d == 0) | (d == 1))
        boundary[1:] = ~ok
        if n > 2:
            boundary[2:] |= d[1:] != d[:-1]
    start = boundary.nonzero().squeeze(1)
    end = torch.cat([start[1:], start.new_tensor([n])])
    length = end - start
    nxt = (start + 1).clamp(max=n - 1)
    causal = (length > 1) & ((hi[nxt] - hi[start]) == 1)
    return {"start": start, "length": length, "k_lo": lo[start], "k_hi": hi[end - 1], "causal": causal}


def _trim(lo: torch.Tensor, hi: torch.Tensor, tk: int):
    """Drop rows that see nothing and key columns nobody sees.

    This is where the zigzag load balance turns into saved work: for a remote
    shard of an earlier rank only the first chunk of each sequence is visible,
    for a later rank only the second-chunk queries see anything.  Ranges stay
    contiguous after removing unseen columns (every column inside a range is seen).
    Returns None when nothing is visible, else (rows|None, cols|None, lo', hi').
    """
    active = hi > lo
    n_active = int(active.sum())
    if n_active == 0:
        return None
    rows = None if n_active == lo.numel() else active.nonzero().squeeze(1)
    if rows is not None:
        lo, hi = lo[rows], hi[rows]
    diff = torch.zeros(tk + 1, dtype=torch.long, device=lo.device)
    diff.index_add_(0, lo, torch.ones_like(lo))
    diff.index_add_(0, hi, -torch.ones_like(hi))
    cover = diff.cumsum(0)[:tk] > 0
    n_cover = int(cover.sum())
    if n_cover == tk:
        return rows, None, lo, hi
    cols = cover.nonzero().squeeze(1)
    before = torch.zeros(tk + 1, dtype=torch.long, device=lo.device)
    before[1:] = cover.long().cumsum(0)
    new_lo = before[lo]
    return rows, cols, new_lo, new_lo + (hi - lo)


# ------------------------------------------------------------------------ kernels
class AttentionKernel:
    """Masked attention on one (query set, key block) pair, forward and backward.

    Subclasses implement :meth:`_forward_dense` / :meth:`_backward_dense` on a
    block where every row sees something; this base class validates shapes,
    trims invisible rows/columns and scatters results back.
    """

    name = "abstract"

    @staticmethod
    def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ShapeMismatchError("q, k, v must be [tokens, heads, head_dim]")
        if k.shape != v.shape:
            raise ShapeMismatchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ShapeMismatchError(
                f"q {tuple(q.shape)} incompatible with k {tuple(k.shape)} (head_dim must match, H % Hkv == 0)"
            )
        if lo.shape != (q.shape[0],) or hi.shape != (q.shape[0],):
            raise ShapeMismatchError("lo/hi must have one entry per query row")

    def forward(self, q, k, v, lo, hi, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out [Tq,H,D], lse [Tq,H])`` in :func:`compute_dtype` of ``q``."""
        self._check(q, k, v, lo, hi)
        cdt = compute_dtype(q.dtype)
        tq, h, d = q.shape
        out = q.new_zeros((tq, h, d), dtype=cdt)
        lse = q.new_full((tq, h), float("-inf"), dtype=cdt)
        t = _trim(lo, hi, k.shape[0])
        if t is None:
            return out, lse
        rows, cols, lo_t, hi_t = t
        qt = q if rows is None else q.index_select(0, rows)
        kt = k if cols is None else k.index_select(0, cols)
        vt = v if cols is None else v.index_select(0, cols)
        o, l = self._forward_dense(qt, kt, vt, lo_t, hi_t, scale)
        if rows is None:
            return o.to(cdt), l.to(cdt)
        out.index_copy_(0, rows, o.to(cdt))
        lse.index_copy_(0, rows, l.to(cdt))
        return out, lse

    def backward(self, dout, q, k, v, lse, delta, lo, hi, scale: float):
        """Gradient share of this key block given the *global* ``lse`` and ``delta = sum(dO * O)``.

        Returns ``(dq, dk, dv)`` in :func:`compute_dtype` of ``q``.
        """
        self._check(q, k, v, lo, hi)
        cdt = compute_dtype(q.dtype)
        dq = q.new_zeros(q.shape, dtype=cdt)
        dk = k.new_zeros(k.shape, dtype=cdt)
        dv = v.new_zeros(v.shape, dtype=cdt)
        t = _trim(lo, hi, k.shape[0])
        if t is None:
            return dq, dk, dv
        rows, cols, lo_t, hi_t = t

        def rsel(x):
            return x if rows is None else x.index_select(0, rows)

        def csel(x):
            return x if cols is None else x.index_select(0, cols)

        gq, gk, gv = self._backward_dense(
            rsel(dout), rsel(q), csel(k), csel(v), rsel(lse), rsel(delta), lo_t, hi_t, scale
        )
        if rows is None:
            dq = gq.to(cdt)
        else:
            dq.index_copy_(0, rows, gq.to(cdt))
        if cols is None:
            dk, dv = gk.to(cdt), gv.to(cdt)
        else:
            dk.index_copy_(0, cols, gk.to(cdt))
            dv.index_copy_(0, cols, gv.to(cdt))
        return dq, dk, dv

    def _forward_dense(self, q, k, v, lo, hi, scale):  # pragma: no cover - abstract
        raise NotImplementedError

    def _backward_dense(self, dout, q, k, v, lse, delta, lo, hi, scale):  # pragma: no cover - abstract
        raise NotImplementedError


class TorchAttentionKernel(AttentionKernel):
    """Pure-torch kernel (any device/dtype); materialises scores one row chunk at a time.

    ``max_score_elems`` bounds the ``H x rows x Tk`` score block, which is what
    keeps per-rank peak memory proportional to the local query count.
    """

    name = "torch"

    def __init__(self, max_score_elems: int = 1 << 24):
        self.max_score_elems = int(max_score_elems)

    def _row_chunks(self, tq: int, h: int, tk: int):
        step = max(1, self.max_score_elems // max(1, h * tk))
        for s in range(0, tq, step):
            yield s, min(tq, s + step)

    @staticmethod
    def _scores(qc, k, lo, hi, scale, cdt):
        # qc [r, Hkv, G, D] x k [Tk, Hkv, D] -> [Hkv, G, r, Tk]
        s = torch.einsum("qhgd,khd->hgqk", qc.to(cdt), k.to(cdt)) * scale
        m = ranges_to_mask(lo, hi, k.shape[0])
        return s.masked_fill(~m, float("-inf"))

    def _forward_dense(self, q, k, v, lo, hi, scale):
        cdt = compute_dtype(q.dtype)
        tq, h, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        qg = q.view(tq, hkv, g, d)
        out = torch.empty((tq, h, d), dtype=cdt, device=q.device)
        lse = torch.empty((tq, h), dtype=cdt, device=q.device)
        for a, b in self._row_chunks(tq, h, k.shape[0]):
            s = self._scores(qg[a:b], k, lo[a:b], hi[a:b], scale, cdt)
            l = torch.logsumexp(s, dim=-1)  # [Hkv, G, r]; finite: every row sees a key
            p = torch.exp(s - l.unsqueeze(-1))
            o = torch.einsum("hgqk,khd->qhgd", p, v.to(cdt))
            out[a:b] = o.reshape(b - a, h, d)
            lse[a:b] = l.permute(2, 0, 1).reshape(b - a, h)
        return out, lse

    def _backward_dense(self, dout, q, k, v, lse, delta, lo, hi, scale):
        cdt = compute_dtype(q.dtype)
        tq, h, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        qg = q.view(tq, hkv, g, d)
        dog = dout.to(cdt).reshape(tq, hkv, g, d)
        kc, vc = k.to(cdt), v.to(cdt)
        dq = torch.empty((tq, h, d), dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        lse_g = lse.to(cdt).reshape(tq, hkv, g).permute(1, 2, 0)  # [Hkv, G, Tq]
        delta_g = delta.to(cdt).reshape(tq, hkv, g).permute(1, 2, 0)
        for a, b in self._row_chunks(tq, h, k.shape[0]):
            s = self._scores(qg[a:b], kc, lo[a:b], hi[a:b], scale, cdt)
            ls = lse_g[..., a:b]
            ls = torch.where(torch.isneginf(ls), torch.zeros_like(ls), ls)
            p = torch.exp(s - ls.unsqueeze(-1))
            do = dog[a:b]
            dv += torch.einsum("hgqk,qhgd->khd", p, do)
            dp = torch.einsum("qhgd,khd->hgqk", do, vc)
            ds = p * (dp - delta_g[..., a:b].unsqueeze(-1))
            dq[a:b] = (torch.einsum("hgqk,khd->qhgd", ds, kc) * scale).reshape(b - a, h, d)
            dk += torch.einsum("hgqk,qhgd->khd", ds, qg[a:b].to(cdt)) * scale
        return dq, dk, dv


class FlashAttnKernel(TorchAttentionKernel):
    """flash-attn varlen forward (which returns the LSE) for fp16/bf16 CUDA tensors.

    The per-row ranges are converted to varlen batch entries with
    :func:`varlen_runs` (one call for causal runs, one for full runs).  Keys of
    overlapping runs are gathered, i.e. duplicated, which is cheap for the
    main-sequence ring (one run per sequence) but grows with the number of
    draft blocks.  The backward uses the exact torch recipe of the parent class
    (flash-attn's private backward entry point changes signature between
    releases).  Not exercised on CPU-only machines.
    """

    name = "flash-attn"

    def __init__(self, max_score_elems: int = 1 << 26):
        if _flash_varlen is None:
            raise RuntimeError(f"flash-attn is not importable: {_FLASH_IMPORT_ERROR!r}")
        super().__init__(max_score_elems)

    def _forward_dense(self, q, k, v, lo, hi, scale):
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return super()._forward_dense(q, k, v, lo, hi, scale)
        runs = varlen_runs(lo, hi)
        cdt = compute_dtype(q.dtype)
        out = torch.empty(q.shape, dtype=cdt, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=cdt, device=q.device)
        for causal in (False, True):
            sel = (runs["causal"] == causal).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            start, length = runs["start"][sel], runs["length"][sel]
            k_lo, k_len = runs["k_lo"][sel], runs["k_hi"][sel] - runs["k_lo"][sel]
            q_idx = _segments(start, length)
            k_idx = _segments(k_lo, k_len)
            cu_q = torch.nn.functional.pad(length.cumsum(0), (1, 0)).int()
            cu_k = torch.nn.functional.pad(k_len.cumsum(0), (1, 0)).int()
            o, l, _ = _flash_varlen(
                q.index_select(0, q_idx),
                k.index_select(0, k_idx),
                v.index_select(0, k_idx),
                cu_q,
                cu_k,
                int(length.max()),
                int(k_len.max()),
                softmax_scale=scale,
                causal=causal,
                return_attn_probs=True,
            )
            out.index_copy_(0, q_idx, o.to(cdt))
            lse.index_copy_(0, q_idx, l.transpose(0, 1).to(cdt))  # flash varlen lse is [H, total_q]
        return out, lse


def _segments(start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(start[i], start[i] + length[i])`` without a Python loop."""
    total = int(length.sum())
    seg = torch.repeat_interleave(torch.arange(length.numel(), device=start.device), length)
    offs = torch.arange(total, device=start.device) - torch.repeat_interleave(length.cumsum(0) - length, length)
    return start[seg] + offs


def select_kernel(device: torch.device | str, dtype: torch.dtype) -> AttentionKernel:
    """flash-attn on CUDA for 16-bit inputs when importable, the torch kernel otherwise."""
    if torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
        return FlashAttnKernel()
    return TorchAttentionKernel()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
