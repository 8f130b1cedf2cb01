"""``HybridParallel``: sparse tables sharded like a parameter server, dense parameters DDP."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from veloce.distributed._comm import Group
from veloce.distributed.backward import drop_failed_gradients
from veloce.distributed.prefetch import complete_prefetched, dispatch_many
from veloce.distributed.sharded import Shard
from veloce.embedding import DynamicEmbedding
from veloce.runtime import capture as _capture
from veloce.runtime.device import current_stream, to_device
from veloce.runtime.update_stream import on_prefetch_stream, record_streams
from veloce.sparse import LocalBackend, apply_pending, raise_deferred

__all__ = ["HybridParallel"]


def _tensors(obj: Any) -> list:
    """The tensors in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _to_device(obj: Any, dev: torch.device) -> Any:
    """``obj`` with its CPU tensors copied to ``dev`` without a host sync (pinned staging)."""
    if isinstance(obj, torch.Tensor):
        return to_device(obj, dev) if obj.device.type == "cpu" else obj
    if isinstance(obj, tuple):
        return tuple(_to_device(o, dev) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, dev) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(o, dev) for k, o in obj.items()}
    return obj


_EXCHANGE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                    "fp16": torch.float16, "half": torch.float16}  # fmt: skip


def _exchange_dtype(value: Any) -> Optional[torch.dtype]:
    """``HybridParallel``'s ``exchange_dtype`` as a torch dtype (None: the tables' own)."""
    if value is None or value == "table":
        return None
    dtype = _EXCHANGE_DTYPES.get(value) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or dtype not in _EXCHANGE_DTYPES.values():
        raise ValueError(
            f"HybridParallel: exchange_dtype must be None or 'table' (rows travel in the tables' dtype), "
            f"torch.bfloat16 or torch.float16, or one of the names {sorted(_EXCHANGE_DTYPES)}; got {value!r}"
        )
    return dtype


def _high_priority(backend: str) -> Any:
    """Process group options whose collectives run on a high-priority stream (NCCL), else None."""
    if backend != "nccl" or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


_SPARSE = ("sync", "async")
_DENSE = ("ddp", "none")
_LOOKUP_ERRORS = ("raise", "raise_next")
_PREFETCH_DEPTHS = ("inserts", "header")


