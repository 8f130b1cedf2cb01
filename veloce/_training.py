"""The small conventions the :class:`veloce.Trainer` (and the CLI) rely on, in one place.

- batches are ``(inputs, target)``; :func:`move_to` moves nested tuples/lists/dicts of
  tensors to a device and :func:`call_model` calls the model with ``inputs``;
- :func:`model_device` finds where a model lives (dense parameters or embedding tables);
- :func:`rng_state` / :func:`set_rng_state`: the torch RNG states as JSON-serialisable lists;
- :func:`world`, :func:`gather`, :func:`broadcast` and :func:`lockstep`:
  ``torch.distributed`` when it is initialised, else the one-process answers, so the
  Trainer has one code path for 1 and N ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Optional

import torch
from torch import nn


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


def gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``all_gather_object``); ``[obj]`` in one process."""
    _, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    torch.distributed.all_gather_object(out, obj)
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


def lockstep(batches: Iterable, device: torch.device, what: str, kind: Optional[Callable[[Any], int]] = None,
             group: Any = None) -> Iterator:  # fmt: skip
    """The batches of this rank, for as long as every rank still has one.

    Sharded lookups are collectives, so ranks must run the same number of steps; when
    their loaders yield different numbers of batches, all ranks stop at the shortest
    (one tiny all-reduce per batch) and a rank that drops batches warns.

    ``kind``: each batch's kind on this rank (an int >= 1); then ``(batch, agreed)`` pairs
    are yielded, ``agreed`` the lowest kind over the ranks (the Trainer's graphed steps: 1
    eager, 2 a replay). ``group``: the process group of the all-reduce (a gloo group
    keeps it off the device's queue); the default group otherwise."""
    _, size = world()
    if size == 1:
        for batch in batches:
            yield (batch, kind(batch)) if kind is not None else batch
        return
    dist = torch.distributed
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    it = iter(batches)
    while True:
        batch = next(it, _END)
        mine = 0 if batch is _END else (kind(batch) if kind is not None else 1)
        if mine < 1 and batch is not _END:
            raise ValueError(f"{what}: a batch's kind must be >= 1, got {mine}")
        flag = torch.tensor([mine], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        agreed = int(flag.item())
        if not agreed:
            if batch is not _END:
                warnings.warn(
                    f"{what}: this rank ({dist.get_rank()}) has more batches than another rank; its remaining "
                    f"batches are skipped so that every rank runs the same steps. Give every rank the same "
                    f"number of batches (e.g. drop_last, or a sample count that splits evenly).",
                    stacklevel=2,
                )
            return
        yield (batch, agreed) if kind is not None else batch
