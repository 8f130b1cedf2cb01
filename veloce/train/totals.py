"""What a :class:`veloce.Trainer` counts of an epoch while it trains: the loss, batches,
samples and time on this rank (:class:`EpochTotals`), for the step and epoch records."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from veloce.train.lockstep import gather

__all__ = ["EpochTotals"]


class EpochTotals:
    """Loss, batches and samples of the current epoch on this rank. The loss is summed
    weighted by each batch's samples (a mean over every sample of the epoch, whatever the
    batches' sizes) and stays on the device (no sync per step) in float64 until a record
    needs it."""

    def __init__(self, device: torch.device) -> None:
        self.reset(device)

    def reset(self, device: torch.device) -> None:
        self.loss_rows = torch.zeros((), dtype=torch.float64, device=device)  # sum of batch loss x samples
        self.batches = self.samples = 0
        self.seconds_before = 0.0  # the epoch's training time before a resume
        self.start_clock()

    def start_clock(self) -> None:
        self.started = time.perf_counter()
        # loss_rows, samples, time at the last step record
        self._mark = (float(self.loss_rows), self.samples, self.started)

    def add(self, loss: torch.Tensor, samples: int, drawn: bool = True) -> None:
        """A batch's mean loss over its ``samples``; ``drawn`` False for a zero-row stand-in
        batch (it counts as no batch)."""
        if samples:
            self.loss_rows += loss.to(torch.float64) * samples
        self.batches += int(drawn)
        self.samples += samples

    def window(self) -> dict[str, float]:
        """Mean loss over this rank's samples, and samples/s, since the previous call (or the
        epoch's start)."""
        loss, now = float(self.loss_rows), time.perf_counter()
        loss0, samples0, t0 = self._mark
        self._mark = (loss, self.samples, now)
        return {"loss": (loss - loss0) / max(self.samples - samples0, 1),
                "samples_per_s": (self.samples - samples0) / max(now - t0, 1e-9)}  # fmt: skip

    def summary(self) -> dict[str, float]:
        """The epoch's record fields over all ranks: the mean loss over every sample, each counted once."""
        per_rank = gather((float(self.loss_rows), self.samples))
        loss, samples = (sum(x) for x in zip(*per_rank))
        seconds = self.seconds()
        if not samples:
            warnings.warn("Trainer: an epoch without samples (an empty loader, or a one-shot iterator "
                          "already used up by an earlier epoch); its loss is NaN", stacklevel=3)  # fmt: skip
        return {"loss": loss / samples if samples else math.nan, "samples": samples, "seconds": seconds,
                "samples_per_s": samples / max(seconds, 1e-9)}  # fmt: skip

    def seconds(self) -> float:
        """The epoch's training time so far, over resumes."""
        return self.seconds_before + time.perf_counter() - self.started

    def state(self) -> dict[str, Any]:
        return {"loss_rows": float(self.loss_rows), "batches": self.batches, "samples": self.samples,
                "seconds": self.seconds()}  # fmt: skip

    def load(self, state: Mapping[str, Any], device: torch.device) -> None:
        self.reset(device)
        self.batches, self.samples = state["batches"], state["samples"]
        if "loss_rows" in state:
            self.loss_rows.fill_(state["loss_rows"])
        else:  # a checkpoint whose totals hold the sum of the batches' mean losses instead
            self.loss_rows.fill_(state["loss_sum"] * self.samples / max(self.batches, 1))
        self.seconds_before = state.get("seconds", 0.0)  # (totals saved without it: no time before)
