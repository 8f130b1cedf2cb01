# Cost of agreeing on one host int: NCCL all_reduce + read-back vs gloo all_reduce, GPU idle and GPU busy.
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
r = dist.get_rank(); torch.cuda.set_device(r % torch.cuda.device_count())
g = dist.new_group(backend="gloo")
n = dist.new_group(backend="nccl")
def nccl_agree(x):
    t = torch.tensor([x], device="cuda"); dist.all_reduce(t, group=n); return int(t.item())
def gloo_agree(x):
    t = torch.tensor([x]); dist.all_reduce(t, group=g); return int(t.item())
a = torch.randn(4096, 4096, device="cuda")
for name, f in [("nccl", nccl_agree), ("gloo", gloo_agree)] * 2:
    for busy in (False, True):
        for _ in range(20): f(1)
        torch.cuda.synchronize(); dist.barrier(group=g)
        ts = []
        for _ in range(200):
            if busy:
                for _ in range(3): a = a @ a * 1e-3  # ~0.3 ms of GPU work queued first
            t0 = time.perf_counter(); f(1); ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        ts.sort()
        if r == 0: print(f"{name} busy={busy}: median {ts[100]*1e3:.3f} ms p90 {ts[180]*1e3:.3f} ms")
dist.destroy_process_group()
