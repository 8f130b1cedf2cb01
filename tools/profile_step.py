"""Profile one DynamicEmbedding training step with torch.profiler (GPU or CPU).

    python tools/profile_step.py --device cuda            # BENCHMARKS.md configuration 3 shape
    python tools/profile_step.py --device cpu --rows 1000000 --batch 65536

Prints the ops and kernels that take the most device (or CPU) time, so the next
optimisation targets what the step really spends time on.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import veloce

SCRAMBLE = 0x9E3779B97F4A7C15 - (1 << 64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=16_000_000)
    p.add_argument("--batch", type=int, default=1_048_570, help="ids per step (bags of one id)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    p.add_argument("--alpha", type=float, default=1.05)
    args = p.parse_args()
    dev = torch.device(args.device)
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

    for _ in range(5):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
