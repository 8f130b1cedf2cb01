"""``DynamicEmbedding``: a drop-in ``nn.EmbeddingBag`` whose rows live in a hash table.

Shapes (as ``nn.EmbeddingBag``): ``N`` ids, ``B`` bags, ``L`` ids per bag for 2-D
input, ``D`` embedding dim.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from typing import Any, Callable, NamedTuple, NoReturn, Optional, Sequence, TypeVar

import torch
from torch import nn

from veloce import _capture, _compile, _ext
from veloce._device import HostCopy, host_tensor
from veloce._update_stream import run_update
from veloce import init as _init
from veloce import optim as _optim
from veloce.ops import optimizer as _ops
from veloce.ops.embedding import accumulate_grad, bag_layouts_bad, bag_of, max_pool, max_pool_position_grad, pooled_lookup_kernels
from veloce.table import HashTable, PlainAttrs, find_or_insert_many, insert_beside_updates, is_int64
from veloce.eviction import EvictionPolicy

__all__ = ["DynamicEmbedding", "lookup_many", "step_tables"]

_T = TypeVar("_T")
_DIST_AVAILABLE = torch.distributed.is_available()
_MODES = {"sum": 0, "mean": 1}  # the pooling kernels' modes; "max" pools in veloce.ops.embedding.max_pool
_POOLINGS = ("sum", "mean", "max")
_NONFINITE = ("raise", "raise_next", "skip", "apply")
_CHECKED = ("raise", "raise_next")  # policies whose step() checks every gradient before applying any
_UNKNOWN = ("init", "zeros")
# What a user of nn.EmbeddingBag reaches for and what does that here (see __getattr__).
_NOT_EMBEDDING_BAG = {
    "weight": "the rows live in a hash table keyed by raw ids, not in a (num_embeddings, D) matrix whose row i "
              "is id i. Read rows with find(ids) (export() gives every id and row), write them with "
              "insert(ids, rows), start from a matrix with DynamicEmbedding.from_pretrained(weight), and choose "
              "new rows' values with initializer=veloce.init...",
    "num_embeddings": "there is no vocabulary size: len(emb) is the number of ids held now, emb.capacity the "
                      "slots allocated, emb.max_capacity the bound (None: unbounded)",
}


# Every DynamicEmbedding alive in the process: torch's gradient clipping asks which hold a
# gradient it cannot see (veloce.optim).
_LIVE: "weakref.WeakSet[DynamicEmbedding]" = weakref.WeakSet()


def waiting_tables() -> list["DynamicEmbedding"]:
    """The live tables holding a gradient that arrived since the last step of any torch
    optimizer and waits for their step() (pending, or in flight in async mode): what a
    gradient clipping of the dense parameters alone would leave unclipped."""
    steps = _optim.torch_step_count()
    return [t for t in list(_LIVE) if t._unapplied_since == steps]


def training_lookup(module: "DynamicEmbedding") -> bool:
    """Whether a lookup of ``module`` made now is a training lookup (it inserts new ids,
    scores rows for eviction and gives the table a gradient): the module is in training
    mode and gradients are enabled. Under ``torch.no_grad()`` or ``torch.inference_mode()``
    a lookup is an evaluation lookup whatever the mode, as validation is: nothing changes
    in the table, as nothing changes in an ``nn.EmbeddingBag`` there. Read it before
    entering an autograd Function, whose forward runs with gradients disabled."""
    return module.training and torch.is_grad_enabled()


class DynamicEmbedding(PlainAttrs, nn.Module):
    """A pooled embedding over raw int64 ids with no vocabulary: ``nn.EmbeddingBag`` without
    ``num_embeddings``.

    Rows are created on first sight by a training lookup (training mode, gradients
    enabled; initialised from ``(seed, id)``), trained by a fused sparse optimizer on
    :meth:`step` (or through :class:`veloce.optim.CombinedOptimizer`), and the table grows
    as needed up to ``max_capacity`` rows, where it evicts by ``eviction`` policy.
    :meth:`reserve` pre-sizes it for a known number of rows (memory per row and the cost of
    growth: ``docs/memory.md``). In eval mode (``module.eval()``), and under
    ``torch.no_grad()`` or ``torch.inference_mode()`` in either mode (validation without
    ``model.eval()``), lookups change nothing in the table: no insert, no eviction, no
    LRU/LFU score; unknown ids read the initializer's value (``unknown="init"``) or zeros
    (``unknown="zeros"``). Eval-mode lookups do not train the table either (per-sample
    weights still get their gradient).

    The rows are not parameters: the sparse gradient a backward pass leaves waits in the
    table until :meth:`step`, which a torch optimizer over ``model.parameters()`` never
    calls. A training lookup raises ``RuntimeError`` when a torch optimizer stepped while
    the table's gradient waited (the loop went round without stepping the table: use
    :class:`veloce.optim.CombinedOptimizer`, or call :meth:`step` after the dense step),
    or when ``max_pending_backwards`` (1024) backward passes wait already (each keeps its
    lookup's ids and output gradient in memory); accumulating over several backward passes
    before one step is fine. :meth:`zero_grad` (and
    :class:`veloce.optim.CombinedOptimizer`'s) drops it; ``model.zero_grad()`` and a dense
    optimizer's ``zero_grad()`` do not, and ``requires_grad_(False)`` does not freeze the
    table (look it up in eval mode instead, or do not step it). ``torch.nn.utils.
    clip_grad_norm_`` cannot see the gradient: it raises while one waits, and
    :func:`veloce.clip_grad_norm_` clips the dense gradients and the tables' together. A
    backward pass that accumulates only into what it is asked for (``torch.autograd.grad``,
    ``backward(inputs=...)``) gives the table nothing, as it leaves an
    ``nn.EmbeddingBag``'s ``weight.grad`` alone (tables sharded by
    :class:`veloce.distributed.HybridParallel` take every pass's gradient).

    Args:
        embedding_dim: D.
        mode: "sum", "mean" or "max" (default "mean", like ``nn.EmbeddingBag``). "max"
            takes each column's max over the bag (empty bags give zeros) and sends each
            column's gradient to the row that held the max; it takes no
            per_sample_weights and is not sharded by HybridParallel.
        capacity: initial slots (rounded up to a power of two >= 32).
        max_capacity: the most rows the table holds: ``len(self)`` never exceeds it (its
            slots grow to about 1.25 per row at most); None = no bound.
        eviction: what a new id does at ``len(self) == max_capacity``: "lru" / "lfu"
            evict the least recently / frequently used row of its two buckets, "none"
            raises :class:`veloce.table.TableFullError`; or a :mod:`veloce.eviction`
            policy object: ``veloce.eviction.TTL(steps=N)`` also erases the rows that
            ``N`` training lookups went by without, full or not (``docs/eviction.md``).
        initializer: a :mod:`veloce.init` spec; default ``normal(std=0.01)``.
        optimizer: a :mod:`veloce.optim` sparse optimizer; default ``Adagrad(lr=0.05)``.
        padding_idx: an id that is skipped (contributes nothing, not counted by mean,
            never inserted), like ``nn.EmbeddingBag``'s ``padding_idx``.
        include_last_offset: as ``nn.EmbeddingBag``.
        seed: initializer seed.
        dtype: row dtype (float32; float64, float16, bfloat16 also work).
        device: where the table lives.
        unknown: eval-mode value of ids not in the table: "init" or "zeros".
        nonfinite_grad: what :meth:`step` does with NaN/Inf gradients (of a bag's
            pooled output, or a NaN/Inf per-sample weight in it): "raise"
            (default; nothing is applied), "raise_next" (nothing is applied either, but
            step() does not wait for the check: the update skips itself on the device, and
            the next step() raises; see :meth:`step`), "skip" (those rows are not updated)
            or "apply".
        defer_inserts: a training lookup does not wait for its insert to report how many
            ids it inserted (on CUDA a host sync that leaves the GPU idle while the host
            queues the rest of the step; the CPU gains nothing but behaves alike). The
            counts are read later, at the latest by the next :meth:`step` (through
            :class:`veloce.optim.CombinedOptimizer` too), before anything is applied. What
            changes: bad ``offsets`` raise there instead of in the forward (that forward's
            lookup of this table read zeros, its gradient is dropped, and the table is
            unchanged but for its LRU clock tick); and an insert that finds no room (rare:
            a call defers only while the table's size plus the ids of this call and of the
            calls not read yet stay within ``grow_at * capacity``) drops that step's lookup
            of this table the same way, with a warning, and the table grows. A table at
            least half way to ``grow_at`` that a call would take past it grows first (one
            doubling early). A call waits as before when the bound does not hold otherwise
            (a batch with more ids than ``grow_at * capacity``, or than the room left in a
            table less than half way there), when the call could take the table past
            ``max_capacity`` rows (it may evict), or under
            ``torch.use_deterministic_algorithms``; tables sharded by
            :class:`veloce.distributed.HybridParallel` always wait (an owner's failure
            must stop every rank). A refusal is raised by whatever reads the counts first
            (``step()``, ``len()``, ``erase()``, saving a checkpoint). Default False: every
            error in the forward that caused it.
        per_rank: each rank of a multi-process run trains a table of its own on purpose.
            Without it, a training lookup of a table that HybridParallel did not shard
            raises while ``torch.distributed`` runs more than one rank: under
            ``DistributedDataParallel`` (which synchronises parameters only, and the rows
            are not parameters) each rank's copy would drift apart unnoticed. Use
            :class:`veloce.distributed.HybridParallel` to train one table over the ranks.
            A per-rank table is checkpointed from rank 0 (``veloce.checkpoint``).

    Differences from ``nn.EmbeddingBag`` (README's "Differences from nn.EmbeddingBag"):
    no ``num_embeddings`` (the first argument is ``embedding_dim``), no ``.weight`` (see
    :meth:`find`, :meth:`insert`, :meth:`export`, :meth:`from_pretrained`), no
    ``max_norm``, ``norm_type``, ``scale_grad_by_freq`` or ``sparse`` arguments, and no
    TorchScript.

    Shape:
        - input: (N,) with ``offsets`` (B,) (or (B+1,) with ``include_last_offset``),
          or (B, L) with ``offsets=None``.
        - per_sample_weights: like input (sum mode only).
        - output: (B, D).

    Example::

        emb = veloce.DynamicEmbedding(16, mode="sum", optimizer=veloce.optim.Adagrad(lr=0.05))
        out = emb(torch.tensor([3, -7, 2**62, 3]), offsets=torch.tensor([0, 2]))  # (2, 16)
        out.sum().backward()
        emb.step(); emb.zero_grad()
    """

    def __init__(
        self,
        embedding_dim: int,
        mode: str = "mean",
        capacity: int = 1024,
        max_capacity: Optional[int] = None,
        eviction: str | EvictionPolicy = "lru",
        initializer: Optional[_init.Initializer] = None,
        optimizer: Optional[_optim.SparseOptimizer] = None,
        padding_idx: Optional[int] = None,
        include_last_offset: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        unknown: str = "init",
        nonfinite_grad: str = "raise",
        defer_inserts: bool = False,
        per_rank: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if isinstance(mode, int) and not isinstance(mode, bool):
            # nn.EmbeddingBag(num_embeddings, embedding_dim)'s order: the second int is the dim
            raise TypeError(
                f"DynamicEmbedding({embedding_dim}, {mode}): the second argument is mode, got the int {mode}. "
                f"DynamicEmbedding has no num_embeddings (the table grows with the ids it sees): where you had "
                f"nn.EmbeddingBag({embedding_dim}, {mode}), write DynamicEmbedding({mode}) (capacity={embedding_dim} "
                f"pre-sizes the table, max_capacity={embedding_dim} bounds it)"
            )
        if mode not in _POOLINGS:
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if unknown not in _UNKNOWN:
            raise ValueError(f"unknown must be 'init' or 'zeros', got {unknown!r}")
        if nonfinite_grad not in _NONFINITE:
            raise ValueError(f"nonfinite_grad must be one of {_NONFINITE}, got {nonfinite_grad!r}")
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be a floating dtype (float32, float64, float16, bfloat16), got {dtype}")
        if padding_idx is not None and not is_int64(padding_idx):
            raise ValueError(f"padding_idx must be an int64 id or None, got {padding_idx!r}")
        initializer = _init.normal(std=0.01) if initializer is None else initializer
        optimizer = _optim.Adagrad(lr=0.05) if optimizer is None else optimizer
        if not isinstance(initializer, _init.Initializer):
            raise TypeError(f"initializer must come from veloce.init, got {type(initializer).__name__}")
        if not isinstance(optimizer, _optim.SparseOptimizer):
            raise TypeError(f"optimizer must come from veloce.optim (SGD, Adagrad, ...), got {type(optimizer).__name__}")
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.padding_idx = None if padding_idx is None else int(padding_idx)
        self.include_last_offset = include_last_offset
        self.optimizer = optimizer
        self.unknown = unknown
        self.nonfinite_grad = nonfinite_grad
        self.per_rank = bool(per_rank)
        self._frozen = False
        self.table = HashTable(
            embedding_dim, optimizer.state_dim(embedding_dim), capacity=capacity, max_capacity=max_capacity,
            eviction=eviction, initializer=initializer, seed=seed, dtype=dtype, device=device,
            init_state=optimizer.initial_state(embedding_dim),
        )  # fmt: skip
        self.table.defer = bool(defer_inserts)
        self._steps = 0  # sparse optimizer steps applied (Adam's t): step_count
        # nonfinite_grad="raise_next": the check of the last step() while unread, and the
        # error it found once read (raised by the next step()).
        self._verdict: Optional[_DeferredCheck] = None
        self._nonfinite_error: Optional[FloatingPointError] = None
        # Inputs of the backward passes since the last step (gradient accumulation).
        self._pending: list[_Pending] = []
        self._last_lr: Optional[float] = None  # the learning rate of the last step()
        self._had_backward = False  # a backward pass reached the table since the last step()
        # Backward passes whose gradient waits for step(), and the torch optimizer steps made
        # when the first arrived (None: none waits); see _check_unapplied.
        self._unapplied_passes = 0
        self._unapplied_since: Optional[int] = None
        # Row-wise sharding across ranks (set by veloce.distributed.HybridParallel).
        self._shard: Optional[Any] = None
        _LIVE.add(self)
        self._handle = _compile.register(self)  # how a compiled graph's lookup op finds this module

    # Bookkeeping set on every training step (see PlainAttrs).
    _PLAIN_ATTRS = frozenset({"_steps", "_verdict", "_nonfinite_error", "_pending", "_last_lr", "_had_backward",
                              "_unapplied_passes", "_unapplied_since"})  # fmt: skip

    #: Backward passes whose gradient may wait for :meth:`step` (gradient accumulation):
    #: a training lookup past it raises. Each waiting pass keeps its lookup's ids and
    #: output gradient in memory. Settable per table or on the class.
    max_pending_backwards: int = 1024

    @property
    def table(self) -> HashTable:
        """The :class:`~veloce.table.HashTable` holding the rows (a submodule). Read on
        every host path of a step, many times per table: this property finds it directly,
        where nn.Module's attribute fallback would search parameters, buffers and modules
        (about 10% of a 26-table sharded step's host time on a CPU)."""
        try:
            return self._modules["table"]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'table'") from None

    @property
    def defer_inserts(self) -> bool:
        """Whether training inserts defer their read-back (see the class docstring); settable."""
        return self.table.defer

    @defer_inserts.setter
    def defer_inserts(self, value: bool) -> None:
        self.table.defer = bool(value)

    @property
    def frozen(self) -> bool:
        """Whether the table is frozen (``from_pretrained(..., freeze=True)``): it stays in
        eval mode whatever ``train()`` says, so its lookups never insert and never leave a
        gradient for :meth:`step` (per-sample weights still get theirs), as an
        ``nn.EmbeddingBag`` whose weight does not require grad. Settable; unfreezing leaves
        the table in eval mode until the next ``train()``."""
        return self._frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = bool(value)
        if self._frozen:
            self.train(False)

    def train(self, mode: bool = True) -> "DynamicEmbedding":
        """``nn.Module.train``; a :attr:`frozen` table stays in eval mode."""
        return super().train(bool(mode) and not self._frozen)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        ids: Optional[torch.Tensor] = None,
        freeze: bool = True,
        **kwargs: Any,
    ) -> "DynamicEmbedding":
        """A table holding given rows, like ``nn.EmbeddingBag.from_pretrained``.

        Args:
            embeddings: the rows, one per id; its second dim is the embedding dim.
            ids: the id of each row; default ``arange(N)``, so that ids index
                ``embeddings`` as they index an ``nn.EmbeddingBag``'s weight.
            freeze: the table never changes in training (:attr:`frozen`): lookups read
                the given rows and never insert; an id not among ``ids`` reads what
                ``unknown`` says (the initializer's row, or zeros with
                ``unknown="zeros"``). With ``freeze=False`` the rows are trained and new
                ids are inserted as in any table. Default True, as ``nn.EmbeddingBag``'s.
            **kwargs: the constructor's other arguments (``mode``, ``optimizer``,
                ``unknown``, ``padding_idx``, ``device``, ...). ``capacity`` defaults to
                room for the given rows; ``dtype`` to that of ``embeddings`` (if floating).

        Returns:
            The table, in training mode unless frozen; the rows start with zero optimizer
            state.

        Shape:
            - embeddings: (N, D); ids: (N,), distinct.

        Example::

            glove = torch.randn(1000, 50)
            emb = veloce.DynamicEmbedding.from_pretrained(glove, mode="sum")  # frozen
            out = emb(torch.tensor([[1, 2], [3, 999]]))                         # (2, 50)
        """
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2 or not embeddings.is_floating_point():
            got = f"shape {tuple(embeddings.shape)}, dtype {embeddings.dtype}" if isinstance(embeddings, torch.Tensor) \
                else type(embeddings).__name__  # fmt: skip
            raise ValueError(f"from_pretrained: embeddings must be a 2-D floating-point tensor (N, D), got {got}")
        n = embeddings.shape[0]
        if ids is None:
            ids = torch.arange(n, device=embeddings.device)
        if not isinstance(ids, torch.Tensor) or ids.shape != (n,) or ids.dtype not in (torch.int64, torch.int32):
            got = f"shape {tuple(ids.shape)}, dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"from_pretrained: ids must be an int64 tensor of shape ({n},) (one id per row), got {got}")
        if ids.unique().numel() != n:
            raise ValueError("from_pretrained: ids must be distinct (one row per id)")
        if "dtype" not in kwargs and embeddings.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            kwargs["dtype"] = embeddings.dtype
        kwargs.setdefault("capacity", max(1024, int(n / 0.85) + 1))  # below the growth threshold (grow_at 0.9)
        emb = cls(embeddings.shape[1], **kwargs)
        emb.insert(ids, embeddings.detach())
        emb.frozen = bool(freeze)
        return emb

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            hint = _NOT_EMBEDDING_BAG.get(name)
            if hint is None:
                raise
            raise AttributeError(f"'DynamicEmbedding' object has no attribute {name!r}: {hint}") from None

    def __prepare_scriptable__(self) -> NoReturn:
        # torch.jit.script calls this on every submodule before compiling it: a clear
        # refusal instead of an annotation error from deep inside the table's code.
        raise RuntimeError(
            "DynamicEmbedding does not support TorchScript (torch.jit.script): its lookups insert into a hash "
            "table that grows and route gradients outside autograd. Use the module eagerly, or torch.compile "
            "it (see docs/ops.md); to serve lookups without Python, export the rows (export()) into an "
            "nn.EmbeddingBag over a dict of ids"
        )

    @property
    def step_count(self) -> int:
        """Sparse optimizer steps applied (Adam's t). With nonfinite_grad="raise_next",
        reading it first reads the last step's check (a step whose gradient held NaN/Inf
        was not applied and does not count)."""
        self._settle_check()
        return self._steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        # A value set from outside (a restore) replaces the last step's bookkeeping: a check
        # of that step read later must not roll it back, nor raise for it.
        self._drop_verdict()
        self._steps = value

    def __getstate__(self) -> dict[str, Any]:
        # copy.deepcopy / pickle: the last step's check read first (it holds CUDA events).
        self._settle_check()
        return super().__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Modules pickled before step_count became a property kept it as a plain attribute.
        if "step_count" in state:
            state = dict(state)
            state["_steps"] = state.pop("step_count")
        state.setdefault("_verdict", None)
        state.setdefault("_nonfinite_error", None)
        state.setdefault("per_rank", False)
        state.setdefault("_frozen", False)
        state.setdefault("_unapplied_passes", 0)
        state.setdefault("_unapplied_since", None)
        super().__setstate__(state)
        _LIVE.add(self)
        # A copy is another module: a compiled graph of the original must not look it up.
        self._handle = _compile.register(self)

    def _settle_check(self) -> None:
        """Reads the last step's unread "raise_next" check, if any (see _DeferredCheck)."""
        if self._verdict is not None:
            self._verdict.settle()

    def _drop_verdict(self) -> None:
        """Before a load replaces the table: settles the last step's check (other tables of
        that step roll back consistently) and forgets its error for this table."""
        self._settle_check()
        self._nonfinite_error = None

    # ---- nn.EmbeddingBag-compatible forward -------------------------------------------
    def forward(
        self,
        input: torch.Tensor,
        offsets: Optional[torch.Tensor] = None,
        per_sample_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Pooled embeddings of ``input`` bags; see the class docstring for shapes."""
        if _compile.is_compiling():  # one opaque op in the graph (veloce._compile)
            return _compile.lookup([self], [(input, offsets, per_sample_weights)], many=False)[0]
        _ext.require()
        training = training_lookup(self)
        if self._shard is not None:
            # The offsets' values are checked with the exchange's header (sharded_lookup).
            deferred: list = []
            with self._shard.abandon_on_error():  # bad input here fails every rank, not just this one
                if training:
                    self._check_unapplied()
                ids, offsets, psw = self._bags(input, offsets, per_sample_weights, deferred=deferred)
            return self._shard.lookup(self, ids, offsets, psw, deferred)
        layouts: list = []
        if not training:
            return self._lookup(*self._bags(input, offsets, per_sample_weights, deferred=layouts), unchecked=layouts)
        if not self.per_rank and _world_size() > 1:
            _refuse_replicated_training(self)
        table = self.table

        def checked_insert():  # on the insert stream while an update is in flight (veloce._update_stream)
            ids, offs, psw = self._bags(input, offsets, per_sample_weights, deferred=layouts)
            slots, check = _insert_checked(
                layouts, [table], lambda bad, refused: table.find_or_insert(ids, self.padding_idx, bad, refused)
            )
            return (ids, check.guard(offs, ids.numel(), self.include_last_offset), psw), slots

        self._check_unapplied()
        bags, slots = insert_beside_updates([table], checked_insert)
        (out,) = _train_lookups([self], [bags], [slots])
        return out

    def _lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        unchecked: Sequence[tuple] = (),
        check: Optional["_LayoutCheck"] = None,
    ) -> torch.Tensor:
        """The local (unsharded) lookup of bags that passed :meth:`_bags`.

        ``unchecked``: the bag layouts whose offsets' values :meth:`_bags` deferred (empty
        when the caller has checked them). In training their check rides on the insert
        (:func:`_insert_checked`: no host sync of its own, and a bad layout raises before
        the table changes); in eval they are read back first. ``check``: in training, the
        check that an earlier insert of the same call carried (lookup_many's table listed
        twice), carried again by this one (its layouts are guarded already)."""
        table = self.table
        if training_lookup(self):
            if check is not None:
                slots = table.find_or_insert(ids, self.padding_idx, check.flag, check.refused)
            else:
                slots, check = _insert_checked(
                    unchecked, [table], lambda bad, refused: table.find_or_insert(ids, self.padding_idx, bad, refused)
                )
                offsets = check.guard(offsets, ids.numel(), self.include_last_offset)
            (out,) = _train_lookups([self], [(ids, offsets, psw)], [slots])
            return out
        _check_offsets_many(unchecked)
        slots, extra = self._eval_slots(ids)
        if self.mode == "max":
            return max_pool(table.weights, slots, offsets, self.include_last_offset, extra)[0]
        # The offsets passed _bags' checks and the slots come from the table: no re-check.
        return torch.ops.veloce.pooled_lookup(
            table.weights, slots, offsets, psw, _MODES[self.mode], self.include_last_offset, extra, False
        )

    def _eval_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        table = self.table
        slots = table.find(ids)
        missing = slots < 0
        if self.padding_idx is not None:
            pad = ids == self.padding_idx
            missing &= ~pad
            slots = slots.masked_fill(pad, -1)
        if not bool(missing.any()):
            return slots, None
        if self.unknown == "zeros":
            return slots.masked_fill(missing, -2), None
        idx = missing.nonzero().squeeze(1)
        init = table.initializer
        extra = torch.ops.veloce.initialize(
            ids[idx], self.embedding_dim, table.seed, init.kind, init.a, init.b, table.dtype
        )
        slots = slots.index_put((idx,), torch.arange(idx.numel(), device=ids.device) + table.capacity)
        return slots, extra

    def _bags(
        self, input: torch.Tensor, offsets: Optional[torch.Tensor], psw: Optional[torch.Tensor],
        deferred: Optional[list] = None, aranges: Optional[dict] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Validates nn.EmbeddingBag-style input and returns (ids (N,), offsets, psw (N,)).

        Checked here, before any lookup, so bad input leaves the table unchanged. The
        offsets' values (a device read) are checked here, or, with ``deferred``, appended
        to it for the caller to check before touching any table: several tables' at once
        (:func:`_check_offsets_many`), or with the insert (:func:`_insert_checked`).
        ``aranges``: a dict in which the offsets made for 2-D inputs are kept and reused
        (read-only) by calls with the same shape: a model's tables share one tensor (and
        one launch) in :func:`lookup_many`."""
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a tensor of int64 ids, got {type(input).__name__}")
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must hold int64 (or int32) ids, got dtype {input.dtype}")
        device = self.table.device
        if input.device != device:
            raise ValueError(f"input is on {input.device} but the table is on {device}; move one of them")
        ids = input.long()
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D (B, L): each row is one bag")
            b, bag_len = ids.shape
            num_offsets = b + int(self.include_last_offset)
            key = (device, num_offsets, bag_len)
            offsets = None if aranges is None else aranges.get(key)
            if offsets is None:
                if bag_len:
                    offsets = torch.arange(0, num_offsets * bag_len, bag_len, device=device)
                else:
                    offsets = torch.zeros(num_offsets, dtype=torch.long, device=device)
                if aranges is not None:
                    aranges[key] = offsets
            if psw is not None and psw.shape != input.shape:
                raise ValueError(
                    f"per_sample_weights must have the shape of input {tuple(input.shape)}, got {tuple(psw.shape)}"
                )
            ids = ids.reshape(-1)
            psw = None if psw is None else psw.reshape(-1)
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError("offsets is required when input is 1-D (the start of each bag in input)")
            if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32):
                got = offsets.dtype if isinstance(offsets, torch.Tensor) else type(offsets).__name__
                raise TypeError(f"offsets must be an int64 (or int32) tensor, got {got}")
            if offsets.dim() != 1:
                raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
            if offsets.device != device:
                raise ValueError(f"offsets is on {offsets.device} but the table is on {device}")
            offsets = offsets.long()
            if deferred is None:
                _check_offsets(offsets, ids.numel(), self.include_last_offset)
            else:
                deferred.append((offsets, ids.numel(), self.include_last_offset))
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D (B, L), got shape {tuple(input.shape)}")
        if psw is not None:
            if self.mode != "sum":
                raise ValueError(f"per_sample_weights is only supported with mode='sum', got mode={self.mode!r}")
            if not isinstance(psw, torch.Tensor) or not psw.is_floating_point():
                raise TypeError("per_sample_weights must be a floating-point tensor")
            if psw.shape != ids.shape:
                raise ValueError(f"per_sample_weights must have shape ({ids.numel()},) like input, got {tuple(psw.shape)}")
            if psw.device != device:
                raise ValueError(f"per_sample_weights is on {psw.device} but the table is on {device}")
            psw = psw.to(self.table.dtype)
        return ids, offsets, psw

    # ---- the sparse optimizer ---------------------------------------------------------
    def _accumulate(self, entry: "_Pending", noted: bool = False) -> None:
        """Keeps one backward pass's inputs until step() (gradient accumulation).
        ``noted``: the pass was counted when it was sent (async gradients in flight)."""
        self._had_backward = True
        if not noted:
            self._note_backward()
        if entry.slots.numel():
            self._pending.append(entry)

    def _note_backward(self) -> None:
        """Counts a backward pass whose gradient waits for step() (pending here, or in
        flight to this shard's rows in async mode), and notes the torch optimizer steps
        made when the first of them arrived (see :meth:`_check_unapplied`)."""
        if self._unapplied_since is None:
            self._unapplied_since = _optim.torch_step_count()
        self._unapplied_passes += 1

    def _forget_gradient(self) -> None:
        """Drops the pending gradient and its bookkeeping (zero_grad, a load, a failed step)."""
        self._pending.clear()
        if self._had_backward:  # each set is a call of PlainAttrs.__setattr__: only when it changes
            self._had_backward = False
        if self._unapplied_since is not None:
            self._unapplied_since = None
            self._unapplied_passes = 0

    def _check_unapplied(self) -> None:
        """Before a training lookup: raises when the gradient waiting for step() shows a
        loop that does not step this table: a torch optimizer stepped since the gradient
        arrived (the table is no parameter of it), or ``max_pending_backwards`` backward
        passes wait already (their inputs are kept until step(): memory grows with each)."""
        since = self._unapplied_since
        if since is None:
            return
        passes = self._unapplied_passes
        if since < _optim.torch_step_count():
            raise RuntimeError(
                f"DynamicEmbedding: a torch optimizer stepped since this table's last backward pass, but the table "
                f"was not stepped: the gradient of {passes} backward pass(es) waits unapplied. Its rows are not "
                f"parameters, so torch.optim optimizers never train them. Step the tables with the dense optimizer: "
                f"opt = veloce.optim.CombinedOptimizer(torch.optim.Adam(model.parameters()), model) (then "
                f"opt.step() and opt.zero_grad() as usual), or call emb.step() (veloce.step_tables(tables)) after "
                f"opt.step(). emb.zero_grad() drops the waiting gradient."
            )  # fmt: skip
        if passes >= self.max_pending_backwards:
            raise RuntimeError(
                f"DynamicEmbedding: {passes} backward passes reached this table since its last step() "
                f"(max_pending_backwards = {self.max_pending_backwards}): each one's inputs are kept until step(). "
                f"Call emb.step() (or veloce.optim.CombinedOptimizer(opt, model).step()) to apply them, or "
                f"emb.zero_grad() to drop them; to accumulate more passes, raise emb.max_pending_backwards."
            )  # fmt: skip

    def _pending_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending gradient per row, what step() applies (weight decay aside): the
        touched slots ``(U,)`` in ascending order and their summed gradients ``(U, D)``
        (an ``nn.EmbeddingBag``'s ``weight.grad`` on those rows)."""
        if not self._pending:
            dev = self.table.device
            return (torch.empty(0, dtype=torch.long, device=dev),
                    torch.empty(0, self.embedding_dim, dtype=self.table.dtype, device=dev))  # fmt: skip
        e = self._merged()
        slots = self._resolved(e) if e.ids is not None else e.slots
        return accumulate_grad(e.grad, slots, e.offsets, e.psw, e.mode, e.include_last_offset, self.table.capacity)

    def _scale_pending(self, factor: torch.Tensor) -> None:
        """Multiplies the pending gradient by ``factor`` (a scalar tensor): each pooled
        gradient, so each row's gradient, which is linear in them (gradient clipping)."""
        self._pending = [e._replace(grad=e.grad * factor.to(e.grad.device, e.grad.dtype)) for e in self._pending]

    def _clamp_pending(self, clip_value: float) -> None:
        """Clamps each row's pending gradient to ``[-clip_value, clip_value]``: the pending
        gradient becomes one batch of one bag per touched row, holding its clamped sum."""
        slots, rows = self._pending_rows()
        if not slots.numel():
            return
        table = self.table
        ids = table.keys[slots]  # for step() to find the rows by id if the table changes first
        offsets = torch.arange(slots.numel(), device=slots.device)
        self._pending = [_Pending(ids, slots, offsets, None, rows.clamp(-clip_value, clip_value), _MODES["sum"], False,
                                  table.version)]  # fmt: skip

    def _resolved(self, entry: "_Pending") -> torch.Tensor:
        """The entry's slots under the current table: re-resolved by id if the table grew,
        evicted or erased since; evicted ids become -2 (no gradient), padding stays -1."""
        if entry.version == self.table.version:
            return entry.slots
        return _reresolve(self.table, entry.ids, entry.slots)

    def _merged(self) -> "_Pending":
        """One batch equivalent to all pending ones: mean bags become sum bags with
        per-position weights 1 / len(bag), offsets are shifted and concatenated."""
        if len(self._pending) == 1:
            return self._pending[0]
        slots, offsets, psw, grads = [], [], [], []
        base = 0
        for e in self._pending:
            s = self._resolved(e)
            o = e.offsets[:-1] if e.include_last_offset else e.offsets
            w = e.psw if e.psw is not None else torch.ones(s.numel(), dtype=e.grad.dtype, device=s.device)
            if e.mode == _MODES["mean"]:
                bag = bag_of(o, s.numel())
                counts = torch.zeros(o.numel(), dtype=e.grad.dtype, device=s.device)
                counts.index_add_(0, bag, (s != -1).to(e.grad.dtype))
                w = w / counts.clamp(min=1)[bag]
            slots.append(s)
            offsets.append(o + base)
            psw.append(w)
            grads.append(e.grad)
            base += s.numel()
        return _Pending(
            ids=None, slots=torch.cat(slots), offsets=torch.cat(offsets), psw=torch.cat(psw),
            grad=torch.cat(grads), mode=_MODES["sum"], include_last_offset=False, version=self.table.version,
        )  # fmt: skip

    @torch.no_grad()
    def step(self, lr: Optional[float] = None) -> None:
        """Applies the sparse optimizer to every row with a pending gradient, then
        forgets the gradient. ``lr`` overrides the configured learning rate (an LR
        scheduler sets it through :class:`veloce.optim.CombinedOptimizer`).

        The gradient of each touched row is summed and applied in one fused pass
        (``torch.ops.veloce.accumulate_and_update``); rows evicted since their forward
        pass get nothing, and a row that moved (growth) is found by its id.

        On CUDA the update is queued on an update stream (:mod:`veloce._update_stream`):
        the next forward's insert runs beside it, and every read of the rows waits for it
        on the device.

        NaN/Inf gradients (``nonfinite_grad``): with "raise", step() waits for the
        device's check of the gradient and raises ``FloatingPointError`` before anything
        is applied (the gradient stays pending). With "raise_next" it does not wait: the
        update is queued behind the check and skips itself on the device when the check
        fails, and the *next* step() raises ``FloatingPointError`` before applying
        anything of its own. The failed step is then not counted (``step_count``) and its
        gradient is gone; the gradient pending at the raise is kept (``zero_grad()`` drops
        it, ``step()`` applies it). On a GPU this saves a wait for the whole backward pass
        in every step. Reading ``step_count``, ``export()`` or ``state_dict()`` reads the
        check first, so they never count a step that was not applied. When one call steps
        tables on several devices, or with a "raise" table, the check is read at once, as
        with "raise". A failed check skips every update of its call, those of "skip" and
        "apply" tables in it too; each of its tables then raises at its next step()."""
        step_tables([self], [lr])

    def _apply_pending(self, lr: Optional[float]) -> None:
        """Applies the pending gradient (its nonfinite_grad check included) and books the step."""
        _raise_deferred([self])
        update = self._prepare_update(lr)
        if update is not None:
            _apply_updates([self], [update])
        self._book(update)

    def _prepare_update(self, lr: Optional[float], known_finite: bool = False) -> Optional["_Update"]:
        """The arguments of the accumulate_and_update that applies the pending gradient
        (learning rate, step count, nonfinite_grad="skip" masking, merged and re-resolved
        pending batches), or None when no row has a pending gradient. ``known_finite``: the
        "raise" check is done by the caller (step_tables). Books nothing: :func:`_apply_updates`
        runs the update, with those of other tables that share its arguments, and
        :meth:`_book` counts the step once it is applied."""
        bad = None if known_finite else self._check_finite()
        if not self._pending:
            return None
        _ext.require()
        if bad is not None:
            self._pending = [_drop_bags(e, b) for e, b in zip(self._pending, bad)]
        e = self._merged()
        slots = self._resolved(e) if e.ids is not None else e.slots
        opt = self.optimizer
        # include_last_offset=True becomes False with the last offset dropped (a view; the
        # offsets passed _bags' checks, so the last one is N): the same bags, and one value
        # of the flag for every table of a grouped call.
        offsets = e.offsets[:-1] if e.include_last_offset else e.offsets
        weights, opt_state = self.table._rows()
        # The step count as step_count reads it: both callers read the last step's check
        # first (_raise_deferred), so there is none left to read.
        return _Update(
            weights, opt_state, e.grad, slots, offsets, e.psw, e.mode, opt.kind, float(opt.lr if lr is None else lr),
            tuple(opt.hyperparameters()), float(opt.weight_decay), self._steps + 1, lr,
        )  # fmt: skip

    def _book(self, update: Optional["_Update"]) -> None:
        """Counts a step once its update is applied (``update``), or when there was nothing
        to apply (None), and forgets the applied gradient. Sets only the attributes that
        change: each set is a call of PlainAttrs.__setattr__, for every table in every step."""
        if self._unapplied_since is not None:  # (async gradients in flight are the next steps' to apply)
            self._unapplied_since = None
            self._unapplied_passes = 0
        if update is None:
            # A gradient over no rows (a lookup of no ids, or a shard that received none)
            # still counts as a step, as for torch's SparseAdam: every shard of a table
            # keeps the step count of one process.
            if self._had_backward:
                self._steps += 1
                self._had_backward = False
            return
        self._pending.clear()
        self._steps = update.step
        if self._last_lr is not update.requested_lr:
            self._last_lr = update.requested_lr
        if self._had_backward:
            self._had_backward = False

    def _check_finite(self) -> Optional[list[torch.Tensor]]:
        """The nonfinite_grad policy on the pooled gradients (one reduction each). "raise"
        raises (on every rank of a sharded table: the ranks agree first, so none is left
        waiting in the next exchange); "skip" returns per pending entry the bags to drop
        (None when every gradient is finite)."""
        if self.nonfinite_grad == "apply":
            return None
        bad: list[torch.Tensor] = []
        num_bad = 0
        n = len(self._pending)
        tensors, owner = _checked_tensors(self._pending)
        flags = _ops.nonfinite_flags(tensors, owner, n).tolist() if n else []
        for e, flagged in zip(self._pending, flags):  # one read-back for all pending gradients
            b = torch.zeros(e.grad.shape[0], dtype=torch.bool, device=e.grad.device)
            if flagged:
                b = _nonfinite_bags(e)
                num_bad += int(b.sum())
            bad.append(b)
        if self.nonfinite_grad in _CHECKED:
            where = "its"
            if self._shard is not None:
                num_bad, where = self._shard.agree(num_bad), "this table's (over all ranks)"
            if num_bad:
                raise FloatingPointError(
                    f"DynamicEmbedding.step: {where} gradient of {num_bad} bag(s) holds NaN or Inf; nothing was "
                    f"applied. Call zero_grad() to drop it, or construct with nonfinite_grad='skip' to drop such "
                    f"bags' gradients." + _float16_exchange_hint([self])
                )
            return None
        return bad if num_bad else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the pending sparse gradient (and dense grads of submodules, if any)."""
        self._forget_gradient()
        # nn.Module.zero_grad walks every parameter of every submodule: only where there may
        # be some (a subclass's own, or submodules beside the table), once per table per step.
        table = self.table
        if self._parameters or table._parameters or (
            len(self._modules) > 1 and any(m is not table for m in self.children())
        ):
            super().zero_grad(set_to_none=set_to_none)

    # ---- table access -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.table)

    @property
    def capacity(self) -> int:
        """Slots currently allocated."""
        return self.table.capacity

    @property
    def max_capacity(self) -> Optional[int]:
        """The most rows the table holds (``len(self)`` never exceeds it), or None."""
        return self.table.max_capacity

    @property
    def load_factor(self) -> float:
        """len(self) / capacity."""
        return self.table.load_factor

    def reserve(self, n: int) -> None:
        """Pre-sizes the table for ``n`` rows in one rehash, so that training up to ``n``
        rows never grows it. Growing from the default capacity rehashes every row at each
        doubling and holds the old and the new slots at once (``docs/memory.md`` measures
        it); a table that will hold millions of rows is best reserved once. It never
        shrinks the table. On a table sharded by
        :class:`veloce.distributed.HybridParallel`, ``n`` is this rank's rows.

        Raises:
            ValueError: ``n`` is negative or more than ``max_capacity``.
        """
        self.table.reserve(n)

    @torch.no_grad()
    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` without inserting: weights (N, D) (zeros where absent) and found (N,) bool."""
        ids = self._check_ids(ids, "ids")
        slots = self.table.find(ids)
        found = slots >= 0
        rows = self.table.weights[slots.clamp(min=0)]
        return rows.masked_fill(~found.unsqueeze(1), 0), found

    @torch.no_grad()
    def insert(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Writes rows (insert_or_assign): ``weights`` (N, D) for ``ids`` (N,). New rows get
        zero optimizer state; existing rows keep theirs. On a table sharded by
        ``HybridParallel`` this writes this rank's shard, so every id must be one this
        rank owns (``veloce.distributed.owner_of(ids, world_size) == rank``)."""
        ids = self._check_ids(ids, "ids")
        if self._shard is not None:
            self._check_owned(ids)
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise TypeError(f"weights must be a floating-point tensor, got {got}")
        if weights.shape != (ids.numel(), self.embedding_dim):
            raise ValueError(f"weights must have shape ({ids.numel()}, {self.embedding_dim}), got {tuple(weights.shape)}")
        self.table.insert(ids, weights.to(self.table.device, self.table.dtype))

    @torch.no_grad()
    def erase(self, ids: torch.Tensor) -> int:
        """Removes ``ids`` from the table; returns how many were present."""
        return self.table.erase(self._check_ids(ids, "ids"))

    @torch.no_grad()
    def export(self) -> dict[str, torch.Tensor]:
        """All that restores the table: keys (M,), weights (M, D), optimizer_state (M, S),
        scores (M,), in slot order, plus step (the sparse optimizer's step count)."""
        out = self.table.export()
        out["step"] = torch.tensor(self.step_count, dtype=torch.long)
        return out

    def _check_owned(self, ids: torch.Tensor) -> None:
        from veloce.ops.exchange import owner_of

        rank, world = self._shard.group.rank, self._shard.group.size
        foreign = (owner_of(ids, world) != rank).nonzero()
        if foreign.numel():
            i = int(foreign[0, 0])
            raise ValueError(
                f"ids[{i}] = {int(ids[i])} belongs to rank {int(owner_of(ids[i : i + 1], world))}, not to this "
                f"rank ({rank}) of this sharded table; insert each id on its owner "
                f"(veloce.distributed.owner_of(ids, {world}) == rank). {foreign.numel()} id(s) are not this rank's."
            )

    def _check_ids(self, ids: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"{name} must be an int64 tensor of ids, got {got}")
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        return ids.to(self.table.device, torch.long)

    # ---- state_dict: compact entries, any table size ----------------------------------
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self.export().items():
            destination[prefix + name] = value
        destination[prefix + "clock"] = torch.tensor(self.table.clock, dtype=torch.long)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        names = ("keys", "weights", "optimizer_state", "scores", "step", "clock")
        if strict:  # keys of this module that it does not know (a child's are the child's to judge)
            unexpected_keys.extend(
                k for k in state_dict
                if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0] not in (*names, *self._modules)
            )  # fmt: skip
        missing = [prefix + n for n in names if prefix + n not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        counters = {}
        for n in ("step", "clock"):  # checked before the table changes
            v = state_dict[prefix + n]
            if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype in (torch.int64, torch.int32):
                v = int(v)
            if type(v) is not int or v < 0:
                got = f"{v.dtype} tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
                error_msgs.append(f"while loading DynamicEmbedding {prefix!r}: {n} must be an int >= 0, got {got}")
                return
            counters[n] = v
        entries = {n: state_dict[prefix + n] for n in names[:4]}
        if self._shard is not None and isinstance(entries["keys"], torch.Tensor) and entries["keys"].dim() == 1:
            entries = self._owned_entries(entries)
        try:
            self.table.load_entries(entries)
        except ValueError as exc:
            error_msgs.append(f"while loading DynamicEmbedding {prefix!r}: {exc}")
            return
        self.step_count = counters["step"]  # drops the last step's unread check
        self.table.clock = counters["clock"]
        self._forget_gradient()  # a backward before the load books no step after it

    def _owned_entries(self, entries: dict[str, Any]) -> dict[str, Any]:
        """The entries of the ids this rank owns, on a table sharded by HybridParallel: a
        state dict of the whole table (one process's, or every shard's gathered) loads on
        every rank, each keeping its own rows, as ``veloce.checkpoint.load`` does. Without
        it each shard kept every row, and the next checkpoint's shards overlapped."""
        from veloce.ops.exchange import owner_of

        keys = entries["keys"]
        mine = owner_of(keys.to(self.table.device, torch.long), self._shard.group.size).to(keys.device)
        mine = mine == self._shard.group.rank
        return {n: (v[mine] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == keys.shape[0] else v)
                for n, v in entries.items()}  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer}, {self.table._size_text()}"


def step_tables(tables: Sequence["DynamicEmbedding"], lrs: Optional[Sequence[Optional[float]]] = None) -> None:
    """``t.step(lr)`` for every table, with one device read-back for all of them and one
    fused update per group of alike tables.

    The ``nonfinite_grad="raise"`` check of every table reduces on the device into one
    flag per table (for sharded tables summed over their ranks in one all-reduce per
    process group), read back in one copy: a step over K tables waits for the device once
    instead of K times. When the tables share one device, the updates do not wait for that
    read: they are queued behind the check, each op carrying "some flag is set" as its
    ``skip`` argument, and the host reads the flags while the GPU runs them. A table whose
    flag is set takes the per-table path, which counts its bad bags and raises; nothing is
    applied to any table (the queued updates skipped themselves on the device). Every rank
    must step its sharded tables in the same calls and order.

    The updates themselves are grouped: tables on one device with the same dtype, embedding
    dim, pooling of their pending gradient, optimizer kind and hyperparameters, learning
    rate, weight decay and (Adam) step count are applied by one
    ``torch.ops.veloce.accumulate_and_update_many`` call (on CUDA one sort and one fused
    kernel for all of them, instead of about a dozen launches per table). The result is
    that of stepping each table alone, bit for bit. A table listed twice is stepped once.
    :class:`veloce.optim.CombinedOptimizer` steps its tables this way.
    """
    lrs = [None] * len(tables) if lrs is None else list(lrs)
    if len(lrs) != len(tables):
        raise ValueError(f"step_tables: {len(tables)} tables but {len(lrs)} learning rates")
    # The last step's "raise_next" check first, before anything of this step (async
    # gradients stay in flight: zero_grad() after the error does not drop them; an owner's
    # deferred lookup failure drops the failed step's, see HybridParallel(lookup_errors=)).
    _raise_deferred(tables)
    for t in tables:
        if t._shard is not None:
            t._shard.collect(t)  # gradients other ranks sent for this shard's rows
    once: dict[int, tuple[DynamicEmbedding, Optional[float]]] = {}  # stepping a table again finds nothing
    for t, lr in zip(tables, lrs):
        once.setdefault(id(t), (t, lr))
    tables, lrs = [t for t, _ in once.values()], [lr for _, lr in once.values()]
    checked = [t for t in tables if t.nonfinite_grad in _CHECKED]
    check = _FiniteCheck(checked)
    # On one device the updates are queued behind the check with its result as their skip
    # flag, and the host reads that result afterwards: it waits for the check, not for the
    # updates, and the GPU never idles between them. Otherwise the result is read first.
    skip = check.skip_flag({t.table.device for t in tables})
    capture = _capture.ACTIVE
    if skip is None and checked and capture is not None:
        raise RuntimeError(
            "veloce: a step over tables on several devices cannot be captured in a CUDA graph: its NaN/Inf check "
            "is read before the updates; capture each device's tables in a step of their own"
        )
    if skip is None:
        _raise_nonfinite(tables, check.result())
    updates = [t._prepare_update(lr, known_finite=t.nonfinite_grad in _CHECKED) for t, lr in zip(tables, lrs)]
    ready = [i for i, u in enumerate(updates) if u is not None]
    applied: list[int] = []  # indices into ready, of the updates whose op call returned
    try:
        _apply_updates([tables[i] for i in ready], [updates[i] for i in ready], skip, applied)
    except BaseException:
        # (a captured step reads no check: its capture fails, and nothing was booked)
        if capture is None and (skip is None or all(check.result().values())):  # the calls that ran did apply
            for j in applied:
                tables[ready[j]]._book(updates[ready[j]])
        raise
    # "raise_next" alone: the host does not read the check now. Every update carried its
    # flag, so if it failed nothing was applied: reading it later rolls the booking back.
    # A captured step reads every check so (veloce.graphs reads each replay's).
    deferred = skip is not None and (capture is not None or all(t.nonfinite_grad == "raise_next" for t in checked))
    if skip is not None and not deferred and not all(check.result().values()):
        # Nothing was applied (every call carried the set flag): raise, before any booking.
        _raise_nonfinite(tables, check.result())
    if capture is not None:
        if checked:
            capture.checks.append(_capture.CheckLog(check, list(tables)))
        for t, u in zip(tables, updates):
            capture.requested_lr[id(t)] = None if u is None else u.requested_lr
    verdict = _DeferredCheck(check, tables) if deferred and checked and capture is None else None
    for t, u in zip(tables, updates):
        t._book(u)
    if verdict is not None:
        for t in tables:
            t._verdict = verdict


def _float16_exchange_hint(tables: Sequence["DynamicEmbedding"]) -> str:
    """A sentence for a NaN/Inf gradient error when some of ``tables`` receive their
    gradients in float16 (``HybridParallel(exchange_dtype=torch.float16)``), else ''."""
    if not any(t._shard is not None and t._shard.exchange_dtype == torch.float16 for t in tables):
        return ""
    return (" The gradients travel between ranks in float16 (HybridParallel(exchange_dtype=torch.float16)), "
            "which overflows above 65504: torch.bfloat16 keeps float32's range.")  # fmt: skip


class _DeferredCheck:
    """The nonfinite_grad="raise_next" check of one step_tables call, read when needed.

    Every update of that call was queued with the check's result as its skip flag, so a
    failed check applied nothing: :meth:`settle` then puts every table's step count and
    last learning rate back to what they were before the call and leaves the error for its
    next step(). Sharded tables' flags are summed over the ranks, so every rank reads the
    same result and raises in the same step()."""

    def __init__(self, check: "_FiniteCheck", tables: Sequence["DynamicEmbedding"]) -> None:
        self.check = check
        # Read before booking; step_tables read every table's last check first, so _steps
        # is what step_count would read.
        self.before = [(t, t._steps, t._last_lr) for t in tables]

    def settle(self) -> None:
        finite = self.check.result()  # the device finished this check long ago, as a rule
        flagged = sum(not ok for ok in finite.values())
        error = None
        if flagged:
            error = FloatingPointError(
                f"DynamicEmbedding.step: the gradient of the previous step() held NaN or Inf in {flagged} of its "
                f"{len(finite)} checked table(s) (nonfinite_grad='raise_next' reads the device's check one step "
                f"late); nothing of that step was applied and its gradient was dropped. The gradient pending now "
                f"was not applied either: call zero_grad() to drop it, or step() to apply it."
                + _float16_exchange_hint([t for t, _, _ in self.before])
            )  # fmt: skip
        for t, steps, lr in self.before:
            if t._verdict is not self:  # settled already, or a load replaced the table since
                continue
            t._verdict = None
            if error is not None:
                t._steps, t._last_lr, t._nonfinite_error = steps, lr, error


def _raise_deferred(tables: Sequence["DynamicEmbedding"]) -> None:
    """Raises the error a "raise_next" check of an earlier step found in any of ``tables``
    (each table's error is raised once), or an owner's failure of a sharded lookup that
    ``HybridParallel(lookup_errors="raise_next")`` deferred. Reads the counts of the
    tables' deferred inserts first (``defer_inserts``): bad offsets they refused raise."""
    from veloce.distributed._comm import raise_deferred_failures  # veloce.distributed imports this module

    groups = {id(t._shard.group): t._shard.group for t in tables if t._shard is not None}
    for group in groups.values():
        raise_deferred_failures(group)
    for t in tables:  # deferred inserts: a refused one (bad offsets) raises here, before anything is applied
        if t.table._unread:
            t.table.settle()
    error = None
    for t in tables:
        t._settle_check()
        if t._nonfinite_error is not None:
            error, t._nonfinite_error = error or t._nonfinite_error, None
    if error is not None:
        raise error


def _raise_nonfinite(tables: Sequence["DynamicEmbedding"], finite: dict[int, bool]) -> None:
    """Every table whose "raise" check flagged its gradient counts its bad bags (a sharded
    one agrees with its peers) and raises, before anything is applied: an error in one
    table applies no other, and no rank skips an agreement another rank waits in."""
    error: Optional[FloatingPointError] = None
    for t in tables:
        if not finite.get(id(t), True):
            try:
                t._check_finite()
            except FloatingPointError as e:
                error = error or e
    if error is not None:
        raise error
    if not all(finite.values()):  # the flags and the per-table count test the same bits
        raise AssertionError("step_tables: a gradient was flagged NaN/Inf, but its table found no such bag")


class _Update(NamedTuple):
    """A table's accumulate_and_update arguments for one step (DynamicEmbedding._prepare_update)."""

    weights: torch.Tensor
    opt_state: torch.Tensor
    grad: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor  # include_last_offset=False
    psw: Optional[torch.Tensor]
    mode: int
    kind: int
    lr: float
    hyper: tuple[float, ...]  # the optimizer's own hyperparameters (SparseOptimizer.hyperparameters)
    weight_decay: float
    step: int  # the table's step count once this update is applied
    requested_lr: Optional[float]  # step()'s lr argument (None: the optimizer's own)

    def group_key(self) -> tuple:
        """Updates with equal keys share every scalar argument of one
        accumulate_and_update_many call (and its device, dtype and dim). Only Adam reads
        the step count (its bias correction), so other optimizers group across step counts.

        The pooling mode is part of the key rather than converted: turning a mean pooled
        gradient into sum with per-sample weights 1 / len(bag) would cost several launches
        per table (what grouping saves) and round those weights to the row dtype (not bit
        for bit the mean update for float16 / bfloat16). Tables of a model usually share
        one mode."""
        w = self.weights
        step = self.step if self.kind == _optim.Adam.kind else 0
        return (w.device, w.dtype, w.shape[1], self.mode, self.kind, self.lr, self.hyper, self.weight_decay, step)

    def hparams(self) -> list[float]:
        """The ops' hyperparameter vector: ``[lr, step, weight_decay, *hyper]``."""
        return [self.lr, float(self.step), self.weight_decay, *self.hyper]


def _apply_updates(
    tables: Sequence["DynamicEmbedding"], updates: Sequence[_Update], skip: Optional[torch.Tensor] = None,
    applied: Optional[list[int]] = None,
) -> None:
    """Runs the prepared updates of ``tables`` (one each): those with equal group keys in
    one accumulate_and_update_many, a lone one in accumulate_and_update, every call with
    the ``skip`` flag. Appends to ``applied`` the index of each update whose call
    returned (the caller books them: :meth:`DynamicEmbedding._book`). The offsets passed
    _bags' checks and the slots come from the tables: no input checks (on CUDA, no host
    sync)."""
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        groups.setdefault(u.group_key(), []).append(i)
    calls: list[list[int]] = []
    for idx in groups.values():
        # Modules sharing one table's rows take separate calls, in order: the k-th update of
        # a table goes to the k-th call.
        batches: list[list[int]] = []
        seen: dict[int, int] = {}  # weights' data_ptr -> updates of that table so far
        for i in idx:
            ptr = updates[i].weights.data_ptr()
            k = seen.get(ptr, 0)
            seen[ptr] = k + 1
            if k == len(batches):
                batches.append([])
            batches[k].append(i)
        calls.extend(batches)
    for idx in calls:
        group = [updates[i] for i in idx]
        # On CUDA the update runs on the update stream: the next step's insert does not wait
        # for it (veloce._update_stream). The fence keeps the inputs alive until the stream they
        # came from waited for it, or it has run.
        # A captured step reads its hyperparameters from the device tensor it advances (veloce.graphs).
        hparams = None if _capture.ACTIVE is None else _capture.ACTIVE.hparams_of([tables[i] for i in idx])
        fence = run_update(group[0].weights.device, functools.partial(_launch_update, group, skip, hparams),
                           (group, skip))  # fmt: skip
        if fence is not None:
            for i in idx:
                tables[i].table._update_fence = fence
        if applied is not None:  # a failed call leaves its tables' steps pending
            applied.extend(idx)


# The hyperparameter tensors of the eager updates: one per (device, optimizer), refreshed in
# place by each call on the stream that runs it.
_HPARAMS = _ops.HyperparameterBuffer()


def _launch_update(group: Sequence[_Update], skip: torch.Tensor | None, hparams: torch.Tensor | None = None) -> None:
    """One accumulate_and_update(_many) call for updates that share their group key
    (``hparams``: their hyperparameters on the device, in a captured step)."""
    u = group[0]
    if hparams is None:
        hparams = _HPARAMS.fill(u.weights.device, u.kind, u.hparams())
    if len(group) == 1:
        torch.ops.veloce.accumulate_and_update(
            u.weights, u.opt_state, u.grad, u.slots, u.offsets, u.psw, u.mode, False, u.kind, hparams, False, skip,
        )  # fmt: skip
    else:
        torch.ops.veloce.accumulate_and_update_many(
            [v.weights for v in group], [v.opt_state for v in group], [v.grad for v in group],
            [v.slots for v in group], [v.offsets for v in group], [v.psw for v in group], u.mode, False, u.kind,
            hparams, False, skip,
        )  # fmt: skip


class _FiniteCheck:
    """The nonfinite_grad="raise" check of step_tables' tables: whether every pending
    gradient of a table is finite (over all ranks for a sharded table). One
    ``torch.ops.veloce.nonfinite_flags`` over the gradients of each device's tables (every
    element read once; no host sync), one all-reduce per process group of sharded tables,
    and at most one read-back per device, queued at construction and waited for by
    :meth:`result` (:class:`veloce._device.HostCopy`)."""

    def __init__(self, tables: Sequence["DynamicEmbedding"]) -> None:
        self.tables = list(tables)
        self._result: Optional[dict[int, bool]] = None
        by_device: dict[torch.device, list[int]] = {}
        where: dict[int, tuple[torch.device, int]] = {}  # table -> (device, row of its flag)
        groups: dict[int, list[int]] = {}  # the sharded tables per process group
        for i, t in enumerate(self.tables):
            dev = t.table.device
            idx = by_device.setdefault(dev, [])
            where[i] = (dev, len(idx))
            idx.append(i)
            if t._shard is not None:
                groups.setdefault(id(t._shard.group), []).append(i)
        flags: dict[torch.device, list[torch.Tensor]] = {}  # per device: bool flag rows
        self._any: dict[torch.device, torch.Tensor] = {}  # per device: (1,) "some row is set", where ready
        for dev, idx in by_device.items():
            grads, owner = [], []
            for j, i in enumerate(idx):
                g, _ = _checked_tensors(self.tables[i]._pending)
                grads += g
                owner += [j] * len(g)
            if grads:
                f = _ops.nonfinite_flags(grads, owner, len(idx))
                flags[dev], self._any[dev] = [f[:-1]], f[-1:]
            else:
                flags[dev] = [torch.zeros(len(idx), dtype=torch.bool, device=dev)]
        # Sharded tables: the flags summed over the ranks (every rank steps the same tables
        # in the same order), appended after the device's own rows.
        for idx in groups.values():
            dev = where[idx[0]][0]
            rows = [where[i][1] for i in idx]
            own = flags[dev][0]
            if {where[i][0] for i in idx} == {dev}:  # the usual case: one gather (or none) for the group
                mine = own if rows == list(range(own.numel())) else own[host_tensor(rows, dev)]
            else:
                mine = torch.stack([flags[where[i][0]][0][where[i][1]].to(dev) for i in idx])
            mine = mine.to(torch.long, copy=True)  # agree_all reduces in place: never the local rows
            summed = self.tables[idx[0]]._shard.agree_all(mine).to(dev) != 0
            base = sum(f.numel() for f in flags[dev])
            flags[dev].append(summed)
            self._any.pop(dev, None)  # the agreed rows count too
            for k, i in enumerate(idx):
                where[i] = (dev, base + k)
        self._where = where
        self._flags = {dev: fs[0] if len(fs) == 1 else torch.cat(fs) for dev, fs in flags.items()}
        # Queued, not waited for; a captured step's are made after each replay (requeued).
        self._copies = {} if _capture.ACTIVE is not None else self._queue_copies()

    def _queue_copies(self) -> dict:
        return {dev: HostCopy(f) for dev, f in self._flags.items()}

    def requeued(self) -> "_FiniteCheck":
        """The same check of the flags' current values (a replayed CUDA graph rewrote them):
        their read-backs queued now, the result not read yet."""
        again = copy.copy(self)
        again._result, again._copies = None, self._queue_copies()
        return again

    def skip_flag(self, devices: set) -> Optional[torch.Tensor]:
        """A (1,) bool on the device of every table in ``devices`` (those to be updated),
        true when some checked gradient is not finite; None when the tables span several
        devices (the caller then reads :meth:`result` before updating)."""
        if len(devices) != 1 or set(self._flags) != devices:  # several devices, or no table to check
            return None
        (dev,) = devices
        ready = self._any.get(dev)
        return ready if ready is not None else self._flags[dev].any().reshape(1)

    def result(self) -> dict[int, bool]:
        """id(table) -> whether its pending gradient is finite (waits for the read-back once)."""
        if self._result is None:
            host = {dev: c.tolist() for dev, c in self._copies.items()}
            self._result = {id(t): not host[self._where[i][0]][self._where[i][1]] for i, t in enumerate(self.tables)}
        return self._result


def lookup_many(tables: Sequence["DynamicEmbedding"], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Looks up several tables at once: ``[t(*x) for t, x in zip(tables, inputs)]``.

    The result is the same as calling each table (forward hooks of the tables aside:
    they are not run); the difference is speed. In training, the new ids of all tables
    are inserted by one op (:func:`veloce.table.find_or_insert_many`), so on a GPU the
    host waits for the device once or twice per call instead of per table. When the
    tables are sharded by :class:`veloce.distributed.HybridParallel`, the ids of every
    table with the same embedding dim also travel in one all-to-all exchange instead of
    one per table. ``veloce.models`` look their features up this way.

    Args:
        tables: ``DynamicEmbedding`` modules.
        inputs: per table, a 2-D ``(B, L)`` tensor of ids, or a tuple ``(input,
            offsets[, per_sample_weights])`` as the module's forward takes.

    Returns:
        One pooled ``(B, D)`` tensor per table.
    """
    if _compile.is_compiling():  # one opaque op in the graph (veloce._compile)
        return _compile.lookup(tables, inputs, many=True)
    args, groups, local = _lookup_groups(tables, inputs, "lookup_many")
    out: list[Optional[torch.Tensor]] = [None] * len(tables)
    aranges: dict = {}  # the offsets of 2-D inputs, shared by the tables (see _bags)
    # Every sharded table's input is checked before any table changes (a bad input of a
    # later exchange used to arrive after the earlier exchanges inserted): this rank then
    # abandons the first exchange, where every other rank raises too. The offsets' values
    # are checked with each exchange's header.
    sharded: list[tuple[list[int], list, list]] = []
    if groups:
        with tables[next(iter(groups.values()))[0]]._shard.abandon_on_error():
            for idx in groups.values():
                for i in idx:
                    if training_lookup(tables[i]):
                        tables[i]._check_unapplied()
                layouts_k: list = []
                sharded.append((idx, [tables[i]._bags(*args[i], deferred=layouts_k, aranges=aranges) for i in idx],
                                layouts_k))  # fmt: skip
    if local:
        # A local table's error (bad input, a full table) must not leave the other ranks
        # waiting in this call's first sharded exchange: this rank abandons it, so they
        # raise too (the exchanges after the first are never reached by any rank).
        first_group = tables[next(iter(groups.values()))[0]]._shard if groups else None
        with first_group.abandon_on_error() if first_group is not None else contextlib.nullcontext():
            # Every local input (eval tables' and repeated ones' too) is checked before any
            # table changes; then the training tables insert in one op, so the host waits for
            # the device once, not per table. The bag layouts' check rides on that op's
            # read-back (_insert_checked), or, with no training table, is read back alone. A
            # table listed twice (or shared by two modules) inserts on its own the second
            # time, after its first lookup (its layout is already checked).
            layouts: list = []
            first: dict[int, int] = {}
            train = [i for i in local if training_lookup(tables[i]) and first.setdefault(id(tables[i].table), i) == i]
            for i in train:
                tables[i]._check_unapplied()
            train_tables = [tables[i].table for i in train]
            if train and _world_size() > 1:
                for i in train:
                    if not tables[i].per_rank:
                        _refuse_replicated_training(tables[i])

            def checked_insert():  # on the insert stream while an update is in flight (veloce._update_stream)
                bags = {i: tables[i]._bags(*args[i], deferred=layouts, aranges=aranges) for i in local}
                if not train:
                    return bags, None, None
                slots, check = _insert_checked(
                    layouts, train_tables,
                    lambda bad, refused: find_or_insert_many(train_tables, [bags[i][0] for i in train],
                                                             [tables[i].padding_idx for i in train], bad, refused),
                )  # fmt: skip
                return {i: (ids, check.guard(offs, ids.numel(), tables[i].include_last_offset), psw)
                        for i, (ids, offs, psw) in bags.items()}, slots, check  # fmt: skip

            bags, slots, check = insert_beside_updates(train_tables, checked_insert)
            if train:
                for i, o in zip(train, _train_lookups([tables[i] for i in train], [bags[i] for i in train], slots)):
                    out[i] = o
            else:
                _check_offsets_many(layouts)
            # A training table listed again inserts again, carrying the same check: when the
            # first insert deferred (its check unread), a refused call then changes no table.
            for i in local:
                if out[i] is None:
                    out[i] = tables[i]._lookup(*bags[i], check=check if training_lookup(tables[i]) else None)
    from veloce.distributed.sharded import sharded_lookup

    for idx, bags_k, layouts_k in sharded:
        # The layouts' offsets are checked with the exchange's header (one host sync for both).
        for i, o in zip(idx, sharded_lookup([tables[i] for i in idx], bags_k, layouts_k)):
            out[i] = o
    return out  # type: ignore[return-value]


def _world_size() -> int:
    """The default process group's size; 1 without torch.distributed (one cheap check on
    the training lookups of tables that are not sharded)."""
    if not _DIST_AVAILABLE or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def _refuse_replicated_training(table: "DynamicEmbedding") -> NoReturn:
    """Raises for a training lookup of an unsharded table while several ranks run: each
    rank would train a copy of its own. A gradient all-reduce (DDP's, FSDP's, a user's)
    covers parameters, and a table's rows are not parameters, so nothing else notices."""
    ddp_cls = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    inside_ddp = getattr(ddp_cls, "_active_ddp_module", None) is not None
    why = (
        "torch.nn.parallel.DistributedDataParallel does not synchronise DynamicEmbedding tables (their rows are "
        "not parameters): every rank would train its own copy and the copies drift apart"
        if inside_ddp else
        "every rank would train its own copy of the table and the copies drift apart (DistributedDataParallel, "
        "FSDP and gradient all-reduces synchronise parameters only; a table's rows are not parameters)"
    )  # fmt: skip
    raise RuntimeError(
        f"DynamicEmbedding: training lookup of a table that is not sharded, while torch.distributed runs "
        f"{_world_size()} ranks: {why}. Use veloce.distributed.HybridParallel(model) instead of "
        f"DistributedDataParallel(model): it shards the tables across the ranks and runs DDP over the dense "
        f"parameters. For a table that each rank trains on its own on purpose, pass per_rank=True "
        f"(DynamicEmbedding(..., per_rank=True), or set table.per_rank = True)."
    )


def _lookup_groups(tables: Sequence["DynamicEmbedding"], inputs: Sequence[Any], what: str):
    """``lookup_many``'s inputs as ``(input, offsets, per_sample_weights)`` per table (the
    missing ones None), the sharded tables grouped by exchange (same process group, dim,
    dtype, training lookup or not (:func:`training_lookup`) and sparse mode: one exchange
    each), and the local tables."""
    if len(tables) != len(inputs):
        raise ValueError(f"{what}: {len(tables)} tables but {len(inputs)} inputs")
    _ext.require()
    args = [_padded_args(x) for x in inputs]
    groups: dict[tuple, list[int]] = {}
    local: list[int] = []
    for i, t in enumerate(tables):
        if not isinstance(t, DynamicEmbedding):
            raise TypeError(f"{what}: tables[{i}] is a {type(t).__name__}, not a DynamicEmbedding")
        if t._shard is None:
            local.append(i)
            continue
        key = (id(t._shard.group), t.embedding_dim, t.table.dtype, training_lookup(t), t._shard.mode)
        groups.setdefault(key, []).append(i)
    return args, groups, local


def _padded_args(x: Any) -> tuple:
    """One table's input to lookup_many (a tensor, or a tuple or list of the forward's
    arguments) as ``(input, offsets, per_sample_weights)``, the missing ones None."""
    if isinstance(x, torch.Tensor):  # the usual case, first
        return (x, None, None)
    a = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return a + (None,) * (3 - len(a))


def dispatch_many(tables: Sequence["DynamicEmbedding"], inputs: Sequence[Any], depth: str = "inserts") -> None:
    """The first half of a later ``lookup_many(tables, inputs)`` of sharded tables, run now:
    each exchange's ids go to their owners, which insert them
    (:meth:`veloce.distributed.HybridParallel.prefetch` calls it; local tables are looked
    up in full later). The later call finds it and runs only the second half.
    ``depth="header"``: only the first half's start (no host sync); the later call runs the rest."""
    from veloce.distributed.sharded import check_prefetchable, deferring_errors, dispatch_group

    args, groups, _ = _lookup_groups(tables, inputs, "prefetch")
    aranges: dict = {}
    for idx in groups.values():
        shard = tables[idx[0]]._shard
        group_tables = [tables[i] for i in idx]
        check_prefetchable(group_tables)  # before the input's checks, which abandon the exchange on an error
        with deferring_errors(shard, group_tables, depth) as failed:
            with shard.abandon_on_error(shard.dispatch_group or shard.group):  # bad input fails every rank
                layouts: list = []
                bags = [tables[i]._bags(*args[i], deferred=layouts, aranges=aranges) for i in idx]
        if not failed:
            dispatch_group(group_tables, bags, layouts, depth)


def _check_offsets(offsets: torch.Tensor, n: int, include_last_offset: bool) -> None:
    """nn.EmbeddingBag's bag layout rules, checked before the table is touched."""
    flags = _offsets_flags([(offsets, n, include_last_offset)])
    if not any(bool(f) for f in flags.values()):  # one device sync; the details below only run for bad input
        return
    _raise_offsets_error(offsets, n)


def _check_offsets_many(
    layouts: Sequence[tuple], flags: dict[torch.device, torch.Tensor] | None = None
) -> None:
    """:func:`_check_offsets` for several ``(offsets, n, include_last_offset)`` with one
    device read-back per device for all of them (a lookup of K tables waits once).
    ``flags``: their :func:`_offsets_flags`, when the caller has them already."""
    flags = _offsets_flags(layouts) if flags is None else flags
    if any(bool(f) for f in flags.values()):  # one read per device
        _raise_first_offsets_error(layouts)


def _offsets_flags(layouts: Sequence[tuple]) -> dict[torch.device, torch.Tensor]:
    """Per device, whether any of the bag layouts ``(offsets, n, include_last_offset)`` there
    breaks a rule: one (1,) bool tensor on that device (one ``bag_layouts_bad`` call for all
    of them; nothing read back). Layouts with empty offsets are checked on the host by
    :func:`_host_checked_offsets` and add no flag; no device flag at all gives an empty dict."""
    by_device: dict[torch.device, list[tuple]] = {}
    for lay in layouts:
        if _host_checked_offsets(*lay):
            continue
        by_device.setdefault(lay[0].device, []).append(lay)
    return {dev: bag_layouts_bad(*zip(*lays)) for dev, lays in by_device.items()}


def _insert_checked(
    layouts: Sequence[tuple], tables: Sequence[HashTable],
    insert: Callable[[torch.Tensor | None, Callable[[], None] | None], _T],
) -> tuple[_T, "_LayoutCheck"]:  # fmt: skip
    """``insert(bad_input, on_refused)``, a find_or_insert into ``tables``, run so that it
    changes no table unless every bag layout in ``layouts`` (deferred by
    :meth:`DynamicEmbedding._bags`) is good; a bad one raises :func:`_check_offsets`'s error.
    Returns the insert's result and the check (:class:`_LayoutCheck`), whose ``guard`` the
    caller applies to each bag layout it then looks up with (the identity, unless the
    insert may have deferred, below).

    Why: reading the layouts' flag back would cost a host sync of its own (on a GPU, the
    device idles while Python runs), and the insert reads the device back anyway (CUDA
    find_or_insert's counters of the new ids, before it changes anything). So
    the layouts' flags are combined into one and passed to the op as ``bad_input``: it
    travels in that same copy, and the op refuses the call (ValueError, nothing changed)
    when it is set. A training forward then waits for the device once instead of twice.
    The detailed error is built only then, on the error path, where reading is fine.

    The flag rides only when it is one tensor on the device of all the tables (one op
    call); otherwise (layouts on several devices, tables on several devices) the layouts
    are read back first, as :func:`_check_offsets_many` does.

    A deferred insert (``defer_inserts``) reads nothing back: a bad layout makes it change
    nothing and give slots of -1, and the error is raised when its counts are read (by the
    next ``step()`` at the latest: ``on_refused``, once for the call). The lookup still runs, so ``guard``
    replaces the checked layouts' offsets on the device, when the flag is set, by a good
    layout: zeros (and the number of ids last, with include_last_offset), every bag empty
    but the last, over ids whose slots are -1 (zero rows, no gradient). The kernels then
    never read past the ids."""
    flags = _offsets_flags(layouts)
    if not flags:  # nothing to check on the device
        return insert(None, None), _LayoutCheck()
    if len(flags) > 1 or set(flags) != {t.device for t in tables}:
        _check_offsets_many(layouts, flags)
        return insert(None, None), _LayoutCheck()
    (flag,) = flags.values()
    check = _LayoutCheck(flag, layouts)
    try:
        result = insert(flag, check.refused)
    except ValueError:
        if not bool(flag):  # not refused for the offsets: someone else's error
            raise
    else:
        check.deferring = _capture.ACTIVE is not None or any(t.defer for t in tables)
        return result, check
    _raise_first_offsets_error(layouts)  # outside the except: the refusal is no part of the user's error


class _LayoutCheck:
    """The bag layouts' check that rode on a training insert (:func:`_insert_checked`): its
    flag (None: nothing left to check), the guard of the layouts looked up after it, and
    the refusal that a deferred insert raises when its counts are read, once for every
    insert that carried the flag."""

    def __init__(self, flag: torch.Tensor | None = None, layouts: Sequence[tuple] = ()) -> None:
        self.flag = flag
        self.layouts = layouts
        self.deferring = False  # some table of the insert defers: the guard replaces flagged layouts
        self.raised = False

    def guard(self, offsets: torch.Tensor, n: int, include_last_offset: bool) -> torch.Tensor:
        """``offsets`` (of ``n`` ids), or, when the insert may have deferred and the layout
        is one of the checked ones, a good layout of as many bags where the flag is set
        (zeros, and ``n`` last with include_last_offset; on the device, nothing read back)."""
        if not self.deferring or not offsets.numel():
            return offsets
        if not any(o is offsets and m == n and i == include_last_offset for o, m, i in self.layouts):
            return offsets
        if not include_last_offset:
            return torch.where(self.flag, 0, offsets)  # one kernel (masked_fill out of place: a copy and a fill)
        good = torch.zeros_like(offsets)
        good[-1:].fill_(n)  # a kernel (an indexed assignment copies from the host, which a capture refuses)
        return torch.where(self.flag, good, offsets)

    def renewed(self) -> "_LayoutCheck":
        """The same check, not raised yet (for a replay of a captured step)."""
        again = copy.copy(self)
        again.raised = False
        return again

    def refused(self) -> None:
        """Raises the first bad layout's error (the first time only). When the offsets were
        changed in place since (none breaks a rule now), a ValueError says so."""
        if self.raised:
            return
        self.raised = True
        try:
            _raise_first_offsets_error(self.layouts)
        except AssertionError:
            pass
        raise ValueError(
            "the bag layout (offsets) of an earlier training forward broke a rule of nn.EmbeddingBag's offsets; "
            "that forward changed no table and read zeros. Its offsets were changed in place since, so the rule "
            "it broke is unknown"
        )


def _raise_first_offsets_error(layouts: Sequence[tuple]) -> NoReturn:
    """Raises the detailed error of the first bad layout, once a flag said some layout is
    bad (reads each layout back: for error paths only)."""
    for lay in layouts:
        _check_offsets(*lay)
    raise AssertionError("a bag layout was flagged bad, but none breaks a rule")


def _host_checked_offsets(offsets: torch.Tensor, n: int, include_last_offset: bool) -> bool:
    """Checks the rules of empty offsets (their shape alone) on the host, raising when one
    is broken; returns whether ``offsets`` is empty: nothing left for the device to check."""
    if offsets.numel():
        return False
    if include_last_offset:
        raise ValueError("offsets must hold at least one entry with include_last_offset=True, got 0")
    if n:
        raise ValueError(f"offsets is empty (0 bags) but input holds {n} ids")
    return True


def _raise_offsets_error(offsets: torch.Tensor, n: int) -> None:
    """Raises the error that says which rule a bad bag layout breaks."""
    first = int(offsets[0])
    if first != 0:
        raise ValueError(f"offsets must start at 0, got offsets[0] = {first}")
    if offsets.numel() > 1:
        dec = (offsets[1:] < offsets[:-1]).nonzero()
        if dec.numel():
            i = int(dec[0, 0])
            raise ValueError(
                f"offsets must be non-decreasing, got offsets[{i}] = {int(offsets[i])} > "
                f"offsets[{i + 1}] = {int(offsets[i + 1])}"
            )
    last = int(offsets[-1])
    if last > n:
        raise ValueError(f"offsets[-1] = {last} is past the end of input ({n} ids)")
    raise ValueError(f"with include_last_offset=True, offsets[-1] must equal the number of ids ({n}), got {last}")


class _Pending(NamedTuple):
    """The inputs of one backward pass, kept until step(): the gradient is summed per row
    and applied by one fused kernel then (never materialised per row)."""

    ids: Optional[torch.Tensor]  # (N,) for re-resolving slots if the table changes
    slots: torch.Tensor  # (N,) slots at forward time (codes -1 / -2 allowed)
    offsets: torch.Tensor  # (B,) or (B + 1,)
    psw: Optional[torch.Tensor]  # (N,) or None
    grad: torch.Tensor  # (B, D) gradient of the pooled output
    mode: int
    include_last_offset: bool
    version: int  # table version the slots belong to


_ANCHORS: dict[torch.device, torch.Tensor] = {}


def autograd_anchor(device: torch.device) -> torch.Tensor:
    """An empty leaf tensor on ``device`` that requires grad: the input that makes autograd
    run the backward of a lookup whose other inputs need no gradient (the table's rows get
    theirs through the table, not autograd). Its gradient is always None. One per device,
    shared by every lookup: a step over many tables evaluates one AccumulateGrad node for
    it, not one per table, and allocates nothing."""
    capture = _capture.ACTIVE
    if capture is not None:
        # A captured step's own: autograd syncs a leaf's gradient with the stream its
        # AccumulateGrad node was made on, and the shared anchor's was made on another
        # stream, outside the capture (which capture refuses).
        if capture.anchor is None:
            with torch.inference_mode(False):
                capture.anchor = torch.empty(0, device=device, requires_grad=True)
        return capture.anchor
    anchor = _ANCHORS.get(device)
    if anchor is None:
        with torch.inference_mode(False):  # a normal tensor even when first asked for in inference mode
            anchor = _ANCHORS.setdefault(device, torch.empty(0, device=device, requires_grad=True))
    return anchor


class _SparseLookup(torch.autograd.Function):
    """The pooled lookups of K tables (one autograd node for all of them), whose backward
    sends each table's sparse gradient to the table, not to autograd.

    ``anchor`` is an empty tensor that requires grad so that backward runs; each table's
    per-sample weights (``psws``, inputs after the fixed ones) get a real gradient when
    they require one. A table whose output gets no gradient (unused in the loss) receives
    nothing, as if it had not been looked up: no pending gradient, no step counted. One
    node for a model's tables saves the autograd machinery of K - 1 nodes per step on the
    host (:func:`lookup_many`); a module's own forward is the case K = 1.
    """

    @staticmethod
    def forward(ctx, anchor, modules, ids, slots, offsets, *psws):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # None stays None: an unused output sends no gradient
        outs, ctx.argmax = _pooled(modules, slots, offsets, psws)
        ctx.modules = modules
        ctx.versions = [m.table.version for m in modules]
        ctx.save_for_backward(*ids, *slots, *offsets, *psws)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        k = len(ctx.modules)
        saved = ctx.saved_tensors
        ids, slots, offsets, psws = (saved[j * k : (j + 1) * k] for j in range(4))
        grads = _contiguous_grads(grads, [m.table.dtype for m in ctx.modules])
        trains = _accumulates_into(ctx.next_functions[0][0])
        grad_psws = []
        for j, (module, grad_out) in enumerate(zip(ctx.modules, grads)):
            if grad_out is None:
                grad_psws.append(None)
                continue
            grad_psws.append(_table_backward(module, ids[j], slots[j], offsets[j], psws[j], grad_out,
                                             ctx.versions[j], trains, ctx.needs_input_grad[5 + j],
                                             ctx.argmax[j]))  # fmt: skip
        return (None, None, None, None, None, *grad_psws)


def _pooled(modules: Sequence["DynamicEmbedding"], slots: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
            psws: Sequence[Optional[torch.Tensor]]) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:  # fmt: skip
    """The pooled rows of the training lookups of ``modules`` at ``slots`` (no autograd),
    and per table the argmax positions its backward needs (:func:`max_pool`; None for sum
    and mean). Sum and mean tables pool in one kernel launch, max tables by torch ops."""
    outs: list = [None] * len(modules)
    argmax: list = [None] * len(modules)
    rest = [k for k, m in enumerate(modules) if m.mode != "max"]
    if rest:
        res = pooled_lookup_kernels([modules[k].table.weights for k in rest], [slots[k] for k in rest],
                                    [offsets[k] for k in rest], [psws[k] for k in rest],
                                    [_MODES[modules[k].mode] for k in rest],
                                    [modules[k].include_last_offset for k in rest], [None] * len(rest))  # fmt: skip
        for k, o in zip(rest, res):
            outs[k] = o
    for k, m in enumerate(modules):
        if m.mode == "max":
            outs[k], argmax[k] = max_pool(m.table.weights, slots[k], offsets[k], m.include_last_offset)
    return outs, argmax


def _table_backward(module: "DynamicEmbedding", ids: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor,
                    psw: Optional[torch.Tensor], grad_out: torch.Tensor, version: int, trains: bool,
                    psw_grad: bool, argmax: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:  # fmt: skip
    """One table's part of a training lookup's backward: the pending gradient of its rows
    (when the pass ``trains`` the tables), and the gradient of its per-sample weights (when
    ``psw_grad``). ``slots`` were taken at table ``version``; ``grad_out`` is contiguous, in
    the table's dtype. ``argmax``: a max table's argmax positions (:func:`_pooled`): each
    column's gradient goes to its bag's argmax position, kept as a sum-mode gradient of one
    bag per position. Shared by :class:`_SparseLookup` and the compiled lookup's backward op
    (:mod:`veloce._compile`)."""
    table = module.table
    if version != table.version:  # the table grew or evicted since forward
        slots = _reresolve(table, ids, slots)
    ilo = module.include_last_offset
    if trains and argmax is not None:
        grad_rows = max_pool_position_grad(grad_out, argmax, offsets, slots.numel(), ilo)
        positions = torch.arange(slots.numel(), device=slots.device)
        module._accumulate(_Pending(ids, slots, positions, None, grad_rows, _MODES["sum"], False, table.version))
    elif trains:
        module._accumulate(_Pending(ids, slots, offsets, psw, grad_out, _MODES[module.mode], ilo, table.version))
    if psw is None or not psw_grad:
        return None
    return _psw_grad(table.weights, slots, offsets, grad_out, ilo)


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def _accumulates_into(anchor_node) -> bool:
    """Whether the backward pass running now accumulates gradients into the anchor's
    leaf (``anchor_node``: its AccumulateGrad node), as ``loss.backward()`` does into every
    leaf. ``torch.autograd.grad(...)`` and ``backward(inputs=[...])`` accumulate only into
    what they are asked for, never into the anchor: such a pass gives the per-sample
    weights their gradient but the tables none, as it leaves an ``nn.EmbeddingBag``'s
    ``weight.grad`` alone."""
    if _WILL_EXECUTE is None:  # no such query in this torch: every pass trains the tables
        return True
    try:
        return bool(_WILL_EXECUTE(anchor_node))
    except RuntimeError:  # autograd.grad(..., inputs=[the anchor]): grad() accumulates into nothing
        return False


def _contiguous_grads(grads: Sequence[Optional[torch.Tensor]],
                      dtypes: Sequence[torch.dtype]) -> list[Optional[torch.Tensor]]:  # fmt: skip
    """The lookups' output gradients as contiguous tensors of their tables' dtypes (what
    the sparse update reads). A model that stacks its tables' outputs (DLRM's and DeepFM's
    interactions) gets each one's gradient as a strided slice of the stack's gradient: a
    copy each, one launch per table on a GPU. The slices of one shape, dtype and device are
    copied by one ``torch.stack`` instead (one launch for all, the same values), whose
    rows then are contiguous views. They share the stack's memory, which lives until the
    last of those tables has stepped (the same total as the per-table copies, when the
    tables step together, as ``step_tables`` and ``CombinedOptimizer`` step them)."""
    out = list(grads)
    groups: dict[tuple, list[int]] = {}
    for j, g in enumerate(grads):
        if g is None:
            continue
        g = g.to(dtypes[j])
        out[j] = g
        if not g.is_contiguous():
            groups.setdefault((g.shape, g.dtype, g.device), []).append(j)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = out[idx[0]].contiguous()
            continue
        for j, g in zip(idx, torch.stack([out[j] for j in idx]).unbind(0)):
            out[j] = g
    return out


def _train_lookups(modules: Sequence["DynamicEmbedding"], bags: Sequence[tuple],
                   slots: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The training lookups of distinct tables' validated ``bags`` (ids, offsets, psw), their
    ids inserted at ``slots``: one autograd node for all of them (:class:`_SparseLookup`)."""
    ids, offsets, psws = zip(*bags)
    recorder = _compile.RECORDER
    if recorder is not None:  # inside the compiled lookup's op, which is the autograd node itself
        return recorder.record(modules, ids, slots, offsets, psws)
    return _SparseLookup.apply(autograd_anchor(ids[0].device), list(modules), ids, list(slots), offsets, *psws)


def _reresolve(table: HashTable, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Slots of ``ids`` under the table's current mapping: evicted ids become -2 (still
    counted by mean, no gradient), padding (-1 in ``slots``) stays -1."""
    fresh = table.find(ids)
    return fresh.masked_fill(fresh < 0, -2).masked_fill(slots == -1, -1)


def _checked_tensors(pending: Sequence[_Pending]) -> tuple[list[torch.Tensor], list[int]]:
    """What the NaN/Inf check reads of pending entries, and the entry each tensor belongs
    to: every gradient, and the per-sample weights that scale it into the rows' gradients
    (a NaN weight makes a NaN row gradient out of a finite pooled one)."""
    tensors, owner = [], []
    for j, e in enumerate(pending):
        tensors.append(e.grad)
        owner.append(j)
        if e.psw is not None:
            tensors.append(e.psw)
            owner.append(j)
    return tensors, owner


def _nonfinite_bags(e: _Pending) -> torch.Tensor:
    """(B,) bool: the bags of ``e`` whose gradient, or some position's per-sample weight,
    holds NaN or Inf."""
    bad = ~torch.isfinite(e.grad).all(dim=1)
    if e.psw is not None:
        bad[_position_bags(e)[~torch.isfinite(e.psw)]] = True
    return bad


def _drop_bags(e: _Pending, bad: torch.Tensor) -> _Pending:
    """``e`` without the gradient of the ``bad`` bags (nonfinite_grad="skip"): their pooled
    gradient and their positions' per-sample weights become zero."""
    grad = e.grad.masked_fill(bad.unsqueeze(1), 0)
    if e.psw is None:
        return e._replace(grad=grad)
    return e._replace(grad=grad, psw=e.psw.masked_fill(bad[_position_bags(e)], 0))


def _position_bags(e: _Pending) -> torch.Tensor:
    """(N,) the bag of each position of a pending entry."""
    return bag_of(e.offsets[:-1] if e.include_last_offset else e.offsets, e.slots.numel())


def _psw_grad(weights, slots, offsets, grad_out, include_last_offset, extra_rows=None) -> torch.Tensor:
    """d out[bag(i)] / d psw[i] = <row(i), grad_out[bag(i)]>; zero for codes -1 / -2. Slots
    ``>= C`` read ``extra_rows`` (an eval lookup's unknown ids, ``_eval_slots``)."""
    bag = bag_of(offsets[:-1] if include_last_offset else offsets, slots.numel())
    c = weights.shape[0]
    rows = weights[slots.clamp(0, c - 1)]
    if extra_rows is not None:
        picked = extra_rows[(slots - c).clamp(0, extra_rows.shape[0] - 1)]
        rows = torch.where((slots >= c).unsqueeze(1), picked, rows)
    return ((rows * grad_out[bag]).sum(1) * (slots >= 0)).to(grad_out.dtype)
