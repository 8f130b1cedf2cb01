#!/usr/bin/env bash
# Session 11, call C (one GPU): build a52bcc5+ (saved); old = 87125e5 with call A's prebuilt extension.
# The CUDA suite; then configuration 1, configuration 3 and the 1-GPU DLRM step, new and old interleaved.
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
timeout 170 python3 -m pytest tests -q -p no:cacheprovider -k "cuda or nonfinite or update_stream" > /tmp/pytest_cuda.txt 2>&1
{ echo "== pytest cuda"; grep -E "FAILED|Error|passed|failed" /tmp/pytest_cuda.txt | tail -25; } >> "$S"
echo "t=$(( $(date +%s) - T0 )) tested" | tee -a "$S"
hb() {  # tree tag
  local root=$PWD; [ "$1" = old ] && root=/tmp/old
  [ $(( $(date +%s) - T0 )) -gt 430 ] && { echo "skip hash $1 (time)" >> "$S"; return; }
  PYTHONPATH=$root timeout 50 python3 $root/benchmarks/bench_hash_table.py --dims 64 > /tmp/hb_$1.log 2>&1 || tail -5 /tmp/hb_$1.log >> "$S"
  grep -E "^\| 64" /tmp/hb_$1.log | sed "s/^/hash $1 $2 /" >> "$S"
}
B="--device cuda --features 10 --ids-per-feature 1600000 --batch 104857 --bag 1 --dim 128 --dist zipf --alpha 1.05"
B="$B --optimizers sgd,adam --no-dict --unchecked --steps 50 --warmup 5 --back-to-back"
c3() {  # tree tag
  local root=$PWD; [ "$1" = old ] && root=/tmp/old
  [ $(( $(date +%s) - T0 )) -gt 500 ] && { echo "skip c3 $1 (time)" >> "$S"; return; }
  PYTHONPATH=$root timeout 50 python3 $root/benchmarks/bench_embedding.py $B > /tmp/c3_$1.log 2>&1 || tail -3 /tmp/c3_$1.log >> "$S"
  grep -E "^\| (sgd|adam)" /tmp/c3_$1.log | sed "s/^/c3 $1 $2 /" >> "$S"
}
dlrm() {  # tree tag
  local root=$PWD; [ "$1" = old ] && root=/tmp/old
  [ $(( $(date +%s) - T0 )) -gt 555 ] && { echo "skip dlrm $1 (time)" >> "$S"; return; }
  PYTHONPATH=$root timeout 40 python3 -m torch.distributed.run --standalone --nproc_per_node=1 $root/benchmarks/bench_distributed.py \
    --sparse sync --nonfinite raise_next --watchdog 35 --warmup 5 --steps 30 --profile-steps 2 --json /tmp/d_$1_$2.json \
    > /tmp/d_$1.log 2>&1 || tail -c 1000 /tmp/d_$1.log >> "$S"
  echo "dlrm $1 $2: $(grep -o '"step_ms": [0-9.]*' /tmp/d_$1.log | head -1)" | tee -a "$S"
}
hb new a; hb old a; c3 new a; c3 old a; dlrm new a; dlrm old a; dlrm old b; dlrm new b; hb old b; hb new b
grep -h "^| optimizer" /tmp/c3_new.log >> "$S" 2>/dev/null
echo "t=$(( $(date +%s) - T0 )) done" | tee -a "$S"
