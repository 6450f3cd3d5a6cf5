"""One training loss per drafter family. Each takes a batch (`dcoco.train.batch`) and returns the
loss and its extras; `predictions` gives the greedy drafts inference makes, `slot_probs` the
distribution T > 0 drafting samples each slot from, and `eval_metrics` the held-out figures."""

from .dcoco import DCOCOLoss
from .dflash import DrafterLoss
from .dspark import DSparkLoss
from .eagle3 import Eagle3Batch, Eagle3Loss, make_eagle3_batch
from .target_head import TargetHead

__all__ = ["DCOCOLoss", "DSparkLoss", "DrafterLoss", "Eagle3Batch", "Eagle3Loss", "TargetHead", "make_eagle3_batch"]
