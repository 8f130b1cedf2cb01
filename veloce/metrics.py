"""Stateful binary-classification metrics in the torchmetrics style.

Each metric has ``update(preds, target)`` (accumulate a batch), ``compute() -> float``
(the value over everything accumulated since the last ``reset()``) and ``reset()``.
``preds`` are the model's outputs: logits by default (``from_logits=True``), or
probabilities. ``target`` holds 0/1 labels (``LogLoss`` also takes soft labels in [0, 1]).
Inputs of any shape are flattened; ``preds`` and ``target`` must have the same number of
elements. States live on the CPU in float64, whatever the inputs' device.

Degenerate cases return NaN with a ``RuntimeWarning`` rather than raising: ``compute()``
with nothing accumulated (every metric), and ``AUC`` when all targets are one class.
:class:`veloce.Trainer` turns a NaN metric into a :class:`MetricError` (a run whose
validation has no value fails instead of recording NaN).

The metrics accumulate what their process sees. Under ``torch.distributed`` the Trainer
gathers every rank's predictions once per evaluation and computes these metrics over all
of them, so they equal one process's metrics on the same samples whatever the world size.
In a loop of your own, gather the predictions yourself (``all_gather_object``) or use
torchmetrics, whose metrics synchronise across ranks in ``compute()``. These metrics do
not: a ``compute()`` that is a collective hangs when only rank 0 calls it, and the
Trainer's single gather serves every metric at once. torchmetrics is not needed to use
veloce (``import veloce`` never imports it); the Trainer takes its objects as metrics too.

Example::

    >>> auc, logloss = AUC(), LogLoss()
    >>> for (dense, sparse), label in loader:
    ...     logits = model(dense, sparse)
    ...     auc.update(logits, label)
    ...     logloss.update(logits, label)
    >>> print(auc.compute(), logloss.compute())
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

__all__ = ["AUC", "Accuracy", "LogLoss", "Metric", "MetricError"]


class MetricError(ValueError):
    """A metric has no value on the data it was given (NaN): no samples at all, or an AUC
    over samples of one class. Raised by :meth:`veloce.Trainer.evaluate` (and so by a
    ``fit`` with a ``val_loader``) naming the metric and why."""


class Metric:
    """Base class: ``update``, ``compute``, ``reset``; calling the metric is ``update``."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Accumulates a batch: ``preds`` (logits, or probabilities with
        ``from_logits=False``) and ``target`` (0/1 labels; soft labels in [0, 1] for
        ``LogLoss``), of any shapes with the same number of elements. Raises ``TypeError``
        / ``ValueError`` naming the argument for non-tensors, mismatched sizes, NaN
        predictions or labels out of range; nothing is accumulated then."""
        raise NotImplementedError

    def compute(self) -> float:
        """The metric over everything accumulated since the last :meth:`reset` (NaN, with a
        ``RuntimeWarning``, when that is nothing or the value is undefined)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forgets everything accumulated."""
        raise NotImplementedError

    def __call__(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.update(preds, target)

    def _inputs(
        self, preds: torch.Tensor, target: torch.Tensor, binary: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        name = type(self).__name__
        if not isinstance(preds, torch.Tensor) or not isinstance(target, torch.Tensor):
            raise TypeError(
                f"{name}.update: preds and target must be tensors, got "
                f"{type(preds).__name__} and {type(target).__name__}"
            )
        if preds.numel() != target.numel():
            raise ValueError(
                f"{name}.update: preds and target must have the same number of elements, got "
                f"preds {tuple(preds.shape)} and target {tuple(target.shape)}"
            )
        p = preds.detach().reshape(-1).to("cpu", torch.float64)
        t = target.detach().reshape(-1).to("cpu", torch.float64)
        if torch.isnan(p).any():
            raise ValueError(f"{name}.update: preds contains NaN")
        if binary:
            bad = (t != 0) & (t != 1)
            if bad.any():
                raise ValueError(f"{name}.update: target must be 0 or 1, got {t[bad][0].item()}")
        elif ((t < 0) | (t > 1) | torch.isnan(t)).any():
            raise ValueError(f"{name}.update: target must be in [0, 1]")
        return p, t


def _nan(why: str) -> float:
    warnings.warn(why, RuntimeWarning, stacklevel=3)
    return math.nan


class AUC(Metric):
    """Area under the ROC curve over all accumulated samples, computed exactly.

    Rank-based (Mann-Whitney): tied scores share their average rank, so a tie between a
    positive and a negative counts one half, as in ``sklearn.metrics.roc_auc_score``.
    Keeps every prediction (9 bytes a sample: a float64 score and a bool label); ``compute``
    sorts them, O(n log n).
    AUC is the same for logits and probabilities up to ties that rounding a sigmoid
    creates, so no ``from_logits`` is needed.

    Returns NaN (with a ``RuntimeWarning``) when the accumulated targets are all of one
    class, or when nothing was accumulated.

    Example::

        >>> m = AUC()
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> m.compute()
        0.75
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._preds: list[torch.Tensor] = []
        self._target: list[torch.Tensor] = []

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        p, t = self._inputs(preds, target, binary=True)
        self._preds.append(p)
        self._target.append(t.to(torch.bool))

    def compute(self) -> float:
        if not self._preds:
            return _nan("AUC.compute: no samples were accumulated; returning NaN")
        p = torch.cat(self._preds)
        t = torch.cat(self._target)
        n_pos = int(t.sum())
        n_neg = t.numel() - n_pos
        if n_pos == 0 or n_neg == 0:
            return _nan(
                f"AUC.compute: AUC is undefined when all {t.numel()} targets are "
                f"{'positive' if n_neg == 0 else 'negative'}; returning NaN"
            )
        return _auc(p, t, n_pos, n_neg)


