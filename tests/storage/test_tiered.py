"""A HostCached table trains as the all-in-memory table: forward outputs, the final rows
and optimizer state, eval lookups, with a cache far smaller than the working set (fetches
and write-backs in every step); the pinned-rows rule; several tables in one insert."""

from __future__ import annotations

import pytest
import torch

import veloce
from _tiers import assert_same_entries, assert_same_eval, batches, cached, make, train_pair
from conftest import DEVICES
from veloce.optim import OPTIMIZERS
from veloce.table import TableFullError

STEPS = 50


def _optimizer(name: str):
    return OPTIMIZERS[name](lr=0.05)




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_host_cached_trains_as_the_all_in_memory_table(name, mode, device):
    ref = make(None, _optimizer(name), mode, device)
    tiered = make(cached(64), _optimizer(name), mode, device)
    train_pair(ref, tiered, STEPS, device, psw=mode == "sum")
    assert len(tiered) == len(ref) > 1000  # the working set: far more than the cache
    assert_same_entries(tiered.export(), ref.export())
    stats = tiered.stats()
    assert stats["cache_rows"] <= 64 and stats["store_rows"] == len(ref) - stats["cache_rows"]
    assert stats["fetched"] > 0 and stats["written_back"] > 0 and stats["fetched_last_step"] > 0
    # eval: ids in the store read their stored rows, unknown ones the initializer's; nothing moves
    before = tiered.stats()
    assert_same_eval(ref, tiered, device)
    after = tiered.stats()
    assert (after["cache_rows"], after["store_rows"], after["fetched"]) == (
        before["cache_rows"], before["store_rows"], before["fetched"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unknown", ["init", "zeros"])
def test_eval_and_find_read_the_stored_rows(unknown, device):
    ref = make(None, device=device, unknown=unknown)
    tiered = make(cached(50), device=device, unknown=unknown)
    train_pair(ref, tiered, 10, device)
    ids = torch.arange(-5, 2100, device=device)
    rows_ref, found_ref = ref.find(ids)
    rows, found = tiered.find(ids)
    assert torch.equal(found, found_ref) and int(found.sum()) == len(ref)
    torch.testing.assert_close(rows, rows_ref, atol=0, rtol=0)
    ref.eval(), tiered.eval()
    offsets = torch.arange(0, ids.numel(), 7, device=device)
    torch.testing.assert_close(tiered(ids, offsets), ref(ids, offsets), atol=1e-6, rtol=0)
    with torch.no_grad():  # training mode without gradients reads as eval does
        ref.train(), tiered.train()
        torch.testing.assert_close(tiered(ids, offsets), ref(ids, offsets), atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_keeps_both_batches_rows(device):
    ref = make(None, device=device)
    tiered = make(cached(100), device=device)  # two batches of 48 distinct ids fit; a third would not
    train_pair(ref, tiered, 20, device, accumulate=2)
    assert_same_entries(tiered.export(), ref.export())


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_larger_than_the_cache_raises_and_changes_nothing(device):
    tiered = make(cached(64), device=device)
    train_pair(make(None, device=device), tiered, 3, device)
    before = tiered.export()
    ids = torch.arange(10_000, 10_100, device=device)  # 100 distinct ids, a cache of 64
    with pytest.raises(TableFullError, match=r"cache_rows=64.*Raise cache_rows to at least 100"):
        tiered(ids, torch.arange(0, 100, 10, device=device))
    assert_same_entries(tiered.export(), before, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_pinned_rows_of_an_earlier_forward_are_never_evicted(device):
    tiered = make(cached(64), device=device)
    first = torch.arange(0, 40, device=device)
    out = tiered(first, torch.tensor([0], device=device))
    out.sum().backward()
    second = torch.arange(100, 140, device=device)  # 40 + 40 > 64: only the first batch's rows could leave
    with pytest.raises(TableFullError, match=r"40 cached row\(s\) are pinned.*40 more must come in"):
        tiered(second, torch.tensor([0], device=device))
    tiered.step()  # applies the first gradient and releases its rows
    tiered.zero_grad()
    tiered(second, torch.tensor([0], device=device)).sum().backward()
    tiered.step()
    assert len(tiered) == 80


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_brings_rows_up_and_pins_them(device):
    ref, tiered = make(None, device=device), make(cached(128), device=device)
    train_pair(ref, tiered, 5, device)
    it = list(batches(4, seed=5, device=device))
    for ids, offsets in it:
        tiered.prefetch(ids)
        fetched = tiered.stats()["fetched"]
        out_a, out_b = ref(ids, offsets), tiered(ids, offsets)
        assert tiered.stats()["fetched"] == fetched  # the forward found every row in the cache
        torch.testing.assert_close(out_b, out_a, atol=1e-6, rtol=0)
        out_a.sum().backward(), out_b.sum().backward()
        ref.step(), tiered.step()
        ref.zero_grad(), tiered.zero_grad()
    assert_same_entries(tiered.export(), ref.export())
    ref.eval(), tiered.eval()
    tiered.prefetch(it[0][0])  # eval: a no-op
    make(None, device=device).prefetch(it[0][0])  # a Device table: a no-op


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_many_over_tiered_and_device_tables(device):
    refs = [make(None, device=device, seed=s) for s in range(3)]
    tables = [make(cached(64), device=device, seed=0), make(None, device=device, seed=1),
              make(cached(80), device=device, seed=2)]  # fmt: skip
    its = [batches(30, seed=s, device=device) for s in range(3)]
    for _ in range(30):
        inputs = [next(it) for it in its]
        outs_ref = veloce.lookup_many(refs, inputs)
        outs = veloce.lookup_many(tables, inputs)
        for a, b in zip(outs, outs_ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        sum(o.square().sum() for o in outs_ref).backward()
        sum(o.square().sum() for o in outs).backward()
        veloce.step_tables(refs), veloce.step_tables(tables)
        for t in refs + tables:
            t.zero_grad()
    for a, b in zip(tables, refs):
        assert_same_entries(a.export(), b.export())
        a.eval(), b.eval()
    inputs = [next(batches(1, seed=50 + s, pool=2500, device=device)) for s in range(3)]
    for a, b in zip(veloce.lookup_many(tables, inputs), veloce.lookup_many(refs, inputs)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_idx_is_neither_fetched_nor_counted(device):
    ref = make(None, device=device, padding_idx=5)
    tiered = make(cached(64), device=device, padding_idx=5)
    train_pair(ref, tiered, 10, device)
    ids = torch.tensor([5, 5, 1, 2], device=device)
    before = tiered.stats(reset=True)
    torch.testing.assert_close(tiered(ids, torch.tensor([0, 2], device=device)),
                               ref(ids, torch.tensor([0, 2], device=device)), atol=1e-6, rtol=0)  # fmt: skip
    stats = tiered.stats()
    assert stats["hits"] + stats["misses"] == 2
    assert len(tiered) == len(ref) and before["rows"] <= len(tiered)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_offsets_raise_before_any_row_moves(device):
    tiered = make(cached(64), device=device)
    train_pair(make(None, device=device), tiered, 3, device)
    before, stats = tiered.export(), tiered.stats()
    ids = torch.arange(5000, 5040, device=device)
    with pytest.raises(ValueError, match="offsets"):
        tiered(ids, torch.tensor([0, 30, 10], device=device))
    assert_same_entries(tiered.export(), before, atol=0)
    assert tiered.stats()["misses"] == stats["misses"]


@pytest.mark.parametrize("device", DEVICES)
def test_held_pins_keep_a_steps_rows_one_step_more(device):
    tiered = make(cached(64), device=device)
    tiered.table.hold_pins(1)
    first, second = torch.arange(0, 40, device=device), torch.arange(100, 140, device=device)
    bag = torch.tensor([0], device=device)
    tiered(first, bag).sum().backward()
    tiered.step()  # the first batch's rows stay one step more
    with pytest.raises(TableFullError, match="40 cached row"):
        tiered(second, bag)
    tiered.table.hold_pins(0)  # (unwrapped from async HybridParallel)
    tiered(second, bag).sum().backward()
    tiered.step()
    assert len(tiered) == 80
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        tiered.table.hold_pins(-1)
    make(None).table.hold_pins(3)  # a Device table holds nothing
