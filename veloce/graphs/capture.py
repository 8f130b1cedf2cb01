"""Capturing a step into a CUDA graph, and the host's bookkeeping around its replays."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch

from veloce.distributed import static
from veloce.embedding import DynamicEmbedding
from veloce.runtime import capture as _capture
from veloce.runtime import update_stream as _update_stream
from veloce.sparse import DeferredCheck
from veloce.table import DeferredCounts, TableFullError

__all__ = ["Capturing"]


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


class Capturing:
    """:class:`~veloce.graphs.CUDAGraphStep`'s capture and replays."""

    # ---- capture ----------------------------------------------------------------------
    def _capture(self, inputs: Sequence[torch.Tensor], plans: Optional[list] = None) -> None:
        for attempt in range(64):
            for t in self._tables:  # nothing in flight that the graph would have to wait for
                t.settle()
            torch.cuda.synchronize()
            for t in self._tables:  # all has run: no event of another stream to wait for inside the capture
                t.forget_in_flight()
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
                if self._hp is not None and self._hp.ddp is not None:
                    log.averaging = self._hp
                    hook = self.optimizer.dense.register_step_pre_hook(lambda *_: self._hp.average_dense_grads())
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
                self._host_delta[id(t)] = t.clock - saved[id(t)].clock
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
        try:
            table.make_deferred_room(n)
        except TableFullError as e:
            raise TableFullError(
                f"CUDAGraphStep: {e}, which a captured step cannot: raise max_capacity, or train this model "
                f"eagerly"
            ) from None

    def _host_state(self) -> dict[int, Any]:
        state: dict[int, tuple] = {}
        for m in self.modules:
            state[id(m)] = (m._steps, m._last_lr, m._had_backward, m._verdict, m._nonfinite_error)
        for t in self._tables:
            state[id(t)] = t.bookkeeping()
        return state

    def _restore(self, saved: dict[int, Any]) -> None:
        """The host's bookkeeping as before the capture (which ran the Python of a step, not
        its kernels: the first replay does those)."""
        for m in self.modules:
            m._steps, m._last_lr, m._had_backward, m._verdict, m._nonfinite_error = saved[id(m)]
            m._pending = []
        for t in self._tables:
            t.restore_bookkeeping(saved[id(t)])

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
        return (t.version, t.capacity) + t.state_addresses()

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
            if not t.has_deferred_room(n):
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
            counts = DeferredCounts(ins.counts, refusal)
            for k, (t, n) in enumerate(zip(ins.tables, ins.num_ids)):
                t.add_deferred_counts(counts, k, n)
        for chk in log.checks:  # before the host's steps move on: the verdict keeps them to roll back
            for m in chk.tables:  # an older verdict left unread (an error cut its read short): settled first
                m._settle_check()
            verdict = DeferredCheck(chk.check.requeued(), chk.tables)
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

