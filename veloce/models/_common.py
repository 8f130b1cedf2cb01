"""Pieces the models share: MLPs, feature names, the default embedding factory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn

from veloce.embedding import DynamicEmbedding
from veloce.sparse import is_compiling, lookup_many, training_lookup
from veloce.table import insert_beside_updates

EmbeddingFactory = Callable[[int], nn.Module]
"""Builds one embedding module of the given dimension.

The module is called like ``nn.EmbeddingBag`` with a 2-D ``(B, 1)`` int64 input (one id
per bag) and returns ``(B, dim)``. ``veloce.DynamicEmbedding`` is the default; an
``nn.EmbeddingBag`` over hashed ids works too.
"""


def default_embedding_factory(dim: int) -> nn.Module:
    """``veloce.DynamicEmbedding(dim, mode="sum")`` with its other defaults.

    With one id per bag, ``"sum"`` and ``"mean"`` agree and ``"sum"`` skips a division.
    """
    return DynamicEmbedding(dim, mode="sum")


def feature_names(num_sparse: int | Sequence[str]) -> list[str]:
    """Names of the sparse features: the given names, or ``sparse_0 .. sparse_{n-1}``."""
    if isinstance(num_sparse, int):
        if num_sparse < 1:
            raise ValueError(f"num_sparse must be >= 1, got {num_sparse}")
        return [f"sparse_{i}" for i in range(num_sparse)]
    names = [str(n) for n in num_sparse]
    if not names:
        raise ValueError("num_sparse: the list of feature names is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"num_sparse: feature names must be distinct, got {names}")
    bad = [n for n in names if not n or "." in n]
    if bad:
        raise ValueError(f"num_sparse: feature names must be non-empty and contain no '.', got {bad}")
    return names


def mlp(in_dim: int, sizes: Sequence[int], last_activation: bool, name: str) -> nn.Sequential:
    """Linear layers of the given output sizes, ReLU between them (and after the last if asked)."""
    if any(s < 1 for s in sizes):
        raise ValueError(f"{name}: layer sizes must be >= 1, got {tuple(sizes)}")
    layers: list[nn.Module] = []
    for i, out in enumerate(sizes):
        layers.append(nn.Linear(in_dim, out))
        if i < len(sizes) - 1 or last_activation:
            layers.append(nn.ReLU())
        in_dim = out
    return nn.Sequential(*layers)


def make_embeddings(names: list[str], dim: int, factory: EmbeddingFactory | None) -> nn.ModuleDict:
    """One embedding module per feature, keyed by feature name."""
    factory = factory or default_embedding_factory
    return nn.ModuleDict({n: factory(dim) for n in names})


def lookup(embeddings: nn.ModuleDict, sparse: torch.Tensor, model: str) -> list[torch.Tensor]:
    """Looks up column ``i`` of ``sparse`` (B, F) in the ``i``-th embedding: F tensors (B, dim)."""
    modules, cols = _columns(embeddings, sparse, model)
    if all(isinstance(m, DynamicEmbedding) for m in modules):
        return lookup_many(modules, cols)  # one exchange when sharded
    return [emb(c) for c, emb in zip(cols, modules)]


def sparse_lookups(embeddings: nn.ModuleDict, sparse: torch.Tensor, model: str) -> list[tuple[list, list]]:
    """The lookups :func:`lookup` makes, as ``[(tables, inputs)]`` for
    ``HybridParallel.prefetch`` (none when some embedding is not a ``DynamicEmbedding``)."""
    modules, cols = _columns(embeddings, sparse, model)
    return [(modules, cols)] if all(isinstance(m, DynamicEmbedding) for m in modules) else []


def _columns(embeddings: nn.ModuleDict, sparse: torch.Tensor, model: str) -> tuple[list, list[torch.Tensor]]:
    """The embeddings, and column ``i`` of ``sparse`` (B, F) as a (B, 1) input of the ``i``-th."""
    if sparse.dim() != 2 or sparse.shape[1] != len(embeddings):
        raise ValueError(f"{model}: sparse must have shape (B, {len(embeddings)}), got {tuple(sparse.shape)}")
    if sparse.dtype != torch.int64:
        raise ValueError(f"{model}: sparse must be int64, got {sparse.dtype}")
    modules = list(embeddings.values())
    if is_compiling():
        # (F, B) as a graph op: a graph must not read the tables' update state, which changes
        # every step (a guard on it would recompile the graph).
        cols = sparse.t().contiguous()
    else:
        tables = [m.table for m in modules if isinstance(m, DynamicEmbedding) and training_lookup(m)]
        # (F, B): each feature's ids contiguous. Beside a sparse update still in flight, like the
        # inserts that read it (a copy queued on the current stream would wait for the update).
        cols = insert_beside_updates(tables, lambda: sparse.t().contiguous())
    return modules, list(cols.unsqueeze(2).unbind(0))  # one op for every column's (B, 1) view


def check_sizes(num_dense: int, embedding_dim: int, model: str) -> None:
    """The constructor arguments every model shares: num_dense >= 0, embedding_dim >= 1."""
    if num_dense < 0:
        raise ValueError(f"{model}: num_dense must be >= 0, got {num_dense}")
    if embedding_dim < 1:
        raise ValueError(f"{model}: embedding_dim must be >= 1, got {embedding_dim}")


def check_dense(dense: torch.Tensor | None, num_dense: int, batch: int, model: str) -> None:
    if num_dense == 0:
        if dense is not None and dense.numel() != 0:
            raise ValueError(f"{model}: num_dense is 0 but dense has shape {tuple(dense.shape)}")
        return
    if dense is None or dense.dim() != 2 or dense.shape != (batch, num_dense):
        shape = None if dense is None else tuple(dense.shape)
        raise ValueError(f"{model}: dense must have shape ({batch}, {num_dense}), got {shape}")
