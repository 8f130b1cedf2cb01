#!/usr/bin/env bash
# Session 11, call B (4 GPUs): build the batched inserts (saved); old = HEAD 87125e5 with call A's prebuilt extension.
# In parallel: CUDA suite (GPU 0), memcheck of the hash-table CUDA tests (GPU 1), NCCL tests on 2 ranks (GPUs 2, 3).
# Then configuration 1 (find_or_insert) new/old and configuration 5 sync new/old on 1, 2, 4 GPUs, interleaved.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/o}"; mkdir -p "$OUT"
T0=$(date +%s)
S="$OUT/summary.txt"
mkdir -p /tmp/old && tar -xf .gpu/old11.tar -C /tmp/old && gunzip -c .gpu/s11a_out/_C.abi3.so.gz > /tmp/old/veloce/_C.abi3.so
VELOCE_SAVE_BUILD=1 bash tools/gpu_session.sh build > "$OUT/build_tail.txt" 2>&1 || { tail -30 "$OUT/build_tail.txt"; exit 1; }
cat "$OUT/build_tail.txt" >> "$S"
export PYTHONPATH=$PWD
echo "t=$(( $(date +%s) - T0 )) built" | tee -a "$S"
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests -q -p no:cacheprovider -x -k "cuda or nonfinite or update_stream" \
    > /tmp/pytest_cuda.txt 2>&1; tail -25 /tmp/pytest_cuda.txt > /tmp/pytest_cuda_tail.txt ) &
( CUDA_VISIBLE_DEVICES=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
    tests/test_hash_table.py -q -p no:cacheprovider -k "cuda and not hypothesis" > /tmp/san.txt 2>&1; echo "rc=$?" >> /tmp/san.txt ) &
( CUDA_VISIBLE_DEVICES=2,3 VELOCE_TEST_NCCL=1 VELOCE_TEST_WORLD_SIZES=2 timeout 200 python3 -m pytest tests/test_distributed.py \
    -q -p no:cacheprovider -k "nccl or cuda" > /tmp/nccl2.txt 2>&1; tail -6 /tmp/nccl2.txt > /tmp/nccl2_tail.txt ) &
wait
{ echo "== pytest cuda"; cat /tmp/pytest_cuda_tail.txt; echo "== sanitizer"; grep -E "ERROR SUMMARY|passed|failed|rc=|Invalid|Error" /tmp/san.txt | head -30;
  echo "== nccl2"; cat /tmp/nccl2_tail.txt; } >> "$S"
echo "t=$(( $(date +%s) - T0 )) tested" | tee -a "$S"
hb() {  # tree
  local root=$PWD; [ "$1" = old ] && root=/tmp/old
  [ $(( $(date +%s) - T0 )) -gt 420 ] && { echo "skip hash $1 (time)" >> "$S"; return; }
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$root timeout 60 python3 $root/benchmarks/bench_hash_table.py --dims 64 > /tmp/hb_$1.log 2>&1 || tail -5 /tmp/hb_$1.log >> "$S"
  grep -E "^\|" /tmp/hb_$1.log | sed "s/^/hash $1 /" >> "$S"
}
c5() {  # tree world
  local root=$PWD; [ "$1" = old ] && root=/tmp/old
  [ $(( $(date +%s) - T0 )) -gt 560 ] && { echo "skip c5 $1 w=$2 (time)" >> "$S"; return; }
  PYTHONPATH=$root timeout 45 python3 -m torch.distributed.run --standalone --nproc_per_node=$2 $root/benchmarks/bench_distributed.py \
    --sparse sync --nonfinite raise_next --watchdog 40 --warmup 5 --steps 30 --profile-steps 2 --json /tmp/c5_$1_$2_$SECONDS.json \
    > /tmp/c5_$1_$2.log 2>&1 || tail -c 1500 /tmp/c5_$1_$2.log >> "$S"
  echo "c5 $1 w=$2: $(grep -o '"step_ms": [0-9.]*' /tmp/c5_$1_$2.log | head -1)" | tee -a "$S"
}
hb new; hb old
c5 new 1; c5 old 1; c5 new 2; c5 old 2; c5 new 4; c5 old 4; c5 old 2; c5 new 2; c5 old 1; c5 new 1
echo "t=$(( $(date +%s) - T0 )) done" | tee -a "$S"
