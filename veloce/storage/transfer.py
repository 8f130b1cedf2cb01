"""Moving entries between a CUDA cache and host memory in bulk: the tensors of one
transfer (ids, rows, optimizer state, scores) packed into one byte buffer, so that a
fetch is one host-to-device copy and a write-back one device-to-host copy, through
pinned staging buffers reused from step to step (pinning memory is slow; the store's
own memory is never pinned). On the CPU nothing moves: the tensors are returned as they
are."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from veloce.runtime.device import current_stream

__all__ = ["PinnedStaging"]


def _byte_views(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]


def _check_order(tensors: Sequence[torch.Tensor]) -> None:
    # Each tensor's bytes start where the previous ones end: in descending element size,
    # every start is a multiple of the element size that views it back.
    sizes = [t.element_size() for t in tensors]
    if sizes != sorted(sizes, reverse=True):
        raise ValueError(f"PinnedStaging: tensors must come in descending element size, got sizes {sizes}")


def _unpack(buf: torch.Tensor, likes: Sequence[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    out, at = [], 0
    for shape, dtype in likes:
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(buf[at:at + n].view(dtype).view(shape))
        at += n
    return out


class PinnedStaging:
    """Pinned host buffers for a cache's transfers, grown as needed and reused (see the
    module docstring). A buffer is written again only after the copy that last read it
    ran (an event per direction)."""

    def __init__(self) -> None:
        self._host: dict[str, torch.Tensor] = {}
        self._done: dict[str, Optional[torch.cuda.Event]] = {}

    def __getstate__(self) -> dict:
        return {"_host": {}, "_done": {}}  # buffers are scratch: a copy makes its own

    def _buffer(self, which: str, nbytes: int) -> torch.Tensor:
        event = self._done.get(which)
        if event is not None:
            event.synchronize()
            self._done[which] = None
        buf = self._host.get(which)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.numel()), 1 << 16)
            buf = self._host[which] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (on one device, in descending element size) on the host: one copy into
        a pinned buffer, waited for. The results are views of that buffer, valid until the
        next call."""
        if not tensors or not tensors[0].is_cuda:
            return [t.cpu() for t in tensors]
        _check_order(tensors)
        packed = torch.cat(_byte_views(tensors))
        buf = self._buffer("to_host", packed.numel())
        buf.copy_(packed, non_blocking=True)
        current_stream(packed.device).synchronize()
        return _unpack(buf, [(t.shape, t.dtype) for t in tensors])

    def to_device(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Host ``tensors`` (in descending element size) on ``device``: packed into a pinned
        buffer, one copy queued on the current stream (not waited for). The results are views
        of one device buffer."""
        if device.type != "cuda":
            return [t.to(device) for t in tensors]
        _check_order(tensors)
        views = _byte_views(tensors)
        buf = self._buffer("to_device", sum(v.numel() for v in views))
        torch.cat(views, out=buf)
        on_device = buf.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(current_stream(device))
        self._done["to_device"] = event
        return _unpack(on_device, [(t.shape, t.dtype) for t in tensors])
