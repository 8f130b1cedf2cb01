"""Host clock + CUDA event at named points of back-to-back training steps.

Used by ``tools/profile_step.py --phases`` (one GPU) and ``bench_distributed.py --phases``
(rank 0 of a sharded step). Nothing syncs until the report: each marker records the host
time and a CUDA event on the current stream. Per marker the report gives the median host
time since the step's start and the GPU lag: how long after the host passed the marker the
GPU got there. A lag near zero means the GPU had run out of work and waited for the host
at that point; growing lags mean the host is ahead.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Iterable

import torch


class Markers:
    """Named points of each step; a name repeated within one step gets ``#2``, ``#3``..."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.points: list[tuple[str, float, object]] = []
        self._seen: dict[str, int] = {}

    def mark(self, name: str) -> None:
        if name == "start":
            self._seen.clear()
        n = self._seen[name] = self._seen.get(name, 0) + 1
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.points.append((name if n == 1 else f"{name} #{n}", time.perf_counter(), ev))

    def clear(self) -> None:
        self.points.clear()
        self._seen.clear()

    def report(self, title: str, steps: int) -> str:
        """The table of median host time and GPU lag per marker (call after a device sync)."""
        rows, total = self.medians(steps)
        lines = [
            f"\nphases of {steps} back-to-back steps ({title}): median ms since the step's start on the host, and the "
            "GPU lag (GPU reached the point that long after the host; near 0: the GPU waited for the host there)",
            f"{'marker':<50} {'host':>8} {'GPU lag':>8}",
        ]
        lines += [f"{name:<50} {host:8.3f} {lag:8.3f}" for name, host, lag in rows]
        lines.append(f"host time per step (back to back): {total:.3f} ms")
        return "\n".join(lines)

    def medians(self, steps: int) -> tuple[list[tuple[str, float, float]], float]:
        """Per marker (in order of first appearance): its name, median host ms since the
        step's start and median GPU lag; and the host ms per step (call after a device sync)."""
        t_first, e_first = self.points[0][1], self.points[0][2]
        rows: dict[str, list[tuple[float, float]]] = {}
        order: list[str] = []
        step_host = 0.0
        for name, t, ev in self.points:
            host = (t - t_first) * 1e3
            gpu = e_first.elapsed_time(ev) if ev is not None else float("nan")
            if name == "start":
                step_host = host
            if name not in rows:
                order.append(name)
            rows.setdefault(name, []).append((host - step_host, gpu - host))
        out = [(name, statistics.median(h for h, _ in rows[name]), statistics.median(g for _, g in rows[name]))
               for name in order]  # fmt: skip
        return out, (self.points[-1][1] - t_first) * 1e3 / steps


@contextlib.contextmanager
def marked_calls(markers: Markers, targets: Iterable[tuple[object, str, str]]):
    """Replaces each ``getattr(owner, attr)`` by a wrapper that marks ``label`` when the
    call returns; restores them on exit. ``targets``: ``(owner, attr, label)``."""
    saved: list[tuple[object, str, Callable]] = []

    def wrap(fn, label):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            markers.mark(label)
            return out

        return call

    try:
        for owner, attr, label in targets:
            fn = getattr(owner, attr)
            saved.append((owner, attr, fn))
            setattr(owner, attr, wrap(fn, label))
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def print_idle_gaps(prof, steps: int, top: int = 15) -> None:
    """From a torch.profiler run of ``steps`` steps: the device's busy and idle time per step, and the largest idle gaps, summed per
    (activity before, activity after) pair."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    if not spans:
        return
    gaps: dict[tuple[str, str], list[float]] = {}
    end, last = spans[0][1], spans[0][2]
    idle = 0.0
    for start, stop, name in spans[1:]:
        if start > end:
            gap = start - end
            idle += gap
            g = gaps.setdefault((last[:45], name[:45]), [0, 0.0])
            g[0] += 1
            g[1] += gap
        if stop >= end:
            end, last = stop, name
    span = spans[-1][1] - spans[0][0]
    print(f"\ndevice per step: {span / steps / 1e3:.3f} ms from first to last activity, "
          f"{(span - idle) / steps / 1e3:.3f} ms busy, {idle / steps / 1e3:.3f} ms idle")  # fmt: skip
    print(f"largest idle gaps (summed over {steps} steps): total us, count, after -> before")
    for (before, after), (count, total) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{total:10.1f} {count:5d}  {before} -> {after}")
