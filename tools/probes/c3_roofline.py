"""The bytes a configuration-3 step must move, from the ids bench_embedding.py draws (CPU).

    python tools/probes/c3_roofline.py                  # configuration 3: SGD and Adam, dim 128, fp32
    python tools/probes/c3_roofline.py --bandwidth 3.0  # another card's copy bandwidth (TB/s)

Counts the distinct rows U of one step's N ids (bench_embedding.make_ids, seed 0) and how
often they repeat, then prints BENCHMARKS.md's roofline terms in MB and the floor they set at
the given copy bandwidth (default 4.3 TB/s, the H200's measured device-to-device copy), with
and without the NaN/Inf check's own pass over the gradient (nonfinite_grad="raise").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_embedding import make_ids  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=104_857)
    p.add_argument("--features", type=int, default=10)
    p.add_argument("--ids-per-feature", type=int, default=1_600_000)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bandwidth", type=float, default=4.3, help="copy bandwidth, TB/s (read + write)")
    p.add_argument("--target-ms", type=float, default=0.62, help="a step time to express as a share of the bandwidth")
    args = p.parse_args()
    ns = argparse.Namespace(batch=args.batch, features=args.features, ids_per_feature=args.ids_per_feature,
                            bag=1, dist="zipf", alpha=args.alpha, warmup=0, steps=1)  # fmt: skip
    idx, _ = make_ids(ns, torch.Generator().manual_seed(0))[0]
    _, counts = idx.unique(return_counts=True)
    N, U, D = idx.numel(), counts.numel(), args.dim
    print(f"N = {N:,} ids, U = {U:,} distinct rows (U/N = {U / N:.3f})")
    for lo, hi in ((1, 1), (2, 4), (5, 64), (65, None)):
        m = (counts >= lo) & (counts <= hi) if hi is not None else counts >= lo
        span = f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi is not None else f">{lo - 1}")
        print(f"  rows seen {span} times: {int(m.sum()):,} ({int(counts[m].sum()):,} ids)")
    terms = {
        "pooled output written (4ND)": 4 * N * D,
        "distinct rows gathered (4UD)": 4 * U * D,
        "gradient read by the update (4ND)": 4 * N * D,
        "gradient read by the NaN/Inf check (4ND)": 4 * N * D,
        "rows read and written by the update (8UD)": 8 * U * D,
        "Adam's state read and written (16UD)": 16 * U * D,
    }
    print("\n| | MB |\n|---|---|")
    for name, b in terms.items():
        print(f"| {name} | {b / 1e6:,.0f} |")
    check = terms["gradient read by the NaN/Inf check (4ND)"]
    sgd = sum(terms.values()) - terms["Adam's state read and written (16UD)"]
    adam = sum(terms.values())
    bw = args.bandwidth * 1e12
    print()
    for name, b in (("SGD", sgd), ("Adam", adam)):
        print(f"{name}: {b / 1e6:,.0f} MB with the check ({b / bw * 1e3:.2f} ms at {args.bandwidth} TB/s), "
              f"{(b - check) / 1e6:,.0f} MB without ({(b - check) / bw * 1e3:.2f} ms); "
              f"{args.target_ms} ms would be {b / (args.target_ms * 1e-3) / bw:.0%} of the bandwidth with the check")  # fmt: skip


if __name__ == "__main__":
    main()
