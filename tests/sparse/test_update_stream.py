"""Sparse updates on the update stream (veloce.runtime.update_stream): the next step's insert runs
beside the update, and every other use of a table's rows waits for it.

The protocol (which accesses wait for the fence) is tested on any device with a spy fence;
on CUDA, training with the update stream must give, bit for bit, what training on the
current stream gives, also when the rows are read, erased, exported, grown or evicted
right behind a large update."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, deterministic_algorithms

import veloce
import veloce.runtime.update_stream as update_stream

CUDA = [d for d in DEVICES if d != "cpu"]


class SpyFence:
    """Stands in for an UpdateFence: counts the waits."""

    def __init__(self) -> None:
        self.joins = 0

    def join(self) -> bool:
        self.joins += 1
        return True


def fenced(table: veloce.table.HashTable) -> SpyFence:
    fence = SpyFence()
    table._update_fence = fence
    return fence


def test_fence_protocol_inserts_without_eviction_skip_it_everything_else_waits():
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=64, optimizer=veloce.optim.Adam())
    t = emb.table
    t.find_or_insert(torch.arange(10))
    # An insert that may not evict places new ids in free slots only: it does not wait,
    # and neither does find (keys and digests are not the update's).
    f = fenced(t)
    t.find_or_insert(torch.arange(5, 20))
    t.find(torch.arange(30))
    veloce.table.find_or_insert_many([t], [torch.arange(20, 25)])
    assert f.joins == 0 and t._update_fence is f
    # Every other access waits once, and drops the fence.
    accesses = {
        "weights": lambda: t.weights,
        "opt_state": lambda: t.opt_state,
        "erase": lambda: t.erase(torch.tensor([1])),
        "clear": t.clear,
        "export": t.export,
        "insert_or_assign": lambda: t.insert(torch.tensor([99]), torch.ones(1, 4)),
        "resize": lambda: t.resize(2 * t.capacity),
        "to": lambda: t.to(torch.float64),
        "training lookup": lambda: emb(torch.tensor([[1, 2]])),
        "DynamicEmbedding.find": lambda: emb.find(torch.tensor([1])),
        "state_dict": emb.state_dict,
    }
    for name, access in accesses.items():
        f = fenced(t)
        access()
        assert (f.joins, t._update_fence) == (1, None), name


def test_copies_wait_for_the_update_and_leave_the_fence_behind():
    import copy

    emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam())
    emb(torch.tensor([[1, 2]])).sum().backward()
    emb.step()
    f = fenced(emb.table)
    twin = copy.deepcopy(emb)
    assert (f.joins, emb.table._update_fence, twin.table._update_fence) == (1, None, None)
    assert torch.equal(twin.export()["weights"], emb.export()["weights"])


def test_reading_the_dtype_does_not_wait():
    t = veloce.DynamicEmbedding(4, mode="sum", dtype=torch.float64).table
    f = fenced(t)
    assert t.dtype == torch.float64 and f.joins == 0


def test_fence_protocol_an_insert_that_may_evict_or_grow_waits():
    # At max_capacity with eviction, new ids may take the slots of rows the update writes.
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=32, max_capacity=32, eviction="lru")
    t = emb.table
    t.find_or_insert(torch.arange(20))
    f = fenced(t)
    t.find_or_insert(torch.arange(100, 120))
    assert (f.joins, t._update_fence) == (1, None)
    f = fenced(t)
    veloce.table.find_or_insert_many([t], [torch.arange(200, 202)])
    assert (f.joins, t._update_fence) == (1, None)
    # Growth rehashes every row.
    grow = veloce.DynamicEmbedding(4, mode="sum", capacity=32).table
    f = fenced(grow)
    grow.find_or_insert(torch.arange(100))
    assert grow.capacity > 32 and (f.joins, grow._update_fence) == (1, None)


class FakeStream:
    """Compares like torch.cuda.Stream: by id, and neither equal nor unequal to None."""

    def __init__(self) -> None:
        self.waits = 0
        self.device = torch.device("cuda", 0)

    def wait_event(self, event) -> None:
        self.waits += 1

    def __eq__(self, other):
        return other is not None and other is self

    def __ne__(self, other):
        return other is not None and other is not self


def test_update_fence_join_covers_the_origin_stream_once_other_streams_every_time(monkeypatch):
    main, other = FakeStream(), FakeStream()
    current = [other]
    # The seam join() asks (veloce.runtime.device.current_stream, whose cache never sees the fakes).
    monkeypatch.setattr(update_stream, "current_stream", lambda device: current[0])
    fence = update_stream.UpdateFence(object(), (), origin=main)
    monkeypatch.setattr(update_stream, "_IN_FLIGHT", [fence])
    # A stream of the user's own waits, each time, and the fence stays: the origin has not waited.
    assert (fence.join(), fence.join(), other.waits, update_stream._IN_FLIGHT) == (False, False, 2, [fence])
    current[0] = main
    assert (fence.join(), fence.join(), main.waits, update_stream._IN_FLIGHT) == (True, True, 1, [])


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_fences_of_finished_updates_are_released_when_a_table_allocates(monkeypatch):
    """A fence holds its update's inputs (a deleted table's rows among them) until waited for
    or done; done ones are dropped before each update and each table allocation."""
    done, running = (update_stream.UpdateFence(FakeEvent(d), (), None) for d in (True, False))
    monkeypatch.setattr(update_stream, "_IN_FLIGHT", [done, running])
    veloce.table.HashTable(4, 1)
    assert update_stream._IN_FLIGHT == [running]


def test_updates_off_cuda_hold_no_fence():
    emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=0.1))
    emb(torch.tensor([[1, 2]])).sum().backward()
    emb.step()
    assert emb.table._update_fence is None


def _train(device, enabled: bool, monkeypatch, n: int = 1 << 18, dim: int = 64, steps: int = 6) -> list:
    """Steps over two grouped Adam tables and an SGD one (growth, new ids every step, an
    evicting table at max_capacity), reading and changing the tables right behind each
    update. Returns everything observed."""
    monkeypatch.setattr(update_stream, "ENABLED", enabled)
    gen = torch.Generator().manual_seed(0)
    a = veloce.DynamicEmbedding(dim, mode="sum", capacity=1024, optimizer=veloce.optim.Adam(lr=0.01), device=device)
    b = veloce.DynamicEmbedding(dim, mode="mean", capacity=1024, optimizer=veloce.optim.Adam(lr=0.01),
                                device=device, seed=1)  # fmt: skip
    c = veloce.DynamicEmbedding(dim, mode="sum", capacity=2 * n, max_capacity=2 * n, eviction="lru",
                                optimizer=veloce.optim.SGD(lr=0.1), device=device, seed=2)  # fmt: skip
    tables = [a, b, c]
    seen = []
    for step in range(steps):
        ids = [torch.randint(0, 3 * n, (n,), generator=gen).to(device) for _ in tables]
        outs = veloce.lookup_many(tables, [(i, torch.arange(0, n, 4, device=device)) for i in ids])
        grads = [torch.randn(o.shape, generator=gen).to(device) for o in outs]
        torch.autograd.backward(outs, grads)
        veloce.step_tables(tables)
        probe = ids[0][:64]
        if step % 3 == 0:  # reads right behind the update
            seen.append(a.table.weights[a.table.find(probe).clamp(min=0)].clone())
            seen.append(b.find(ids[1][:64])[0])
            seen.append(c.table.opt_state[:256].clone())
        elif step % 3 == 1:  # changes right behind the update
            a.erase(probe[:16])
            b.insert(ids[1][:8], torch.full((8, dim), 0.5, device=device))
            seen.append(c.export()["weights"].sum(0))
        else:  # growth right behind the update
            a.table.resize(2 * a.capacity)
        seen.extend(o.detach().clone() for o in outs)
    assert c.table.num_evicted > 0 and a.capacity > 1024  # both paths that must wait were taken
    for t in tables:
        e = t.export()
        order = e["keys"].argsort()
        seen.extend(e[k][order] for k in ("keys", "weights", "optimizer_state"))
    torch.cuda.synchronize()
    return [s.cpu() for s in seen]


def _agree_with_and_without_streams(train, device, monkeypatch) -> int:
    """Runs ``train(device, enabled, monkeypatch)`` with the update stream on, then off, and
    checks that everything observed agrees bit for bit; returns how many tensors it compared.
    In deterministic mode: CUDA inserts place conflicting new ids in order (else their slots,
    and so eviction, may differ between two runs)."""
    with deterministic_algorithms(warn_only=True):
        with_stream = train(device, True, monkeypatch)
        on_current = train(device, False, monkeypatch)
    assert len(with_stream) == len(on_current)
    for k, (x, y) in enumerate(zip(with_stream, on_current)):
        assert torch.equal(x, y), k
    return len(with_stream)


@pytest.mark.parametrize("device", CUDA)
def test_cuda_update_stream_trains_bit_for_bit_as_the_current_stream(device, monkeypatch):
    _agree_with_and_without_streams(_train, device, monkeypatch)


@pytest.mark.parametrize("device", CUDA)
def test_cuda_next_insert_runs_beside_the_update_and_the_lookup_waits(device, monkeypatch):
    monkeypatch.setattr(update_stream, "ENABLED", True)
    beside = []
    monkeypatch.setattr(veloce.table.batch, "beside_updates",
                        lambda d, fn: beside.append(d) or update_stream.beside_updates(d, fn))  # fmt: skip
    emb = veloce.DynamicEmbedding(64, mode="sum", capacity=1 << 22, optimizer=veloce.optim.Adam(), device=device)
    ids = torch.arange(1 << 19, device=device)
    emb(ids, ids).sum().backward()
    emb.step()
    fence = emb.table._update_fence
    assert isinstance(fence, update_stream.UpdateFence)
    emb.table.find_or_insert(ids + (1 << 19))  # new ids, free slots: beside the update
    assert emb.table._update_fence is fence and len(beside) == 1
    out = emb(ids[:4], ids[:4])  # the lookup reads the rows: after the update
    assert emb.table._update_fence is None
    torch.cuda.synchronize()
    expected = emb.find(ids[:4])[0]
    assert torch.equal(out.detach(), expected)


def _train_dlrm(device, enabled: bool, monkeypatch, steps: int = 4) -> list:
    monkeypatch.setattr(update_stream, "ENABLED", enabled)
    from veloce.models import DLRM

    torch.manual_seed(0)

    def table(dim):
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=1 << 12, optimizer=veloce.optim.Adam(), device=device)

    model = DLRM(4, 5, embedding_dim=16, bottom_mlp=(32, 16), embedding_factory=table).to(device)
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        dense = torch.randn(4096, 4, generator=gen).to(device)
        sparse = torch.randint(0, 20000, (4096, 5), generator=gen).to(device)
        out = model(dense, sparse)
        torch.nn.functional.binary_cross_entropy_with_logits(out, (sparse[:, 0] % 2).float()).backward()
        opt.step()
        opt.zero_grad()
        seen.append(out.detach().clone())
    torch.cuda.synchronize()
    return [s.cpu() for s in seen]


@pytest.mark.parametrize("device", CUDA)
def test_cuda_update_stream_dlrm_trains_bit_for_bit_as_the_current_stream(device, monkeypatch):
    assert _agree_with_and_without_streams(_train_dlrm, device, monkeypatch) == 4


@pytest.mark.parametrize("device", CUDA)
def test_cuda_current_stream_follows_torch_under_contexts_threads_and_devices(device):
    """veloce.runtime.device.current_stream (cached by the stream's raw handle) answers what
    torch.cuda.current_stream answers: on the default stream, inside stream contexts (nested,
    and after them), in another thread (whose current stream is its own), for a device given
    without an index, and for a stream of another device when there is one."""
    import threading

    from veloce.runtime.device import current_stream

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()

    def same() -> bool:
        want = torch.cuda.current_stream(index)
        return current_stream(dev) == want and current_stream(torch.device("cuda")) == torch.cuda.current_stream()

    assert same()
    a, b = torch.cuda.Stream(device=index), torch.cuda.Stream(device=index, priority=-1)
    with torch.cuda.stream(a):
        assert same() and current_stream(dev) == a
        with torch.cuda.stream(b):
            assert same() and current_stream(dev) == b
        assert same() and current_stream(dev) == a
    assert same() and current_stream(dev) != a
    seen = []

    def other_thread():
        with torch.cuda.stream(b):
            seen.append(current_stream(dev) == b)
        seen.append(current_stream(dev) == torch.cuda.current_stream(index))

    with torch.cuda.stream(a):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert current_stream(dev) == a  # the other thread's streams are not this one's
    assert seen == [True, True] and same()
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", 1 - index if index < 2 else 0)
        s = torch.cuda.Stream(device=other)
        with torch.cuda.stream(s):
            assert current_stream(other) == s
        assert current_stream(other) == torch.cuda.current_stream(other)


@pytest.mark.parametrize("device", CUDA)
def test_cuda_bad_input_beside_an_update_changes_nothing_and_restores_the_stream(device, monkeypatch):
    monkeypatch.setattr(update_stream, "ENABLED", True)
    emb = veloce.DynamicEmbedding(8, mode="sum", capacity=1 << 12, optimizer=veloce.optim.SGD(lr=0.1), device=device)
    ids = torch.arange(100, device=device)
    emb(ids, ids).sum().backward()
    emb.step()
    assert emb.table._update_fence is not None
    main = torch.cuda.current_stream(device)
    with pytest.raises(ValueError, match="offsets"):  # checked on the insert stream, beside the update
        emb(ids + 1000, torch.tensor([0, 5, 3], device=device))
    assert torch.cuda.current_stream(device) == main
    assert len(emb) == 100 and emb.table.find(ids + 1000).max() == -1
    emb(ids + 1000, ids).sum().backward()  # a good forward after the refused one
    assert len(emb) == 200


@pytest.mark.parametrize("device", CUDA)
def test_cuda_a_table_stepped_twice_in_one_call_keeps_both_updates_inputs(device, monkeypatch):
    """Two modules sharing one table take two update calls in one step_tables: the first
    fence, replaced on the table by the second, stays in flight until it is done."""
    monkeypatch.setattr(update_stream, "ENABLED", True)
    fences = []

    def spy(*args):
        fences.append(update_stream.run_update(*args))
        return fences[-1]

    monkeypatch.setattr(veloce.sparse.step, "run_update", spy)
    a = veloce.DynamicEmbedding(128, mode="sum", capacity=1 << 22, optimizer=veloce.optim.Adam(), device=device)
    b = veloce.DynamicEmbedding(128, mode="sum", optimizer=veloce.optim.Adam(), device=device)
    b.table = a.table
    ids = torch.arange(1 << 20, device=device)
    outs = veloce.lookup_many([a, b], [(ids, ids), (ids, ids)])
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    veloce.step_tables([a, b])
    assert len(fences) == 2 and a.table._update_fence is fences[1]
    assert all(f in update_stream._IN_FLIGHT or f.event.query() for f in fences)
    _ = a.table.weights  # the current stream waits for the last one: it leaves the list
    assert fences[1] not in update_stream._IN_FLIGHT
    torch.cuda.synchronize()


def _slow_fill(x: torch.Tensor):
    """Queues a wait of tens of milliseconds on the device, then x.fill_(1): a reader that
    is not ordered after it sees zeros."""

    def launch():
        torch.cuda._sleep(50_000_000)
        x.fill_(1.0)

    return launch


@pytest.mark.parametrize("device", CUDA)
def test_cuda_an_error_beside_an_update_still_makes_the_current_stream_wait(device, monkeypatch):
    monkeypatch.setattr(update_stream, "ENABLED", True)
    x = torch.zeros(1024, device=device)

    def fails():
        _slow_fill(x)()  # on the insert stream
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        update_stream.beside_updates(torch.device(device), fails)
    assert bool((x.clone() == 1).all())  # the current stream waited for the insert stream


def _table_behind_a_slow_update(device):
    """A table whose fence is a slow fill of ``x`` (zeros until it has run) on the update stream."""
    emb = veloce.DynamicEmbedding(8, mode="sum", optimizer=veloce.optim.SGD(lr=0.1), device=device)
    x = torch.zeros(1024, device=device)
    fence = update_stream.run_update(torch.device(device), _slow_fill(x), ())
    emb.table._update_fence = fence
    return emb, x, fence


@pytest.mark.parametrize("device", CUDA)
def test_cuda_reading_the_rows_makes_the_current_stream_wait_for_the_update(device, monkeypatch):
    monkeypatch.setattr(update_stream, "ENABLED", True)
    emb, x, fence = _table_behind_a_slow_update(device)
    _ = emb.table.weights  # joins
    assert bool((x.clone() == 1).all()) and emb.table._update_fence is None
    assert fence not in update_stream._IN_FLIGHT


@pytest.mark.parametrize("device", CUDA)
def test_cuda_a_join_on_a_stream_of_ones_own_waits_but_keeps_the_fence(device, monkeypatch):
    monkeypatch.setattr(update_stream, "ENABLED", True)
    emb, x, fence = _table_behind_a_slow_update(device)
    mine = torch.cuda.Stream(device)
    with torch.cuda.stream(mine):
        _ = emb.table.weights
        assert bool((x.clone() == 1).all())  # this stream waited
    assert emb.table._update_fence is fence and fence in update_stream._IN_FLIGHT  # the origin has not
    _ = emb.table.weights
    assert emb.table._update_fence is None


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("change", ["resize", "insert", "erase", "clear", "load"])
def test_cuda_a_change_of_the_table_is_waited_for_by_the_prefetch_streams_next_insert(device, change):
    """A change queued on the current stream outside the training inserts (resize,
    insert_or_assign, erase, clear, load) leaves an event; the next op on the prefetch
    stream (HybridParallel.prefetch's inserts, which do not wait for the current stream)
    waits for it, and one on the current stream does not consume it. The current stream is
    held up before the change, and the insert's ids come from the prefetch stream: without
    the wait, the insert would run first (a clear would then drop the ids it found)."""
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=64, device=device)
    t = emb.table
    ids = torch.arange(1, 41, device=device)
    t.find_or_insert(ids)
    torch.cuda.synchronize(device)
    t._changed = None  # (the allocation's)
    main = torch.cuda.current_stream(device)
    torch.cuda._sleep(100_000_000)  # the change runs well after the insert below is queued
    if change == "resize":
        t.resize(4 * t.capacity)
    elif change == "insert":
        t.insert(ids[:5], torch.full((5, 4), 7.0, device=device))
    elif change == "erase":
        t.erase(ids[:5])
    elif change == "clear":
        t.clear()
    else:
        t.load_entries(t.export())
    assert t._changed is not None and t._changed[1] == main
    t._state()  # an op on the current stream: ordered after the change anyway; keeps the event
    assert t._changed is not None
    side = update_stream.prefetch_stream(torch.device(device))
    with torch.cuda.stream(side):
        slots = t.find_or_insert(torch.arange(1, 41, device=device))
    assert t._changed is None  # waited for there, by the insert's first use of the state
    main.wait_stream(side)
    present = t.find(ids)
    assert (present >= 0).all() and torch.equal(present, slots)
    if change == "insert":
        got = emb.export()
        rows = dict(zip(got["keys"].tolist(), got["weights"].tolist()))
        assert all(rows[i] == [7.0] * 4 for i in range(1, 6))


@pytest.mark.parametrize("device", CUDA)
def test_cuda_a_table_moved_to_the_cpu_after_a_change_still_works(device):
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=64, device=device)
    emb.table.find_or_insert(torch.arange(1, 41, device=device))
    emb.table.resize(256)  # leaves its event
    emb.cpu()
    assert emb.table._changed is None
    assert emb.state_dict()["keys"].numel() == 40  # export() through the state, on the CPU
    assert (emb.table.find_or_insert(torch.arange(1, 41)) >= 0).all()


@pytest.mark.parametrize("device", CUDA)
def test_cuda_a_copy_waits_for_a_change_queued_on_another_stream(device):
    """copy.deepcopy reads the state on the current stream: after a change another stream
    queued (a growth inside HybridParallel.prefetch, on its side stream), it waits for that
    change first. The side stream is held up before it, so a copy that did not wait would
    read the new buffers unfilled."""
    import copy

    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=64, device=device)
    ids = torch.arange(1, 41, device=device)
    emb.table.find_or_insert(ids)
    torch.cuda.synchronize(device)
    side = update_stream.prefetch_stream(torch.device(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        emb.table.resize(256)
    assert emb.table._changed is not None and emb.table._changed[1] == side
    twin = copy.deepcopy(emb)
    assert twin.table._changed is None
    torch.cuda.synchronize(device)
    assert twin.table.capacity == 256 and (twin.table.find(ids) >= 0).all()
    assert torch.equal(twin.export()["keys"].sort().values, ids)


# ---- the side streams' host helpers (veloce.runtime.device.use_stream, wait_for) ------------------
@pytest.mark.parametrize("device", CUDA)
def test_cuda_use_stream_sets_and_restores_the_current_stream(device):
    """use_stream is torch.cuda.stream at less host cost: inside, the given stream is
    current; after (also after an error, and nested), the one before it is."""
    from veloce.runtime.device import current_stream, use_stream

    dev = torch.device(device)
    before = torch.cuda.current_stream(dev)
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with use_stream(a):
        assert torch.cuda.current_stream(dev) == a and current_stream(dev) == a
        with use_stream(b):
            assert torch.cuda.current_stream(dev) == b
        assert torch.cuda.current_stream(dev) == a
    assert torch.cuda.current_stream(dev) == before and current_stream(dev) == before
    with pytest.raises(RuntimeError, match="inside"):
        with use_stream(a):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream(dev) == before
    if torch.cuda.device_count() > 1:  # a stream of another device: torch's context, the device switched back
        cur = torch.cuda.current_device()
        other = torch.cuda.Stream(torch.device("cuda", (cur + 1) % torch.cuda.device_count()))
        with use_stream(other):
            assert torch.cuda.current_stream(other.device) == other
        assert torch.cuda.current_device() == cur
        assert torch.cuda.current_stream(dev) == before


@pytest.mark.parametrize("device", CUDA)
def test_cuda_wait_for_orders_work_across_streams_with_a_reused_event(device):
    """wait_for(waiter, waited): work queued on the waiter afterwards runs after the work
    queued on the waited stream before. Its event is kept per pair and recorded again
    by the next call: that must not loosen an earlier wait."""
    from veloce.runtime.device import use_stream, wait_for

    dev = torch.device(device)
    waited, waiter = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    x = torch.zeros(1 << 20, device=dev)
    wait_for(waited, torch.cuda.current_stream(dev))  # x's zeros, queued on the current stream
    outs = []
    for value in (1.0, 2.0, 3.0):
        with use_stream(waited):
            torch.cuda._sleep(50_000_000)  # the write runs well after the read below is queued
            x.fill_(value)
        wait_for(waiter, waited)
        with use_stream(waiter):
            outs.append(x.clone())
    torch.cuda.synchronize(dev)
    assert [float(o.min()) for o in outs] == [1.0, 2.0, 3.0]
    assert [float(o.max()) for o in outs] == [1.0, 2.0, 3.0]
