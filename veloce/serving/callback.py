""":class:`Publish`: the :class:`veloce.Trainer` callback that publishes the model it trains
to a serving store every few optimizer steps and when ``fit`` ends."""

from __future__ import annotations

from typing import Any, Optional

import torch

from veloce.runtime.hooks import AnyTrainer, Callback
from veloce.serving.publisher import Publisher
from veloce.serving.store import ServingStore

__all__ = ["Publish"]


class Publish(Callback):
    """Publishes the trainer's model to ``store`` with a :class:`~veloce.serving.Publisher`.

    The publisher is made when ``fit`` starts (its first publication is a full snapshot,
    deltas follow) and gives its lease back when ``fit`` returns; a ``fit`` that raised
    keeps it, and the next ``fit`` of the same trainer goes on with it. Every rank runs
    the callback (the publisher's collectives keep the ranks together), all at the same
    step. Sparse updates still in flight (``HybridParallel(sparse="async")``) are applied
    before each publication, as before a checkpoint, so a version holds every update of
    the steps it counts.

    Args:
        store: where the versions go (:class:`~veloce.serving.FileStore`,
            :class:`~veloce.serving.RedisStore`, :class:`~veloce.serving.RocksDBStore`).
        every_n_steps: publish after every ``every_n_steps``-th optimizer step (counted over
            the run, as ``trainer.global_step``); None: only at the end.
        at_end: publish when ``fit`` ends, unless the last step was just published.
        keep_last, fold_every, dtype, lease_ttl, owner, take_over: the
            :class:`~veloce.serving.Publisher`'s.

    Attributes:
        published: ``(global_step, version)`` of every publication of this callback.

    Raises:
        ValueError: ``every_n_steps`` is not None or an int >= 1, or the callback would
            never publish (``every_n_steps=None`` and ``at_end=False``).

    Example::

        store = veloce.serving.FileStore("/models/ctr")
        trainer = veloce.Trainer(model, callbacks=[veloce.serving.Publish(store, every_n_steps=500)])
    """

    def __init__(self, store: ServingStore, every_n_steps: Optional[int] = None, at_end: bool = True,
                 keep_last: int = 3, fold_every: int = 10, dtype: Optional[torch.dtype] = None,
                 lease_ttl: float = 600.0, owner: Optional[str] = None, take_over: bool = False) -> None:  # fmt: skip
        if not isinstance(store, ServingStore):
            raise TypeError(
                f"Publish: store must be a veloce.serving store (FileStore, RedisStore, RocksDBStore), "
                f"got {type(store).__name__}"
            )
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):  # fmt: skip
            raise ValueError(f"Publish: every_n_steps must be None or an int >= 1, got {every_n_steps!r}")
        if every_n_steps is None and not at_end:
            raise ValueError("Publish: every_n_steps=None with at_end=False never publishes; pass every_n_steps=N or "
                             "at_end=True")  # fmt: skip
        self.store, self.every_n_steps, self.at_end = store, every_n_steps, bool(at_end)
        self._publisher_args: dict[str, Any] = {"keep_last": keep_last, "fold_every": fold_every, "dtype": dtype,
                                                "lease_ttl": lease_ttl, "owner": owner,
                                                "take_over": take_over}  # fmt: skip
        self.publisher: Optional[Publisher] = None
        self.published: list[tuple[int, int]] = []

    @property
    def version(self) -> Optional[int]:
        """The last version this callback published (None before the first)."""
        return self.published[-1][1] if self.published else None

    def on_fit_start(self, trainer: AnyTrainer) -> None:
        if self.publisher is None:
            self.publisher = Publisher(self.store, trainer.model, **self._publisher_args)

    def on_step_end(self, trainer: AnyTrainer, step: int) -> None:
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self._publish(trainer, step)

    def on_fit_end(self, trainer: AnyTrainer, history: list[dict[str, Any]]) -> None:
        if self.publisher is None:
            return
        step = trainer.global_step
        if self.at_end and (not self.published or self.published[-1][0] != step):
            self._publish(trainer, step)
        self.publisher.close()
        self.publisher = None

    def _publish(self, trainer: AnyTrainer, step: int) -> None:
        if self.publisher is None:  # a hook called outside fit
            self.on_fit_start(trainer)
        assert self.publisher is not None
        flush = getattr(trainer.model, "flush", None)  # async sparse updates in flight belong to the version
        if callable(flush):
            flush()
        self.published.append((step, self.publisher.publish()))
