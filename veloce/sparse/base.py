"""What every module of the one-process engine knows of a table module: its base class
and the pooling modes of the kernels."""

from __future__ import annotations

import torch
from torch import nn

from veloce.runtime.attrs import PlainAttrs

__all__ = ["MODES", "POOLINGS", "TableModule", "training_lookup"]

MODES = {"sum": 0, "mean": 1}  # the pooling kernels' modes; "max" pools in veloce.ops.embedding.max_pool
POOLINGS = ("sum", "mean", "max")


class TableModule(PlainAttrs, nn.Module):
    """The base of a module whose rows live in a :class:`~veloce.table.HashTable` (its
    ``table``): what the engine's functions (:func:`veloce.sparse.lookup_many`,
    :func:`veloce.sparse.step_tables`, clipping, :class:`veloce.sparse.CombinedOptimizer`)
    accept and look for in a model. :class:`veloce.DynamicEmbedding` is the one such module;
    the engine's mixins give it its lookups, pending gradient, NaN/Inf policy and step."""


def training_lookup(module: TableModule) -> bool:
    """Whether a lookup of ``module`` made now is a training lookup (it inserts new ids,
    scores rows for eviction and gives the table a gradient): the module is in training
    mode and gradients are enabled. Under ``torch.no_grad()`` or ``torch.inference_mode()``
    a lookup is an evaluation lookup whatever the mode, as validation is: nothing changes
    in the table, as nothing changes in an ``nn.EmbeddingBag`` there. Read it before
    entering an autograd Function, whose forward runs with gradients disabled."""
    return module.training and torch.is_grad_enabled()
