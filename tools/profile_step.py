"""Profile one training step with torch.profiler (GPU or CPU).

    python tools/profile_step.py --device cuda            # one table, BENCHMARKS.md configuration 3 shape
    python tools/profile_step.py --device cpu --rows 1000000 --batch 65536
    python tools/profile_step.py --model dlrm             # configuration 5 on one GPU: DLRM, 26 tables

Prints the ops and kernels that take the most device (or CPU) time, the host-side
CUDA runtime calls (synchronizations and copies, per step), the wall time per step and,
on a GPU, where the device sits idle: its busy and idle time per step and the largest
gaps between consecutive device activities, named by the kernels around them (an idle
GPU in a step is host time on the critical path). ``--trace PATH`` also writes the
profile as a Chrome trace (open in chrome://tracing or Perfetto).

``--cprofile`` prints where the host's time goes in back-to-back steps (no profiler):
Python's cProfile by own time, then the torch ops dispatched per step and their host
time (the torch profiler, CPU side only, over separate steps).

``--phases`` times the host path of back-to-back steps without the profiler (whose own
overhead doubles host times): markers at the phase boundaries of every step (the insert's
return, that is just after its host sync; the forward, backward and update launch; the
step) record the host clock and a CUDA event. Per marker it prints the median host time
since the step started and the GPU lag: how long after the host passed the marker the GPU
got there. A lag near zero means the GPU had run out of work and waited for the host at
that point; growing lags mean the host is ahead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import veloce

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from _phases import Markers, marked_calls, print_idle_gaps  # noqa: E402

SCRAMBLE = 0x9E3779B97F4A7C15 - (1 << 64)
STEPS = 5


def table_step(args, dev, markers: Markers | None = None):
    opt = veloce.optim.Adam() if args.optimizer == "adam" else veloce.optim.SGD(lr=0.01)
    emb = veloce.DynamicEmbedding(args.dim, mode="sum", capacity=2 * args.rows, optimizer=opt, device=dev,
                                  nonfinite_grad="apply" if args.unchecked else "raise",
                                  defer_inserts=args.defer_inserts)  # fmt: skip
    for chunk in torch.arange(args.rows, device=dev).split(1 << 21):
        emb.table.find_or_insert(chunk * SCRAMBLE)
    probs = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** args.alpha
    ids = (torch.multinomial(probs, args.batch, replacement=True) * SCRAMBLE).to(dev)
    offsets = torch.arange(args.batch, device=dev)
    grad = torch.randn(args.batch, args.dim, device=dev)

    def step():
        emb(ids, offsets).backward(grad)
        emb.step()
        emb.zero_grad()

    def marked_step():
        markers.mark("start")
        out = emb(ids, offsets)
        markers.mark("forward returned")
        out.backward(grad)
        markers.mark("backward returned")
        emb.step()
        markers.mark("step returned")
        emb.zero_grad()
        markers.mark("zero_grad returned")

    return step if markers is None else marked_step


def dlrm_step(args, dev):
    """Configuration 5's model and batch (bench_distributed.py) on one device, no sharding."""
    from veloce.models import DLRM

    def table(dim):
        return veloce.DynamicEmbedding(
            dim, mode="sum", capacity=1 << 20, optimizer=veloce.optim.RowWiseAdagrad(lr=0.01), device=dev
        )

    model = DLRM(13, 26, embedding_dim=args.dim, bottom_mlp=(512, 256, args.dim),
                 top_mlp=(1024, 1024, 512, 256, 1), embedding_factory=table).to(dev)  # fmt: skip
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    gen = torch.Generator(device=dev).manual_seed(0)
    b = args.dlrm_batch
    dense = torch.randn(b, 13, generator=gen, device=dev)
    u = torch.rand(b, 26, generator=gen, device=dev, dtype=torch.float64)
    rank = torch.floor((1 - u) ** (-1.0 / (args.alpha - 1.0))).clamp(max=10**7).long()
    sparse = rank * 0x9E3779B97F4A7C1 + torch.arange(26, device=dev)
    label = (torch.rand(b, generator=gen, device=dev) < 0.25).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step():
        loss_fn(model(dense, sparse), label).backward()
        opt.step()
        opt.zero_grad()

    return step


