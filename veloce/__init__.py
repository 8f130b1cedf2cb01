"""veloce: dynamic (hash-table) embeddings and hybrid-parallel training for PyTorch.

Importing veloce never hard-fails: if the compiled extension is missing or was built
against another torch, the first use of an op raises an error that says how to rebuild.
"""

from veloce import _ext
from veloce import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
