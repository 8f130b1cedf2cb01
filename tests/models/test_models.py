"""veloce.models: shapes, reference forwards, and learning on the synthetic data.

The models take an embedding factory; until ``veloce.DynamicEmbedding`` is wired in, these
tests use ``HashedEmbeddingBag``: an ``nn.EmbeddingBag`` over ids hashed into a fixed range.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import veloce
from veloce.data import SyntheticClicks
from veloce.metrics import AUC
from veloce.models import DLRM, DeepFM, default_embedding_factory


class HashedEmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` over ``id mod num_buckets``: accepts any int64 id."""

    def __init__(self, dim: int, num_buckets: int = 2**12, mode: str = "sum") -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.bag = nn.EmbeddingBag(num_buckets, dim, mode=mode)
        nn.init.normal_(self.bag.weight, std=0.01)

    def forward(self, input, offsets=None, per_sample_weights=None):
        return self.bag(torch.remainder(input, self.num_buckets), offsets, per_sample_weights)


def hashed(dim: int) -> nn.Module:
    return HashedEmbeddingBag(dim)


def batch(b: int = 8, num_dense: int = 13, num_sparse: int = 26, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(b, num_dense, generator=g)
    sparse = torch.randint(-(2**62), 2**62, (b, num_sparse), generator=g)
    return dense, sparse


# ---------------------------------------------------------------------------------- shapes and config


@pytest.mark.parametrize("cls", [DLRM, DeepFM])
def test_forward_shapes_and_factory_calls(cls):
    dims = []

    def factory(dim):
        dims.append(dim)
        return hashed(dim)

    model = cls(
        13, 26, embedding_dim=8, embedding_factory=factory, **({"bottom_mlp": (32, 8)} if cls is DLRM else {})
    )
    dense, sparse = batch()
    out = model(dense, sparse)
    assert out.shape == (8,) and out.dtype == torch.float32
    assert dims == [8] * 26 if cls is DLRM else dims == [8] * 26 + [1] * 26
    assert len(model.embeddings) == 26
    out.sum().backward()
    assert model.embeddings["sparse_0"].bag.weight.grad is not None


@pytest.mark.parametrize("cls", [DLRM, DeepFM])
def test_named_features_and_no_dense(cls):
    model = cls(
        0,
        ["user", "item", "genre"],
        embedding_dim=4,
        embedding_factory=hashed,
        **({"bottom_mlp": ()} if cls is DLRM else {}),
    )
    assert list(model.embeddings) == ["user", "item", "genre"]
    _, sparse = batch(num_sparse=3)
    assert model(None, sparse).shape == (8,)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="bottom_mlp's last size must equal embedding_dim=16"):
        DLRM(13, 26, embedding_dim=16, bottom_mlp=(64, 8), embedding_factory=hashed)
    with pytest.raises(ValueError, match="top_mlp's last size must be 1"):
        DLRM(13, 26, top_mlp=(64, 2), embedding_factory=hashed)
    with pytest.raises(ValueError, match="feature names must be distinct"):
        DeepFM(13, ["a", "a"], embedding_factory=hashed)
    model = DLRM(13, 4, embedding_factory=hashed)
    dense, sparse = batch(num_sparse=4)
    with pytest.raises(ValueError, match=r"sparse must have shape \(B, 4\), got \(8, 5\)"):
        model(dense, torch.zeros(8, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="sparse must be int64"):
        model(dense, sparse.int())
    with pytest.raises(ValueError, match=r"dense must have shape \(8, 13\), got \(8, 12\)"):
        model(dense[:, :12], sparse)


def test_default_factory_is_dynamic_embedding_or_says_what_to_do():
    if hasattr(veloce, "DynamicEmbedding"):
        assert isinstance(default_embedding_factory(4), veloce.DynamicEmbedding)
    else:
        with pytest.raises(ImportError, match="pass embedding_factory="):
            DLRM(13, 26)


# ---------------------------------------------------------------------------------- reference forwards


def test_dlrm_matches_reference_forward():
    torch.manual_seed(0)
    model = DLRM(5, 3, embedding_dim=4, bottom_mlp=(6, 4), top_mlp=(7, 1), embedding_factory=hashed)
    dense, sparse = batch(b=5, num_dense=5, num_sparse=3)
    x = model.bottom(dense)
    vecs = [x] + [model.embeddings[n](sparse[:, i : i + 1]) for i, n in enumerate(model.feature_names)]
    dots = [(vecs[i] * vecs[j]).sum(1) for i in range(len(vecs)) for j in range(i)]  # pairs i > j
    ref = model.top(torch.cat([x, torch.stack(dots, 1)], 1)).squeeze(-1)
    torch.testing.assert_close(model(dense, sparse), ref)


def test_deepfm_matches_reference_forward():
    torch.manual_seed(0)
    model = DeepFM(5, 3, embedding_dim=4, deep_mlp=(7,), embedding_factory=hashed)
    dense, sparse = batch(b=5, num_dense=5, num_sparse=3)
    vecs = [model.embeddings[n](sparse[:, i : i + 1]) for i, n in enumerate(model.feature_names)]
    vecs.append(model.dense_field(dense))
    first = sum(
        model.first_order[n](sparse[:, i : i + 1]).squeeze(1) for i, n in enumerate(model.feature_names)
    )
    first = first + model.dense_linear(dense).squeeze(1) + model.bias
    fm = sum((vecs[i] * vecs[j]).sum(1) for i in range(len(vecs)) for j in range(i))
    deep = model.deep(torch.cat(vecs, 1)).squeeze(1)
    torch.testing.assert_close(model(dense, sparse), first + fm + deep)


# ---------------------------------------------------------------------------------- learning


@pytest.fixture
def one_thread():
    """Small models train several times faster on one thread than on two busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_and_auc(
    model: nn.Module, steps: int, lr: float, batch_size: int = 256
) -> tuple[list[float], float]:
    torch.manual_seed(0)
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)  # dense gradients: the hashed tables are small
    losses = []
    for (dense, sparse), label in SyntheticClicks(steps * batch_size, batch_size=batch_size, seed=0):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    auc = AUC()
    with torch.no_grad():
        for (dense, sparse), label in SyntheticClicks(10_000, batch_size=5000, seed=0, start=10**8):
            auc.update(model(dense, sparse), label)
    return losses, auc.compute()


class LogisticRegression(nn.Module):
    """One learned weight per id of each feature plus a linear dense term."""

    def __init__(self, num_dense: int = 13, num_sparse: int = 26) -> None:
        super().__init__()
        self.weights = nn.ModuleList(HashedEmbeddingBag(1) for _ in range(num_sparse))
        self.dense = nn.Linear(num_dense, 1)

    def forward(self, dense, sparse):
        per_feature = [w(sparse[:, i : i + 1]) for i, w in enumerate(self.weights)]
        return torch.cat(per_feature, 1).sum(1) + self.dense(dense).squeeze(1)


def test_logistic_regression_learns_synthetic_clicks(one_thread):
    _losses, auc = train_and_auc(LogisticRegression(), steps=200, lr=0.1)
    assert auc > 0.6, auc


@pytest.mark.parametrize("cls", [DLRM, DeepFM])
def test_training_reduces_loss_and_learns(one_thread, cls):
    if cls is DLRM:
        model = DLRM(13, 26, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), embedding_factory=hashed)
    else:
        model = DeepFM(13, 26, embedding_dim=8, deep_mlp=(32,), embedding_factory=hashed)
    losses, auc = train_and_auc(model, steps=200, lr=0.05)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < first - 0.02, (first, last)
    assert auc > 0.6, auc


@pytest.mark.parametrize("cls", [DLRM, DeepFM])
def test_training_with_dynamic_embedding_learns(one_thread, cls):
    """The real thing: raw int64 ids into DynamicEmbedding tables, dense Adam + sparse
    Adagrad through CombinedOptimizer, no vocabulary anywhere."""
    torch.manual_seed(0)

    def table(dim: int) -> nn.Module:
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=64, optimizer=veloce.optim.Adagrad(lr=0.05))

    if cls is DLRM:
        model = DLRM(13, 26, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), embedding_factory=table)
    else:
        model = DeepFM(13, 26, embedding_dim=8, deep_mlp=(32,), embedding_factory=table)
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3), model)
    losses = []
    for (dense, sparse), label in SyntheticClicks(200 * 256, batch_size=256, seed=0):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    auc = AUC()
    tables = [m for m in model.modules() if isinstance(m, veloce.DynamicEmbedding)]
    sizes = [len(t) for t in tables]
    with torch.no_grad():
        for (dense, sparse), label in SyntheticClicks(10_000, batch_size=5000, seed=0, start=10**8):
            auc.update(model(dense, sparse), label)
    assert [len(t) for t in tables] == sizes  # eval never inserts
    assert sum(sizes) > 26 * 64  # tables grew past their initial capacity from raw ids
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < first - 0.02, (first, last)
    assert auc.compute() > 0.6
