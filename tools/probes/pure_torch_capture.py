import torch
from torch import nn
m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()
opt = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True)
x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 1, device="cuda")
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        loss = ((m(x) - y) ** 2).mean(); loss.backward(); opt.step(); opt.zero_grad()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    loss = ((m(x) - y) ** 2).mean(); loss.backward(); opt.step(); opt.zero_grad()
for _ in range(3): g.replay()
torch.cuda.synchronize(); print("pure torch capture ok", loss.item())
