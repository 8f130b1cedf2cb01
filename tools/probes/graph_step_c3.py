"""What-if (not a training mode): configuration 3's DynamicEmbedding step, eager against one
CUDA graph of the whole step (forward, backward, step, zero_grad), back to back, ms per step;
then SGD tables after 5 replays against 5 eager steps.

    VELOCE_UPDATE_STREAM=0 python tools/probes/graph_step_c3.py     (on a GPU machine)

It reaches into private state: ``HashTable.settle`` is made a no-op while the stream is
captured, and the deferred counts the capture left are dropped (``table._unread``), so a
replay's inserts are never counted. The scalars the ops take on the host (the LRU clock,
Adam's step) are frozen at their captured values: fine for timing, not for training.
With the update stream on (the default), capture fails: the update stream's fence joins
work outside the capture (benchmarks/README.md, twenty-eighth session).
"""
import os, sys, time, traceback, statistics
import torch, veloce
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import back_to_back  # noqa: E402  (also silences settle() during capture)

dev = torch.device("cuda")
F, PER, ROWS = 10, 104_857, 1_600_000
N = F * PER
torch.manual_seed(0)
probs = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.05
STEPS = 40
batches = []
for s in range(STEPS):
    local = torch.multinomial(probs, N, replacement=True)
    feat = torch.arange(N) // PER
    batches.append(((feat * ROWS + local).to(dev), torch.arange(N, device=dev)))


def make(opt):
    o = veloce.optim.SGD(lr=0.01) if opt == "sgd" else veloce.optim.Adam(lr=0.001)
    return veloce.DynamicEmbedding(128, mode="sum", capacity=2**25, optimizer=o, nonfinite_grad="apply",
                                   defer_inserts=True, device=dev)

def step(emb, ids, offs):
    out = emb(ids, offs)
    out.backward(torch.ones_like(out))  # static grad; sum loss
    emb.step()
    emb.zero_grad()


for opt in ("sgd", "adam"):
    print(f"== {opt}, update stream {veloce.runtime.update_stream.ENABLED}", flush=True)
    emb = make(opt)
    for ids, offs in batches: step(emb, ids, offs)   # warm: every id inserted
    len(emb)
    eager = [back_to_back(lambda i: step(emb, *batches[i % STEPS]), 30) for _ in range(3)]
    print("eager ms/step", [round(x, 3) for x in eager], flush=True)
    sid, soff = batches[0][0].clone(), batches[0][1].clone()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): step(emb, sid, soff)
    torch.cuda.current_stream().wait_stream(s)
    len(emb); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step(emb, sid, soff)
        emb.table._unread.clear()
    except Exception:
        traceback.print_exc(); print("CAPTURE FAILED", flush=True); continue
    print("captured", flush=True)
    def rep(i):
        ids, offs = batches[i % STEPS]
        sid.copy_(ids, non_blocking=True); g.replay()
    graphed = [back_to_back(rep, 30) for _ in range(3)]
    print("graph ms/step", [round(x, 3) for x in graphed], flush=True)
    # correctness (SGD: no frozen scalar matters but the LRU clock): K eager vs K replays from equal tables
    if opt == "sgd":
        a, b = make(opt), make(opt)
        for ids, offs in batches[:3]: step(a, ids, offs); step(b, ids, offs)
        len(a); len(b)
        sid2, soff2 = batches[0][0].clone(), batches[0][1].clone()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        # warm on side stream, then capture; both tables take the same extra steps
        with torch.cuda.stream(s):
            for k in range(3): step(b, sid2, soff2); step(a, sid2, soff2)
        torch.cuda.current_stream().wait_stream(s); len(a); len(b)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            step(b, sid2, soff2)
        b.table._unread.clear()
        for i in range(1, 6):
            sid2.copy_(batches[i][0]); g2.replay()
            step(a, batches[i][0], batches[i][1])
        torch.cuda.synchronize()
        ea, eb = a.export(), b.export()
        ka, ia = ea["keys"].sort(); kb, ib = eb["keys"].sort()
        print("keys equal", torch.equal(ka, kb), "max |dw|", (ea["weights"][ia] - eb["weights"][ib]).abs().max().item(), flush=True)