class HybridParallel(nn.Module):
    """Wraps an unchanged model for multi-process training: its ``DynamicEmbedding``
    tables are sharded row-wise across ranks, its dense parameters are data-parallel.

    Every rank feeds its own batch. A table lookup sends each id to the rank that owns
    it (``veloce.distributed.owner_of(id, world_size)``); owners look rows up (inserting
    new ids in training), pool each bag's part, and send partial sums back. In backward,
    each part's gradient goes back to its owner, which applies it in its ``step()``.
    Gradients are averaged over ranks like DDP's, sparse ones too: with every rank
    computing the mean loss of its own (equal-sized) batch, ``sparse="sync"`` trains
    exactly like one process on the global batch.

    Args:
        model: the model; its ``DynamicEmbedding`` submodules become shards (each rank
            keeps the rows it owns; ``len()``, ``find()``, ``export()`` and
            ``state_dict()`` answer for that shard).
        sparse: ``"sync"``: every update of step t is applied before step t + 1 starts.
            ``"async"``: the gradient exchange of step t runs in the background and its
            update is applied at step t + ``staleness`` (the exchange overlaps compute).
        staleness: async only: how many steps late an update is applied (>= 0; 0 = sync).
        dense: ``"ddp"`` (torch ``DistributedDataParallel`` over the dense parameters;
            skipped when there are none) or ``"none"`` (you average dense gradients).
        dedup: send each distinct id of a batch once and pool on the requester (one row per
            distinct id each way) instead of pooling bag parts on the owners: faster when
            ids repeat within a batch (hot ids, bags of one id). Same results (with an
            ``exchange_dtype``, rows rather than partial sums are rounded on the way).
        lookup_errors: what a sharded lookup does when an owner fails to serve it (a full
            table without eviction, out of memory): ``"raise"`` (default): every rank
            raises in that forward (the owner its own error, the others
            :class:`~veloce.distributed.ExchangeError`); the ranks agree through a
            collective read back to the host in every training forward. ``"raise_next"``:
            that agreement stays on the device and is read back later, which saves a host
            sync per forward. The forward then returns, with zeros for the failed owner's
            parts, and every rank raises at its next ``step()`` (before anything of the
            step is applied, dense parameters too with ``CombinedOptimizer``), sharded
            lookup or ``flush()``; the sparse gradients not yet applied then are dropped
            (that forward's never apply, in async mode either).
        prefetch_depth: how much of a later forward's exchange :meth:`prefetch` runs:
            ``"inserts"`` (default): the bucketing of ids by owner, the header, the ids'
            all-to-all and the owners' inserts (prefetch waits for the device there).
            ``"header"``: the bucketing and the header's all-to-all only, queued without a
            host sync (prefetch returns at once, so it may be called as early as right
            after the previous forward); the forward reads the header and runs the rest
            on the prefetch stream, its inserts where its own would run.
        exchange_dtype: the dtype in which embedding rows, partial sums and their gradients
            travel between ranks: None (default) sends them in the tables' dtype (exact);
            ``torch.bfloat16`` (or ``"bf16"``) halves the bytes of fp32 tables, as TorchRec's
            quantized communication does. Rows are rounded to it on the way (evaluation
            lookups too), then summed and applied in the tables' dtype. Prefer bfloat16:
            ``torch.float16`` keeps 3 more mantissa bits but has no loss scaling here, so
            gradients below about 6e-5 lose precision (below 6e-8 they vanish) and values
            above 65504 overflow (the owner's non-finite gradient check then fires).
            Tables stored in 16 bits send their own dtype. Ids, lengths and per-sample
            weights always travel exactly. Worth it where the exchange's bytes cost (many
            ranks, large dims, links slower than NVLink); the results are then no longer
            bit for bit those of one process. Every rank must pass the same value.
        process_group: the ranks to shard over (default: the whole world).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).

    Tables with feature admission (``admission=``, :mod:`veloce.admission`) count each id's
    sightings on its owner, which decides (the k-th sighting on any rank inserts), and share
    one default row: every rank keeps a replica, and each step applies the gradient of
    the refused ids summed over the ranks to every replica (one all-reduce of the row per
    process group and step), so the replicas stay identical (``docs/admission.md``).

    Tables with ``mode="max"`` are refused over several ranks. Over a ``process_group`` of
    one rank (in a larger world) nothing is sharded, and each rank's tables become its own
    (``per_rank=True``).

    Every rank must construct its tables with the same seed and initializer (rows start
    as a function of (seed, id), so shards agree with a single process) and call them in
    the same order. World size 1 is plain single-process training.

    Example::

        torch.distributed.init_process_group()          # torchrun sets the environment
        model = veloce.distributed.HybridParallel(model, sparse="sync")
        opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters()), model)
        for inputs, target in loader:                   # this rank's batches
            loss_fn(model(*inputs), target).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        sparse: str = "sync",
        staleness: int = 1,
        dense: str = "ddp",
        dedup: bool = False,
        lookup_errors: str = "raise",
        prefetch_depth: str = "inserts",
        exchange_dtype: Any = None,
        process_group: Optional[dist.ProcessGroup] = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()

        if sparse not in _SPARSE:
            raise ValueError(f"HybridParallel: sparse must be 'sync' or 'async', got {sparse!r}")
        if dense not in _DENSE:
            raise ValueError(f"HybridParallel: dense must be 'ddp' or 'none', got {dense!r}")
        if lookup_errors not in _LOOKUP_ERRORS:
            raise ValueError(f"HybridParallel: lookup_errors must be 'raise' or 'raise_next', got {lookup_errors!r}")
        if prefetch_depth not in _PREFETCH_DEPTHS:
            raise ValueError(f"HybridParallel: prefetch_depth must be 'inserts' or 'header', got {prefetch_depth!r}")
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"HybridParallel: staleness must be an int >= 0, got {staleness!r}")
        wire = _exchange_dtype(exchange_dtype)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "HybridParallel needs torch.distributed: call torch.distributed.init_process_group() first "
                "(torchrun sets its environment), or train without the wrapper in a single process"
            )
        if isinstance(model, HybridParallel):
            raise ValueError("HybridParallel: the model is already wrapped")
        self.module = model
        self.sparse = sparse
        self.dedup = bool(dedup)
        self.lookup_errors = lookup_errors
        self.prefetch_depth = prefetch_depth
        self.exchange_dtype = wire
        self.staleness = staleness if sparse == "async" else 0
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.tables = [(n, m) for n, m in model.named_modules() if isinstance(m, DynamicEmbedding)]
        taken = [n for n, m in self.tables if m.backend.sharded]
        if taken:
            raise ValueError(f"HybridParallel: table(s) {taken} are already sharded by another wrapper")
        maxed = [n for n, m in self.tables if m.mode == "max"]
        if maxed and self.world_size > 1:
            raise ValueError(
                f"HybridParallel: table(s) {maxed} pool with mode='max', which sharded tables do not support (an "
                f"owner pools only its part of a bag); use mode='sum' or 'mean' for tables sharded over ranks"
            )
        if self.world_size > 1:
            self._shard_tables(process_group)
        elif dist.get_world_size() > 1:
            for _, m in self.tables:  # a group of one rank: each rank's tables are its own
                m.per_rank = True
        dense_params = [p for p in model.parameters() if p.requires_grad]
        ddp = None
        if dense == "ddp" and self.world_size > 1 and dense_params:
            # The tables' buffers join what the user told DDP to ignore, if anything.
            own = list(getattr(model, "_ddp_params_and_buffers_to_ignore", None) or [])
            ignored = [f"{name}.{b}" if name else b for name, m in self.tables for b, _ in m.named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(dict.fromkeys(own + ignored)))
            devices = {p.device for p in dense_params}
            device_ids = [next(iter(devices))] if len(devices) == 1 and next(iter(devices)).type == "cuda" else None
            self._ddp_kwargs = dict(device_ids=device_ids, process_group=process_group, **ddp_kwargs)
            try:
                ddp = DistributedDataParallel(model, **self._ddp_kwargs)
            except BaseException:
                # (a mistyped DDP argument, say) the tables as they were, so that a corrected
                # call can wrap them
                for _, m in self.tables:
                    m.backend = LocalBackend()
                model._ddp_params_and_buffers_to_ignore = own
                raise
        object.__setattr__(self, "_ddp", ddp)  # not a submodule: model's state appears once
        self._process_group = process_group

    def _check_same_admission(self, process_group: Optional[dist.ProcessGroup]) -> None:
        """Raises on every rank when the ranks' tables differ in admission policy: the owners
        would decide differently, and the extra exchanges of admitting tables (sighting
        counts, the default row's gradient) would run on some ranks only and hang."""
        mine = [(n, repr(m.table.admission)) for n, m in self.tables]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine, group=process_group)
        for rank, theirs in enumerate(every):
            if theirs != mine:
                differ = [f"{n!r}: {a} here, {b} on rank {rank}" for (n, a), (_, b) in zip(mine, theirs) if a != b]
                raise ValueError(
                    f"HybridParallel: the ranks' tables differ in feature admission ({'; '.join(differ) or theirs}); "
                    f"give every rank's tables the same admission= policy (type, min_count or p, width, depth, seed)"
                )  # fmt: skip

    def _shard_tables(self, process_group: Optional[dist.ProcessGroup]) -> None:
        self._check_same_admission(process_group)  # once, at wrap time: every rank takes part
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        backend = dist.get_backend(process_group)
        # Sparse exchanges get their own groups: they never queue behind DDP's all-reduces,
        # and async gradient exchanges never queue behind the next step's lookups.
        # With a subgroup, only its ranks take part in creating the new groups.
        local = {"use_local_synchronization": True} if ranks is not None else {}
        lookup_group = Group(dist.new_group(ranks=ranks, backend=backend, **local))
        grad_group = Group(dist.new_group(ranks=ranks, backend=backend, **local)) if self.sparse == "async" else None
        # prefetch()'s exchanges too: they run while the previous step's are still queued.
        # (NCCL sets a communicator up at its first collective: unused, it costs nothing.)
        # Its NCCL stream has high priority, like the side stream prefetch() runs on: the
        # header's all-to-all would otherwise start only once the kernels queued before it on
        # the current stream (the previous step's tail) have left the GPU's SMs.
        urgent = _high_priority(backend)
        dispatch_group = Group(dist.new_group(ranks=ranks, backend=backend, pg_options=urgent, **local))
        for tag, (name, m) in enumerate(self.tables):
            m.backend = Shard(lookup_group, tag, self.sparse, self.staleness, grad_group, self.dedup,
                             self.lookup_errors, dispatch_group, self.exchange_dtype, weakref.ref(self))  # fmt: skip
            m.table.hold_pins(self.staleness)  # a tiered shard keeps rows until their late gradients land
            if self.rank != 0:  # every rank's copy of the sketch so far is the whole table's: rank 0 saves it
                m.table.mark_sketch_shared()
        modules = [m for _, m in self.tables]
        lookup_group.on_failure = lambda: drop_failed_gradients(modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped model (through DDP when dense parameters are data-parallel)."""

        if _capture.ACTIVE is not None and _capture.ACTIVE.averaging is self:
            return self.module(*args, **kwargs)  # a captured step (CUDAGraphStep) averages the dense gradients itself
        if self.prefetch_depth == "header" and self.tables and self.world_size > 1:
            complete_prefetched(self.tables[0][1].backend.group)
        return (self._ddp or self.module)(*args, **kwargs)

    @property
    def ddp(self) -> Optional[DistributedDataParallel]:
        """The ``DistributedDataParallel`` over the dense parameters, or None (``dense="none"``,
        no dense parameters, or one rank)."""
        return self._ddp

    def remake_ddp(self, stream: Any) -> None:
        """Makes DDP again with ``stream`` current (a collective: every rank calls it), for a
        step captured on that stream (CUDAGraphStep): DDP keeps the dense parameters'
        gradient-accumulation nodes alive, and a node made on another stream ties the
        backward to that stream, which a capture refuses."""
        if self._ddp is None:
            return
        object.__setattr__(self, "_ddp", None)  # the old reducer, and its nodes, go first
        with torch.cuda.stream(stream):
            ddp = DistributedDataParallel(self.module, **self._ddp_kwargs)
        object.__setattr__(self, "_ddp", ddp)

    @torch.no_grad()
    def average_dense_grads(self) -> None:
        """What DDP does to the dense gradients, as one all-reduce per dtype with no host
        work per bucket: for a step captured in a CUDA graph (CUDAGraphStep), which runs
        the model without DDP and calls this before the dense optimizer's step."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.module.parameters():
            if p.requires_grad and p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)  # divided first, as DDP does
            dist.all_reduce(flat, group=self._process_group)
            for g, f in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(f.view_as(g))

    def prefetch(self, *args: Any, **kwargs: Any) -> None:
        """Starts the sparse exchange of a later ``forward(*args, **kwargs)`` now: the ids go
        to their owners, which insert them. Call it right after ``step()`` with the next
        batch (TorchRec pipelines its input distribution the same way)::

            model.prefetch(*next_inputs)
            for inputs, target in batches:              # next_inputs is the first
                loss_fn(model(*inputs), target).backward(); opt.step(); opt.zero_grad()
                model.prefetch(*following_inputs)       # before the next forward, if any

        The forward then runs only the exchange's second half (the owners' lookups and the
        partial sums back), with no host sync when ``lookup_errors="raise_next"``; the
        first half's host syncs (the split sizes, the inserts' counts) wait for this
        exchange alone while the GPU still runs the previous step. On CUDA it runs on a
        high-priority side stream; tensors on the CPU (as a data loader yields them) are
        copied to the device there. Tensors already on the GPU make that stream wait for all
        work queued so far (they may come from it): correct, but then nothing overlaps.

        It may also be called between ``backward()`` and ``step()``: the inserts then run
        beside the backward's tail, before that step's update is queued, which finds the
        rows a growth moved by their ids (and gives rows evicted meanwhile nothing, as the
        next insert would have evicted them after it).

        Results are those of the forward alone, bit for bit (tested, sync and async, with
        the tables growing while prefetched). The model must say which
        lookups its forward makes: ``model.sparse_lookups(*args, **kwargs)`` returns them as
        ``[(tables, inputs), ...]`` groups in call order, each as :func:`veloce.lookup_many`
        takes them (``veloce.models`` define it). Each prefetched group is taken by the next
        sharded lookup of the same tables; a forward that looks up other tables raises
        ``ValueError``, one given inputs of other shapes fails on every rank (see
        ``docs/distributed.md``). Prefetch one batch ahead: a table whose prefetched lookup
        no forward has taken yet cannot be prefetched again. Collective: every rank calls
        it. A no-op at world size 1. Not available with ``dedup=True``.
        """
        # Not under no_grad: whether per-sample weights require grad is part of the exchange's
        # signature, and must be what the forward will see (weights computed by the model too).
        lookups = getattr(self.module, "sparse_lookups", None)
        if lookups is None:
            raise TypeError(
                f"HybridParallel.prefetch: {type(self.module).__name__} has no sparse_lookups(*inputs) method "
                f"returning the [(tables, inputs)] groups its forward looks up (veloce.models define one)"
            )  # fmt: skip
        if self.world_size == 1 or not self.tables:
            return

        dev = self.tables[0][1].table.device
        if dev.type != "cuda":
            for tables, inputs in lookups(*args, **kwargs):
                dispatch_many(tables, inputs, self.prefetch_depth)
            return
        groups = {id(m.backend.group): m.backend.group for _, m in self.tables}.values()
        queued = [len(g.prefetched) for g in groups]
        on_gpu = [t for t in _tensors((args, kwargs)) if t.is_cuda]
        # Inputs on the GPU may come from work queued on the current stream: wait for it.
        # A header-only prefetch touches no table and its results are used on the prefetch
        # stream first (the forward's _complete): the current stream need not wait for its
        # header swap, which ends when every rank's has begun; only for its reads of the
        # inputs (and of what sparse_lookups computed from parameters), which later work
        # there may overwrite.
        join = self.prefetch_depth != "header"
        with on_prefetch_stream(dev, wait=bool(on_gpu), join=join) as main:
            try:
                args, kwargs = _to_device((args, kwargs), dev)
                for t in on_gpu:
                    t.record_stream(current_stream(dev))
                for tables, inputs in lookups(*args, **kwargs):
                    dispatch_many(tables, inputs, self.prefetch_depth)
            finally:
                for g, n in zip(groups, queued):  # also those queued before a later group failed
                    for d in list(g.prefetched)[n:]:
                        record_streams(d.tensors(), main)  # allocated on the side stream, used on main
                        if not join:
                            read = getattr(d, "read", None)
                            if read is not None:
                                main.wait_event(read)
                            else:  # failed before its header: wait for whatever it read
                                main.wait_stream(current_stream(dev))

    def train(self, mode: bool = True) -> "HybridParallel":
        super().train(mode)
        if self._ddp is not None:
            self._ddp.train(mode)
        return self

    @torch.no_grad()
    def flush(self) -> None:
        """Async mode: waits for every sparse gradient still in flight and applies it, so
        the tables hold every update (call before evaluating, exporting or checkpointing
        at the end of training). Collective: every rank calls it, in sync mode too (where
        it applies nothing and only meets the other ranks: a barrier)."""
        raise_deferred([m for _, m in self.tables])  # a failed step's error first: nothing moved yet
        for _, m in self.tables:
            if m.backend.in_flight:
                m.backend.flush(m)
                apply_pending(m)
        if self.world_size > 1:
            dist.barrier(group=self.tables[0][1].backend.group.group if self.tables else None)

    @torch.no_grad()
    def unwrap(self) -> nn.Module:
        """Removes the sharding hooks and returns the model (each table keeps its shard).
        Async sparse gradients still in flight are waited for and kept as the tables'
        pending gradients, for their next ``step()`` (a ``zero_grad()`` before it drops
        them). Call it on every rank: a failure of an earlier step that was deferred
        (``lookup_errors`` or ``nonfinite_grad`` "raise_next") is raised first, on every
        rank, with the model still wrapped and that step's gradients dropped. While several
        ranks run, a training lookup of an unwrapped table then raises (each rank would
        train its shard alone) unless the table is ``per_rank``."""
        raise_deferred([m for _, m in self.tables])
        for _, m in self.tables:  # every table's, before any is unwrapped
            if m.backend.in_flight:
                m.backend.flush(m)
        for _, m in self.tables:
            m.backend = LocalBackend()
            m.table.hold_pins(0)
        return self.module

    def extra_repr(self) -> str:
        return (
            f"sparse={self.sparse!r}, staleness={self.staleness}, dedup={self.dedup}, "
            f"lookup_errors={self.lookup_errors!r}, prefetch_depth={self.prefetch_depth!r}, "
            f"exchange_dtype={self.exchange_dtype}, "
            f"world_size={self.world_size}, "
            f"tables={len(self.tables)}, dense={'ddp' if self._ddp is not None else 'none'}"
        )
