"""The small conventions the :class:`veloce.Trainer` (and the CLI) rely on, in one place.

- batches are ``(inputs, target)``; :func:`move_to` moves nested tuples/lists/dicts of
  tensors to a device and :func:`call_model` calls the model with ``inputs``;
- :func:`model_device` finds where a model lives (dense parameters or embedding tables);
- :func:`rng_state` / :func:`set_rng_state`: the torch RNG states as JSON-serialisable lists;
- :func:`world`, :func:`gather`, :func:`broadcast` and :func:`lockstep`:
  ``torch.distributed`` when it is initialised, else the one-process answers, so the
  Trainer has one code path for 1 and N ranks; :func:`lockstep` keeps ranks with
  different numbers of batches in step without dropping any (:func:`zero_rows`,
  :func:`zero_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree


def move_to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device``; tuples, lists and dicts are walked
    recursively (their type is kept), anything else is returned as is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return type(obj)((k, move_to(v, device)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(move_to(v, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_to(v, device) for v in obj)
    return obj


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict, else ``model(inputs)``."""
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A loader's batch as ``(inputs, target)``; anything else is an error that says what to yield."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = type(batch).__name__
        if isinstance(batch, (tuple, list)):
            got += f" of length {len(batch)}"
        raise TypeError(f"Trainer: a loader must yield (inputs, target) pairs, got a {got}")
    return batch[0], batch[1]


def batch_size(target: Any) -> int:
    """Samples in a batch: the first dimension of ``target`` (1 for a scalar or a non-tensor)."""
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return int(target.shape[0])
    return 1


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer; CPU for a model with neither.

    ``DynamicEmbedding`` tables hold their rows in buffers, so a model made only of tables
    is found too."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def rng_state() -> dict[str, list]:
    """The torch CPU RNG state (and every CUDA device's, if CUDA is initialised) as lists of ints."""
    state = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, list]) -> None:
    """Restores a state from :func:`rng_state` (the CUDA part only where CUDA is available)."""
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without an initialised process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(obj: Any, group: Any = None) -> list[Any]:
    """``obj`` of every rank, in rank order (``all_gather_object``); ``[obj]`` in one process."""
    _, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``broadcast_object_list``); ``obj`` in one process."""
    _, size = world()
    if size == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


_END = object()


class Step(NamedTuple):
    """One step of :func:`lockstep`: this rank's batch and the step's sample counts."""

    batch: Any  # this rank's batch (``stage``d); a zero-row one when this rank's loader is done
    rows: int  # samples in this rank's batch (the first dimension of its target)
    total: int  # samples in the step's batches over all ranks
    kind: int  # with ``kind``: the lowest kind (1 or 2) over the ranks (a zero-row batch counts as 1); else 1
    drawn: bool  # whether the batch came from this rank's loader (False: a zero-row stand-in)
    stop: bool = False  # with ``interrupted``: some rank was interrupted (every rank sees the same)

    def loss_scale(self, world_size: int) -> float:
        """What this rank's mean loss is multiplied by so that the average over ranks (DDP's,
        and HybridParallel's for the tables) is the gradient of the mean over every rank's
        samples: ``rows * world_size / total`` (exactly 1.0 when the ranks' batches are equal)."""
        if self.rows * world_size == self.total:
            return 1.0
        return self.rows * world_size / self.total


def zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor of at least one dimension cut to zero rows (``x[:0]``):
    the batch a rank whose loader is done runs while other ranks still have batches."""
    return pytree.tree_map(lambda x: x[:0] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, batch)


def zero_loss(preds: Any) -> torch.Tensor:
    """The loss of a zero-row batch: zero, but computed from the predictions, so that the
    backward reaches every parameter the forward used (DDP's all-reduces and the sharded
    tables' gradient exchange wait for every rank's backward)."""
    leaves = [x for x in pytree.tree_leaves(preds) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise TypeError(
            f"Trainer: the model's output has no floating-point tensor, got {type(preds).__name__}"
        )
    return sum(x.sum() for x in leaves) * 0.0


def _rows(batch: Any) -> int:
    return batch_size(split_batch(batch)[1])


def lockstep(batches: Iterable, device: torch.device, what: str, *, stage: Optional[Callable[[Any], Any]] = None,
             kind: Optional[Callable[[Any], int]] = None, group: Any = None, last: Any = None,
             interrupted: Optional[Callable[[], bool]] = None) -> Iterator[Step]:  # fmt: skip
    """The steps of this rank, for as long as any rank still has a batch.

    Sharded lookups are collectives, so ranks must run the same number of steps. When
    their loaders yield different numbers of batches, a rank whose loader is done keeps
    stepping with a zero-row batch (:func:`zero_rows` of its last batch, or of another
    rank's first batch when its loader yielded none) until every rank is done: no batch
    is dropped. Each step makes one tiny all-reduce (this rank's batch drawn or not, its
    samples, its kind, whether it was interrupted), which also gives the step's samples
    over all ranks (:meth:`Step.loss_scale`) and lets every rank stop at the same step.

    Args:
        batches: this rank's ``(inputs, target)`` batches.
        device: where the all-reduce's tensor goes on an NCCL group.
        what: who asks, for errors.
        stage: applied to each batch (the drawn ones and the zero-row ones) before ``kind``;
            ``Step.batch`` is what it returns.
        kind: each staged batch's kind on this rank, 1 or 2 (the Trainer's graphed steps:
            1 eager, 2 a replay); ``Step.kind`` is the lowest over the ranks, and a zero-row
            batch is 1.
        group: the process group of the all-reduce (a gloo group keeps it off the device's
            queue); the default group otherwise.
        last: the batch this rank drew last before ``batches`` (a resumed epoch's skipped
            batches), the template of its zero-row batches if ``batches`` is empty.
        interrupted: whether this rank was asked to stop (Ctrl-C); ``Step.stop`` is true
            on every rank when it is true on any.
    """
    asked = interrupted if interrupted is not None else (lambda: False)
    stage = stage if stage is not None else (lambda b: b)
    _, size = world()
    if size == 1:
        for batch in batches:
            rows, staged = _rows(batch), stage(batch)
            yield Step(staged, rows, rows, kind(staged) if kind is not None else 1, True, asked())
        return
    dist = torch.distributed
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    it = iter(batches)
    first = True
    while True:
        batch = next(it, _END)
        drawn = batch is not _END
        rows, staged, mine = 0, None, 1
        if drawn:
            rows, staged = _rows(batch), stage(batch)
            mine = kind(staged) if kind is not None else 1
            if mine not in (1, 2):
                raise ValueError(f"{what}: a batch's kind must be 1 or 2, got {mine}")
            last = batch
        # [ranks with a batch, samples, ranks whose batch runs eagerly (kind 1), ranks interrupted]
        flag = torch.tensor([int(drawn), rows, int(mine == 1 or not drawn), int(asked())], dtype=torch.int64,
                            device=dev)  # fmt: skip
        dist.all_reduce(flag, group=group)
        alive, total, eager, stop = (int(x) for x in flag.tolist())
        if not alive:
            return
        if first and alive < size:  # some rank's loader yielded nothing: it takes another rank's batch's form
            template = gather(None if last is None else move_to(zero_rows(last), torch.device("cpu")), group)
            last = last if last is not None else next(t for t in template if t is not None)
        first = False
        if not drawn:
            staged = stage(zero_rows(last))
        yield Step(staged, rows, total, 1 if eager else 2, drawn, bool(stop))