@contextlib.contextmanager
def _hooks(markers: Markers):
    """Marks the return of every table insert and sparse-update op call."""
    import veloce.distributed.owner
    import veloce.embedding
    import veloce.table

    inserted = "forward: insert returned (after its host sync)"
    targets = [(veloce.table.HashTable, "find_or_insert", inserted)]
    # modules that call find_or_insert_many by name
    targets += [(m, "find_or_insert_many", inserted) for m in (veloce.table, veloce.embedding, veloce.distributed.owner)]
    targets += [(torch.ops.veloce, n, "step: update launched") for n in ("accumulate_and_update", "accumulate_and_update_many")]
    with marked_calls(markers, targets):
        yield


def phases(args, dev, steps: int = 30) -> None:
    """Back-to-back steps with markers; prints per marker the median host time since the
    step's start and the GPU lag (see the module docstring)."""
    if args.model != "table":
        raise SystemExit("--phases supports --model table")
    markers = Markers(dev)
    emb_step = table_step(args, dev, markers)
    for _ in range(5):
        emb_step()
    if markers.cuda:
        torch.cuda.synchronize()
    markers.clear()
    with _hooks(markers):
        for _ in range(steps):
            emb_step()
        if markers.cuda:
            torch.cuda.synchronize()
    print(markers.report(f"{args.optimizer}, {'unchecked' if args.unchecked else 'checked'}", steps))


def host_profile(args, dev, steps: int = 100) -> None:
    """The host's time in back-to-back steps: cProfile by own time (a wait for the device
    counts in the call that waits), then the torch ops per step with their host time."""
    import cProfile
    import io
    import pstats

    step = table_step(args, dev) if args.model == "table" else dlrm_step(args, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(10):
        step()
    sync()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    print(f"{steps} back-to-back steps under cProfile: {(time.perf_counter() - t) * 1e3 / steps:.3f} ms per step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(STEPS):
            step()
        sync()
    events = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
    print(f"torch ops per step (CPU-side profiler, {STEPS} steps): calls, self host us per step")
    for e in events[:45]:
        print(f"{e.count / STEPS:7.1f}  {e.self_cpu_time_total / STEPS:9.1f}  {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="table", choices=["table", "dlrm"])
    p.add_argument("--rows", type=int, default=16_000_000)
    p.add_argument("--batch", type=int, default=1_048_570, help="ids per step (bags of one id)")
    p.add_argument("--dlrm-batch", type=int, default=16384, help="samples per step of --model dlrm")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--unchecked", action="store_true", help="table: nonfinite_grad='apply' (no NaN/Inf check)")
    p.add_argument("--defer-inserts", action="store_true", help="table: DynamicEmbedding(defer_inserts=True)")
    p.add_argument("--trace", default=None, help="write the profiled steps as a Chrome trace (.json or .json.gz)")
    p.add_argument("--cprofile", action="store_true",
                   help="the host path of back-to-back steps by Python function and by torch op, instead of profiling")
    p.add_argument("--phases", action="store_true",
                   help="time the host path of back-to-back steps with markers and events instead of profiling")
    args = p.parse_args()
    dev = torch.device(args.device)
    if args.phases:
        phases(args, dev)
        return
    if args.cprofile:
        host_profile(args, dev)
        return
    step = table_step(args, dev) if args.model == "table" else dlrm_step(args, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{args.model} step on {dev}: median {times[len(times) // 2] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(STEPS):
            step()
        sync()
    events = prof.key_averages()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(events.table(sort_by=key, row_limit=30, max_name_column_width=70))
    print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    runtime = [e for e in events if e.key.startswith("cuda") and ("Synchronize" in e.key or "Memcpy" in e.key)]
    for e in runtime:
        print(f"per step: {e.count / STEPS:8.1f} x {e.key} ({e.cpu_time_total / STEPS / 1e3:.3f} ms host)")
    if dev.type == "cuda":
        try:
            print_idle_gaps(prof, STEPS)
        except Exception as exc:  # noqa: BLE001 - a diagnostic; the tables above stand
            print(f"idle-gap analysis failed: {exc!r}")
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
