"""Checkpoints of tiered tables stream: the save writes the entries of ``export_chunks``
chunk by chunk (never one tensor of every row) into the same safetensors layout, and the
load reads them back in chunks (``load_chunks``); round trips are exact at 1 and 2 ranks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import veloce
from _dist import run_ranks
from _tiers import DIM, assert_same_entries, cached, make
from veloce.checkpoint import stream
from veloce.distributed import HybridParallel, owner_of
from veloce.storage import TieredTable
from veloce.storage.both_tiers import BothTiers

ROWS, CHUNK = 1000, 100


def _rows(ids: torch.Tensor) -> torch.Tensor:
    return ids.unsqueeze(1).float() * 1e-3 + torch.arange(DIM, dtype=torch.float32)


def _filled(storage, ids: torch.Tensor = torch.arange(ROWS)) -> nn.ModuleDict:
    model = nn.ModuleDict({"emb": make(storage)})
    model["emb"].insert(ids, _rows(ids))
    return model


def _expected(ids: torch.Tensor = torch.arange(ROWS)) -> dict[str, torch.Tensor]:
    return {"keys": ids, "weights": _rows(ids)}


def _same_rows(got: dict, want: dict) -> None:
    order = torch.argsort(got["keys"])
    assert torch.equal(got["keys"][order], want["keys"])
    assert torch.equal(got["weights"][order], want["weights"])


@pytest.fixture
def counted(monkeypatch):
    """Chunks of at most CHUNK rows, and the sizes of those the tiered tables export and load."""
    monkeypatch.setattr(stream, "CHUNK_ROWS", CHUNK)
    sizes = {"export": [], "load": []}
    export_chunks, load_chunks = TieredTable.export_chunks, TieredTable.load_chunks

    def counting_export(self, rows=1 << 20):
        for c in export_chunks(self, rows):
            sizes["export"].append(c["keys"].numel())
            yield c

    def counting_load(self, chunks):
        return load_chunks(self, (sizes["load"].append(c["keys"].numel()) or c for c in chunks))

    def no_whole_export(self, *a, **k):
        raise AssertionError("a checkpoint of a tiered table must not export every row at once")

    monkeypatch.setattr(TieredTable, "export_chunks", counting_export)
    monkeypatch.setattr(TieredTable, "load_chunks", counting_load)
    monkeypatch.setattr(TieredTable, "export", no_whole_export)
    return sizes


def test_a_save_streams_the_tiered_rows_in_bounded_chunks_and_the_load_reads_them_in_chunks(tmp_path, counted):
    model = _filled(cached(64))
    assert model["emb"].stats()["store_rows"] > 0
    veloce.checkpoint.save(tmp_path / "c", model, step=3)
    assert sum(counted["export"]) == ROWS and len(counted["export"]) >= ROWS // CHUNK
    assert max(counted["export"]) <= CHUNK
    # the same safetensors layout as any checkpoint's table file
    f = load_file(str(tmp_path / "c" / "tables.rank00000.safetensors"))
    assert f["emb/keys"].shape == (ROWS,) and f["emb/weights"].shape == (ROWS, DIM)
    _same_rows({"keys": f["emb/keys"], "weights": f["emb/weights"]}, _expected())

    back = nn.ModuleDict({"emb": make(cached(64))})
    veloce.checkpoint.load(tmp_path / "c", back)
    assert sum(counted["load"]) == ROWS and len(counted["load"]) >= ROWS // CHUNK and max(counted["load"]) <= CHUNK
    assert back["emb"].stats()["cache_rows"] == 64 and len(back["emb"]) == ROWS
    saved = {k: f[f"emb/{k}"] for k in ("keys", "weights", "optimizer_state", "scores")}
    assert_same_entries(_all_entries(back["emb"]), saved, atol=0)


def _all_entries(emb) -> dict[str, torch.Tensor]:
    """Every tier's entries (``BothTiers.export``: the fixture refuses ``TieredTable.export``)."""
    return BothTiers.export(emb.table)


def test_a_streamed_checkpoint_loads_into_a_device_table_and_back(tmp_path, counted):
    veloce.checkpoint.save(tmp_path / "c", _filled(cached(64)), step=1)
    device = nn.ModuleDict({"emb": make(None)})
    veloce.checkpoint.load(tmp_path / "c", device)
    _same_rows(device["emb"].export(), _expected())
    veloce.checkpoint.save(tmp_path / "d", device, step=2)  # a Device table's file, loaded into a tiered table
    tiered = nn.ModuleDict({"emb": make(cached(200))})
    veloce.checkpoint.load(tmp_path / "d", tiered)
    assert len(counted["load"]) >= ROWS // CHUNK
    assert len(tiered["emb"]) == ROWS and tiered["emb"].stats()["cache_rows"] == 200


def test_a_tiered_and_a_device_table_share_a_streamed_file(tmp_path, counted):
    model = _filled(cached(64))
    model["dev"] = make(None)
    model["dev"].insert(torch.arange(50) + 5000, _rows(torch.arange(50) + 5000))
    veloce.checkpoint.save(tmp_path / "c", model)
    back = nn.ModuleDict({"emb": make(cached(64)), "dev": make(None)})
    veloce.checkpoint.load(tmp_path / "c", back)
    _same_rows(back["dev"].export(), _expected(torch.arange(50) + 5000))
    assert len(back["emb"]) == ROWS


def test_a_checkpoint_with_repeated_ids_is_refused_and_the_table_kept(tmp_path, counted):
    veloce.checkpoint.save(tmp_path / "c", _filled(cached(64)))
    target = _filled(cached(64), torch.arange(20) + 7000)
    calls = []

    def repeated(self, chunks):  # every chunk twice: an id in two chunks
        chunks = list(chunks)
        calls.append(len(chunks))
        return BothTiers.load_chunks(self, chunks + chunks)

    with mock.patch.object(TieredTable, "load_chunks", repeated):
        with pytest.raises(veloce.checkpoint.CheckpointError, match="more than one chunk"):
            veloce.checkpoint.load(tmp_path / "c", target)
    assert calls and len(target["emb"]) == 20


def _rank_body(rank: int, world: int, path: str) -> dict:
    stream.CHUNK_ROWS = CHUNK
    ids = torch.arange(ROWS)
    mine = ids[owner_of(ids, world) == rank]
    model = nn.ModuleDict({"emb": make(cached(40))})
    HybridParallel(model)
    model["emb"].insert(mine, _rows(mine))
    veloce.checkpoint.save(path, model, step=5)
    again = nn.ModuleDict({"emb": make(cached(40))})
    HybridParallel(again)
    veloce.checkpoint.load(path, again)
    return {"saved": len(model["emb"]), "loaded": again["emb"].export(), "stats": again["emb"].stats()}


def test_two_ranks_round_trip_exactly_and_load_into_one(tmp_path):
    path = str(tmp_path / "c2")
    results = run_ranks(_rank_body, 2, path, timeout=120)
    assert sum(r["saved"] for r in results) == ROWS
    merged = {k: torch.cat([r["loaded"][k] for r in results]) for k in ("keys", "weights")}
    _same_rows(merged, _expected())
    for rank, r in enumerate(results):  # each rank holds the ids it owns, a cache over its store
        assert bool((owner_of(r["loaded"]["keys"], 2) == rank).all()) and r["stats"]["store_rows"] > 0
    one = nn.ModuleDict({"emb": make(cached(64))})  # 2 ranks -> 1
    veloce.checkpoint.load(path, one)
    _same_rows(one["emb"].export(), _expected())
