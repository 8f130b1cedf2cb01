"""Small values between host and device without a stream sync; the current CUDA stream, cheaply.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and torch makes
that copy blocking: the host waits until the stream has run everything queued before it.
On a step that is otherwise launched ahead of the GPU, each such copy is a bubble. Staging
the values in pinned memory lets the copy be queued like a kernel (torch's caching host
allocator keeps the pinned buffer until the copy has run).

The other way, :class:`HostCopy` queues a device-to-host copy into pinned memory and
waits only for that copy when its values are asked for: work queued after it keeps the
GPU busy meanwhile (``x.tolist()`` would wait for the whole stream, then leave the GPU
idle while the host launches the next work).
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

__all__ = ["HostCopy", "current_stream", "host_tensor", "to_device", "use_stream", "wait_for"]

# The raw handle of torch's current-stream query, and the current device's index (CUDA
# builds only; a CPU build never asks).
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_CURRENT: dict[int, tuple[int, torch.cuda.Stream]] = {}  # device index -> (raw handle, its Stream)


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for a CUDA ``device``, at a fraction of its host cost.

    torch's call parses the device and builds a new ``Stream`` object each time: a few
    microseconds of Python that a training step paid dozens of times (once per table when
    it joins an update). Here the stream's raw handle is asked for (one C call) and the
    ``Stream`` last built for that handle is returned while the handle is unchanged (a
    ``torch.cuda.stream(...)`` block, or ``set_stream``, changes it)."""
    index = device.index
    if index is None:
        index = torch.cuda.current_device()
    return _current_stream_at(index)


def _current_stream_at(index: int) -> torch.cuda.Stream:
    if _raw_current_stream is None:
        return torch.cuda.current_stream(index)
    raw = _raw_current_stream(index)
    cached = _CURRENT.get(index)
    if cached is not None and cached[0] == raw:
        return cached[1]
    stream = torch.cuda.current_stream(index)
    _CURRENT[index] = (raw, stream)
    return stream


class use_stream:
    """``with use_stream(stream):`` is ``with torch.cuda.stream(stream):``, at a fraction of
    its host cost for a stream of the current device (the sparse update's and the insert's
    side streams, entered every training step): the stream set, and the one it replaced set
    back, with one query of the current stream (:func:`current_stream`'s cache) instead of
    torch's device parsing and two new ``Stream`` objects. A stream of another device takes
    torch's context (which also switches the current device)."""

    __slots__ = ("stream", "prev", "other")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.prev: torch.cuda.Stream | None = None
        self.other = None  # torch's context, for a stream of another device

    def __enter__(self) -> None:
        s = self.stream
        if _current_device is None or s.device_index != _current_device():
            self.other = torch.cuda.stream(s)
            self.other.__enter__()
            return
        self.prev = _current_stream_at(s.device_index)
        torch.cuda.set_stream(s)

    def __exit__(self, *exc) -> None:
        if self.other is not None:
            self.other.__exit__(*exc)
        else:
            torch.cuda.set_stream(self.prev)


# (thread, device, waiter's handle, waited's handle) -> the event between the two streams.
# Per thread: two threads recording one event between their record and wait would mix
# their orders. Bounded: a program that makes streams as it goes must not grow it forever.
_WAIT_EVENTS: dict[tuple[int, int, int, int], torch.cuda.Event] = {}
_MAX_WAIT_EVENTS = 256


def wait_for(waiter: torch.cuda.Stream, waited: torch.cuda.Stream) -> None:
    """``waiter.wait_stream(waited)`` (on the device: work queued on ``waiter`` from now on
    comes after the work queued on ``waited`` so far), with one event kept per pair of
    streams instead of a new event each call. Recording an event again does not change
    what an earlier wait on it waits for (CUDA takes the event's state at the wait), so
    reusing it is safe; it saves creating and destroying an event, every step, on each of
    the update stream's hand-overs."""
    # A default stream's handle is 0 on every device: the device is part of the key.
    key = (threading.get_ident(), waited.device_index, waiter.cuda_stream, waited.cuda_stream)
    event = _WAIT_EVENTS.get(key)
    if event is None:
        if len(_WAIT_EVENTS) >= _MAX_WAIT_EVENTS:
            _WAIT_EVENTS.clear()  # the events' earlier waits stand (CUDA took their state then)
        event = _WAIT_EVENTS[key] = torch.cuda.Event()
    event.record(waited)
    waiter.wait_event(event)


def host_tensor(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, queued without a host sync on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued without a host sync on CUDA."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values, copied to the host behind the work queued so far.

    ``HostCopy(x)`` queues the copy; :meth:`tolist` waits for it (on CUDA only for the
    copy, through an event, not for what was queued after it) and returns the values."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.device.type != "cuda":
            self._host, self._ready = values, None
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record(current_stream(values.device))

    def tolist(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
