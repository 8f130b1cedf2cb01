"""Sparse updates on a stream of their own, beside the next step's insert.

A training step ends with the fused sparse update (``accumulate_and_update``), the
largest kernel of the step; the next step begins with the insert (``find_or_insert``),
which reads a count back to the host. On one stream that read waits for the update too,
so the host idles for the whole update, then launches the rest of the step while the GPU
idles. On CUDA the updates therefore run on a per-device side stream (after everything
queued on the current stream), and each updated table holds an :class:`UpdateFence`: an
event after its update, and the update's inputs.

The update writes the rows and optimizer state of rows that exist; it never touches keys,
digests or scores. So the next insert may run beside it, as long as it only places new
ids in free slots: :class:`veloce.table.HashTable` lets an insert that may not evict skip
the fence, and makes every other access wait for it on the current stream, on the device
(no host sync): reading ``weights`` or ``opt_state``, every op over the whole state
(export, insert_or_assign, growth, an insert that may evict), erase, clear and moving the
table. The training lookup reads ``weights`` and so waits for the update it needs. Such
a wait on a stream of the user's own makes that stream wait and keeps the fence: the
stream the update came from (its origin) still waits before its next use of the rows.

Beside means at once: the update's blocks fill the GPU, and the block scheduler serves
the kernels of streams of equal priority in launch order, so an insert on the current
stream would still start only when the update's last blocks do. An insert that skips a
fence therefore runs on a high-priority stream (:func:`beside_updates`), whose blocks the
scheduler takes first as the update's blocks finish. So do the training forward's input
checks before it, which the insert waits for: kernels left on the current stream would
start only after the update. (Other work queued on the current stream after the update,
such as a model's dense layers before its lookups, still waits for the update's blocks,
and the insert for it.)

The inputs (gradients, slots, offsets, the table's tensors) were allocated on the current
stream. Each fence stays in a list of fences in flight until the current stream has
waited for it or its event has completed, and it holds the inputs: the caching allocator
cannot hand their memory to work that would run before the update is done, also when a
table is deleted or stepped twice in one call.

One hazard is left to the caller: the update reads the tensors the forward and backward
were given where it can use them as they are (1-D ``offsets``, ``per_sample_weights`` of
the table's dtype, a ``gradient=`` passed to ``backward``) until it has run. Do not
overwrite those in place before the next forward (or set ``VELOCE_UPDATE_STREAM=0``).

``VELOCE_UPDATE_STREAM=0`` in the environment (read at import) runs the updates on the
current stream instead.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from veloce.runtime import capture as _capture
from veloce.runtime.device import current_stream, use_stream, wait_for

__all__ = ["ENABLED", "UpdateFence", "beside_updates", "prefetch_stream", "prefetching", "release_done",
           "run_update", "wait_prefetch_origin", "on_prefetch_stream", "record_streams"]  # fmt: skip

ENABLED = os.environ.get("VELOCE_UPDATE_STREAM", "1") != "0"

_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
_IN_FLIGHT: list[UpdateFence] = []  # fences not yet waited for, oldest first
_UPDATE, _INSERT = 0, -1  # stream priorities (lower is higher; torch clamps to the device's range)


def _stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    if device.index is None:  # one stream per device, however it is named
        device = torch.device("cuda", torch.cuda.current_device())
    s = _STREAMS.get((device, priority))
    if s is None:
        s = _STREAMS[(device, priority)] = torch.cuda.Stream(device, priority=priority)
    return s


class UpdateFence:
    """Sparse updates queued on a device's update stream: the event after them, and the
    tensors they read (held until the origin stream waited for them, or they have run)."""

    __slots__ = ("event", "inputs", "origin", "waited")

    def __init__(self, event: torch.cuda.Event, inputs: Any, origin: torch.cuda.Stream) -> None:
        self.event = event
        self.inputs = inputs
        self.origin = origin  # the stream the update was queued behind, and its inputs came from
        self.waited = False  # the origin stream waited (itself, or through the insert stream)

    def join(self) -> bool:
        """Makes the current stream wait (on the device) for the updates. Returns whether
        that covers the origin stream: the origin itself, or the insert stream, which the
        origin waits for after (:func:`beside_updates`). Then work queued on the origin
        from now on comes after the updates, their inputs may go back to the allocator,
        and the tables drop the fence. A join on another stream waits each time and keeps
        the fence. Tables updated by one call share the fence: the origin waits once."""
        stream = current_stream(self.origin.device)
        covers = stream == self.origin or stream == _STREAMS.get((stream.device, _INSERT))
        if not (covers and self.waited):
            stream.wait_event(self.event)
        if covers:
            self.waited = True
            if self in _IN_FLIGHT:
                _IN_FLIGHT.remove(self)
        return covers


def release_done() -> None:
    """Drops the fences whose updates have run: their inputs (a deleted table's rows among
    them) go back to the allocator. Called before each update and each table allocation."""
    if _IN_FLIGHT:
        _IN_FLIGHT[:] = [f for f in _IN_FLIGHT if not f.event.query()]


def run_update(device: torch.device, launch: Callable[[], None], inputs: Any) -> UpdateFence | None:
    """``launch()`` (an update's op call) on ``device``'s update stream, behind all work
    queued so far on the current stream; returns the fence for the updated tables. Off CUDA,
    or with the stream disabled, launches on the current stream and returns None."""
    if device.type != "cuda" or not ENABLED or _capture.ACTIVE is not None:  # a captured step: one stream
        launch()
        return None
    release_done()
    side = _stream(device, _UPDATE)
    origin = current_stream(device)
    wait_for(side, origin)
    try:
        with use_stream(side):
            launch()
    except BaseException:  # kernels it queued before failing: what follows on origin waits for them
        wait_for(origin, side)
        raise
    done = torch.cuda.Event()
    done.record(side)
    fence = UpdateFence(done, inputs, origin)
    _IN_FLIGHT.append(fence)
    return fence


def beside_updates(device: torch.device, fn: Callable[[], Any]) -> Any:
    """``fn()`` (an insert, or a training forward's input checks and insert) on ``device``'s
    high-priority insert stream, behind all work queued so far on the current stream; the
    current stream then waits for it. Every CUDA tensor in the result (walking tuples,
    lists and dicts) is recorded as used by the current stream: it may have been allocated
    on the insert stream. Run on the insert stream already (nested), just ``fn()``.

    What ``fn`` reads it must read before it returns (ids are read before the insert's last
    host sync); what it allocates and returns is recorded here."""
    main = current_stream(device)
    side = _stream(device, _INSERT)
    if main == side:
        return fn()
    wait_for(side, main)
    try:
        with use_stream(side):
            out = fn()
    finally:  # also when fn raises: a fence it joined was waited for on the insert stream
        wait_for(main, side)
    record_streams(out, main)
    return out


def prefetch_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of ``HybridParallel.prefetch``'s exchanges: the high-priority insert
    stream (their inserts run there anyway, beside the updates)."""
    return _stream(device, _INSERT)


_PREFETCH_ORIGIN: list = []  # the event on the current stream where a prefetch in progress began


@contextlib.contextmanager
def prefetching(origin: torch.cuda.Event):
    """While ``HybridParallel.prefetch`` runs on the insert stream without waiting for the
    current stream: ``origin``, recorded on that stream when it began, is what every access
    to a table's rows or slots waits for (:func:`wait_prefetch_origin`). The inserts that
    may not evict need not; a growth or an eviction then also waits for work queued before
    the prefetch (an update with the update stream off, or whose fence the current stream
    already joined)."""
    _PREFETCH_ORIGIN.append(origin)
    try:
        yield
    finally:
        _PREFETCH_ORIGIN.pop()


@contextlib.contextmanager
def on_prefetch_stream(device: torch.device, wait: bool = False, join: bool = True):
    """Runs the block on the prefetch stream (:func:`prefetch_stream`) under
    :func:`prefetching`, its origin recorded on the current stream now; afterwards (with
    ``join``) the current stream waits for everything the block queued. ``wait``: the
    prefetch stream first waits for the current one too (the block reads tensors that come
    from it). Without ``join`` nothing queued later on the current stream waits for the
    block (unless it raised): only for blocks whose results are used on the prefetch
    stream first, and whose reads the caller orders itself.
    Yields the current stream (None on a CPU, where the block just runs): tensors the
    block allocates and later work uses there need ``record_stream`` on it."""
    if device.type != "cuda":
        yield None
        return
    main, side = current_stream(device), prefetch_stream(device)
    if wait:
        wait_for(side, main)
    origin = torch.cuda.Event()
    origin.record(main)  # what a growth or an eviction on the side stream waits for
    try:
        with use_stream(side), prefetching(origin):
            yield main
    except BaseException:
        wait_for(main, side)  # whatever the block queued before it failed, joined always
        raise
    # Work queued from now on comes after the block's (its results, and a table grown or
    # rows evicted on the side stream); the work queued before it does not.
    if join:
        wait_for(main, side)


def wait_prefetch_origin(device: torch.device) -> None:
    """Inside :func:`prefetching`: the current stream waits for the prefetch's origin."""
    if _PREFETCH_ORIGIN and device.type == "cuda":
        current_stream(device).wait_event(_PREFETCH_ORIGIN[-1])


def record_streams(obj: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream(stream)`` on every CUDA tensor in ``obj`` (a tensor, or tuples, lists
    and dicts of them; other values are skipped): tensors allocated on another stream and
    used on ``stream``."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            record_streams(o, stream)
    elif isinstance(obj, dict):
        for o in obj.values():
            record_streams(o, stream)
