"""``veloce.Trainer``: the training loop of a recommendation model, checkpointed and resumable.

Where data enters and leaves: a loader yields ``(inputs, target)``; the trainer moves both
to the model's device, calls the model (:mod:`veloce.train.lockstep` holds the conventions),
applies ``loss_fn(preds, target)``, steps a :class:`veloce.CombinedOptimizer` (dense
parameters and every ``DynamicEmbedding`` table) and feeds ``preds`` to stateful metrics.
Checkpoints go through :mod:`veloce.checkpoint`; records go to the callbacks
(:mod:`veloce.train.callbacks`: progress bar, JSON lines, TensorBoard, early stopping).
The ``cuda_graph`` steps are in :mod:`veloce.train.graphed`, the epoch's totals and the
metrics in :mod:`veloce.train.records`, what a checkpoint keeps of the run in
:mod:`veloce.train.resume`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from veloce.distributed import HybridParallel
from veloce.metrics import MetricError
from veloce.sparse import CombinedOptimizer, clip_grad_norm_
from veloce.train.arguments import check_args
from veloce.train.callbacks import Callback, EarlyStopping, JSONLinesLogger, ProgressBar, TensorBoardLogger
from veloce.train.evaluation import evaluate_metrics
from veloce.train.graphed import GraphedSteps
from veloce.train.interrupt import Interrupt, InterruptHandler, TrainingInterrupted
from veloce.train.lockstep import (
    Step,
    call_model,
    gather,
    lockstep,
    model_device,
    move_to,
    split_batch,
    world,
    zero_loss,
)
from veloce.train.prefetch import NextBatchPrefetch
from veloce.train.resume import ResumableRun, check_writable
from veloce.train.telemetry import TableTelemetry
from veloce.train.totals import EpochTotals

__all__ = ["Trainer", "TrainingInterrupted"]

LOG_FILE = "log.jsonl"


class Trainer(GraphedSteps, ResumableRun):
    """Trains and evaluates a model on loaders of ``(inputs, target)`` batches.

    The model is called as ``model(*inputs)`` when ``inputs`` is a tuple or list,
    ``model(**inputs)`` when it is a dict, else ``model(inputs)``; its output (``preds``,
    logits for the built-in metrics) goes to ``loss_fn(preds, target)`` and to every metric's
    ``update(preds, target)``. Inputs and targets (nested tuples, lists, dicts of tensors)
    are moved to the model's device.

    Under ``torch.distributed`` with more than one rank, the model is wrapped in
    ``veloce.distributed.HybridParallel(model, **strategy)``, every rank trains on its own
    batches, metrics are computed over all ranks' predictions, and only rank 0 logs. Ranks
    whose loaders yield different numbers of batches all step until the last rank is
    done: a rank whose loader is done runs zero-row batches meanwhile, and no batch is
    dropped. Each rank's loss is weighted by its share of the step's samples (``loss_fn``
    is taken to be a mean over the batch's samples), so the gradients averaged over ranks
    are those of the mean over every rank's samples: uneven batches train as one process
    on the concatenated batch would. A rank's zero-row batch runs forward and backward
    with a zero loss (``loss_fn`` is not called on it).

    A model with tiered tables (``DynamicEmbedding(storage=veloce.storage.HostCached(...))``)
    that defines ``sparse_lookups(*inputs)`` gets the next batch's rows prefetched into the
    caches after each step (:mod:`veloce.train.prefetch`); every table's ``stats()`` goes
    into the step records as ``tables/<module path>/<key>`` (:mod:`veloce.train.telemetry`).

    Args:
        model: the model; its ``DynamicEmbedding`` tables are stepped with their own sparse
            optimizer.
        loss_fn: ``loss_fn(preds, target) -> scalar``; default ``nn.BCEWithLogitsLoss()``.
        optimizer: a :class:`~veloce.CombinedOptimizer`, or a torch optimizer over the
            dense parameters (wrapped in a ``CombinedOptimizer`` so the tables are stepped
            too), or None for ``torch.optim.Adam(lr=1e-3)`` on the dense parameters.
        metrics: name -> metric with ``update(preds, target)``, ``compute()``, ``reset()``
            (``veloce.metrics`` or torchmetrics objects). A metric that computes to NaN
            (an empty or one-class evaluation set) raises
            :class:`veloce.metrics.MetricError`.
        strategy: keyword arguments of ``HybridParallel`` (e.g. ``{"sparse": "async",
            "staleness": 2}``); used only when the world size is > 1.
        precision: ``"fp32"``, or ``"bf16"`` for autocast to bfloat16 around forward and
            loss (the tables stay in their own dtype).
        accumulate_steps: micro-batches per optimizer step; each micro-batch's loss is
            divided by it. A last partial group of an epoch is stepped too.
        max_epochs: epochs to train.
        max_steps: stop after this many optimizer steps in total (None: no limit); a later
            ``fit`` with a larger limit resumes from the checkpoint.
        checkpoint_dir: where checkpoints go; ``fit`` resumes from the newest one there.
            With it, Ctrl-C (SIGINT, in the main thread) during ``fit`` stops at the end of
            the current optimizer step (or validation batch), checkpoints that step and
            raises :class:`TrainingInterrupted`; on several ranks, every rank stops at the
            same step when any rank is interrupted (the flag rides on the all-reduce the ranks make
            at every step anyway).
        checkpoint_every: also checkpoint every this many optimizer steps (besides every
            epoch's end); needs ``checkpoint_dir``.
        keep_last: checkpoints kept in ``checkpoint_dir``.
        log_every: optimizer steps between step records (progress bar, logs).
        log_dir: where ``log.jsonl`` (and TensorBoard events, if installed) go; default
            ``checkpoint_dir``; None for neither.
        callbacks: :class:`veloce.Callback` objects (e.g. ``EarlyStopping``).
        progress: show a progress bar on rank 0.
        seed: ``torch.manual_seed(seed)`` when a fit starts from scratch (a resumed fit
            restores the saved RNG state instead).
        device: move the model there first; default: where the model already is.
        cuda_graph: run each training step (forward, loss, backward, the dense and sparse
            updates) as one CUDA graph, captured after two eager steps
            (:class:`veloce.CUDAGraphStep`, ``docs/cuda_graphs.md``): on a GPU, a step bound
            by the host's launches runs at the speed of its kernels. Needs a CUDA model,
            ``accumulate_steps=1`` and a dense optimizer that keeps its state on the device
            (``torch.optim.Adam(..., capturable=True)``; SGD). Batches of another shape than
            the captured one (an epoch's short last batch) run eagerly. On several ranks:
            sharded tables (``sparse="sync"``) and a model that defines
            ``sparse_lookups(*inputs)`` (``veloce.models`` do); every rank replays or runs
            eagerly alike, and each step counts the next batch's ids while it runs (the
            next batch is drawn from the loader before the step: a loader that draws from
            torch's global RNG per batch does not resume exactly).
        clip_grad_norm: clip each step's gradients, dense and the tables' together, to
            this total 2-norm (:func:`veloce.clip_grad_norm_`) before the optimizer steps;
            None (default) does not clip. Not with ``cuda_graph``.

    Example::

        trainer = veloce.Trainer(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                 metrics={"auc": veloce.metrics.AUC()}, checkpoint_dir="runs/x")
        history = trainer.fit(train_loader, val_loader)   # [{"epoch": 0, "loss": ..., "val_auc": ...}]
        print(trainer.evaluate(test_loader))               # {"auc": 0.79}
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        metrics: Optional[Mapping[str, Any]] = None,
        strategy: Optional[Mapping[str, Any]] = None,
        precision: str = "fp32",
        accumulate_steps: int = 1,
        max_epochs: int = 1,
        max_steps: Optional[int] = None,
        checkpoint_dir: Optional[str | Path] = None,
        checkpoint_every: Optional[int] = None,
        keep_last: int = 3,
        log_every: int = 50,
        log_dir: Optional[str | Path] = None,
        callbacks: Sequence[Callback] = (),
        progress: bool = True,
        seed: int = 0,
        device: Optional[torch.device | str] = None,
        cuda_graph: bool = False,
        clip_grad_norm: Optional[float] = None,
    ) -> None:
        check_args(model, loss_fn, metrics, strategy, precision, accumulate_steps, max_epochs, max_steps,
                   checkpoint_dir, checkpoint_every, keep_last, log_every, callbacks, seed, cuda_graph,
                   clip_grad_norm)  # fmt: skip
        self.clip_grad_norm = clip_grad_norm
        if device is not None:
            model = model.to(device)
        self.module = model
        self.rank, self.world_size = world()
        self.model = _wrap(model, strategy) if self.world_size > 1 else model
        self.device = model_device(model)
        self.optimizer = _combined(optimizer, self.model)
        self.loss_fn = loss_fn if loss_fn is not None else nn.BCEWithLogitsLoss()
        self.metrics = dict(metrics or {})
        self.precision, self.accumulate_steps = precision, accumulate_steps
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.keep_last, self.log_every = checkpoint_every, keep_last, log_every
        self.seed = seed
        self.callbacks = list(callbacks)
        log_dir = log_dir if log_dir is not None else self.checkpoint_dir
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._loggers = self._make_loggers(progress) if self.rank == 0 else []
        # progress of the run; all of it is saved in checkpoints
        self.epoch = 0  # current epoch (0-based)
        self.global_step = 0  # optimizer steps over the run
        self.batches_in_epoch = 0  # micro-batches of the current epoch consumed
        self.steps_in_epoch = 0  # optimizer steps in the current epoch
        self.history: list[dict[str, Any]] = []
        self.should_stop = False
        self._finished = False  # a callback stopped the run: a later fit does not train further
        self._epoch_rng: Optional[dict[str, list]] = None  # RNG state when the epoch's iterator was made
        self._totals = EpochTotals(self.device)
        self._last_saved: Optional[tuple[int, int]] = None  # (global_step, epoch) of the last checkpoint
        self._last_path: Optional[Path] = None  # ... and where it is
        self._interrupts: Optional[InterruptHandler] = None  # during fit with a checkpoint_dir: Ctrl-C
        self._overwrite = False  # resumed from an explicit checkpoint: replace stale later ones
        self._train_len: Optional[int] = None
        self._telemetry = TableTelemetry(model)  # the tables' stats() in the step records
        self._prefetch = NextBatchPrefetch(self.model, model, self.device, self.world_size)  # tiered tables
        self._logged_at = 0  # global_step of the last step record
        self._init_graph(cuda_graph)

    # ---- public API -----------------------------------------------------------------------
    def fit(
        self,
        train_loader: Iterable,
        val_loader: Optional[Iterable] = None,
        *,
        resume_from: Optional[str | Path] = None,
    ) -> list[dict[str, Any]]:
        """Trains for ``max_epochs`` (or until ``max_steps`` or a callback stops it).

        Resumes from the newest checkpoint in ``checkpoint_dir`` if there is one (or from
        ``resume_from``): model, optimizer, RNG, history and position in the epoch (the
        loader's first batches are read and discarded, so any deterministic loader resumes
        exactly).

        Args:
            train_loader: yields ``(inputs, target)``.
            val_loader: evaluated with the metrics at the end of every epoch (``val_<name>``).
            resume_from: a committed checkpoint directory to resume from instead of the
                newest one in ``checkpoint_dir`` (e.g. the one a launcher such as Ray Train
                kept); checkpoints of later steps already in ``checkpoint_dir`` (written by
                an attempt that did not reach the launcher) are overwritten as the run
                reaches their steps again.

        Returns:
            The history: one record per completed epoch (see :mod:`veloce.train.callbacks`).

        Raises:
            TrainingInterrupted: Ctrl-C (with a ``checkpoint_dir``), after the checkpoint
                of the step reached.
        """
        self._start(resume_from)
        if self._finished or self._steps_exhausted():
            return self.history
        self._check_fit_args(val_loader)
        self._train_len = self._steps_of(train_loader)
        handler = InterruptHandler(announce=self.rank == 0) if self.checkpoint_dir is not None else None
        with handler if handler is not None else contextlib.nullcontext():
            self._interrupts = handler
            try:
                self._fit_epochs(train_loader, val_loader)
            except Interrupt:
                self._flush()
                self._save()
                raise TrainingInterrupted(
                    f"interrupted at step {self.global_step} (epoch {self.epoch}); checkpoint {self._last_path}; "
                    f"fit again with the same checkpoint_dir to resume",
                    self.global_step, self.epoch, self._last_path,
                ) from None  # fmt: skip
            finally:
                self._interrupts = None
        return self.history

    def _fit_epochs(self, train_loader: Iterable, val_loader: Optional[Iterable]) -> None:
        self._telemetry.mark()
        self._logged_at = self.global_step
        self._call("on_fit_start")
        while self.epoch < self.max_epochs and not self.should_stop and not self._steps_exhausted():
            completed = self._train_epoch(train_loader)
            if not completed:
                break
            self._end_epoch(val_loader)
        self._flush()  # async sparse updates still in flight belong to the result
        self._save()
        self._call("on_fit_end", self.history)

    def _interrupted(self) -> bool:
        """Whether Ctrl-C reached this rank during fit (with a checkpoint_dir); lockstep
        carries it in its per-step all-reduce, so every rank stops at the same step."""
        return self._interrupts is not None and self._interrupts.requested

    def _stop_if_interrupted(self, step: Step) -> None:
        """Raises Interrupt, on every rank at once, when Ctrl-C reached any rank."""
        if step.stop and self._interrupts is not None:
            raise Interrupt

    def _check_fit_args(self, val_loader: Optional[Iterable]) -> None:
        """What would otherwise fail only at the first epoch's end or the first checkpoint,
        after an epoch of training: validation without metrics, an early stop on a record
        field no epoch will have, a checkpoint directory that cannot be written."""
        if val_loader is not None and not self.metrics:
            raise ValueError(
                "Trainer.fit: val_loader is given but the Trainer has no metrics to evaluate on it; pass "
                "metrics={'auc': veloce.metrics.AUC(), ...} to the Trainer, or no val_loader"
            )
        for cb in self.callbacks:
            if not isinstance(cb, EarlyStopping) or not cb.monitor.startswith("val_"):
                continue
            if val_loader is None:
                raise ValueError(f"Trainer.fit: EarlyStopping monitors {cb.monitor!r}, which needs a val_loader")
            if cb.monitor[4:] not in self.metrics:
                raise ValueError(
                    f"Trainer.fit: EarlyStopping monitors {cb.monitor!r}, but the metrics are {sorted(self.metrics)} "
                    f"(the epoch record will have {sorted('val_' + k for k in self.metrics)})"
                )
        if self.checkpoint_dir is not None and self.rank == 0:
            check_writable(self.checkpoint_dir)

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> dict[str, float]:
        """The metrics over every batch of ``loader`` (all ranks together), in eval mode.

        With several ranks, the metrics see the predictions of every rank (veloce's are
        computed once over all of them; torchmetrics objects synchronise themselves), so
        they equal the metrics of one process on the same samples; ranks with different
        numbers of batches all take part until the last one is done.

        Returns:
            metric name -> float.

        Raises:
            veloce.metrics.MetricError: a metric computed to NaN (no samples at all, or an
                AUC over samples of one class): it names the metric and why.
        """
        if not self.metrics:
            raise ValueError("Trainer.evaluate: no metrics; pass metrics={'auc': veloce.metrics.AUC(), ...}")
        was_training = self.model.training
        self._flush()
        self.model.eval()
        try:
            return evaluate_metrics(self.model, loader, self.metrics, self.device, self.world_size,
                                    autocast=self._autocast, interrupted=self._interrupted,
                                    check_stop=self._stop_if_interrupted)  # fmt: skip
        finally:
            self.model.train(was_training)

    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps in one epoch of the current train loader (None if it has no length)."""
        if self._train_len is None:
            return None
        return math.ceil(self._train_len / self.accumulate_steps)

    # ---- one epoch ------------------------------------------------------------------------
    def _train_epoch(self, loader: Iterable) -> bool:
        """Trains the rest of the current epoch; False if it stopped early (max_steps, callback)."""
        self.model.train()
        if self._graph is not None:
            batches = self._graph_batches(*self._epoch_iter(loader))
            self._call("on_epoch_start", self.epoch)
            return self._train_graphed(batches)
        it, last = self._epoch_iter(loader)
        batches = lockstep(it, self.device, "Trainer.fit", last=last, interrupted=self._interrupted)
        self._call("on_epoch_start", self.epoch)
        pending = 0
        for step, coming in self._prefetch.ahead(batches):  # (coming: None unless a tiered table prefetches)
            if not pending:  # (at an optimizer step's boundary only: no half-accumulated gradient is lost)
                self._stop_if_interrupted(step)
            pending += 1
            self._forward_backward(step)
            self.batches_in_epoch += 1
            if pending == self.accumulate_steps:
                pending = 0
                self._optimizer_step()
                if self.should_stop or self._steps_exhausted():
                    return self._loader_done()
            if coming is not None and not coming.stop:  # (a stop leaves no prefetched lookup behind)
                self._prefetch(split_batch(coming.batch)[0])
        if pending:
            self._optimizer_step()
        return True

    def _loader_done(self) -> bool:
        """Whether the epoch's batches are all consumed, when a stop (``max_steps``, a
        callback) comes at a step: then the epoch ends as usual (validation, its record, a
        checkpoint). Known from the loader's length; a loader without one is not drawn
        from again, so its epoch stays open and a later fit finishes it."""
        return self._train_len is not None and self.batches_in_epoch >= self._train_len

    def _steps_of(self, loader: Iterable) -> Optional[int]:
        """Steps in an epoch of ``loader``: its length, the longest over the ranks (every
        rank steps until the last one is done); None if some rank's loader has no length."""
        mine = _len_or_none(loader)
        if self.world_size == 1:
            return mine
        lengths = gather(mine)
        return None if any(n is None for n in lengths) else max(lengths)

    def _forward_backward(self, step: Step) -> None:
        inputs, target = move_to(split_batch(step.batch), self.device)
        with self._autocast():
            preds = call_model(self.model, inputs)
            loss = self.loss_fn(preds, target) if step.rows else zero_loss(preds)
        scale = step.loss_scale(self.world_size)
        ((loss * scale if scale != 1.0 else loss) / self.accumulate_steps).backward()
        self._totals.add(loss.detach(), step.rows, step.drawn)

    def _optimizer_step(self, stepped: bool = False) -> None:
        if not stepped:
            if self.clip_grad_norm is not None:
                clip_grad_norm_(self.model, self.clip_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad()
        self._count_step()
        if self.global_step % self.log_every == 0:
            self._log_step()
        self._call("on_step_end", self.global_step)
        # (not at an epoch's last step: the epoch's end saves right after, with its record)
        if self.checkpoint_every and self.global_step % self.checkpoint_every == 0 and not self._loader_done():
            self._save()

    def _count_step(self) -> None:
        """An optimizer step taken: the run's and the epoch's step counters."""
        self.global_step += 1
        self.steps_in_epoch += 1

    def _end_epoch(self, val_loader: Optional[Iterable]) -> None:
        record = {"event": "epoch", "epoch": self.epoch, "step": self.global_step, **self._totals.summary()}
        if val_loader is not None:
            try:
                record.update({f"val_{k}": v for k, v in self.evaluate(val_loader).items()})
            except MetricError:
                # The epoch's training is kept (its last batch consumed, the epoch not ended):
                # a fit resumed with a usable val_loader validates it and goes on.
                self._save()
                raise
        self.history.append(record)
        self._call("on_epoch_end", record)
        self.epoch += 1
        self.batches_in_epoch = self.steps_in_epoch = 0
        self._save()

    def _log_step(self) -> None:
        record = {"event": "step", "epoch": self.epoch, "step": self.global_step, **self._totals.window(),
                  "lr": self.optimizer.param_groups[0]["lr"], "time": time.time()}  # fmt: skip
        record.update(self._telemetry.window(self.global_step - self._logged_at))
        self._logged_at = self.global_step
        self._call("on_log", record)

    # ---- helpers --------------------------------------------------------------------------
    def _flush(self) -> None:
        """Async sparse mode: applies the gradients still in flight (before evaluating or
        checkpointing, on every rank at the same step)."""
        flush = getattr(self.model, "flush", None)
        if callable(flush):
            flush()

    def _steps_exhausted(self) -> bool:
        return self.max_steps is not None and self.global_step >= self.max_steps

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _make_loggers(self, progress: bool) -> list[Callback]:
        loggers: list[Callback] = [ProgressBar()] if progress else []
        if self.log_dir is not None:
            loggers.append(JSONLinesLogger(self.log_dir / LOG_FILE))
            loggers.append(TensorBoardLogger(self.log_dir / "tensorboard"))
        return loggers

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self._loggers + self.callbacks:
            getattr(cb, hook)(self, *args)


def _wrap(model: nn.Module, strategy: Optional[Mapping[str, Any]]) -> nn.Module:
    return HybridParallel(model, **dict(strategy or {}))


def _combined(optimizer: Optional[torch.optim.Optimizer], model: nn.Module) -> CombinedOptimizer:
    if isinstance(optimizer, CombinedOptimizer):
        return optimizer
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=1e-3) if params else None
    return CombinedOptimizer(optimizer, model)



def _len_or_none(loader: Iterable) -> Optional[int]:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
