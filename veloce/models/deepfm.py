"""DeepFM: a first-order term, a factorisation machine and an MLP over shared embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from veloce.models._common import (
    EmbeddingFactory, check_dense, check_sizes, feature_names, lookup, make_embeddings, mlp, sparse_lookups,
)  # fmt: skip


class DeepFM(nn.Module):
    """DeepFM (Guo et al., 2017) with dense features as one extra field.

    ``logit = first_order + fm + deep``:

    - first order: a learned scalar per id of every sparse feature (embeddings of
      dimension 1) plus a linear term on the dense features (and a bias);
    - FM: the sum of dot products of every pair of field vectors, computed as
      ``0.5 * ((sum v)^2 - sum v^2)``; the field vectors are the sparse features'
      embeddings and, when there are dense features, a linear projection of them;
    - deep: an MLP over the concatenated field vectors.

    Args:
        num_dense: number of dense features; 0 for none.
        num_sparse: number of sparse features, or their names.
        embedding_dim: dimension of the field vectors.
        deep_mlp: hidden sizes of the deep part (a final layer of size 1 is added).
        embedding_factory: ``factory(dim) -> module`` builds each embedding (called with
            ``embedding_dim`` and with 1 for every feature); None uses
            ``veloce.DynamicEmbedding(dim, mode="sum")``.

    Shape:
        - dense: ``(B, num_dense)`` float (or None when ``num_dense == 0``).
        - sparse: ``(B, F)`` int64 raw ids.
        - output: ``(B,)`` logits.

    Example::

        >>> model = DeepFM(num_dense=13, num_sparse=26, embedding_dim=16)
        >>> logits = model(torch.randn(32, 13), torch.randint(-2**40, 2**40, (32, 26)))
        >>> logits.shape
        torch.Size([32])
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int | Sequence[str],
        embedding_dim: int = 16,
        deep_mlp: Sequence[int] = (64, 32),
        embedding_factory: EmbeddingFactory | None = None,
    ) -> None:
        super().__init__()
        check_sizes(num_dense, embedding_dim, "DeepFM")
        self.num_dense = num_dense
        self.feature_names = feature_names(num_sparse)
        self.embedding_dim = embedding_dim
        self.embeddings = make_embeddings(self.feature_names, embedding_dim, embedding_factory)
        self.first_order = make_embeddings(self.feature_names, 1, embedding_factory)
        self.bias = nn.Parameter(torch.zeros(()))
        self.dense_linear = nn.Linear(num_dense, 1, bias=False) if num_dense else None  # first order
        self.dense_field = nn.Linear(num_dense, embedding_dim, bias=False) if num_dense else None
        fields = len(self.feature_names) + (1 if num_dense else 0)
        self.deep = mlp(
            fields * embedding_dim, [*deep_mlp, 1], last_activation=False, name="DeepFM: deep_mlp"
        )

    def sparse_lookups(self, dense: torch.Tensor | None, sparse: torch.Tensor) -> list[tuple[list, list]]:
        """The table lookups ``forward(dense, sparse)`` makes, in order, as ``[(tables,
        inputs)]`` (for :meth:`veloce.distributed.HybridParallel.prefetch`)."""
        return sparse_lookups(self.embeddings, sparse, "DeepFM") + sparse_lookups(self.first_order, sparse, "DeepFM")

    def forward(self, dense: torch.Tensor | None, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits of a batch.

        Args:
            dense: ``(B, num_dense)`` dense features (None if ``num_dense == 0``).
            sparse: ``(B, F)`` int64 ids.

        Returns:
            ``(B,)`` logits.
        """
        b = sparse.shape[0]
        vecs = lookup(self.embeddings, sparse, "DeepFM")
        check_dense(dense, self.num_dense, b, "DeepFM")
        first = torch.cat(lookup(self.first_order, sparse, "DeepFM"), dim=1).sum(dim=1) + self.bias  # (B,)
        if self.dense_linear is not None and self.dense_field is not None:
            first = first + self.dense_linear(dense).squeeze(-1)
            vecs = vecs + [self.dense_field(dense)]
        v = torch.stack(vecs, dim=1)  # (B, fields, D)
        fm = 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)  # (B,)
        deep = self.deep(v.reshape(b, -1)).squeeze(-1)
        return first + fm + deep
