"""A whole training step as one CUDA graph: :class:`CUDAGraphStep`.

On a GPU, a step of a model with many small layers and tables is often bound by the host:
Python and the launches of a few hundred kernels take longer than the kernels themselves
(configuration 5's DLRM on one H200 with TF32 matmuls: 7.3 ms eager, 3.9 ms of GPU work).
A CUDA graph captures the step's kernels once and replays them with one launch.

What makes a veloce step capturable (see :mod:`veloce.runtime.capture`): while capturing, every
training insert defers its read-back and stamps its LRU clocks from device tensors; every
fused update reads its learning rate and step count from device tensors; the graph advances
both itself. The wrapper carries the host's bookkeeping across replays: it reads each
replay's insert counts (the table sizes) and NaN/Inf check before the next replay, raising
their errors as ``step()`` would; it grows a table that a replay could fill and captures
again; it moves the learning rates of a :class:`veloce.CombinedOptimizer` (an LR
scheduler's) to the device before each replay.

- :mod:`~veloce.graphs.step`: :class:`CUDAGraphStep`, its checks, the call, eager steps;
- :mod:`~veloce.graphs.capture`: the capture, and the host's bookkeeping around replays;
- :mod:`~veloce.graphs.counting`: sharded tables' counting phase before each replay.
"""

from veloce.graphs.step import CUDAGraphStep

__all__ = ["CUDAGraphStep"]
