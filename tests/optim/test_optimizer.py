"""Tests of the optimizer op family (sparse_update) against torch optimizers, 10 steps each."""

from __future__ import annotations

import math

import pytest
import torch

from veloce.ops import extension as _ext
from veloce.ops.optimizer import hparams, sparse_update, state_width

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")

DIMS = [1, 4, 16, 33, 128]
from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)
STEPS = 10
NUM_ROWS = 24


def batches(seed, dim, device, dtype, steps=STEPS):
    """``steps`` batches of (unique unsorted slots, grads); a batch may be empty."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        k = int(torch.randint(0, NUM_ROWS + 1, (1,), generator=g))
        slots = torch.randperm(NUM_ROWS, generator=g)[:k]
        grads = torch.randn(k, dim, generator=g, dtype=torch.float64)
        out.append((slots.to(device), grads.to(device, dtype)))
    return out


def run_ours(optimizer, weights, batches_, lr, weight_decay, eps=1e-10, beta1=0.9, beta2=0.999):
    w = weights.clone()
    state = torch.zeros(
        w.shape[0],
        state_width(optimizer, w.shape[1]),
        device=w.device,
        dtype=torch.float64 if w.dtype == torch.float64 else torch.float32,
    )
    for t, (slots, grads) in enumerate(batches_, start=1):
        sparse_update(w, state, slots, grads, optimizer, lr, eps, beta1, beta2, weight_decay, t)
    return w, state


def run_torch_dense(make_opt, weights, batches_, weight_decay):
    """A dense parameter whose gradient is zero outside the touched rows (lazy L2 added by hand)."""
    p = torch.nn.Parameter(weights.clone())
    opt = make_opt([p])
    for slots, grads in batches_:
        grad = torch.zeros_like(p)
        grad[slots] = grads + weight_decay * p.detach()[slots]
        p.grad = grad
        opt.step()
    return p.detach(), opt


def tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=6, deadline=None)
@given(dim=st.sampled_from(DIMS), seed=st.integers(0, 2**16), weight_decay=st.sampled_from([0.0, 0.01]))
def test_sgd_matches_torch(device, dtype, dim, seed, weight_decay):
    weights = torch.randn(NUM_ROWS, dim, dtype=dtype, device=device)
    data = batches(seed, dim, device, dtype)
    ours, state = run_ours("sgd", weights, data, 0.05, weight_decay)
    assert state.shape == (NUM_ROWS, 0)
    ref, _ = run_torch_dense(lambda ps: torch.optim.SGD(ps, lr=0.05), weights, data, weight_decay)
    torch.testing.assert_close(ours, ref, **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=6, deadline=None)
@given(dim=st.sampled_from(DIMS), seed=st.integers(0, 2**16), weight_decay=st.sampled_from([0.0, 0.01]))
def test_adagrad_matches_torch(device, dtype, dim, seed, weight_decay):
    weights = torch.randn(NUM_ROWS, dim, dtype=dtype, device=device)
    data = batches(seed, dim, device, dtype)
    ours, state = run_ours("adagrad", weights, data, 0.1, weight_decay, eps=1e-10)
    ref, opt = run_torch_dense(
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10), weights, data, weight_decay
    )
    torch.testing.assert_close(ours, ref, **tol(dtype))
    torch.testing.assert_close(state.to(dtype), next(iter(opt.state.values()))["sum"], **tol(dtype))


def rowwise_adagrad_reference(weights, batches_, lr, eps, weight_decay):
    """FBGEMM's row-wise Adagrad: one accumulator per row, the mean of the squared gradient."""
    w = weights.clone().double()
    acc = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
    for slots, grads in batches_:
        for slot, grad in zip(slots.tolist(), grads.double()):
            g = grad + weight_decay * w[slot]
            acc[slot] += (g * g).mean()
            w[slot] -= lr * g / (acc[slot].sqrt() + eps)
    return w.to(weights.dtype), acc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=6, deadline=None)
@given(dim=st.sampled_from(DIMS), seed=st.integers(0, 2**16), weight_decay=st.sampled_from([0.0, 0.01]))
def test_rowwise_adagrad_matches_reference(device, dtype, dim, seed, weight_decay):
    weights = torch.randn(NUM_ROWS, dim, dtype=dtype, device=device)
    data = batches(seed, dim, device, dtype)
    ours, state = run_ours("rowwise_adagrad", weights, data, 0.1, weight_decay, eps=1e-8)
    ref, acc = rowwise_adagrad_reference(weights, data, 0.1, 1e-8, weight_decay)
    torch.testing.assert_close(ours, ref, **tol(dtype))
    torch.testing.assert_close(state[:, 0].double(), acc, **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=6, deadline=None)
