"""Fine-tuning.

:class:`FinetuneConfig`, :func:`finetune` (checkpoint folder in, fine-tuned folder out), :func:`train_model`.
"""

from symfuse.train.finetune import TRAIN_REPORT, FinetuneConfig, finetune, train_model

__all__ = ["TRAIN_REPORT", "FinetuneConfig", "finetune", "train_model"]
