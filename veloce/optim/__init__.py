"""Sparse optimizers for :class:`veloce.DynamicEmbedding` (``veloce.sparse.CombinedOptimizer`` steps them with a
torch optimizer).

A sparse optimizer is a frozen config; the table applies it with one fused kernel pass
per touched row (``torch.ops.veloce.sparse_update``). Each matches a torch reference on
the rows a step touches:

============================  ===========  ==========================================
config                        state/row    reference
============================  ===========  ==========================================
``SGD(lr)``                   0            ``torch.optim.SGD``
``Adagrad(lr, eps)``          D            ``torch.optim.Adagrad``
``RowWiseAdagrad(lr, eps)``   1            FBGEMM row-wise Adagrad (mean of g**2)
``Adam(lr, betas, eps)``      2D           ``torch.optim.SparseAdam`` (lazy Adam)
``FTRL(lr, lr_power, l1,      2D           ``tf.keras.optimizers.Ftrl`` (FTRL-Proximal)
l2, initial_accumulator_value,
beta)``
============================  ===========  ==========================================

Each config names its kernel rule (``kind``, an id of ``veloce.ops.optimizer.RULES``) and
gives the kernels its own hyperparameters (:meth:`SparseOptimizer.hyperparameters`) and the
state new rows start from (:meth:`SparseOptimizer.initial_state`). Adding an optimizer is a
rule header in ``csrc/include/veloce/optim/``, a line in its registry (and in ``RULES``), a
config file here and its line in :data:`OPTIMIZERS` (docs/ops.md, "Adding an optimizer").

Example::

    model = MyModel()                         # holds veloce.DynamicEmbedding modules
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)  # scales both
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()
"""

from typing import Any

from veloce.optim.adagrad import Adagrad
from veloce.optim.adam import Adam
from veloce.optim.base import SparseOptimizer
from veloce.optim.ftrl import FTRL
from veloce.optim.registry import OPTIMIZERS
from veloce.optim.rowwise_adagrad import RowWiseAdagrad
from veloce.optim.sgd import SGD

__all__ = ["OPTIMIZERS", "SparseOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL"]

# Names of the engine (veloce.sparse, a layer above this package) that users may look for here.
_ELSEWHERE = {
    "CombinedOptimizer": "veloce.CombinedOptimizer (veloce.sparse.CombinedOptimizer)",
    "clip_grad_norm_": "veloce.clip_grad_norm_ (veloce.sparse.clip_grad_norm_)",
    "clip_grad_value_": "veloce.clip_grad_value_ (veloce.sparse.clip_grad_value_)",
}


def __getattr__(name: str) -> Any:
    where = _ELSEWHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'veloce.optim' has no attribute {name!r}")
    raise AttributeError(
        f"module 'veloce.optim' has no attribute {name!r}: veloce.optim holds the sparse optimizer configs; "
        f"use {where}"
    )
