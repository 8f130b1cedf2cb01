"""Bad input on the serving side, each refused with an error that says what went wrong and
what to do: a store of another model or layout, a version that does not exist (never
published, or deleted as superseded), a path that is not a store (or a store of the other
kind), a store tampered with, and an unreachable Redis."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from _twin_model import Trainer, TwoTables

from veloce.ops import rocksdb
from veloce.serving import (
    FileStore,
    InferenceEmbedding,
    Publisher,
    RocksDBStore,
    VersionMissing,
    inference_twin,
    refresh,  # fmt: skip
)


@pytest.fixture
def published(tmp_path):
    """A FileStore with versions 1 and 2 of a trained TwoTables, and the model."""
    model = TwoTables()
    trainer = Trainer(model)
    store = FileStore(tmp_path / "store")
    with Publisher(store, model) as pub:
        for _ in range(2):
            trainer.steps(2)
            pub.publish()
    return store, model


def test_a_store_of_another_model_names_what_differs(published):
    store, _ = published
    other = torch.nn.Module()  # another architecture: one table under another name
    other.emb = TwoTables().a
    with pytest.raises(ValueError, match=r"holds the tables \['a', 'tables.0'\], the model has \['emb'\]: a store of "
                                         r"another model; construct the architecture that published it"):  # fmt: skip
        inference_twin(other, store)
    with pytest.raises(ValueError, match=r"table 'a' was published with dim 8 and mode 'sum', the model's has 4 "
                                         r"and 'sum': construct the model with the published table's dim and mode"):  # fmt: skip
        inference_twin(TwoTables(dim=4), store)
    with pytest.raises(ValueError, match=r"table 'tables.0' was published with dim 8 and mode 'max', the model's "
                                         r"has 8 and 'mean'"):  # fmt: skip
        inference_twin(TwoTables(second_mode="mean"), store)
    bigger = TwoTables()
    bigger.head = torch.nn.Linear(16, 2)  # the same tables, another dense head
    with pytest.raises(ValueError, match=r"head.weight has shape \(1, 16\), the model's \(2, 16\): a store of "
                                         r"another model"):  # fmt: skip
        inference_twin(bigger, store)
    extra = TwoTables()
    extra.out = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"2 of the model's not published \['out.bias', 'out.weight'\]"):
        inference_twin(extra, store)
    with pytest.raises(ValueError, match=r"holds no table 'emb' \(it holds \['a', 'tables.0'\]\): a store of another "
                                         r"model; pass the name of a published table"):  # fmt: skip
        InferenceEmbedding(store, "emb")


def test_a_version_that_does_not_exist(published, tmp_path):
    store, _ = published
    what_to_do = r"committed: \[1, 2\]; pass one of them, or None for the newest"
    with pytest.raises(VersionMissing, match=rf"has no committed version 7 \({what_to_do}"):
        inference_twin(TwoTables(), store, version=7)
    with pytest.raises(VersionMissing, match=rf"has no committed version 7 \({what_to_do}"):
        InferenceEmbedding(store, "a", version=7)
    twin = inference_twin(TwoTables(), store, version=1)
    with pytest.raises(VersionMissing, match=rf"has no committed version 9 \({what_to_do}"):
        refresh(twin, 9)  # (the dense part first)
    with pytest.raises(VersionMissing, match=rf"has no committed version 9 \({what_to_do}"):
        twin.a.refresh(9)
    with pytest.raises(VersionMissing, match=rf"has no committed version 9 \({what_to_do}"):
        store.read_part(9, "t/a/r0")
    assert twin.a.version == 1 and refresh(twin) == 2  # refused refreshes changed nothing

    empty = FileStore(tmp_path / "empty")
    with pytest.raises(VersionMissing, match="holds no committed version: publish one first"):
        inference_twin(TwoTables(), empty)
    with pytest.raises(VersionMissing, match=r"has no committed version 1 \(it holds none: publish one first"):
        empty.manifest(1)


def test_a_version_deleted_as_superseded(tmp_path):
    model = TwoTables()
    trainer = Trainer(model)
    store = FileStore(tmp_path)
    with Publisher(store, model, keep_last=1, fold_every=1) as pub:
        for _ in range(3):
            trainer.steps(1)
            pub.publish()
    assert store.committed() == [3]
    with pytest.raises(VersionMissing, match=r"no committed version 1 \(committed: \[3\]; pass one of them, or None "
                                             r"for the newest \(older ones are deleted as superseded\)"):  # fmt: skip
        inference_twin(TwoTables(), store, version=1)


def test_a_path_that_is_not_a_store(tmp_path):
    a_file = tmp_path / "model.pt"
    a_file.write_bytes(b"not a store")
    with pytest.raises(ValueError, match=r"FileStore: path .*model.pt' is a file, not a serving store's directory: "
                                         r"pass the directory a Publisher wrote"):  # fmt: skip
        FileStore(a_file)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "step_100.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"path .*checkpoints' is not a serving store \(it holds \['step_100.pt'\], "
                                         r"and no manifests/ or data/\): pass the directory a Publisher wrote, or a "
                                         r"new or empty one"):  # fmt: skip
        FileStore(checkpoints)
    assert list(checkpoints.iterdir()) == [checkpoints / "step_100.pt"]  # left as it was
    FileStore(tmp_path / "new")  # a new directory, or an empty one, starts a store
    FileStore(tmp_path / "new")
    if rocksdb.available():
        with pytest.raises(ValueError, match=r"RocksDBStore: path .*checkpoints' is not a serving store"):
            RocksDBStore(checkpoints)


@pytest.mark.skipif(not rocksdb.available(), reason="veloce._rocksdb is not built")
def test_a_store_opened_as_the_other_kind(tmp_path):
    model = TwoTables()
    Trainer(model).steps(2)
    with Publisher(FileStore(tmp_path / "file"), model) as pub:
        pub.publish()
    with Publisher(RocksDBStore(tmp_path / "rocks"), model) as pub:
        pub.publish()
    batch = torch.randint(0, 300, (4, 4)), torch.rand(4, 4)
    with pytest.raises(VersionMissing, match=r"was written by a FileStore: open this directory with "
                                             r"veloce.serving.FileStore\("):  # fmt: skip
        inference_twin(TwoTables(), RocksDBStore(tmp_path / "file"))(*batch)
    with pytest.raises(VersionMissing, match=r"was written by a RocksDBStore: open this directory with "
                                             r"veloce.serving.RocksDBStore\("):  # fmt: skip
        inference_twin(TwoTables(), FileStore(tmp_path / "rocks"))(*batch)


def test_a_store_of_another_format(published):
    store, _ = published
    path = store._part_file(2, "dense").split("/data/")[0] + "/manifests/000000000002.json"
    with open(path) as f:
        manifest = json.load(f)
    manifest["format"] = "other-tool/3"
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match=r"version 2 has format 'other-tool/3', not 'veloce-serving/1'"):
        inference_twin(TwoTables(), store)


def test_an_unreachable_redis_names_the_url():
    pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
    from veloce.serving import RedisStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(ConnectionError, match=rf"cannot reach Redis at '{url}' .*start redis-server there or pass "
                                              rf"the url of a running one"):  # fmt: skip
        RedisStore(url, "x", timeout=2)
