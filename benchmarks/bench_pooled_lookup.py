"""The pooled_lookup forward alone: achieved bandwidth against a device copy and F.embedding_bag.

    python benchmarks/bench_pooled_lookup.py                          # fp32, dim 128, bags of 1 and 20
    python benchmarks/bench_pooled_lookup.py --dtype bfloat16 --bags 1,2,5,20 --json out.json

Per bag length L: B = ids // L bags of exactly L ids (N = B * L), ids uniform over a table
of --rows rows (far larger than L2, so every row comes from HBM), sum mode. Times
``pooled_lookup(..., check_inputs=False)`` (the kernel alone: no check, no host sync)
and ``F.embedding_bag`` on the same slots and offsets, side by side: CUDA events around
each call, --warmup calls first, median of --iters.

Bytes per call: slots 8N + offsets 8B + rows N*D*s read + output B*D*s written (s = bytes
per element). Percentages are of the device-to-device copy bandwidth measured in the same
run (2 * 1 GiB moved per ``dst.copy_(src)``, median of the same number of calls).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import veloce  # noqa: F401  (registers torch.ops.veloce)
from veloce.ops.embedding import pooled_lookup


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(warmup: int, iters: int) -> float:
    """Device-to-device copy, GB/s counting read + write."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    src.random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, iters)
    return 2 * 2**30 / ms / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16 * 2**20, help="table rows (default 16M)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32")
    p.add_argument("--ids", type=int, default=1_048_570, help="ids per call (N); B = ids // bag")
    p.add_argument("--bags", default="1,20", help="bag lengths, comma separated")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pooled_lookup.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(args.warmup, args.iters)
    torch.cuda.empty_cache()

    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.empty(args.rows, args.dim, dtype=dtype, device="cuda")
    weights.normal_(generator=gen)
    exact = dtype in (torch.float32, torch.float64)
    tol = {"rtol": 1e-5, "atol": 1e-5} if exact else {"rtol": 2e-2, "atol": 2e-2}
    results = []
    for bag in (int(b) for b in args.bags.split(",")):
        B = args.ids // bag
        N = B * bag
        slots = torch.randint(0, args.rows, (N,), device="cuda", generator=gen)
        offsets = torch.arange(0, N, bag, device="cuda")

        def ours(slots=slots, offsets=offsets):
            return pooled_lookup(weights, slots, offsets, None, "sum", False, None, False)

        def theirs(slots=slots, offsets=offsets):
            return F.embedding_bag(slots, weights, offsets, mode="sum")

        torch.testing.assert_close(ours(), theirs(), **tol)
        nbytes = 8 * N + 8 * B + elem * N * args.dim + elem * B * args.dim
        row = {"bag": bag, "B": B, "N": N, "bytes": nbytes}
        for label, fn in (("veloce", ours), ("embedding_bag", theirs)):
            ms = time_ms(fn, args.warmup, args.iters)
            row[label] = {"ms": ms, "GB/s": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / copy_gbs}
        results.append(row)

    print(
        f"\n### pooled_lookup: {name}, torch {torch.__version__}, {args.dtype}, dim {args.dim}, "
        f"table {args.rows:,} rows, sum, median of {args.iters}\n"
    )
    print(f"Device-to-device copy (1 GiB, read + write): {copy_gbs:,.0f} GB/s\n")
    print(
        "| bag | bags (B) | ids (N) | MB moved | veloce ms | GB/s | % of copy "
        "| embedding_bag ms | GB/s | % of copy | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        v, e = r["veloce"], r["embedding_bag"]
        print(
            f"| {r['bag']} | {r['B']:,} | {r['N']:,} | {r['bytes'] / 1e6:,.0f} | {v['ms']:.3f} | {v['GB/s']:,.0f} | "
            f"{v['pct_copy']:.0f}% | {e['ms']:.3f} | {e['GB/s']:,.0f} | {e['pct_copy']:.0f}% | "
            f"{e['ms'] / v['ms']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "config": vars(args),
                    "copy_GB/s": copy_gbs,
                    "rows": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
