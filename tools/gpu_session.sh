#!/usr/bin/env bash
# Build veloce on the GPU machine and run the chosen stages; logs go to $OUT.
#   tools/gpu_session.sh build test checks bench profile streams
# At most 8 files come back from $OUT: the build keeps its log under /tmp unless it fails, and
# the card and torch version go to $OUT/gpu.txt.
# VELOCE_SAVE_BUILD=1 returns the built extension ($OUT/_C.abi3.so.gz, _C.key); a later call
# that carries them in a folder named by VELOCE_PREBUILT skips the build while csrc/, setup.py
# and torch are unchanged.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/veloce-out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
for stage in "$@"; do
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
      python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
      start=$(date +%s)
      # The sources and torch a build comes from: a prebuilt extension is used only for the same.
      key=$( { cat setup.py $(find csrc -type f | sort); python3 -c "import torch; print(torch.__version__)"; } \
        | sha1sum | cut -c1-16)
      # VELOCE_PREBUILT=DIR: a folder (carried into the call) holding _C.abi3.so.gz and _C.key
      # from an earlier call's VELOCE_SAVE_BUILD=1: used instead of a build (about 3 minutes)
      # when its key matches, e.g. for calls that change only Python.
      if [ -n "${VELOCE_PREBUILT:-}" ] && [ "$(cat "$VELOCE_PREBUILT/_C.key" 2>/dev/null)" = "$key" ]; then
        gunzip -c "$VELOCE_PREBUILT/_C.abi3.so.gz" > veloce/_C.abi3.so
        echo "build: prebuilt extension $key"
      else
        # The machine's Python was built with /opt/gcc, whose g++ links libstdc++ statically:
        # a private libstdc++ inside _C crashed while formatting any error message. Build
        # with the system toolchain, which links the shared libstdc++ that torch uses.
        export CC=gcc CXX=g++ LDSHARED="g++ -shared"
        TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace >/tmp/veloce_build.log 2>&1 \
          || { cp /tmp/veloce_build.log "$OUT/build.log"; grep -E "error|Error" /tmp/veloce_build.log | head -40; exit 1; }
        echo "build: $(( $(date +%s) - start )) s ($key)"
        if [ "${VELOCE_SAVE_BUILD:-0}" = 1 ]; then  # for VELOCE_PREBUILT in later calls (files back: 16 MiB each)
          strip --strip-debug -o /tmp/_C.stripped.so veloce/_C.abi3.so && gzip -9 -c /tmp/_C.stripped.so > "$OUT/_C.abi3.so.gz"
          echo "$key" > "$OUT/_C.key"
          ls -la "$OUT/_C.abi3.so.gz"
        fi
      fi
      python3 -c "import veloce; assert veloce.ops.extension.has_cuda_kernels(), 'no CUDA kernels'; print('CUDA kernels: yes')"
      ;;
    test)
      timeout 900 python3 -m pytest tests -q -p no:cacheprovider -k "cuda" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
      ;;
    testall)
      timeout 900 python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_all.log" | tail -25
      ;;
    checks)
      timeout 300 python3 tools/cuda_checks.py 2>&1 | tee "$OUT/cuda_checks.log" | tail -30
      ;;
    sanitize)
      timeout 600 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/table/test_hash_table.py \
        tests/sparse/test_embedding.py tests/optim/test_optimizer.py -q -p no:cacheprovider -k "cuda and not hypothesis" -x 2>&1 \
        | tee "$OUT/sanitizer.log" | tail -15
      ;;
    bench)
      # BENCHMARKS.md configuration 1 (hash table) and 3 (dynamicemb parity, no pooling).
      timeout 300 python3 benchmarks/bench_hash_table.py --dims 64,8 --json "$OUT/bench_hash_table.json" 2>&1 \
        | tee "$OUT/bench_hash_table.log" | tail -20
      timeout 300 python3 benchmarks/bench_embedding.py --device cuda --features 10 --ids-per-feature 1600000 \
        --batch 104857 --bag 1 --dim 128 --dist zipf --alpha 1.05 --optimizers sgd,adam --no-dict --unchecked --steps 50 \
        --warmup 5 --json "$OUT/bench_embedding_config3.json" 2>&1 | tee "$OUT/bench_embedding_config3.log" | tail -8
      ;;
    profile)
      # Where the time of one step goes: configuration 3 (Adam, one table) and DLRM on one GPU.
      timeout 200 python3 tools/profile_step.py --device cuda 2>&1 | tee "$OUT/profile_config3_adam.txt" | head -3
      timeout 200 python3 tools/profile_step.py --device cuda --model dlrm 2>&1 | tee "$OUT/profile_dlrm.txt" | head -3
      # The host path of back-to-back steps without the profiler: where the GPU waits for the host.
      timeout 200 python3 tools/profile_step.py --device cuda --phases 2>&1 | tee "$OUT/phases_config3_adam.txt" | tail -10
      timeout 200 python3 tools/profile_step.py --device cuda --phases --unchecked 2>&1 | tee "$OUT/phases_config3_adam_unchecked.txt" | tail -10
      ;;
    nccl)
      # The multi-process tests on every GPU count this machine has (2, 3, 4), with NCCL and gloo.
      n=$(nvidia-smi -L | wc -l); sizes=$(seq -s, 2 "$n")
      VELOCE_TEST_NCCL=1 VELOCE_TEST_WORLD_SIZES="$sizes" timeout 600 python3 -m pytest tests/distributed/test_distributed.py \
        -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_distributed.log" | tail -15
      ;;
    streams)
      # Configuration 3 back to back with the update stream on and off (one build, runs in the
      # order on, off, on, off), then the host path of each (--phases), checked and unchecked.
      B="--device cuda --features 10 --ids-per-feature 1600000 --batch 104857 --bag 1 --dim 128 --dist zipf"
      B="$B --alpha 1.05 --optimizers sgd,adam --no-dict --unchecked --steps 50 --warmup 5 --back-to-back"
      for s in 1 0 1 0; do
        VELOCE_UPDATE_STREAM=$s timeout 120 python3 benchmarks/bench_embedding.py $B >"$OUT/c3_stream$s.log" 2>&1 \
          || tail -c 2000 "$OUT/c3_stream$s.log"
        grep -E "^\| (sgd|adam)" "$OUT/c3_stream$s.log" | sed "s/^/stream=$s /" | tee -a "$OUT/c3_streams.log"
      done
      for s in 1 0; do
        for flag in "" --unchecked; do
          VELOCE_UPDATE_STREAM=$s timeout 100 python3 tools/profile_step.py --device cuda --phases $flag 2>&1 \
            | tail -10 | sed "s/^/stream=$s${flag:+ unchecked} /" | tee -a "$OUT/phases_streams.log"
        done
      done
      ;;
    dist)
      # BENCHMARKS.md configuration 5 on 1, 2, 4 GPUs (as many as the machine has), sync and async.
      n=$(nvidia-smi -L | wc -l)
      for w in ${DIST_WORLDS:-4 2 1}; do
        [ "$w" -gt "$n" ] && continue
        for mode in ${DIST_MODES:-sync async sync+dedup async+dedup}; do
          dedup=""; [ "${mode%+dedup}" != "$mode" ] && dedup="--dedup"
          timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node="$w" \
            benchmarks/bench_distributed.py --sparse "${mode%+dedup}" $dedup --watchdog 150 ${DIST_ARGS:-} \
            --json "$OUT/dist_w${w}_${mode}.json" >"$OUT/dist_w${w}_${mode}.log" 2>&1 \
            || tail -c 3000 "$OUT/dist_w${w}_${mode}.log"
        done
      done
      python3 benchmarks/bench_distributed.py --summarize "$OUT"/dist_w*.json | tee "$OUT/bench_distributed.md"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
