"""veloce.serving on the CPU: delta publish throughput against the raw stores, inference
lookup latency against ``nn.EmbeddingBag``, and published bytes per training step.

    python benchmarks/bench_serving.py                     # ~2 minutes on 2 CPU cores
    python benchmarks/bench_serving.py --rows 1000000 --dim 128 --json out.json
    python benchmarks/bench_serving.py --parts lookup     # (b) only

(a) **Delta publish**: a model with one table of ``--rows`` rows (ids ``0..rows-1``,
``--dim`` fp32) is published once (the full snapshot, untimed); training lookups then
touch ``--delta`` distinct rows and ``Publisher.publish()`` writes the delta, timed whole
(lease, export of the changed rows, the dense part, the manifest). The raw baseline
writes the same ids and row bytes in the store's own layout with no veloce code around
it: a redis-py pipeline of ``HSET`` (id bytes -> row bytes) in batches of the same size,
and one ``veloce.ops.rocksdb`` store written with ``put`` and ``flush``. Redis is a
``redis-server`` this benchmark starts on a free port (skipped when it or redis-py is
missing); RocksDB is skipped when ``veloce._rocksdb`` is not built. ``ratio`` is the
publish time over the raw time (goal: <= 1.5).

(b) **Lookup**: an ``InferenceEmbedding`` over the published table (the snapshot plus the
delta) answers bags of ``--bag`` ids at batch 1, 64 and 4096 (ids drawn uniformly from
the rows); ``warm``: every row of the batch in the cache; ``cold``: the cache emptied
before each batch, the rows read from the store (a FileStore keeps its parts in memory
once read; RocksDB reads them with MultiGet, Redis with HMGET). The baseline is
``nn.EmbeddingBag`` (sum) over the same rows in memory, indexed by the same ids.
Latency p50 / p99 of one forward over ``--iters`` batches (a tenth of them at 4096), and
throughput in samples/s at p50.

(c) **Bytes per step**: Zipf ids (``--zipf``) over an id space of ``--rows`` train the
table; a FileStore publishes every k steps (k in ``--every``); the bytes of each delta
over its k steps against the bytes of a full snapshot of the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

import veloce
from veloce.ops import rocksdb
from veloce.serving import FileStore, InferenceEmbedding, Publisher, RedisStore, RocksDBStore, ServingStore

_BATCH = 4096  # ids per HSET of the raw pipeline (RedisStore's batch)
PARTS = ("publish", "lookup", "bytes")  # (a), (b), (c)


class OneTable(nn.Module):
    """A table and a small dense head: what a publication writes."""

    def __init__(self, dim: int, capacity: int) -> None:
        super().__init__()
        self.emb = veloce.DynamicEmbedding(dim, mode="sum", capacity=capacity, optimizer=veloce.optim.SGD(lr=0.1),
                                           initializer=veloce.init.normal(std=0.1))  # fmt: skip
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def train_on(model: OneTable, ids: torch.Tensor, batch: int = 8192) -> None:
    """Training lookups (and sparse updates) over ``ids``, ``batch`` at a time."""
    for s in range(0, ids.numel(), batch):
        model(ids[s:s + batch].view(-1, 1)).sum().backward()
        veloce.step_tables([model.emb])
        model.zero_grad()


def filled(dim: int, rows: int) -> OneTable:
    torch.manual_seed(0)
    model = OneTable(dim, capacity=1 << max(10, (2 * rows - 1).bit_length()))
    train_on(model, torch.arange(rows))
    return model


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# ---- redis-server ----------------------------------------------------------------------------
def start_redis(workdir: str) -> tuple[Optional[subprocess.Popen], Optional[str]]:
    """A redis-server on a free port (its process and URL), or (None, why not)."""
    server = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        return None, "redis-py is not installed"
    if server is None:
        return None, "redis-server is not installed"
    for _ in range(5):  # a port taken between the probe and the bind: try another
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                return proc, f"redis://127.0.0.1:{port}/0"
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    return None, "redis-server did not start"


# ---- (a) delta publish ---------------------------------------------------------------------------
def raw_redis(url: str, keys: torch.Tensor, weights: torch.Tensor) -> float:
    import redis

    client = redis.Redis.from_url(url)
    id_bytes = keys.numpy().astype("<i8").tobytes()
    row_bytes = weights.contiguous().view(torch.uint8).numpy().tobytes()
    width = weights.size(1) * weights.element_size()
    start = time.perf_counter()
    with client.pipeline(transaction=False) as p:
        for s in range(0, keys.numel(), _BATCH):
            e = min(s + _BATCH, keys.numel())
            p.hset("raw", mapping={id_bytes[8 * i:8 * i + 8]: row_bytes[width * i:width * (i + 1)] for i in range(s, e)})
        p.execute()
    took = time.perf_counter() - start
    client.delete("raw")
    return took


def raw_rocksdb(path: str, keys: torch.Tensor, weights: torch.Tensor) -> float:
    start = time.perf_counter()
    db = rocksdb.open_store(path, weights.size(1), 0, weights.dtype, torch.float32, 0, 64 << 20, False)
    n = keys.numel()
    for s in range(0, n, 1 << 16):
        e = min(s + (1 << 16), n)
        db.put(keys[s:e], weights[s:e].contiguous(), torch.empty(e - s, 0), torch.zeros(e - s, dtype=torch.long), True)
    db.flush()
    db.close()
    took = time.perf_counter() - start
    shutil.rmtree(path, ignore_errors=True)
    return took


def publish_delta(store: ServingStore, args: argparse.Namespace, raw: Callable[[torch.Tensor, torch.Tensor], float],
                  ) -> dict[str, Any]:  # fmt: skip
    """Median over ``--repeat`` deltas of ``--delta`` rows: publish time and raw time."""
    model = filled(args.dim, args.rows)
    gen = torch.Generator().manual_seed(1)
    with Publisher(store, model, keep_last=2, fold_every=1 << 20) as pub:
        pub.publish()
        pub_times, raw_times, rows = [], [], 0
        for _ in range(args.repeat):
            ids = torch.randperm(args.rows, generator=gen)[: args.delta]
            train_on(model, ids)
            d = model.emb.export(since=pub._clocks["emb"], values_only=True)
            start = time.perf_counter()
            pub.publish()
            pub_times.append(time.perf_counter() - start)
            rows = d["keys"].numel()
            order = torch.argsort(d["keys"])
            raw_times.append(raw(d["keys"][order], d["weights"][order]))
    t, r = float(np.median(pub_times)), float(np.median(raw_times))
    mb = rows * (8 + 4 * args.dim) / 1e6
    return {"rows": rows, "publish_s": t, "raw_s": r, "publish_rows_per_s": rows / t, "publish_mb_per_s": mb / t,
            "raw_rows_per_s": rows / r, "raw_mb_per_s": mb / r, "ratio": t / r}  # fmt: skip


# ---- (b) lookup ----------------------------------------------------------------------------------
def lookup_latency(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor],
                   before: Optional[Callable[[], None]] = None) -> dict[str, float]:  # fmt: skip
    times = []
    with torch.no_grad():
        for ids in batches:
            if before is not None:
                before()
            start = time.perf_counter()
            fn(ids)
            times.append(time.perf_counter() - start)
    p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
    return {"p50_ms": 1e3 * p50, "p99_ms": 1e3 * p99, "samples_per_s": batches[0].size(0) / p50}


def lookups(stores: dict[str, ServingStore], model: OneTable, args: argparse.Namespace) -> list[dict[str, Any]]:
    e = model.emb.export(values_only=True)
    bag = nn.EmbeddingBag(args.rows, args.dim, mode="sum")
    with torch.no_grad():
        bag.weight[e["keys"]] = e["weights"]
    gen = torch.Generator().manual_seed(2)
    out = []
    for batch in (1, 64, 4096):
        iters = args.iters if batch < 4096 else max(20, args.iters // 10)
        batches = [torch.randint(0, args.rows, (batch, args.bag), generator=gen) for _ in range(iters)]
        base = lookup_latency(bag, batches)
        out.append({"batch": batch, "what": "nn.EmbeddingBag", **base})
        for name, store in stores.items():
            inf = InferenceEmbedding(store, "emb", cache_rows=args.rows + 1024)
            inf(batches[0])  # the store's parts opened
            cold = lookup_latency(inf, batches, before=inf.table.clear)
            out.append({"batch": batch, "what": f"{name} cold", **cold, "vs_bag_p50": cold["p50_ms"] / base["p50_ms"]})
            if name == "file":
                inf(torch.arange(args.rows).view(-1, 1))  # every row cached
                warm = lookup_latency(inf, batches)
                out.append({"batch": batch, "what": "warm (any store)", **warm,
                            "vs_bag_p50": warm["p50_ms"] / base["p50_ms"]})  # fmt: skip
    return out


# ---- (c) bytes per step --------------------------------------------------------------------------
def bytes_per_step(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    gen = np.random.default_rng(3)

    def zipf(n: int) -> torch.Tensor:
        return torch.from_numpy((gen.zipf(args.zipf, n) - 1) % args.rows)

    out = []
    for every in args.every:
        torch.manual_seed(0)
        model = OneTable(args.dim, capacity=1 << max(10, (2 * args.rows - 1).bit_length()))
        path = os.path.join(workdir, f"bytes{every}")
        store = FileStore(path)
        with Publisher(store, model, keep_last=1 << 20, fold_every=1 << 20) as pub:
            train_on(model, zipf(args.step_ids * args.warm_steps), batch=args.step_ids)  # the table fills up
            full_v, snapshot_rows = pub.publish(), len(model.emb)
            deltas = []
            for _ in range(args.publications):
                train_on(model, zipf(args.step_ids * every), batch=args.step_ids)
                deltas.append(pub.publish())
        full = du(os.path.dirname(store._part_file(full_v, "dense")))
        delta = float(np.mean([du(os.path.dirname(store._part_file(v, "dense"))) for v in deltas]))
        out.append({"every": every, "table_rows": snapshot_rows, "full_bytes": full, "delta_bytes": delta,
                    "bytes_per_step": delta / every, "delta_over_full": delta / full})  # fmt: skip
        shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows of the published table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--delta", type=int, default=50_000, help="rows changed between two publications (a)")
    p.add_argument("--repeat", type=int, default=3, help="deltas timed (a; the median is reported)")
    p.add_argument("--bag", type=int, default=4, help="ids per sample (b)")
    p.add_argument("--iters", type=int, default=300, help="batches timed at batch 1 and 64 (b; a tenth, >= 20, at 4096)")
    p.add_argument("--every", type=int, nargs="+", default=[1, 10, 100], help="steps between publications (c)")
    p.add_argument("--step-ids", type=int, default=4096, help="ids per training step (c)")
    p.add_argument("--warm-steps", type=int, default=200, help="training steps before the snapshot (c)")
    p.add_argument("--publications", type=int, default=3, help="deltas measured per --every (c)")
    p.add_argument("--zipf", type=float, default=1.15, help="Zipf exponent of the ids (c)")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="the parts run: publish (a), lookup (b), bytes (c); default all")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="bench_serving_", dir=args.dir)
    redis_proc, url = start_redis(workdir)
    result: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args)}
    try:
        if "publish" in args.parts:  # (a)
            publish: dict[str, Any] = {}
            if redis_proc is not None:
                publish["redis"] = publish_delta(RedisStore(url, "pub"), args, lambda k, w: raw_redis(url, k, w))
            else:
                print(f"redis skipped: {url}")
            if rocksdb.available():
                raw_dir = os.path.join(workdir, "raw.rocksdb")
                publish["rocksdb"] = publish_delta(RocksDBStore(os.path.join(workdir, "pub_rocksdb")), args,
                                                   lambda k, w: raw_rocksdb(raw_dir, k, w))  # fmt: skip
            else:
                print("rocksdb skipped: veloce._rocksdb is not built")
            publish["file"] = publish_delta(FileStore(os.path.join(workdir, "pub_file")), args,
                                            lambda k, w: float("nan"))  # fmt: skip
            result["publish"] = publish
            print(f"\n(a) delta publish: {args.rows} rows x dim {args.dim} fp32, deltas of {args.delta} rows "
                  f"(median of {args.repeat})\n")  # fmt: skip
            print("| store | rows | publish rows/s | publish MB/s | raw rows/s | raw MB/s | publish / raw time |")
            print("|---|---|---|---|---|---|---|")
            for name, r in publish.items():
                raw = "- | - | -"  # (a FileStore has no raw counterpart of its own: it is the safetensors file)
                if r["raw_s"] == r["raw_s"]:
                    raw = f"{r['raw_rows_per_s']:,.0f} | {r['raw_mb_per_s']:,.1f} | {r['ratio']:.2f}x"
                print(f"| {name} | {r['rows']:,} | {r['publish_rows_per_s']:,.0f} | {r['publish_mb_per_s']:,.1f} "
                      f"| {raw} |")  # fmt: skip

        if "lookup" in args.parts:  # (b): a snapshot and a delta in each store
            model = filled(args.dim, args.rows)
            stores: dict[str, ServingStore] = {"file": FileStore(os.path.join(workdir, "look_file"))}
            if rocksdb.available():
                stores["rocksdb"] = RocksDBStore(os.path.join(workdir, "look_rocksdb"))
            if redis_proc is not None:
                stores["redis"] = RedisStore(url, "look")
            pubs = [Publisher(store, model) for store in stores.values()]  # (no eviction: no tombstone to share)
            for pub in pubs:
                pub.publish()
            train_on(model, torch.randperm(args.rows)[: args.delta])
            for pub in pubs:
                pub.publish()
                pub.close()
            result["lookup"] = lookups(stores, model, args)
            print(f"\n(b) lookup: bags of {args.bag} ids, uniform over {args.rows} rows; cold = cache emptied before "
                  f"each batch\n")  # fmt: skip
            print("| batch | lookup | p50 ms | p99 ms | samples/s | p50 vs nn.EmbeddingBag |")
            print("|---|---|---|---|---|---|")
            for r in result["lookup"]:
                vs = f"{r['vs_bag_p50']:.1f}x" if "vs_bag_p50" in r else "1.0x"
                print(f"| {r['batch']} | {r['what']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
                      f"| {r['samples_per_s']:,.0f} | {vs} |")  # fmt: skip

        if "bytes" in args.parts:  # (c)
            result["bytes"] = bytes_per_step(args, workdir)
            print(f"\n(c) published bytes: Zipf({args.zipf}) ids over {args.rows}, {args.step_ids} ids per step, "
                  f"FileStore\n")  # fmt: skip
            print("| publish every | rows at the snapshot | full snapshot bytes | delta bytes | bytes per step "
                  "| delta / full |")  # fmt: skip
            print("|---|---|---|---|---|---|")
            for r in result["bytes"]:
                print(f"| {r['every']} steps | {r['table_rows']:,} | {r['full_bytes']:,} | {r['delta_bytes']:,.0f} | "
                      f"{r['bytes_per_step']:,.0f} | {r['delta_over_full']:.3f} |")  # fmt: skip
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
