"""Small host values on a device without a stream sync.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and torch makes
that copy blocking: the host waits until the stream has run everything queued before it.
On a step that is otherwise launched ahead of the GPU, each such copy is a bubble. Staging
the values in pinned memory lets the copy be queued like a kernel (torch's caching host
allocator keeps the pinned buffer until the copy has run).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["host_tensor"]


def host_tensor(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, queued without a host sync on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
