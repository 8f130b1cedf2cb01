import torch, veloce
ops=torch.ops.veloce
C=64
t=[torch.zeros(C,dtype=torch.long,device="cuda"),torch.zeros(C,dtype=torch.uint8,device="cuda"),torch.zeros(C,dtype=torch.long,device="cuda"),torch.zeros(C,4,device="cuda"),torch.zeros(C,2,device="cuda")]
for bad in [torch.ones(2,2,dtype=torch.long,device="cuda"), torch.ones(3,device="cuda")]:
    try:
        ops.find_or_insert(*t, bad, 0,0,False,0,0,0.0,0.0,None)
    except RuntimeError as e:
        print("raised:", str(e)[:200])
try:
    ops.find(t[0], t[1], torch.ones(2,2,dtype=torch.long,device="cuda"))
except RuntimeError as e: print("find raised:", str(e)[:200])
print("done")
