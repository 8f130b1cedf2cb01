"""CPU pooled_lookup and accumulate_and_update against F.embedding_bag, as ratios.

On a noisy machine times of one build move by up to 2x within minutes, so each round times
the op and then F.embedding_bag on the same ids, and the figure is the median over rounds
of their ratio (with the op's median ms). One tree per process (PYTHONPATH picks it); an
A/B interleaves processes of both trees (benchmarks/README.md, thirty-third session):

    for t in old new old new; do
      echo "$t $(PYTHONPATH=<tree of $t> python tools/probes/cpu_lookup_ab.py 2)"; done

Prints one line of JSON: {case: [ratio, ms]}. Arguments: the number of threads, the dim (default 64).
"""
import sys, time, json, torch, torch.nn.functional as F
import veloce
from veloce.ops.embedding import pooled_lookup
from veloce.ops.optimizer import accumulate_and_update
torch.set_num_threads(int(sys.argv[1]))
D=int(sys.argv[2]) if len(sys.argv) > 2 else 64; res={}
def ratio(f, y, n=31):
    for _ in range(3): f(); y()
    r=[]; ts=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); t1=time.perf_counter(); y(); t2=time.perf_counter()
        r.append((t1-t0)/(t2-t1)); ts.append(t1-t0)
    r.sort(); ts.sort(); return round(r[n//2],3), round(ts[n//2]*1e3,3)
for rows in (10_000, 1_000_000):
  for L in (1, 20):
    g=torch.Generator().manual_seed(0)
    B=65536 if L==1 else 8192
    w=torch.randn(rows,D,generator=g); s=torch.randint(0,rows,(B*L,),generator=g); o=torch.arange(0,B*L,L)
    eb=lambda: F.embedding_bag(s,w,o,mode='sum')
    res[f"lookup/embedding_bag r{rows} L{L}"]=ratio(lambda: pooled_lookup(w,s,o,check_inputs=False), eb)
    go=torch.randn(B,D,generator=g)
    for opt,S in (("sgd",0),("adam",2*D)):
      st=torch.zeros(rows,S)
      res[f"update_{opt}/embedding_bag r{rows} L{L}"]=ratio(lambda: accumulate_and_update(w,st,go,s,o,None,"sum",False,opt,1e-3,check_inputs=False), eb)
print(json.dumps(res))
