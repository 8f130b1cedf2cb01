"""DynamicEmbedding loses no quality against a vocabulary: DLRM on the real Criteo sample.

The sample's 8,018 rows are in time order: the first 85% train (one epoch), the last 15%
validate. Three DLRMs differ only in their embeddings:

- ``dynamic``: ``veloce.DynamicEmbedding`` on the raw ids (no vocabulary);
- ``vocab``: ``nn.EmbeddingBag`` over a vocabulary of the training ids (exact ids; ids
  unseen in training share row 0);
- ``hashed``: ``nn.EmbeddingBag`` over ids hashed into 2**16 buckets per feature (reported only).

Everything else is the same: dense weights (same seed), batch size, initial distribution of
the rows (normal, std 0.01), Adagrad with the same learning rate for rows (veloce's fused
Adagrad, or ``torch.optim.Adagrad`` on sparse gradients) and for the dense part. The AUCs
are averaged over seeds; dynamic and vocab must agree within 0.005.
Figures: benchmarks/results/criteo_auc.md.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

import veloce
from veloce.data import CriteoTSV
from veloce.models import DLRM

from conftest import data_dir

SAMPLE = data_dir() / "criteo" / "criteo_kaggle_train_sample.tsv"
pytestmark = pytest.mark.skipif(
    not SAMPLE.is_file(), reason=f"Criteo sample not found: {SAMPLE} (set VELOCE_DATA_DIR)"
)

SEEDS = (0, 1, 2, 3, 4)
BATCH, DIM, INIT_STD = 128, 16, 0.01
DENSE_LR, SPARSE_LR = 0.02, 0.05
VAL_FRACTION = 0.15
HASH_BUCKETS = 1 << 16


@pytest.fixture(scope="module")
def criteo():
    """(dense, sparse, label, split): every row of the sample, and the first validation row."""
    (dense, sparse), label = next(iter(CriteoTSV(SAMPLE, batch_size=1 << 20)))
    return dense, sparse, label, int(len(label) * (1 - VAL_FRACTION))


def vocabulary_ids(sparse: torch.Tensor, split: int) -> tuple[torch.Tensor, list[int]]:
    """Per feature, ids of the training rows -> 1..V (sorted), any other id -> 0; and the V + 1 sizes."""
    out, sizes = torch.empty_like(sparse), []
    for f in range(sparse.shape[1]):
        col = sparse[:, f].contiguous()
        vocab = torch.unique(col[:split])
        pos = torch.searchsorted(vocab, col).clamp(max=len(vocab) - 1)
        out[:, f] = torch.where(vocab[pos] == col, pos + 1, 0)
        sizes.append(len(vocab) + 1)
    return out, sizes


def embedding_bag(num: int, seed: int) -> nn.EmbeddingBag:
    """Rows drawn from normal(0, INIT_STD) by their own generator, so the dense layers' init
    (drawn from torch's global RNG) is the same as with DynamicEmbedding."""
    weight = torch.empty(num, DIM).normal_(0.0, INIT_STD, generator=torch.Generator().manual_seed(seed))
    return nn.EmbeddingBag(num, DIM, mode="sum", sparse=True, _weight=weight)


def variant(name: str, sparse: torch.Tensor, split: int, seed: int):
    """(ids the model sees, embedding factory) of one variant."""
    if name == "dynamic":
        return sparse, lambda dim: veloce.DynamicEmbedding(
            dim, mode="sum", initializer=veloce.init.normal(std=INIT_STD), optimizer=veloce.optim.Adagrad(lr=SPARSE_LR),
            seed=seed)  # fmt: skip
    if name == "vocab":
        ids, sizes = vocabulary_ids(sparse, split)
        it = iter(sizes)
        return ids, lambda dim: embedding_bag(next(it), seed)
    return torch.remainder(sparse, HASH_BUCKETS), lambda dim: embedding_bag(HASH_BUCKETS, seed)


def batches(dense, ids, label, lo: int, hi: int, size: int) -> list:
    return [((dense[i : min(i + size, hi)], ids[i : min(i + size, hi)]), label[i : min(i + size, hi)])
            for i in range(lo, hi, size)]  # fmt: skip


def validation_auc(name: str, criteo, seed: int) -> float:
    dense, sparse, label, split = criteo
    ids, factory = variant(name, sparse, split, seed)
    torch.manual_seed(seed)
    model = DLRM(13, 26, DIM, embedding_factory=factory)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    bag_params = [p for n, p in model.named_parameters() if n.startswith("embeddings.")]  # none for dynamic
    groups = [{"params": dense_params, "lr": DENSE_LR}] + ([{"params": bag_params, "lr": SPARSE_LR}] if bag_params else [])
    trainer = veloce.Trainer(model, optimizer=torch.optim.Adagrad(groups), metrics={"auc": veloce.metrics.AUC()},
                             progress=False, seed=seed)  # fmt: skip
    history = trainer.fit(batches(dense, ids, label, 0, split, BATCH), batches(dense, ids, label, split, len(label), 4096))
    return history[0]["val_auc"]


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch.optim.Adagrad on sparse grads
def test_dynamic_embedding_matches_a_vocabulary_on_criteo(criteo):
    dense, sparse, label, split = criteo
    assert split > 6000 and len(label) - split > 1000  # enough rows for the comparison to mean something
    aucs, seconds = {}, {}
    for name in ("dynamic", "vocab", "hashed"):
        start = time.perf_counter()
        aucs[name] = [validation_auc(name, criteo, seed) for seed in SEEDS]
        seconds[name] = time.perf_counter() - start
        print(f"{name:8s} AUC per seed {[round(a, 4) for a in aucs[name]]}  mean {np.mean(aucs[name]):.4f}  "
              f"({seconds[name]:.1f} s for {len(SEEDS)} runs)")  # fmt: skip
    dyn, vocab = float(np.mean(aucs["dynamic"])), float(np.mean(aucs["vocab"]))
    assert dyn > 0.70, f"DynamicEmbedding DLRM learned too little: mean AUC {dyn:.4f}"
    assert abs(dyn - vocab) <= 0.005, f"mean AUC: dynamic {dyn:.4f} vs vocabulary {vocab:.4f}"
