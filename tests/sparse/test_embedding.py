"""Tests of the embedding op family (pooled_lookup, accumulate_grad) against F.embedding_bag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import veloce
from veloce.ops import extension as _ext
from veloce.ops.embedding import accumulate_grad, pooled_lookup

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")

DIMS = [1, 4, 16, 33, 128]
from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


@st.composite
def bag_cases(draw):
    """A random batch: table (C, D), extra rows (M, D), bags with duplicates, -1, -2, extra slots."""
    dim = draw(st.sampled_from(DIMS))
    num_rows = draw(st.integers(1, 40))
    num_extra = draw(st.integers(0, 4))
    lengths = draw(st.lists(st.integers(0, 7), min_size=0, max_size=8))
    choices = [st.integers(0, num_rows - 1), st.integers(0, min(num_rows, 3) - 1), st.sampled_from([-1, -2])]
    if num_extra:
        choices.append(st.integers(num_rows, num_rows + num_extra - 1))
    slots = [draw(st.one_of(*choices)) for _ in range(sum(lengths))]
    mode = draw(st.sampled_from([0, 1]))
    use_psw = mode == 0 and draw(st.booleans())
    include_last_offset = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dim, num_rows, num_extra, lengths, slots, mode, use_psw, include_last_offset, seed


def make_inputs(case, device, dtype=torch.float32):
    dim, num_rows, num_extra, lengths, slots, mode, use_psw, include_last_offset, seed = case
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(num_rows, dim, generator=g, dtype=torch.float64).to(device, dtype)
    extra = (
        torch.randn(num_extra, dim, generator=g, dtype=torch.float64).to(device, dtype) if num_extra else None
    )
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    starts = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    offsets = (starts if include_last_offset else starts[:-1]).to(device)
    psw = torch.rand(len(slots), generator=g, dtype=torch.float64).to(device, dtype) if use_psw else None
    return weights, slots_t, offsets, psw, mode, include_last_offset, extra


def reference_inputs(weights, slots, extra):
    """Maps veloce slot codes onto one table for F.embedding_bag: [weights; extra; zero row; padding row]."""
    dim = weights.shape[1]
    parts = [weights] + ([extra] if extra is not None else []) + [weights.new_zeros(2, dim)]
    table = torch.cat(parts).detach()
    zero_row, pad_row = table.shape[0] - 2, table.shape[0] - 1
    ids = torch.where(slots == -2, zero_row, torch.where(slots == -1, pad_row, slots))
    return table, ids, pad_row


def _reference_bags(weights, slots, offsets, psw, mode, include_last_offset, extra, requires_grad=False):
    """(F.embedding_bag over the reference table, that table)."""
    table, ids, pad = reference_inputs(weights, slots, extra)
    if requires_grad:
        table.requires_grad_(True)
    out = F.embedding_bag(
        ids,
        table,
        offsets,
        mode=["sum", "mean"][mode],
        per_sample_weights=psw,
        include_last_offset=include_last_offset,
        padding_idx=pad,
    )
    return out, table


def reference_lookup(weights, slots, offsets, psw, mode, include_last_offset, extra):
    return _reference_bags(weights, slots, offsets, psw, mode, include_last_offset, extra)[0]


def reference_dense_grad(grad_output, weights, slots, offsets, psw, mode, include_last_offset, extra):
    out, table = _reference_bags(weights, slots, offsets, psw, mode, include_last_offset, extra, requires_grad=True)
    out.backward(grad_output)
    return table.grad[: weights.shape[0]]


def dense_from_sparse(unique_slots, grad_rows, num_rows):
    return grad_rows.new_zeros(num_rows, grad_rows.shape[1]).index_add_(0, unique_slots, grad_rows)


# ---- reference equivalence ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(case=bag_cases())
def test_pooled_lookup_matches_embedding_bag(device, case):
    args = make_inputs(case, device)
    torch.testing.assert_close(pooled_lookup(*args), reference_lookup(*args), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(case=bag_cases())
def test_accumulate_grad_matches_embedding_bag_backward(device, case):
    weights, slots, offsets, psw, mode, ilo, extra = make_inputs(case, device)
    num_bags = offsets.numel() - (1 if ilo else 0)
    grad_output = torch.randn(num_bags, weights.shape[1], device=device)
    unique_slots, grad_rows = accumulate_grad(grad_output, slots, offsets, psw, mode, ilo, weights.shape[0])
    want = sorted({s for s in slots.tolist() if 0 <= s < weights.shape[0]})
    assert unique_slots.tolist() == want
    assert grad_rows.shape == (len(want), weights.shape[1]) and grad_rows.dtype == grad_output.dtype
    ref = reference_dense_grad(grad_output, weights, slots, offsets, psw, mode, ilo, extra)
    torch.testing.assert_close(
        dense_from_sparse(unique_slots, grad_rows, weights.shape[0]), ref, **TOL[torch.float32]
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@settings(max_examples=15, deadline=None)
@given(case=bag_cases())
def test_other_dtypes(device, dtype, case):
    args = make_inputs(case, device, dtype)
    out = pooled_lookup(*args)
    assert out.dtype == dtype
    weights, slots, offsets, psw, mode, ilo, extra = args
    up = lambda t: None if t is None else t.double()
    ref = reference_lookup(weights.double(), slots, offsets, up(psw), mode, ilo, up(extra))
    tol = TOL[torch.float64] if dtype == torch.float64 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(out.double(), ref, **tol)
    grad_output = torch.randn(out.shape, device=device, dtype=torch.float64)
    us, gr = accumulate_grad(grad_output.to(dtype), slots, offsets, psw, mode, ilo, weights.shape[0])
    assert gr.dtype == dtype
    ref = reference_dense_grad(grad_output, weights.double(), slots, offsets, up(psw), mode, ilo, up(extra))
    torch.testing.assert_close(dense_from_sparse(us, gr.double(), weights.shape[0]), ref, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_grad_merges_gradient_batches(device):
    g = torch.Generator().manual_seed(0)
    slots = torch.randint(0, 1000, (5000,), generator=g).to(device)
    rows = torch.randn(5000, 16, generator=g).to(device)
    us, gr = accumulate_grad(rows, slots, torch.arange(5000, device=device), None, "sum", False, 1000)
    torch.testing.assert_close(us, torch.unique(slots))
    ref = torch.zeros(1000, 16, device=device).index_add_(0, slots, rows)[us]
    torch.testing.assert_close(gr, ref, **TOL[torch.float32])


def test_accumulate_grad_is_deterministic_across_thread_counts():
    g = torch.Generator().manual_seed(1)
    n = 300_000  # large enough for the parallel radix sort
    slots = torch.randint(0, 50, (n,), generator=g)
    rows = torch.randn(n, 4, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        us1, gr1 = accumulate_grad(rows, slots, torch.arange(n), None, 0, False, 50)
        torch.set_num_threads(max(2, threads))
        us2, gr2 = accumulate_grad(rows, slots, torch.arange(n), None, 0, False, 50)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(us1, us2) and torch.equal(gr1, gr2)
    # Sums run in position order: the same as a sequential float32 sum of each slot's rows.
    mask = slots == int(us1[7])
    want = torch.zeros(4)
    for r in rows[mask][:2000]:
        want += r
    _, part = accumulate_grad(rows[mask][:2000], slots[mask][:2000], torch.arange(2000), None, 0, False, 50)
    assert torch.equal(part[0], want)


# Bags across the CPU kernels' chunks of 32 rows (padding and zero rows take no place in a
# chunk), dims with every remainder of their 16- (fp32) and 8-column (fp64) blocks.
LONG_BAG_LENGTHS = [0, 1, 31, 32, 33, 64, 65, 100, 3]
ODD_DIMS = [1, 3, 15, 16, 17, 31, 33, 100, 600]  # 600: chunks of fewer rows (wide rows)
ACC = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32,
       torch.float16: torch.float32}
BIT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def long_bags(dtype, dim, seed):
    g = torch.Generator().manual_seed(seed)
    C, M = 50, 3
    weights = torch.randn(C, dim, generator=g, dtype=torch.float64).to(dtype)
    extra = torch.randn(M, dim, generator=g, dtype=torch.float64).to(dtype)
    bags = []
    for n in LONG_BAG_LENGTHS:
        s = torch.randint(0, C + M, (n,), generator=g)
        s[torch.rand(n, generator=g) < 0.1] = -2  # zero rows
        s[torch.rand(n, generator=g) < 0.1] = -1  # padding
        bags.append(s)
    rows = lambda n: torch.randint(0, C + M, (n,), generator=g)  # noqa: E731
    pad, zero = torch.full((5,), -1), torch.full((3,), -2)
    bags += [
        rows(32),  # exactly one full chunk
        rows(64),  # exactly two
        torch.cat([rows(32), pad]),  # a full chunk, then padding: a last chunk of no rows
        torch.cat([rows(32), zero, pad]),  # ... of zero rows, which mean pooling counts
        torch.cat([pad, rows(40), zero, rows(24)]),  # two chunks, the second full
        torch.full((70,), -1),  # padding only, longer than a chunk
    ]
    starts = torch.tensor([0] + [len(b) for b in bags]).cumsum(0)
    slots = torch.cat(bags)
    psw = torch.rand(len(slots), generator=g, dtype=torch.float64).to(dtype)
    return weights, extra, slots, starts, psw


def sequential_lookup(weights, extra, slots, starts, psw, mean):
    """pooled_lookup position by position, each step one rounding in the accumulation dtype."""
    acc_t = ACC[weights.dtype]
    table = torch.cat([weights, extra]).to(acc_t)
    out = []
    for b in range(len(starts) - 1):
        a = torch.zeros(weights.shape[1], dtype=acc_t)
        count = 0
        for i in range(int(starts[b]), int(starts[b + 1])):
            s = int(slots[i])
            if s == -1:
                continue
            count += 1
            if s == -2:
                continue
            a = a + (psw[i].to(acc_t) * table[s] if psw is not None else table[s])
        out.append(a / count if mean and count > 0 else a)
    return torch.stack(out).to(weights.dtype)


@pytest.mark.parametrize("dtype", BIT_DTYPES)
@pytest.mark.parametrize("dim", ODD_DIMS)
@pytest.mark.parametrize("variant", ["sum", "mean", "weighted"])
def test_cpu_pooled_lookup_adds_in_position_order_bit_for_bit(dtype, dim, variant):
    """The CPU kernel is the specification: its sums equal a sequential sum exactly, whatever
    the bag length (chunks of positions) and dim (column blocks)."""
    weights, extra, slots, starts, psw = long_bags(dtype, dim, seed=dim)
    psw = psw if variant == "weighted" else None
    mean = variant == "mean"
    got = pooled_lookup(weights, slots, starts[:-1], psw, "mean" if mean else "sum", extra_rows=extra)
    assert torch.equal(got, sequential_lookup(weights, extra, slots, starts, psw, mean))


@pytest.mark.parametrize("dtype", BIT_DTYPES)
@pytest.mark.parametrize("dim", ODD_DIMS)
@pytest.mark.parametrize("variant", ["sum", "mean", "weighted"])
def test_cpu_accumulate_grad_adds_in_position_order_bit_for_bit(dtype, dim, variant):
    """Each slot's gradient is its positions' rows (times their scale) added one by one in
    position order: runs longer than a chunk included."""
    _, _, slots, starts, psw = long_bags(dtype, dim, seed=dim + 1)
    slots = torch.where(slots >= 0, slots % 4, slots)  # 4 slots: segments of about 100 rows
    slots[slots == 3] = 2  # and a segment of exactly 64 rows, the first 64 of slot 3's
    slots[(slots == 2).nonzero().flatten()[:64]] = 3
    psw = psw if variant == "weighted" else None
    acc_t = ACC[dtype]
    B = len(starts) - 1
    g = torch.Generator().manual_seed(dim)
    grad_output = torch.randn(B, dim, generator=g, dtype=torch.float64).to(dtype)
    us, gr = accumulate_grad(grad_output, slots, starts[:-1], psw, variant if variant == "mean" else "sum", False, 4)
    bag_of = torch.repeat_interleave(torch.arange(B), starts.diff())
    counts = torch.tensor([int((slots[starts[b] : starts[b + 1]] != -1).sum()) for b in range(B)])
    want = []
    for u in us.tolist():
        a = torch.zeros(dim, dtype=acc_t)
        for i in (slots == u).nonzero().flatten().tolist():
            b = int(bag_of[i])
            row = grad_output[b].to(acc_t)
            if psw is not None:
                a = a + psw[i].to(acc_t) * row
            elif variant == "mean":
                a = a + (torch.ones((), dtype=acc_t) / int(counts[b])) * row
            else:
                a = a + row
        want.append(a)
    assert torch.equal(gr, torch.stack(want).to(dtype))


def test_empty_inputs():
    w = torch.randn(5, 3)
    out = pooled_lookup(w, torch.empty(0, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert torch.equal(out, torch.zeros(3, 3))
    out = pooled_lookup(w, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 3)
    us, gr = accumulate_grad(
        torch.randn(3, 3), torch.tensor([-1, -2, 9]), torch.tensor([0, 1, 3]), num_rows=5
    )
    assert us.numel() == 0 and gr.shape == (0, 3)


# ---- CUDA against the CPU kernel (the specification) ------------------------------------

CUDA = [d for d in DEVICES if d != "cpu"]  # skipped, with the reason, where CUDA is absent

# Bag length mixes, drawn in random order. Their mean lengths (about 0.75, 1.07, 1.5, 2.2
# and 5.2) make the CUDA launcher put 4, 3, 2, 1 and 1 bags in one lane group (4 * B / N,
# clamped to 1..4); long bags (5, 20) sit among short and empty ones in most mixes.
LENGTH_MIXES = {
    "ones_and_empty": [0] * 40 + [1] * 10 + [2, 3, 5, 20],
    "mostly_ones": [0] * 5 + [1] * 20 + [2, 3, 5],
    "ones_twos_20": [0] * 10 + [1] * 20 + [2] * 10 + [20],
    "up_to_five": [0, 1, 2, 3, 5],
    "mixed": [0, 1, 2, 3, 5, 20],
}


def many_bags(dtype, dim, mix, seed, num_bags=1000 + 7):
    """B bags (not a multiple of 2, 3 or 4) with lengths drawn from LENGTH_MIXES[mix]; ~10%
    of the slots -1, ~10% -2, some in the extra rows; weights, extra rows and per-sample
    weights in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(LENGTH_MIXES[mix])
    lengths = pool[torch.randint(0, len(pool), (num_bags,), generator=g)]
    n = int(lengths.sum())
    C, M = 5000, 7
    slots = torch.randint(0, C + M, (n,), generator=g)
    code = torch.rand(n, generator=g)
    slots = torch.where(code < 0.1, -1, torch.where(code < 0.2, -2, slots))
    weights = torch.randn(C, dim, generator=g, dtype=torch.float64).to(dtype)
    extra = torch.randn(M, dim, generator=g, dtype=torch.float64).to(dtype)
    psw = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return weights, slots, starts, psw, extra


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 3, 4, 64, 128, 600])
@pytest.mark.parametrize("mix", list(LENGTH_MIXES))
def test_pooled_lookup_cuda_matches_cpu_many_bags(device, dtype, dim, mix):
    """Thousands of mixed-length bags: CUDA lane groups of 1 to 4 bags, every vector width
    and column loop, against the CPU kernel. Without per-sample weights both sum the same
    values in the same (position) order in the same accumulator type: equal bit for bit;
    with them CUDA may fuse the multiply-add, so only to rounding."""
    weights, slots, starts, psw, extra = many_bags(dtype, dim, mix, seed=dim)
    for include_last_offset in (False, True):
        offsets = starts if include_last_offset else starts[:-1]
        for mode, p, ex in ((0, None, extra), (1, None, extra), (0, psw, extra), (0, None, None)):
            s = slots if ex is not None else slots.clamp(max=weights.shape[0] - 1)
            args = (weights, s, offsets, p, mode, include_last_offset, ex)
            want = pooled_lookup(*args)
            got = pooled_lookup(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
            assert got.dtype == dtype and got.shape == want.shape
            if p is None:
                assert torch.equal(got.cpu(), want), (mode, include_last_offset)
            else:
                tol = {
                    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
                    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
                    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
                    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
                }[dtype]
                torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("bag", [1, 5])
def test_pooled_lookup_cuda_output_past_2_31_elements(device, bag):
    """B * D > 2^31 output elements (4 GiB of bfloat16): row offsets need 64 bits. Bags of
    one (4 bags per lane group) and of five (1); the first and last bags against the CPU."""
    D, B = 2048, (1 << 20) + 5
    if torch.cuda.get_device_properties(device).total_memory < 16 * 2**30:
        pytest.skip("needs a GPU with 16 GiB")
    g = torch.Generator().manual_seed(bag)
    weights = torch.randn(1000, D, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, 1000, (B * bag,), generator=g)
    offsets = torch.arange(0, B * bag, bag)
    out = pooled_lookup(weights.to(device), slots.to(device), offsets.to(device))
    assert out.shape == (B, D)
    for first in (0, B - 9):
        bags = slice(first, first + 9)
        want = pooled_lookup(weights, slots[first * bag : (first + 9) * bag], offsets[bags] - first * bag)
        assert torch.equal(out[bags].cpu(), want)
    del out
    torch.cuda.empty_cache()


# ---- bag_layouts_bad ----------------------------------------------------------------------


def layout_breaks_a_rule(offsets: list[int], n: int, include_last_offset: bool) -> bool:
    """nn.EmbeddingBag's offsets rules, written out on the host (the reference)."""
    if not offsets:
        return n > 0 or include_last_offset
    decreasing = any(b < a for a, b in zip(offsets, offsets[1:]))
    last = offsets[-1]
    return offsets[0] != 0 or decreasing or last > n or (include_last_offset and last != n)


def random_layout(gen: torch.Generator, flaw: str) -> tuple[list[int], int, bool]:
    """Offsets over n ids, good or with one ``flaw``."""
    bags = int(torch.randint(0, 40, (1,), generator=gen))
    lengths = torch.randint(0, 4, (bags,), generator=gen).tolist()
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    n = starts[-1]
    ilo = bool(torch.randint(0, 2, (1,), generator=gen))
    offsets = starts if ilo else starts[:-1]
    if flaw == "first" and offsets:
        offsets[0] = 1
    elif flaw == "decrease" and len(offsets) > 2:
        i = int(torch.randint(1, len(offsets), (1,), generator=gen))
        offsets[i] = offsets[i - 1] - 1
    elif flaw == "past_end" and offsets:
        offsets[-1] = n + 1
    elif flaw == "last_short" and ilo and offsets:
        n += 1  # the last entry no longer equals n
    elif flaw == "empty":
        offsets, n = [], 3
    return offsets, n, ilo


@pytest.mark.parametrize("device", DEVICES)
def test_bag_layouts_bad_flags_exactly_the_broken_layouts(device):
    """Groups of layouts (up to 70: three CUDA launches), each good or with one flaw, anywhere
    in the group: the flag is set exactly when the host reference finds a broken rule."""
    from veloce.ops.embedding import bag_layouts_bad

    gen = torch.Generator().manual_seed(0)
    flaws = ["first", "decrease", "past_end", "last_short", "empty"]
    seen = {True: 0, False: 0}
    for trial in range(60):
        k = int(torch.randint(1, 71, (1,), generator=gen))
        layouts = [random_layout(gen, "none") for _ in range(k)]
        if trial % 2:
            j = int(torch.randint(0, k, (1,), generator=gen))
            layouts[j] = random_layout(gen, flaws[trial // 2 % len(flaws)])
        want = any(layout_breaks_a_rule(*lay) for lay in layouts)
        offsets = [torch.tensor(o, dtype=torch.long, device=device) for o, _, _ in layouts]
        got = bag_layouts_bad(offsets, [n for _, n, _ in layouts], [i for _, _, i in layouts])
        assert got.shape == (1,) and got.dtype == torch.bool and got.device.type == device
        assert bool(got) == want, layouts
        seen[want] += 1
    assert seen[True] > 10 and seen[False] > 10


@pytest.mark.parametrize("device", DEVICES)
def test_bag_layouts_bad_of_a_long_layout(device):
    """One decrease in a million entries, at either end or in the middle, is found."""
    from veloce.ops.embedding import bag_layouts_bad

    n = 1 << 20
    good = torch.arange(n, device=device)
    assert not bool(bag_layouts_bad([good], [n], [False]))
    assert not bool(bag_layouts_bad([torch.cat([good, good.new_tensor([n])])], [n], [True]))
    for i in (1, n // 2 + 7, n - 1):
        bad = good.clone()
        bad[i] = bad[i - 1] - 1
        assert bool(bag_layouts_bad([good, bad], [n, n], [False, False]))


@pytest.mark.parametrize("device", DEVICES)
def test_bag_layouts_bad_maps_each_entry_to_its_layout(device):
    """Empty layouts between non-empty ones (skipped by the kernels, so the others' ids and
    include_last_offset must stay with them), and strided offsets (views): a rule that holds
    for one layout's ids but not its neighbour's is judged by its own."""
    from veloce.ops.embedding import bag_layouts_bad

    t = lambda *v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    empty = t()
    offsets = [empty, t(0, 2, 5), empty, empty, t(0, 1), empty, t(0, 3)]
    num_ids = [0, 5, 0, 0, 7, 0, 3]
    last = [False, True, False, False, False, False, True]
    assert not bool(bag_layouts_bad(offsets, num_ids, last))
    # One layout's (ids, include_last_offset) changed so that it alone breaks a rule.
    for k, n, ilo in [(1, 4, True), (1, 6, True), (4, 7, True), (4, 0, False), (6, 4, True), (6, 2, False)]:
        bad_n, bad_last = list(num_ids), list(last)
        bad_n[k], bad_last[k] = n, ilo
        assert bool(bag_layouts_bad(offsets, bad_n, bad_last)), (k, n, ilo)
    # ... and the same values moved onto a layout they suit: good again.
    assert not bool(bag_layouts_bad(offsets, [0, 6, 0, 0, 1, 0, 3], [False, False, False, False, True, False, True]))
    strided = torch.arange(20, device=device)[::2]  # 0, 2, ..., 18: a view with stride 2
    assert not strided.is_contiguous()
    assert not bool(bag_layouts_bad([strided, empty], [18, 0], [True, False]))
    assert bool(bag_layouts_bad([strided.flip(0)[::1], empty], [18, 0], [False, False]))  # decreasing
    assert bool(bag_layouts_bad([strided, empty], [17, 0], [False, False]))  # past the end


@pytest.mark.parametrize("device", DEVICES)
def test_bag_layouts_bad_opcheck_and_bad_arguments(device):
    from veloce.ops.embedding import bag_layouts_bad

    good = [torch.tensor([0, 2, 2], device=device), torch.tensor([0, 1], device=device)]
    torch.library.opcheck(torch.ops.veloce.bag_layouts_bad.default, (good, [3, 1], [0, 1]))
    cases = [
        (([], [], []), ValueError, "offsets must hold at least one tensor"),
        ((good, [3], [0, 1]), ValueError, "one num_ids per offsets tensor: offsets has 2 entries but num_ids has 1"),
        ((good, [3, 1], [0]), ValueError, "one include_last_offset per offsets tensor"),
        ((good, [3, -1], [0, 1]), ValueError, r"num_ids\[1\] must be >= 0, got -1"),
        ((good, [3, 1], [0, 2]), ValueError, r"include_last_offset\[1\] must be 0 or 1, got 2"),
        (([good[0], good[1].int()], [3, 1], [0, 1]), RuntimeError, r"offsets\[1\] must be torch.int64, got torch.int32"),
        (([good[0], good[1].view(1, 2)], [3, 1], [0, 1]), RuntimeError, r"offsets\[1\] must be 1-D"),
    ]  # fmt: skip
    if device == "cuda":
        cases.append((([good[0], good[1].cpu()], [3, 1], [0, 1]), RuntimeError, r"offsets\[1\] .*cpu"))
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            bag_layouts_bad(*args)
    assert bag_layouts_bad(good, [3, 1], [False, True]).tolist() == [False]


# ---- opcheck and gradcheck ------------------------------------------------------------


def sample_inputs(device, dtype=torch.float64):
    weights = torch.randn(12, 5, device=device, dtype=dtype)
    extra = torch.randn(2, 5, device=device, dtype=dtype)
    slots = torch.tensor([3, 3, -1, 0, 12, -2, 7, 13, 11, 3], device=device)
    offsets = torch.tensor([0, 3, 3, 6, 10], device=device)
    psw = torch.rand(10, device=device, dtype=dtype)
    return weights, slots, offsets, psw, extra


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_opcheck(device, mode, include_last_offset):
    weights, slots, offsets, psw, extra = sample_inputs(device)
    psw = psw if mode == 0 else None
    num_bags = offsets.numel() - int(include_last_offset)
    torch.library.opcheck(
        torch.ops.veloce.pooled_lookup.default,
        (weights, slots, offsets, psw, mode, include_last_offset, extra),
    )
    weights.requires_grad_(True)
    torch.library.opcheck(
        torch.ops.veloce.pooled_lookup.default,
        (weights, slots, offsets, psw, mode, include_last_offset, extra),
    )
    grad_output = torch.randn(num_bags, 5, device=device, dtype=torch.float64)
    torch.library.opcheck(
        torch.ops.veloce.accumulate_grad.default,
        (grad_output, slots, offsets, psw, mode, include_last_offset, 12),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_gradcheck(device, include_last_offset):
    weights, slots, offsets, psw, extra = sample_inputs(device)
    weights.requires_grad_(True)
    psw.requires_grad_(True)
    fn = lambda w, p: pooled_lookup(w, slots, offsets, p, "sum", include_last_offset, extra)
    assert torch.autograd.gradcheck(fn, (weights, psw))
    fn = lambda w: pooled_lookup(w, slots, offsets, None, "mean", include_last_offset, extra)
    assert torch.autograd.gradcheck(fn, (weights,))


# ---- bad input ------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
    w, s, o, p, e = sample_inputs("cpu", torch.float32)
    L = torch.long
    cases = [
        (
            lambda: pooled_lookup(w.long(), s, o),
            r"weights must be float32, float64, float16 or bfloat16, got torch.int64",
        ),
        (lambda: pooled_lookup(w, s.float(), o), r"slots must be torch.int64, got torch.float32"),
        (lambda: pooled_lookup(w, s.view(2, 5), o), r"slots must be 1-D, got a 2-D"),
        (lambda: pooled_lookup(w, s.view(1, 2, 5), o), r"slots must be 1-D, got a 3-D"),
        (lambda: pooled_lookup(w.view(1, 12, 5), s, o), r"weights must be 2-D, got a 3-D"),
        (lambda: pooled_lookup(w, s, o.int()), r"offsets must be torch.int64, got torch.int32"),
        (
            lambda: pooled_lookup(w, s, torch.tensor([1, 3], dtype=L)),
            r"offsets must start at 0, got offsets\[0\] = 1",
        ),
        (
            lambda: pooled_lookup(w, s, torch.tensor([0, 5, 3], dtype=L)),
            r"offsets must be non-decreasing.*5.*3",
        ),
        (
            lambda: pooled_lookup(w, s, torch.tensor([0, 11], dtype=L)),
            r"offsets\[1\] = 11 is past the end of the 10",
        ),
        (
            lambda: pooled_lookup(w, s, torch.tensor([0, 4], dtype=L), None, 0, True),
            r"last offset must equal",
        ),
        (
            lambda: pooled_lookup(w, s, o, p[:9]),
            r"per_sample_weights must have one entry per slot \(10\), got 9",
        ),
        (lambda: pooled_lookup(w, s, o, p, "mean"), r"per_sample_weights is only supported with mode 0"),
        (lambda: pooled_lookup(w, s, o, p.double()), r"per_sample_weights must have the dtype"),
        (lambda: pooled_lookup(w, s, o, None, 2), r"mode must be 0 \(sum\) or 1 \(mean\), got 2"),
        (
            lambda: pooled_lookup(w, torch.tensor([0, -3]), torch.tensor([0])),
            r"slots\[1\] = -3 is not a valid slot",
        ),
        (
            lambda: pooled_lookup(w, torch.tensor([12]), torch.tensor([0])),
            r"slots\[0\] = 12 is not a valid slot",
        ),
        (
            lambda: pooled_lookup(w, torch.tensor([14]), torch.tensor([0]), extra_rows=e),
            r"slots\[0\] = 14 .*< 14",
        ),
        (
            lambda: pooled_lookup(w, s, o, extra_rows=e[:, :4]),
            r"extra_rows.size\(1\) must equal weights.size\(1\)",
        ),
        (
            lambda: accumulate_grad(torch.randn(3, 5), s, o, num_rows=12),
            r"grad_output must have one row per bag \(5 bags\), got 3 rows",
        ),
        (
            lambda: accumulate_grad(torch.randn(5, 5).long(), s, o, num_rows=12),
            r"grad_output must be float32",
        ),
        (
            lambda: accumulate_grad(torch.randn(4, 5, 1), s, o, num_rows=12),
            r"grad_output must be 2-D, got a 3-D",
        ),
        (
            lambda: accumulate_grad(torch.randn(5, 5), s, o, p, 1, num_rows=12),
            r"per_sample_weights is only supported",
        ),
        (
            lambda: accumulate_grad(torch.randn(5, 5), s, o, p[:3], num_rows=12),
            r"per_sample_weights must have one",
        ),
        (
            lambda: accumulate_grad(torch.randn(1, 5), torch.tensor([-5]), torch.tensor([0]), num_rows=12),
            r"slots\[0\] = -5 is not a valid slot",
        ),
        (lambda: accumulate_grad(torch.randn(5, 5), s, o, num_rows=-1), r"num_rows must be >= 0, got -1"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
    with pytest.raises(ValueError, match="mode must be one of"):
        pooled_lookup(w, s, o, mode="max")


def test_veloce_exposes_ops():
    assert veloce.ops.embedding.pooled_lookup is pooled_lookup


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [0, 1])
def test_accumulate_grad_hot_slot_repeated_many_times(device, mode):
    """A Zipf-hot id: one slot at 5000 positions (CUDA reduces such runs in two levels),
    next to short runs. Matches the dense autograd reference and repeats bit for bit."""
    g = torch.Generator().manual_seed(0)
    C, D, n = 50, 33, 6000
    slots = torch.where(torch.rand(n, generator=g) < 0.8, torch.tensor(7), torch.randint(0, C, (n,), generator=g))
    offsets = torch.arange(0, n, 3)
    grad_out = torch.randn(offsets.numel(), D, generator=g, dtype=torch.float64)
    w = torch.randn(C, D, dtype=torch.float64, requires_grad=True)
    F.embedding_bag(slots, w, offsets, mode="sum" if mode == 0 else "mean").backward(grad_out)
    args = (grad_out.float().to(device), slots.to(device), offsets.to(device), None, mode, False, C)
    uniq, rows = accumulate_grad(*args)
    uniq2, rows2 = accumulate_grad(*args)
    assert torch.equal(uniq, uniq2) and torch.equal(rows, rows2)
    dense = torch.zeros(C, D, dtype=torch.float64)
    dense[uniq.cpu()] = rows.cpu().double()
    torch.testing.assert_close(dense, w.grad, rtol=1e-4, atol=1e-3)


# ---- pooled_lookup_many ---------------------------------------------------------------


def _many_lookup_cases(device, dtype=torch.float32):
    """Tables of one dim and dtype with everything that varies per table: sizes, bag lengths
    (one id each, or mixed and empty), modes, per-sample weights, extra rows, a table with no
    bags and one with no positions, and the first table again."""
    g = torch.Generator().manual_seed(11)
    cases = []
    for k, (rows, lengths, mode, with_psw, num_extra) in enumerate([
        (30, [1] * 50, 0, False, 0),
        (7, [3, 0, 5, 1, 0, 0, 9, 2], 1, False, 2),
        (100, [2, 2, 7, 1], 0, True, 0),
        (5, [], 0, False, 0),
        (12, [0, 0, 0], 1, False, 0),
        (64, [4] * 40 + [0, 1], 0, True, 3),
    ]):  # fmt: skip
        weights = torch.randn(rows, 6, generator=g, dtype=torch.float64).to(device, dtype)
        extra = torch.randn(num_extra, 6, generator=g, dtype=torch.float64).to(device, dtype) if num_extra else None
        n = sum(lengths)
        slots = torch.randint(-2, rows + num_extra, (n,), generator=g).to(device)
        offsets = (torch.tensor([0] + lengths[:-1], dtype=torch.long).cumsum(0) if lengths else torch.zeros(0, dtype=torch.long)).to(device)
        psw = torch.rand(n, generator=g, dtype=torch.float64).to(device, dtype) if with_psw else None
        cases.append((weights, slots, offsets, psw, mode, extra))
    cases.append(cases[0])
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_pooled_lookup_many_equals_one_lookup_per_table(device, dtype):
    """Entry k of pooled_lookup_many is pooled_lookup of table k, bit for bit (on CUDA one
    launch for all the tables, each reading its own arguments); each result is its own tensor."""
    from veloce.ops.embedding import pooled_lookup_many

    cases = _many_lookup_cases(device, dtype)
    w, s, o, p, m, e = (list(x) for x in zip(*cases))
    got = pooled_lookup_many(w, s, o, p, m, False, e)
    assert len(got) == len(cases)
    for out, (weights, slots, offsets, psw, mode, extra) in zip(got, cases):
        assert torch.equal(out, pooled_lookup(weights, slots, offsets, psw, mode, False, extra))
    assert len({out.data_ptr() for out in got if out.numel()}) == sum(out.numel() > 0 for out in got)


@pytest.mark.parametrize("device", CUDA)
def test_pooled_lookup_many_cuda_matches_cpu_over_launches(device):
    """70 tables (three launches of at most 32), of varied bag lengths, against the CPU."""
    from veloce.ops.embedding import pooled_lookup_many

    g = torch.Generator().manual_seed(5)
    w, s, o = [], [], []
    for k in range(70):
        n = int(torch.randint(0, 300, (1,), generator=g))
        w.append(torch.randn(50 + k, 128, generator=g))
        s.append(torch.randint(-1, 50 + k, (n,), generator=g))
        cut = torch.randint(0, n + 1, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).sort().values
        o.append(torch.cat([torch.zeros(1, dtype=torch.long), cut]))
    want = pooled_lookup_many(w, s, o, None, "sum")
    got = pooled_lookup_many([x.to(device) for x in w], [x.to(device) for x in s], [x.to(device) for x in o],
                             None, "sum")  # fmt: skip
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_pooled_lookup_many_opcheck(device):
    cases = _many_lookup_cases(device, torch.float64)[:3]
    w, s, o, p, m, e = (list(x) for x in zip(*cases))
    torch.library.opcheck(torch.ops.veloce.pooled_lookup_many.default, (w, s, o, p, m, False, e))
    from veloce.ops.embedding import pooled_lookup_many

    assert pooled_lookup_many([], [], []) == []
    with pytest.raises(ValueError, match="not differentiable, but an input requires grad"):
        pooled_lookup_many([w[0].clone().requires_grad_(True)], s[:1], o[:1])
    with torch.no_grad():
        assert len(pooled_lookup_many([w[0].clone().requires_grad_(True)], s[:1], o[:1])) == 1


def test_pooled_lookup_many_bad_inputs_name_the_table():
    from veloce.ops.embedding import pooled_lookup_many

    w, s, o, _, _ = sample_inputs("cpu", torch.float32)
    with pytest.raises(ValueError, match="one entry per table: weights has 2 but slots has 1"):
        pooled_lookup_many([w, w], [s], [o, o])
    with pytest.raises(ValueError, match="weights\\[1\\] has dim 3 but weights\\[0\\] has dim 5"):
        pooled_lookup_many([w, torch.randn(4, 3)], [s, s.clamp(max=3)], [o, o])
    with pytest.raises(ValueError, match="weights\\[1\\] is torch.float64 but weights\\[0\\] is torch.float32"):
        pooled_lookup_many([w, w.double()], [s.clamp(max=11), s.clamp(max=11)], [o, o])
    with pytest.raises(RuntimeError, match=r"pooled_lookup_many \(table 1\).*slots"):
        pooled_lookup_many([w, w], [s.clamp(max=11), s + 100], [o, o])


# ---- autograd at the op layer --------------------------------------------------------------
def _written_tensors_bumped(device):
    """Each op that writes its arguments (Tensor(a!) in its schema), run once on a small
    table: (name, [versions of the written tensors before], [after])."""
    from veloce.ops import optimizer as opt
    from veloce.table import HashTable

    cases = []
    table = HashTable(4, 0, capacity=32, device=device)
    ids = torch.tensor([1, 2, 3], device=device)

    def run(name, fn, tensors):
        before = [t._version for t in tensors]
        fn()
        cases.append((name, before, [t._version for t in tensors]))

    b = table._buffers
    everything = [b["keys"], b["digests"], b["scores"], b["weights"], b["opt_state"]]
    run("find_or_insert", lambda: table.find_or_insert(ids), everything)
    run("insert_or_assign", lambda: table.insert(ids, torch.ones(3, 4, device=device)), everything)
    run("erase", lambda: table.erase(ids[:1]), [b["digests"]])
    w, s = torch.zeros(8, 4, device=device), torch.zeros(8, 4, device=device)
    slots = torch.tensor([2, 5], device=device)
    run("sparse_update", lambda: opt.sparse_update(w, s, slots, torch.ones(2, 4, device=device), "adagrad", lr=0.1),
        [w, s])  # fmt: skip
    run("accumulate_and_update",
        lambda: opt.accumulate_and_update(w, s, torch.ones(1, 4, device=device), slots, torch.tensor([0], device=device),
                                          None, "sum", False, "adagrad", lr=0.1), [w, s])  # fmt: skip
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_ops_that_write_their_arguments_bump_the_version_counters(device):
    """As torch's in-place ops do: autograd can then tell that a tensor it saved changed."""
    for name, before, after in _written_tensors_bumped(device):
        assert all(a > b for a, b in zip(after, before)), (name, before, after)


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_after_an_update_of_its_saved_rows_raises(device):
    """pooled_lookup saves the rows for the gradient of per_sample_weights; an update of
    them before backward used to give a gradient computed from the new rows, silently."""
    from veloce.ops import optimizer as opt

    w = torch.randn(8, 4, device=device)
    psw = torch.ones(3, device=device, requires_grad=True)
    out = pooled_lookup(w, torch.tensor([1, 2, 3], device=device), torch.tensor([0], device=device), psw)
    opt.sparse_update(w, torch.zeros(8, 0, device=device), torch.tensor([1], device=device),
                      torch.ones(1, 4, device=device), "sgd", lr=10.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_double_backward_through_pooled_lookup_raises():
    """The weights' gradient comes from accumulate_grad, which has no derivative: a second
    derivative through it raised nothing and was wrong (gradgradcheck failed)."""
    w = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    out = pooled_lookup(w, torch.tensor([0, 2, 2, 5]), torch.tensor([0, 1]))
    (g,) = torch.autograd.grad(out.pow(2).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_pooled_lookup_many_refuses_a_backward():
    w = torch.randn(4, 2, requires_grad=True)
    (out,) = torch.ops.veloce.pooled_lookup_many([w], [torch.tensor([1, 2])], [torch.tensor([0])], [None], [0], False,
                                                 [None])  # fmt: skip
    with pytest.raises(RuntimeError, match="pooled_lookup_many has no gradient: call pooled_lookup per table"):
        out.sum().backward()


def test_wrapper_arguments_that_used_to_be_misread():
    from veloce.ops.exchange import bucketize_bags

    with pytest.raises(TypeError, match="num_rows is required"):
        accumulate_grad(torch.ones(1, 2), torch.tensor([0]), torch.tensor([0]))
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 4])
    with pytest.raises(TypeError, match="world_size must be an int, got True"):
        bucketize_bags(ids, offsets, True, 4)  # the op's order, not the wrapper's
    with pytest.raises(ValueError, match=r"Adam.eps must be a finite number > 0"):
        veloce.optim.Adam(eps=0.0)
