"""Publishing to a FileStore and serving from it: the inference twin equals the training
model in eval mode after every publication (full, deltas, folds), deltas hold only what
changed, the store stays bounded, one publisher per store, a killed publisher leaves
readers on the previous version, half-precision rows, and clear errors for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import veloce

from _twin_model import Trainer, TwoTables, eval_batches
from conftest import DEVICES
from veloce.serving import FileStore, InferenceEmbedding, LeaseHeld, Publisher, VersionMissing, inference_twin, refresh
from veloce.ops import rocksdb
from veloce.storage import HostCached

ROOT = Path(__file__).resolve().parents[2]


def outputs(model, batches):
    model.eval()
    with torch.no_grad():
        return [model(x, w) for x, w in batches]


def assert_twin_equal(model, twin, trainer, exact=True):
    batches = eval_batches(trainer)
    for a, b in zip(outputs(model, batches), outputs(twin, batches)):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["device", "host_cached"])
def test_round_trips_full_deltas_folds(tmp_path, storage, device):
    torch.manual_seed(0)
    model = TwoTables(HostCached(cache_rows=72) if storage == "host_cached" else None, device=device)
    trainer = Trainer(model)
    store = FileStore(tmp_path / "store")
    pub = Publisher(store, model, keep_last=2, fold_every=3)
    twin = None
    kinds = []
    for cycle in range(7):
        trainer.steps(3)
        clock = model.a.table.clock
        expect = None
        if pub._clocks is not None:  # what the delta must hold: the table's own answer
            expect = model.a.export(since=pub._clocks["a"], values_only=True)
        v = pub.publish()
        m = store.manifest(v)
        kinds.append(m["kind"])
        if m["kind"] == "delta":
            gone = expect["removed"].unique()
            assert m["tables"]["a"]["rows"] == [expect["keys"].numel()]  # the rows changed, no other
            assert m["tables"]["a"]["removed"] == [int((~torch.isin(gone, expect["keys"])).sum())]
        assert m["tables"]["a"]["clocks"] == [clock]
        if twin is None:
            twin = inference_twin(TwoTables(device=device), store)
            assert isinstance(twin.a, InferenceEmbedding) and not twin.training
            assert twin.a.table.device.type == twin.tables[0].table.device.type == torch.device(device).type
        else:
            assert refresh(twin) == v
        assert twin.a.version == v and twin.tables[0].version == v
        assert_twin_equal(model, twin, trainer)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert twin.a.hits > 0  # the cache served rows across refreshes


@pytest.mark.parametrize("device", DEVICES)
def test_admission_default_row_serves_the_ids_without_a_row(tmp_path, device):
    # ids seen fewer than 3 times read the table's trained default row, in training's eval
    # and in the twin, which follows it from version to version
    torch.manual_seed(0)
    model = TwoTables(admission=veloce.admission.Frequency(min_count=3), device=device)
    trainer = Trainer(model)
    store = FileStore(tmp_path / "store")
    pub = Publisher(store, model)
    trainer.steps(4)
    pub.publish()
    twin = inference_twin(TwoTables(admission=veloce.admission.Frequency(min_count=3), device=device), store)
    assert twin.a.default_row is not None and model.a.stats()["refused"] > 0
    assert_twin_equal(model, twin, trainer)
    before = twin.a.default_row.clone()
    model.train()
    trainer.steps(3)
    pub.publish()
    assert refresh(twin) == 2 and not torch.equal(twin.a.default_row, before)  # trained on since
    assert_twin_equal(model, twin, trainer)


@pytest.mark.skipif(not rocksdb.available(), reason="veloce._rocksdb is not built (RocksDB missing)")
@pytest.mark.parametrize("device", DEVICES)
def test_rocksdb_store_round_trips(tmp_path, device):
    from veloce.serving import RocksDBStore

    model = TwoTables(device=device)
    trainer = Trainer(model)
    pub = Publisher(RocksDBStore(tmp_path), model, keep_last=2, fold_every=3, dtype=torch.float16)
    twin = None
    for _ in range(5):
        trainer.steps(2)
        v = pub.publish()
        if twin is None:
            twin = inference_twin(TwoTables(device=device), RocksDBStore(tmp_path))
        else:
            assert refresh(twin) == v
        assert_twin_equal(model, twin, trainer, exact=False)
    store = twin.a.store
    assert store.committed() == [4, 5] and sorted(os.listdir(tmp_path / "data")) == [f"{4:012d}", f"{5:012d}"]
    part = store.read_part(5, "t/a/r0")
    assert part["keys"].numel() == store.manifest(5)["tables"]["a"]["rows"][0]
    assert part["weights"].dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES)
def test_one_dim_input_with_offsets(tmp_path, device):
    model = TwoTables(device=device)
    trainer = Trainer(model)
    trainer.steps(2)
    Publisher(FileStore(tmp_path), model).publish()
    twin = inference_twin(TwoTables(device=device), FileStore(tmp_path))
    model.eval()
    ids = torch.tensor([3, 0, 7, 7, 250, 999, 5], device=device)
    for offsets in (torch.tensor([0, 2, 2, 5], device=device), torch.tensor([0, 3, 7], device=device)):
        with torch.no_grad():
            assert torch.equal(model.a(ids, offsets), twin.a(ids, offsets))
            assert torch.equal(model.tables[0](ids, offsets), twin.tables[0](ids, offsets))  # (0 is its padding id)
    with pytest.raises(ValueError, match="offsets is required"):
        twin.a(ids)


def test_import_veloce_does_not_import_redis():
    code = "import sys, veloce, veloce.serving; assert 'redis' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


@pytest.mark.parametrize("device", DEVICES)
def test_lfu_table_is_published_whole(tmp_path, device):
    model = TwoTables(eviction="lfu", device=device)
    trainer = Trainer(model)
    store = FileStore(tmp_path)
    pub = Publisher(store, model, fold_every=10)
    twin = None
    for _ in range(3):
        trainer.steps(3)  # (evicting: ids of older versions must not come back from them)
        v = pub.publish()
        m = store.manifest(v)
        assert m["tables"]["a"]["whole"] and m["tables"]["a"]["rows"] == [len(model.a)]
        assert not m["tables"]["tables.0"]["whole"] or v == 1
        twin = inference_twin(TwoTables(device=device), store) if twin is None else twin
        refresh(twin)
        assert_twin_equal(model, twin, trainer)
    assert [store.manifest(v)["kind"] for v in store.committed()] == ["full", "delta", "delta"]


@pytest.mark.parametrize("device", DEVICES)
def test_delta_holds_only_changed_rows(tmp_path, device):
    model = TwoTables(max_capacity=10_000, device=device)
    trainer = Trainer(model, pool=5000)
    store = FileStore(tmp_path)
    pub = Publisher(store, model, fold_every=100)
    trainer.steps(20)
    pub.publish()
    trainer.steps(1)
    v = pub.publish()
    part = store.read_part(v, "t/a/r0")
    full = {k: v.cpu() for k, v in model.a.export().items()}
    assert part["keys"].numel() <= 16 * 4 < full["keys"].numel()  # one batch's ids, not the table
    assert torch.equal(part["keys"], torch.sort(part["keys"]).values)
    at = {k: i for i, k in enumerate(full["keys"].tolist())}
    idx = torch.tensor([at[k] for k in part["keys"].tolist()])
    assert torch.equal(part["weights"], full["weights"][idx])


def test_store_stays_bounded(tmp_path):
    model = TwoTables()
    trainer = Trainer(model)
    store = FileStore(tmp_path)
    pub = Publisher(store, model, keep_last=2, fold_every=3)
    sizes = []
    for _ in range(15):
        trainer.steps(1)
        pub.publish()
        assert len(store.committed()) <= 2 + 3  # the last 2 and the snapshot and deltas they need
        assert len(os.listdir(tmp_path / "data")) == len(store.committed())
        sizes.append(store.nbytes())
    assert max(sizes[6:]) <= 1.5 * max(sizes[:6])
    twin = inference_twin(TwoTables(), store)
    assert_twin_equal(model, twin, trainer)


def test_lease(tmp_path):
    model = TwoTables()
    store = FileStore(tmp_path)
    first = Publisher(store, model, lease_ttl=0.5)
    with pytest.raises(LeaseHeld, match="leased to another publisher"):
        Publisher(FileStore(tmp_path), model)
    time.sleep(0.6)  # the first one's lease expires: it counts as dead
    second = Publisher(FileStore(tmp_path), model, lease_ttl=60)
    second.publish()
    with pytest.raises(LeaseHeld):
        first.publish()  # taken over: the first may not write any more
    second.close()
    Publisher(store, model).close()  # given back: free for the next


@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_rows(tmp_path, device):
    for dtype in (torch.float16, torch.bfloat16):
        model = TwoTables(device=device)
        trainer = Trainer(model)
        store = FileStore(tmp_path / str(dtype))
        pub = Publisher(store, model, dtype=dtype)
        trainer.steps(2)
        pub.publish()
        assert store.read_part(1, "t/a/r0")["weights"].dtype == dtype
        twin = inference_twin(TwoTables(device=device), store)
        assert_twin_equal(model, twin, trainer, exact=False)
        trainer.steps(2)
        pub.publish()
        refresh(twin)
        assert_twin_equal(model, twin, trainer, exact=False)


def test_bad_input(tmp_path):
    model = TwoTables()
    store = FileStore(tmp_path)
    with pytest.raises(VersionMissing, match="no committed version"):
        inference_twin(TwoTables(), store)
    Publisher(store, model).publish()
    with pytest.raises(VersionMissing, match="no committed version 7"):
        inference_twin(TwoTables(), store, version=7)
    other = torch.nn.Module()
    other.b = TwoTables().a
    with pytest.raises(ValueError, match="another model"):
        inference_twin(other, store)
    with pytest.raises(ValueError, match="dim 8"):
        inference_twin(TwoTables(dim=4), store)
    with pytest.raises(ValueError, match="keep_last must be"):
        Publisher(store, model, keep_last=0)
    with pytest.raises(ValueError, match="no DynamicEmbedding"):
        Publisher(store, torch.nn.Linear(2, 2))


KILLED = """
import os, signal, sys, torch
sys.path.insert(0, {here!r})
from _twin_model import Trainer, TwoTables, eval_batches
from veloce.serving import FileStore, Publisher
torch.manual_seed(0)
model = TwoTables()
trainer = Trainer(model)
store = FileStore({path!r})
pub = Publisher(store, model, lease_ttl=3.0)
trainer.steps(3)
pub.publish()
batches = eval_batches(trainer)
model.eval()
with torch.no_grad():
    torch.save((batches, [model(x, w) for x, w in batches]), {expect!r})
