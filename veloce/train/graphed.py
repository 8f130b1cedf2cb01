"""The Trainer's ``cuda_graph=True`` steps: each training step (forward, loss, backward, the
dense and sparse updates) captured once as a :class:`veloce.CUDAGraphStep` and replayed for
every batch of the captured structure and shapes; other batches run eagerly.

:class:`GraphedSteps` is a part of :class:`veloce.Trainer` (it reads and sets the
trainer's state: its model, optimizer, counters and epoch totals), kept apart so that the
eager loop reads on its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from veloce.graphs import CUDAGraphStep
from veloce.train.lockstep import Step, batch_size, call_model, lockstep, move_to, split_batch, zero_loss

__all__ = ["GraphedSteps", "graph_shape"]


class GraphedSteps:
    """The captured training step of a :class:`veloce.Trainer` (``cuda_graph=True``)."""

    def _init_graph(self, cuda_graph: bool) -> None:
        """The graph state; with ``cuda_graph``, checks the settings and makes the step to capture."""
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
                if not self._graph.sharded:
                    raise ValueError(
                        "Trainer: cuda_graph=True over several ranks captures sharded steps (HybridParallel with "
                        "sparse='sync'); this model has no sharded DynamicEmbedding"
                    )  # fmt: skip
                self._control = torch.distributed.new_group(backend="gloo")

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
            loss = self.loss_fn(preds, target) if self._step_rows else zero_loss(preds)
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
            shape = graph_shape(leaves, spec)
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
        ahead_ok = graph.sharded
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


def graph_shape(leaves: Sequence[Any], spec: Any) -> Optional[tuple]:
    """A batch's structure (its pytree spec) and its tensors' shapes and dtypes, or None when
    some leaf is not a tensor: with cuda_graph=True, the batches of the captured shape replay
    the step, the others run eagerly."""
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    return spec, [(x.shape, x.dtype) for x in leaves]

