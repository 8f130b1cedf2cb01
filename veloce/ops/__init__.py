"""Typed wrappers over ``torch.ops.veloce``, with fake kernels and autograd registrations.

One module per op family (the same names as ``csrc/cpu/<family>.cpp``)."""

from veloce.ops import embedding, exchange, hash_table, optimizer, sketch  # noqa: F401  (registers fake kernels and autograd)
