"""What-if (not a training mode): configuration 5's DLRM on one GPU (no sharding, 26 tables,
B samples a step), eager against one CUDA graph of the whole step, fp32 and TF32 matmuls,
back to back, ms per step.

    B=16384 VELOCE_UPDATE_STREAM=0 python tools/probes/graph_step_dlrm.py   (on a GPU machine)

The same private hooks and frozen scalars as graph_step_c3.py (see its docstring); the
dense optimizer is torch's Adam(capturable=True).
"""
import sys, time, traceback, os
import torch, veloce
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import back_to_back  # noqa: E402  (also silences settle() during capture)
from veloce.models import DLRM
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_distributed import zipf_ids

dev = torch.device("cuda")
B, FEAT, DIM = int(os.environ.get("B", 16384)), 26, 128
gen = torch.Generator(device=dev).manual_seed(0)
data = []
for _ in range(40):
    dense = torch.randn(B, 13, generator=gen, device=dev)
    sparse = torch.stack([zipf_ids(B, 1.05, 10**7, gen, dev) + f for f in range(FEAT)], 1)
    label = (torch.rand(B, generator=gen, device=dev) < 0.25).float()
    data.append((dense, sparse, label))



for tf32 in (False, True):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.manual_seed(0)
    def table(dim):
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=2**22, optimizer=veloce.optim.RowWiseAdagrad(lr=0.01),
                                       device=dev, nonfinite_grad="apply", defer_inserts=True)
    model = DLRM(13, FEAT, embedding_dim=DIM, bottom_mlp=(512, 256, DIM), top_mlp=(1024, 1024, 512, 256, 1),
                 embedding_factory=table).to(dev)
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True), model)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    def step(d, s, l):
        loss = loss_fn(model(d, s), l)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    for b in data: step(*b)
    for t in model.embeddings.values() if hasattr(model.embeddings, "values") else model.embeddings: len(t)
    eager = [back_to_back(lambda i: step(*data[i % 40]), 30) for _ in range(3)]
    print(f"tf32={tf32} B={B} eager ms/step", [round(x, 3) for x in eager], flush=True)
    sd, ss, sl = [x.clone() for x in data[0]]
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): step(sd, ss, sl)
    torch.cuda.current_stream().wait_stream(s)
    tabs = list(model.embeddings.values()) if hasattr(model.embeddings, "values") else list(model.embeddings)
    for t in tabs: len(t)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step(sd, ss, sl)
        for t in tabs: t.table._unread.clear()
    except Exception:
        traceback.print_exc(); print("CAPTURE FAILED", flush=True); continue
    def rep(i):
        d, sp, l = data[i % 40]
        sd.copy_(d, non_blocking=True); ss.copy_(sp, non_blocking=True); sl.copy_(l, non_blocking=True); g.replay()
    graphed = [back_to_back(rep, 30) for _ in range(3)]
    print(f"tf32={tf32} graph ms/step", [round(x, 3) for x in graphed], flush=True)
    del g
