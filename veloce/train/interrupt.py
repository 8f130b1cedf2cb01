"""Ctrl-C during :meth:`veloce.Trainer.fit`: noted by a SIGINT handler, acted on at the next
step boundary (where the state is whole), then the step reached is checkpointed and
:class:`TrainingInterrupted` raised."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["Interrupt", "InterruptHandler", "TrainingInterrupted"]


class TrainingInterrupted(KeyboardInterrupt):
    """``Trainer.fit`` stopped on Ctrl-C (SIGINT) after checkpointing the step it reached.

    A ``KeyboardInterrupt``, so code that lets Ctrl-C through still does. A later ``fit``
    with the same ``checkpoint_dir`` resumes from ``checkpoint``.

    Attributes:
        step: the optimizer steps taken (the checkpoint's step).
        epoch: the epoch it stopped in (0-based).
        checkpoint: the checkpoint holding that step.
    """

    def __init__(self, message: str, step: int = 0, epoch: int = 0, checkpoint: Optional[Path] = None) -> None:
        super().__init__(message)
        self.step, self.epoch, self.checkpoint = step, epoch, checkpoint


class Interrupt(Exception):
    """Every rank agreed to stop at this step boundary (raised inside fit, caught by it)."""


class InterruptHandler:
    """SIGINT during ``fit``: noted, and acted on at the next step boundary (where the state
    is whole: no half-applied optimizer step) rather than wherever Python happens to be.

    Installed only in the main thread and only over Python's default handler (an ignored
    SIGINT, a handler of the user's, stay). A second SIGINT a second or more after the first
    raises ``KeyboardInterrupt`` at once, without the checkpoint; one within the second is
    the same Ctrl-C arriving again (torchrun forwards its own SIGINT to the ranks, which
    the terminal signalled already)."""

    def __init__(self, announce: bool) -> None:
        self.requested = False
        self.announce = announce
        self._first: Optional[float] = None
        self._installed = False

    def __enter__(self) -> InterruptHandler:
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first, self.requested = now, True
            if self.announce:
                print("\nveloce: interrupted; stopping after this step to save a checkpoint (Ctrl-C again to stop "
                      "at once, without it)", file=sys.stderr, flush=True)  # fmt: skip
        elif now - self._first >= 1.0:
            raise KeyboardInterrupt
