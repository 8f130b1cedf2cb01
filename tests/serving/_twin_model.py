"""A small two-table model with dense parameters and buffers, its training and its batches,
shared by the serving tests (and run by the killed publisher's subprocess)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import veloce


class TwoTables(nn.Module):
    """A sum table with per-sample weights, a max (``second_mode``) table with a padding id, a linear layer
    and a batch norm (its running statistics are buffers), all on ``device``."""

    def __init__(self, storage: Optional[veloce.storage.StorageSpec] = None, max_capacity: int = 96,
                 dim: int = 8, eviction: str = "lru", second_mode: str = "max", admission=None,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.a = veloce.DynamicEmbedding(dim, mode="sum", max_capacity=max_capacity, storage=storage, eviction=eviction,
                                         optimizer=veloce.optim.Adagrad(lr=0.1), seed=3, admission=admission,
                                         device=device)  # fmt: skip
        self.tables = nn.ModuleList([veloce.DynamicEmbedding(dim, mode=second_mode, padding_idx=0, unknown="zeros",
                                                             optimizer=veloce.optim.SGD(lr=0.1), device=device)])  # fmt: skip
        self.norm = nn.BatchNorm1d(2 * dim, device=device)
        self.head = nn.Linear(2 * dim, 1, device=device)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.cat([self.a(x, per_sample_weights=w), self.tables[0](x)], 1)))


class Trainer:
    """Steps of a TwoTables model on random batches (deterministic for a seed: drawn on the
    host, then moved to the model's device)."""

    def __init__(self, model: TwoTables, seed: int = 0, pool: int = 300) -> None:
        self.model, self.pool = model, pool
        self.device = model.head.weight.device
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def batch(self, n: int = 16, pool: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, pool or self.pool, (n, 4), generator=self.gen)
        return x.to(self.device), torch.rand(n, 4, generator=self.gen).to(self.device)

    def steps(self, k: int) -> None:
        m = self.model
        m.train()
        for _ in range(k):
            m(*self.batch()).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            veloce.step_tables([t for t in m.modules() if isinstance(t, veloce.DynamicEmbedding)])


def eval_batches(trainer: Trainer, k: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches with ids the model never saw too (their rows: the initializer's, or zeros)."""
    return [trainer.batch(32, pool=2 * trainer.pool) for _ in range(k)]
