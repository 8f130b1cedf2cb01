"""veloce.metrics against brute-force and torch references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from veloce.metrics import AUC, Accuracy, LogLoss


def brute_force_auc(preds: list[float], target: list[int]) -> float:
    """P(score of a positive > score of a negative), ties counted one half: O(n^2)."""
    pos = [p for p, t in zip(preds, target) if t == 1]
    neg = [p for p, t in zip(preds, target) if t == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 1)), min_size=2, max_size=60),
    chunks=st.integers(1, 4),
)
def test_auc_matches_brute_force_with_ties(data, chunks):
    preds = [float(p) / 2 for p, _ in data]  # few distinct values: many ties
    target = [t for _, t in data]
    if len(set(target)) < 2:
        target[0] = 1 - target[0]
    m = AUC()
    p, t = torch.tensor(preds), torch.tensor(target)
    for pc, tc in zip(p.chunk(chunks), t.chunk(chunks)):
        m.update(pc, tc)
    assert m.compute() == pytest.approx(brute_force_auc(preds, target), abs=1e-12)


def test_auc_large_random_and_reset():
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 2, (400,), generator=g)
    preds = torch.randn(400, generator=g) + target  # informative
    preds = torch.round(preds * 4) / 4  # ties
    m = AUC()
    m.update(preds.view(-1, 1), target.float().view(-1, 1))  # (B, 1) shapes are flattened
    expected = brute_force_auc(preds.tolist(), target.tolist())
    assert m.compute() == pytest.approx(expected, abs=1e-12)
    assert 0.7 < expected < 0.9
    m.reset()
    m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    assert m.compute() == pytest.approx(0.75)


def test_auc_invariant_to_monotone_transform_and_perfect():
    p = torch.tensor([-2.0, -1.0, 0.5, 3.0])
    t = torch.tensor([0, 1, 0, 1])
    a, b = AUC(), AUC()
    a.update(p, t)
    b.update(torch.sigmoid(p), t)
    assert a.compute() == b.compute() == pytest.approx(0.75)
    c = AUC()
    c.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 1]))
    assert c.compute() == 1.0


def test_auc_degenerate_cases_give_nan_with_warning():
    m = AUC()
    with pytest.warns(RuntimeWarning, match="no samples"):
        assert math.isnan(m.compute())
    m.update(torch.tensor([0.2, 0.9]), torch.tensor([1.0, 1.0]))
    with pytest.warns(RuntimeWarning, match="all 2 targets are positive"):
        assert math.isnan(m.compute())


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="target must be 0 or 1"):
        AUC().update(torch.tensor([0.1, 0.2]), torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="same number of elements"):
        LogLoss().update(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="preds contains NaN"):
        Accuracy().update(torch.tensor([math.nan]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="probabilities in"):
        LogLoss(from_logits=False).update(torch.tensor([1.5]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="threshold"):
        Accuracy(threshold=1.0)


@pytest.mark.parametrize("from_logits", [True, False])
def test_logloss_matches_torch_bce(from_logits):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1000, generator=g) * 3
    target = torch.rand(1000, generator=g).round()
    target[:10] = torch.rand(10, generator=g)  # soft labels are allowed
    preds = logits if from_logits else torch.sigmoid(logits.double())
    m = LogLoss(from_logits=from_logits)
    for pc, tc in zip(preds.split(300), target.split(300)):
        m.update(pc, tc)
    if from_logits:
        ref = F.binary_cross_entropy_with_logits(logits.double(), target.double())
    else:
        ref = F.binary_cross_entropy(preds, target.double())
    assert m.compute() == pytest.approx(ref.item(), rel=1e-12)
    m.reset()
    with pytest.warns(RuntimeWarning):
        assert math.isnan(m.compute())


def test_logloss_extreme_logits_are_finite():
    m = LogLoss()
    m.update(torch.tensor([100.0, -100.0]), torch.tensor([0.0, 1.0]))
    assert m.compute() == pytest.approx(100.0)


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_accuracy(threshold):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(500, generator=g)
    target = torch.randint(0, 2, (500,), generator=g).float()
    expected = ((torch.sigmoid(logits.double()) > threshold).double() == target).double().mean().item()
    a = Accuracy(threshold=threshold)
    a.update(logits, target)
    b = Accuracy(threshold=threshold, from_logits=False)
    b.update(torch.sigmoid(logits.double()), target)
    assert a.compute() == pytest.approx(expected)
    assert b.compute() == pytest.approx(expected)
