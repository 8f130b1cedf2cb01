"""A training step of a model with DynamicEmbedding tables, eager against ``torch.compile``.

    python benchmarks/bench_compile.py                         # GPU if there is one, else CPU sizes
    python benchmarks/bench_compile.py --device cpu --json out.json
    python benchmarks/bench_compile.py --batch 65536 --tf32   # GPU, larger batch

Two models, each trained by two copies side by side on the same batches: one eagerly, one
as ``torch.compile(model)`` (default mode: the forward and its backward compiled; the loss,
``backward()`` and the optimizer step as a user writes them):

- ``DLRM``: ``veloce.models.DLRM`` (configuration 5's shape on a GPU: 26 tables of dim 128,
  bags of one id, bottom MLP 512-256-128, top MLP 1024-1024-512-256-1; smaller on a CPU);
  its tables are looked up by one ``lookup_many``.
- ``one table``: one ``DynamicEmbedding`` over bags of ``--bag`` ids and an MLP head.

Tables start at ``--capacity`` slots and grow during the warm-up (every batch is run once
by both copies first; the compiled copy compiles then). Timed windows of back-to-back
steps alternate between the copies; the table reports the median window of each, the
ratio, the graphs and graph breaks of the forward (``torch._dynamo.explain``), the graphs
compiled over the whole run (``torch._dynamo.utils.counters``: more than the explain's
count means a recompile), the time of the first compiled step and the tables' growth.
"""

from __future__ import annotations

import argparse
import copy
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

PRESETS = {  # per device: batch, features, dim, bottom MLP (its last = dim), top MLP
    "cuda": (16384, 26, 128, (512, 256), (1024, 1024, 512, 256, 1)),
    "cpu": (2048, 8, 16, (64,), (64, 32, 1)),
}


class OneTable(nn.Module):
    """One DynamicEmbedding over bags of ids, and an MLP head over its pooled rows."""

    def __init__(self, dim: int, capacity: int) -> None:
        super().__init__()
        self.emb = veloce.DynamicEmbedding(dim, mode="sum", capacity=capacity)
        self.head = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(sparse)).squeeze(-1)


def make_model(name: str, args, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if name == "DLRM":
        def table(dim):
            return veloce.DynamicEmbedding(dim, mode="sum", capacity=args.capacity,
                                           optimizer=veloce.optim.RowWiseAdagrad(lr=0.01))  # fmt: skip

        model = DLRM(13, args.features, embedding_dim=args.dim, bottom_mlp=(*args.bottom, args.dim),
                     top_mlp=args.top, embedding_factory=table)  # fmt: skip
    else:
        model = OneTable(args.dim, args.capacity)
    return model.to(device)


def batches_for(name: str, args, device: torch.device) -> list:
    """The DLRM batches; for one table, each sample's ``--bag`` ids of the same Zipf space."""
    out = dlrm_batches(args, args.distinct_batches, 0, device)
    if name == "DLRM":
        return out
    reps = -(-args.bag // args.features)
    return [(d, s.repeat(1, reps)[:, : args.bag] * (1 + torch.arange(args.bag, device=device)), y) for d, s, y in out]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def window(run, batches, steps: int, start: int, device: torch.device) -> float:
    """ms per step of ``steps`` back-to-back steps (between two device syncs)."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        run(*batches[(start + i) % len(batches)])
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def measure(name: str, args, device: torch.device) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    batches = batches_for(name, args, device)
    eager_model = make_model(name, args, device)
    explained = torch._dynamo.explain(copy.deepcopy(eager_model))(*batches[0][:2])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # from here: the graphs the compiled copy compiles
    compiled_model = copy.deepcopy(eager_model)
    loss_fn = nn.BCEWithLogitsLoss()
    eager = whole_step(eager_model, loss_fn, veloce.CombinedOptimizer(
        torch.optim.Adam(eager_model.parameters(), lr=1e-3), eager_model))  # fmt: skip
    compiled = whole_step(torch.compile(compiled_model), loss_fn, veloce.CombinedOptimizer(
        torch.optim.Adam(compiled_model.parameters(), lr=1e-3), compiled_model))  # fmt: skip
    tables = [m for m in compiled_model.modules() if isinstance(m, veloce.DynamicEmbedding)]
    capacity_before = sum(t.capacity for t in tables)
    sync(device)
    t0 = time.perf_counter()
    first_diff = abs(float(compiled(*batches[0])) - float(eager(*batches[0])))
    sync(device)
    first_step_s = time.perf_counter() - t0
    for b in batches[1:]:  # warm: every id of the batches inserted in both (the tables grow)
        eager(*b)
        compiled(*b)
    gc.disable()
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    try:
        for w in range(args.windows):
            order = (("eager", eager), ("compiled", compiled))
            for key, run in order if w % 2 == 0 else order[::-1]:
                times[key].append(window(run, batches, args.steps, w * args.steps, device))
    finally:
        gc.enable()
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {
        "model": name, "eager_ms": e, "compiled_ms": c, "speedup": e / c, "eager_windows_ms": times["eager"],
        "compiled_windows_ms": times["compiled"], "graphs": explained.graph_count,
        "graph_breaks": explained.graph_break_count, "break_reasons": [r.reason.split("\n")[0] for r in
                                                                      explained.break_reasons],
        "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "first_compiled_step_s": first_step_s, "first_loss_diff": first_diff,
        "capacity": [capacity_before, sum(t.capacity for t in tables)], "tables": len(tables),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", choices=("DLRM", "one table"), default=["DLRM", "one table"])
    p.add_argument("--batch", type=int, default=None, help="samples per step (default: the device's preset)")
    p.add_argument("--features", type=int, default=None, help="DLRM tables (default: the device's preset)")
    p.add_argument("--dim", type=int, default=None, help="embedding dim (default: the device's preset)")
    p.add_argument("--bag", type=int, default=20, help="ids per bag of the one-table model")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--id-space", type=int, default=10**7)
    p.add_argument("--capacity", type=int, default=1024, help="initial slots per table (they grow in the warm-up)")
    p.add_argument("--tf32", action="store_true", help="TF32 matmuls for the dense layers (torch's default: off)")
    p.add_argument("--distinct-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps per timed window")
    p.add_argument("--windows", type=int, default=4, help="timed windows per variant, alternating")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    batch, features, dim, bottom, top = PRESETS[args.device]
    args.batch, args.features, args.dim = args.batch or batch, args.features or features, args.dim or dim
    args.bottom, args.top = bottom, top
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    rows = [measure(name, args, device) for name in args.models]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    head = (f"{where}, torch {torch.__version__}, fp32; {args.batch} samples per step; DLRM: {args.features} tables "
            f"x dim {args.dim}, bags of 1, MLPs {(*args.bottom, args.dim)} / {args.top}; one table: dim {args.dim}, "
            f"bags of {args.bag}; Zipf({args.alpha}) ids; tables from {args.capacity} slots, RowWiseAdagrad / "
            f"Adagrad, dense Adam; torch.compile(model), default mode")  # fmt: skip
    print(f"### {head}\n")
    print("| model | eager ms/step | compiled ms/step | speedup | graphs | graph breaks | graphs compiled in the run "
          "| first compiled step (s) | table slots (start -> end) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['speedup']:.2f}x | {r['graphs']} | "
              f"{r['graph_breaks']} | {r['graphs_compiled']} | {r['first_compiled_step_s']:.1f} | "
              f"{r['capacity'][0]:,} -> {r['capacity'][1]:,} |")
    for r in rows:
        if r["break_reasons"]:
            print(f"\n{r['model']}: graph breaks: " + "; ".join(r["break_reasons"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
