"""The checks of :class:`veloce.Trainer`'s constructor arguments, each error naming the
argument and the value."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from veloce.train.callbacks import Callback

__all__ = ["PRECISIONS", "check_args"]

PRECISIONS = ("fp32", "bf16")


def check_args(
    model: Any, loss_fn: Any, metrics: Any, strategy: Any, precision: Any, accumulate_steps: Any, max_epochs: Any,
    max_steps: Any, checkpoint_dir: Any, checkpoint_every: Any, keep_last: Any, log_every: Any, callbacks: Any,
    seed: Any, cuda_graph: Any, clip_grad_norm: Any,
) -> None:
    """Checks every argument of :class:`veloce.Trainer`'s constructor (of any type: that is
    what is checked).

    Raises:
        TypeError: ``model`` is not a module, or ``cuda_graph`` not a bool.
        ValueError: any other argument out of its range; the message names it and its value.
    """
    def need(ok: bool, name: str, value: Any, what: str) -> None:
        if not ok:
            raise ValueError(f"Trainer: {name} must be {what}, got {value!r}")

    def positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if not isinstance(model, nn.Module):
        raise TypeError(f"Trainer: model must be a torch.nn.Module, got {type(model).__name__}")
    need(loss_fn is None or callable(loss_fn), "loss_fn", loss_fn, "callable as loss_fn(preds, target)")
    need(metrics is None or isinstance(metrics, Mapping), "metrics", metrics, "a dict of name -> metric")
    for name, m in (metrics or {}).items():
        need(all(hasattr(m, a) for a in ("update", "compute", "reset")), f"metrics[{name!r}]", m,
             "an object with update(preds, target), compute() and reset()")  # fmt: skip
    need(strategy is None or isinstance(strategy, Mapping), "strategy", strategy,
         "None or a dict of HybridParallel keyword arguments")  # fmt: skip
    need(precision in PRECISIONS, "precision", precision, f"one of {PRECISIONS}")
    need(positive_int(accumulate_steps), "accumulate_steps", accumulate_steps, "an int >= 1")
    need(positive_int(max_epochs), "max_epochs", max_epochs, "an int >= 1")
    need(max_steps is None or positive_int(max_steps), "max_steps", max_steps, "None or an int >= 1")
    need(checkpoint_every is None or positive_int(checkpoint_every), "checkpoint_every", checkpoint_every,
         "None or an int >= 1")  # fmt: skip
    need(checkpoint_every is None or checkpoint_dir is not None, "checkpoint_every", checkpoint_every,
         "None when checkpoint_dir is None (set checkpoint_dir)")  # fmt: skip
    need(positive_int(keep_last), "keep_last", keep_last, "an int >= 1")
    need(positive_int(log_every), "log_every", log_every, "an int >= 1")
    need(isinstance(seed, int) and seed >= 0, "seed", seed, "an int >= 0")
    for cb in callbacks:
        need(isinstance(cb, Callback), "callbacks", cb, "a list of veloce.Callback objects")
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"Trainer: cuda_graph must be a bool, got {cuda_graph!r}")
    if clip_grad_norm is not None and not (
        isinstance(clip_grad_norm, (int, float)) and not isinstance(clip_grad_norm, bool)
        and math.isfinite(clip_grad_norm) and clip_grad_norm > 0
    ):  # fmt: skip
        raise ValueError(f"Trainer: clip_grad_norm must be None or a positive number, got {clip_grad_norm!r}")
    if clip_grad_norm is not None and cuda_graph:
        raise ValueError(
            "Trainer: clip_grad_norm is not available with cuda_graph=True (summing the tables' row gradients "
            "for the norm reads their number back to the host, which a captured step cannot hold)"
        )  # fmt: skip
