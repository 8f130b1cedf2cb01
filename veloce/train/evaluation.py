"""Evaluation of a :class:`veloce.Trainer`: its metrics over every batch of a loader, on
every rank together (:func:`evaluate_metrics`), fed batch by batch (:class:`MetricSink`)."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
from torch import nn

from veloce.metrics import MetricError
from veloce.train.lockstep import Step, call_model, gather, lockstep, move_to, split_batch

__all__ = ["MetricSink", "evaluate_metrics"]


def evaluate_metrics(
    model: nn.Module,
    loader: Iterable,
    metrics: Mapping[str, Any],
    device: torch.device,
    world_size: int,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager],
    interrupted: Callable[[], bool],
    check_stop: Callable[[Step], None],
) -> dict[str, float]:
    """``metrics`` over every batch of ``loader`` on every rank, the model called as it is
    (:meth:`veloce.Trainer.evaluate` puts it in eval mode around this).

    Args:
        model: the (wrapped) model.
        loader: this rank's ``(inputs, target)`` batches.
        metrics: name -> metric with ``update``, ``compute`` and ``reset``.
        device: the model's device.
        world_size: ranks taking part (each runs until the last one is done).
        autocast: the context of the model's forward (the Trainer's precision).
        interrupted: whether Ctrl-C reached this rank (carried by lockstep's all-reduce).
        check_stop: called with every step first; raises to stop every rank at once.

    Returns:
        metric name -> float.

    Raises:
        veloce.metrics.MetricError: a metric computed to NaN; it names the metric and why.
    """
    sink = MetricSink(metrics, world_size)
    samples = 0
    for step in lockstep(loader, device, "Trainer.evaluate", interrupted=interrupted):
        check_stop(step)  # (validation inside fit: Ctrl-C need not wait for its end)
        inputs, target = move_to(split_batch(step.batch), device)
        with autocast():
            preds = call_model(model, inputs)
        samples += step.total
        if step.rows:  # (a zero-row batch runs for the ranks' collectives only)
            sink.update(preds.float() if torch.is_tensor(preds) else preds, target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = sink.compute()
    nan = [k for k, v in result.items() if math.isnan(v)]
    if nan:
        why = "; ".join(dict.fromkeys(str(w.message) for w in caught))
        raise MetricError(
            f"Trainer.evaluate: metric{'s' if len(nan) > 1 else ''} {', '.join(map(repr, nan))} computed to NaN "
            f"over the {samples} evaluation samples of all {world_size} rank(s)"
            f"{f' ({why})' if why else ''}: evaluate on data with samples, of both classes for an AUC "
            f"(a larger or another validation split)"
        )  # fmt: skip
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


class MetricSink:
    """Feeds metrics batch by batch; with several ranks, metrics that do not synchronise
    themselves (veloce's) get every rank's predictions, gathered once at the end.
    torchmetrics objects (they have ``sync``) update locally and synchronise in ``compute``."""

    def __init__(self, metrics: Mapping[str, Any], world_size: int) -> None:
        self.metrics = metrics
        for m in metrics.values():
            m.reset()
        self.local = {k: m for k, m in metrics.items() if world_size == 1 or hasattr(m, "sync")}
        self.gathered = {k: m for k, m in metrics.items() if k not in self.local}
        self.preds: list[torch.Tensor] = []
        self.target: list[torch.Tensor] = []

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        for m in self.local.values():
            m.update(preds, target)
        if self.gathered:
            self.preds.append(preds.detach().reshape(-1).cpu())
            self.target.append(target.detach().reshape(-1).cpu())

    def compute(self) -> dict[str, float]:
        if self.gathered:
            mine = (torch.cat(self.preds) if self.preds else torch.zeros(0),
                    torch.cat(self.target) if self.target else torch.zeros(0))  # fmt: skip
            everyone = gather(mine)
            preds, target = torch.cat([p for p, _ in everyone]), torch.cat([t for _, t in everyone])
            for m in self.gathered.values():
                m.update(preds, target)
        return {k: float(m.compute()) for k, m in self.metrics.items()}
