"""Helpers of the tiered-storage tests: a table module per storage, batches whose distinct
ids fit a small cache, and exports compared by key."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

import veloce
from veloce.storage import HostCached

DIM = 8


def make(storage: Optional[veloce.storage.StorageSpec] = None, optimizer=None, mode: str = "sum",
         device: str = "cpu", **kwargs) -> veloce.DynamicEmbedding:  # fmt: skip
    """A small table; the same seed and initializer for every storage."""
    optimizer = veloce.optim.Adam(lr=0.01) if optimizer is None else optimizer
    kwargs.setdefault("seed", 7)
    return veloce.DynamicEmbedding(DIM, mode=mode, optimizer=optimizer, storage=storage, device=device, **kwargs)


def cached(rows: int = 64, **kwargs) -> HostCached:
    return HostCached(cache_rows=rows, **kwargs)


def batches(steps: int, seed: int = 0, pool: int = 2000, distinct: int = 48, n: int = 256,
            bags: int = 64, device: str = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """``steps`` batches of ``n`` ids with repeats: ``distinct`` ids of ``range(pool)`` each
    (a working set far larger than a small cache), in ``bags`` bags."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        chosen = torch.randperm(pool, generator=g)[:distinct]
        ids = chosen[torch.randint(0, distinct, (n,), generator=g)]
        offsets = torch.sort(torch.randint(0, n, (bags,), generator=g)).values
        offsets[0] = 0
        yield ids.to(device), offsets.to(device)


def by_key(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An export's tensors in ascending key order, on the CPU."""
    order = entries["keys"].cpu().argsort()
    return {k: v.cpu()[order] for k, v in entries.items() if k != "step"}


def assert_same_entries(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    a, b = by_key(a), by_key(b)
    assert torch.equal(a["keys"], b["keys"])
    torch.testing.assert_close(a["weights"], b["weights"], atol=atol, rtol=0)
    torch.testing.assert_close(a["optimizer_state"], b["optimizer_state"], atol=atol, rtol=0)
    assert torch.equal(a["scores"], b["scores"])