trainer.steps(3)
store.commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # after every part, before the marker
pub.publish()
"""


def test_killed_publisher_leaves_previous_version(tmp_path):
    path, expect = str(tmp_path / "store"), str(tmp_path / "expect.pt")
    script = KILLED.format(here=str(Path(__file__).parent), path=path, expect=expect)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    store = FileStore(path)
    model = TwoTables()
    with pytest.raises(LeaseHeld):
        Publisher(store, model)  # the dead publisher's lease still runs
    assert store.committed() == [1] and store.begun() == [1, 2]  # the broken version's parts, never committed
    assert os.path.exists(os.path.join(path, "data", f"{2:012d}", "t~a~r0.safetensors"))
    twin = inference_twin(TwoTables(), store)
    assert twin.a.version == 1
    batches, want = torch.load(expect)
    for (x, w), y in zip(batches, outputs(twin, batches)):
        assert torch.equal(y, want.pop(0))
    trainer = Trainer(model)
    time.sleep(max(0.0, store._read_lease()["expires"] - time.time()) + 0.05)
    pub = Publisher(store, model)
    trainer.steps(2)
    v = pub.publish()
    assert v == 3 and store.committed() == [1, 3] and store.begun() == [1, 3]  # the broken one is gone
    assert refresh(twin) == 3
    assert_twin_equal(model, twin, trainer)
