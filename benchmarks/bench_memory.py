"""Memory per row of a full table, and the cost of growing one against reserve() (docs/memory.md).

    python benchmarks/bench_memory.py                      # both parts, CPU
    python benchmarks/bench_memory.py --part rows          # bytes per row at max_capacity
    python benchmarks/bench_memory.py --part growth --rows 2000000 --device cuda

``rows``: for each embedding dim and sparse optimizer, a ``DynamicEmbedding`` with
``max_capacity`` (default 100,000) and LRU eviction is filled past it (110 % of it in new
ids) by training forwards from its default capacity; printed are the payload of a row (the
row, its optimizer state, key, score and digest), the rows and slots held, the bytes of the
table's state per row held and their ratio to the payload, and the bytes per row that
``max_capacity`` asked for.

``growth``: ``--rows`` distinct ids (dim 16, Adagrad by default) are looked up in training
mode in batches of ``--batch``, by a table grown from its default capacity and by one that
called ``reserve(rows)`` first. Printed: the seconds of the inserts (the reserve included)
and the peak memory above the start (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the
peak resident set of a fresh process per variant, over its size before the inserts).
A veloce without ``reserve`` (an older one on ``PYTHONPATH``) runs the growing variant alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import torch

import veloce

OPTIMIZERS = {
    "SGD": lambda: veloce.optim.SGD(lr=0.1),
    "RowWiseAdagrad": lambda: veloce.optim.RowWiseAdagrad(lr=0.1),
    "Adagrad": lambda: veloce.optim.Adagrad(lr=0.1),
    "Adam": lambda: veloce.optim.Adam(lr=0.1),
}


def ids_for(start: int, n: int, device: str) -> torch.Tensor:
    """n distinct ids (a bijection of start .. start + n - 1), spread like real ones."""
    return (torch.arange(start, start + n, dtype=torch.long, device=device) * 0x9E3779B97F4A7C15).view(-1, 1)


def state_bytes(emb: veloce.DynamicEmbedding) -> int:
    return sum(b.numel() * b.element_size() for b in emb.table._buffers.values())


def fill(emb: veloce.DynamicEmbedding, rows: int, batch: int, device: str) -> None:
    for start in range(0, rows, batch):
        emb(ids_for(start, min(batch, rows - start), device))  # a training lookup inserts; nothing kept


def rows_part(args) -> list[dict]:
    out = []
    for dim in args.dims:
        for name, make in OPTIMIZERS.items():
            emb = veloce.DynamicEmbedding(dim, mode="sum", max_capacity=args.max_capacity, optimizer=make(),
                                          device=args.device)  # fmt: skip
            fill(emb, args.max_capacity + args.max_capacity // 10, args.batch, args.device)  # past it: LRU evicts
            s = emb.table.state_dim
            payload = dim * emb.table.weights.element_size() + s * emb.table.opt_state.element_size() + 8 + 8 + 1
            per_row = state_bytes(emb) / len(emb)
            out.append({"dim": dim, "optimizer": name, "rows": len(emb), "slots": emb.capacity, "payload": payload,
                        "bytes_per_row": per_row, "ratio": per_row / payload,
                        "bytes_per_max_row": state_bytes(emb) / args.max_capacity})  # fmt: skip
    return out


def one_growth(variant: str, args) -> dict:
    """One variant in this process: seconds and peak memory of inserting args.rows ids."""
    emb = veloce.DynamicEmbedding(args.dim, mode="sum", optimizer=OPTIMIZERS[args.optimizer](), device=args.device)
    emb(ids_for(-1, 1, args.device))  # warm the op path (one row)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kib() * 1024
    t0 = time.perf_counter()
    if variant == "reserve":
        emb.reserve(args.rows + 1)
    fill(emb, args.rows, args.batch, args.device)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss_kib() * 1024) - base
    return {"variant": variant, "seconds": seconds, "peak_bytes": peak, "rows": len(emb), "slots": emb.capacity,
            "state_bytes": state_bytes(emb)}  # fmt: skip


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def _peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def growth_part(args) -> list[dict]:
    variants = ["grow"] + (["reserve"] if hasattr(veloce.DynamicEmbedding, "reserve") else [])
    out = []
    for variant in variants:
        # A fresh process per variant: the CPU's peak resident set cannot be reset.
        cmd = [sys.executable, __file__, "--one", variant, "--rows", str(args.rows), "--batch", str(args.batch),
               "--dim", str(args.dim), "--optimizer", args.optimizer, "--device", args.device]  # fmt: skip
        res = subprocess.run(cmd, check=True, capture_output=True, text=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["rows", "growth", "both"], default="both")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--max-capacity", type=int, default=100_000)
    p.add_argument("--rows", type=int, default=1_000_000, help="growth: distinct ids inserted")
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--dim", type=int, default=16, help="growth: embedding dim")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="Adagrad", help="growth: optimizer")
    p.add_argument("--one", choices=["grow", "reserve"], help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_growth(args.one, args)))
        return
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"device {args.device} ({dev}), torch {torch.__version__}, float32 rows\n")
    result = {}
    if args.part in ("rows", "both"):
        result["rows"] = rows_part(args)
        print(f"Bytes per row of a table filled past max_capacity {args.max_capacity:,} (LRU), grown from its "
              f"default capacity:\n")  # fmt: skip
        print("| dim | optimizer | payload B/row | rows held | slots | B/row held | ratio | B per max_capacity row |")
        print("|---|---|---|---|---|---|---|---|")
        for r in result["rows"]:
            print(f"| {r['dim']} | {r['optimizer']} | {r['payload']} | {r['rows']:,} | {r['slots']:,} | "
                  f"{r['bytes_per_row']:.1f} | {r['ratio']:.2f}x | {r['bytes_per_max_row']:.1f} |")  # fmt: skip
        print()
    if args.part in ("growth", "both"):
        result["growth"] = growth_part(args)
        print(f"{args.rows:,} new ids in batches of {args.batch:,}, dim {args.dim}, {args.optimizer}:\n")
        print("| table | seconds | peak memory MB | state MB at the end | slots |")
        print("|---|---|---|---|---|")
        for r in result["growth"]:
            what = "grown from the default capacity" if r["variant"] == "grow" else "reserve(rows) first"
            print(f"| {what} | {r['seconds']:.2f} | {r['peak_bytes'] / 2**20:.0f} | {r['state_bytes'] / 2**20:.0f} | "
                  f"{r['slots']:,} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
