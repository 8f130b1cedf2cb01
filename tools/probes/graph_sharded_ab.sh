# TESTS=1 (TEST_K: a pytest -k filter for the static exchange's tests): first the static exchange's tests (NCCL, 2 and, on 4 GPUs, 4 ranks) and the
# single-GPU graph tests. Then configuration 5, eager against graphed (CUDAGraphStep, static exchanges), on all GPUs and
# on one, fp32 and TF32 matmuls, then a torch.profiler kernel table of the graphed step on
# all GPUs. Each run is stopped 15 s after its JSON appears (a run with graphs alive can hang
# in destroy_process_group). Prebuilt extension: carry=[".gpu"].
export PYTHONPATH=$PWD
gunzip -c .gpu/b/new.so.gz > veloce/_C.abi3.so
W=$(nvidia-smi -L | wc -l)
nvidia-smi -L
bench() {  # bench NAME GPUS ARGS...
  local name=$1 w=$2; shift 2
  rm -f $OUT/$name.json
  torchrun --standalone --nproc_per_node=$w ${MAIN:-benchmarks/bench_distributed.py} --sparse sync --nonfinite raise_next \
    --steps 30 --windows 3 --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1 &
  local pid=$! n=0
  while kill -0 $pid 2>/dev/null && [ ! -s $OUT/$name.json ] && [ $n -lt ${RUN_S:-120} ]; do sleep 1; n=$((n+1)); done
  for i in $(seq 15); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -- -$pid 2>/dev/null; pkill -f bench_distributed.py; pkill -f probe_main.py; sleep 1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'w', d['world_size'], 'tf32', d['tf32'], 'step_ms %.2f synced %.2f windows %s captures %s' % (d['step_ms'], d['step_ms_synced'], [round(x,2) for x in d['windows_ms']], d.get('captures')))" $OUT/$name.json $name 2>/dev/null || echo "$name: no result"
}
if [ -n "${TESTS:-}" ]; then
  sizes=2; [ "$W" -ge 4 ] && sizes=2,4
  VELOCE_TEST_NCCL=1 VELOCE_TEST_WORLD_SIZES=$sizes timeout ${TEST_S:-200} python3 -m pytest tests/test_static_exchange.py \
    -q -x -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee $OUT/pytest_static.txt | tail -15
  timeout 200 python3 -m pytest tests/test_graphs.py tests/test_device_scalars.py -q -p no:cacheprovider 2>&1 \
    | tee $OUT/pytest_graphs.txt | tail -3
fi
# RUNS: "name:gpus:args;..." (args comma-separated); default: eager and graphed, fp32 and TF32, all GPUs and one
RUNS=${RUNS:-"eager:$W:;graph:$W:--graph;eager_tf32:$W:--tf32;graph_tf32:$W:--graph,--tf32;eager:1:;graph:1:--graph;eager_tf32:1:--tf32;graph_tf32:1:--graph,--tf32"}
IFS=';' read -r -a runs <<< "$RUNS"
for r in "${runs[@]}"; do
  IFS=':' read -r name gpus args <<< "$r"
  # shellcheck disable=SC2086
  bench "w${gpus}_$name" "$gpus" ${args//,/ }
done
if [ -n "${PROFILE:-}" ]; then
  bench w${W}_graph_profile $W --graph --steps 10 --windows 1 --profile - ${PROFILE_ARGS:-}
  grep -a -A25 "Self CUDA %" $OUT/w${W}_graph_profile.log | sed -n 28,60p | cut -c1-60,100-118,140-175
fi
