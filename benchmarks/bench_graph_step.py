"""A training step run eagerly against the same step as one CUDA graph (veloce.CUDAGraphStep).

    python benchmarks/bench_graph_step.py                    # configuration 5's DLRM on one GPU
    python benchmarks/bench_graph_step.py --batch 65536 --tf32 --json out.json

The model is configuration 5's DLRM (26 tables, dim 128, bags of one id, bottom MLP 512-256-128,
top MLP 1024-1024-512-256-1) on one GPU, unsharded, trained with RowWiseAdagrad tables and a
dense Adam (``capturable=True`` in both runs) through a CombinedOptimizer. Two copies of the
model train side by side on the same batches: one eagerly (tables with ``defer_inserts=True``,
the graph's insert semantics), one through ``CUDAGraphStep``. Timed windows of back-to-back
steps alternate between them; the table reports the median window of each and the ratio,
headed by the device, torch version and configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

import veloce
from veloce.models import DLRM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import dlrm_batches, whole_step


def make_step(args, device):
    torch.manual_seed(0)

    def table(dim):
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=args.capacity, device=device, defer_inserts=True,
                                       optimizer=veloce.optim.RowWiseAdagrad(lr=0.01), nonfinite_grad=args.nonfinite)  # fmt: skip

    model = DLRM(13, args.features, embedding_dim=args.dim, bottom_mlp=(512, 256, args.dim),
                 top_mlp=(1024, 1024, 512, 256, 1), embedding_factory=table).to(device)  # fmt: skip
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True), model)
    return model, opt, whole_step(model, nn.BCEWithLogitsLoss(), opt)


def window(run, batches, steps, start) -> float:
    """ms per step of ``steps`` back-to-back steps (between two device syncs)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        run(*batches[(start + i) % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--id-space", type=int, default=10**7)
    p.add_argument("--capacity", type=int, default=1 << 20)
    p.add_argument("--tf32", action="store_true", help="TF32 matmuls for the dense layers (torch's default: off)")
    p.add_argument("--nonfinite", default="raise", choices=["raise", "raise_next", "apply"])
    p.add_argument("--distinct-batches", type=int, default=20)
    p.add_argument("--steps", type=int, default=30, help="steps per timed window")
    p.add_argument("--windows", type=int, default=4, help="timed windows per variant, alternating")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_graph_step.py needs a CUDA device")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    batches = dlrm_batches(args, args.distinct_batches, 0, device)
    _, _, eager = make_step(args, device)
    model, opt, fn = make_step(args, device)
    graphed = veloce.CUDAGraphStep(fn, model, opt)
    for b in batches:  # warm: every id of the batches inserted in both, the graph captured
        eager(*b)
        graphed(*b)
    gc.disable()
    times: dict[str, list[float]] = {"eager": [], "graph": []}
    try:
        for w in range(args.windows):
            for name, run in (("eager", eager), ("graph", graphed)) if w % 2 == 0 else (("graph", graphed),
                                                                                           ("eager", eager)):
                times[name].append(window(run, batches, args.steps, w * args.steps))
    finally:
        gc.enable()
    e, g = statistics.median(times["eager"]), statistics.median(times["graph"])
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fp32 rows, "
            f"{'TF32' if args.tf32 else 'fp32'} matmuls; DLRM (configuration 5) on one GPU, {args.batch} samples, "
            f"{args.features} tables x dim {args.dim}, nonfinite_grad={args.nonfinite}")  # fmt: skip
    print(f"### {head}\n")
    print("| step | ms per step (median window) | windows | samples/s | vs eager |")
    print("|---|---|---|---|---|")
    rows = []
    for name, ms in (("eager", e), ("CUDAGraphStep", g)):
        key = "eager" if name == "eager" else "graph"
        ratio = e / ms
        print(f"| {name} | {ms:.3f} | {', '.join(f'{t:.2f}' for t in times[key])} | {args.batch / ms * 1e3:,.0f} | "
              f"{ratio:.2f}x |")
        rows.append({"step": name, "ms": ms, "windows_ms": times[key], "speedup": ratio})
    print(f"\ncaptures: {graphed.captures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "args": vars(args), "rows": rows, "captures": graphed.captures}, f, indent=1)


if __name__ == "__main__":
    main()
