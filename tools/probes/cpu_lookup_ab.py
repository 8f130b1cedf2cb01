"""CPU pooled_lookup and accumulate_and_update against F.embedding_bag, as ratios.

On a noisy machine times of one build move by up to 2x within minutes, so each round times
the op and then F.embedding_bag on the same ids, and the figure is the median over rounds
of their ratio (with the op's median ms). One tree per process (PYTHONPATH picks it); an
A/B interleaves processes of both trees (benchmarks/README.md, thirty-third session):

    for t in old new old new; do
      echo "$t $(PYTHONPATH=<tree of $t> python tools/probes/cpu_lookup_ab.py --threads 2)"; done

Prints one line of JSON: {case: [ratio, ms]}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import veloce  # noqa: F401  (registers torch.ops.veloce)
from veloce.ops.embedding import pooled_lookup
from veloce.ops.optimizer import accumulate_and_update


def ratio(op, yardstick, rounds: int = 31) -> tuple[float, float]:
    """(median of op time / yardstick time, median op ms), the yardstick right after the op."""
    for _ in range(3):
        op()
        yardstick()
    ratios, times = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        op()
        t1 = time.perf_counter()
        yardstick()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
        times.append(t1 - t0)
    return round(sorted(ratios)[rounds // 2], 3), round(sorted(times)[rounds // 2] * 1e3, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    D, res = args.dim, {}
    for rows in (10_000, 1_000_000):
        for L in (1, 20):
            g = torch.Generator().manual_seed(0)
            B = 65536 if L == 1 else 8192
            w = torch.randn(rows, D, generator=g)
            s = torch.randint(0, rows, (B * L,), generator=g)
            o = torch.arange(0, B * L, L)

            def embedding_bag():
                F.embedding_bag(s, w, o, mode="sum")

            def lookup():
                pooled_lookup(w, s, o, check_inputs=False)

            res[f"lookup/embedding_bag r{rows} L{L}"] = ratio(lookup, embedding_bag)
            go = torch.randn(B, D, generator=g)
            for opt, S in (("sgd", 0), ("adam", 2 * D)):
                st = torch.zeros(rows, S)

                def update():
                    accumulate_and_update(w, st, go, s, o, None, "sum", False, opt, 1e-3, check_inputs=False)

                res[f"update_{opt}/embedding_bag r{rows} L{L}"] = ratio(update, embedding_bag)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
