"""The optimizer seam of the ops: the hyperparameter tensor (``hparams``) of the updating
ops, written in place between calls as the engine and captured CUDA graphs do, and the
initial optimizer state (``init_state``) the insert ops write into new rows."""

from __future__ import annotations

import pytest
import torch

import veloce
from veloce.ops import extension as _ext
from veloce.ops import hash_table as ht
from veloce.ops.optimizer import OPTIMIZERS, HyperparameterBuffer, accumulate_and_update, hparam_values, hparams, state_width

from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")


# ---- the hyperparameter tensor -------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_hparams_tensor_changed_between_calls_takes_effect(device, optimizer):
    """One hparams tensor written in place between calls applies what the scalars would."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 8, generator=g).to(device)
    s = torch.rand(32, state_width(optimizer, 8), generator=g).to(device)
    grad = torch.randn(4, 8, generator=g).to(device)
    slots, offsets = torch.tensor([1, 5, 5, 30], device=device), torch.tensor([0, 1, 2, 3], device=device)
    a, b = (w.clone(), s.clone()), (w.clone(), s.clone())
    h = hparams(optimizer, 0.1, 1, 0.01, device=device)
    for step, lr in ((1, 0.1), (2, 0.02), (3, 0.3)):
        accumulate_and_update(*a, grad, slots, offsets, None, "sum", False, optimizer, lr, weight_decay=0.01, step=step)
        h.copy_(hparams(optimizer, lr, step, 0.01))
        accumulate_and_update(*b, grad, slots, offsets, None, "sum", False, optimizer, hparams=h)
    torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b[1], a[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_step_lr_argument_reaches_the_kernel(device):
    """The engine's persistent hparams tensor follows the learning rate of each step."""
    a = veloce.DynamicEmbedding(4, optimizer=veloce.optim.SGD(lr=0.1), device=device)
    ids, offsets = torch.tensor([3, 4], device=device), torch.tensor([0, 1], device=device)
    for lr in (0.1, 0.5, 0.05):
        a(ids, offsets).sum().backward()
        before = a.find(ids)[0].detach().clone()
        a.step(lr=lr)
        torch.testing.assert_close(a.find(ids)[0], before - lr, rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_hyperparameter_buffer_refills_one_tensor_per_device_and_optimizer(device):
    buf = HyperparameterBuffer()
    a = buf.fill(device, OPTIMIZERS["adam"], hparam_values("adam", 0.1, step=2))
    b = buf.fill(device, OPTIMIZERS["adam"], hparam_values("adam", 0.2, step=3))
    assert a.data_ptr() == b.data_ptr() and b.dtype == torch.float64
    assert b.tolist() == pytest.approx([0.2, 3.0, 0.0, 1e-10, 0.9, 0.999])
    c = buf.fill(device, OPTIMIZERS["sgd"], hparam_values("sgd", 0.5))
    assert c.data_ptr() != b.data_ptr() and c.tolist() == [0.5, 1.0, 0.0]


def test_hparam_values_name_the_optimizers_own_values():
    assert hparam_values("adagrad", 0.1, step=4, weight_decay=0.01, eps=1e-6) == [0.1, 4.0, 0.01, 1e-6]
    with pytest.raises(ValueError, match=r"Adagrad has no hyperparameter 'beta1'; its own are \['eps'\]"):
        hparam_values("adagrad", 0.1, beta1=0.9)
    with pytest.raises(ValueError, match=r"optimizer must be one of"):
        hparam_values("lamb", 0.1)


# ---- the initial state of new rows -----------------------------------------------------------
def _table(capacity, dim, width, device):
    return [torch.zeros(capacity, dtype=torch.int64, device=device), torch.zeros(capacity, dtype=torch.uint8, device=device),
            torch.zeros(capacity, dtype=torch.int64, device=device), torch.zeros(capacity, dim, device=device),
            torch.full((capacity, width), -1.0, device=device)]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_insert_ops_write_init_state_into_new_rows_only(device):
    init = torch.tensor([1.5, 2.5, 0.0], device=device)
    t = _table(64, 2, 3, device)
    slots, _, _ = ht.find_or_insert(*t, torch.tensor([4, 8], device=device), init_state=init)
    assert torch.equal(t[4][slots].cpu(), init.cpu().expand(2, 3))
    t[4][slots[0]] = 7.0  # a found row keeps its state
    slots2, _, _ = ht.find_or_insert(*t, torch.tensor([4, 12], device=device), init_state=init)
    assert slots2[0] == slots[0] and torch.equal(t[4][slots[0]].cpu(), torch.full((3,), 7.0))
    assert torch.equal(t[4][slots2[1]].cpu(), init.cpu())
    # without init_state: zeros
    s3, _, _ = ht.find_or_insert(*t, torch.tensor([16], device=device))
    assert torch.equal(t[4][s3].cpu(), torch.zeros(1, 3))
    # insert_or_assign: init_state for new rows without opt_values
    s4, _, _ = ht.insert_or_assign(*t, torch.tensor([20], device=device), torch.ones(1, 2, device=device),
                                   init_state=init)  # fmt: skip
    assert torch.equal(t[4][s4].cpu(), init.cpu().expand(1, 3))
    # many: per table, None for zeros
    a, b = _table(64, 2, 3, device), _table(64, 2, 3, device)
    slots, _, _ = ht.find_or_insert_many([a, b], [torch.tensor([1], device=device), torch.tensor([2], device=device)],
                                         [0, 0], [0, 0], [False, False], [0, 0], [0, 0], [0.0, 0.0], [0.0, 0.0],
                                         [None, None], init_state=[init, None])  # fmt: skip
    assert torch.equal(a[4][slots[0]].cpu(), init.cpu()) and torch.equal(b[4][slots[1]].cpu(), torch.zeros(3))


def test_bad_init_state_is_refused_and_changes_nothing():
    t = _table(64, 2, 3, "cpu")
    before = [x.clone() for x in t]
    for bad, what in [(torch.zeros(2), r"init_state must be 1-D with one value per state column of opt_state \(3,\)"),
                      (torch.zeros(3, dtype=torch.float64), r"init_state must be torch.float32, got torch.float64")]:  # fmt: skip
        with pytest.raises((ValueError, RuntimeError), match=what):
            ht.find_or_insert(*t, torch.tensor([4]), init_state=bad)
        with pytest.raises((ValueError, RuntimeError), match=what):
            ht.insert_or_assign(*t, torch.tensor([4]), torch.ones(1, 2), init_state=bad)
    with pytest.raises(ValueError, match=r"init_state must hold one entry per table \(1; None for zeros\), got 2"):
        ht.find_or_insert_many([t], [torch.tensor([1])], [0], [0], [False], [0], [0], [0.0], [0.0], [None],
                               init_state=[None, None])  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(t, before))


