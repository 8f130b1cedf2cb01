"""Does a leaf 'anchor' (requires_grad, created outside the capture, grad always None) break capture?"""
import sys
import torch
from torch import nn

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        return None, g * 2

mode = sys.argv[1]
m = nn.Linear(8, 1).cuda()
opt = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True)
x = torch.randn(32, 8, device="cuda")
anchor = torch.empty(0, device="cuda", requires_grad=True)
def step(a):
    loss = m(F.apply(a, x)).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad()
if mode in ("default_stream_first", "fresh_in_capture"):
    step(anchor)  # the anchor's first use on the default stream
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2): step(anchor)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    step(torch.empty(0, device="cuda", requires_grad=True) if mode == "fresh_in_capture" else anchor)
g.replay(); torch.cuda.synchronize(); print(mode, "capture ok", flush=True)
