"""Sharded tables in a captured step: the counting phase that sizes the static exchanges
(:mod:`veloce.distributed.static`) before each replay."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from veloce.distributed import HybridParallel, agree_sum, static

__all__ = ["ShardedCounting"]


class ShardedCounting:
    """:class:`~veloce.graphs.CUDAGraphStep`'s counting phase (sharded tables)."""

    def _check_sharded(self) -> None:
        for m in self.modules:
            if not m.backend.sharded:
                continue
            static.check_static([m])
            if m.backend.group.backend != "nccl":
                raise ValueError(f"CUDAGraphStep: sharded tables need the NCCL backend, got {m.backend.group.backend!r}")
        if not callable(self.lookups):
            raise ValueError(
                "CUDAGraphStep: the model's tables are sharded (HybridParallel): pass lookups=, a function of the "
                "step's inputs that returns the model's lookups, e.g. lambda dense, sparse, label: "
                "model.module.sparse_lookups(dense, sparse)"
            )  # fmt: skip
        wrappers = {id(w): w for w in (m.backend.wrapper() if m.backend.wrapper is not None else None
                                       for m in self.modules if m.backend.sharded) if w is not None}  # fmt: skip
        if len(wrappers) != 1:
            raise ValueError(
                f"CUDAGraphStep: the sharded tables must belong to one live HybridParallel, found {len(wrappers)}"
            )
        self._hp = next(iter(wrappers.values()))
        if not isinstance(self._hp, HybridParallel):
            raise TypeError(f"CUDAGraphStep: the tables' wrapper is a {type(self._hp).__name__}")
        if self._hp.ddp is not None:
            if self.optimizer is None or self.optimizer.dense is None:
                raise ValueError(
                    "CUDAGraphStep: a HybridParallel model's dense gradients are averaged inside the graph before "
                    "the dense optimizer's step: pass the CombinedOptimizer that holds it as optimizer"
                )  # fmt: skip

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
                if not t.has_deferred_room(n):
                    self._grow(t, n)
        except Exception as e:  # noqa: BLE001 - raised after the ranks agree
            return e
        return None


class _Ahead(NamedTuple):
    """A counting phase launched ahead of its step (``next_inputs``)."""

    inputs: tuple  # the tensors the next call must pass
    error: Optional[BaseException]  # this rank's verdict on room for that step
    done: torch.cuda.Event  # recorded after it on the side stream

