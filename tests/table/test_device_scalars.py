"""The ops' scalars read on the device: find_or_insert(_many)'s ``clock`` (the LRU stamp) and
accumulate_and_update(_many)'s ``lr_step`` (learning rate and step count), and what they are
for: a training step's ops captured in one CUDA graph and replayed with new values."""

from __future__ import annotations

import pytest
import torch

from veloce.ops import extension as _ext
from veloce.ops import hash_table as ht
from veloce.ops.optimizer import accumulate_and_update, accumulate_and_update_many, state_width

from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)
from test_hash_table import assert_same_contents, ids_tensor, make_table  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")

LRU, LFU = 1, 2
INIT = {"seed": 3, "init_kind": 2, "init_a": -0.5, "init_b": 0.5}
HYPER = {"eps": 1e-8, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.01}


def _clock(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _lr_step(lr, step, device) -> torch.Tensor:
    return torch.tensor([lr, float(step)], dtype=torch.float64, device=device)


# ---- find_or_insert(_many)(clock=) ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", [LRU, LFU])
@pytest.mark.parametrize("defer", [False, True])
def test_clock_stamps_what_score_value_would(device, policy, defer):
    """The same table as score_value=v: new and found ids (and repeats) stamped v under LRU;
    LFU ignores it as it ignores score_value."""
    a, b = make_table(256, device=device), make_table(256, device=device)
    first = ids_tensor([1, 2, 3, 2], device)
    then = ids_tensor([2, 9, 10, 9, 3], device)
    for t, clock in ((a, None), (b, _clock([7], device))):
        ht.find_or_insert(*t.tensors(), first, policy, 7, False, **INIT, defer=defer, clock=clock)
    for t, clock in ((a, None), (b, _clock([42], device))):
        # b's score_value is wrong on purpose: the clock replaces it
        ht.find_or_insert(*t.tensors(), then, policy, 42 if clock is None else -5, False, **INIT, defer=defer,
                          clock=clock)  # fmt: skip
    assert_same_contents(a, b)
    if policy == LRU:
        keys, scores = a.keys[a.digests != 0].cpu(), a.scores[a.digests != 0].cpu()
        assert dict(zip(keys.tolist(), scores.tolist())) == {1: 7, 2: 42, 3: 42, 9: 42, 10: 42}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("defer", [False, True])
def test_clock_of_many_tables_is_per_table(device, defer):
    tables = [make_table(128, device=device), make_table(256, dim=8, state=0, device=device), make_table(64, device=device)]
    expected = [t.clone() for t in tables]
    ids = [ids_tensor([5, 6, 5], device), ids_tensor([7], device), ids_tensor([5, 8, 9], device)]
    k = len(tables)
    args = ([LRU, LFU, LRU], None, [False] * k, [1, 2, 3], [2] * k, [-1.0] * k, [1.0] * k, [None] * k)
    want = [11, 12, 13]
    ht.find_or_insert_many([t.tensors() for t in expected], ids, args[0], want, *args[2:], defer=defer)
    ht.find_or_insert_many([t.tensors() for t in tables], ids, args[0], [0] * k, *args[2:], defer=defer,
                           clock=_clock(want, device))  # fmt: skip
    for t, e in zip(tables, expected):
        assert_same_contents(t, e)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_clock_is_refused_and_changes_nothing(device):
    t = make_table(64, device=device)
    before = t.clone()
    ids = ids_tensor([1, 2], device)
    for bad, what in [
        (torch.tensor([1], dtype=torch.int32, device=device), "clock must be an int64 tensor of shape \\(1,\\)"),
        (_clock([1, 2], device), "clock must be an int64 tensor of shape \\(1,\\)"),
        (_clock(5, device), "clock must be an int64 tensor of shape \\(1,\\)"),
    ]:
        with pytest.raises(ValueError, match=what):
            ht.find_or_insert(*t.tensors(), ids, LRU, 0, False, **INIT, clock=bad)
    with pytest.raises(ValueError, match="clock must be an int64 tensor of shape \\(2,\\)"):
        ht.find_or_insert_many([t.tensors(), make_table(64, device=device).tensors()], [ids, ids], [LRU] * 2,
                               [0] * 2, [False] * 2, [1] * 2, [0] * 2, [0.0] * 2, [0.0] * 2, [None] * 2,
                               clock=_clock([1], device))  # fmt: skip
    t.assert_equal(before)
    if torch.cuda.is_available() and device == "cpu":
        # the dispatcher may pick the CUDA kernel for the clock's device: then keys are refused
        with pytest.raises((ValueError, RuntimeError), match="clock|keys must be a CUDA tensor"):
            ht.find_or_insert(*t.tensors(), ids, LRU, 0, False, **INIT, clock=_clock([1], "cuda"))
        t.assert_equal(before)


@pytest.mark.parametrize("device", DEVICES)
def test_clock_opcheck(device):
    t = make_table(2048, device=device)
    ids = ids_tensor([3, 4, 3, 1000], device)
    torch.library.opcheck(torch.ops.veloce.find_or_insert.default,
                          (*t.tensors(), ids, LRU, 0, False, 1, 2, -1.0, 1.0, None, None, True, _clock([9], device)))
    tables = [make_table(2048, device=device), make_table(2048, dim=8, device=device)]
    cols = [[x.tensors()[c] for x in tables] for c in range(5)]
    torch.library.opcheck(torch.ops.veloce.find_or_insert_many.default,
                          (*cols, [ids, ids], [LRU, LRU], [0, 0], [False, False], [1, 1], [2, 2], [-1.0, -1.0],
                           [1.0, 1.0], [None, None], None, True, _clock([4, 5], device)))  # fmt: skip


# ---- accumulate_and_update(_many)(lr_step=) -------------------------------------------


def _update_case(device, K, dim, optimizer, seed):
    """K tables' (weights, opt_state, grad_output, slots, offsets): repeated slots, padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(K):
        rows = 64 * (k + 1)
        n = 200
        slots = torch.randint(-1, rows, (n,), generator=g)
        offsets = torch.arange(0, n, 4)
        grad = torch.randn(offsets.numel(), dim, generator=g)
        w = torch.randn(rows, dim, generator=g)
        s = torch.rand(rows, state_width(optimizer, dim), generator=g)
        out.append([x.to(device) for x in (w, s, grad, slots, offsets)])
    return out


def _assert_same(a, b, optimizer):
    # Adam's bias correction is computed on the device from lr_step (pow on the GPU may
    # differ from the host's in the last bit of a double); the others are bit for bit.
    if optimizer == "adam":
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dim", [16, 600])  # 600: rows too wide for the fused CUDA kernel
def test_lr_step_applies_what_lr_and_step_would(device, optimizer, dim):
    (w, s, grad, slots, offsets), = _update_case(device, 1, dim, optimizer, seed=dim)
    a, b = (w.clone(), s.clone()), (w.clone(), s.clone())
    for step, lr in ((1, 0.1), (2, 0.05), (7, 0.2)):
        accumulate_and_update(*a, grad, slots, offsets, None, "sum", False, optimizer, lr, **HYPER, step=step)
        # b's lr and step are wrong on purpose: lr_step replaces them
        accumulate_and_update(*b, grad, slots, offsets, None, "sum", False, optimizer, 9.0, **HYPER, step=1,
                              lr_step=_lr_step(lr, step, device))  # fmt: skip
    _assert_same(b[0], a[0], optimizer)
    _assert_same(b[1], a[1], optimizer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_lr_step_of_many_tables(device, optimizer):
    tables = _update_case(device, 3, 32, optimizer, seed=5)
    a = [(t[0].clone(), t[1].clone()) for t in tables]
    b = [(t[0].clone(), t[1].clone()) for t in tables]
    lists = [[t[i] for t in tables] for i in range(2, 5)]
    for step in (1, 4):
        accumulate_and_update_many([w for w, _ in a], [s for _, s in a], *lists, None, "mean", False, optimizer, 0.3,
                                   **HYPER, step=step)  # fmt: skip
        accumulate_and_update_many([w for w, _ in b], [s for _, s in b], *lists, None, "mean", False, optimizer, 1.0,
                                   **HYPER, step=1, lr_step=_lr_step(0.3, step, device))  # fmt: skip
    for (wa, sa), (wb, sb) in zip(a, b):
        _assert_same(wb, wa, optimizer)
        _assert_same(sb, sa, optimizer)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_lr_step_is_refused_and_changes_nothing(device):
    (w, s, grad, slots, offsets), = _update_case(device, 1, 8, "adam", seed=1)
    before = (w.clone(), s.clone())
    args = (w, s, grad, slots, offsets, None, "sum", False, "adam", 0.1)
    for bad, what in [
        (torch.tensor([0.1, 1.0], device=device), r"lr_step must be a float64 tensor of shape \(2,\)"),
        (torch.tensor([0.1, 1.0, 2.0], dtype=torch.float64, device=device), r"lr_step must be a float64"),
    ]:
        with pytest.raises(ValueError, match=what):
            accumulate_and_update(*args, lr_step=bad)
        with pytest.raises(ValueError, match=what):
            accumulate_and_update_many([w], [s], [grad], [slots], [offsets], None, "sum", False, "adam", 0.1,
                                       lr_step=bad)  # fmt: skip
    if device == "cpu":  # the CPU reads the values, so it checks them as it checks lr and step
        for lr, step, what in [(-1.0, 1, "lr must be a finite number >= 0, got -1"),
                               (0.1, 0, "step must be >= 1 for Adam"),
                               (0.1, 1.5, r"lr_step\[1\] \(the step count\) must be a whole number, got 1.5")]:  # fmt: skip
            with pytest.raises((ValueError, RuntimeError), match=what):
                accumulate_and_update(*args, lr_step=_lr_step(lr, step, device))
    assert torch.equal(w, before[0]) and torch.equal(s, before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_lr_step_makes_lr_and_step_placeholders(device):
    """With lr_step, the scalar lr and step are not read: values they could not hold as
    arguments (an Adam step of 0, a negative lr) do not refuse the call."""
    (w, s, grad, slots, offsets), = _update_case(device, 1, 8, "adam", seed=2)
    a, b = (w.clone(), s.clone()), (w.clone(), s.clone())
    accumulate_and_update(*a, grad, slots, offsets, None, "sum", False, "adam", 0.1, **HYPER, step=3)
    accumulate_and_update(*b, grad, slots, offsets, None, "sum", False, "adam", -1.0, **HYPER, step=0,
                          lr_step=_lr_step(0.1, 3, device))  # fmt: skip
    _assert_same(b[0], a[0], "adam")


@pytest.mark.parametrize("device", DEVICES)
def test_lr_step_opcheck(device):
    tables = _update_case(device, 2, 8, "adagrad", seed=3)
    w, s, grad, slots, offsets = tables[0]
    # [lr, step, weight_decay, eps]: the op's hparams, Adagrad's
    hyper = (torch.tensor([0.2, 3.0, 0.0, 1e-8], dtype=torch.float64, device=device), True, None)
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update.default,
                          (w, s, grad, slots, offsets, None, 0, False, 1, *hyper))
    lists = [[t[i] for t in tables] for i in range(5)]
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update_many.default,
                          (*lists, [None, None], 0, False, 1, *hyper))


# ---- a step's ops in one CUDA graph ---------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not _ext.has_cuda_kernels(),
                          reason="needs a GPU and veloce's CUDA kernels")  # fmt: skip


def _graph_batches(K, steps, seed):
    """Per step, K tables' ids (known ids, new ones, repeats; the same count every step)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        per = []
        for k in range(K):
            known = torch.randint(0, 300, (150,), generator=g)
            new = torch.arange(50) + 10_000 * (step + 1) + 1000 * k
            per.append(torch.cat([known, new, new[:20]])[torch.randperm(220, generator=g)].cuda())
        out.append(per)
    return out


def _churn_pinned_memory(K):
    """Between replays: an eager insert over K other tables (its per-table arguments copied
    from pinned memory) and pinned buffers filled with junk, so that pinned blocks a replay
    might still read from are handed out again and overwritten."""
    tabs = [make_table(64, device="cuda") for _ in range(K)]
    ids = [ids_tensor([1, 2, 3], "cuda")] * K
    ht.find_or_insert_many([t.tensors() for t in tabs], ids, [LRU] * K, [99] * K, [False] * K, [0] * K, [0] * K,
                           [0.0] * K, [0.0] * K, [None] * K)  # fmt: skip
    for n in (1 << 12, 1 << 16):
        junk = torch.full((n,), 0xAB, dtype=torch.uint8, pin_memory=True)
        torch.empty(n, dtype=torch.uint8, device="cuda").copy_(junk, non_blocking=True)


@CUDA
# 1: the insert's calls travel as kernel parameters; 3: copied to the device in one launch's
# parameters while captured; 12: in several (each carries 3840 bytes)
@pytest.mark.parametrize("K", [1, 3, 12])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_a_captured_step_replays_as_eager_steps_do(K, optimizer):
    """Insert (deferred, clock on the device) and fused update (lr and step on the device) of
    K tables captured in one CUDA graph, the clocks (one per table) and step advanced inside
    it, replayed over new ids and a new learning rate, with pinned memory reused between
    replays: the tables of eager calls with those values."""
    dim = 16
    batches = _graph_batches(K, 6, seed=K)

    def fresh():
        tabs = [make_table(4096, dim=dim, state=state_width(optimizer, dim), device="cuda") for _ in range(K)]
        warm = [ids_tensor(range(300), "cuda")] * K  # the known ids, present before step 1
        ht.find_or_insert_many([t.tensors() for t in tabs], warm, [LRU] * K, [0] * K, [False] * K, [3] * K,
                               [2] * K, [-0.5] * K, [0.5] * K, [None] * K)  # fmt: skip
        return tabs

    grads = [torch.randn(220, dim, device="cuda") for _ in range(K)]
    offsets = [torch.arange(220, device="cuda")] * K  # bags of one id

    def step(tabs, ids, clock_values, lr, step_count, clock=None, lr_step=None):
        slots, _, _ = ht.find_or_insert_many([t.tensors() for t in tabs], ids, [LRU] * K, clock_values,
                                             [False] * K, [3] * K, [2] * K, [-0.5] * K, [0.5] * K, [None] * K,
                                             defer=True, clock=clock)  # fmt: skip
        accumulate_and_update_many([t.weights for t in tabs], [t.opt_state for t in tabs], grads,
                                   list(slots.split([i.numel() for i in ids])), offsets, None, "sum", False,
                                   optimizer, lr, **HYPER, step=step_count, check_inputs=False, lr_step=lr_step)  # fmt: skip

    eager = fresh()
    lrs = [0.1, 0.1, 0.05, 0.05, 0.02, 0.02]
    start = [100 * k for k in range(K)]  # each table's clock
    for i, ids in enumerate(batches):
        step(eager, ids, [c + i + 1 for c in start], lrs[i], i + 1)

    graphed = fresh()
    static_ids = [i.clone() for i in batches[0]]
    clock = _clock(start, "cuda")  # advanced by one inside the graph
    lr_step = _lr_step(lrs[0], 0, "cuda")  # its step advanced inside the graph, its lr set between replays
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        clock.add_(1)
        lr_step[1:].add_(1.0)
        step(graphed, static_ids, [-1] * K, 9.0, 1, clock=clock, lr_step=lr_step)
    for i, ids in enumerate(batches):
        for s, x in zip(static_ids, ids):
            s.copy_(x)
        lr_step[0].fill_(lrs[i])
        graph.replay()
        _churn_pinned_memory(max(K, 2))
    torch.cuda.synchronize()
    assert clock.tolist() == [c + len(batches) for c in start] and lr_step[1].item() == len(batches)
    for a, b in zip(graphed, eager):
        assert int((a.digests != 0).sum()) == 300 + 50 * len(batches)
        keys_a, keys_b = a.keys[a.digests != 0], b.keys[b.digests != 0]
        assert torch.equal(torch.sort(keys_a).values, torch.sort(keys_b).values)
        oa, ob = torch.argsort(keys_a), torch.argsort(keys_b)
        assert torch.equal(a.scores[a.digests != 0][oa], b.scores[b.digests != 0][ob])
        for x, y in ((a.weights, b.weights), (a.opt_state, b.opt_state)):
            _assert_same(x[a.digests != 0][oa], y[b.digests != 0][ob], optimizer)
