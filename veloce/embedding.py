"""``DynamicEmbedding``: a drop-in ``nn.EmbeddingBag`` whose rows live in a hash table.

Shapes (as ``nn.EmbeddingBag``): ``N`` ids, ``B`` bags, ``L`` ids per bag for 2-D
input, ``D`` embedding dim.
"""


from __future__ import annotations

from typing import Any, NoReturn, Optional

import torch

from veloce import init
from veloce.ops import extension as _ext
from veloce.optim import Adagrad, SparseOptimizer
from veloce.sparse import (
    LIVE, NONFINITE, POOLINGS, DeferredCheck, InputChecks, LocalBackend, LocalLookup, LookupBackend, NonfinitePolicy,
    Pending, PendingGradient, Stepping, TableModule, compiled_lookup, is_compiling, register, training_lookup,
)  # fmt: skip
from veloce.table import HashTable, is_int64
from veloce.admission import AdmissionPolicy
from veloce.eviction import EvictionPolicy
from veloce.storage import Device, StorageSpec

__all__ = ["DynamicEmbedding"]

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


class DynamicEmbedding(InputChecks, LocalLookup, PendingGradient, NonfinitePolicy, Stepping, TableModule):
    """A pooled embedding over raw int64 ids with no vocabulary: ``nn.EmbeddingBag`` without
    ``num_embeddings``.

    Rows are created on first sight by a training lookup (training mode, gradients
    enabled; initialised from ``(seed, id)``), trained by a fused sparse optimizer on
    :meth:`step` (or through :class:`veloce.CombinedOptimizer`), and the table grows
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
    :class:`veloce.CombinedOptimizer`, or call :meth:`step` after the dense step),
    or when ``max_pending_backwards`` (1024) backward passes wait already (each keeps its
    lookup's ids and output gradient in memory); accumulating over several backward passes
    before one step is fine. :meth:`zero_grad` (and
    :class:`veloce.CombinedOptimizer`'s) drops it; ``model.zero_grad()`` and a dense
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
            :class:`veloce.CombinedOptimizer` too), before anything is applied. What
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
        storage: where the rows and optimizer state live, a :mod:`veloce.storage` spec:
            ``veloce.storage.Device()`` (default: all on ``device``) or
            ``veloce.storage.HostCached(cache_rows=...)`` (in host memory, the hot rows
            cached on ``device``; a table larger than the device's memory). A tiered
            table behaves as the all-in-memory one (same values, every optimizer, pooling,
            checkpoints in and out of any storage); ``max_capacity`` counts the rows of
            every tier; :meth:`stats` reports the cache's hit rate and the rows moved, and
            :meth:`prefetch` brings a coming batch's rows up ahead of it
            (``docs/storage.md``). ``state_dict()`` and :meth:`export` return tensors,
            so they hold every row of every tier in host memory at once; for a table
            larger than RAM, checkpoint with :mod:`veloce.checkpoint`, which writes and
            reads a tiered table's rows in chunks.
        admission: which new ids get a row, a :mod:`veloce.admission` policy: None
            (default: every id, on its first training sighting),
            ``veloce.admission.Frequency(min_count=k)`` (on its k-th sighting, counted in
            a count-min sketch of fixed size) or ``veloce.admission.Probability(p)``. An
            id not admitted reads the table's default row, one trained row shared by them
            (their gradients train it); in eval, with ``unknown="init"``, every unknown id
            reads it. :meth:`find` reports such ids as absent; ``state_dict()`` and
            ``veloce.checkpoint`` keep the sketch and the default row; :meth:`stats` adds
            ``admitted``, ``refused`` and ``default_row_share``. Not with
            :class:`veloce.distributed.HybridParallel` sharding.

    Differences from ``nn.EmbeddingBag`` (README's "Differences from nn.EmbeddingBag"):
    no ``num_embeddings`` (the first argument is ``embedding_dim``), no ``.weight`` (see
    :meth:`find`, :meth:`insert`, :meth:`export`, :meth:`from_pretrained`), no
    ``max_norm``, ``norm_type``, ``scale_grad_by_freq`` or ``sparse`` arguments, and no
    TorchScript.

    ``backend`` (a :class:`veloce.sparse.LookupBackend`) says where lookups go: this
    process's rows (:class:`veloce.sparse.LocalBackend`, the default), or the ranks that
    own the ids (:class:`veloce.distributed.HybridParallel` installs a sharded one).

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
        initializer: Optional[init.Initializer] = None,
        optimizer: Optional[SparseOptimizer] = None,
        padding_idx: Optional[int] = None,
        include_last_offset: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        unknown: str = "init",
        nonfinite_grad: str = "raise",
        defer_inserts: bool = False,
        per_rank: bool = False,
        storage: Optional[StorageSpec] = None,
        admission: AdmissionPolicy | str | None = None,
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
        if mode not in POOLINGS:
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if unknown not in _UNKNOWN:
            raise ValueError(f"unknown must be 'init' or 'zeros', got {unknown!r}")
        if nonfinite_grad not in NONFINITE:
            raise ValueError(f"nonfinite_grad must be one of {NONFINITE}, got {nonfinite_grad!r}")
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be a floating dtype (float32, float64, float16, bfloat16), got {dtype}")
        if padding_idx is not None and not is_int64(padding_idx):
            raise ValueError(f"padding_idx must be an int64 id or None, got {padding_idx!r}")
        initializer = init.normal(std=0.01) if initializer is None else initializer
        optimizer = Adagrad(lr=0.05) if optimizer is None else optimizer
        if not isinstance(initializer, init.Initializer):
            raise TypeError(f"initializer must come from veloce.init, got {type(initializer).__name__}")
        if not isinstance(optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must come from veloce.optim (SGD, Adagrad, ...), got {type(optimizer).__name__}")
        storage = Device() if storage is None else storage
        if not isinstance(storage, StorageSpec):
            raise TypeError(f"storage must be a veloce.storage spec (Device(), HostCached(...)), got "
                            f"{type(storage).__name__}")  # fmt: skip
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.padding_idx = None if padding_idx is None else int(padding_idx)
        self.include_last_offset = include_last_offset
        self.optimizer = optimizer
        self.unknown = unknown
        self.nonfinite_grad = nonfinite_grad
        self.per_rank = bool(per_rank)
        self._frozen = False
        self.storage = storage
        self.table = storage.make_table(
            dim=embedding_dim, state_dim=optimizer.state_dim(embedding_dim), capacity=capacity,
            max_capacity=max_capacity, eviction=eviction, initializer=initializer, seed=seed, dtype=dtype,
            device=device, init_state=optimizer.initial_state(embedding_dim),
        )  # fmt: skip
        self.table.defer = bool(defer_inserts)
        self.table.set_admission(admission)
        self._steps = 0  # sparse optimizer steps applied (Adam's t): step_count
        # nonfinite_grad="raise_next": the check of the last step() while unread, and the
        # error it found once read (raised by the next step()).
        self._verdict: Optional[DeferredCheck] = None
        self._nonfinite_error: Optional[FloatingPointError] = None
        # Inputs of the backward passes since the last step (gradient accumulation).
        self._pending: list[Pending] = []
        self._pending_default: list[Pending] = []  # the default row's (admission)
        self._last_lr: Optional[float] = None  # the learning rate of the last step()
        self._had_backward = False  # a backward pass reached the table since the last step()
        # Backward passes whose gradient waits for step(), and the torch optimizer steps made
        # when the first arrived (None: none waits); see _check_unapplied.
        self._unapplied_passes = 0
        self._unapplied_since: Optional[int] = None
        # Where lookups go: this process's rows, or the owners' (HybridParallel installs a
        # sharded backend).
        self.backend: LookupBackend = LocalBackend()
        LIVE.add(self)
        self._handle = register(self)  # how a compiled graph's lookup op finds this module

    # Bookkeeping set on every training step (see PlainAttrs).
    _PLAIN_ATTRS = frozenset({"_steps", "_verdict", "_nonfinite_error", "_pending", "_pending_default", "_last_lr",
                              "_had_backward",
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
                room for the given rows; ``dtype`` to that of ``embeddings`` (if floating),
                ``device`` to its device.

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
        kwargs.setdefault("device", embeddings.device)  # as nn.EmbeddingBag.from_pretrained's weight
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
        state.setdefault("_pending_default", [])
        state.setdefault("storage", Device())
        if "backend" not in state:  # pickled with the sharding as a private attribute
            shard = state.pop("_shard", None)
            state["backend"] = LocalBackend() if shard is None else shard
        super().__setstate__(state)
        LIVE.add(self)
        # A copy is another module: a compiled graph of the original must not look it up.
        self._handle = register(self)

    def forward(
        self,
        input: torch.Tensor,
        offsets: Optional[torch.Tensor] = None,
        per_sample_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Pooled embeddings of ``input`` bags; see the class docstring for shapes."""
        if is_compiling():  # one opaque op in the graph (veloce.sparse.compile)
            return compiled_lookup([self], [(input, offsets, per_sample_weights)], many=False)[0]
        _ext.require()
        return self.backend.forward(self, input, offsets, per_sample_weights, training_lookup(self))

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
        rows = self.table.rows(slots.clamp(min=0)).masked_fill(~found.unsqueeze(1), 0)
        below = self.table.rows_below(ids, ~found)  # a tiered table's stored rows (moved nowhere)
        if below is not None:
            idx = (~found).nonzero().squeeze(1)
            held, stored = below
            rows[idx] = torch.where(held.unsqueeze(1), stored.to(rows.dtype), rows[idx])
            found = found.index_put((idx,), held)
        return rows, found

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """The table's telemetry, one dict (``docs/storage.md``): ``rows``, ``capacity``,
        ``max_capacity``, ``evicted``; a tiered table adds its cache's (``cache_rows``,
        ``cache_capacity``, ``store_rows``, ``hits``, ``misses``, ``hit_rate``, rows and
        bytes fetched and written back). ``reset`` restarts the counts that run since the
        last reset. On a table sharded by HybridParallel, this rank's shard. With
        ``admission``, also ``admitted``, ``refused`` (training sightings served by a row
        of their own and by the default row), ``admitted_last``, ``refused_last`` (the last
        training lookup's), ``default_row_share`` and ``sketch_bytes``."""
        out = self.table.stats(reset)
        out.update(self.table.admission_stats(reset))
        return out

    @torch.no_grad()
    def prefetch(self, ids: torch.Tensor) -> None:
        """Brings the rows of a coming training batch's ``ids`` into a tiered table's cache
        now (fetching them while this batch trains), and keeps them there until the step
        after that batch. A no-op for ``storage=Device()``, in eval mode and for a frozen
        table (their lookups move no rows).

        Raises:
            RuntimeError: the table is sharded by HybridParallel (``HybridParallel.prefetch``
                brings each owner's rows up with the exchange it prefetches).
        """
        if not self.training:
            return
        if self.backend.sharded:
            raise RuntimeError(
                "DynamicEmbedding.prefetch: this table is sharded by HybridParallel: its rows live on the ranks that "
                "own the ids; HybridParallel.prefetch(batch) brings them up with the exchange it prefetches"
            )  # fmt: skip
        self.table.prefetch(self._check_ids(ids, "ids").reshape(-1), self.padding_idx)

    @torch.no_grad()
    def insert(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Writes rows (insert_or_assign): ``weights`` (N, D) for ``ids`` (N,). New rows get
        zero optimizer state; existing rows keep theirs. On a table sharded by
        ``HybridParallel`` this writes this rank's shard, so every id must be one this
        rank owns (``veloce.distributed.owner_of(ids, world_size) == rank``)."""
        ids = self._check_ids(ids, "ids")
        self.backend.check_owned(ids)
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
    def export(self, since: Optional[int] = None, values_only: bool = False) -> dict[str, torch.Tensor]:
        """All that restores the table: keys (M,), weights (M, D), optimizer_state (M, S),
        scores (M,), in slot order, plus step (the sparse optimizer's step count).

        The tensors hold every row at once (of every tier, in host memory for a tiered
        table), as do those of ``state_dict()``; ``veloce.checkpoint`` streams a tiered
        table in chunks instead (``self.table.export_chunks(rows)`` yields them).

        With ``since`` (a table clock, ``self.table.clock`` at an earlier export): only
        the rows changed after it (each row's version is its score: the clock of its last
        training lookup) and the ids removed after it, ``removed`` (R,) with their clocks
        ``removed_at`` (R,), plus ``clock`` (the current one: the next export's ``since``).
        Exact from the clock at which :meth:`track_removed` started the tombstone log;
        ``docs/serving.md`` and :mod:`veloce.table.versions` give the semantics. On a
        table sharded by ``HybridParallel``, this rank's shard.

        Args:
            since: None for every row, or an int clock >= 0.
            values_only: leave the optimizer state out (what serving needs).

        Raises:
            ValueError: ``since`` on a table whose scores are use counts (``eviction="lfu"``),
                or not an int >= 0.
            veloce.table.versions.VersionsUnavailable: the ids removed after ``since`` are
                not all known (the log was started later, overflowed, or a clear or load
                stopped it): export whole, then ``track_removed()``.
        """
        if since is not None:
            out = self.table.changed_since(since, values_only)
            out["clock"] = torch.tensor(self.table.clock, dtype=torch.long)
        else:
            out = self.table.export()
            if values_only:
                del out["optimizer_state"]
        out["step"] = torch.tensor(self.step_count, dtype=torch.long)
        return out

    def track_removed(self, limit: Optional[int] = None) -> None:
        """Starts the log of removed ids (tombstones) at the table's current clock, so that
        :meth:`export` ``since`` this clock or a later one is exact; ``limit`` bounds the
        tombstones kept (16 bytes each). :class:`veloce.serving.Publisher` calls it."""
        self.table.track_removed(limit)

    def forget_removed(self, upto: int) -> None:
        """Drops the tombstones stamped at or before clock ``upto`` (once published)."""
        self.table.forget_removed(upto)

    def load_admission_state(self, state: dict[str, torch.Tensor]) -> None:
        """Puts back the table's admission state, the sketch and the default row
        (:meth:`~veloce.table.HashTable.load_admission_state`, checked first). Every shard of
        a sharded table loads the whole sketch; ranks other than 0 note it as shared, so that
        the next checkpoint, which sums the shards' sketches, counts each sighting once.

        Raises:
            ValueError: a tensor is missing or its shape does not fit the table's policy.
        """
        self.table.load_admission_state(state)
        if self.table.admits and self.backend.world_size > 1 and self.backend.rank != 0:
            self.table.mark_sketch_shared()

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self.export().items():
            destination[prefix + name] = value
        destination[prefix + "clock"] = torch.tensor(self.table.clock, dtype=torch.long)
        for name, value in self.table.admission_state().items():
            destination[prefix + name] = value if keep_vars else value.detach().clone()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        names = ("keys", "weights", "optimizer_state", "scores", "step", "clock", *self.table.admission_state())
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
        if isinstance(entries["keys"], torch.Tensor) and entries["keys"].dim() == 1:
            # A state dict of the whole table (one process's, or every shard's gathered) loads
            # on every rank of a sharded table, each keeping its own rows, as
            # veloce.checkpoint.load does; otherwise the next checkpoint's shards overlap.
            entries = self.backend.owned_entries(self, entries)
        admission = {n: state_dict[prefix + n] for n in self.table.admission_state()}
        try:
            self.load_admission_state(admission)  # checked before the rows change
            self.table.load_entries(entries)
        except ValueError as exc:
            error_msgs.append(f"while loading DynamicEmbedding {prefix!r}: {exc}")
            return
        self.step_count = counters["step"]  # drops the last step's unread check
        self.table.clock = counters["clock"]
        self._forget_gradient()  # a backward before the load books no step after it

    def extra_repr(self) -> str:
        storage = "" if isinstance(self.storage, Device) else f", storage={self.storage!r}"
        admission = "" if not self.table.admits else f", admission={self.table.admission!r}"
        return (f"{self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer}, {self.table._size_text()}"
                f"{storage}{admission}")  # fmt: skip
