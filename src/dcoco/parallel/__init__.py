"""Scale-out for draft training: zigzag context-parallel ring attention with
branch (draft-query) attention, and TapChannel for pipeline-parallel feature taps.

See ``docs/scale_out.md`` for the design and the measured numbers.
"""

from .attention import (
    AttentionKernel,
    FlashAttnKernel,
    TorchAttentionKernel,
    flash_attn_available,
    key_ranges,
    merge_partials,
    select_kernel,
    varlen_runs,
)
from .baseline import allgather_attention
from .branch import BranchSpec, branch_attention, branch_owners, dflash_spec, eagle3_ttt_spec, expand_blocks
from .comm import CommStats
from .draft_loss import ContextShard, allreduce_gradients
from .errors import (
    BranchSpecError,
    LayoutError,
    ParallelError,
    ShapeMismatchError,
    TapChannelError,
    TapClosedError,
    TapShapeError,
    TapSlotsExhaustedError,
    TapTimeoutError,
    WorldSizeMismatchError,
)
from .ring import ring_attention, zigzag_ring_attention
from .tap_channel import TapChannel
from .zigzag import ZigzagLayout

__all__ = [
    "AttentionKernel",
    "BranchSpec",
    "BranchSpecError",
    "CommStats",
    "ContextShard",
    "FlashAttnKernel",
    "LayoutError",
    "ParallelError",
    "ShapeMismatchError",
    "TapChannel",
    "TapChannelError",
    "TapClosedError",
    "TapShapeError",
    "TapSlotsExhaustedError",
    "TapTimeoutError",
    "TorchAttentionKernel",
    "WorldSizeMismatchError",
    "ZigzagLayout",
    "allgather_attention",
    "allreduce_gradients",
    "branch_attention",
    "branch_owners",
    "dflash_spec",
    "eagle3_ttt_spec",
    "expand_blocks",
    "flash_attn_available",
    "key_ranges",
    "merge_partials",
    "ring_attention",
    "select_kernel",
    "varlen_runs",
    "zigzag_ring_attention",
]
