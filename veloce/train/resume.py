"""A :class:`veloce.Trainer` run's checkpoints: saving its position with the model
(:class:`ResumableRun`), resuming from one (the epoch's loader drawn again past the batches
consumed), the checks before a fit writes or resumes, the strict-JSON encoding of its
records, and each rank's share of the saved state when the number of ranks changed."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from veloce import checkpoint
from veloce.train.graphed import graph_shape
from veloce.train.lockstep import broadcast, gather, rng_state, set_rng_state, split_batch

__all__ = ["RESUME_KEYS", "ResumableRun", "check_resumable", "check_writable", "decode_floats", "encode_floats",
           "rank_state"]  # fmt: skip

_DONE = object()


class ResumableRun:
    """The checkpoints of a :class:`veloce.Trainer` run (a part of it: it reads and sets the
    trainer's position, totals and RNG state): :meth:`_start` resumes, :meth:`_save` saves,
    :meth:`_epoch_iter` draws the epoch's batches again up to where the checkpoint was."""

    def _start(self, resume_from: Optional[str | Path]) -> None:
        """Loads ``resume_from`` or the newest checkpoint, or seeds the RNG for a fresh run."""
        self.should_stop = False
        self._overwrite = resume_from is not None
        if resume_from is not None:
            path: Optional[Path] = Path(resume_from)
        else:
            path = checkpoint.latest(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        found = broadcast(None if path is None else str(path))  # every rank resumes from rank 0's choice
        path = None if found is None else Path(found)
        if path is None:
            if self.global_step == 0:
                torch.manual_seed(self.seed)
            return
        check_resumable(path)
        extra = decode_floats(checkpoint.load(path, self.model, self.optimizer)["extra"])
        self.epoch, self.global_step = extra["epoch"], extra["global_step"]
        self.batches_in_epoch, self.steps_in_epoch = extra["batches_in_epoch"], extra["steps_in_epoch"]
        self.history, self._finished = extra["history"], extra["finished"]
        mine = rank_state(extra["ranks"], self.rank, self.world_size)
        self._epoch_rng = mine["epoch_rng"]
        self._totals.load(mine["totals"], self.device)
        for cb, state in zip(self.callbacks, extra["callbacks"]):
            cb.load_state_dict(state)
        set_rng_state(mine["rng"])
        self._last_saved, self._last_path = (self.global_step, self.epoch), path

    def _save(self) -> None:
        # Saved once per step and epoch: an epoch that ends at a step checkpoint_every saved
        # replaces that checkpoint (the same model; now with the epoch's end and record).
        if self.checkpoint_dir is None or (self.global_step, self.epoch) == self._last_saved:
            return
        again = self._last_saved is not None and self._last_saved[0] == self.global_step
        self._flush()
        extra = {
            "epoch": self.epoch, "global_step": self.global_step, "batches_in_epoch": self.batches_in_epoch,
            "steps_in_epoch": self.steps_in_epoch, "history": self.history, "finished": self.should_stop,
            "callbacks": [cb.state_dict() for cb in self.callbacks],
            # each rank's RNG and running totals (a collective: every rank saves)
            "ranks": gather({"rng": rng_state(), "epoch_rng": self._epoch_rng, "totals": self._totals.state()}),
        }  # fmt: skip
        path = checkpoint.save_in(self.checkpoint_dir, self.model, self.optimizer, step=self.global_step,
                                  extra=encode_floats(extra), keep_last=self.keep_last,
                                  overwrite=self._overwrite or again)  # fmt: skip
        self._last_saved, self._last_path = (self.global_step, self.epoch), path
        self._call("on_checkpoint", path)

    def _epoch_iter(self, loader: Iterable) -> tuple[Iterator, Any]:
        """The loader's iterator for this epoch, past the batches a resumed run already
        consumed, and the last batch skipped (None if none was).

        The iterator is made under the RNG state of the epoch's start, so a shuffling loader
        draws the same order as the interrupted run; then the RNG state of the checkpoint
        comes back. ``batches_in_epoch`` counts the epoch's steps, the same on every rank:
        a rank whose loader is shorter skips all of it (it was stepping with zero-row
        batches)."""
        resuming = self.batches_in_epoch > 0
        last = None
        if not resuming:
            self._epoch_rng = rng_state()
            self._totals.reset(self.device)
            it = iter(loader)
        else:
            at_checkpoint = rng_state()
            set_rng_state(self._epoch_rng)
            it = iter(loader)
            skipped = 0
            for i in range(self.batches_in_epoch):
                batch = next(it, _DONE)
                if batch is _DONE:
                    break
                skipped, last = skipped + 1, batch
                if i == 0 and self._graph is not None and self._graph_spec is None:
                    # The captured shape is the first batch's: the epoch's first, a full one,
                    # rather than the batch the resumed run starts at (its short last, maybe).
                    self._graph_spec = graph_shape(*pytree.tree_flatten(split_batch(batch)))  # (None: not tensors)
            longest = max(gather(skipped))  # (every rank raises alike)
            if longest < self.batches_in_epoch:
                raise RuntimeError(
                    f"Trainer: cannot resume: the checkpoint consumed {self.batches_in_epoch} batches of "
                    f"epoch {self.epoch} but the loader has only {longest}"
                    f"{' (the longest over the ranks)' if self.world_size > 1 else ''}; resume with the same data"
                )  # fmt: skip
            set_rng_state(at_checkpoint)
        self._totals.start_clock()
        return it, last



def check_writable(directory: Path) -> None:
    """Makes ``directory`` and writes a file in it, or raises CheckpointError saying why."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise checkpoint.CheckpointError(
            f"Trainer: checkpoint_dir {str(directory)!r} cannot be written ({exc.strerror or exc}); choose another "
            f"checkpoint_dir"
        ) from exc


RESUME_KEYS = ("epoch", "global_step", "batches_in_epoch", "steps_in_epoch", "history", "finished", "callbacks",
                "ranks")  # fmt: skip


def check_resumable(path: Path) -> None:
    """Refuses, before the model changes, a checkpoint that a Trainer did not write (a
    ``veloce.checkpoint.save_in`` of one's own holds no training position)."""
    extra = checkpoint.describe(path)["extra"]
    missing = [k for k in RESUME_KEYS if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise checkpoint.CheckpointError(
            f"Trainer: {path} was not written by a Trainer (its extra lacks {', '.join(missing)}): a fit cannot "
            f"resume from it. Load the model from it with veloce.checkpoint.load(path, model) before making the "
            f"Trainer, and give the Trainer a checkpoint_dir without it"
        )


def encode_floats(obj: Any) -> Any:
    """``obj`` (JSON types) with NaN and infinities as ``{"$float": "nan"}`` etc.: a
    checkpoint's extra is strict JSON, and an epoch record may hold NaN (a metric on a
    one-class split, a loss gone NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"$float": repr(obj)}
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_floats(v) for v in obj]
    return obj


def decode_floats(obj: Any) -> Any:
    """The inverse of :func:`encode_floats`."""
    if isinstance(obj, dict):
        if obj.keys() == {"$float"}:
            return float(obj["$float"])
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj


def rank_state(ranks: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's saved RNG and epoch totals. Saved by another number of ranks: rank 0's
    RNG everywhere, and the epoch totals summed on rank 0 (zero elsewhere) so that the
    epoch's summary over ranks stays right."""
    if len(ranks) == world_size:
        return ranks[rank]
    totals = [r["totals"] for r in ranks]
    # (the ranks trained side by side: the epoch's time so far is the longest rank's)
    summed = {k: (max if k == "seconds" else sum)(t[k] for t in totals) for k in totals[0]}
    summed = summed if rank == 0 else {k: 0 for k in totals[0]}
    return {**ranks[0], "totals": summed}
