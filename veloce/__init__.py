"""veloce: dynamic (hash-table) embeddings and hybrid-parallel training for PyTorch.

Importing veloce never hard-fails: if the compiled extension is missing or was built
against another torch, the first use of an op raises an error that says how to rebuild.

Example::

    import torch, veloce
    emb = veloce.DynamicEmbedding(16, mode="sum")            # no num_embeddings
    out = emb(torch.tensor([[42, -7], [2**62, 42]]))         # any int64 id; (2, 16)
"""

from veloce import checkpoint, data, distributed, eviction, graphs, init, metrics, models, ops, optim, runtime, sparse, serving, storage, table, train
from veloce.embedding import DynamicEmbedding
from veloce.graphs import CUDAGraphStep
from veloce.sparse import CombinedOptimizer, clip_grad_norm_, clip_grad_value_, lookup_many, step_tables
from veloce.table import HashTable, TableFullError
from veloce.train import Callback, EarlyStopping, Trainer, callbacks

__version__ = "0.1.0"

__all__ = [
    "CUDAGraphStep", "Callback", "CombinedOptimizer", "DynamicEmbedding", "EarlyStopping", "HashTable", "TableFullError", "Trainer",
    "clip_grad_norm_", "clip_grad_value_", "lookup_many", "step_tables",
    "callbacks", "checkpoint", "data", "distributed", "eviction", "graphs", "init", "metrics", "models", "ops", "optim",
    "runtime", "sparse", "storage", "table", "train",
    "__version__",
]
