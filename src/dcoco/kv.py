"""A batched KV cache whose rows may hold different numbers of committed tokens.

Speculative decoding appends a whole draft block for every request, then keeps a different prefix
of it per request. Instead of re-running or padding, rejected slots simply become *holes*: each row
carries a validity mask and the position of every slot, and attention is masked accordingly (a
4-D mask passed straight to the Hugging Face model). Trailing holes shared by all rows are cropped at
once; when compaction would free more than a quarter of the slots, the cache is compacted with
one gather per layer. With one
request there are never holes: rejection is a plain crop.

Layers are preallocated and grown by doubling, so a decode step writes in place instead of
re-concatenating the whole cache as `DynamicLayer` does. Requests come and go without copying the
cache either: a finished request's row is overwritten by the last row, and the rows so freed take
the next admitted requests.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def pad_rows(
    rows: Sequence[Sequence[int]], width: int, device: Optional[torch.device] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged token lists into (B, width) (zero-padded) plus their lengths, on `device`."""
    rows = [[int(t) for t in r][:width] for r in rows]
    out = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
    return out.view(len(rows), width), lens


class GrowingLayer(DynamicLayer):
    """A cache layer with capacity in slots and in rows: in-place appends of tokens and of requests,
    views over the used part. Rows beyond the used ones are spare room for requests admitted later."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.keys = torch.empty(B, H, 0, D, dtype=self.dtype, device=self.device)
        self.values = torch.empty(B, H, 0, value_states.shape[-1], dtype=self.dtype, device=self.device)
        self._kbuf, self._vbuf = self.keys, self.values
        self.is_initialized = True

    def _view(self, rows: int, slots: int) -> None:
        self.keys, self.values = self._kbuf[:rows, :, :slots], self._vbuf[:rows, :, :slots]

    def _reserve(self, need: int) -> None:
        cap = self._kbuf.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 64)
        B, used = self.keys.shape[0], self.keys.shape[2]
        rows = self._kbuf.shape[0]  # spare rows stay
        kb = self._kbuf.new_empty(rows, self._kbuf.shape[1], new_cap, self._kbuf.shape[3])
        vb = self._vbuf.new_empty(rows, self._vbuf.shape[1], new_cap, self._vbuf.shape[3])
        kb[:B, :, :used] = self.keys
        vb[:B, :, :used] = self.values
        self._kbuf, self._vbuf = kb, vb
        self._view(B, used)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, used, q = self.keys.shape[0], self.keys.shape[2], key_states.shape[2]
        self._reserve(used + q)
        self._kbuf[:B, :, used : used + q] = key_states
        self._vbuf[:B, :, used : used + q] = value_states
        self._view(B, used + q)
        return self.keys, self.values

    def set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the contents (after a gather or a merge)."""
        self.dtype, self.device = keys.dtype, keys.device
        self._kbuf, self._vbuf = keys.contiguous(), values.contiguous()
        self.keys, self.values = self._kbuf, self._vbuf
        self.is_initialized = True

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove and self.is_initialized:
            self._view(self.keys.shape[0], self.keys.shape[2] - abs(tokens_to_remove))

    @torch.inference_mode()  # the buffers were made by the target's inference-mode forward
    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Copy rows `src` onto rows `dst`, then keep the first `rows` rows (the rest become spare)."""
        S = self.keys.shape[2]
        if len(dst):
            self._kbuf[dst, :, :S] = self._kbuf[src, :, :S]
            self._vbuf[dst, :, :S] = self._vbuf[src, :, :S]
        self._view(rows, S)

    def fits(self, rows: int, slots: int) -> bool:
        """Whether `rows` more requests of at most the current number of slots fit in spare rows."""
        B, S = self.keys.shape[0], self.keys.shape[2]
        return B + rows <= self._kbuf.shape[0] and slots <= S

    @torch.inference_mode()
    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write requests into spare rows, right-aligned (zeros in the left padding: masked slots
        must hold finite numbers)."""
        B, S = self.keys.shape[0], self.keys.shape[2]
        n, S2 = keys.shape[0], keys.shape[2]
        for buf, new in ((self._kbuf, keys), (self._vbuf, values)):
            buf[B : B + n, :, : S - S2].zero_()
            buf[B : B + n, :, S - S2 : S] = new
        self._view(B + n, S)


def new_cache(num_layers: int) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [GrowingLayer() for _ in range(num_layers)]
    cache.layer_class_to_replicate = None
    return cache


