"""Host CPU time of a training step, on the CPU, without a GPU: the cost of veloce's Python.

On two GPUs the sharded DLRM step of configuration 5 is bound by its host path
(``bench_distributed.py --phases`` shows it): the time the main thread spends in
Python and in launching work. On a CPU with a tiny batch, the main thread's CPU time per
step (``time.thread_time``, which a wait does not count) measures that path closely and
repeatably. Compare changes with interleaved runs.

    python tools/host_time.py                # 26 sharded tables (one process, gloo)
    python tools/host_time.py --local        # the same model without sharding
    python tools/host_time.py --profile tottime   # then a cProfile of 100 steps (under torchrun: rank 0's)

The sharded path runs in one process: the tables are sharded over a gloo group of one
rank, so other ranks' waits and scheduling do not add noise. Under torchrun they are
sharded over its ranks (``torchrun --nproc_per_node 4 tools/host_time.py``): the work
that grows with the number of peers (per-peer blocks) shows, and rank 0 reports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_distributed import batches

import veloce
from veloce.models import DLRM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--local", action="store_true", help="no sharding: the single-process path")
    p.add_argument("--sparse", default="sync", choices=["sync", "async"], help="HybridParallel's sparse mode")
    p.add_argument("--profile", default=None, help="a pstats sort key: print a cProfile of 100 more steps")
    p.add_argument("--ops", action="store_true",
                   help="then count the torch ops dispatched per step (on a GPU, each launches work)")
    args = p.parse_args()
    args.alpha, args.id_space, args.profile_steps = 1.05, 10**7, 0
    if "WORLD_SIZE" in os.environ:  # under torchrun: sharded over its ranks (rank 0 reports)
        dist.init_process_group("gloo")
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    def table(dim):
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=1 << 14, nonfinite_grad="raise_next",
                                       optimizer=veloce.optim.RowWiseAdagrad(lr=0.01))  # fmt: skip

    model = DLRM(13, args.features, embedding_dim=args.dim, bottom_mlp=(32, args.dim), top_mlp=(32, 1),
                 embedding_factory=table)  # fmt: skip
    hp = veloce.distributed.HybridParallel(model, sparse=args.sparse)
    if args.local and world > 1:
        raise SystemExit("--local: one process only (without torchrun)")
    if not args.local and world == 1:
        hp._shard_tables(None)  # sharded over the one rank: the sharded path's host work
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), hp)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = batches(args, rank, torch.device("cpu"))
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for i, (dense, sparse, label) in enumerate(data):
        t0 = time.thread_time()
        out = hp(dense, sparse)
        t1 = time.thread_time()
        loss_fn(out, label).backward()
        t2 = time.thread_time()
        opt.step()
        opt.zero_grad()
        t3 = time.thread_time()
        if i >= args.warmup:
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    what = "local" if args.local else f"sharded over {world} rank(s)"
    if rank == 0:
        print(f"{what}, {args.features} tables: main-thread CPU ms per step (median of {args.steps}): "
              + ", ".join(f"{k} {v:.3f}" for k, v in med.items()) + f", total {sum(med.values()):.3f}")  # fmt: skip
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile(time.thread_time)  # every rank runs the steps; rank 0 profiles its own
        if rank == 0:
            prof.enable()
        for dense, sparse, label in data[:100]:
            loss_fn(hp(dense, sparse), label).backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            prof.disable()
            pstats.Stats(prof).sort_stats(args.profile).print_stats(40)
    if args.ops:
        _count_ops(lambda d, s, y: (loss_fn(hp(d, s), y).backward(), opt.step(), opt.zero_grad()), data[:10],
                   rank == 0)
    dist.destroy_process_group()


def _count_ops(step, data, report: bool = True) -> None:
    """Prints the torch ops (aten, veloce, c10d) that ``step`` dispatches per batch of ``data``."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.callers: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            self.callers[_veloce_caller()] += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        for batch in data:
            step(*batch)
    n = len(data)
    if not report:
        return
    print(f"torch ops dispatched per step: {sum(count.ops.values()) / n:.1f}")
    for name, c in count.ops.most_common(40):
        print(f"  {c / n:7.1f}  {name}")
    print("by the innermost veloce (or model) function that dispatched them:")
    for name, c in count.callers.most_common(30):
        print(f"  {c / n:7.1f}  {name}")


def _veloce_caller() -> str:
    """``file:function`` of the innermost frame in veloce's package (else the first frame
    outside torch), for attributing a dispatched op."""
    f = sys._getframe(2)
    first = None
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if name.startswith(_PACKAGE):
            return f"{os.path.relpath(name, _ROOT)}:{f.f_code.co_name}"
        if first is None and f"{os.sep}torch{os.sep}" not in name:
            first = f"{os.path.basename(name)}:{f.f_code.co_name}"
        f = f.f_back
    return first or "?"


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE = os.path.join(_ROOT, "veloce") + os.sep  # the package, not the repository (which may be named veloce)


if __name__ == "__main__":
    main()
