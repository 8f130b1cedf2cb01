"""Callbacks of :class:`veloce.Trainer`: the hooks, early stopping, and the built-in loggers.

A callback overrides any of the ``on_*`` hooks; each receives the trainer, so it can read
``trainer.global_step``, ``trainer.epoch`` or set ``trainer.should_stop = True`` (the
trainer stops after the current step). Callbacks with state that must survive a
resume return it from ``state_dict`` (JSON-serialisable); it is saved in checkpoints.

The trainer adds the loggers itself, on rank 0 only: :class:`ProgressBar` (when
``progress=True``), :class:`JSONLinesLogger` and :class:`TensorBoardLogger` (when it
has a ``log_dir``). User callbacks run on every rank.

Records:
    - step records (``on_log``, every ``log_every`` optimizer steps): ``event="step"``,
      ``epoch``, ``step``, ``loss`` (mean over the steps since the last record),
      ``samples_per_s`` (this rank), ``lr`` (the first parameter group's), ``time``, and
      each ``DynamicEmbedding``'s telemetry as ``tables/<module path>/<key>``: ``rows``;
      for a table that drops rows ``evicted_per_step``, ``evicted_within_n``,
      ``returned_within_n``, ``oldest_row_age`` or ``min_use_count``; with admission
      ``admitted_per_step``, ``refused_per_step``, ``default_row_share``; and for a tiered
      table ``hit_rate``, ``fetched_per_step``, ``written_back_per_step``,
      ``bytes_moved_per_step`` over the steps since the last record
      (:mod:`veloce.train.telemetry`; on several ranks, this rank's shard).
    - epoch records (``on_epoch_end``, and the items of ``fit``'s history):
      ``event="epoch"``, ``epoch``, ``step``, ``loss``, ``samples``, ``seconds``,
      ``samples_per_s``, and ``val_<metric>`` for every metric when there is a
      validation loader.

Example::

    class StopAt(veloce.Callback):
        def on_step_end(self, trainer, step):
            if step == 100:
                trainer.should_stop = True
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from veloce.runtime.hooks import AnyTrainer, Callback
from veloce.runtime.progress import Bar

__all__ = ["Callback", "EarlyStopping", "JSONLinesLogger", "ProgressBar", "TensorBoardLogger"]


class EarlyStopping(Callback):
    """Stops training when a value of the epoch record stops improving.

    Args:
        monitor: key of the epoch record, e.g. ``"val_auc"``, ``"val_logloss"`` or ``"loss"``.
        mode: ``"max"`` (higher is better) or ``"min"``.
        patience: epochs without improvement tolerated before stopping (>= 0).
        min_delta: smallest change that counts as an improvement (>= 0).

    Example::

        trainer = veloce.Trainer(..., callbacks=[veloce.EarlyStopping("val_auc", patience=2)])
    """

    def __init__(self, monitor: str, mode: str = "max", patience: int = 2, min_delta: float = 0.0) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping: mode must be 'max' or 'min', got {mode!r}")
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping: patience must be an int >= 0, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping: min_delta must be >= 0, got {min_delta!r}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best: Optional[float] = None
        self.wait = 0

    def on_epoch_end(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        if self.monitor not in record:
            raise KeyError(
                f"EarlyStopping: monitor {self.monitor!r} is not in the epoch record; it has "
                f"{sorted(record)} (validation metrics need val_loader)"
            )
        value = float(record[self.monitor])
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            trainer.should_stop = True

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        gain = value - self.best if self.mode == "max" else self.best - value
        return gain > self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = state["best"], state["wait"]


class JSONLinesLogger(Callback):
    """Appends every step and epoch record to ``path`` as one JSON object per line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def on_fit_start(self, trainer: AnyTrainer) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_log(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        self._write(record)

    def on_epoch_end(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        self._write(record)


class TensorBoardLogger(Callback):
    """Writes the numbers of every record to TensorBoard under ``log_dir``.

    Does nothing when the ``tensorboard`` package is not installed."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = str(log_dir)
        self.writer: Any = None

    def on_fit_start(self, trainer: AnyTrainer) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self.writer = SummaryWriter(self.log_dir)

    def _write(self, prefix: str, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key not in ("event", "epoch", "step", "time") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])
        self.writer.flush()

    def on_log(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        self._write("train", record)

    def on_epoch_end(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        self._write("epoch", record)

    def on_fit_end(self, trainer: AnyTrainer, history: list[dict[str, Any]]) -> None:
        if self.writer is not None:
            self.writer.close()


class ProgressBar(Callback):
    """A tqdm bar per epoch with loss, samples/s and ETA."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_epoch_start(self, trainer: AnyTrainer, epoch: int) -> None:
        total = trainer.steps_per_epoch()
        self.bar = Bar(total=total, initial=trainer.steps_in_epoch, unit="step", desc=f"epoch {epoch}",
                        dynamic_ncols=True, file=sys.stderr)  # fmt: skip

    def on_step_end(self, trainer: AnyTrainer, step: int) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        if self.bar is None:
            loss, speed = record["loss"], record["samples_per_s"]
            print(f"step {record['step']}: loss {loss:.4f}, {speed:,.0f} samples/s", file=sys.stderr)
            return
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:,.0f}")

    def on_epoch_end(self, trainer: AnyTrainer, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        values = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("val_"))
        print(f"epoch {record['epoch']}: loss {record['loss']:.4f}, {record['samples_per_s']:,.0f} samples/s"
              + (f", {values}" if values else ""), file=sys.stderr)  # fmt: skip
