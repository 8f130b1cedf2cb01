"""Two ranks (gloo) training a HybridParallel model publish one consistent version per
publication: every rank's shard of every table, one manifest, read back whole by a
single-process inference twin."""

from __future__ import annotations

import torch

import veloce
from _dist import run_ranks
from _twin_model import TwoTables
from veloce.distributed import HybridParallel
from veloce.serving import FileStore, Publisher, inference_twin, refresh
from veloce.serving.publisher import dense_state


def _body(rank, world, path):
    torch.manual_seed(0)  # the same dense initial state on every rank
    model = TwoTables(max_capacity=10_000, second_mode="mean")  # (sharded tables pool sum or mean)
    hp = HybridParallel(model, sparse="sync")
    opt = veloce.CombinedOptimizer(torch.optim.SGD(hp.parameters(), lr=0.05), hp)
    gen = torch.Generator().manual_seed(10 + rank)
    pub = Publisher(FileStore(path), hp, fold_every=3)
    shards = []
    for _ in range(3):
        hp.train()
        for _ in range(2):
            x = torch.randint(0, 400, (8, 4), generator=gen)
            hp(x, torch.rand(8, 4, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        v = pub.publish()
        shards.append((v, {n: model.get_submodule(n).export(values_only=True) for n in ("a", "tables.0")},
                       dense_state(model)))  # fmt: skip
    return shards


def test_two_ranks_publish_one_version(tmp_path):
    path = str(tmp_path / "store")
    results = run_ranks(_body, 2, path, timeout=180)
    store = FileStore(path)
    twin = None
    for k in range(3):
        v = results[0][k][0]
        assert results[1][k][0] == v
        m = store.manifest(v)
        assert m["world_size"] == 2 and m["kind"] == ("full" if k == 0 else "delta")
        assert all(t["ranks"] == [0, 1] and t["sharded"] for t in m["tables"].values())
        if twin is None:
            twin = inference_twin(TwoTables(second_mode="mean"), store, version=v)
        else:
            refresh(twin, v)
        for name in ("a", "tables.0"):
            keys = torch.cat([results[r][k][1][name]["keys"] for r in range(2)])
            weights = torch.cat([results[r][k][1][name]["weights"] for r in range(2)])
            assert torch.equal(twin.get_submodule(name).rows(keys), weights)  # every rank's shard, this version
        for n, t in results[0][k][2].items():
            assert torch.equal(dict(twin.named_parameters(), **dict(twin.named_buffers()))[n], t)


def _trainer_body(rank, world, path):
    from veloce.data import SyntheticClicks
    from veloce.models import DLRM
    from veloce.serving import Publish

    torch.manual_seed(0)
    model = DLRM(4, 2, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1),
                 embedding_factory=lambda d: veloce.DynamicEmbedding(d, mode="sum", max_capacity=10_000))  # fmt: skip
    cb = Publish(FileStore(path), every_n_steps=2)
    trainer = veloce.Trainer(model, progress=False, callbacks=[cb])
    trainer.fit(SyntheticClicks(32 * 5, batch_size=32, num_dense=4, num_sparse=2, id_space=300, seed=1, rank=rank,
                                world_size=world))  # fmt: skip
    tables = {n: e.export(values_only=True) for n, e in model.named_modules() if isinstance(e, veloce.DynamicEmbedding)}
    return cb.published, tables, dense_state(model)


def test_two_ranks_trainer_publish_callback_writes_one_version_per_publication(tmp_path):
    from veloce.models import DLRM

    path = str(tmp_path / "store")
    results = run_ranks(_trainer_body, 2, path, timeout=180)
    assert results[0][0] == results[1][0] == [(2, 1), (4, 2), (5, 3)]
    twin = inference_twin(DLRM(4, 2, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1)), FileStore(path))
    assert FileStore(path).manifest(3)["world_size"] == 2
    for name in results[0][1]:
        keys = torch.cat([results[r][1][name]["keys"] for r in range(2)])
        weights = torch.cat([results[r][1][name]["weights"] for r in range(2)])
        assert torch.equal(twin.get_submodule(name).rows(keys), weights)  # every rank's shard, the last version
    for n, t in results[0][2].items():
        assert torch.equal(dict(twin.named_parameters(), **dict(twin.named_buffers()))[n], t)
