"""Sharded tables tiered on every rank: HybridParallel over HostCached or RocksDB tables (each
rank's shard a cache over its own store) trains as one process with the table on its device."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import veloce
from _dist import run_ranks
from _tiers import assert_same_entries, make
from veloce.distributed import HybridParallel
from veloce.ops import rocksdb as rocksdb_ops
from veloce.storage import HostCached, RocksDB

STEPS, BAGS, LEN = 15, 16, 4


class _Model(nn.Module):
    def __init__(self, storage) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = make(storage, optimizer=veloce.optim.Adagrad(lr=0.1))
        self.head = nn.Linear(self.emb.embedding_dim, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids, offsets)).squeeze(1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    chosen = torch.randperm(500, generator=g)[:30]  # 30 distinct ids a step, over 500
    return chosen[torch.randint(0, 30, (BAGS * LEN,), generator=g)], torch.rand(BAGS, generator=g)


def _train(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    opt = veloce.CombinedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    per = BAGS // world
    outs = []
    for step in range(STEPS):
        ids, labels = _batch(step)
        mine = ids[rank * per * LEN:(rank + 1) * per * LEN]
        out = model(mine, torch.arange(0, mine.numel(), LEN))
        loss = (out - labels[rank * per:(rank + 1) * per]).square().sum() * world / BAGS
        loss.backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs


def _rank_body(rank: int, world: int, tiered: bool = True, sparse: str = "sync", rocksdb: str | None = None) -> dict:
    # evict_fraction=1: whenever the cache needs room, every unpinned row is written back
    fraction = 1.0 if sparse == "async" else 1 / 32
    if rocksdb is not None:  # each rank's shard in its own database, path/rank<R>
        storage = RocksDB(rocksdb, cache_rows=40, evict_fraction=fraction)
    else:
        storage = HostCached(cache_rows=40, evict_fraction=fraction) if tiered else None
    model = _Model(storage)
    outs = _train(HybridParallel(model, sparse=sparse, staleness=1), rank, world)
    stats = model.emb.stats()
    return {"outs": outs, "entries": _merged([model.emb.export()]), "stats": stats}


def _merged(exports: list[dict]) -> dict:
    return {k: torch.cat([e[k] for e in exports]) for k in ("keys", "weights", "optimizer_state", "scores")}


def test_hybrid_parallel_shards_are_tiered_on_every_rank():
    world = 2
    results = run_ranks(_rank_body, world, timeout=120)
    ref = _Model(None)
    ref_outs = _train(ref, 0, 1)
    for step in range(STEPS):
        got = torch.cat([r["outs"][step] for r in results])
        torch.testing.assert_close(got, ref_outs[step], atol=1e-5, rtol=1e-5)
    assert_same_entries(_merged([r["entries"] for r in results]), ref.emb.export(), atol=1e-5)
    for r in results:  # each shard moved rows between its tiers
        assert r["stats"]["store_rows"] > 0 and r["stats"]["written_back"] > 0


@pytest.mark.skipif(not rocksdb_ops.available(), reason="veloce._rocksdb is not built (apt-get install "
                    "librocksdb-dev, then rebuild)")  # fmt: skip
def test_hybrid_parallel_shards_on_rocksdb_each_in_its_ranks_database(tmp_path):
    results = run_ranks(_rank_body, 2, True, "sync", str(tmp_path / "db"), timeout=120)
    ref = _Model(None)
    ref_outs = _train(ref, 0, 1)
    for step in range(STEPS):
        torch.testing.assert_close(torch.cat([r["outs"][step] for r in results]), ref_outs[step], atol=1e-5, rtol=1e-5)
    assert_same_entries(_merged([r["entries"] for r in results]), ref.emb.export(), atol=1e-5)
    assert sorted(os.listdir(tmp_path / "db")) == ["rank0", "rank1"]
    assert all(r["stats"]["store_rows"] > 0 for r in results)


def test_async_shards_keep_rows_until_their_late_gradients_land():
    # staleness 1: a step's gradients reach the owners' tables one step later; the rows they
    # update stay cached meanwhile (hold_pins), so the tiered run is the device run
    tiered = run_ranks(_rank_body, 2, True, "async", timeout=120)
    device = run_ranks(_rank_body, 2, False, "async", timeout=120)
    for a, b in zip(tiered, device):
        for x, y in zip(a["outs"], b["outs"]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
        assert_same_entries(a["entries"], b["entries"])
