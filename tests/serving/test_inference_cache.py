"""InferenceEmbedding's cache: on the device given or moved to (``device=`` / ``.to()``), the
lookups pooled from its slots equal the training table's eval lookups whether the rows are
cached, read from the store or both in one batch, each read sets the rows' LRU score, and
``hits`` / ``misses`` count the ids of the lookups."""

from __future__ import annotations

import pytest
import torch
from _twin_model import Trainer, TwoTables
from conftest import DEVICES

from veloce.serving import FileStore, InferenceEmbedding, Publisher


def published(tmp_path, device) -> tuple[TwoTables, FileStore]:
    torch.manual_seed(0)
    model = TwoTables(max_capacity=1000, device=device)
    Trainer(model, pool=500).steps(20)
    store = FileStore(tmp_path)
    Publisher(store, model).publish()
    return model.eval(), store


@pytest.mark.parametrize("device", DEVICES)
def test_cache_on_the_device_given_or_moved_to(tmp_path, device):
    model, store = published(tmp_path, device)
    given = InferenceEmbedding(store, "a", device=device)
    moved = InferenceEmbedding(store, "a").to(device)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # cold, then partly warm: cached rows and rows read from the store in one lookup
        x = torch.randint(0, 800, (16, 4), generator=gen).to(device)
        w = torch.rand(16, 4, generator=gen).to(device)
        want = model.a(x, per_sample_weights=w)
        for inf in (given, moved):
            assert inf.table.device.type == torch.device(device).type
            got = inf(x, per_sample_weights=w)
            assert got.device == want.device and torch.equal(got, want)
    for inf in (given, moved):
        slots = model.a.table.find(torch.arange(1000, device=device))
        held = (slots >= 0).nonzero().squeeze(1)  # the ids training holds (cached or not)
        assert torch.equal(inf.rows(held), model.a.table.rows(slots[held]))
        assert torch.equal(inf(x, per_sample_weights=w), want)  # warm: every id cached


@pytest.mark.parametrize("device", DEVICES)
def test_lookups_set_lru_scores_and_count_ids(tmp_path, device):
    model, store = published(tmp_path, device)
    inf = InferenceEmbedding(store, "tables.0", cache_rows=256, device=device)  # (padding id 0, max pooling)
    first = torch.tensor([[0, 1, 2, 2], [3, 0, 4, 5]], device=device)
    assert torch.equal(inf(first), model.tables[0](first))
    assert (inf.hits, inf.misses) == (0, 6)  # the padding positions are neither
    assert torch.equal(inf.table.last_seen(torch.tensor([1, 2, 3, 4, 5], device=device)).cpu(),
                       torch.full((5,), inf.table.clock))  # fmt: skip
    second = torch.tensor([[1, 2, 9, 0]], device=device)
    assert torch.equal(inf(second), model.tables[0](second))
    assert (inf.hits, inf.misses) == (2, 7)
    seen = inf.table.last_seen(torch.tensor([1, 2, 9, 3, 0], device=device)).cpu().tolist()
    clock = inf.table.clock
    assert seen == [clock, clock, clock, clock - 1, -1]  # read now / read by the first lookup / padding never cached
    warm = torch.tensor([[9, 1], [3, 3]], device=device)
    assert torch.equal(inf(warm), model.tables[0](warm))
    assert (inf.hits, inf.misses) == (6, 7)
    assert inf.table.last_seen(torch.tensor([9, 1, 3, 2], device=device)).cpu().tolist() == [clock + 1] * 3 + [clock]
