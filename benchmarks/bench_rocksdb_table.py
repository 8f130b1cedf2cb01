"""A training step of a ``DynamicEmbedding`` whose table lives in RocksDB on local disk,
with a cache and a RAM tier above it (``storage=RocksDB(path, cache_rows=...,
ram_cache_rows=...)``), against the same table all in memory (``Device()``) and in RocksDB
under the cache alone (no RAM tier), on the CPU.

    python benchmarks/bench_rocksdb_table.py                        # 2M rows, cache 1/8, RAM 1/8
    python benchmarks/bench_rocksdb_table.py --rows 8000000 --dir /mnt/nvme/bench --json out.json

Every table holds ``--rows`` ids (dim ``--dim``, Adagrad), filled before timing: the
all-in-memory one by ``insert``, the tiered ones through their stores, as a checkpoint
load fills them. Each step looks up ``--batch`` bags of ``--bag`` ids drawn from a
Zipf(``--alpha``) law over the rows' ranks (rank r is a random id, so hot ids are spread
over the database's key range), then runs backward and the sparse optimizer step. The
tables train on the same batches, interleaved step by step: ``--warmup`` steps fill the
caches, ``--steps`` are timed.

Reported per table: the median step time and its ratio to the all-in-memory step; for the
tiered ones also the hit rates of the cache (distinct ids found there) and of the RAM tier
(rows the cache fetched that RAM held), rows moved per step across each boundary, the disk
bytes read and written per step (``/proc/self/io`` ``read_bytes`` / ``write_bytes`` around
each table's steps: what reached the block device, so rows in the OS page cache cost no
read; a write RocksDB's background threads make lands in the step it overlaps), and the
database directory's size (with the write-ahead log and entries not yet compacted away).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

import veloce
from veloce.storage import Device, RocksDB

_CHUNK = 1 << 18


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (zeros where the file is missing)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except OSError:
        return {"read_bytes": 0, "write_bytes": 0}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(": ", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Zipf:
    """Ids drawn from a Zipf(``alpha``) law over ranks ``0..rows-1``, rank r being ``ids[r]``."""

    def __init__(self, ids: torch.Tensor, alpha: float, gen: torch.Generator) -> None:
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.float64).pow(-alpha)
        self.cdf = weights.cumsum(0)
        self.cdf /= self.cdf[-1].clone()
        self.ids = ids
        self.gen = gen

    def __call__(self, n: int) -> torch.Tensor:
        u = torch.rand(n, generator=self.gen, dtype=torch.float64)
        return self.ids[torch.searchsorted(self.cdf, u).clamp_(max=self.ids.numel() - 1)]


def fill(emb: veloce.DynamicEmbedding, ids: torch.Tensor, gen: torch.Generator) -> float:
    """Puts a row for every id in the table (scored 0: colder than any trained row); returns seconds."""
    table = emb.table
    start = time.perf_counter()
    if not hasattr(table, "store"):
        table.reserve(ids.numel())  # its final slots at once, as a table sized for its rows
    for part in ids.split(_CHUNK):
        rows = torch.randn(part.numel(), table.dim, generator=gen) * 0.01
        state = torch.zeros(part.numel(), table.state_dim, dtype=table.state_dtype)
        if hasattr(table, "store"):  # the tiered table: through its store, as a checkpoint load
            table.store.put(part, rows, state, torch.zeros_like(part), fresh=True)
        else:
            table.insert(part, rows, state, torch.zeros_like(part))
    return time.perf_counter() - start


def tiered_row(name: str, emb: veloce.DynamicEmbedding, path: str, steps: int, io: dict[str, int]) -> dict:
    """A tiered table's figures over the timed steps (its stats were reset before them)."""
    st = emb.stats()
    return {
        "cache_rows": st["cache_capacity"], "ram_rows": st.get("ram_capacity", 0), "db_rows": st["rocksdb_entries"],
        "cache_hit_rate": st["hit_rate"], "ram_hit_rate": st.get("ram_hit_rate"),
        "fetched_per_step": st["fetched"] / steps, "written_back_per_step": st["written_back"] / steps,
        "read_up_per_step": st.get("read_up", st["fetched"]) / steps,
        "written_down_per_step": st.get("written_down", st["written_back"]) / steps,
        "disk_read_bytes_per_step": io["read_bytes"] / steps, "disk_write_bytes_per_step": io["write_bytes"] / steps,
        "db_dir_bytes": du(path),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="ids in the table (all filled before timing)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--cache", type=float, default=1 / 8, help="the cache's rows, as a share of --rows")
    p.add_argument("--ram", type=float, default=1 / 8, help="the RAM tier's rows, as a share of --rows")
    p.add_argument("--no-cache-only", action="store_true",
                   help="leave out the third table (RocksDB with the cache alone, no RAM tier)")  # fmt: skip
    p.add_argument("--batch", type=int, default=1024, help="bags per step")
    p.add_argument("--bag", type=int, default=32, help="ids per bag")
    p.add_argument("--alpha", type=float, default=1.05, help="the Zipf exponent of the ids")
    p.add_argument("--warmup", type=int, default=100, help="untimed steps first (the caches fill)")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dir", default=None, help="where the databases go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    cache_rows = max(1, int(args.rows * args.cache))
    ram_rows = max(1, int(args.rows * args.ram))

    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(args.rows, generator=gen) * 7919 + 13  # rank -> id: hot ids spread over the key range
    draw = Zipf(ids, args.alpha, gen)
    root = tempfile.mkdtemp(dir=args.dir, prefix="veloce-rocksdb-table-")
    paths = {"rocksdb+ram": os.path.join(root, "ram"), "rocksdb": os.path.join(root, "cache_only")}
    specs = {"memory": Device(),
             "rocksdb+ram": RocksDB(paths["rocksdb+ram"], cache_rows=cache_rows, ram_cache_rows=ram_rows)}  # fmt: skip
    if not args.no_cache_only:
        specs["rocksdb"] = RocksDB(paths["rocksdb"], cache_rows=cache_rows)
    labels = {"memory": "`Device()` (all in RAM)",
              "rocksdb+ram": f"`RocksDB(cache_rows={cache_rows}, ram_cache_rows={ram_rows})`",
              "rocksdb": f"`RocksDB(cache_rows={cache_rows})` (no RAM tier)"}  # fmt: skip
    try:
        embs = {name: veloce.DynamicEmbedding(args.dim, mode="sum", optimizer=veloce.optim.Adagrad(lr=args.lr),
                                              storage=spec, seed=1)  # fmt: skip
                for name, spec in specs.items()}
        fill_s = {name: fill(emb, ids, gen) for name, emb in embs.items()}
        tiered = [name for name in embs if name != "memory"]
        for name in tiered:
            embs[name].table.store.flush()
        n = args.batch * args.bag
        offsets = torch.arange(0, n, args.bag)
        times: dict[str, list[float]] = {name: [] for name in embs}
        io = {name: {"read_bytes": 0, "write_bytes": 0} for name in embs}

        distinct = []
        for k in range(args.warmup + args.steps):
            timed = k >= args.warmup
            if k == args.warmup:
                for name in tiered:
                    embs[name].stats(reset=True)
            batch = draw(n)
            if timed:
                distinct.append(torch.unique(batch).numel())
            for name, emb in embs.items():  # the same batch for each table, one after another
                before, start = proc_io(), time.perf_counter()
                emb(batch, offsets).sum().backward()
                emb.step()
                emb.zero_grad()
                took, after = time.perf_counter() - start, proc_io()
                if timed:
                    times[name].append(took)
                    for key in io[name]:
                        io[name][key] += after[key] - before[key]
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        payload = 8 + args.dim * 4 + args.dim * 4 + 8
        result = {
            "args": vars(args), "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "commit": commit(), "fill_s": fill_s, "distinct_ids_per_step": statistics.mean(distinct),
            "payload_bytes_per_row": payload,
            "tables": {name: {"step_ms": ms[name], "ratio": ms[name] / ms["memory"],
                              **(tiered_row(name, embs[name], paths[name], args.steps, io[name]) if name in tiered else {})}
                       for name in embs},
        }  # fmt: skip
        print(f"{result['cpu']}, {result['threads']} threads, torch {result['torch']}, commit {result['commit']}")
        print(f"{args.rows:,} rows, dim {args.dim} float32, Adagrad (payload {payload} B a row), Zipf {args.alpha}, "
              f"{args.batch} bags x {args.bag} ids per step ({n:,} ids, {result['distinct_ids_per_step']:,.0f} "
              f"distinct); median of {args.steps} steps after {args.warmup}, the tables interleaved step by step")  # fmt: skip
        print("fill: " + ", ".join(f"{name} {t:.1f} s" for name, t in fill_s.items()))
        print("\n| table | ms/step | ratio | cache hit rate | RAM tier hit rate | rows up / down per step (cache) "
              "| rows up / down per step (database) | disk read / written per step | database rows | database dir |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, r in result["tables"].items():
            if name == "memory":
                print(f"| {labels[name]} | {r['step_ms']:.1f} | 1.00x | | | | | | | |")
                continue
            ram_rate = "" if r["ram_hit_rate"] is None else f"{r['ram_hit_rate']:.3f}"
            print(f"| {labels[name]} | {r['step_ms']:.1f} | {r['ratio']:.2f}x | {r['cache_hit_rate']:.3f} | {ram_rate} "
                  f"| {r['fetched_per_step']:,.0f} / {r['written_back_per_step']:,.0f} "
                  f"| {r['read_up_per_step']:,.0f} / {r['written_down_per_step']:,.0f} "
                  f"| {r['disk_read_bytes_per_step'] / 1024:,.0f} / {r['disk_write_bytes_per_step'] / 1024:,.0f} KiB "
                  f"| {r['db_rows']:,.0f} | {r['db_dir_bytes'] / 2**20:,.0f} MiB "
                  f"({r['db_dir_bytes'] / max(1, r['db_rows']):.0f} B a row) |")  # fmt: skip
        for name in tiered:
            embs[name].table.store.close()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
