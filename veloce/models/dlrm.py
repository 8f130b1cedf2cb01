"""DLRM: bottom MLP on dense features, one embedding per sparse feature, dot interaction, top MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from veloce.models._common import (
    EmbeddingFactory, check_dense, check_sizes, feature_names, lookup, make_embeddings, mlp, sparse_lookups,
)  # fmt: skip


class DLRM(nn.Module):
    """Deep Learning Recommendation Model (Naumov et al., 2019) with the dot interaction.

    The bottom MLP maps the dense features to one ``embedding_dim`` vector; each sparse
    feature is looked up in its own embedding (one id per sample). The dot products of
    every pair of these ``F + 1`` vectors, with the bottom MLP's output, feed the top MLP,
    whose single output is the click logit.

    Args:
        num_dense: number of dense features; 0 for none (no bottom MLP).
        num_sparse: number of sparse features, or their names (the keys of
            ``self.embeddings``; default names are ``sparse_0`` ...).
        embedding_dim: dimension of every embedding.
        bottom_mlp: output sizes of the bottom MLP's layers; the last must equal
            ``embedding_dim``. Ignored when ``num_dense == 0``.
        top_mlp: output sizes of the top MLP's layers; the last must be 1.
        embedding_factory: ``factory(dim) -> module`` builds each embedding; None uses
            ``veloce.DynamicEmbedding(dim, mode="sum")``. The module is called with a
            ``(B, 1)`` int64 tensor of ids and returns ``(B, dim)``.

    Shape:
        - dense: ``(B, num_dense)`` float (or None when ``num_dense == 0``).
        - sparse: ``(B, F)`` int64 raw ids, column ``i`` for feature ``i``.
        - output: ``(B,)`` logits.

    Example::

        >>> model = DLRM(num_dense=13, num_sparse=26, embedding_dim=16)
        >>> logits = model(torch.randn(32, 13), torch.randint(-2**40, 2**40, (32, 26)))
        >>> logits.shape
        torch.Size([32])
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int | Sequence[str],
        embedding_dim: int = 16,
        bottom_mlp: Sequence[int] = (64, 16),
        top_mlp: Sequence[int] = (64, 32, 1),
        embedding_factory: EmbeddingFactory | None = None,
    ) -> None:
        super().__init__()
        check_sizes(num_dense, embedding_dim, "DLRM")
        if num_dense and (not bottom_mlp or bottom_mlp[-1] != embedding_dim):
            raise ValueError(
                f"DLRM: bottom_mlp's last size must equal embedding_dim={embedding_dim}, got {tuple(bottom_mlp)}"
            )
        if not top_mlp or top_mlp[-1] != 1:
            raise ValueError(f"DLRM: top_mlp's last size must be 1 (the logit), got {tuple(top_mlp)}")
        self.num_dense = num_dense
        self.feature_names = feature_names(num_sparse)
        self.embedding_dim = embedding_dim
        self.bottom = (
            mlp(num_dense, bottom_mlp, last_activation=True, name="DLRM: bottom_mlp") if num_dense else None
        )
        self.embeddings = make_embeddings(self.feature_names, embedding_dim, embedding_factory)
        n = len(self.feature_names) + (1 if num_dense else 0)  # vectors that interact
        li, lj = torch.tril_indices(n, n, offset=-1)
        # Positions of the pairs in the flattened (n, n) products: one index_select (whose
        # backward is an index_add) instead of advanced indexing (a slow index_put backward).
        # A constant, so a plain attribute that _apply moves with the model, not a buffer: DDP
        # would broadcast a buffer from rank 0 before every forward.
        self._pairs = li * n + lj
        top_in = n * (n - 1) // 2 + (embedding_dim if num_dense else 0)
        self.top = mlp(top_in, top_mlp, last_activation=False, name="DLRM: top_mlp")

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), ...: _pairs goes along
        self._pairs = fn(self._pairs)
        return super()._apply(fn, recurse)

    def sparse_lookups(self, dense: torch.Tensor | None, sparse: torch.Tensor) -> list[tuple[list, list]]:
        """The table lookups ``forward(dense, sparse)`` makes, in order, as ``[(tables,
        inputs)]`` (for :meth:`veloce.distributed.HybridParallel.prefetch`)."""
        return sparse_lookups(self.embeddings, sparse, "DLRM")

    def forward(self, dense: torch.Tensor | None, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits of a batch.

        Args:
            dense: ``(B, num_dense)`` dense features (None if ``num_dense == 0``).
            sparse: ``(B, F)`` int64 ids.

        Returns:
            ``(B,)`` logits.
        """
        vecs = lookup(self.embeddings, sparse, "DLRM")
        check_dense(dense, self.num_dense, sparse.shape[0], "DLRM")
        if self.bottom is not None:
            x = self.bottom(dense)
            vecs = [x] + vecs
        t = torch.stack(vecs, dim=1)  # (B, n, D)
        z = torch.bmm(t, t.transpose(1, 2))  # (B, n, n)
        inter = z.flatten(1).index_select(1, self._pairs)  # (B, n(n-1)/2)
        top_in = torch.cat([x, inter], dim=1) if self.bottom is not None else inter
        return self.top(top_in).squeeze(-1)
