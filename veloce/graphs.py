"""A whole training step as one CUDA graph: :class:`CUDAGraphStep`.

On a GPU, a step of a model with many small layers and tables is often bound by the host:
Python and the launches of a few hundred kernels take longer than the kernels themselves
(configuration 5's DLRM on one H200 with TF32 matmuls: 7.3 ms eager, 3.9 ms of GPU work;
``benchmarks/README.md``, twenty-eighth session). A CUDA graph captures the step's kernels
once and replays them with one launch.

What makes a veloce step capturable (see :mod:`veloce._capture`): while capturing, every
training insert defers its read-back and stamps its LRU clocks from device tensors; every
fused update reads its learning rate and step count from device tensors; the graph advances
both itself. The wrapper carries the host's bookkeeping across replays: it reads each
replay's insert counts (the table sizes) and NaN/Inf check before the next replay, raising
their errors as ``step()`` would; it grows a table that a replay could fill and captures
again; it moves the learning rates of a :class:`veloce.optim.CombinedOptimizer` (an LR
scheduler's) to the device before each replay.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from veloce import _capture, _update_stream
from veloce._device import current_stream
from veloce.distributed import static
from veloce.embedding import DynamicEmbedding, _DeferredCheck, _raise_deferred
from veloce.optim import CombinedOptimizer
from veloce.table import TableFullError, _DeferredCounts

__all__ = ["CUDAGraphStep"]


def _needed_default_stream(e: BaseException) -> bool:
    """Whether a failed capture's error (or one it was raised while handling: the capture's
    end reports only that the capture was invalidated) is CUDA's refusal to make the legacy
    default stream depend on the capture."""
    seen: set[int] = set()
    x: Optional[BaseException] = e
    while x is not None and id(x) not in seen:
        if "legacy stream depend on a capturing" in str(x):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


class CUDAGraphStep:
    """Runs ``fn(*inputs)``, a whole training step, as one CUDA graph.

    ``fn`` is the step as it would run eagerly: forward, loss, ``backward()``, the
    optimizer's ``step()`` and ``zero_grad()``; it returns a tensor, a tuple or list of
    tensors, or None. The first ``warmup`` calls run it eagerly; the next one captures it
    (the Python in ``fn`` then runs once) and every call after that copies its inputs into
    the graph's own and replays it. The results are those of eager steps, with two
    differences: the sparse tables' inserts always defer their read-back
    (``DynamicEmbedding(defer_inserts=True)``'s semantics), and a NaN/Inf gradient of a
    checked table (``"raise"`` or ``"raise_next"``) is reported as with ``"raise_next"``, by
    the next call (the failed step applied nothing). ``"skip"`` cannot be captured; each table
    is stepped once per step.

    Rules, as for any CUDA graph:
    - every call passes tensors of the shapes, dtypes and device of the first captured one
      (pad the last batch, drop it, or run it with :meth:`eager`); a different shape raises
      ``ValueError``;
    - ``fn`` is captured, not re-run: work that must happen at every step on the host (LR
      schedulers, logging) goes outside it. The sparse tables' learning rates follow the
      ``CombinedOptimizer`` given as ``optimizer`` (its groups are read before each replay);
      the dense optimizer must keep its state on the device
      (``torch.optim.Adam(..., capturable=True)``); its float hyperparameters are baked into
      the graph, so a change (an LR scheduler's) captures the step again, with a warning:
      give it a tensor ``lr`` to schedule it without new captures;
    - the returned tensors are the graph's outputs, overwritten by the next call: clone what
      you keep;
    - the tables must be on one CUDA device and able to grow (a table at its
      ``max_capacity`` rows would have to evict, which a graph cannot).

    **Sharded tables** (``HybridParallel`` over NCCL, ``sparse="sync"``, without ``dedup``,
    ``padding_idx`` or per-sample weights): every call first replays a small graph that
    buckets the batch's ids by owner and swaps the counts, reads the largest over all
    ranks (the step's one host sync), and replays the step's graph for capacities that
    hold them (:mod:`veloce.distributed.static`: padded, equal-split all-to-alls; the
    capacities only grow, so after a few steps the graph stops changing). ``lookups``
    must then say which lookups the model makes (``veloce.models`` define
    ``sparse_lookups``). The dense gradients are averaged inside the graph by one
    all-reduce before the dense optimizer's step (DDP is bypassed there), so ``optimizer``
    must be the ``CombinedOptimizer`` holding the dense optimizer. Every rank makes the
    same calls; a table grown on one rank captures again there alone. Pass each call the
    next batch (``step(*batch, next_inputs=following)``) and the next call's counting
    phase runs beside this step, so that the device goes from step to step without waiting
    for the host (see :meth:`__call__`).

    Args:
        fn: the training step.
        model: the module holding the ``DynamicEmbedding`` tables ``fn`` trains (searched
            recursively).
        optimizer: the ``CombinedOptimizer`` ``fn`` steps, if any.
        warmup: eager calls before the capture (lazy initialisation, e.g. the optimizers'
            state, must not happen inside it). At least 1.
        lookups: for sharded tables: ``lookups(*inputs)`` returns the step's lookups as
            ``[(tables, table_inputs), ...]`` in the order the forward makes them (for a
            ``veloce.models`` model: ``lambda dense, sparse, label: model.sparse_lookups(dense,
            sparse)``).

    Example::

        opt = veloce.optim.CombinedOptimizer(torch.optim.Adam(model.parameters(), capturable=True), model)

        def train_step(dense, sparse, label):
            loss = loss_fn(model(dense, sparse), label)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = veloce.graphs.CUDAGraphStep(train_step, model, opt)
        for dense, sparse, label in loader:
            loss = step(dense, sparse, label)
    """

    def __init__(self, fn: Callable[..., Any], model: nn.Module, optimizer: Optional[CombinedOptimizer] = None,
                 warmup: int = 2, lookups: Optional[Callable[..., Any]] = None) -> None:  # fmt: skip
        if not callable(fn):
            raise TypeError(f"CUDAGraphStep: fn must be callable, got {type(fn).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"CUDAGraphStep: model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, CombinedOptimizer):
            raise TypeError(
                f"CUDAGraphStep: optimizer must be a veloce.optim.CombinedOptimizer (or None), got {type(optimizer).__name__}"
            )
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"CUDAGraphStep: warmup must be an int >= 1, got {warmup!r}")
        self.fn, self.model, self.optimizer, self.warmup, self.lookups = fn, model, optimizer, warmup, lookups
        self.modules = [m for m in model.modules() if isinstance(m, DynamicEmbedding)]
        if not self.modules:
            warnings.warn("CUDAGraphStep: the model has no DynamicEmbedding", RuntimeWarning, stacklevel=2)
        self._check_modules()
        self._sharded = any(m._shard is not None for m in self.modules)
        self._hp: Any = None  # the HybridParallel whose dense gradients the graph averages
        dev = self.modules[0].table.device if self.modules else torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(dev)  # every capture's (see HybridParallel._remake_ddp)
        if self._sharded:
            self._check_sharded()
            if self._hp is not None:
                self._hp._remake_ddp(self._stream)
        self._planner = static.Planner()
        self._count_graph: Optional[torch.cuda.CUDAGraph] = None  # sharded: the counting phase
        self._count_host: Optional[torch.Tensor] = None
        self._count_inputs: list[torch.Tensor] = []  # the counting phase's inputs (the step's: _static)
        self._counted: list = []  # the counting phase's results
        self._step_counted: list = []  # the step's copy of them (static.staged)
        self._ahead: Optional[_Ahead] = None  # the next call's counting phase, run ahead (next_inputs)
        self._caps: list = []
        self._plans: list = []
        self._status: Optional[torch.Tensor] = None  # sharded: this rank's verdict, read by the counting phase
        self._calls = 0
        self.captures = 0  # how many times the step was captured (growth captures it again)
        # Whether the last call ran its step (replayed or eagerly), also when it then raised
        # an earlier replay's error (next_inputs: read once this step is launched).
        self.stepped = False
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._static: list[torch.Tensor] = []
        self._out: Any = None
        self._log: Optional[_capture.Capture] = None
        self._tensors: list[tuple] = []  # the tables' tensors at capture (growth replaces them)
        self._tables = list({id(m.table): m.table for m in self.modules}.values())  # modules may share one
        self._host_delta: dict[int, int] = {}  # id(module) -> steps, id(table) -> clock ticks, per replay
        self._mirror: dict[int, tuple] = {}  # what the device scalars hold: id -> value
        self._hyper: list = []  # the dense optimizer's settings baked into the graph
        self._warned_hyper = False

    # ---- checks -----------------------------------------------------------------------
    def _check_modules(self) -> None:
        devices = {m.table.device for m in self.modules}
        if any(d.type != "cuda" for d in devices) or len(devices) > 1:
            raise ValueError(
                f"CUDAGraphStep: the tables must be on one CUDA device, got {sorted(str(d) for d in devices)}"
            )
        for m in self.modules:
            if m.nonfinite_grad == "skip":
                raise ValueError(
                    "CUDAGraphStep: nonfinite_grad='skip' reads the gradient's check on the host; use 'raise', "
                    "'raise_next' or 'apply' for a captured step"
                )
        dense = self.optimizer.dense if self.optimizer is not None else None
        if dense is not None and any(g.get("capturable") is False for g in dense.param_groups):
            raise ValueError(
                f"CUDAGraphStep: the dense optimizer ({type(dense).__name__}) keeps its state on the host; construct "
                f"it with capturable=True"
            )

    def _check_sharded(self) -> None:
        from veloce.distributed.hybrid import HybridParallel

        for m in self.modules:
            if m._shard is None:
                continue
            static.check_static([m])
            if m._shard.group.backend != "nccl":
                raise ValueError(f"CUDAGraphStep: sharded tables need the NCCL backend, got {m._shard.group.backend!r}")
        if not callable(self.lookups):
            raise ValueError(
                "CUDAGraphStep: the model's tables are sharded (HybridParallel): pass lookups=, a function of the "
                "step's inputs that returns the model's lookups, e.g. lambda dense, sparse, label: "
                "model.module.sparse_lookups(dense, sparse)"
            )  # fmt: skip
        wrappers = {id(w): w for w in (m._shard.wrapper() if m._shard.wrapper is not None else None
                                       for m in self.modules if m._shard is not None) if w is not None}  # fmt: skip
        if len(wrappers) != 1:
            raise ValueError(
                f"CUDAGraphStep: the sharded tables must belong to one live HybridParallel, found {len(wrappers)}"
            )
        self._hp = next(iter(wrappers.values()))
        if not isinstance(self._hp, HybridParallel):
            raise TypeError(f"CUDAGraphStep: the tables' wrapper is a {type(self._hp).__name__}")
        if self._hp._ddp is not None:
            if self.optimizer is None or self.optimizer.dense is None:
                raise ValueError(
                    "CUDAGraphStep: a HybridParallel model's dense gradients are averaged inside the graph before "
                    "the dense optimizer's step: pass the CombinedOptimizer that holds it as optimizer"
                )  # fmt: skip

    @staticmethod
    def _check_tensors(inputs: Sequence[Any], where: str) -> None:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{where}: input {i} must be a tensor, got {type(x).__name__}")

    def _check_inputs(self, inputs: Sequence[Any]) -> None:
        self._check_tensors(inputs, "CUDAGraphStep")
        if not self.matches(*inputs):
            got = [(tuple(x.shape), x.dtype) for x in inputs]
            want = [(tuple(s.shape), s.dtype) for s in self._static]
            raise ValueError(
                f"CUDAGraphStep: the step was captured for inputs {want}, got {got}; a graph replays fixed "
                f"shapes: pad the batch to the captured shape, run it with eager(...) (the last batch of an "
                f"epoch), or call reset() to capture again"
            )

    # ---- the call ---------------------------------------------------------------------
    def __call__(self, *inputs: torch.Tensor, next_inputs: Optional[Sequence[torch.Tensor]] = None) -> Any:
        """One step: ``fn(*inputs)``, eagerly while warming up, then replayed.

        ``next_inputs`` (sharded tables): the inputs the next call will pass, the same
        tensor objects, left unwritten until then. That call's counting phase then runs now, on a side stream and a
        communicator of its own, beside this step, so that the next call reads its needs
        without waiting for this step and launches its graph while this one still runs:
        the device goes from step to step without the host's round trip between them. A
        replay's errors (NaN/Inf gradients, refused inserts) are then read by the next
        call once it has launched its own replay, and raised there: the step after a
        failed one runs (with the failed step in its optimizer step count). Every rank
        passes them or None alike. Ignored without sharded tables, while warming up, and
        when this step runs eagerly (a batch holding the padding id) or raises."""
        self.stepped = False
        self._check_inputs(inputs)
        if next_inputs is not None:
            self._check_tensors(next_inputs, "CUDAGraphStep(next_inputs=)")
            ref = self._static or inputs  # (before the first capture: this call's, which it captures)
            if not _alike(next_inputs, ref):
                raise ValueError(
                    f"CUDAGraphStep: next_inputs must be of the captured shapes {[tuple(r.shape) for r in ref]}, "
                    f"got {[tuple(x.shape) for x in next_inputs]}"
                )  # fmt: skip
        self._calls += 1
        ahead = self._ahead
        if ahead is not None and (len(ahead.inputs) != len(inputs)
                                  or any(a is not x for a, x in zip(ahead.inputs, inputs))):  # fmt: skip
            self.discard_ahead()  # (its collectives ran on every rank: the results are dropped)
            raise ValueError(
                "CUDAGraphStep: the last call's next_inputs announced other tensors than this call's inputs; pass "
                "the very tensors announced (every rank alike: the announced step's counting phase has run)"
            )  # fmt: skip
        if self._calls <= self.warmup:
            out = self._eager(inputs)
            self.stepped = True
            return out
        if self._sharded:
            from veloce.distributed._comm import raise_deferred_failures

            try:
                for g in {id(m._shard.group): m._shard.group for m in self.modules if m._shard is not None}.values():
                    raise_deferred_failures(g)  # an eager step's (lookup_errors="raise_next"; agreed: all raise)
            except BaseException:
                self.discard_ahead()
                raise
        self._ahead = None
        # The last replay's errors (bad offsets, NaN/Inf gradients) first, as step() raises
        # them; this reads its insert counts (the sizes) too. (Sharded: the NaN/Inf check is
        # agreed over the ranks, so all raise alike.) With the counting phase run ahead, they
        # are read once this step is launched (``unread``), and raised once it is booked, so
        # that every rank queues the same replays.
        unread = ahead is not None
        if not unread:
            _raise_deferred(self.modules)
        late: Optional[BaseException] = None
        plans = None
        if self._sharded:
            if ahead is None:
                # Room for the step: an error on this rank alone travels in the counting
                # phase's all-reduce, so that every rank raises, none waits in a replay.
                error = self._room_error(self._plans)
                self._count(inputs, error, ahead=False)
                plans = self._fit(error)
            else:
                plans = self._fit(ahead.error)
            if plans is None:  # some rank's batch holds the static exchange's padding id
                if unread:  # (raised after the step, as after a replay: every rank runs it eagerly)
                    late = self._read_last()
                out = self._eager(inputs)
                self.stepped = True
                if late is not None:
                    raise late
                return out
        if self._graph is not None and not self._valid():
            self._drop_graph()
        if self._graph is None:
            if unread:  # (the capture runs the step's Python: nothing may be left to read)
                late, unread = self._read_last(), False
            try:
                self._capture(inputs, plans)
            except BaseException as e:
                if late is not None:
                    raise e from late  # (the last replay's error too)
                raise
        self._sync_scalars()
        for t in self._tables:  # an eager update since (run outside the graph): the replay waits for it
            if t._update_fence is not None:
                t._join_update()
        if self._sharded:  # the counting phase's inputs and results, for the graph to read
            torch.cuda.current_stream().wait_event(self._count_done)
            for s, x in zip(self._static, self._count_inputs):
                s.copy_(x, non_blocking=True)
            for dst, src in zip(self._step_counted, self._counted):
                static.stage(dst, src)
            self._staged.record()
        else:
            for s, x in zip(self._static, inputs):
                s.copy_(x, non_blocking=True)
        self._graph.replay()
        self.stepped = True
        try:
            if unread:  # the last replay's, read while this one is queued
                late = self._read_last()
        finally:
            self._after_replay()  # (this replay ran: its bookkeeping whatever the reading met)
        if late is not None:
            raise late
        if self._sharded and next_inputs is not None:
            self._count_ahead(next_inputs)
        return self._out

    def _read_last(self) -> Optional[BaseException]:
        """Reads what the last replay left for the host (see ``_raise_deferred``: insert
        counts, NaN/Inf checks) and returns its error, if any, for the caller to raise once
        this call's replay is booked. Everything is read even then (a refused insert's
        error does not leave the checks unread)."""
        try:
            _raise_deferred(self.modules)
            return None
        except Exception as e:  # noqa: BLE001 - the caller raises it
            for t in self._tables:
                t.settle(refusals=False)
            for m in self.modules:
                m._settle_check()  # (a failed check's error is raised by the next call)
            return e

    def matches(self, *inputs: Any) -> bool:
        """Whether ``inputs`` may be passed to a call: tensors, of the captured shapes, dtypes
        and device once the step is captured."""
        if not all(isinstance(x, torch.Tensor) for x in inputs):
            return False
        if not self._static:
            return True
        return _alike(inputs, self._static)

    def eager(self, *inputs: torch.Tensor) -> Any:
        """``fn(*inputs)`` run eagerly, of any shapes (say, the short last batch of an
        epoch), between replays: the graph stays, and the next replay starts from the state
        this step leaves (its step counts, clocks, table sizes and rows). It runs on the
        stream the captures use (after the work queued on the current stream, which then
        waits for it), so that a graph it leaves alive cannot break a later capture."""
        self._check_tensors(inputs, "CUDAGraphStep.eager")
        return self._eager(inputs)

    def discard_ahead(self) -> None:
        """Drops the counting phase that the last call's ``next_inputs`` launched, if any (the
        loop stopped before that batch's step): the next call counts its own inputs. Call it
        on every rank alike."""
        if self._ahead is not None:
            self._ahead.done.synchronize()  # (its collectives ran on every rank)
            self._ahead = None

    def reset(self) -> None:
        """Drops the graph: the next call captures the step again (of new shapes, if they
        changed). Sharded tables: the counting phase too; call it on every rank (the next
        call counts and captures again, which runs collectives)."""
        self.discard_ahead()
        self._drop_graph()
        self._static = []
        self._count_graph, self._caps, self._plans, self._counted, self._step_counted = None, [], [], [], []
        self._planner = static.Planner()

    def _drop_graph(self) -> None:
        """Drops the step's graph (growth, moved tensors): captured again at the next call, with
        the same counting phase and capacities (a change a rank makes alone)."""
        self._graph, self._log, self._out = None, None, None
        if not self._sharded:
            self._static = []

    # ---- sharded tables: the counting phase -----------------------------------------------
    def _count(self, inputs: Sequence[torch.Tensor], error: Optional[BaseException], ahead: bool) -> None:
        """Runs the counting phase of the step's static exchanges on ``inputs`` (a graph of
        its own, captured at first): on the current stream, or with ``ahead`` on the side
        stream, beside the step just launched. ``error``: this rank cannot run the step
        (its status in the agreement; :meth:`_fit` raises it, the other ranks ExchangeError)."""
        dev = self.modules[0].table.device
        if self._count_graph is None:
            self._count_inputs = [x.clone() for x in inputs]
            self._static = [x.clone() for x in inputs]  # the step's: the counting phase's, copied
            self._status = torch.zeros(1, dtype=torch.long, device=dev)
            counted = self._planner.count(self.lookups(*self._count_inputs))  # eagerly first: constants, communicators
            agreed = static.agree(counted, self._status)
            self._count_host = torch.empty(agreed.shape, dtype=agreed.dtype, pin_memory=True)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream):
                counted = self._planner.count(self.lookups(*self._count_inputs))
                self._count_host.copy_(static.agree(counted, self._status), non_blocking=True)
            self._count_graph, self._counted = graph, counted
            self._step_counted = [static.staged(c) for c in counted]
            self._count_done, self._staged = torch.cuda.Event(), torch.cuda.Event()
            self._side = torch.cuda.Stream(dev, priority=-1)  # the counting phase run ahead
        stream = self._side if ahead else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            if ahead:  # after the last step's copies (and, before them, whatever made inputs)
                stream.wait_event(self._staged)
            else:  # after a count run ahead and dropped (a no-op once it is done, or if none ran)
                stream.wait_event(self._count_done)
            for s, x in zip(self._count_inputs, inputs):
                s.copy_(x, non_blocking=True)
                if ahead:
                    x.record_stream(stream)
            self._status.fill_(int(error is not None))
            self._count_graph.replay()
            self._count_done.record(stream)

    def _count_ahead(self, inputs: Sequence[torch.Tensor]) -> None:
        """The next call's counting phase, launched now (``next_inputs``), with this rank's
        verdict on room for it (this step's inserts counted at their bounds)."""
        error = self._room_error(self._plans)
        self._count(inputs, error, ahead=True)
        self._ahead = _Ahead(tuple(inputs), error, self._count_done)

    def _fit(self, error: Optional[BaseException]) -> Optional[list]:
        """Reads the counting phase's needs over all ranks (the step's one host sync): the
        plans of the exchanges, or None when this step must run eagerly. New capacities
        drop the step's graph."""
        self._count_done.synchronize()
        assert self._count_host is not None
        if error is not None:
            raise error
        caps = self._planner.fit(self._counted, self._count_host.tolist())  # raises when another rank failed
        if caps is None:
            return None
        if self._planner.changed:  # some rank's capacities changed: the same on every rank
            if caps != self._caps:
                self._drop_graph()
                self._caps = list(caps)
                self._plans = [static.prepare(c, k) for c, k in zip(self._step_counted, caps)]
            # Room for the new capacities: a rank that cannot make it makes every rank raise.
            failed = self._room_error(self._plans)
            from veloce.distributed._comm import agree_sum

            if agree_sum(self._counted[0].group, int(failed is not None)):
                if failed is not None:
                    raise failed
                raise static.ExchangeError(
                    "CUDAGraphStep: another rank could not make room for this step's ids (its own error says why, "
                    "e.g. a table full at its max_capacity); every rank stops here"
                )  # fmt: skip
        return self._plans

    def _room_error(self, plans: Sequence[Any]) -> Optional[BaseException]:
        """Grows (outside any graph) every table that lacks room for ``plans``' ids; the error
        that stopped it, if one did (a table at its max_capacity, out of memory)."""
        need: dict[int, tuple[Any, int]] = {}  # per table: a table may be looked up in several exchanges
        for plan in plans:
            for m, n in zip(plan.counted.modules, plan.caps.table_ids):
                need[id(m.table)] = (m.table, need.get(id(m.table), (m.table, 0))[1] + n)
        try:
            for t, n in need.values():
                if _short_of_room(t, n):
                    self._grow(t, n)
        except Exception as e:  # noqa: BLE001 - raised after the ranks agree
            return e
        return None

    def _eager(self, inputs: Sequence[torch.Tensor]) -> Any:
        """``fn(*inputs)`` run eagerly on the captures' stream (warm-up steps, eager steps).

        Autograd runs a leaf's AccumulateGrad node, and syncs the leaf's gradient, on the
        stream the node was made on, and the node lives as long as some graph holding it
        does (a loss the caller keeps, DDP's hooks). A node made by an eager step on the
        default stream and still alive at a later capture makes the capture depend on the
        legacy stream, which it refuses (``cudaErrorStreamCaptureImplicit``); one made on
        another side stream would make it wait on work outside the capture. Made on the
        captures' own stream, it is what a capture would make. (HybridParallel's DDP is
        made on that stream too.) The tensors the step allocates there and the caller uses
        afterwards are safe: every later use of the stream waits for the caller's stream
        first.

        An update it queued keeps a fence whose origin is the captures' stream; the caller's
        stream becomes its origin, so that the next replay's join (on the caller's stream)
        drops it, as it dropped the fence of an eager step on that stream: the captures'
        stream waits for the caller's before its next use."""
        stream = self._stream
        caller = current_stream(stream.device)  # (the tables' device, also when another is current)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                out = self.fn(*inputs)
        finally:  # also when fn raises: the caller's stream comes after what fn queued
            caller.wait_stream(stream)
            for t in self._tables:
                fence = t._update_fence
                if fence is not None and fence.origin == stream:
                    fence.origin = caller
        return out

    # ---- capture ----------------------------------------------------------------------
    def _capture(self, inputs: Sequence[torch.Tensor], plans: Optional[list] = None) -> None:
        for attempt in range(64):
            for t in self._tables:  # nothing in flight that the graph would have to wait for
                t.settle()
            torch.cuda.synchronize()
            for t in self._tables:  # all has run: no event of another stream to wait for inside the capture
                t._update_fence = None
                t._changed = None
            _update_stream.release_done()
            saved = self._host_state()
            log = _capture.Capture()
            dev = self.modules[0].table.device if self.modules else torch.device("cuda")
            for m in self.modules:
                log.clocks[id(m.table)] = torch.tensor([m.table.clock], dtype=torch.int64, device=dev)
                opt = m.optimizer
                log.hparams[id(m)] = torch.tensor(
                    [self._lr_of(m, None), float(m._steps), float(opt.weight_decay), *opt.hyperparameters()],
                    dtype=torch.float64, device=dev,
                )  # fmt: skip
            inputs_at = self._static if plans is not None else [x.clone() for x in inputs]
            graph = torch.cuda.CUDAGraph()
            _capture.ACTIVE = log
            hook = None
            if plans is not None:
                static.PLANNED.clear()
                static.PLANNED.extend(plans)
                static.EXPECTING = True
                if self._hp is not None and self._hp._ddp is not None:
                    log.averaging = self._hp
                    hook = self.optimizer.dense.register_step_pre_hook(lambda *_: self._hp._average_dense_grads())
            try:
                with torch.cuda.graph(graph, stream=self._stream):
                    out = self.fn(*inputs_at)
                if static.PLANNED:
                    raise ValueError(
                        f"CUDAGraphStep: the step made {len(plans) - len(static.PLANNED)} sharded lookups where its "
                        f"lookups() said {len(plans)}"
                    )  # fmt: skip
            except _capture.NeedsRoom as e:
                self._restore(saved)
                self._grow(e.table, e.n)
                continue
            except BaseException as e:
                self._restore(saved)
                if _needed_default_stream(e):
                    raise RuntimeError(
                        "CUDAGraphStep: the capture of the step needed the default stream: autograd syncs a "
                        "parameter's gradient with the stream its gradient node was made on, and some node made "
                        "on the default stream is still alive. Either a graph of a step run outside the wrapper "
                        "is (a loss kept with its grad_fn: drop it or keep it .detach()ed, or run such steps "
                        "through CUDAGraphStep.eager()), or a DistributedDataParallel made on the default stream "
                        "holds its nodes (use HybridParallel, whose DDP the wrapper remakes on its stream). A "
                        "failed capture leaves torch's CUDA state unusable: fix it and start the process again "
                        "(docs/cuda_graphs.md, 'Eager steps and the capture')"
                    ) from e  # fmt: skip
                raise
            finally:
                _capture.ACTIVE = None
                static.PLANNED.clear()
                static.EXPECTING = False
                if hook is not None:
                    hook.remove()
            checked = [id(m) for chk in log.checks for m in chk.tables]
            if len(checked) != len(set(checked)):
                self._restore(saved)
                raise ValueError(
                    "CUDAGraphStep: fn steps a table twice (say, optimizer.step() and then table.step()); a "
                    "captured step reads one NaN/Inf check per table: step each table once"
                )
            dense = self.optimizer.dense if self.optimizer is not None else None
            if dense is not None and any(isinstance(v, torch.Tensor) and not v.is_cuda
                                         for st in dense.state.values() for v in st.values()):  # fmt: skip
                self._restore(saved)
                raise ValueError(
                    f"CUDAGraphStep: the dense optimizer ({type(dense).__name__}) keeps state on the host (its step "
                    f"count?), which a graph would not advance; use torch.optim.Adam(..., capturable=True) or SGD"
                )
            pending = [m for m in self.modules if m._pending]
            if pending:
                self._restore(saved)
                raise ValueError(
                    "CUDAGraphStep: fn left a sparse gradient pending (it must step its tables: "
                    "optimizer.step() or table.step(), then zero_grad())"
                )
            for m in self.modules:  # what one replay does to the host's bookkeeping
                self._host_delta[id(m)] = m._steps - saved[id(m)][0]
            for t in self._tables:
                self._host_delta[id(t)] = t.clock - saved[id(t)][0]
            self._restore(saved)
            self._graph, self._log, self._static, self._out = graph, log, inputs_at, out
            self._tensors = [self._table_tensors(m) for m in self.modules] + [self._dense_tensors()]
            self._hyper = self._dense_hyper()
            self._mirror = {}
            self._sync_scalars()
            self.captures += 1
            return
        raise RuntimeError("CUDAGraphStep: the tables kept lacking room while capturing the step")

    def _grow(self, table: Any, n: int) -> None:
        """Grows ``table`` (outside any capture) until ``n`` more ids fit under grow_at."""
        while _short_of_room(table, n):
            bound = table.max_capacity
            if table._at_max() or (bound is not None and table._size + table._unread_ids() + n > bound):
                raise TableFullError(
                    f"CUDAGraphStep: a table of max_capacity {bound} ({table._size} rows) has no room for the {n} "
                    f"ids of a step without evicting, which a captured step cannot: raise max_capacity, or train "
                    f"this model eagerly"
                )
            table._grow()

    def _host_state(self) -> dict[int, tuple]:
        state: dict[int, tuple] = {}
        for m in self.modules:
            state[id(m)] = (m._steps, m._last_lr, m._had_backward, m._verdict, m._nonfinite_error)
        for t in self._tables:
            state[id(t)] = (t.clock, t.num_evicted, t.last_evicted, list(t._unread))
        return state

    def _restore(self, saved: dict[int, tuple]) -> None:
        """The host's bookkeeping as before the capture (which ran the Python of a step, not
        its kernels: the first replay does those)."""
        for m in self.modules:
            m._steps, m._last_lr, m._had_backward, m._verdict, m._nonfinite_error = saved[id(m)]
            m._pending = []
        for t in self._tables:
            t.clock, t.num_evicted, t.last_evicted, t._unread = saved[id(t)]

    def _dense_tensors(self) -> tuple:
        """Where the model's parameters and buffers and the dense optimizer's state live: a
        load that replaces them (an optimizer's load_state_dict does) needs a new capture."""
        ptrs = [x.data_ptr() for x in self.model.parameters()] + [x.data_ptr() for x in self.model.buffers()]
        dense = self.optimizer.dense if self.optimizer is not None else None
        if dense is not None:
            for state in dense.state.values():
                ptrs.extend(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        return tuple(ptrs)

    def _dense_hyper(self) -> list:
        """The dense optimizer's plain-number settings (a tensor lr is read at every replay)."""
        dense = self.optimizer.dense if self.optimizer is not None else None
        if dense is None:
            return []
        return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, tuple))}
                for g in dense.param_groups]  # fmt: skip

    @staticmethod
    def _table_tensors(m: DynamicEmbedding) -> tuple:
        t = m.table
        return (t.version, t.capacity) + tuple(x.data_ptr() for x in t._state(join=False))

    # ---- replays ----------------------------------------------------------------------
    def _valid(self) -> bool:
        """Whether the graph still fits: the tables', parameters' and dense optimizer state's
        tensors unchanged (no growth, load or move), room for the next replay's ids, and the
        tables of each captured update call still sharing learning rate and step count."""
        assert self._log is not None
        if [self._table_tensors(m) for m in self.modules] + [self._dense_tensors()] != self._tensors:
            return False
        per_table: dict[int, tuple[Any, int]] = {}  # a table may take several inserts in a step
        for ins in self._log.inserts:
            for t, n in zip(ins.tables, ins.num_ids):
                per_table[id(t)] = (t, per_table.get(id(t), (t, 0))[1] + n)
        for t, n in per_table.values():
            if _short_of_room(t, n):
                self._grow(t, n)
                return False
        if self._dense_hyper() != self._hyper:
            if not self._warned_hyper:
                self._warned_hyper = True
                warnings.warn(
                    "CUDAGraphStep: the dense optimizer's hyperparameters (its learning rate: an LR scheduler?) "
                    "changed since the capture, which baked them in: the step is captured again, at every change. "
                    "Give the optimizer a tensor lr (torch.optim.Adam(..., lr=torch.tensor(1e-3), capturable=True)) "
                    "to schedule it without new captures", RuntimeWarning, stacklevel=3,
                )  # fmt: skip
            return False
        for upd in self._log.updates:
            if len({(self._lr_of(m, self._log), m._steps) for m in upd.tables}) > 1:
                return False
        return True

    def _requested_lr(self, m: DynamicEmbedding, log: Optional[_capture.Capture]) -> Optional[float]:
        """The ``lr`` argument ``fn``'s step() gives ``m`` now: the CombinedOptimizer's group,
        else what step() was given at capture (None: the table's optimizer's own)."""
        if self.optimizer is not None:
            for (_, table), group in zip(self.optimizer.tables, self.optimizer._sparse_groups):
                if table is m:
                    return float(group["lr"])
        return None if log is None else log.requested_lr.get(id(m))

    def _lr_of(self, m: DynamicEmbedding, log: Optional[_capture.Capture]) -> float:
        requested = self._requested_lr(m, log)
        return float(m.optimizer.lr if requested is None else requested)

    def _sync_scalars(self) -> None:
        """Writes the device clocks and hparams[:2] ([lr, step]) where the host's values moved on without
        the graph (a load, an eager step, an LR scheduler); nothing when they agree."""
        log = self._log
        assert log is not None
        for t in self._tables:
            if self._mirror.get(id(t)) != t.clock:
                log.clocks[id(t)].fill_(t.clock)
                self._mirror[id(t)] = t.clock
        for m in self.modules:
            want = (self._lr_of(m, log), float(m._steps))
            if self._mirror.get(id(m)) != want:
                log.hparams[id(m)][:2].copy_(torch.tensor(want, dtype=torch.float64))
                self._mirror[id(m)] = want

    def _after_replay(self) -> None:
        """The host's bookkeeping of one replay: its insert counts and NaN/Inf checks queued
        for reading (before the next call), the step counts, clocks and learning rates."""
        log = self._log
        assert log is not None
        fresh: dict[int, Any] = {}  # per replay, one copy of each captured layout check (shared by inserts)
        for ins in log.inserts:
            refusal = ins.on_refused  # a _LayoutCheck's, which raises once: a fresh one per replay
            if refusal is not None and hasattr(refusal, "__self__"):
                check = fresh.get(id(refusal.__self__))
                if check is None:
                    check = fresh[id(refusal.__self__)] = refusal.__self__.renewed()
                refusal = check.refused
            counts = _DeferredCounts(ins.counts, refusal)
            for k, (t, n) in enumerate(zip(ins.tables, ins.num_ids)):
                t._unread.append((counts, k, n))
        for chk in log.checks:  # before the host's steps move on: the verdict keeps them to roll back
            for m in chk.tables:  # an older verdict left unread (an error cut its read short): settled first
                m._settle_check()
            verdict = _DeferredCheck(chk.check.requeued(), chk.tables)
            for m in chk.tables:
                m._verdict = verdict
        for m in self.modules:
            if self._host_delta[id(m)]:
                m._steps += self._host_delta[id(m)]
                m._last_lr = self._requested_lr(m, log)
            lr, steps = self._mirror[id(m)]
            self._mirror[id(m)] = (lr, steps + log.steps.get(id(m), 0))  # what the graph advanced
        for t in self._tables:
            t.clock += self._host_delta[id(t)]
            self._mirror[id(t)] += log.ticks.get(id(t), 0)


class _Ahead(NamedTuple):
    """A counting phase launched ahead of its step (``next_inputs``)."""

    inputs: tuple  # the tensors the next call must pass
    error: Optional[BaseException]  # this rank's verdict on room for that step
    done: torch.cuda.Event  # recorded after it on the side stream


def _alike(xs: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> bool:
    """Whether ``xs`` are as many tensors as ``ref``, of their shapes, dtypes and devices."""
    return len(xs) == len(ref) and all(
        x.shape == r.shape and x.dtype == r.dtype and x.device == r.device for x, r in zip(xs, ref)
    )


def _short_of_room(table: Any, n: int) -> bool:
    """Whether ``n`` more ids could take ``table`` past its growth threshold, counting the
    inserts whose counts are not read yet (a replay's inserts defer; they cannot grow it)."""
    return table._size + table._unread_ids() + n > table._defer_limit()
