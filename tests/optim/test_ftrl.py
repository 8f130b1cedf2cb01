"""FTRL-Proximal (veloce.optim.FTRL) against an independent reference of the update of
``tf.keras.optimizers.Ftrl``: the op, DynamicEmbedding, the initial state of new rows,
checkpoints, argument checks and (on a GPU) CUDA against the CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import veloce
from veloce.ops import extension as _ext
from veloce import checkpoint as ckpt
from veloce.ops.optimizer import accumulate_and_update, sparse_update

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)
from test_optimizer import batches  # noqa: E402  (the sparse_update tests' batches)

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")

NUM_ROWS = 24
STEPS = 8


# ---- the reference: written from the Keras update, in float64 NumPy ---------------------------
def ftrl_reference_row(w, n, z, grad, lr, lr_power, l1, l2, beta, weight_decay):
    """One FTRL step of one row (NumPy float64 arrays w, n, z, grad): returns new (w, n, z).

    Keras' Ftrl: new_accum = accum + g^2; linear += g - (new_accum^-p - accum^-p) / lr * var;
    quadratic = new_accum^-p / lr + 2 * (l2 + beta / (2 lr)); var = (clip(linear, -l1, l1)
    - linear) / quadratic; with g the gradient plus weight_decay * var (lazy L2)."""
    g = grad + weight_decay * w
    n_new = n + g * g
    z_new = z + g - (np.power(n_new, -lr_power) - np.power(n, -lr_power)) / lr * w
    quadratic = np.power(n_new, -lr_power) / lr + 2.0 * (l2 + beta / (2.0 * lr))
    w_new = (np.clip(z_new, -l1, l1) - z_new) / quadratic
    return w_new, n_new, z_new


def run_reference(weights, batches_, init_acc, **hyper):
    """The reference over batches of (unique slots, row gradients), row by row."""
    w = weights.double().cpu().numpy().copy()
    n = np.full_like(w, init_acc)
    z = np.zeros_like(w)
    for slots, grads in batches_:
        g = grads.double().cpu().numpy()
        for i, s in enumerate(slots.tolist()):
            w[s], n[s], z[s] = ftrl_reference_row(w[s], n[s], z[s], g[i], **hyper)
    return w, n, z


def initial_state(rows, dim, init_acc, device, dtype=torch.float32):
    state = torch.zeros(rows, 2 * dim, dtype=dtype, device=device)
    state[:, :dim] = init_acc
    return state


HYPER = st.fixed_dictionaries({
    "lr": st.sampled_from([0.05, 0.5]),
    "lr_power": st.sampled_from([-0.5, -0.3, -1.0, 0.0]),
    "l1": st.sampled_from([0.0, 0.05]),
    "l2": st.sampled_from([0.0, 0.1]),
    "beta": st.sampled_from([0.0, 0.5]),
    "weight_decay": st.sampled_from([0.0, 0.01]),
})  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=12, deadline=None)
@given(dim=st.sampled_from([1, 4, 16, 33]), seed=st.integers(0, 2**16), hyper=HYPER,
       init_acc=st.sampled_from([0.1, 1.0]))  # fmt: skip
def test_ftrl_matches_reference(device, dtype, dim, seed, hyper, init_acc):
    weights = torch.randn(NUM_ROWS, dim, dtype=dtype, device=device)
    data = batches(seed, dim, device, dtype, steps=STEPS)
    w = weights.clone()
    state = initial_state(NUM_ROWS, dim, init_acc, device, torch.float64 if dtype == torch.float64 else torch.float32)
    own = {k: hyper[k] for k in ("lr_power", "l1", "l2", "beta")}
    for t, (slots, grads) in enumerate(data, start=1):
        sparse_update(w, state, slots, grads, "ftrl", hyper["lr"], weight_decay=hyper["weight_decay"], step=t, **own)
    ref_w, ref_n, ref_z = run_reference(weights, data, init_acc, **hyper)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(w.double().cpu(), torch.from_numpy(ref_w), **tol)
    torch.testing.assert_close(state[:, :dim].double().cpu(), torch.from_numpy(ref_n), **tol)
    torch.testing.assert_close(state[:, dim:].double().cpu(), torch.from_numpy(ref_z), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_ftrl_l1_makes_touched_rows_exactly_zero(device):
    weights = torch.randn(NUM_ROWS, 8, device=device)
    w, state = weights.clone(), initial_state(NUM_ROWS, 8, 0.1, device)
    slots = torch.tensor([3, 7, 11], device=device)
    sparse_update(w, state, slots, 0.01 * torch.randn(3, 8, device=device), "ftrl", 0.1, l1=10.0)
    assert torch.equal(w[slots], torch.zeros(3, 8, device=device))  # exactly zero, not small
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(w[untouched], weights[untouched])


# ---- through DynamicEmbedding: bags with repeated ids, weight decay, several steps ------------
def _bag_batches(seed, steps=5, n=40, bags=8, space=12):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, space, (n,), generator=g) * 1000 + 7  # repeats within and across bags
        cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
        target = torch.randn(bags, 1, generator=g)
        out.append((ids, offsets, target))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("lr_power,l1", [(-0.5, 0.0), (-0.5, 1.0), (-0.25, 0.0), (0.0, 0.5)])
def test_ftrl_dynamic_embedding_matches_reference(device, mode, lr_power, l1):
    dim = 6
    opt = veloce.optim.FTRL(lr=0.05, lr_power=lr_power, l1=l1, l2=0.05, initial_accumulator_value=0.3, beta=0.1,
                            weight_decay=0.01)  # fmt: skip
    emb = veloce.DynamicEmbedding(dim, mode=mode, initializer=veloce.init.normal(std=0.1), optimizer=opt,
                                  capacity=64, device=device)  # fmt: skip
    data = _bag_batches(seed=int(-lr_power * 100) + int(l1 * 1000))
    ref: dict[int, tuple] = {}  # id -> (w, n, z), float64
    hyper = {"lr": 0.05, "lr_power": lr_power, "l1": l1, "l2": 0.05, "beta": 0.1, "weight_decay": 0.01}
    for ids, offsets, target in data:
        ids_d, offsets_d = ids.to(device), offsets.to(device)
        out = emb(ids_d, offsets_d)  # inserts the new ids: find then gives the rows before this step
        rows = emb.find(ids_d)[0].detach().double().cpu()
        # The gradient an nn.EmbeddingBag over these rows would get, summed per id.
        leaf = rows.clone().requires_grad_(True)
        pooled = torch.nn.functional.embedding_bag(torch.arange(len(ids)), leaf, offsets, mode=mode)
        ((pooled - target.double()) ** 2).sum().backward()
        loss = ((out - target.to(device)) ** 2).sum()
        loss.backward()
        emb.step()
        emb.zero_grad()
        per_id: dict[int, np.ndarray] = {}
        for i, key in enumerate(ids.tolist()):
            per_id[key] = per_id.get(key, 0.0) + leaf.grad[i].numpy()
        for key, g in per_id.items():
            if key not in ref:
                ref[key] = (rows[ids.tolist().index(key)].numpy(), np.full(dim, 0.3), np.zeros(dim))
            ref[key] = ftrl_reference_row(*ref[key], g, **hyper)
    e = emb.export()
    got = {int(k): (w, s) for k, w, s in zip(e["keys"].tolist(), e["weights"].double().cpu(),
                                              e["optimizer_state"].double().cpu())}  # fmt: skip
    assert set(got) == set(ref)
    for key, (w, n, z) in ref.items():
        torch.testing.assert_close(got[key][0], torch.from_numpy(w), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[key][1], torch.from_numpy(np.concatenate([n, z])), rtol=1e-4, atol=1e-5)
    if l1 > 0:
        assert (e["weights"] == 0).any()  # some rows are exactly zero


# ---- the initial state of new rows -----------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_new_rows_start_from_the_optimizers_initial_state(device):
    emb = veloce.DynamicEmbedding(4, optimizer=veloce.optim.FTRL(lr=0.1, initial_accumulator_value=0.25),
                                  device=device)  # fmt: skip
    emb(torch.tensor([5, 9, 5], device=device), torch.tensor([0, 2], device=device))
    state = emb.export()["optimizer_state"].cpu()
    assert state.shape == (2, 8)
    assert torch.equal(state, torch.tensor([[0.25] * 4 + [0.0] * 4] * 2))
    assert veloce.optim.FTRL().initial_state(3).tolist() == [0.1, 0.1, 0.1, 0.0, 0.0, 0.0]
    assert veloce.optim.Adam().initial_state(3) is None  # zeros


# ---- checkpoints --------------------------------------------------------------------------
def _trained_ftrl(seed):
    torch.manual_seed(seed)
    emb = veloce.DynamicEmbedding(4, optimizer=veloce.optim.FTRL(lr=0.1, l1=0.01, lr_power=-0.4), seed=seed)
    for ids, offsets, target in _bag_batches(seed=seed, steps=3):
        ((emb(ids, offsets) - target) ** 2).sum().backward()
        emb.step()
        emb.zero_grad()
    return emb


def _same(a, b):
    ea, eb = a.export(), b.export()
    oa, ob = torch.argsort(ea["keys"]), torch.argsort(eb["keys"])
    for k in ("keys", "weights", "optimizer_state"):
        assert torch.equal(ea[k][oa], eb[k][ob])
    assert a.step_count == b.step_count


def test_ftrl_state_dict_round_trip_and_training_goes_on_alike(tmp_path):
    a = _trained_ftrl(0)
    b = veloce.DynamicEmbedding(4, optimizer=veloce.optim.FTRL(lr=0.1, l1=0.01, lr_power=-0.4), seed=0)
    b.load_state_dict(a.state_dict())
    _same(a, b)
    ckpt.save(tmp_path / "c", a)
    c = veloce.DynamicEmbedding(4, optimizer=veloce.optim.FTRL(lr=0.1, l1=0.01, lr_power=-0.4), seed=0)
    ckpt.load(tmp_path / "c", c)
    _same(a, c)
    for emb in (a, b, c):  # a new id after the load starts from the initial state in every copy
        ((emb(torch.tensor([123456, 7]), torch.tensor([0])) - 1.0) ** 2).sum().backward()
        emb.step()
    _same(a, b)
    _same(a, c)


def test_bad_ftrl_arguments_are_clear_errors():
    FTRL = veloce.optim.FTRL
    for kwargs, what in [({"lr_power": 0.5}, r"FTRL.lr_power must be a finite number <= 0"),
                         ({"l1": -1.0}, r"FTRL.l1 must be a finite number >= 0, got -1.0"),
                         ({"l2": float("nan")}, r"FTRL.l2 must be a finite number >= 0"),
                         ({"initial_accumulator_value": -0.1}, r"FTRL.initial_accumulator_value must be"),
                         ({"beta": -1.0}, r"FTRL.beta must be"),
                         ({"lr": 0.0}, r"FTRL.lr must be a positive finite number")]:  # fmt: skip
        with pytest.raises(ValueError, match=what):
            FTRL(**kwargs)
    w, s = torch.zeros(4, 2), torch.zeros(4, 4)
    slots, g = torch.tensor([1]), torch.ones(1, 2)
    for kwargs, what in [({"lr_power": 0.5}, r"lr_power must be a finite number <= 0, got 0.5 \(hparams\[3\]\)"),
                         ({"l1": -1.0}, r"l1 must be a finite number >= 0, got -1 \(hparams\[4\]\)"),
                         ({"beta": math.inf}, r"beta must be a finite number >= 0, got inf \(hparams\[6\]\)")]:  # fmt: skip
        with pytest.raises(RuntimeError, match=what):
            sparse_update(w, s, slots, g, "ftrl", 0.1, **kwargs)
    with pytest.raises(RuntimeError, match=r"lr must be > 0 for FTRL"):
        sparse_update(w, s, slots, g, "ftrl", 0.0)
    with pytest.raises(ValueError, match=r"hparams must be a float64 tensor of shape \(7,\) for FTRL"):
        sparse_update(w, s, slots, g, "ftrl", hparams=torch.zeros(6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"FTRL has no hyperparameter 'eta'"):
        sparse_update(w, s, slots, g, "ftrl", 0.1, eta=1.0)
    assert torch.equal(w, torch.zeros(4, 2)) and torch.equal(s, torch.zeros(4, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 64, 600])  # 600: rows too wide for the fused kernel's registers
@pytest.mark.parametrize("lr_power", [-0.5, -0.3])
def test_ftrl_cuda_agrees_with_cpu(dtype, dim, lr_power):
    g = torch.Generator().manual_seed(dim)
    n = 500
    slots = torch.randint(-1, 64, (n,), generator=g)
    offsets = torch.arange(0, n, 5)
    grad = torch.randn(offsets.numel(), dim, generator=g).to(dtype)
    w = torch.randn(64, dim, generator=g).to(dtype)
    s = initial_state(64, dim, 0.1, "cpu")
    cpu, gpu = (w.clone(), s.clone()), (w.cuda(), s.cuda())
    own = {"lr_power": lr_power, "l1": 0.01, "l2": 0.01, "beta": 0.1}
    for step in (1, 2, 3):
        for (ww, ss), dev in ((cpu, "cpu"), (gpu, "cuda")):
            accumulate_and_update(ww, ss, grad.to(dev), slots.to(dev), offsets.to(dev), None, "sum", False, "ftrl",
                                  0.1, weight_decay=0.01, step=step, **own)  # fmt: skip
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(gpu[0].cpu().float(), cpu[0].float(), **tol)
    # z reads the rows (z -= sigma * w): with 16-bit rows, a row that rounds one step apart on
    # the two devices moves z of later steps by sigma times that step, so z takes the rows' tolerance.
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], **tol)