@given(dim=st.sampled_from(DIMS), seed=st.integers(0, 2**16))
def test_adam_matches_sparse_adam(device, dtype, dim, seed):
    weights = torch.randn(NUM_ROWS, dim, dtype=dtype, device=device)
    data = batches(seed, dim, device, dtype)
    ours, state = run_ours("adam", weights, data, 0.01, 0.0, eps=1e-8, beta1=0.8, beta2=0.99)
    p = torch.nn.Parameter(weights.clone())
    opt = torch.optim.SparseAdam([p], lr=0.01, betas=(0.8, 0.99), eps=1e-8)
    for slots, grads in data:
        p.grad = torch.sparse_coo_tensor(slots.unsqueeze(0), grads, p.shape, check_invariants=True)
        opt.step()
    torch.testing.assert_close(ours, p.detach(), **tol(dtype))
    if opt.state:  # SparseAdam creates its state on the first non-empty gradient
        s = opt.state[p]
        torch.testing.assert_close(state[:, :dim].to(dtype), s["exp_avg"], **tol(dtype))
        torch.testing.assert_close(state[:, dim:].to(dtype), s["exp_avg_sq"], **tol(dtype))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights_follow_float32(optimizer, dtype):
    weights = torch.randn(NUM_ROWS, 16)
    data = batches(3, 16, "cpu", torch.float32)
    ref, _ref_state = run_ours(optimizer, weights, data, 0.01, 0.0, eps=1e-8)
    low = [(s, g.to(dtype)) for s, g in data]
    ours, state = run_ours(optimizer, weights.to(dtype), low, 0.01, 0.0, eps=1e-8)
    assert ours.dtype == dtype and state.dtype == torch.float32
    torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=2e-2)


def test_adam_bias_correction_uses_step():
    w = torch.zeros(4, 2)
    state = torch.zeros(4, 4)
    sparse_update(w, state, torch.tensor([1]), torch.ones(1, 2), "adam", 0.1, 1e-8, 0.9, 0.999, 0.0, 1)
    # First step: m = 0.1, v = 0.001; step_size = lr * sqrt(1 - b2) / (1 - b1).
    want = -0.1 * math.sqrt(0.001) / 0.1 * 0.1 / (math.sqrt(0.001) + 1e-8)
    assert w[1, 0].item() == pytest.approx(want, rel=1e-6)
    assert torch.equal(w[0], torch.zeros(2))


# The scalar arguments of the tests below (eps, beta1, beta2) as each optimizer's own hparams.
_OWN = {0: {}, 1: {"eps": 1e-8}, 2: {"eps": 1e-8}, 3: {"eps": 1e-8, "beta1": 0.9, "beta2": 0.999}}


