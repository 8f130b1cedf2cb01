import sys, torch, veloce
ops = torch.ops.veloce
dev = sys.argv[1]
w = torch.randn(12, 5, device=dev); s = torch.arange(10, device=dev) % 12; o = torch.tensor([0, 4], device=dev)
for name, f in [("dtype", lambda: ops.pooled_lookup(w, s.float(), o, None, 0, False)),
                ("dim", lambda: ops.pooled_lookup(w, s.view(2, 5), o, None, 0, False)),
                ("device", lambda: ops.find(torch.zeros(32, dtype=torch.long, device=dev), torch.zeros(32, dtype=torch.uint8, device=dev), torch.ones(2, dtype=torch.long)))]:
    try:
        f(); print(name, "no error")
    except RuntimeError as e:
        print(name, "raised:", str(e).splitlines()[0][:150], flush=True)
print("done")
