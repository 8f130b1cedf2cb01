"""Hash-table ops in keys/s at a given load factor (BENCHMARKS.md, configuration 1).

    python benchmarks/bench_hash_table.py                                # GPU: dims 8, 64, 128; loads 0.5/0.75/1.0
    python benchmarks/bench_hash_table.py --dims 64 --loads 0.5 --json out.json
    python benchmarks/bench_hash_table.py --device cpu                  # small smoke run

Per (dim, load): a table of `capacity` slots (default 2^27 for dim 8, 2^26 for dim 64 and
128 on GPU, like HierarchicalKV's benchmark) is filled to the load factor with random
int64 keys; then every call gets 2^20 keys, 60 % already present and 40 % new, and
`find`, `insert_or_assign` and `find_or_insert` (LRU scores) are timed with CUDA events
(5 warm-ups, >= 20 timed calls, median). After each timed insert, its new keys are
erased (untimed) so the load stays put. At load 1.0 inserts run with allow_evict=True
(as HierarchicalKV does): without eviction they fail for lack of room.

Printed beside HierarchicalKV's numbers measured on our H100 (BENCHMARKS.md). veloce's
`find` returns slots (the row stays in the table for the fused lookup); HierarchicalKV's
find also copies the values out, so the find columns are not the same work.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import veloce  # noqa: F401  (loads torch.ops.veloce)

BUCKET = 32
# HierarchicalKV, 1x H100 80GB HBM3, 2^20 keys/call, 60 % hits, LRU; units of 2^30 keys/s.
HKV = {
    (64, 0.5): {"find": 3.08, "find_or_insert": 1.52, "insert_or_assign": 1.52},
    (64, 0.75): {"find": 3.11, "find_or_insert": 1.46, "insert_or_assign": 1.43},
    (64, 1.0): {"find": 3.25, "find_or_insert": 1.14, "insert_or_assign": 1.14},
    (8, 0.5): {"find": 3.89, "find_or_insert": 1.90, "insert_or_assign": 1.80},
}
OPS = ("find", "insert_or_assign", "find_or_insert")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def evicts(load: float) -> bool:
    """Whether inserts at this load factor run with allow_evict (as HierarchicalKV's at 1.0):
    without eviction they fail for lack of room."""
    return load >= 0.999


def random_keys(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randint(INT64_MIN, INT64_MAX, (n,), dtype=torch.long, generator=gen).to(device)


class Table:
    """The five state tensors of one table (no optimizer state: S = 0)."""

    def __init__(self, capacity: int, dim: int, device: torch.device) -> None:
        self.keys = torch.zeros(capacity, dtype=torch.long, device=device)
        self.digests = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.scores = torch.zeros(capacity, dtype=torch.long, device=device)
        self.weights = torch.zeros(capacity, dim, dtype=torch.float32, device=device)
        self.opt_state = torch.zeros(capacity, 0, dtype=torch.float32, device=device)

    def state(self):
        return (self.keys, self.digests, self.scores, self.weights, self.opt_state)

    def size(self) -> int:
        return int((self.digests != 0).sum())


def fill(t: Table, target: int, chunk: int, gen, device) -> torch.Tensor:
    """Inserts random keys until `target` slots are occupied; returns the keys present."""
    present = []
    size = 0
    while size < target:
        want = min(chunk, target - size)
        ids = random_keys(want, gen, device)
        evict = size + want > 0.95 * t.keys.numel()  # near full some bucket pairs are full
        _, counts, evicted = torch.ops.veloce.find_or_insert(*t.state(), ids, 1, 0, evict, 0, 0, 0.0, 0.0)
        if int(counts[1]) > 0:  # retry with eviction on
            _, counts, evicted = torch.ops.veloce.find_or_insert(*t.state(), ids, 1, 0, True, 0, 0, 0.0, 0.0)
        present.append(ids)
        before, size = size, t.size()
        if size - before < want // 100:  # only evictions left: as full as two-choice gets
            break
    keys = torch.cat(present)
    # Keep only keys that are still present (evictions near load 1.0 removed a few).
    return keys[torch.ops.veloce.find(t.keys, t.digests, keys) >= 0]


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def bench_one(dim: int, load: float, args, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(1234 + dim)
    capacity = args.capacity or (args.capacity_dim8 if dim <= 8 else args.capacity_default)
    capacity = max(BUCKET, capacity // BUCKET * BUCKET)
    t = Table(capacity, dim, device)
    present = fill(t, int(load * capacity), args.batch, gen, device)
    actual_load = t.size() / capacity
    evict = evicts(load)
    n_hit = int(round(args.hit * args.batch))
    timer = Timer(device)
    rows = []
    for op in args.ops.split(","):
        times = []
        for it in range(args.warmup + args.iters):
            hits = present[torch.randint(0, present.numel(), (n_hit,), generator=gen).to(device)]
            new = random_keys(args.batch - n_hit, gen, device)
            ids = torch.cat([hits, new])[torch.randperm(args.batch, generator=gen).to(device)]
            if op == "find":
                ms = timer(lambda: torch.ops.veloce.find(t.keys, t.digests, ids))
            elif op == "find_or_insert":
                ms = timer(lambda: torch.ops.veloce.find_or_insert(
                    *t.state(), ids, 1, it + 1, evict, 0, 2, -0.05, 0.05))  # fmt: skip
            else:
                values = torch.randn(args.batch, dim, generator=gen).to(device)
                ms = timer(lambda: torch.ops.veloce.insert_or_assign(
                    *t.state(), ids, values, None, None, 1, it + 1, evict))  # fmt: skip
            if op != "find" and not evict:
                torch.ops.veloce.erase(t.keys, t.digests, new)  # untimed: keep the load factor
            if it >= args.warmup:
                times.append(ms)
        ms = statistics.median(times)
        rate = args.batch / (ms * 1e-3) / 2**30
        ref = HKV.get((dim, load), {}).get(op)
        rows.append({
            "dim": dim, "capacity": capacity, "load": load, "actual_load": round(actual_load, 4), "op": op,
            "ms": round(ms, 4), "keys_per_s_2e30": round(rate, 3), "hkv_2e30": ref,
            "vs_hkv": round(rate / ref, 2) if ref else None, "evict": evict,
        })  # fmt: skip
        print(f"  dim {dim:>3} load {load:.2f} ({actual_load:.3f}) {op:<17} {ms:8.3f} ms  {rate:6.3f} x 2^30 keys/s"
              + (f"  (HKV {ref}, {rate / ref:.2f}x)" if ref else ""), flush=True)  # fmt: skip
    del t
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dims", default=None, help="comma-separated (GPU default 8,64,128; CPU 8,64)")
    p.add_argument("--loads", default="0.5,0.75,1.0")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--capacity", type=int, default=None, help="slots for every dim (overrides the defaults)")
    p.add_argument("--batch", type=int, default=None, help="keys per call (GPU default 2^20, CPU 2^14)")
    p.add_argument("--hit", type=float, default=0.6, help="fraction of each call's keys already present")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=None, help="timed calls (GPU default 20, CPU 5)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.dims = args.dims or ("8,64,128" if gpu else "8,64")
    args.batch = args.batch or (1 << 20 if gpu else 1 << 14)
    args.iters = args.iters or (20 if gpu else 5)
    args.capacity_default = 1 << 26 if gpu else 1 << 18
    args.capacity_dim8 = 1 << 27 if gpu else 1 << 18
    if gpu:
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    print(f"### Hash table ops: {name}, torch {torch.__version__}, float32 rows, "
          f"{args.batch:,} keys/call, {args.hit:.0%} present, LRU; median of {args.iters} calls", flush=True)
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        for load in (float(x) for x in args.loads.split(",")):
            rows += bench_one(dim, load, args, device)

    print("\n| dim | capacity | load | op | ms | keys/s (2^30) | HierarchicalKV (H100) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dim']} | 2^{r['capacity'].bit_length() - 1} | {r['load']:.2f} ({r['actual_load']:.3f}) | "
              f"{r['op']} | {r['ms']:.3f} | {r['keys_per_s_2e30']:.3f} | {r['hkv_2e30'] or '-'} | "
              f"{r['vs_hkv'] if r['vs_hkv'] is not None else '-'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
