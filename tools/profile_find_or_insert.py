"""Where a CUDA ``find_or_insert`` call's time goes (BENCHMARKS.md configuration 1 shape).

Fills a table of ``--capacity`` slots (dim ``--dim``, no optimizer state) to ``--load``
(default 0.5), then calls ``find_or_insert`` with 2^20 keys per call, 60% of them present,
each call's new ids erased after it, or at load 1.0 inserted with eviction and kept (as
``benchmarks/bench_hash_table.py``): prints the CUDA-event time and
host time of ``--calls`` calls, a torch.profiler table of 4 more (with their erases), and
the GPU timeline of the first profiled calls
(start and duration in microseconds, and the idle gap before each: gaps after a
device-to-host copy are the host's time between a sync and its next launch).

``--host`` adds the host side of one profiled call to that timeline: the op's span and
every CUDA runtime call (launches, copies, syncs, allocations) on the same clock, so the
host's time before the first kernel and between the syncs shows call by call. It also
times the host cost of a few small things on this machine (a launch through the
dispatcher, an op that launches nothing, a find_or_insert whose GPU work is tiny).

    python tools/profile_find_or_insert.py                  # 2^26 slots, dim 64
    python tools/profile_find_or_insert.py --capacity 4194304 --events 60
    python tools/profile_find_or_insert.py --load 1.0        # every new id evicts a key
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_hash_table import Table, evicts, fill, random_keys

import veloce  # noqa: F401  (registers the ops)


def timeline(trace: list, events: int) -> None:
    """The first ``events`` GPU activities of a Chrome trace's events, with the idle gap before each."""
    gpu = sorted((e for e in trace if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])  # fmt: skip
    if not gpu:
        print("no GPU activity in the trace")
        return
    t0 = end = gpu[0]["ts"]
    print(f"{'start us':>9} {'dur us':>8} {'gap us':>8}  activity")
    for e in gpu[:events]:
        print(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f} {e['ts'] - end:8.1f}  {e['name'][:90]}")
        end = max(end, e["ts"] + e["dur"])


def host_timeline(trace: list, op: str = "veloce::find_or_insert", which: int = 1) -> None:
    """The host's CUDA runtime calls and the GPU's activities during the ``which``-th call of
    ``op`` in a Chrome trace's events, on one clock (us since the op's start): where its host
    time goes."""
    spans = sorted((e for e in trace if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("name") == op),
                   key=lambda e: e["ts"])  # fmt: skip
    if len(spans) <= which:
        print(f"no call {which} of {op} in the trace")
        return
    t0 = spans[which]["ts"]
    t1 = t0 + spans[which]["dur"]
    kinds = {"cuda_runtime": "host", "cuda_driver": "host", "kernel": "gpu", "gpu_memcpy": "gpu", "gpu_memset": "gpu"}
    rows = sorted((e for e in trace if e.get("ph") == "X" and e.get("cat") in kinds and t0 <= e["ts"] <= t1),
                  key=lambda e: e["ts"])  # fmt: skip
    print(f"\nhost and GPU during {op} call {which} ({spans[which]['dur']:.1f} us on the host); us since its start")
    print(f"{'start':>8} {'dur':>7} {'host gap':>8}  side  activity")
    host_end = t0
    for e in rows:
        side = kinds[e["cat"]]
        gap = ""
        if side == "host":
            gap = f"{e['ts'] - host_end:8.1f}"
            host_end = e["ts"] + e["dur"]
        print(f"{e['ts'] - t0:8.1f} {e['dur']:7.1f} {gap:>8}  {side:4}  {e['name'][:80]}")
    print(f"{t1 - t0:8.1f} {'':7} {t1 - host_end:8.1f}  host  (the op returns)")


def host_costs(t: Table, present: torch.Tensor, dev: torch.device, reps: int = 200) -> None:
    """Host microseconds per call of a few small things, each timed over ``reps`` calls."""
    one = torch.zeros(1, device=dev)
    ids1 = present[:1].clone()
    ids1k = present[:1024].clone()
    cases = {
        "fill_ of one float (a launch through the dispatcher)": lambda: one.fill_(0),
        "torch.empty(1) on the GPU (no launch)": lambda: torch.empty(1, device=dev),
        "veloce find, 1 key (one launch)": lambda: torch.ops.veloce.find(t.keys, t.digests, ids1),
        "veloce find_or_insert, 1 present key (sync b)": lambda: torch.ops.veloce.find_or_insert(
            *t.state(), ids1, 1, 1, False, 0, 2, -0.05, 0.05),
        "veloce find_or_insert, 1024 present keys (sync b)": lambda: torch.ops.veloce.find_or_insert(
            *t.state(), ids1k, 1, 1, False, 0, 2, -0.05, 0.05),
    }  # fmt: skip
    print("\nhost us per call (median of 5 rounds, each of a few hundred calls)")
    for name, fn in cases.items():
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            h0 = time.perf_counter()
            for _ in range(reps):
                fn()
            h1 = time.perf_counter()
            torch.cuda.synchronize()
            rounds.append((h1 - h0) / reps * 1e6)
        print(f"  {statistics.median(rounds):8.1f}  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", type=int, default=1 << 26)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1 << 20)
    p.add_argument("--events", type=int, default=40, help="GPU activities of the timeline to print")
    p.add_argument("--calls", type=int, default=20, help="timed calls (their median is printed)")
    p.add_argument("--load", type=float, default=0.5, help="load factor to fill to (1.0: inserts evict)")
    p.add_argument("--host", action="store_true",
                   help="also the host's runtime calls of one profiled call, and the host cost of small calls")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_find_or_insert.py needs a CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    t = Table(args.capacity, args.dim, dev)
    present = fill(t, int(args.load * args.capacity), args.batch, gen, dev)
    evict = evicts(args.load)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:  # the call's ids, and its new ones
        hits = present[torch.randint(0, present.numel(), (int(0.6 * args.batch),), generator=gen).to(dev)]
        new = random_keys(args.batch - hits.numel(), gen, dev)
        return torch.cat([hits, new])[torch.randperm(args.batch, generator=gen).to(dev)], new

    def call(ids: torch.Tensor, step: int) -> None:  # LRU, uniform(-0.05, 0.05) rows
        torch.ops.veloce.find_or_insert(*t.state(), ids, 1, step, evict, 0, 2, -0.05, 0.05)

    def erase(new: torch.Tensor) -> None:  # keeps the load (at load 1.0 the evictions do)
        if not evict:
            torch.ops.veloce.erase(t.keys, t.digests, new)

    # As bench_hash_table.py: each call's ids drawn right before it, its new ids erased
    # after it (untimed), so the load stays put.
    torch.cuda.synchronize()
    ms, host = [], []
    for i in range(args.calls):
        ids, new = batch()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        call(ids, i + 1)
        h1 = time.perf_counter()
        stop.record()
        stop.synchronize()
        ms.append(start.elapsed_time(stop))
        host.append((h1 - h0) * 1e3)
        erase(new)
    print(f"{torch.cuda.get_device_name(dev)}, {args.batch:,} keys per call: find_or_insert ms (CUDA events): "
          f"{[round(x, 3) for x in ms]} (median {statistics.median(ms):.3f}); host ms: "
          f"{[round(x, 3) for x in host]}")  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(4):
            ids, new = batch()
            call(ids, 100 + i)
            erase(new)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    timeline(trace, args.events)
    if args.host:
        host_timeline(trace)
        host_costs(t, present, dev)


if __name__ == "__main__":
    main()
