"""The config's tables.storage, tables.eviction ttl, and the sparse optimizers' own
hyperparameters (ftrl, adam's betas): each field parsed, built, and refused in the wrong
combination with a message that names it."""

from __future__ import annotations

import os

import pytest
import torch

import veloce
from veloce import storage
from veloce.ops import rocksdb as rocksdb_ops
from veloce.train.build import build_model, build_storage
from veloce.train.config import ConfigError, load_config, parse_config


def table(raw: dict) -> veloce.DynamicEmbedding:
    raw = {"data": {"num_sparse": 2}, **raw}
    return build_model(parse_config(raw), torch.device("cpu")).embeddings["sparse_0"]


def test_storage_defaults_to_device():
    assert table({}).storage == storage.Device()


def test_host_cached_cache_rows_and_policy():
    emb = table({"tables": {"storage": {"kind": "host_cached", "cache_rows": 64, "policy": "lru"}}})
    assert emb.storage == storage.HostCached(cache_rows=64, policy="lru")
    assert emb.stats()["cache_capacity"] == 64


def test_host_cached_cache_bytes():
    emb = table({"tables": {"storage": {"kind": "host_cached", "cache_bytes": 1 << 20}}})
    assert emb.storage == storage.HostCached(cache_bytes=1 << 20)


def test_lfu_policy_with_lfu_eviction():
    emb = table({"tables": {"eviction": "lfu", "storage": {"kind": "host_cached", "cache_rows": 8, "policy": "lfu"}}})
    assert emb.storage.policy == "lfu"


@pytest.mark.parametrize("storage_cfg, match", [
    ({"kind": "host_cached"}, "tables.storage.cache_rows must be set with kind host_cached"),
    ({"kind": "host_cached", "cache_rows": 8, "cache_bytes": 8000}, "tables.storage.cache_bytes must be null when cache_rows"),
    ({"kind": "host_cached", "cache_rows": 0}, "tables.storage.cache_rows must be a positive number, got 0"),
    ({"kind": "host_cached", "cache_rows": 8, "path": "db"}, "tables.storage.path must be null with kind host_cached"),
    ({"kind": "device", "cache_rows": 8}, "tables.storage.cache_rows must be null with kind device"),
    ({"kind": "device", "policy": "lru"}, "tables.storage.policy must be null with kind device"),
    ({"kind": "rocksdb", "cache_rows": 8}, "tables.storage.path must be the RocksDB database's directory"),
    ({"kind": "hbm"}, "tables.storage.kind must be one of device, host_cached, rocksdb, got 'hbm'"),
    ({"kind": "host_cached", "cache_rows": 8, "policy": "fifo"}, "tables.storage.policy must be one of lru, lfu"),
    ({"kind": "host_cached", "cache_row": 8}, "unknown field tables.storage.cache_row \\(did you mean cache_rows"),
])  # fmt: skip
def test_bad_storage_names_the_field(storage_cfg, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"tables": {"storage": storage_cfg}})


@pytest.mark.parametrize("eviction, policy, match", [
    ("lfu", "lru", "tables.storage.policy must be lfu or null with eviction lfu"),
    ("lru", "lfu", "tables.storage.policy must be lru or null with eviction lru"),
])  # fmt: skip
def test_policy_must_rank_by_the_table_scores(eviction, policy, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"tables": {"eviction": eviction, "storage": {"kind": "host_cached", "cache_rows": 8,
                                                                   "policy": policy}}})  # fmt: skip


def test_rocksdb_path_is_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    f = tmp_path / "conf" / "c.yaml"
    f.write_text("tables:\n  storage: {kind: rocksdb, path: dbs, cache_rows: 16}\n")
    cfg = load_config(f)
    assert cfg.tables.storage.path == str(tmp_path / "conf" / "dbs")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(f, overrides=["tables.storage.path=here"])  # --set: relative to the current directory
    assert cfg.tables.storage.path == str(tmp_path / "here")


@pytest.mark.skipif(not rocksdb_ops.available(), reason="veloce._rocksdb is not built (apt-get install "
                    "librocksdb-dev, then rebuild)")  # fmt: skip
