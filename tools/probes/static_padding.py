"""How much more the static exchange moves than the exact one, on configuration 5's ids
(CPU, one process, no communication): per rank count, the rows a rank sends per step padded
to the capacities the planner would reach after ``--steps`` steps, against the rows it must
send. Parts equal ids here (configuration 5's bags hold one id each).

    PYTHONPATH=. python tools/probes/static_padding.py --batch 16384 --steps 20
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_distributed import zipf_ids  # noqa: E402

from veloce.distributed import owner_of  # noqa: E402
from veloce.distributed.static import _level  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--id-space", type=int, default=10**7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worlds", default="2,4,8")
    args = p.parse_args()
    print("| ranks | rows sent per rank (mean, exact) | padded (capacity x ranks) | overhead | "
          "owner's table buffers, capacities of the most loaded owner / exact | the same, its own capacities |")
    print("|---|---|---|---|---|---|")
    for w in (int(x) for x in args.worlds.split(",")):
        gen = torch.Generator().manual_seed(0)
        cap_block, cap_table, exact_sent, exact_recv = 0, [0] * args.features, [], []
        own = [[0] * args.features for _ in range(w)]  # per owner, its own per-table capacities
        for _ in range(args.steps):
            # counts[src, dst, table]
            counts = torch.zeros(w, w, args.features, dtype=torch.long)
            for src in range(w):
                for f in range(args.features):
                    ids = zipf_ids(args.batch, args.alpha, args.id_space, gen, "cpu") + f
                    counts[src, :, f] = torch.bincount(owner_of(ids, w), minlength=w)
            cap_block = _level(int(counts.sum(2).max()), cap_block)
            per_owner_table = counts.sum(0)  # (dst, table)
            cap_table = [_level(int(per_owner_table[:, f].max()) + 1, c) for f, c in enumerate(cap_table)]
            own = [[_level(int(per_owner_table[d, f]) + 1, c) for f, c in enumerate(caps)] for d, caps in enumerate(own)]
            exact_sent.append(counts.sum((1, 2)).float().mean().item())
            exact_recv.append(per_owner_table.sum(1).float().mean().item())
        sent = sum(exact_sent) / len(exact_sent)
        recv = sum(exact_recv) / len(exact_recv)
        print(f"| {w} | {sent:,.0f} | {w * cap_block:,} | {w * cap_block / sent - 1:+.1%} | "
              f"{sum(cap_table):,} / {recv:,.0f} ({sum(cap_table) / recv - 1:+.1%}) | "
              f"{sum(map(sum, own)) / w:,.0f} ({sum(map(sum, own)) / w / recv - 1:+.1%}) |")


if __name__ == "__main__":
    main()
