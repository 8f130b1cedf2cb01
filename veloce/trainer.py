"""``veloce.Trainer``: the training loop of a recommendation model, checkpointed and resumable.

Where data enters and leaves: a loader yields ``(inputs, target)``; the trainer moves both
to the model's device, calls the model (``veloce/_training.py`` holds the conventions),
applies ``loss_fn(preds, target)``, steps a :class:`veloce.CombinedOptimizer` (dense
parameters and every ``DynamicEmbedding`` table) and feeds ``preds`` to stateful metrics.
Checkpoints go through :mod:`veloce.checkpoint`; records go to the callbacks
(:mod:`veloce.callbacks`: progress bar, JSON lines, TensorBoard, early stopping).
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from veloce import checkpoint
from veloce._training import Step, batch_size, broadcast, call_model, gather, lockstep, model_device, move_to
from veloce._training import rng_state, set_rng_state, split_batch, world
from veloce.callbacks import Callback, JSONLinesLogger, ProgressBar, TensorBoardLogger
from veloce.graphs import CUDAGraphStep
from veloce.metrics import MetricError
from veloce.sparse import CombinedOptimizer, clip_grad_norm_

__all__ = ["Trainer", "TrainingInterrupted"]

PRECISIONS = ("fp32", "bf16")
LOG_FILE = "log.jsonl"


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


class _Interrupt(Exception):
    """Every rank agreed to stop at this step boundary (raised inside fit, caught by it)."""


class _InterruptHandler:
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

    def __enter__(self) -> _InterruptHandler:
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


class Trainer:
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
        _check_args(model, loss_fn, metrics, strategy, precision, accumulate_steps, max_epochs, max_steps,
                    checkpoint_dir, checkpoint_every, keep_last, log_every, callbacks, seed)  # fmt: skip
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
        self._totals = _Totals(self.device)
        self._last_saved: Optional[tuple[int, int]] = None  # (global_step, epoch) of the last checkpoint
        self._last_path: Optional[Path] = None  # ... and where it is
        self._interrupts: Optional[_InterruptHandler] = None  # during fit with a checkpoint_dir: Ctrl-C
        self._overwrite = False  # resumed from an explicit checkpoint: replace stale later ones
        self._train_len: Optional[int] = None
        self._graph: Optional[CUDAGraphStep] = None  # cuda_graph: the captured training step
        self._graph_spec: Any = None  # the batch structure it was captured for
        self._spec: Any = None  # the structure of the batch being run
        self._control: Any = None  # cuda_graph over several ranks: a gloo group agreeing on each batch's kind
        self._step_rows, self._loss_scale = 1, 1.0  # cuda_graph: the step's samples here, its loss weight
        if cuda_graph:
            self._check_cuda_graph()
            lookups = self._graph_lookups if self.world_size > 1 else None
            self._graph = CUDAGraphStep(self._graph_fn, self.module, self.optimizer, lookups=lookups)
            if self.world_size > 1:
                if not self._graph._sharded:
                    raise ValueError(
                        "Trainer: cuda_graph=True over several ranks captures sharded steps (HybridParallel with "
                        "sparse='sync'); this model has no sharded DynamicEmbedding"
                    )  # fmt: skip
                self._control = torch.distributed.new_group(backend="gloo")

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
            The history: one record per completed epoch (see :mod:`veloce.callbacks`).

        Raises:
            TrainingInterrupted: Ctrl-C (with a ``checkpoint_dir``), after the checkpoint
                of the step reached.
        """
        self._start(resume_from)
        if self._finished or self._steps_exhausted():
            return self.history
        self._check_fit_args(val_loader)
        self._train_len = self._steps_of(train_loader)
        handler = _InterruptHandler(announce=self.rank == 0) if self.checkpoint_dir is not None else None
        with handler if handler is not None else contextlib.nullcontext():
            self._interrupts = handler
            try:
                self._fit_epochs(train_loader, val_loader)
            except _Interrupt:
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
        """Raises _Interrupt, on every rank at once, when Ctrl-C reached any rank."""
        if step.stop and self._interrupts is not None:
            raise _Interrupt

    def _check_fit_args(self, val_loader: Optional[Iterable]) -> None:
        """What would otherwise fail only at the first epoch's end or the first checkpoint,
        after an epoch of training: validation without metrics, an early stop on a record
        field no epoch will have, a checkpoint directory that cannot be written."""
        if val_loader is not None and not self.metrics:
            raise ValueError(
                "Trainer.fit: val_loader is given but the Trainer has no metrics to evaluate on it; pass "
                "metrics={'auc': veloce.metrics.AUC(), ...} to the Trainer, or no val_loader"
            )
        from veloce.callbacks import EarlyStopping

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
            _check_writable(self.checkpoint_dir)

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
        sink = _MetricSink(self.metrics, self.world_size)
        samples = 0
        try:
            for step in lockstep(loader, self.device, "Trainer.evaluate", interrupted=self._interrupted):
                self._stop_if_interrupted(step)  # (validation inside fit: Ctrl-C need not wait for its end)
                inputs, target = move_to(split_batch(step.batch), self.device)
                with self._autocast():
                    preds = call_model(self.model, inputs)
                samples += step.total
                if step.rows:  # (a zero-row batch runs for the ranks' collectives only)
                    sink.update(preds.float() if torch.is_tensor(preds) else preds, target)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = sink.compute()
        finally:
            self.model.train(was_training)
        nan = [k for k, v in result.items() if math.isnan(v)]
        if nan:
            why = "; ".join(dict.fromkeys(str(w.message) for w in caught))
            raise MetricError(
                f"Trainer.evaluate: metric{'s' if len(nan) > 1 else ''} {', '.join(map(repr, nan))} computed to NaN "
                f"over the {samples} evaluation samples of all {self.world_size} rank(s)"
                f"{f' ({why})' if why else ''}: evaluate on data with samples, of both classes for an AUC "
                f"(a larger or another validation split)"
            )  # fmt: skip
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return result

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
        for step in batches:
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
                    self._graph_spec = _graph_shape(*pytree.tree_flatten(split_batch(batch)))  # (None: not tensors)
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

    def _forward_backward(self, step: Step) -> None:
        inputs, target = move_to(split_batch(step.batch), self.device)
        with self._autocast():
            preds = call_model(self.model, inputs)
            loss = self.loss_fn(preds, target) if step.rows else _zero_loss(preds)
        scale = step.loss_scale(self.world_size)
        ((loss * scale if scale != 1.0 else loss) / self.accumulate_steps).backward()
        self._totals.add(loss.detach(), step.rows, step.drawn)

    # ---- cuda_graph ---------------------------------------------------------------------
    def _check_cuda_graph(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"Trainer: cuda_graph=True needs a model on a CUDA device, got one on {self.device}")
        if self.world_size > 1 and not callable(getattr(self.module, "sparse_lookups", None)):
            raise ValueError(
                f"Trainer: cuda_graph=True over several ranks needs the model to say its sharded lookups: define "
                f"sparse_lookups(*inputs) on {type(self.module).__name__} (veloce.models do; docs/cuda_graphs.md)"
            )  # fmt: skip
        if self.accumulate_steps != 1:
            raise ValueError(
                f"Trainer: cuda_graph=True captures whole optimizer steps: accumulate_steps must be 1, got "
                f"{self.accumulate_steps}"
            )

    def _graph_fn(self, *leaves: torch.Tensor) -> torch.Tensor:
        """The captured step, over the batch's tensors flattened (torch.utils._pytree). Its
        loss is weighted by ``_loss_scale`` (baked into the capture as a constant: right for
        every replay, since a replay runs only when every rank's batch has its captured
        shape, so the ranks' sample counts are those of the capture) and is zero for a
        zero-row batch (always an eager step)."""
        inputs, target = pytree.tree_unflatten(list(leaves), self._spec)
        with self._autocast():
            preds = call_model(self.model, inputs)
            loss = self.loss_fn(preds, target) if self._step_rows else _zero_loss(preds)
        (loss * self._loss_scale if self._loss_scale != 1.0 else loss).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def _graph_lookups(self, *leaves: torch.Tensor) -> Any:
        """The captured step's sharded lookups (CUDAGraphStep's ``lookups``), over the batch's
        tensors flattened: the model's ``sparse_lookups`` of its inputs."""
        inputs, _ = pytree.tree_unflatten(list(leaves), self._spec)
        return call_model(self.module.sparse_lookups, inputs)

    def _graph_batches(self, it: Iterator, last: Any) -> Iterator[Step]:
        """The epoch's steps, their batches moved to the device and flattened, with the kind
        of step every rank agrees on for each (lockstep: one tiny all-reduce per batch, on a
        gloo group so that it never waits for the device): 2, a replay (every rank's batch
        has the captured structure and shapes); 1, an eager step (an epoch's short last
        batch, or a zero-row one, on some rank)."""

        def staged(batch: Any) -> tuple:
            inputs, target = move_to(split_batch(batch), self.device)
            leaves, spec = pytree.tree_flatten((inputs, target))
            shape = _graph_shape(leaves, spec)
            if shape is None:
                raise TypeError("Trainer: cuda_graph=True needs batches of tensors (nested tuples, lists, dicts)")
            if self._graph_spec is None and batch_size(target):  # the first batch's: a full batch, as a rule
                self._graph_spec = shape
            assert self._graph is not None
            fits = shape == self._graph_spec and self._graph.matches(*leaves)
            return leaves, spec, fits

        return lockstep(it, self.device, "Trainer.fit", stage=staged, kind=lambda b: 2 if b[2] else 1,
                        group=self._control, last=last, interrupted=self._interrupted)  # fmt: skip

    def _train_graphed(self, batches: Iterator) -> bool:
        """The epoch's steps as replays of the captured step (cuda_graph=True). False if it
        stopped early. Sharded tables: each batch is drawn from the loader and moved to the
        device one step ahead, and counted while the step before runs
        (``CUDAGraphStep(next_inputs=)``)."""
        graph = self._graph
        assert graph is not None
        ahead_ok = graph._sharded
        cur = next(batches, None)
        try:
            while cur is not None:
                self._stop_if_interrupted(cur)
                following = next(batches, None) if ahead_ok else None
                (leaves, self._spec, _), kind = cur.batch, cur.kind
                self._step_rows, self._loss_scale = cur.rows, cur.loss_scale(self.world_size)
                last = self.max_steps is not None and self.global_step + 1 >= self.max_steps
                ahead = following is not None and kind == 2 and following.kind == 2 and not last
                # Another structure or shape (an epoch's short last batch, on any rank) runs
                # eagerly, also before the capture: the step is captured for full batches.
                try:
                    if kind == 2:
                        loss = graph(*leaves, next_inputs=following.batch[0] if ahead else None)
                    else:
                        loss = graph.eager(*leaves)
                except BaseException:
                    if kind == 2 and graph.stepped:  # an earlier replay's error, raised after this step ran
                        self.batches_in_epoch += 1
                        self._count_step()
                    raise
                # (queued on the device before the next replay rewrites the loss)
                self._totals.add(loss, cur.rows, cur.drawn)
                self.batches_in_epoch += 1
                self._optimizer_step(stepped=True)
                if self.should_stop or self._steps_exhausted():
                    graph.discard_ahead()  # (a callback stopped the run after a batch was announced)
                    return self._loader_done()
                cur = following if ahead_ok else next(batches, None)
        except BaseException:
            graph.discard_ahead()  # a later fit() counts its first batch itself
            raise
        return True

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
        self._call("on_log", record)

    # ---- checkpoints and resume -----------------------------------------------------------
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
        _check_resumable(path)
        extra = _decode_floats(checkpoint.load(path, self.model, self.optimizer)["extra"])
        self.epoch, self.global_step = extra["epoch"], extra["global_step"]
        self.batches_in_epoch, self.steps_in_epoch = extra["batches_in_epoch"], extra["steps_in_epoch"]
        self.history, self._finished = extra["history"], extra["finished"]
        mine = _rank_state(extra["ranks"], self.rank, self.world_size)
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
                                  extra=_encode_floats(extra), keep_last=self.keep_last,
                                  overwrite=self._overwrite or again)  # fmt: skip
        self._last_saved, self._last_path = (self.global_step, self.epoch), path
        self._call("on_checkpoint", path)

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


