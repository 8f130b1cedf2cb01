"""The base class of :class:`veloce.Trainer` callbacks (documented in
:mod:`veloce.train.callbacks`).

It sits below every layer so that a layer under the trainer (:mod:`veloce.serving`'s
``Publish``) can provide a callback without importing the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["AnyTrainer", "Callback"]

# The trainer each hook receives: the veloce.Trainer calling it. The trainer is in a layer
# above this one, so the hooks name its type only in words.
AnyTrainer = Any


class Callback:
    """Base class of trainer callbacks: every hook does nothing by default."""

    def on_fit_start(self, trainer: AnyTrainer) -> None:
        """Called once when ``fit`` starts (after a resume has been loaded)."""

    def on_epoch_start(self, trainer: AnyTrainer, epoch: int) -> None:
        """Called before the first batch of an epoch (also of a resumed, partly done one)."""

    def on_step_end(self, trainer: AnyTrainer, step: int) -> None:
        """Called after every optimizer step; ``step`` counts from 1 over the whole run."""

    def on_log(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        """Called with a step record every ``log_every`` optimizer steps."""

    def on_epoch_end(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        """Called with the epoch record (train loss, throughput, validation metrics)."""

    def on_checkpoint(self, trainer: AnyTrainer, path: Path) -> None:
        """Called on every rank after a checkpoint is committed at ``path`` (every
        ``checkpoint_every`` steps, at the end of an epoch, when ``fit`` ends)."""

    def on_fit_end(self, trainer: AnyTrainer, history: list[dict[str, Any]]) -> None:
        """Called once when ``fit`` returns normally."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state saved in checkpoints (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""
