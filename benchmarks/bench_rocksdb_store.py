"""Rows per second of the RocksDB tier's store (``veloce.storage.rocksdb.RocksDBStore``) on
batches of ids, and its bytes per row on disk.

    python benchmarks/bench_rocksdb_store.py                       # 64k-id batches, dim 128, Adam state
    python benchmarks/bench_rocksdb_store.py --rows 2000000 --dir /mnt/nvme/bench --json out.json

The store is filled with ``--rows`` entries (batches of ``--batch`` fresh ids), then each
operation runs ``--iters`` times on batches of ``--batch`` distinct ids drawn from the
held ones (or from ids never held, for the misses); the table reports the median time
per batch as rows per second:

- ``put fresh``: new ids (``fresh=True``: no existence check), what a cache's write-back is;
- ``put replace``: held ids (``fresh=False``: one MultiGet to keep the count exact);
- ``get hit`` / ``get miss``: held ids / ids never held (the Bloom filter answers);
- ``take``: held ids, removed (each batch is put back, untimed, so the size stays);
- ``lowest(batch)``: the ids of the lowest scores, a scan of every entry.

``disk bytes/row`` is the directory's size after a compaction, over the rows held: the
payload (key 8 + row + state + score 8) and RocksDB's own overhead (index, filter, files).
The numbers depend on the disk and on the page cache: a store larger than RAM reads from
the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from veloce.storage.rocksdb import RocksDBStore


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 20, help="entries held while timing")
    p.add_argument("--batch", type=int, default=1 << 16, help="ids per batch")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--state-dim", type=int, default=256, help="optimizer state per row (Adam: 2 * dim)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--block-cache-mib", type=int, default=256)
    p.add_argument("--dir", default=None, help="where the database goes (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    root = tempfile.mkdtemp(dir=args.dir, prefix="veloce-rocksdb-")
    path = os.path.join(root, "db")
    try:
        store = RocksDBStore(path, args.dim, args.state_dim, block_cache_bytes=args.block_cache_mib << 20)
        gen = torch.Generator().manual_seed(0)
        held = torch.randperm(4 * args.rows, generator=gen)[: args.rows] * 2  # even ids; odd ids are never held
        b = args.batch

        def entries(ids: torch.Tensor):
            n = len(ids)
            return ids, torch.randn(n, args.dim, generator=gen), torch.randn(n, args.state_dim, generator=gen), ids

        fill = []
        for part in held.split(b):
            batch = entries(part)
            fill.append(timed(lambda: store.put(*batch, fresh=True)))
        store.compact()
        disk = du(path) / len(store)

        def sample(ids: torch.Tensor) -> torch.Tensor:
            return ids[torch.randperm(len(ids), generator=gen)[:b]]

        times: dict[str, list[float]] = {k: [] for k in ("put replace", "get hit", "get miss", "take")}
        for _ in range(args.iters):
            ids = sample(held)
            batch = entries(ids)
            times["put replace"].append(timed(lambda: store.put(*batch)))
            times["get hit"].append(timed(lambda: store.get(sample(held))))
            misses = sample(held) + 1
            times["get miss"].append(timed(lambda: store.get(misses)))
            taken = []
            times["take"].append(timed(lambda: taken.append(store.take(ids))))
            _, w, s, sc = taken[0]
            store.put(ids, w, s, sc, fresh=True)
        assert len(store) == args.rows
        scan = statistics.median(timed(lambda: store.lowest(b)) for _ in range(3))
        results = {"put fresh": statistics.median(fill)}
        results.update({k: statistics.median(v) for k, v in times.items()})
        payload = 8 + args.dim * 4 + args.state_dim * 4 + 8
        print(f"RocksDBStore: {args.rows} rows held, batches of {b} ids, dim {args.dim} float32, "
              f"state {args.state_dim} float32, block cache {args.block_cache_mib} MiB, {torch.get_num_threads()} "
              f"threads")  # fmt: skip
        print(f"{'op':<12} {'ms/batch':>9} {'rows/s':>12}")
        for k, t in results.items():
            print(f"{k:<12} {t * 1e3:>9.1f} {b / t:>12,.0f}")
        print(f"lowest({b}): {scan * 1e3:.0f} ms (a scan of the {args.rows} rows)")
        print(f"disk bytes/row {disk:.0f} (payload {payload}: key 8 + row + state + score 8)")
        store.close()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows_per_s": {k: b / t for k, t in results.items()},
                           "lowest_s": scan, "disk_bytes_per_row": disk, "payload_bytes_per_row": payload}, f, indent=1)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