class KVBatch:
    """The target's cache for a batch of requests, with per-row valid slots and positions."""

    COMPACT_HOLE_FRACTION = 0.25

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.device = device
        self.cache = new_cache(num_layers)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (B, S)
        self.pos = torch.zeros(0, 0, dtype=torch.long, device=device)  # (B, S), -1 for holes
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # committed tokens per row
        self._pending: Optional[int] = None  # slots appended by the last forward, not yet committed

    # -- shape ------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    # -- forward support ---------------------------------------------------------------------
    def begin(self, num_tokens: torch.Tensor, q: int, sliding_window: Optional[int] = None):
        """Position ids and the 4-D boolean mask for appending `q` slots (first `num_tokens[b]` real)."""
        if self._pending is not None:
            raise RuntimeError("commit() the previous forward before the next one")
        B, S = self.valid.shape
        if B == 0 and self.lengths.numel() == 0:
            B = num_tokens.shape[0]
            self.valid = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
            self.pos = torch.zeros(B, 0, dtype=torch.long, device=self.device)
            self.lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        ar = torch.arange(q, device=self.device)
        position_ids = self.lengths.unsqueeze(1) + ar  # (B, q)
        real = ar.unsqueeze(0) < num_tokens.to(self.device).unsqueeze(1)  # (B, q)
        old = self.valid.unsqueeze(1).expand(B, q, S)
        causal = ar.view(1, q, 1) >= ar.view(1, 1, q)
        new = (causal & real.unsqueeze(1)) | torch.eye(q, dtype=torch.bool, device=self.device)
        if sliding_window is not None:
            old = old & (self.pos.unsqueeze(1) > position_ids.unsqueeze(2) - sliding_window)
            new = new & (ar.view(1, 1, q) > ar.view(1, q, 1) - sliding_window)
        mask = torch.cat([old, new.expand(B, q, q)], dim=2).unsqueeze(1)
        self._pending = q
        self._pending_pos = position_ids
        return position_ids, mask

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the first `keep[b]` appended slots of each row; the rest become holes."""
        q = self._pending
        if q is None:
            raise RuntimeError("commit() without a forward")
        self._pending = None
        keep = keep.to(self.device)
        ar = torch.arange(q, device=self.device)
        new_valid = ar.unsqueeze(0) < keep.unsqueeze(1)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.pos = torch.cat([self.pos, torch.where(new_valid, self._pending_pos, -1)], dim=1)
        self.lengths = self.lengths + keep
        self._tidy()

    def _tidy(self) -> None:
        used = self.valid.any(0)
        if not used.any():
            last = 0
        else:
            last = int(used.nonzero().max()) + 1
        drop = self.num_slots - last
        if drop > 0:
            for layer in self.cache.layers:
                layer.crop(-drop)
            self.valid, self.pos = self.valid[:, :last], self.pos[:, :last]
        # compaction can shrink the cache to the longest row; left padding of shorter rows stays
        if self.valid.numel():
            reclaimable = self.num_slots - int(self.valid.sum(1).max())
            if reclaimable > self.COMPACT_HOLE_FRACTION * self.num_slots:
                self.compact()

    def compact(self) -> None:
        """Move each row's committed slots to the right end, in order (left padding)."""
        B, S = self.valid.shape
        counts = self.valid.sum(1)
        S2 = int(counts.max()) if B else 0
        # sort key: holes first, then valid slots in their original order
        order = torch.argsort(self.valid.long() * (S + 1) + torch.arange(S, device=self.device), dim=1)
        idx = order[:, S - S2 :]  # (B, S2)
        self.valid = self.valid.gather(1, idx)
        self.pos = self.pos.gather(1, idx)
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            k, v = layer.keys, layer.values
            gi = idx.view(B, 1, S2, 1)
            layer.set(
                k.gather(2, gi.expand(B, k.shape[1], S2, k.shape[3])),
                v.gather(2, gi.expand(B, v.shape[1], S2, v.shape[3])),
            )

    # -- batch membership -------------------------------------------------------------------
    def drop(self, rows: Sequence[int]) -> list[int]:
        """Remove `rows` (finished requests) by moving the last remaining rows into their places: one
        row copy per removed request instead of a copy of the whole cache. Returns the old index of
        each remaining row, in its new order."""
        gone = set(rows)
        B = self.batch_size
        n = B - len(gone)
        holes = [b for b in range(n) if b in gone]
        movers = [b for b in range(n, B) if b not in gone]
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self.valid, self.pos, self.lengths = self.valid[idx], self.pos[idx], self.lengths[idx]
        dst = torch.tensor(holes, dtype=torch.long, device=self.device)
        src = torch.tensor(movers, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.move_rows(dst, src, n)
        self._tidy()
        return order

    def extend(self, other: "KVBatch") -> None:
        """Append the rows of `other` (e.g. freshly prefilled requests) to this batch."""
        if self.batch_size == 0:
            self.__dict__.update(other.__dict__)
            return
        S1, S2 = self.num_slots, other.num_slots
        S = max(S1, S2)
        layers = list(zip(self.cache.layers, other.cache.layers))
        in_place = all(a.is_initialized and b.is_initialized for a, b in layers) and all(
            a.fits(other.batch_size, S2) for a, _ in layers
        )

        def lpad(t: torch.Tensor, n: int, value) -> torch.Tensor:
            if n == 0:
                return t
            pad = torch.full((*t.shape[:-1], n), value, dtype=t.dtype, device=t.device)
            return torch.cat([pad, t], dim=-1)

        self.valid = torch.cat([lpad(self.valid, S - S1, False), lpad(other.valid, S - S2, False)])
        self.pos = torch.cat([lpad(self.pos, S - S1, -1), lpad(other.pos, S - S2, -1)])
        self.lengths = torch.cat([self.lengths, other.lengths])
        if in_place:  # into spare rows: only the new requests are copied
            for a, b in layers:
                a.append_rows(b.keys, b.values)
            return
        for a, b in layers:
            ks, vs = [], []
            for layer, n in ((a, S - S1), (b, S - S2)):
                k, v = layer.keys, layer.values
                if n:
                    k = torch.cat([k.new_zeros(*k.shape[:2], n, k.shape[3]), k], dim=2)
                    v = torch.cat([v.new_zeros(*v.shape[:2], n, v.shape[3]), v], dim=2)
                ks.append(k)
                vs.append(v)
            a.set(torch.cat(ks), torch.cat(vs))
