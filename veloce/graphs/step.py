"""The step wrapper: :class:`CUDAGraphStep`, its checks, the call and its eager steps."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from veloce.distributed import static
from veloce.embedding import DynamicEmbedding
from veloce.graphs.capture import Capturing
from veloce.graphs.counting import ShardedCounting, _Ahead
from veloce.runtime import capture as _capture
from veloce.runtime.device import current_stream
from veloce.sparse import CombinedOptimizer, raise_deferred

__all__ = ["CUDAGraphStep"]


class CUDAGraphStep(Capturing, ShardedCounting):
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

        opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), capturable=True), model)

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
                f"CUDAGraphStep: optimizer must be a veloce.CombinedOptimizer (or None), got {type(optimizer).__name__}"
            )
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"CUDAGraphStep: warmup must be an int >= 1, got {warmup!r}")
        self.fn, self.model, self.optimizer, self.warmup, self.lookups = fn, model, optimizer, warmup, lookups
        self.modules = [m for m in model.modules() if isinstance(m, DynamicEmbedding)]
        if not self.modules:
            warnings.warn("CUDAGraphStep: the model has no DynamicEmbedding", RuntimeWarning, stacklevel=2)
        self._check_modules()
        self._sharded = any(m.backend.sharded for m in self.modules)
        self._hp: Any = None  # the HybridParallel whose dense gradients the graph averages
        dev = self.modules[0].table.device if self.modules else torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(dev)  # every capture's (see HybridParallel.remake_ddp)
        if self._sharded:
            self._check_sharded()
            if self._hp is not None:
                self._hp.remake_ddp(self._stream)
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

    @property
    def sharded(self) -> bool:
        """Whether the model's tables are sharded (``HybridParallel``): each call then runs
        the counting phase of the static exchanges before the step."""
        return self._sharded

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
            try:
                for b in {m.backend.group_id: m.backend for m in self.modules if m.backend.sharded}.values():
                    b.raise_deferred_failures()  # an eager step's (lookup_errors="raise_next"; agreed: all raise)
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
            raise_deferred(self.modules)
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
            t.join_update()
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
        """Reads what the last replay left for the host (see ``raise_deferred``: insert
        counts, NaN/Inf checks) and returns its error, if any, for the caller to raise once
        this call's replay is booked. Everything is read even then (a refused insert's
        error does not leave the checks unread)."""
        try:
            raise_deferred(self.modules)
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
                t.hand_over_update(stream, caller)
        return out


def _alike(xs: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> bool:
    """Whether ``xs`` are as many tensors as ``ref``, of their shapes, dtypes and devices."""
    return len(xs) == len(ref) and all(
        x.shape == r.shape and x.dtype == r.dtype and x.device == r.device for x, r in zip(xs, ref)
    )

