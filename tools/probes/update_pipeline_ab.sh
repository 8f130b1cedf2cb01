#!/usr/bin/env bash
# A change to the fused sparse update (accumulate_update_kernel) against its baseline, on one
# GPU: the baseline tree (.gpu/old.tar: `git archive --format=tar HEAD > .gpu/old.tar` before
# the change) and the working tree, and with NEW3_FLAGS (nvcc flags, e.g.
# -DVELOCE_UPDATE_MIN_BLOCKS=3) a second build of the working tree ("new3"). Run with
# carry=[".gpu"] (.gpu/ in .git/info/exclude).
#
#   STAGES="build ncu tests"   (builds saved under $OUT/b: copy them to .gpu/b here)
#   STAGES="prebuilt suite c3" (a later call, the saved builds)
#   STAGES="buildnew ncu tests" (the working tree against the baseline saved in .gpu/b)
#
# Stages: build (the builds side by side), buildnew (the working tree alone), prebuilt
# (unpack .gpu/b/*.so.gz), tests (the update's CUDA tests on the working tree, on new3 the
# hot-row and CPU-agreement ones), suite (pytest -k "cuda or nonfinite or update_stream", on
# SUITE_TREE: old, new or new3), graphs (the single-GPU CUDA-graph tests, on SUITE_TREE), ncu
# (the kernel's duration, DRAM throughput, registers and occupancy on tools/profile_step.py's
# table; NCU_RUNS, "optimizer:tree" interleaved), diag (ncu's warp states of the SGD kernel,
# DIAG_TAGS), c3 (configuration 3's whole step back to back, checked and unchecked, C3_TAGS
# interleaved). benchmarks/README.md, thirty-first session, has the first use.
set -uo pipefail
export PYTHONUNBUFFERED=1 CC=gcc CXX=g++ LDSHARED="g++ -shared"
OUT="${OUT:-/tmp/upd-out}"; mkdir -p "$OUT"
NEW=$PWD OLD=/tmp/upd-old N3=/tmp/upd-new3
S=$(date +%s)
say() { tee -a "$OUT/summary.txt"; }
t() { echo "t=$(( $(date +%s) - S )) s" | say; }
tree() { case $1 in old) echo "$OLD" ;; new3) echo "$N3" ;; *) echo "$NEW" ;; esac; }
C3="--device cuda --features 10 --ids-per-feature 1600000 --batch 104857 --bag 1 --dim 128 --dist zipf --alpha 1.05"
C3="$C3 --optimizers sgd,adam --no-dict --unchecked --steps 50 --warmup 5 --back-to-back"
nvidia-smi -L | say
rm -rf "$OLD" "$N3" && mkdir -p "$OLD" "$N3" && tar -xf .gpu/old.tar -C "$OLD"
tar -cf - --exclude='*.so' --exclude=.gpu --exclude=build . | tar -xf - -C "$N3"
for stage in ${STAGES:-build tests ncu}; do
  echo "== $stage" | say
  case $stage in
    build)
      b() { (cd "$1" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=5 NVCC_APPEND_FLAGS="$2" python3 setup.py build_ext --inplace \
              > "/tmp/upd_build_$3.log" 2>&1) || { echo "BUILD FAILED: $3" | say; grep -E "error" "/tmp/upd_build_$3.log" | head; }; }
      b "$OLD" "" old & b "$NEW" "" new &
      [ -n "${NEW3_FLAGS:-}" ] && b "$N3" "$NEW3_FLAGS" new3 &
      wait
      mkdir -p "$OUT/b"
      for tag in old new ${NEW3_FLAGS:+new3}; do
        d=$(tree $tag)
        strip --strip-debug -o "/tmp/upd_$tag.so" "$d/veloce/_C.abi3.so" && gzip -6 -c "/tmp/upd_$tag.so" > "$OUT/b/$tag.so.gz"
      done
      ls -la "$OUT/b" | say
      t ;;
    buildnew)  # the working tree alone (16 jobs); the baseline from .gpu/b/old.so.gz
      gunzip -c .gpu/b/old.so.gz > "$OLD/veloce/_C.abi3.so"
      (TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/upd_build_new.log 2>&1) \
        || { echo "BUILD FAILED: new" | say; grep -E "error" /tmp/upd_build_new.log | head; }
      mkdir -p "$OUT/b"
      strip --strip-debug -o /tmp/upd_new.so veloce/_C.abi3.so && gzip -6 -c /tmp/upd_new.so > "$OUT/b/new.so.gz"
      t ;;
    prebuilt)
      for tag in old new new3; do
        [ -f ".gpu/b/$tag.so.gz" ] && gunzip -c ".gpu/b/$tag.so.gz" > "$(tree $tag)/veloce/_C.abi3.so"
      done
      t ;;
    tests)
      PYTHONPATH=$NEW timeout 300 python3 -m pytest tests/test_optimizer.py tests/test_device_scalars.py -q \
        -p no:cacheprovider -k "cuda or accumulate" 2>&1 | tee "$OUT/pytest_update.txt" | tail -3 | say
      [ -f "$N3/veloce/_C.abi3.so" ] && (cd "$N3" && PYTHONPATH=$N3 timeout 200 python3 -m pytest tests/test_optimizer.py -q -p no:cacheprovider \
        -k "hot_rows or agrees" 2>&1 | tail -2 | sed "s/^/new3 /") | say
      t ;;
    suite)  # SUITE_TREE: old, new (default) or new3
      d=$(tree "${SUITE_TREE:-new}")
      (cd "$d" && PYTHONPATH=$d timeout 500 python3 -m pytest tests -q -p no:cacheprovider -x \
         -k "cuda or nonfinite or update_stream" 2>&1 | tee "$OUT/pytest_cuda.txt" | tail -3) | say
      t ;;
    graphs)  # the single-GPU CUDA-graph tests (SUITE_TREE's)
      d=$(tree "${SUITE_TREE:-new}")
      (cd "$d" && PYTHONPATH=$d timeout 300 python3 -m pytest tests/test_graphs.py tests/test_device_scalars.py -q \
         -p no:cacheprovider 2>&1 | tee "$OUT/pytest_graphs.txt" | tail -3) | say
      t ;;
    diag)  # where the kernel's warps wait, SGD (DIAG_TAGS, default "old new")
      for tag in ${DIAG_TAGS:-old new}; do
        d=$(tree "$tag")
        (cd "$d" && PYTHONPATH="$d" timeout 90 ncu --clock-control none --kernel-name regex:accumulate_update_kernel \
           --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
           --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
           python3 tools/profile_step.py --device cuda --optimizer sgd --unchecked --phases > "$OUT/ncu_diag_$tag.txt" 2>&1)
        grep -E "Duration|Stall|Warp Cycles|Issued Warp|Eligible|Active Warps|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|DRAM Throughput" \
          "$OUT/ncu_diag_$tag.txt" | sed "s/^/$tag /" | say
      done
      t ;;
    ncu)
      for run in ${NCU_RUNS:-"sgd:old sgd:new sgd:new sgd:old adam:old adam:new adam:new adam:old"}; do
        run=${run/:/ }
        set -- $run
        d=$(tree "$2")
        (cd "$d" && PYTHONPATH="$d" timeout 60 ncu --clock-control none --kernel-name regex:accumulate_update_kernel \
           --launch-skip 3 --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy \
           python3 tools/profile_step.py --device cuda --optimizer "$1" --unchecked --phases > /tmp/upd_ncu.txt 2>&1)
        echo "$1 $2: $(grep -E ' Duration|DRAM Throughput|Registers Per|Achieved Occupancy' /tmp/upd_ncu.txt \
           | awk '{printf "%s %s, ", $1, $NF}')" | say
      done
      t ;;
    c3)
      for tag in ${C3_TAGS:-old new new old}; do
        d=$(tree $tag)
        (cd "$d" && PYTHONPATH="$d" timeout 200 python3 benchmarks/bench_embedding.py $C3 2>&1 \
           | grep -E "^\| (sgd|adam)" | sed "s/^/$tag /") | say
      done
      t ;;
  esac
done
