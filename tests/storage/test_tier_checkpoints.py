"""Every tier's rows travel through checkpoints (``veloce.checkpoint``) and state dicts,
and restore into any storage: Device -> HostCached -> Device, each leg then training on
equal to a table that never left the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import veloce
from _tiers import assert_same_entries, batches, cached, make, train
from conftest import DEVICES


def _model(storage, device: str, **kwargs) -> nn.Module:
    return nn.ModuleDict({"emb": make(storage, device=device, **kwargs)})



def _train(model: nn.Module, it, steps: int) -> list[torch.Tensor]:
    return train(model["emb"], it, steps)


def _same_run(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_round_trip_device_host_cached_device(tmp_path, device):
    ref = _model(None, device)
    ref_run = _train(ref, batches(30, seed=4, device=device), 30)

    it = batches(30, seed=4, device=device)
    first = _model(None, device)
    run = _train(first, it, 10)
    veloce.checkpoint.save(tmp_path / "a", first, step=10)
    second = _model(cached(64), device)  # Device -> HostCached
    veloce.checkpoint.load(tmp_path / "a", second)
    assert len(second["emb"]) == len(first["emb"]) and second["emb"].stats()["store_rows"] > 0
    assert second["emb"].step_count == 10
    run += _train(second, it, 10)
    veloce.checkpoint.save(tmp_path / "b", second, step=20)  # every tier's rows
    third = _model(None, device)  # HostCached -> Device
    veloce.checkpoint.load(tmp_path / "b", third)
    assert_same_entries(third["emb"].export(), second["emb"].export(), atol=0)
    run += _train(third, it, 10)
    _same_run(run, ref_run)
    assert_same_entries(third["emb"].export(), ref["emb"].export())


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trips_between_storages(device):
    ref = make(None, device=device)
    _train(nn.ModuleDict({"emb": ref}), batches(8, seed=5, device=device), 8)
    tiered = make(cached(32), device=device)
    tiered.load_state_dict(ref.state_dict())
    assert len(tiered) == len(ref) and tiered.table.size == 32
    assert_same_entries(tiered.export(), ref.export(), atol=0)
    back = make(None, device=device)
    back.load_state_dict(tiered.state_dict())
    assert_same_entries(back.export(), ref.export(), atol=0)
    assert back.step_count == tiered.step_count == ref.step_count == 8


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_checkpoint_load_leaves_both_tiers_as_they_were(tmp_path, device):
    small = _model(None, device)
    _train(small, batches(10, seed=6, device=device), 10)
    veloce.checkpoint.save(tmp_path / "c", small, step=10)
    bounded = _model(cached(32), device, max_capacity=100)  # fewer rows than the checkpoint's
    _train(bounded, batches(4, seed=7, distinct=20, device=device), 4)
    assert bounded["emb"].stats()["store_rows"] > 0
    before = bounded["emb"].export()
    with pytest.raises(veloce.checkpoint.CheckpointError):
        veloce.checkpoint.load(tmp_path / "c", bounded)
    assert_same_entries(bounded["emb"].export(), before, atol=0)
