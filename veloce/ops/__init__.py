"""Typed wrappers over ``torch.ops.veloce``, with fake kernels and autograd registrations.

One module per op family (the same names as ``csrc/cpu/<family>.cpp``)."""
