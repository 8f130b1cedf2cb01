# Where a graphed sharded step's time goes: configuration 5 with --graph on all GPUs, the
# synced time of each call split into the counting phase (replay + read) and the rest,
# the capacities, then torch.profiler's table of 5 graphed steps (rank 0).
export PYTHONPATH=$PWD
gunzip -c .gpu/b/new.so.gz > veloce/_C.abi3.so
W=$(nvidia-smi -L | wc -l)
cat > /tmp/probe_main.py <<'PY'
import sys, time, torch, veloce.graphs as G
sys.path.insert(0, "benchmarks")
orig_call, orig_plan = G.CUDAGraphStep.__call__, G.CUDAGraphStep._plan
stats = {"call": [], "plan": []}
def call(self, *a):
    torch.cuda.synchronize(); t = time.perf_counter(); r = orig_call(self, *a); torch.cuda.synchronize()
    stats["call"].append(time.perf_counter() - t)
    if len(stats["call"]) == 25: report()
    return r
def plan(self, *a):
    t = time.perf_counter(); r = orig_plan(self, *a); stats["plan"].append(time.perf_counter() - t)
    if len(stats["plan"]) in (1, 20) and torch.distributed.get_rank() == 0:
        print("caps", self._caps, flush=True)
    return r
G.CUDAGraphStep.__call__, G.CUDAGraphStep._plan = call, plan
def report():
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0: return
    c, p = stats["call"][10:], stats["plan"][10:]
    if c: print(f"PROBE calls {len(c)}: synced call ms median {sorted(c)[len(c)//2]*1e3:.2f}, plan ms median {sorted(p)[len(p)//2]*1e3:.2f}", flush=True)
import bench_distributed
sys.argv = ["bench_distributed.py"] + sys.argv[1:]
try:
    bench_distributed.main()
finally:
    report()
PY
timeout 150 torchrun --standalone --nproc_per_node=$W /tmp/probe_main.py --sparse sync --nonfinite raise_next --steps 10 \
  --windows 1 --graph --profile - --json $OUT/probe.json > $OUT/probe.log 2>&1
echo rc=$?
grep -a "PROBE\|caps\|Self CUDA\|---\|Name" $OUT/probe.log | head -8
grep -a -A40 "Self CUDA %" $OUT/probe.log | head -60 | cut -c1-220
