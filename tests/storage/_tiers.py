"""Helpers of the tiered-storage tests: a table module per storage, batches whose distinct
ids fit a small cache, and exports compared by key."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

import veloce
from veloce.ops.hash_table import initialize
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


def train(emb: veloce.DynamicEmbedding, it: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int) -> list[torch.Tensor]:
    """``steps`` training steps of ``emb`` alone on the batches of ``it`` (loss: the
    outputs' squares); the outputs."""
    outs = []
    for _ in range(steps):
        ids, offsets = next(it)
        out = emb(ids, offsets)
        outs.append(out.detach())
        out.square().sum().backward()
        emb.step()
        emb.zero_grad()
    return outs


def apply_table_op(table, model: dict[int, torch.Tensor], k: int, op: str, ids: list[int]) -> None:
    """Op ``k`` of a random sequence on ``table`` and on ``model`` (a dict id -> row):
    ``insert`` writes rows of value ``k``, ``erase`` removes (checking the count), ``train``
    inserts missing ids with the initializer's rows as a training lookup does (then the
    step that releases its pins)."""
    t = torch.tensor(ids, dtype=torch.long)
    if op == "insert":
        table.insert(t, torch.full((len(ids), table.dim), float(k)))
        for i in ids:
            model[i] = torch.full((table.dim,), float(k))
    elif op == "erase":
        assert table.erase(t) == len({i for i in ids if i in model})
        for i in ids:
            model.pop(i, None)
    else:
        table.find_or_insert(t)
        table.after_step()
        init = table.initializer
        fresh = initialize(t, table.dim, table.seed, init.kind, init.a, init.b, table.dtype)
        for i, row in zip(ids, fresh):
            model.setdefault(i, row)


def train_pair(a, b, steps: int, device: str, seed: int = 0, accumulate: int = 1, psw: bool = False) -> None:
    """Trains ``a`` and ``b`` on the same batches (``accumulate`` forwards per step),
    checking that their outputs agree."""
    it = batches(steps * accumulate, seed=seed, device=device)
    for step in range(steps):
        for _ in range(accumulate):
            ids, offsets = next(it)
            w = torch.rand(ids.shape, device=device) if psw else None
            out_a, out_b = a(ids, offsets, w), b(ids, offsets, w)
            torch.testing.assert_close(out_a, out_b, atol=1e-6, rtol=0, msg=lambda m: f"step {step}: {m}")
            loss = torch.arange(1, out_a.shape[1] + 1, device=device, dtype=out_a.dtype)
            (out_a * loss).square().sum().backward()
            (out_b * loss).square().sum().backward()
        a.step(), b.step()
        a.zero_grad(), b.zero_grad()


def assert_same_eval(ref: veloce.DynamicEmbedding, tiered: veloce.DynamicEmbedding, device: str) -> None:
    """Both tables in eval mode give the same outputs on ids they hold and ids they do not
    (a tiered table reads the rows below its cache, changing nothing)."""
    ref.eval(), tiered.eval()
    for ids, offsets in batches(3, seed=99, pool=2500, device=device):
        torch.testing.assert_close(tiered(ids, offsets), ref(ids, offsets), atol=1e-6, rtol=0)