def test_rocksdb_builds_one_database_per_table_cleared_when_the_run_starts(tmp_path):
    cfg = {"tables": {"storage": {"kind": "rocksdb", "path": str(tmp_path / "db"), "cache_rows": 16}}}
    model = build_model(parse_config(cfg), torch.device("cpu"))
    tables = [m for m in model.modules() if isinstance(m, veloce.DynamicEmbedding)]
    assert len(tables) >= 2 and all(isinstance(t.table.store, storage.RocksDBStore) for t in tables)
    assert sorted(os.listdir(tmp_path / "db")) == sorted(f"table_{i}" for i in range(len(tables)))
    first = tables[0]
    for start in range(0, 100, 10):  # 100 ids through a 16-row cache, 10 a step
        first(torch.arange(start, start + 10), torch.arange(0, 10, 5)).sum().backward()
        first.step()
        first.zero_grad()
    stats = first.stats()
    assert len(first) == 100 and stats["store_rows"] == 100 - stats["cache_rows"] >= 84
    for t in tables:
        t.table.store.close()
    again = build_model(parse_config(cfg), torch.device("cpu"))  # a run starting over the earlier one's databases
    assert all(len(m) == 0 for m in again.modules() if isinstance(m, veloce.DynamicEmbedding))


def test_ttl_eviction_with_ttl_steps():
    emb = table({"tables": {"eviction": "ttl", "ttl_steps": 7}})
    assert emb.table.eviction_policy == veloce.eviction.TTL(steps=7)


@pytest.mark.parametrize("tables, match", [
    ({"eviction": "ttl"}, "tables.ttl_steps must be set with eviction ttl"),
    ({"eviction": "lru", "ttl_steps": 5}, "tables.ttl_steps must be null unless eviction is ttl"),
    ({"eviction": "ttl", "ttl_steps": 0}, "tables.ttl_steps must be a positive number, got 0"),
])  # fmt: skip
def test_bad_ttl_names_the_field(tables, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"tables": tables})


def test_ftrl_and_its_hyperparameters():
    sparse = {"name": "ftrl", "lr": 0.1, "lr_power": -0.4, "l1": 0.01, "l2": 0.02, "initial_accumulator_value": 0.2,
              "beta": 1.0, "weight_decay": 0.001}  # fmt: skip
    opt = table({"optimizer": {"sparse": sparse}}).optimizer
    assert opt == veloce.optim.FTRL(lr=0.1, lr_power=-0.4, l1=0.01, l2=0.02, initial_accumulator_value=0.2, beta=1.0,
                                    weight_decay=0.001)  # fmt: skip


def test_ftrl_defaults():
    assert table({"optimizer": {"sparse": {"name": "ftrl", "lr": 0.1}}}).optimizer == veloce.optim.FTRL(lr=0.1)


def test_adam_betas():
    opt = table({"optimizer": {"sparse": {"name": "adam", "betas": [0.8, "9.9e-1"]}}}).optimizer
    assert opt == veloce.optim.Adam(lr=0.05, betas=(0.8, 0.99))


@pytest.mark.parametrize("sparse, match", [
    ({"name": "adagrad", "betas": [0.9, 0.99]}, "optimizer.sparse.betas must be null with adagrad"),
    ({"name": "adam", "betas": [0.9]}, "optimizer.sparse.betas must be a list of two numbers in \\[0, 1\\)"),
    ({"name": "adam", "betas": [0.9, 1.0]}, "optimizer.sparse.betas must be a list of two numbers"),
    ({"name": "adam", "betas": ["x", 0.9]}, "optimizer.sparse.betas must be a list of numbers"),
    ({"name": "adam", "l1": 0.1}, "optimizer.sparse.l1 must be null with adam \\(l1 is ftrl's\\)"),
    ({"name": "sgd", "beta": 1.0}, "optimizer.sparse.beta must be null with sgd"),
    ({"name": "ftrl", "eps": 1e-8}, "optimizer.sparse.eps must be null with ftrl"),
    ({"name": "sgd", "eps": 1e-8}, "optimizer.sparse.eps must be null with sgd"),
    ({"name": "ftrl", "lr_power": 0.5}, "optimizer.sparse.lr_power must be a number <= 0"),
    ({"name": "ftrl", "l1": -1}, "optimizer.sparse.l1 must be a number >= 0"),
    ({"name": "ftrl", "initial_accumulator_value": 0}, "optimizer.sparse.initial_accumulator_value must be a positive"),
    ({"name": "lamb"}, "optimizer.sparse.name must be one of adagrad, rowwise_adagrad, sgd, adam, ftrl"),
])  # fmt: skip
def test_bad_sparse_optimizer_names_the_field(sparse, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"optimizer": {"sparse": sparse}})
