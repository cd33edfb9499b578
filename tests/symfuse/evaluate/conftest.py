"""Tiny fine-tuned classifiers shared by the evaluation tests (one fine-tune per dataset per session)."""

from __future__ import annotations

import pytest

from symfuse.train import FinetuneConfig, finetune
from tests.symfuse.train.helpers import save_tiny_base


@pytest.fixture(scope="session")
def heads(tmp_path_factory):
    """Checkpoint folders of a tiny BERT fine-tuned on isear, meld, crowdflower and sst2 (one epoch, 32 examples)."""
    root = tmp_path_factory.mktemp("heads")
    base = save_tiny_base(root / "base")
    cfg = FinetuneConfig(epochs=1, lr=1e-3, batch_size=8, max_length=32, max_train_examples=32,
                         max_eval_examples=16, progress=False)  # fmt: skip
    return {n: finetune(base, n, root / n, cfg) for n in ("isear", "meld", "crowdflower", "sst2")}
