"""accumulate_and_update(_many)'s extra rows: rows past a table's own (slot C + e is extra row
e), updated in the table's own pass as rows of it. A table with admission trains its
default row so."""

from __future__ import annotations

import pytest
import torch

from veloce.ops import extension as _ext
from veloce.ops.optimizer import accumulate_and_update, accumulate_and_update_many, state_width

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")

from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)

HYPER = (0.1, 1e-8, 0.9, 0.99, 0.01)


def _case(device, C, E, dim, optimizer, mode, with_psw, seed, hot=0):
    """Rows, states and one batch whose slots reach the extra rows (C .. C + E - 1), past
    them (skipped), codes -1 / -2 and, with ``hot``, one extra row repeated ``hot`` times
    (runs of several chunks in the CUDA kernel)."""
    g = torch.Generator().manual_seed(seed)
    n = 300
    slots = torch.randint(-2, C + E + 3, (n,), generator=g)
    slots[:3] = torch.tensor([C, C + E - 1, C + E])
    if hot:
        slots = torch.cat([slots, torch.full((hot,), C)])[torch.randperm(n + hot, generator=g)]
        n += hot
    bags = 37
    cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    psw = torch.rand(n, generator=g) if with_psw else None
    grad = torch.randn(bags, dim, generator=g)
    S = state_width(optimizer, dim)
    rows = torch.randn(C + E, dim, generator=g)
    state = torch.rand(C + E, S, generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(rows), to(state), to(grad), to(slots), to(offsets), to(psw)


def _split(rows, state, C):
    """The table's own rows and its extra rows, each a tensor of its own."""
    return rows[:C].clone(), state[:C].clone(), rows[C:].clone(), state[C:].clone()


# dim 16: several rows per warp; 128: one 16-byte pack per lane; 130: no packs; 600: rows
# too wide for the fused kernel (accumulate_grad + sparse_update on each part).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("mode,with_psw", [(0, False), (0, True), (1, False)])
@pytest.mark.parametrize("dim", [16, 128, 130, 600])
@pytest.mark.parametrize("E", [1, 3])
def test_extra_rows_update_as_rows_of_the_table(device, optimizer, mode, with_psw, dim, E):
    C = 50
    rows, state, grad, slots, offsets, psw = _case(device, C, E, dim, optimizer, mode, with_psw, seed=dim + E, hot=200)
    whole_w, whole_s = rows.clone(), state.clone()
    w, s, ew, es = _split(rows, state, C)
    for step in (1, 2):
        accumulate_and_update(whole_w, whole_s, grad, slots, offsets, psw, mode, False, optimizer, *HYPER, step)
        accumulate_and_update(w, s, grad, slots, offsets, psw, mode, False, optimizer, *HYPER, step,
                              extra_rows=ew, extra_state=es)  # fmt: skip
    assert torch.equal(torch.cat([w, ew]), whole_w) and torch.equal(torch.cat([s, es]), whole_s)
    assert not torch.equal(ew, rows[C:]), "the extra rows got no update"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
@pytest.mark.parametrize("dim", [16, 128, 600])
def test_many_with_extra_rows_equals_one_call_per_table(device, optimizer, dim):
    """Tables with and without extra rows in one call: each as its own call, bit for bit."""
    cases = [_case(device, C, E, dim, optimizer, k % 2, k == 1, seed=k, hot=100 * (k == 2))
             for k, (C, E) in enumerate([(40, 1), (70, 0), (33, 2)])]  # fmt: skip
    each, many = [], []
    for (rows, state, *_), (C, E) in zip(cases, [(40, 1), (70, 0), (33, 2)]):
        each.append(_split(rows, state, C))
        many.append(_split(rows, state, C))
    for mode in (0,):
        for step in (1, 2):
            for (w, s, ew, es), (_, _, grad, slots, offsets, psw) in zip(each, cases):
                accumulate_and_update(w, s, grad, slots, offsets, psw, mode, False, optimizer, *HYPER, step,
                                      extra_rows=ew if ew.numel() else None, extra_state=es if ew.numel() else None)  # fmt: skip
            accumulate_and_update_many(
                [m[0] for m in many], [m[1] for m in many], *[[c[i] for c in cases] for i in range(2, 6)], mode, False,
                optimizer, *HYPER, step, extra_rows=[m[2] for m in many], extra_state=[m[3] for m in many],
            )  # fmt: skip
    for k, (a, b) in enumerate(zip(each, many)):
        for x, y, name in zip(a, b, ("weights", "opt_state", "extra_rows", "extra_state")):
            assert torch.equal(x, y), f"table {k}: {name} differs from its own call's"


@pytest.mark.parametrize("device", DEVICES)
def test_extra_rows_opcheck_and_versions(device):
    rows, state, grad, slots, offsets, psw = _case(device, 20, 1, 8, "adagrad", 0, True, seed=3)
    w, s, ew, es = _split(rows, state, 20)
    h = torch.tensor([0.1, 1.0, 0.0, 1e-8], dtype=torch.float64, device=device)
    args = (w, s, grad, slots, offsets, psw, 0, False, 1, h, True, None, ew, es)
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update.default, args)
    many = ([w], [s], [grad], [slots], [offsets], [psw], 0, False, 1, h, True, None, [ew], [es])
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update_many.default, many)
    # The written extra rows' version counters move, as those of weights do (autograd then
    # refuses a backward that saved the rows before the update).
    before = (ew._version, es._version)
    torch.ops.veloce.accumulate_and_update(*args)
    assert ew._version > before[0] and es._version > before[1]
    before = (ew._version, es._version)
    torch.ops.veloce.accumulate_and_update_many(*many)
    assert ew._version > before[0] and es._version > before[1]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_extra_rows_are_refused_and_change_nothing(device):
    rows, state, grad, slots, offsets, psw = _case(device, 20, 1, 8, "adagrad", 0, False, seed=4)
    w, s, ew, es = _split(rows, state, 20)
    h = torch.tensor([0.1, 1.0, 0.0, 1e-8], dtype=torch.float64, device=device)
    op, many = torch.ops.veloce.accumulate_and_update, torch.ops.veloce.accumulate_and_update_many

    def single(e, st):
        op(w, s, grad, slots, offsets, None, 0, False, 1, h, True, None, e, st)

    def grouped(e, st):
        many([w], [s], [grad], [slots], [offsets], [None], 0, False, 1, h, True, None, e, st)

    cases = [
        (lambda: single(ew, None), r"extra_rows and extra_state go together"),
        (lambda: single(ew.double(), es), r"extra_rows must have the dtype of weights"),
        (lambda: single(torch.zeros(1, 4, device=device), es), r"extra_rows.*weights.size\(1\)"),
        (lambda: single(ew, torch.zeros(2, 8, device=device)), r"extra_state"),
        (lambda: single(ew, es.double()), r"extra_state"),
        (lambda: single(torch.zeros(8, 2, device=device).t(), es), r"extra_rows must be contiguous"),
        (lambda: single(w[3:4], s[3:4]), r"(weights|opt_state) and extra_(rows|state) share memory"),
        (lambda: grouped([ew], None), r"extra_rows and extra_state go together"),
        (lambda: grouped([ew, ew], [es, es]), r"weights has 1 but extra_rows"),
        (lambda: grouped([w[:1]], [s[:1]]), r"share memory"),
    ]
    before = [t.clone() for t in (w, s, ew, es)]
    for call, pattern in cases:
        with pytest.raises((RuntimeError, ValueError), match=pattern):
            call()
        for t, b in zip((w, s, ew, es), before):
            assert torch.equal(t, b)
