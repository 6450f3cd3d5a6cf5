"""bf16 and float32 linear layers on CPU from a weight packed once for oneDNN, instead of on every call.

A bf16 `F.linear` on CPU hands its weight to oneDNN, which lays it out anew for its matrix kernels
(AMX / AVX-512 BF16) on every call. Decoding multiplies one to a few rows per step, where that
re-layout is a large part of the work: packing once takes 15-26% less time per multiply on a 2-core
Xeon, with the same results (`scripts/linear_bandwidth.py`;
docs/experiments/2026-12-02-prepacked-weights.md). A float32 `F.linear` goes to a BLAS whose
multi-row products re-lay out the weight too: on a 2-core AVX2 EPYC a 5-row product took 1.5x one
row's time, packed 1.25x, and the packed kernel gives each row the same bits whatever the number of
rows beside it (docs/experiments/2026-12-08-float32-prepacked-weights.md). The packed copy follows
its weight: it is rebuilt when the weight is changed in place (an optimizer step, `load_state_dict`)
or replaced. Autograd, other devices and other dtypes take plain `F.linear`.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _weight_key(w: torch.Tensor) -> tuple:
    # an inference-mode tensor has no version counter and cannot change in place
    return (w.data_ptr(), None if w.is_inference() else w._version)


class PrepackedLinear(nn.Linear):
    """An `nn.Linear` whose no-grad CPU forward (bf16 or float32) uses a oneDNN-packed copy of its weight."""

    _packed = None
    _packed_key = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.device.type != "cpu"
            or x.dtype != w.dtype
            or not prepack_supported(w.dtype)  # a packed float32 layer since cast to bf16 where oneDNN has no bf16
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        ):
            return F.linear(x, w, self.bias)
        key = _weight_key(w)
        if key != self._packed_key:
            self._packed, self._packed_key = torch.ops.mkldnn._reorder_linear_weight(w.detach()), key
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


PACKED_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def prepack_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN is there and runs `dtype` on this CPU: float32 wherever oneDNN is, bf16 with AVX-512
    or AVX-NE-CONVERT (not on AVX2-only CPUs)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_enabled(dtype: torch.dtype = torch.bfloat16) -> bool:
    """`prepack_supported(dtype)` and `DCOCO_PREPACK` is not 0 (the switch for A/B runs and debugging)."""
    return os.environ.get("DCOCO_PREPACK", "1") != "0" and prepack_supported(dtype)


def prepack_linears(module: nn.Module) -> int:
    """Turn every bf16 or float32 `nn.Linear` on the CPU in `module` into a `PrepackedLinear`, in
    place (same parameters and state dict), where `prepack_enabled` for its dtype. Returns how many
    were turned."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and prepack_enabled(m.weight.dtype):
            m.__class__ = PrepackedLinear
            n += 1
    return n


def linear_of(weight: torch.Tensor) -> nn.Linear:
    """A bias-free linear layer around `weight` (out, in), prepacked like `prepack_linears` would:
    for products by a weight that is not a module's, such as an LM head's rows."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    prepack_linears(layer)
    return layer


__all__ = ["PACKED_DTYPES", "PrepackedLinear", "linear_of", "prepack_enabled", "prepack_linears", "prepack_supported"]
