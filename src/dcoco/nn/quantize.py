"""Weight-only int8 and int4 quantization of a target's linear layers (`--quantization int8|int4`).

Decoding on a CPU streams every weight once per step: bf16 weights are 2 bytes a parameter, int8
ones 1, int4 ones a half. The products run in torch's own CPU kernels, which dequantize inside
(activations in bf16 or float32). The model that results IS the target: speculative decoding is
lossless with respect to it, not to the bf16 model.

- int8: one scale per output channel (symmetric: scale = max |w| / 127, w ~ q * scale),
  `aten._weight_int8pack_mm`.
- int4: groups of 32 input channels, each with its own step and minimum (w ~ min + q * step,
  q in 0..15: llama.cpp's Q4_1 layout), `aten._weight_int4pack_mm_for_cpu`. The LM head is int8, as
  GGUF files keep their output layer above 4 bits. The embedded target was dequantized from a
  Q4_1 GGUF, so its decoder weights are already on such grids: int4 recovers them up to bf16
  rounding of the steps.

Every `nn.Linear` of the decoder and the LM head is replaced; the input embedding keeps its weight,
so a tied LM head gets its own quantized copy. Readers of `.weight` (a drafter's draft-vocabulary
rows, the training losses' target head) get the dequantized weight, built on first use and kept.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError

__all__ = [
    "QUANTIZATIONS",
    "QUANTIZED_CPU_PASS_TOKENS",
    "Int4Linear",
    "Int8Linear",
    "dequantized_products",
    "quantize_linears",
]

#: the weight-only quantizations a target can be loaded with
QUANTIZATIONS = ("none", "int8", "int4")

#: torch's int8 and int4 CPU kernels take rows in blocks of 4: a 5-token verification pass costs
#: 1.9-2.1x a decode step there, a 4-token one 1.3x (docs/experiments/2026-12-04-lean-decoder-plan.md),
#: so a quantized CPU target verifies at most this many tokens per pass
QUANTIZED_CPU_PASS_TOKENS = 4


class Int8Linear(nn.Module):
    """A frozen linear layer with an int8 weight and one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self._set(q, scale.to(weight.dtype), None if bias is None else bias.detach().clone())

    def _set(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = qweight.shape
        self._dequantized: Optional[torch.Tensor] = None

    @classmethod
    def concat(cls, layers: list["Int8Linear"]) -> "Int8Linear":
        """One layer whose outputs are `layers`' outputs side by side (the same numbers)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._set(torch.cat([m.qweight for m in layers]), torch.cat([m.scale for m in layers]), _concat_biases(layers))
        return fused

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in), in the layer's dtype: what the layer multiplies by."""
        if self._dequantized is None:
            self._dequantized = self.qweight.to(self.scale.dtype) * self.scale[:, None]
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # the int8 kernel is torch's CPU one: elsewhere, the dequantized weight
            return _dequantized_forward(self, x)
        return _cached_bound(self, x.dtype)(x)

    def bound_forward(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for CPU inputs of `dtype`, its per-call checks and conversions done once: for
        callers that make a hundred such calls per token (`dcoco.nn.lean`)."""
        if self.qweight.device.type != "cpu":
            return functools.partial(_dequantized_forward, self)
        mm = torch.ops.aten._weight_int8pack_mm.default
        return _bound(self, mm, self.qweight, self.scale.to(dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """A frozen linear layer with 4-bit weights in groups of `GROUP` input channels, each group with
    its own step and minimum. Shapes torch's kernel cannot take (output channels not a multiple of
    16) multiply by the dequantized weight: the same numbers, only slower."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = n, k = w.shape
        g = self.GROUP if k % self.GROUP == 0 else k  # one group per row when the groups do not fit
        groups = w.view(n, k // g, g)
        low = groups.amin(dim=-1)
        step = ((groups.amax(dim=-1) - low) / 15).clamp_min(1e-12)
        q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        bias = None if bias is None else bias.detach().clone()
        self._set(q, step.to(weight.dtype), low.to(weight.dtype), bias)

    def _set(self, q: torch.Tensor, step: torch.Tensor, low: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """From the 4-bit values q (n, k) as int32, and per group the step and minimum (n, k / group)."""
        self.out_features, self.in_features = n, k = q.shape
        self.group = g = k // step.shape[1]
        self.register_buffer("qweight", (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8))  # two per byte
        self.register_buffer("step", step)
        self.register_buffer("low", low)
        self.register_buffer("bias", bias)
        kernel = q.device.type == "cpu" and n % 16 == 0 and g in (32, 64, 128, 256) and k % 2 == 0
        # the kernel's operands: its own packing of q, and per group (step, value at q = 8), (k / g, n, 2)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2) if kernel else None
        self.register_buffer("packed", packed, persistent=False)
        mids = torch.stack([step, low + 8 * step], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("steps_and_mids", mids, persistent=False)
        self._dequantized: Optional[torch.Tensor] = None

    def _values(self) -> torch.Tensor:
        """The 4-bit values (out, in) as int32."""
        return torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).view(self.out_features, -1).to(torch.int32)

    @classmethod
    def concat(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        """One layer whose outputs are `layers`' outputs side by side (the same numbers)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._set(
            torch.cat([m._values() for m in layers]),
            torch.cat([m.step for m in layers]),
            torch.cat([m.low for m in layers]),
            _concat_biases(layers),
        )
        return fused

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in), in the layer's dtype: what the layer multiplies by."""
        if self._dequantized is None:
            q = self._values().view(self.out_features, -1, self.group)
            w = self.low.float()[..., None] + q.float() * self.step.float()[..., None]
            self._dequantized = w.view(self.out_features, self.in_features).to(self.step.dtype)
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return _dequantized_forward(self, x)
        return _cached_bound(self, x.dtype)(x)

    def bound_forward(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for CPU inputs of `dtype`, its per-call checks and conversions done once (see
        `Int8Linear.bound_forward`)."""
        if self.packed is None or self.packed.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return functools.partial(_dequantized_forward, self)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        sz = self.steps_and_mids.to(dtype)
        return _bound(self, mm, self.packed, self.group, sz)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 in groups of {self.group}"


_dequantized_from_rows: Optional[int] = None  # set by `dequantized_products`


@contextlib.contextmanager
def dequantized_products(min_rows: int = 32) -> Iterator[None]:
    """Within it, quantized products of at least `min_rows` rows multiply by the dequantized weight
    (kept once built, in the layer's dtype): torch's int8 and int4 CPU kernels unpack the weight for
    every few rows, so a bf16 prefill of 150 tokens runs 1.7x faster by the dequantized weight. The
    target uses it for every bf16 pass (decoding one request and verifying its blocks keep the kernels,
    a prefill or a large batch does not), but not with `--exact`: there a token's logits must not
    depend on how many rows share its pass, as they do not with the kernels alone."""
    global _dequantized_from_rows
    before, _dequantized_from_rows = _dequantized_from_rows, min_rows
    try:
        yield
    finally:
        _dequantized_from_rows = before


def _cached_bound(layer: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """`layer.bound_forward(dtype)`, made once per dtype: `forward` is called once per product."""
    cache = layer.__dict__.setdefault("_bound_by_dtype", {})
    if dtype not in cache:
        cache[dtype] = layer.bound_forward(dtype)
    return cache[dtype]


def _dequantized_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A quantized layer's product where its kernel does not apply: by the dequantized weight."""
    return F.linear(x, layer.weight.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


def _bound(layer: nn.Module, kernel, *operands) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (..., k) -> kernel(x as (rows, k), *operands) (+ bias) as (..., n): a quantized layer's
    forward (by the dequantized weight for many rows within `dequantized_products`)."""
    k, n, bias = layer.in_features, layer.out_features, layer.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, k)
        if _dequantized_from_rows is not None and x2.shape[0] >= _dequantized_from_rows:
            return _dequantized_forward(layer, x)
        y = kernel(x2.contiguous(), *operands)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], n)

    return forward


def _concat_biases(layers) -> Optional[torch.Tensor]:
    """The layers' biases end to end (zeros for those without), or None when none has one."""
    biases = [m.bias for m in layers if m.bias is not None]
    if not biases:
        return None
    return torch.cat([m.bias if m.bias is not None else biases[0].new_zeros(m.out_features) for m in layers])


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """Replace `model`'s linear layers (decoder and LM head) in place: by `Int8Linear` for
    `quantization="int8"`; for "int4" by `Int4Linear`, the LM head by `Int8Linear`. "none" leaves
    them. Returns how many were replaced."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization: choose one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                kind = Int4Linear if quantization == "int4" and child is not head else Int8Linear
                setattr(parent, name, kind(child.weight, child.bias))
                replaced += 1
    return replaced
