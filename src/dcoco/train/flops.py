"""Floating-point operations a training step performs, to log achieved TFLOPS against the machine's
matmul peak (`scripts/train_throughput.py`).

torch's `FlopCounterMode` counts matrix products and attention from the operators that run, so the
figure follows whatever the step does (any family, online features or stored). It does not know
two CPU operators the step uses, registered here with torch's own formulas: the oneDNN linear of the
target's prepacked weights (`dcoco.nn.prepack`) and the CPU flash-attention kernel (forward and
backward; counted as full, unmasked attention, as torch counts the others). Elementwise work is not
counted: the figure is matmul FLOPs, the work the matrix units can do.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils import flop_counter as fc

aten = torch.ops.aten


def _register() -> None:
    if aten._scaled_dot_product_flash_attention_for_cpu in fc.flop_registry:  # once per process
        return

    def packed_linear_flop(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        rows = 1
        for d in x_shape[:-1]:
            rows *= d
        return 2 * rows * w_shape[0] * w_shape[1]

    try:
        fc.register_flop_formula(torch.ops.mkldnn._linear_pointwise)(packed_linear_flop)
    except (AttributeError, RuntimeError):  # a torch build without oneDNN: no prepacked linears either
        pass
    # torch's own formulas, already shape-wrapped (get_raw: not wrapped twice)
    fc.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu, get_raw=True)(fc.sdpa_flop)
    fc.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward, get_raw=True)(
        fc.sdpa_backward_flop
    )


class StepFlops:
    """`with counter.counting(): step()`, then `counter.total`: the matmul FLOPs of what ran inside."""

    def __init__(self) -> None:
        _register()
        self.total = 0

    @contextmanager
    def counting(self):
        mode = fc.FlopCounterMode(display=False)
        with mode:
            yield
        self.total = mode.get_total_flops()