def _auc(p: torch.Tensor, t: torch.Tensor, n_pos: int, n_neg: int) -> float:
    """Mann-Whitney AUC with average ranks for ties."""
    sorted_p, order = torch.sort(p)
    _, counts = torch.unique_consecutive(sorted_p, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)  # 1-based rank of each group's last member
    avg_rank = ends - (counts.to(torch.float64) - 1) / 2  # average 1-based rank in the group
    ranks = torch.repeat_interleave(avg_rank, counts)
    pos_rank_sum = float(ranks[t[order]].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


class LogLoss(Metric):
    """Mean binary cross-entropy (log loss) over all accumulated samples.

    Matches ``torch.nn.functional.binary_cross_entropy_with_logits`` (``from_logits=True``)
    or ``binary_cross_entropy`` (``from_logits=False``, whose log is clamped at -100) with
    ``reduction="mean"`` over everything seen, computed in float64. Soft targets in [0, 1]
    are accepted. Returns NaN (with a ``RuntimeWarning``) when nothing was accumulated.

    Args:
        from_logits: whether ``preds`` are logits (True) or probabilities (False).
    """

    def __init__(self, from_logits: bool = True) -> None:
        self.from_logits = from_logits
        self.reset()

    def reset(self) -> None:
        self._sum = 0.0
        self._count = 0

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        p, t = self._inputs(preds, target, binary=False)
        if self.from_logits:
            loss = F.binary_cross_entropy_with_logits(p, t, reduction="sum")
        else:
            if ((p < 0) | (p > 1)).any():
                raise ValueError(
                    "LogLoss.update: preds must be probabilities in [0, 1] with from_logits=False"
                )
            loss = F.binary_cross_entropy(p, t, reduction="sum")
        self._sum += float(loss)
        self._count += p.numel()

    def compute(self) -> float:
        if self._count == 0:
            return _nan("LogLoss.compute: no samples were accumulated; returning NaN")
        return self._sum / self._count


class Accuracy(Metric):
    """Fraction of samples whose thresholded prediction equals the 0/1 target.

    A sample is predicted positive when its probability is strictly above ``threshold``
    (as torchmetrics' ``BinaryAccuracy``). With logits the comparison is made on the logit
    scale (``logit > log(threshold / (1 - threshold))``), which avoids sigmoid rounding.
    Returns NaN (with a ``RuntimeWarning``) when nothing was accumulated.

    Args:
        threshold: probability threshold in (0, 1).
        from_logits: whether ``preds`` are logits (True) or probabilities (False).
    """

    def __init__(self, threshold: float = 0.5, from_logits: bool = True) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"Accuracy: threshold must be in (0, 1), got {threshold}")
        self.threshold = float(threshold)
        self.from_logits = from_logits
        self.reset()

    def reset(self) -> None:
        self._correct = 0
        self._count = 0

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        p, t = self._inputs(preds, target, binary=True)
        cut = math.log(self.threshold / (1.0 - self.threshold)) if self.from_logits else self.threshold
        self._correct += int(((p > cut) == t.to(torch.bool)).sum())
        self._count += p.numel()

    def compute(self) -> float:
        if self._count == 0:
            return _nan("Accuracy.compute: no samples were accumulated; returning NaN")
        return self._correct / self._count
