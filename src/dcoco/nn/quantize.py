"""Weight-only int8 quantization of a target's linear layers (`--quantization int8`).

Decoding on a CPU streams every weight once per step: bf16 weights are 2 bytes a parameter, int8
ones 1. Each output channel keeps its own scale (symmetric: scale = max |w| / 127, w ~ q * scale),
and the product runs in torch's own CPU kernel for int8 weights (`aten._weight_int8pack_mm`:
activations in bf16 or float32, the weight dequantized inside the kernel). The model that results
IS the target: speculative decoding is lossless with respect to it, not to the bf16 model.

Every `nn.Linear` of the decoder and the LM head is replaced; the input embedding keeps its weight,
so a tied LM head gets its own int8 copy. Readers of `.weight` (a drafter's draft-vocabulary rows,
the training losses' target head) get the dequantized weight, built on first use and kept.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError

__all__ = ["QUANTIZATIONS", "Int8Linear", "quantize_linears"]

#: the weight-only quantizations a target can be loaded with
QUANTIZATIONS = ("none", "int8")


class Int8Linear(nn.Module):
    """A frozen linear layer with an int8 weight and one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = w.shape
        self._dequantized: Optional[torch.Tensor] = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in), in the layer's dtype: what the layer multiplies by."""
        if self._dequantized is None:
            self._dequantized = self.qweight.to(self.scale.dtype) * self.scale[:, None]
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # the int8 kernel is torch's CPU one: elsewhere, the dequantized weight
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features).contiguous(), self.qweight, self.scale.to(x.dtype)
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """Replace `model`'s linear layers (decoder and LM head) by `Int8Linear` in place for
    `quantization="int8"`; "none" leaves it. Returns how many were replaced."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization: choose one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
                replaced += 1
    return replaced
