"""Profile one training step with torch.profiler (GPU or CPU).

    python tools/profile_step.py --device cuda            # one table, BENCHMARKS.md configuration 3 shape
    python tools/profile_step.py --device cpu --rows 1000000 --batch 65536
    python tools/profile_step.py --model dlrm             # configuration 5 on one GPU: DLRM, 26 tables

Prints the ops and kernels that take the most device (or CPU) time, the host-side
CUDA runtime calls (synchronizations and copies, per step), and the wall time per
step, so the next optimisation targets what the step really spends time on.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import veloce

SCRAMBLE = 0x9E3779B97F4A7C15 - (1 << 64)
STEPS = 5


def table_step(args, dev):
    opt = veloce.optim.Adam() if args.optimizer == "adam" else veloce.optim.SGD(lr=0.01)
    emb = veloce.DynamicEmbedding(args.dim, mode="sum", capacity=2 * args.rows, optimizer=opt, device=dev)
    for chunk in torch.arange(args.rows, device=dev).split(1 << 21):
        emb.table.find_or_insert(chunk * SCRAMBLE)
    probs = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** args.alpha
    ids = (torch.multinomial(probs, args.batch, replacement=True) * SCRAMBLE).to(dev)
    offsets = torch.arange(args.batch, device=dev)
    grad = torch.randn(args.batch, args.dim, device=dev)

    def step():
        emb(ids, offsets).backward(grad)
        emb.step()
        emb.zero_grad()

    return step


def dlrm_step(args, dev):
    """Configuration 5's model and batch (bench_distributed.py) on one device, no sharding."""
    from veloce.models import DLRM

    def table(dim):
        return veloce.DynamicEmbedding(
            dim, mode="sum", capacity=1 << 20, optimizer=veloce.optim.RowWiseAdagrad(lr=0.01), device=dev
        )

    model = DLRM(13, 26, embedding_dim=args.dim, bottom_mlp=(512, 256, args.dim),
                 top_mlp=(1024, 1024, 512, 256, 1), embedding_factory=table).to(dev)  # fmt: skip
    opt = veloce.optim.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    gen = torch.Generator(device=dev).manual_seed(0)
    b = args.dlrm_batch
    dense = torch.randn(b, 13, generator=gen, device=dev)
    u = torch.rand(b, 26, generator=gen, device=dev, dtype=torch.float64)
    rank = torch.floor((1 - u) ** (-1.0 / (args.alpha - 1.0))).clamp(max=10**7).long()
    sparse = rank * 0x9E3779B97F4A7C1 + torch.arange(26, device=dev)
    label = (torch.rand(b, generator=gen, device=dev) < 0.25).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step():
        loss_fn(model(dense, sparse), label).backward()
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="table", choices=["table", "dlrm"])
    p.add_argument("--rows", type=int, default=16_000_000)
    p.add_argument("--batch", type=int, default=1_048_570, help="ids per step (bags of one id)")
    p.add_argument("--dlrm-batch", type=int, default=16384, help="samples per step of --model dlrm")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    p.add_argument("--alpha", type=float, default=1.05)
    args = p.parse_args()
    dev = torch.device(args.device)
    step = table_step(args, dev) if args.model == "table" else dlrm_step(args, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{args.model} step on {dev}: median {times[len(times) // 2] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(STEPS):
            step()
        sync()
    events = prof.key_averages()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(events.table(sort_by=key, row_limit=30, max_name_column_width=70))
    print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    runtime = [e for e in events if e.key.startswith("cuda") and ("Synchronize" in e.key or "Memcpy" in e.key)]
    for e in runtime:
        print(f"per step: {e.count / STEPS:8.1f} x {e.key} ({e.cpu_time_total / STEPS / 1e3:.3f} ms host)")


if __name__ == "__main__":
    main()
