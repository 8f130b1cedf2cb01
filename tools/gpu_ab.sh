#!/usr/bin/env bash
# A/B of two builds in one call on the GPU machine: a baseline tree carried as a tarball
# (the device's copy of the repository has no .git) against the working tree.
#
#   here:   git archive --format=tar <baseline-commit> > .gpu/old.tar     (.gpu/ in .git/info/exclude)
#   device: bash tools/gpu_ab.sh                  (run with carry=[".gpu"])
#
# Builds both side by side, runs the CUDA tests of the working tree, then configuration 3
# (bench_embedding, SGD and Adam, checked and unchecked) alternating baseline, new, new,
# baseline (step times of one build move between runs on these machines: compare within
# the call), then profile_step --phases of both (a baseline before 1427dc4 has no --phases
# and prints its usage error there). Outputs (five files) go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/veloce-ab}"; mkdir -p "$OUT"
OLD_TAR="${OLD_TAR:-.gpu/old.tar}"
[ -f "$OLD_TAR" ] || { echo "no baseline tarball at $OLD_TAR (see this script's header)"; exit 2; }
mkdir -p /tmp/old && tar -xf "$OLD_TAR" -C /tmp/old
export CC=gcc CXX=g++ LDSHARED="g++ -shared"
( cd /tmp/old && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=8 python3 setup.py build_ext --inplace >/tmp/build_old.log 2>&1 \
  || { echo "baseline build FAILED"; grep -E "error" /tmp/build_old.log | head; } ) &
bash tools/gpu_session.sh build || exit 1
wait
export PYTHONPATH=$PWD
timeout 400 python3 -m pytest tests -q -p no:cacheprovider -k "cuda or nonfinite" >"$OUT/pytest_cuda.log" 2>&1
tail -3 "$OUT/pytest_cuda.log"
B="--device cuda --features 10 --ids-per-feature 1600000 --batch 104857 --bag 1 --dim 128 --dist zipf --alpha 1.05"
B="$B --optimizers sgd,adam --no-dict --unchecked --steps 50 --warmup 5"
for tag in old new new2 old2; do
  if [ "${tag#old}" != "$tag" ]; then d=/tmp/old; else d=$PWD; fi
  (cd "$d" && PYTHONPATH=$d timeout 200 python3 benchmarks/bench_embedding.py $B >"/tmp/c3_$tag.log" 2>&1
   grep -E "^\| (sgd|adam)" "/tmp/c3_$tag.log" | sed "s/^/$tag /" | tee -a "$OUT/c3_ab.log")
done
for tag in old new; do
  if [ "$tag" = old ]; then d=/tmp/old; else d=$PWD; fi
  for flag in "" --unchecked; do
    (cd "$d" && PYTHONPATH=$d timeout 120 python3 tools/profile_step.py --device cuda --phases $flag 2>&1 \
      | tail -10 | sed "s/^/$tag${flag:+ unchecked} /" | tee -a "$OUT/phases_ab.log")
  done
done
