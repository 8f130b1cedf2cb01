"""The one-process engine of table modules, one module per job in the order a step runs:

- :mod:`~veloce.sparse.backend`: where a table's lookups go (:class:`LocalBackend`, or a
  sharded one that :class:`veloce.distributed.HybridParallel` installs);
- :mod:`~veloce.sparse.inputs`: input checks (before any table changes);
- :mod:`~veloce.sparse.lookup`: the local lookup, and :func:`lookup_many`;
- :mod:`~veloce.sparse.autograd`: the lookups' autograd node;
- :mod:`~veloce.sparse.pending`: the pending gradient a backward pass leaves in a table;
- :mod:`~veloce.sparse.step`: the fused sparse updates (:func:`step_tables`);
- :mod:`~veloce.sparse.default_row`: the default row of a sharded table with admission,
  its gradient summed over the ranks;
- :mod:`~veloce.sparse.nonfinite`: the NaN/Inf gradient policy;
- :mod:`~veloce.sparse.compile`: lookups as one opaque op under ``torch.compile``;
- :mod:`~veloce.sparse.combined`: :class:`CombinedOptimizer`;
- :mod:`~veloce.sparse.clip`: :func:`clip_grad_norm_` and :func:`clip_grad_value_`.
"""

from veloce.sparse.autograd import autograd_anchor, train_lookups
from veloce.sparse.backend import (
    LocalBackend, LookupBackend, apply_pending, check_unapplied, eval_slots, forget_gradient, keep_gradient,
    note_backward, validated_bags,
)  # fmt: skip
from veloce.sparse.base import MODES, POOLINGS, TableModule, training_lookup
from veloce.sparse.clip import clip_grad_norm_, clip_grad_value_
from veloce.sparse.combined import CombinedOptimizer
from veloce.sparse.compile import is_compiling, register
from veloce.sparse.compile import lookup as compiled_lookup
from veloce.sparse.inputs import InputChecks, LayoutCheck, check_offsets_many, insert_checked, offsets_flags
from veloce.sparse.lookup import LocalLookup, lookup_groups, lookup_many, world_size
from veloce.sparse.nonfinite import CHECKED, NONFINITE, DeferredCheck, FiniteCheck, NonfinitePolicy, raise_deferred
from veloce.sparse.pending import LIVE, Pending, PendingGradient, PendingState, reresolve, waiting_tables
from veloce.sparse.step import Stepping, step_tables
from veloce.sparse.torch_steps import torch_step_count

__all__ = [
    "CHECKED", "LIVE", "MODES", "NONFINITE", "POOLINGS", "CombinedOptimizer", "DeferredCheck",
    "FiniteCheck", "InputChecks", "LayoutCheck", "LocalBackend", "LocalLookup", "LookupBackend",
    "NonfinitePolicy", "Pending", "PendingGradient", "PendingState", "Stepping", "TableModule",
    "apply_pending", "autograd_anchor", "check_offsets_many", "check_unapplied", "clip_grad_norm_",
    "clip_grad_value_", "compiled_lookup", "eval_slots", "forget_gradient", "insert_checked",
    "is_compiling", "keep_gradient", "lookup_groups", "lookup_many", "note_backward", "offsets_flags",
    "raise_deferred", "register", "reresolve", "step_tables", "torch_step_count",
    "train_lookups", "training_lookup", "validated_bags", "waiting_tables", "world_size",
]  # fmt: skip
