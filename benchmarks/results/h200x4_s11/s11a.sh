#!/usr/bin/env bash
# Session 11, call A (4 GPUs): build (saved for later calls); in parallel the CUDA suite (GPU 0), memcheck of the
# hash-table CUDA tests (GPU 1), NCCL tests on 2 ranks (GPUs 2, 3); then configuration 5 sync on 1, 2, 4 GPUs and a
# per-kernel profile of configuration 3 (Adam).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/o}"; mkdir -p "$OUT"
T0=$(date +%s)
S="$OUT/summary.txt"
VELOCE_SAVE_BUILD=1 bash tools/gpu_session.sh build > "$OUT/build_tail.txt" 2>&1 || { tail -20 "$OUT/build_tail.txt"; exit 1; }
cat "$OUT/build_tail.txt" >> "$S"
export PYTHONPATH=$PWD
echo "t=$(( $(date +%s) - T0 )) built" | tee -a "$S"
( CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m pytest tests -q -p no:cacheprovider -k "cuda or nonfinite or update_stream" \
    > /tmp/pytest_cuda.txt 2>&1; tail -15 /tmp/pytest_cuda.txt > "$OUT/pytest_cuda.txt" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 280 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
    tests/test_hash_table.py -q -p no:cacheprovider -k "cuda and not hypothesis" > /tmp/san.txt 2>&1; echo "rc=$?" >> /tmp/san.txt;
  grep -E "ERROR SUMMARY|passed|failed|rc=|Invalid" /tmp/san.txt | head -20 > "$OUT/sanitizer.txt" ) &
( CUDA_VISIBLE_DEVICES=2,3 VELOCE_TEST_NCCL=1 VELOCE_TEST_WORLD_SIZES=2 timeout 280 python3 -m pytest tests/test_distributed.py \
    -q -p no:cacheprovider -k "nccl or cuda" > /tmp/nccl2.txt 2>&1; tail -8 /tmp/nccl2.txt > "$OUT/pytest_nccl2.txt" ) &
wait
echo "t=$(( $(date +%s) - T0 )) tested" | tee -a "$S"
for w in 1 2 4 2 1; do
  [ $(( $(date +%s) - T0 )) -gt 500 ] && { echo "skip w=$w (time)" >> "$S"; continue; }
  timeout 50 python3 -m torch.distributed.run --standalone --nproc_per_node=$w benchmarks/bench_distributed.py \
    --sparse sync --nonfinite raise_next --watchdog 45 --warmup 5 --steps 30 --profile-steps 2 --json /tmp/c5_w${w}_$SECONDS.json \
    > /tmp/c5_w$w.log 2>&1 || tail -c 1500 /tmp/c5_w$w.log >> "$S"
  echo "c5 w=$w: $(grep -o '"step_ms": [0-9.]*' /tmp/c5_w$w.log | head -1)" | tee -a "$S"
done
python3 benchmarks/bench_distributed.py --summarize /tmp/c5_w*.json >> "$S" 2>&1
echo "t=$(( $(date +%s) - T0 )) c5 done" | tee -a "$S"
[ $(( $(date +%s) - T0 )) -lt 530 ] && CUDA_VISIBLE_DEVICES=0 timeout 60 python3 tools/profile_step.py --device cuda > "$OUT/profile_config3_adam.txt" 2>&1
echo "t=$(( $(date +%s) - T0 )) done" | tee -a "$S"
