"""A table over RocksDB (``storage=veloce.storage.RocksDB(...)``, a cache above the
database) trains as the all-in-memory table, round-trips checkpoints between every
storage, refuses or reuses an earlier run's database as asked, and resumes from a
checkpoint after its process was killed with SIGKILL mid-training."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import veloce
from _tiers import assert_same_entries, assert_same_eval, batches, cached, make, train, train_pair
from conftest import DEVICES
from veloce.ops import rocksdb as rocksdb_ops
from veloce.optim import OPTIMIZERS
from veloce.storage import RocksDB

pytestmark = pytest.mark.skipif(
    not rocksdb_ops.available(),
    reason="veloce._rocksdb is not built (RocksDB was not found at build time: apt-get install librocksdb-dev, "
    "then rebuild)",
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _on_disk(path, rows: int = 64, **kwargs) -> RocksDB:
    return RocksDB(str(path), cache_rows=rows, **kwargs)




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "max"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rocksdb_table_trains_as_the_all_in_memory_table(tmp_path, name, mode, device):
    ref = make(None, OPTIMIZERS[name](lr=0.05), mode, device)
    tiered = make(_on_disk(tmp_path / "db"), OPTIMIZERS[name](lr=0.05), mode, device)
    train_pair(ref, tiered, 50, device)
    assert len(tiered) == len(ref) > 1000
    stats = tiered.stats()
    assert stats["store_rows"] == len(ref) - stats["cache_rows"] and stats["written_back"] > 0
    assert_same_entries(tiered.export(), ref.export())
    assert_same_eval(ref, tiered, device)  # eval reads the database's rows, changing nothing
    tiered.table.store.close()


def test_checkpoints_round_trip_device_rocksdb_host_cached(tmp_path):
    ref = make(None)
    ref_run = train(ref, batches(30, seed=4), 30)
    it = batches(30, seed=4)
    first = nn.ModuleDict({"emb": make(None)})
    run = train(first["emb"], it, 10)
    veloce.checkpoint.save(tmp_path / "a", first, step=10)
    second = nn.ModuleDict({"emb": make(_on_disk(tmp_path / "db"))})  # Device -> RocksDB
    veloce.checkpoint.load(tmp_path / "a", second)
    assert second["emb"].stats()["store_rows"] > 0
    run += train(second["emb"], it, 10)
    veloce.checkpoint.save(tmp_path / "b", second, step=20)
    third = nn.ModuleDict({"emb": make(cached(48))})  # RocksDB -> HostCached
    veloce.checkpoint.load(tmp_path / "b", third)
    assert_same_entries(third["emb"].export(), second["emb"].export(), atol=0)
    run += train(third["emb"], it, 10)
    for x, y in zip(run, ref_run):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert_same_entries(third["emb"].export(), ref.export())
    second["emb"].table.store.close()


def test_an_earlier_runs_database_is_refused_kept_or_cleared_as_asked(tmp_path):
    first = make(_on_disk(tmp_path / "db"))
    train(first, batches(5), 5)
    rows = first.export()
    first.table.store.flush()
    first.table.store.close()  # the cache's rows were never written back: only the store's persist
    with pytest.raises(ValueError, match=r"already holds \d+ rows .*existing='keep'.*existing='clear'"):
        make(_on_disk(tmp_path / "db"))
    kept = make(_on_disk(tmp_path / "db", existing="keep"))
    assert 0 < len(kept) < len(rows["keys"])  # the rows the first run had written back
    kept.table.store.close()
    cleared = make(_on_disk(tmp_path / "db", existing="clear"))
    assert len(cleared) == 0
    cleared.table.store.close()


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [{tests!r}]
    import torch
    from torch import nn
    import veloce
    from _tiers import batches, make
    emb = make(veloce.storage.RocksDB({db!r}, cache_rows=64))
    model = nn.ModuleDict({{"emb": emb}})
    for step, (ids, offsets) in enumerate(batches(30, seed=4), start=1):
        out = emb(ids, offsets)
        out.square().sum().backward()
        emb.step()
        emb.zero_grad()
        if step == 10:
            veloce.checkpoint.save({ckpt!r}, model, step=10)
        if step == 17:  # mid-training, rows written back after the checkpoint: no clean exit
            os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_run_killed_mid_training_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path):
    db, ckpt = str(tmp_path / "db"), str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _KILLED_RUN.format(tests=TESTS, db=db, ckpt=ckpt)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == -9, done.stderr[-3000:]
    ref = make(None)
    ref_run = train(ref, batches(30, seed=4), 30)
    resumed = nn.ModuleDict({"emb": make(_on_disk(db, existing="clear"))})  # the killed run's database
    veloce.checkpoint.load(ckpt, resumed)
    it = batches(30, seed=4)
    for _ in range(10):
        next(it)
    run = train(resumed["emb"], it, 20)
    for x, y in zip(run, ref_run[10:]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert_same_entries(resumed["emb"].export(), ref.export())
    resumed["emb"].table.store.close()