def _op_hparams(optimizer, lr, eps, beta1, beta2, weight_decay, step, device="cpu"):
    """The ops' hparams of the scalar arguments (the optimizer's own among eps, beta1, beta2)."""
    names = {0: (), 1: ("eps",), 2: ("eps",), 3: ("eps", "beta1", "beta2")}.get(optimizer, ())
    given = {"eps": eps, "beta1": beta1, "beta2": beta2}
    values = [lr, float(step), weight_decay] + [given[n] for n in names]
    return torch.tensor(values, dtype=torch.float64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", [0, 1, 2, 3])
def test_opcheck(device, optimizer):
    weights = torch.randn(10, 6, device=device)
    state = torch.rand(10, state_width(optimizer, 6), device=device)
    args = (
        weights,
        state,
        torch.tensor([7, 1, 4], device=device),
        torch.randn(3, 6, device=device),
        optimizer,
        hparams(optimizer, 0.1, 3, 0.01, device=device, **_OWN[optimizer]),
    )
    torch.library.opcheck(torch.ops.veloce.sparse_update.default, args)


def test_bad_inputs_name_the_argument_and_change_nothing():
    w = torch.randn(10, 4)
    s = torch.rand(10, 4)
    slots = torch.tensor([1, 5])
    g = torch.randn(2, 4)
    cases = [
        (
            {"optimizer": 7},
            r"optimizer must be 0 \(SGD\), 1 \(Adagrad\), 2 \(RowWiseAdagrad\), 3 \(Adam\) or 4 \(FTRL\), got 7",
        ),
        (
            {"opt_state": torch.rand(10, 1)},
            r"opt_state.size\(1\) must be the state width of Adagrad \(S = D = 4",
        ),
        (
            {"opt_state": torch.rand(10, 4), "optimizer": 3},
            r"state width of Adam \(S = 2 \* D = 8 for D = 4\), got 4",
        ),
        ({"opt_state": torch.rand(9, 4)}, r"opt_state.size\(0\) must equal weights.size\(0\) \(10\), got 9"),
        ({"opt_state": s.double()}, r"opt_state must be torch.float32, got torch.float64"),
        ({"slots": torch.tensor([1, 10])}, r"slots\[1\] = 10 is out of range for weights with 10 rows"),
        ({"slots": torch.tensor([-1, 3])}, r"slots\[0\] = -1 is out of range"),
        ({"slots": torch.tensor([5, 5])}, r"slots must be unique, got slot 5 more than once"),
        ({"slots": torch.tensor([1.0, 5.0])}, r"slots must be torch.int64, got torch.float32"),
        ({"grads": torch.randn(2, 5)}, r"grads.size\(1\) must equal weights.size\(1\) \(4\), got 5"),
        ({"grads": torch.randn(3, 4)}, r"grads.size\(0\) must equal slots.numel\(\) \(2\), got 3"),
        ({"grads": g.double()}, r"grads must have the dtype of weights \(torch.float32\), got torch.float64"),
        ({"grads": g.view(2, 4, 1)}, r"grads must be 2-D, got a 3-D"),
        ({"optimizer": 3, "opt_state": torch.rand(10, 8), "step": 0}, r"step must be >= 1 for Adam.*got 0"),
        ({"optimizer": 3, "opt_state": torch.rand(10, 8), "beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ({"lr": float("nan")}, r"lr must be a finite number >= 0, got nan"),
    ]
    for override, pattern in cases:
        args = {
            "weights": w.clone(),
            "opt_state": s.clone(),
            "slots": slots,
            "grads": g,
            "optimizer": 1,
            "lr": 0.1,
            "eps": 1e-8,
            "beta1": 0.9,
            "beta2": 0.999,
            "weight_decay": 0.0,
            "step": 1,
        }
        args.update(override)
        before = (args["weights"].clone(), args["opt_state"].clone())
        with pytest.raises(RuntimeError, match=pattern):
            a = args
            h = _op_hparams(a["optimizer"], a["lr"], a["eps"], a["beta1"], a["beta2"], a["weight_decay"], a["step"])
            torch.ops.veloce.sparse_update(a["weights"], a["opt_state"], a["slots"], a["grads"], a["optimizer"], h)
        assert torch.equal(args["weights"], before[0]) and torch.equal(args["opt_state"], before[1])
    with pytest.raises(RuntimeError, match="weights must be contiguous"):
        sparse_update(w.t().contiguous().t(), s, slots, g, "adagrad", 0.1)
    with pytest.raises(RuntimeError, match="weights must be float32, float64, float16 or bfloat16, got torch.int64"):
        sparse_update(w.long(), s, slots, g, "adagrad", 0.1)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        sparse_update(w, s, slots, g, "lamb", 0.1)


# ---- accumulate_and_update: the fused backward + step -------------------------------------
def _bags_over(slots, bags, C, dim, with_psw, g, device):
    """Random bag cuts over ``slots``, per-sample weights, a pooled gradient and C table rows."""
    n = slots.numel()
    cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    psw = torch.rand(n, generator=g) if with_psw else None
    grad_out = torch.randn(bags, dim, generator=g)
    w = torch.randn(C, dim, generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(slots), to(offsets), to(psw), to(grad_out), to(w)


def _fused_case(device, dim, mode, with_psw, seed):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-2, 64, (80,), generator=g)  # duplicates, padding (-1) and zero rows (-2)
    return _bags_over(slots, 9, 64, dim, with_psw, g, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("mode,with_psw", [(0, False), (0, True), (1, False)])
@pytest.mark.parametrize("dim", [1, 16, 33])
def test_accumulate_and_update_equals_the_two_ops(device, optimizer, mode, with_psw, dim):
    from veloce.ops.embedding import accumulate_grad
    from veloce.ops.optimizer import accumulate_and_update

    slots, offsets, psw, grad_out, w = _fused_case(device, dim, mode, with_psw, seed=dim)
    S = state_width(optimizer, dim)
    fused_w, fused_s = w.clone(), torch.rand(w.size(0), S, device=device)
    ref_w, ref_s = fused_w.clone(), fused_s.clone()
    for step in (1, 2):
        accumulate_and_update(fused_w, fused_s, grad_out, slots, offsets, psw, mode, False, optimizer, 0.1,
                              1e-8, 0.9, 0.99, 0.01, step)
        uniq, rows = accumulate_grad(grad_out, slots, offsets, psw, mode, False, w.size(0))
        sparse_update(ref_w, ref_s, uniq, rows, optimizer, 0.1, 1e-8, 0.9, 0.99, 0.01, step)
    torch.testing.assert_close(fused_w, ref_w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused_s, ref_s, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_and_update_opcheck_and_bad_input(device):
    slots, offsets, psw, grad_out, w = _fused_case(device, 8, 0, True, seed=0)
    s = torch.zeros(w.size(0), 8, device=device)
    args = (w, s, grad_out, slots, offsets, psw, 0, False, 1, _op_hparams(1, 0.1, 1e-8, 0.9, 0.99, 0.0, 1, device))
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update.default, args)
    before = (w.clone(), s.clone())
    with pytest.raises(RuntimeError, match=r"grad_output must have one row per bag"):
        torch.ops.veloce.accumulate_and_update(w, s, grad_out[:3], *args[3:])
    with pytest.raises(RuntimeError, match=r"opt_state.size\(1\) must be the state width of Adagrad"):
        torch.ops.veloce.accumulate_and_update(w, s[:, :3].contiguous(), *args[2:])
    assert torch.equal(w, before[0]) and torch.equal(s, before[1])


def _hot_case(device, dim, mode, with_psw, seed):
    """A batch whose slots repeat 1..1000 times: runs of one chunk and of several (the
    fused CUDA kernel cuts runs into chunks of 64 positions and adds the chunks' sums in
    order), plus padding (-1) and zero rows (-2)."""
    g = torch.Generator().manual_seed(seed)
    repeats = [1000, 129, 128, 65, 64, 63, 2, 1]
    hot = torch.cat([torch.full((r,), 7 + 11 * i) for i, r in enumerate(repeats)])
    cold = torch.randint(-2, 3000, (1500,), generator=g)
    slots = torch.cat([hot, cold])[torch.randperm(hot.numel() + 1500, generator=g)]
    return _bags_over(slots, 700, 3000, dim, with_psw, g, device)


# dim 16, 64: groups of 4 and 16 lanes (several rows per warp); 128, 256, 512: one, two
# and four 16-byte packs per lane; 130 (not a multiple of 4) and 600 (too wide for
# registers): the paths without packs and without fusion.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("mode,with_psw", [(0, False), (0, True), (1, False)])
@pytest.mark.parametrize("dim", [16, 64, 128, 256, 512, 130, 600])
def test_accumulate_and_update_hot_rows(device, optimizer, mode, with_psw, dim):
    from veloce.ops.embedding import accumulate_grad
    from veloce.ops.optimizer import accumulate_and_update

    slots, offsets, psw, grad_out, w = _hot_case(device, dim, mode, with_psw, seed=dim)
    S = state_width(optimizer, dim)
    state = torch.rand(w.size(0), S, device=device)
    runs = []
    for check in (True, False, False):  # checked, unchecked, and unchecked again (determinism)
        fw, fs = w.clone(), state.clone()
        for step in (1, 2):
            accumulate_and_update(fw, fs, grad_out, slots, offsets, psw, mode, False, optimizer, 0.1, 1e-8, 0.9,
                                  0.99, 0.01, step, check_inputs=check)  # fmt: skip
        runs.append((fw, fs))
    ref_w, ref_s = w.clone(), state.clone()
    for step in (1, 2):
        uniq, rows = accumulate_grad(grad_out, slots, offsets, psw, mode, False, w.size(0))
        sparse_update(ref_w, ref_s, uniq, rows, optimizer, 0.1, 1e-8, 0.9, 0.99, 0.01, step)
    torch.testing.assert_close(runs[0][0], ref_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[0][1], ref_s, atol=1e-5, rtol=1e-5)
    for fw, fs in runs[1:]:
        assert torch.equal(fw, runs[0][0]) and torch.equal(fs, runs[0][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_and_update_cuda_agrees_with_cpu(optimizer, dtype):
    from veloce.ops.optimizer import accumulate_and_update

    results = []
    for device in ("cpu", "cuda"):
        slots, offsets, psw, grad_out, w = _hot_case(device, 128, 0, True, seed=3)
        w, grad_out, psw = w.to(dtype), grad_out.to(dtype), psw.to(dtype)
        s = torch.rand(w.size(0), state_width(optimizer, 128), generator=torch.Generator().manual_seed(1)).to(device)
        for step in range(1, 11):
            accumulate_and_update(w, s, grad_out, slots, offsets, psw, 0, False, optimizer, 0.01, 1e-8, 0.9, 0.99,
                                  0.0, step)  # fmt: skip
        results.append((w.cpu().float(), s.cpu()))
    # Long runs are summed in another order on CUDA (chunks of 64 positions, then the
    # chunks) than on the CPU (position order); Adam's m / sqrt(v) magnifies that rounding.
    tol = (1e-4 if optimizer == "adam" else 1e-5) if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(results[1][0], results[0][0], atol=tol, rtol=tol)
    torch.testing.assert_close(results[1][1], results[0][1], atol=tol, rtol=tol)


# ---- accumulate_and_update_many: K tables in one call ---------------------------------------
# Table k of a case: CAPACITIES[k] rows. The slots of each table include its first and last
# row and a few rows past its end (no gradient: with one key space over all tables, such a
# slot must not reach the next table's rows), so a wrong table base or bound changes the
# result. Table 1 has a hot slot (a run of 300 positions, several 64-position chunks on
# CUDA) whose slot number also appears in the other tables.
CAPACITIES = [64, 3000, 32, 500, 128]
HOT_SLOT = 7


def _many_tables(device, K, dim, dtype, optimizer, mode, psw_mode, seed, empty=None, include_last_offset=False):
    """K tables' (weights, opt_state, grad_output, slots, offsets, psw); table `empty` has
    bags but no positions. psw_mode: None, "all" or "mixed" (every other table)."""
    g = torch.Generator().manual_seed(seed)
    S = state_width(optimizer, dim)
    tables = []
    for k in range(K):
        C = CAPACITIES[k % len(CAPACITIES)]
        n = 0 if k == empty else int(torch.randint(20, 400, (1,), generator=g))
        slots = torch.randint(-2, C + 8, (n,), generator=g)  # codes -1 / -2 and slots >= C
        if n:
            slots[:4] = torch.tensor([0, C - 1, C, C + 3])
            if k == 1:
                slots = torch.cat([slots, torch.full((300,), HOT_SLOT)])[torch.randperm(n + 300, generator=g)]
            elif C > HOT_SLOT:
                slots[4] = HOT_SLOT
        n = slots.numel()
        bags = int(torch.randint(1, 40, (1,), generator=g))
        cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
        if include_last_offset:
            offsets = torch.cat([offsets, torch.tensor([n])])
        with_psw = psw_mode == "all" or (psw_mode == "mixed" and k % 2 == 0)
        psw = torch.rand(n, generator=g, dtype=torch.float64).to(dtype) if with_psw else None
        grad = torch.randn(bags, dim, generator=g, dtype=torch.float64).to(dtype)
        w = torch.randn(C, dim, generator=g, dtype=torch.float64).to(dtype)
        state = torch.rand(C, S, generator=g, dtype=torch.float64)
        state = state.to(torch.float64 if dtype == torch.float64 else torch.float32)
        tables.append([t if t is None else t.to(device) for t in (w, state, grad, slots, offsets, psw)])
    return tables


def _step_each_and_many(tables, mode, optimizer, include_last_offset=False, steps=(1, 2), check_inputs=True):
    """(weights, opt_state) per table after accumulate_and_update per table and after
    accumulate_and_update_many, each over `steps`."""
    from veloce.ops.optimizer import accumulate_and_update, accumulate_and_update_many

    hyper = (0.1, 1e-8, 0.9, 0.99, 0.01)
    each = [(t[0].clone(), t[1].clone()) for t in tables]
    many = [(t[0].clone(), t[1].clone()) for t in tables]
    for step in steps:
        for (w, s), t in zip(each, tables):
            accumulate_and_update(w, s, *t[2:], mode, include_last_offset, optimizer, *hyper, step, check_inputs)
        accumulate_and_update_many(
            [w for w, _ in many], [s for _, s in many], *[[t[i] for t in tables] for i in range(2, 6)], mode,
            include_last_offset, optimizer, *hyper, step, check_inputs,
        )  # fmt: skip
    return each, many


def _assert_bitwise_equal(each, many):
    for k, ((we, se), (wm, sm)) in enumerate(zip(each, many)):
        assert torch.equal(wm, we), f"table {k}: weights differ from accumulate_and_update's"
        assert torch.equal(sm, se), f"table {k}: opt_state differs from accumulate_and_update's"


# dim 16: several rows per warp (runs of different tables in one warp); 128: one row per
# warp; 600: rows too wide for the fused kernel (the accumulate_grad + sparse_update path).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize(
    "mode,psw_mode,ilo", [(0, None, False), (0, "all", False), (0, "mixed", True), (1, None, False), (1, None, True)]
)
@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("dim", [16, 128, 600])
def test_accumulate_and_update_many_equals_one_call_per_table(device, optimizer, mode, psw_mode, ilo, K, dim):
    tables = _many_tables(device, K, dim, torch.float32, optimizer, mode, psw_mode, seed=K * 1000 + dim,
                          empty=2 if K == 5 else None, include_last_offset=ilo)  # fmt: skip
    each, many = _step_each_and_many(tables, mode, optimizer, ilo)
    _assert_bitwise_equal(each, many)
    assert not torch.equal(many[0][0], tables[0][0])  # something was applied


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 128])
def test_accumulate_and_update_many_other_dtypes(device, optimizer, dtype, dim):
    tables = _many_tables(device, 5, dim, dtype, optimizer, 0, "mixed", seed=dim, empty=3)
    each, many = _step_each_and_many(tables, 0, optimizer, check_inputs=False)
    _assert_bitwise_equal(each, many)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_accumulate_and_update_many_cuts_large_groups(device, optimizer):
    """37 tables: on CUDA more than one launch's worth (32), plus tables without positions
    or without bags."""
    tables = _many_tables(device, 37, 16, torch.float32, optimizer, 0, "mixed", seed=5, empty=20)
    w, s, _, _, _, _ = tables[30]
    tables[30] = [w, s, torch.zeros(0, 16, device=device), torch.zeros(0, dtype=torch.long, device=device),
                  torch.zeros(0, dtype=torch.long, device=device), None]  # fmt: skip
    each, many = _step_each_and_many(tables, 0, optimizer)
    _assert_bitwise_equal(each, many)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_accumulate_and_update_many_misaligned_table(device, optimizer):
    """A grad_output that starts 4 bytes past a 16-byte boundary rules out 16-byte packs for
    its table only (on CUDA: lanes per row, hence RowWiseAdagrad's order of adding g^2); the
    call must still give each table what its own call gives."""
    tables = _many_tables(device, 4, 64, torch.float32, optimizer, 0, None, seed=9)
    grad = tables[2][2]
    flat = torch.empty(grad.numel() + 1, device=device)
    flat[1:] = grad.reshape(-1)
    tables[2][2] = flat[1:].view_as(grad)
    each, many = _step_each_and_many(tables, 0, optimizer)
    _assert_bitwise_equal(each, many)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_and_update_many_no_table_is_a_no_op(device):
    from veloce.ops.optimizer import accumulate_and_update_many

    accumulate_and_update_many([], [], [], [], [], None, "sum", False, "adagrad", 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_and_update_many_opcheck(device):
    tables = _many_tables(device, 3, 8, torch.float32, "adagrad", 0, "mixed", seed=1)
    lists = [[t[i] for t in tables] for i in range(6)]
    args = (*lists, 0, False, 1, _op_hparams(1, 0.1, 1e-8, 0.9, 0.99, 0.0, 1, device))
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update_many.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_and_update_many_bad_input_changes_nothing(device):
    op = torch.ops.veloce.accumulate_and_update_many

    def fresh():
        return [[x for x in t] for t in _many_tables(device, 3, 16, torch.float32, "adagrad", 0, "mixed", seed=2)]

    def call(tables, **changes):
        lists = {n: [t[i] for t in tables] for i, n in enumerate(["w", "s", "g", "slots", "o", "psw"])}
        lists.update(changes)
        op(*lists.values(), 0, False, 1, _op_hparams(1, 0.1, 1e-8, 0.9, 0.99, 0.0, 1, device), True)

    cases = []
    t = fresh()
    pattern = r"one entry per table: weights has 3 but opt_state has 2"
    cases.append((t, {"s": [x[1] for x in t[:2]]}, pattern))
    t = fresh()
    cases.append((t, {"psw": [t[0][5]]}, r"weights has 3 but per_sample_weights \(None for a table without them\) has 1"))
    t = fresh()  # table 1 of embedding dim 8 (valid on its own)
    t[1] = [t[1][0][:, :8].contiguous(), t[1][1][:, :8].contiguous(), t[1][2][:, :8].contiguous(), *t[1][3:]]
    cases.append((t, {}, r"weights\[1\] has embedding dim 8 but weights\[0\] has 16"))
    t = fresh()  # table 1 in float64 (valid on its own)
    t[1] = [t[1][0].double(), t[1][1].double(), t[1][2].double(), t[1][3], t[1][4], None]
    cases.append((t, {}, r"weights\[1\] is torch.float64 but weights\[0\] is torch.float32"))
    t = fresh()  # a bad slot code in table 2
    t[2][3] = t[2][3].clone()
    t[2][3][5] = -7
    cases.append((t, {}, r"\(table 2\): slots\[5\] = -7 is not a valid slot"))
    t = fresh()  # offsets of table 1 not starting at 0
    t[1][4] = t[1][4].clone()
    t[1][4][0] = 1
    cases.append((t, {}, r"\(table 1\): offsets must start at 0"))
    t = fresh()
    t[2][2] = t[2][2][:-1]
    cases.append((t, {}, r"\(table 2\): grad_output must have one row per bag"))
    t = fresh()
    t[1][1] = t[1][1][:, :3].contiguous()
    cases.append((t, {}, r"\(table 1\): opt_state.size\(1\) must be the state width of Adagrad"))
    t = fresh()  # the same table twice
    t[2] = [t[0][0], t[0][1], *t[2][2:]]
    cases.append((t, {}, r"(weights|opt_state)\[0\] and \1\[2\] share memory"))  # the lower in memory is named
    for tables, changes, pattern in cases:
        before = [(x[0].clone(), x[1].clone()) for x in tables]
        with pytest.raises((RuntimeError, ValueError), match=pattern):
            call(tables, **changes)
        for (w, s), x in zip(before, tables):
            assert torch.equal(w, x[0]) and torch.equal(s, x[1])


# ---- skip: an update queued behind a device-side check ----------------------------------------
# dim 16 and 128: the fused kernel reads the flag on the device; 600: rows too wide for it
# (the unfused path reads the flag on the host first).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("dim", [16, 128, 600])
def test_accumulate_and_update_skip_flag(device, optimizer, dim):
    """skip=True changes no table (weights and state bit for bit), in the single and the
    grouped op; skip=False gives the result of no flag at all."""
    from veloce.ops.optimizer import accumulate_and_update, accumulate_and_update_many

    tables = _many_tables(device, 3, dim, torch.float32, optimizer, 0, "mixed", seed=dim)
    hyper = (0.1, 1e-8, 0.9, 0.99, 0.01, 1)
    yes, no = torch.tensor([True], device=device), torch.tensor([False], device=device)
    for k, (w, s, *rest) in enumerate(tables):
        w2, s2 = w.clone(), s.clone()
        accumulate_and_update(w2, s2, *rest, 0, False, optimizer, *hyper, skip=yes)
        assert torch.equal(w2, w) and torch.equal(s2, s), f"table {k} changed under skip=True"
        accumulate_and_update(w2, s2, *rest, 0, False, optimizer, *hyper, skip=no)
        w3, s3 = w.clone(), s.clone()
        accumulate_and_update(w3, s3, *rest, 0, False, optimizer, *hyper)
        assert torch.equal(w2, w3) and torch.equal(s2, s3) and not torch.equal(w2, w)
    lists = [[t[i] for t in tables] for i in range(2, 6)]
    ws, ss = [t[0].clone() for t in tables], [t[1].clone() for t in tables]
    accumulate_and_update_many(ws, ss, *lists, 0, False, optimizer, *hyper, skip=yes)
    for k, (w, s) in enumerate(zip(ws, ss)):
        assert torch.equal(w, tables[k][0]) and torch.equal(s, tables[k][1]), f"table {k} changed under skip=True"
    accumulate_and_update_many(ws, ss, *lists, 0, False, optimizer, *hyper, skip=no)
    each, _ = _step_each_and_many(tables, 0, optimizer, steps=(1,))
    _assert_bitwise_equal(each, list(zip(ws, ss)))


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_and_update_skip_flag_checks(device):
    tables = _many_tables(device, 2, 8, torch.float32, "adagrad", 0, None, seed=3)
    w, s, *rest = tables[0]
    h = _op_hparams(1, 0.1, 1e-8, 0.9, 0.99, 0.0, 1, device)
    args = (w, s, *rest, 0, False, 1, h, True)
    many = ([t[0] for t in tables], [t[1] for t in tables], *[[t[i] for t in tables] for i in range(2, 6)],
            0, False, 1, h, True)  # fmt: skip
    flag = torch.tensor([False], device=device)
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update.default, (*args, flag))
    torch.library.opcheck(torch.ops.veloce.accumulate_and_update_many.default, (*many, flag))
    before = [(t[0].clone(), t[1].clone()) for t in tables]
    bad = [
        (torch.tensor([1], device=device), r"skip must be a bool tensor of one element, got torch.int64 of shape \[1\]"),
        (torch.tensor([True, False], device=device), r"skip must be a bool tensor of one element, got torch.bool"),
    ]
    if device != "cpu":
        bad.append((torch.tensor([True]), r"skip is on cpu but weights(\[0\])? is on cuda"))
    for value, pattern in bad:
        with pytest.raises(RuntimeError, match=r"veloce::accumulate_and_update: " + pattern):
            torch.ops.veloce.accumulate_and_update(*args, value)
        with pytest.raises(RuntimeError, match=r"veloce::accumulate_and_update_many: " + pattern):
            torch.ops.veloce.accumulate_and_update_many(*many, value)
    for t, (w0, s0) in zip(tables, before):
        assert torch.equal(t[0], w0) and torch.equal(t[1], s0)


# ---- nonfinite_flags ------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _reference_flags(tensors, owner, num_owners):
    flags = [False] * (num_owners + 1)
    for t, k in zip(tensors, owner):
        if not bool(torch.isfinite(t).all()):
            flags[k] = flags[num_owners] = True
    return flags


def _poisoned(numel, dtype, device, gen, value, where):
    """A 1-D tensor of ``numel`` finite values with ``value`` at index ``where`` (None: none)."""
    t = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    if where is not None:
        t[where] = value
    return t.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nonfinite_flags_find_every_nan_and_inf(device, dtype):
    """NaN, +Inf and -Inf at the first, a middle and the last element of tensors whose sizes
    are and are not multiples of a 16-byte vector; the largest finite value, subnormals and
    -0.0 are finite."""
    from veloce.ops.optimizer import nonfinite_flags

    gen = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    for numel in [1, 7, 8, 9, 33, 1000, 4099]:
        for value in [float("nan"), float("inf"), float("-inf")]:
            for where in sorted({0, numel // 2, numel - 1}):
                bad = _poisoned(numel, dtype, device, gen, value, where)
                flags = nonfinite_flags([bad], [0], 1).tolist()
                assert flags == [True, True], (numel, value, where)
    edge = torch.tensor([info.max, -info.max, info.tiny / 2, -0.0, info.tiny], dtype=dtype, device=device)
    assert nonfinite_flags([edge], [0], 1).tolist() == [False, False]


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_flags_per_owner_over_many_mixed_tensors(device):
    """More tensors than one CUDA launch takes (32 per dtype), of every dtype, shapes 0-D to
    3-D, empty ones, non-contiguous ones and views that start off 16-byte alignment: each
    owner's flag and the last one equal the reference."""
    from veloce.ops.optimizer import nonfinite_flags

    gen = torch.Generator().manual_seed(1)
    for trial in range(6):
        tensors, owner = [], []
        num_owners = 9
        for i in range(80):
            dtype = FLOAT_DTYPES[int(torch.randint(0, 4, (1,), generator=gen))]
            kind = i % 5
            numel = int(torch.randint(0, 300, (1,), generator=gen))
            poison = torch.rand(1, generator=gen).item() < 0.04
            where = int(torch.randint(0, numel, (1,), generator=gen)) if poison and numel else None
            base = _poisoned(numel + 3, dtype, device, gen, float("nan") if i % 2 else float("inf"),
                             None if where is None else where + 1)  # fmt: skip
            if kind == 0:
                t = base[1 : numel + 1]  # a view one element past the base: off 16-byte alignment
            elif kind == 1:
                t = base[1 : numel + 1].clone().reshape(1, -1) if numel else base[:0]
            elif kind == 2:  # non-contiguous: every other column of a 2-D tensor
                t = torch.stack([base[1 : numel + 1], base[1 : numel + 1]], dim=1)[:, 0] if numel else base[:0]
            elif kind == 3:
                t = base[1 : numel + 1].clone()
            else:
                t = base[1:2].reshape(()) if numel else base[:0]  # 0-D
                if where is not None:
                    t = t.clone().fill_(float("nan"))
            tensors.append(t)
            owner.append(int(torch.randint(0, num_owners, (1,), generator=gen)))
        want = _reference_flags(tensors, owner, num_owners)
        got = nonfinite_flags(tensors, owner, num_owners)
        assert got.dtype == torch.bool and got.device.type == device
        assert got.tolist() == want, trial


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_flags_of_a_large_tensor(device):
    """A tensor of several million elements (many blocks, each thread several vectors): the
    last element alone decides."""
    from veloce.ops.optimizer import nonfinite_flags

    t = torch.zeros(5_000_003, device=device)
    assert nonfinite_flags([t], [0], 2).tolist() == [False, False, False]
    t[-1] = float("inf")
    assert nonfinite_flags([t], [1], 2).tolist() == [False, True, True]


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_flags_opcheck_and_bad_arguments(device):
    from veloce.ops.optimizer import nonfinite_flags

    good = [torch.randn(4, 3, device=device), torch.tensor([1.0, float("nan")], device=device)]
    torch.library.opcheck(torch.ops.veloce.nonfinite_flags.default, (good, [0, 1], 2))
    cases = [
        (([], [], 1), ValueError, "tensors must hold at least one tensor"),
        ((good, [0], 2), ValueError, "one owner per tensor: tensors has 2 entries but owner has 1"),
        ((good, [0, 2], 2), ValueError, r"owner\[1\] = 2 is out of range for num_owners 2"),
        ((good, [0, -1], 2), ValueError, r"owner\[1\] = -1 is out of range"),
        ((good, [0, 0], 0), ValueError, "num_owners must be >= 1, got 0"),
        (([good[0], torch.ones(3, dtype=torch.long, device=device)], [0, 0], 1), RuntimeError,
         r"tensors\[1\] must be float32, float64, float16 or bfloat16, got torch.int64"),
    ]  # fmt: skip
    if hasattr(torch, "float8_e4m3fn"):  # no infinity: its NaN is not an exponent of all ones
        f8 = torch.zeros(0, device=device).to(torch.float8_e4m3fn)
        cases.append((([good[0], f8], [0, 0], 1), RuntimeError,
                      r"tensors\[1\] must be float32, .* got torch.float8_e4m3fn"))
    if device == "cuda":
        cases.append((([good[0], torch.ones(3)], [0, 0], 1), RuntimeError, r"tensors\[1\] .*cpu"))
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            nonfinite_flags(*args)


# ---- veloce.clip_grad_norm_ / clip_grad_value_: dense gradients and tables together -------------
import copy  # noqa: E402
import inspect  # noqa: E402

from torch import nn  # noqa: E402

import veloce  # noqa: E402

_CLIP_BATCHES = [  # raw int64 ids, repeated within and across bags and backward passes
    (torch.tensor([7, 2**40, 7, -3, 5, 2**40]), torch.tensor([0, 3, 3])),
    (torch.tensor([-3, 7, 11, 11]), torch.tensor([0, 1])),
]


class _ClipNet(nn.Module):
    """A table and a dense layer; with ``reference=True`` an nn.EmbeddingBag over the same
    rows, its ids remapped by a dict (the reference for the table)."""

    def __init__(self, mode: str, reference: bool = False):
        super().__init__()
        torch.manual_seed(0)
        ids = sorted({int(i) for x, _ in _CLIP_BATCHES for i in x})
        self.index = {i: k for k, i in enumerate(ids)}
        rows = torch.randn(len(ids), 3) * 5
        self.lin = nn.Linear(3, 1)  # before the nn.EmbeddingBag, whose own init draws from the RNG
        if reference:
            self.emb = nn.EmbeddingBag(len(ids), 3, mode=mode)
            self.emb.weight.data.copy_(rows)
        else:
            self.emb = veloce.DynamicEmbedding(3, mode=mode, optimizer=veloce.optim.SGD(lr=1.0))
            self.emb.insert(torch.tensor(ids), rows)
        self.reference = reference

    def forward(self, ids, offsets):
        if self.reference:
            ids = torch.tensor([self.index[int(i)] for i in ids])
        return self.lin(self.emb(ids, offsets)).squeeze(1)


def _clip_step(model, opt, clip) -> torch.Tensor:
    for k, (ids, offsets) in enumerate(_CLIP_BATCHES):  # two backward passes, one step
        (model(ids, offsets) * (3.0 + k)).pow(2).sum().backward()
    total = clip(model)
    opt.step()
    opt.zero_grad()
    return total


def _clip_both(mode, torch_clip, veloce_clip):
    ref = _ClipNet(mode, reference=True)
    ref_total = _clip_step(ref, torch.optim.SGD(ref.parameters(), lr=1.0), torch_clip)
    ours = _ClipNet(mode)
    opt = veloce.CombinedOptimizer(torch.optim.SGD(ours.lin.parameters(), lr=1.0), ours)
    total = _clip_step(ours, opt, veloce_clip)
    ids = torch.tensor(sorted(ours.index))
    rows, found = ours.emb.find(ids)
    assert bool(found.all())
    torch.testing.assert_close(rows, ref.emb.weight.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(ours.lin.parameters(), ref.lin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return total, ref_total


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_of_the_model_equals_embedding_bag_with_torch_clipping(mode, norm_type):
    total, ref_total = _clip_both(
        mode, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type),
        lambda m: veloce.clip_grad_norm_(m, 1.0, norm_type),
    )  # fmt: skip
    assert float(ref_total) > 10  # the clipping did scale the gradients
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-5)


def test_clip_grad_norm_to_one_bounds_the_joint_norm():
    model = _ClipNet("sum")
    for ids, offsets in _CLIP_BATCHES:
        model(ids, offsets).pow(2).sum().mul(100).backward()
    before = veloce.clip_grad_norm_(model, 1.0)
    after = veloce.clip_grad_norm_(model, math.inf)  # measures without scaling
    assert float(before) > 100
    assert float(after) == pytest.approx(1.0, rel=1e-5)
    dense = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.lin.parameters()]))
    assert float(dense) < 1.0  # the tables hold the rest of the joint norm


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_clip_grad_value_of_the_model_equals_embedding_bag_with_torch_clipping(mode):
    _clip_both(mode, lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.5),
               lambda m: veloce.clip_grad_value_(m, 0.5))  # fmt: skip


def test_torch_clip_grad_norm_raises_while_a_table_holds_a_gradient_and_is_transparent_after():
    from torch.nn.utils import clip_grad

    model = _ClipNet("sum")
    opt = veloce.CombinedOptimizer(torch.optim.SGD(model.lin.parameters(), lr=0.1), model)
    model(*_CLIP_BATCHES[0]).sum().backward()
    for clip in (torch.nn.utils.clip_grad_norm_, clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad_value_):
        name = clip.__name__
        with pytest.raises(RuntimeError, match=rf"torch\.nn\.utils\.{name} cannot clip .* veloce\.{name}\(model"):
            clip(model.parameters(), 1.0)
    opt.step()  # the tables stepped: torch's own clipping is torch's again
    original = torch.nn.utils.clip_grad_norm_.__wrapped__
    assert inspect.signature(torch.nn.utils.clip_grad_norm_) == inspect.signature(original)
    grads = [p.grad.clone() for p in model.lin.parameters()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    got = torch.nn.utils.clip_grad_norm_(model.lin.parameters(), 1e-3)
    torch.testing.assert_close(got, want)
    for p, g in zip(model.lin.parameters(), grads):
        torch.testing.assert_close(p.grad, g * 1e-3 / (want + 1e-6))


def test_veloce_clip_of_parameters_alone_names_the_model():
    model = _ClipNet("sum")
    model(*_CLIP_BATCHES[0]).sum().backward()
    with pytest.raises(ValueError, match=r"Pass the model itself"):
        veloce.clip_grad_norm_(model.parameters(), 1.0)
    dense = copy.deepcopy([p.grad for p in model.lin.parameters()])
    total = veloce.clip_grad_norm_(model.lin.parameters(), 1e9, tables=())  # the dense gradients alone
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense])))
    both = veloce.clip_grad_norm_([*model.lin.parameters(), model.emb], 1e9)  # tables listed with the parameters
    assert float(both) > float(total)