class _Totals:
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
        self.seconds_before = state.get("seconds", 0.0)  # (checkpoints before 2026-12-02 lack it)


class _MetricSink:
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


_DONE = object()


def _zero_loss(preds: Any) -> torch.Tensor:
    """The loss of a zero-row batch: zero, but computed from the predictions, so that the
    backward reaches every parameter the forward used (DDP's all-reduces and the sharded
    tables' gradient exchange wait for every rank's backward)."""
    leaves = [x for x in pytree.tree_leaves(preds) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise TypeError(
            f"Trainer: the model's output has no floating-point tensor, got {type(preds).__name__}"
        )
    return sum(x.sum() for x in leaves) * 0.0


def _check_writable(directory: Path) -> None:
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


_RESUME_KEYS = ("epoch", "global_step", "batches_in_epoch", "steps_in_epoch", "history", "finished", "callbacks",
                "ranks")  # fmt: skip


def _check_resumable(path: Path) -> None:
    """Refuses, before the model changes, a checkpoint that a Trainer did not write (a
    ``veloce.checkpoint.save_in`` of one's own holds no training position)."""
    extra = checkpoint.describe(path)["extra"]
    missing = [k for k in _RESUME_KEYS if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise checkpoint.CheckpointError(
            f"Trainer: {path} was not written by a Trainer (its extra lacks {', '.join(missing)}): a fit cannot "
            f"resume from it. Load the model from it with veloce.checkpoint.load(path, model) before making the "
            f"Trainer, and give the Trainer a checkpoint_dir without it"
        )


def _encode_floats(obj: Any) -> Any:
    """``obj`` (JSON types) with NaN and infinities as ``{"$float": "nan"}`` etc.: a
    checkpoint's extra is strict JSON, and an epoch record may hold NaN (a metric on a
    one-class split, a loss gone NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"$float": repr(obj)}
    if isinstance(obj, dict):
        return {k: _encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_floats(v) for v in obj]
    return obj


def _decode_floats(obj: Any) -> Any:
    """The inverse of :func:`_encode_floats`."""
    if isinstance(obj, dict):
        if obj.keys() == {"$float"}:
            return float(obj["$float"])
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _rank_state(ranks: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
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


def _wrap(model: nn.Module, strategy: Optional[Mapping[str, Any]]) -> nn.Module:
    from veloce.distributed import HybridParallel  # lazily: only multi-rank runs need it

    return HybridParallel(model, **dict(strategy or {}))


def _combined(optimizer: Optional[torch.optim.Optimizer], model: nn.Module) -> CombinedOptimizer:
    if isinstance(optimizer, CombinedOptimizer):
        return optimizer
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=1e-3) if params else None
    return CombinedOptimizer(optimizer, model)


def _graph_shape(leaves: Sequence[Any], spec: Any) -> Optional[tuple]:
    """A batch's structure (its pytree spec) and its tensors' shapes and dtypes, or None when
    some leaf is not a tensor: with cuda_graph=True, the batches of the captured shape replay
    the step, the others run eagerly."""
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    return spec, [(x.shape, x.dtype) for x in leaves]


def _len_or_none(loader: Iterable) -> Optional[int]:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_args(model, loss_fn, metrics, strategy, precision, accumulate_steps, max_epochs, max_steps,
                checkpoint_dir, checkpoint_every, keep_last, log_every, callbacks, seed) -> None:  # fmt: skip
    """Every constructor argument's check, each error naming the argument and the value."""
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
