#!/usr/bin/env bash
# A/B stages on the GPU machine: a baseline tree (a tarball, the device's copy of the
# repository has no .git) against the working tree, in one call or in several calls on one
# warm machine. Every comparison runs the builds interleaved (old, new, new, old, ...): step
# times of one build move by several milliseconds between calls on these machines, so only
# numbers of one call compare.
#
#   here:    mkdir -p .gpu && git archive --format=tar <baseline> > .gpu/old.tar   (.gpu/ is git-ignored)
#   device:  bash tools/gpu_ab_stages.sh build tests c1        (run with carry=[".gpu"])
#            bash tools/gpu_ab_stages.sh prebuilt c5 memcheck   (a later call: the saved builds)
#
# Stages:
#   build      build both trees side by side (about 3-4 minutes), save both extensions
#              under $OUT/b/ (copy them to .gpu/b/ here for `prebuilt` in later calls)
#   buildnew   build the working tree only (saved as $OUT/b/new.so.gz); the baseline from .gpu/b/old.so.gz
#   buildone   build the working tree only, no baseline (for stages of the new tree alone)
#   prebuilt   unpack .gpu/b/{old,new}.so.gz instead of building (same sources only!)
#   tests      the hash-table CUDA tests, then the NCCL tests on 2 ranks
#   xops       the exchange ops' CUDA tests (tests/distributed/test_distributed.py -k "cuda and not nccl")
#   xmemcheck  compute-sanitizer memcheck on the exchange ops' regroup and combine CUDA tests
#   cudasuite  pytest -k "cuda or nonfinite or update_stream"
#   memcheck   compute-sanitizer memcheck on the hash-table CUDA tests
#   defer      the deferred-insert tests (find_or_insert(defer=True), DynamicEmbedding(defer_inserts=True))
#   defmemcheck  compute-sanitizer memcheck on the deferred-insert CUDA tests
#   graphs     the CUDA-graph tests (tests/graphs/test_graphs.py, tests/table/test_device_scalars.py), then
#              memcheck over both
#   graphbench configuration 5's DLRM on one GPU, eager against CUDAGraphStep (bench_graph_step.py),
#              TF32 with and without the NaN/Inf check, then fp32
#   c3d        configuration 3 of the new tree with --defer-inserts (each variant's windows
#              alternately read back and deferred on one table), steps synced, then back to back
#   c1         configuration 1 (find, find_or_insert) at LOADS (default 0.5,0.75), interleaved
#   c3         configuration 3 (SGD, Adam; checked and unchecked), interleaved
#   c3ncu      ncu's duration, DRAM throughput and registers of the fused update kernel
#              (tools/profile_step.py's table, SGD and Adam, unchecked) of both trees, interleaved
#   c3diag     ncu's warp states, scheduler and memory sections of the fused update kernel (SGD,
#              unchecked) of both trees: where its warps wait
#   c3phases   configuration 3's host path (tools/profile_step.py --phases, checked and
#              unchecked) of both trees, interleaved 2x, per optimizer in C3P_OPTS (default adam)
#   hostab     the host path of both trees: configuration 3's step on a small table and batch
#              (profile_step --phases, SGD unchecked and Adam checked), interleaved 3x; then
#              configuration 5's DLRM on one GPU at 256 samples a step, interleaved 2x
#   waves      the fused update's grid by VELOCE_UPDATE_WAVES of the working tree (WAVES, default
#              "0 4 16 64"; 0 is one group per position, capped at 32768 blocks), ncu of the kernel and whole
#              configuration-3 steps, one build
#   c5         configuration 5 on W GPUs (default: all), sync, raise_next, interleaved 3x
#   w1         configuration 5 on one GPU, interleaved 2x
#   c5p        configuration 5 of the new tree on W GPUs, with and without --prefetch, interleaved 3x
#   phases     configuration 5's host path (--phases) of the new tree on W GPUs
#   c5v        configuration 5 of the new tree on W GPUs, one run per variant in VARIANTS
#              (';'-separated bench_distributed arguments, '-' for none), interleaved REPS times
#              (default 2), e.g. VARIANTS="-;--prefetch;--prefetch --prefetch-at backward"
#   w1x4       configuration 5 on one GPU, W processes at once (one GPU each), then one alone
#   gpus       is one GPU slower? the machine's topology (nvidia-smi topo -m, lscpu, each GPU's
#              local CPUs), then configuration 5's one-GPU step on each GPU alone, then on all
#              at once, then all at once with each process on its GPU's local CPUs, while
#              nvidia-smi samples every GPU's SM clock, power, temperature and throttle
#              reasons (gpus_smi.csv); the new tree
#   c5numa     configuration 5 of the new tree on W GPUs, without and with torchrun's
#              --numa-binding node (each rank on the CPUs of its GPU's NUMA node), interleaved 3x
#   c5ab       configuration 5 of both trees on W GPUs with AB_ARGS (e.g. --prefetch), interleaved 3x
#   summarize  the table of every configuration-5 run of this call (bench_distributed --summarize)
#   cprofile   rank 0's cProfile of configuration 5 on W GPUs (CPROFILE_ARGS: more arguments)
# Environment: OUT (default /tmp/ab-out), PREFIX (a command before torchrun in c5_run, e.g. taskset), TORCHRUN_ARGS (more torchrun arguments for every
# configuration-5 run, e.g. "--numa-binding node"), WINDOWS (configuration 5's timed windows per run, default 1:
# the pace of a 4-GPU run changes each time the ranks meet, so several windows per run give
# an A/B more samples for little time), OLD_TAR (default .gpu/old.tar), C3_ARGS (more bench_embedding
# arguments for `c3`, e.g. --back-to-back), W, STEPS (configuration 5's
# timed steps, default 30), LOADS, C3P_OPTS, PIN (a prefix for the one-process runs of c1, c3,
# c3phases and hostab, e.g. PIN="taskset -c 8": pinned to one core, the GPU machine's host
# path of a configuration-3 step is shorter and steadier), PHASES_ARGS
# (more bench_distributed arguments for `phases`, e.g. --prefetch), VARIANTS, REPS, CPROFILE_ARGS.
# At most 8 files come back from $OUT: summary.txt gathers the stages' short results.
set -uo pipefail
PHASES_ARGS="${PHASES_ARGS:-}"
# Configuration 3's bench_embedding.py arguments (the c3 and waves stages).
C3_BASE="--device cuda --features 10 --ids-per-feature 1600000 --batch 104857 --bag 1 --dim 128 --dist zipf"
C3_BASE="$C3_BASE --alpha 1.05 --optimizers sgd,adam --no-dict --unchecked --steps 50 --warmup 5"
PIN="${PIN:-}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/ab-out}"; mkdir -p "$OUT"
OLD_TAR="${OLD_TAR:-.gpu/old.tar}"
NEW=$PWD
OLD=/tmp/ab-old
S=$(date +%s)
t() { echo "t=$(( $(date +%s) - S )) s" | tee -a "$OUT/summary.txt"; }
say() { tee -a "$OUT/summary.txt"; }
tree() { if [ "$1" = old ]; then echo "$OLD"; else echo "$NEW"; fi; }
# The machine's Python was built with /opt/gcc (tools/gpu_session.sh says why the system one).
export CC=gcc CXX=g++ LDSHARED="g++ -shared"

unpack_old() {
  [ -f "$OLD_TAR" ] || { echo "no baseline tarball at $OLD_TAR (see this script's header)" | say; exit 2; }
  rm -rf "$OLD" && mkdir -p "$OLD" && tar -xf "$OLD_TAR" -C "$OLD"
}
build_in() {  # build_in DIR JOBS LOG
  (cd "$1" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="$2" python3 setup.py build_ext --inplace >"$3" 2>&1) \
    || { echo "BUILD FAILED in $1" | say; grep -E "error" "$3" | head -30; cp "$3" "$OUT/"; exit 1; }
}
check_kernels() {
  for d in "$OLD" "$NEW"; do
    (cd "$d" && PYTHONPATH="$d" python3 -c "import veloce; assert veloce.ops.extension.has_cuda_kernels(); print('$d: CUDA kernels')")
  done | say
}
save_build() {  # save_build TAG DIR: the extension, stripped and gzipped, to $OUT/b/TAG.so.gz
  mkdir -p "$OUT/b"
  strip --strip-debug -o "/tmp/ab_$1.so" "$2/veloce/_C.abi3.so" && gzip -6 -c "/tmp/ab_$1.so" > "$OUT/b/$1.so.gz"
}
gpu_cpus() {  # one line per GPU: its index and the CPUs of its NUMA node (sysfs local_cpulist)
  nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader | while IFS=', ' read -r i bus; do
    bus=$(echo "$bus" | tr 'A-F' 'a-f' | sed 's/^0000\(....:\)/\1/')
    echo "$i $(cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null || echo "0-$(( $(nproc) - 1 ))")"
  done
}
ncu_update() {  # ncu_update DIR OPTIMIZER OUTFILE SECONDS [MORE NCU SECTIONS...]: the fused update kernel, once
  local d=$1 opt=$2 out=$3 secs=$4; shift 4
  (cd "$d" && PYTHONPATH="$d" timeout "$secs" ncu --clock-control none --kernel-name regex:accumulate_update_kernel \
     --launch-skip 3 --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy "$@" \
     python3 tools/profile_step.py --device cuda --optimizer "$opt" --unchecked --phases > "$out" 2>&1)
}
c5_run() {  # c5_run TAG GPUS [EXTRA ARGS...]; TAG old or new (new+prefetch: the new tree, --prefetch)
  local tag=$1 w=$2; shift 2
  local d; d=$(tree "${tag%%+*}")
  # shellcheck disable=SC2086  # TORCHRUN_ARGS is several arguments
  (cd "$d" && PYTHONPATH="$d" timeout 150 ${PREFIX:-} torchrun --standalone ${TORCHRUN_ARGS:-} --nproc_per_node="$w" \
     benchmarks/bench_distributed.py \
     --sparse sync --nonfinite raise_next --steps "${STEPS:-30}" --windows "${WINDOWS:-1}" \
     --json "/tmp/ab_c5_${tag}_w$w.json" "$@" >"/tmp/ab_c5_${tag}_w$w.log" 2>&1)
  echo "w=$w $tag: $(grep -o '"step_ms": [0-9.]*\|"step_ms_synced": [0-9.]*\|"median": [0-9.]*\|"p90": [0-9.]*' \
    "/tmp/ab_c5_${tag}_w$w.json" | tr '\n' ' ')$(python3 -c "import json, sys; w = json.load(open(sys.argv[1])).get('windows_ms', []); print(' windows', [round(x, 2) for x in w]) if len(w) > 1 else None" "/tmp/ab_c5_${tag}_w$w.json" 2>/dev/null)" | say
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | say
for stage in "$@"; do
  echo "== $stage" | say
  case "$stage" in
    build)
      unpack_old
      build_in "$OLD" 8 /tmp/ab_build_old.log &
      build_in "$NEW" 8 /tmp/ab_build_new.log
      wait
      check_kernels
      save_build old "$OLD"; save_build new "$NEW"
      t ;;
    buildnew)
      unpack_old
      gunzip -c .gpu/b/old.so.gz > "$OLD/veloce/_C.abi3.so"
      build_in "$NEW" 16 /tmp/ab_build_new.log
      check_kernels; save_build new "$NEW"; t ;;
    buildone)
      build_in "$NEW" 16 /tmp/ab_build_new.log
      PYTHONPATH=$NEW python3 -c "import veloce; assert veloce.ops.extension.has_cuda_kernels(); print('new: CUDA kernels')" | say
      save_build new "$NEW"; t ;;
    prebuilt)
      unpack_old
      gunzip -c .gpu/b/old.so.gz > "$OLD/veloce/_C.abi3.so" && gunzip -c .gpu/b/new.so.gz > veloce/_C.abi3.so
      check_kernels; t ;;
    tests)
      PYTHONPATH=$NEW timeout 300 python3 -m pytest tests/table/test_hash_table.py -q -p no:cacheprovider -k cuda 2>&1 \
        | tee "$OUT/pytest_hash.txt" | tail -3 | say
      VELOCE_TEST_NCCL=1 VELOCE_TEST_WORLD_SIZES=2 PYTHONPATH=$NEW timeout 300 python3 -m pytest tests/distributed/test_distributed.py \
        -q -p no:cacheprovider -k "nccl or cuda" 2>&1 | tee "$OUT/pytest_nccl.txt" | tail -3 | say
      t ;;
    xops)
      PYTHONPATH=$NEW timeout 300 python3 -m pytest tests/distributed/test_distributed.py -q -p no:cacheprovider -k "cuda and not nccl" \
        2>&1 | tee "$OUT/pytest_xops.txt" | tail -3 | say
      t ;;
    xmemcheck)
      PYTHONPATH=$NEW timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
        tests/distributed/test_distributed.py -q -p no:cacheprovider \
        -k "cuda and not nccl and (converts_as or as_sums or converting_exchange or regroup or combine)" 2>&1 | tail -4 | say
      t ;;
    cudasuite)
      PYTHONPATH=$NEW timeout 500 python3 -m pytest tests -q -p no:cacheprovider -k "cuda or nonfinite or update_stream" \
        2>&1 | tee "$OUT/pytest_cuda.txt" | tail -3 | say
      t ;;
    defer)
      PYTHONPATH=$NEW timeout 300 python3 -m pytest tests/table/test_hash_table.py tests/sparse/test_dynamic_embedding.py -q \
        -p no:cacheprovider -k "defer or no_host_sync" 2>&1 | tee "$OUT/pytest_defer.txt" | tail -3 | say
      t ;;
    graphs)
      PYTHONPATH=$NEW timeout 300 python3 -m pytest tests/graphs/test_graphs.py tests/table/test_device_scalars.py -q \
        -p no:cacheprovider 2>&1 | tee "$OUT/pytest_graphs.txt" | tail -3 | say
      PYTHONPATH=$NEW timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
        tests/graphs/test_graphs.py tests/table/test_device_scalars.py -q -p no:cacheprovider 2>&1 | tail -4 | say
      t ;;
    graphbench)
      for a in "--tf32" "--tf32 --nonfinite apply" ""; do
        PYTHONPATH=$NEW timeout 150 python3 benchmarks/bench_graph_step.py $a \
          --json "$OUT/graph_$(echo "$a" | tr -d ' -')".json 2>&1 | tail -7 | say
      done
      t ;;
    defmemcheck)
      PYTHONPATH=$NEW timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
        tests/table/test_hash_table.py tests/sparse/test_dynamic_embedding.py -q -p no:cacheprovider \
        -k "(deferred and cuda) or deferred_cuda" 2>&1 | tail -4 | say
      t ;;
    c3d)
      for mode in synced back-to-back; do
        flag=""; [ "$mode" = back-to-back ] && flag=--back-to-back
        (PYTHONPATH="$NEW" timeout 250 $PIN python3 benchmarks/bench_embedding.py $C3_BASE --defer-inserts $flag \
           ${C3_ARGS:-} --json "$OUT/c3d_$mode.json" 2>&1 | grep -E "^\| (sgd|adam|optimizer)" | sed "s/^/$mode /") | say
      done
      t ;;
    memcheck)
      PYTHONPATH=$NEW timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
        tests/table/test_hash_table.py -q -p no:cacheprovider -k "cuda and not hypothesis" 2>&1 | tail -4 | say
      t ;;
    c1)
      for tag in old new new old; do
        d=$(tree $tag)
        (cd "$d" && PYTHONPATH="$d" timeout 150 $PIN python3 benchmarks/bench_hash_table.py --dims 64 --loads "${LOADS:-0.5,0.75}" \
           --ops find,find_or_insert 2>&1 | grep -E "^\| 64" | sed "s/^/$tag /") | say
      done
      t ;;
    c3)
      B="$C3_BASE ${C3_ARGS:-}"
      for tag in old new new old; do
        d=$(tree $tag)
        (cd "$d" && PYTHONPATH="$d" timeout 200 $PIN python3 benchmarks/bench_embedding.py $B 2>&1 \
           | grep -E "^\| (sgd|adam)" | sed "s/^/$tag /") | say
      done
      t ;;
    c3ncu)
      for run in "sgd old" "sgd new" "sgd new" "sgd old" "adam old" "adam new" "adam new" "adam old"; do
        set -- $run
        d=$(tree "$2")
        ncu_update "$d" "$1" /tmp/ab_ncu.txt 60
        echo "$1 $2: $(grep -E ' Duration|DRAM Throughput|Registers Per|Achieved Occupancy' /tmp/ab_ncu.txt \
           | awk '{printf "%s %s, ", $1, $NF}')" | say
      done
      t ;;
    c3diag)
      for tag in old new; do
        d=$(tree $tag)
        ncu_update "$d" sgd "$OUT/ncu_diag_$tag.txt" 90 --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis
        grep -E "Duration|Warp Cycles|Issued Warp|Eligible|Active Warps|L2 Hit|L1/TEX Hit|Mem Busy|DRAM Throughput" \
          "$OUT/ncu_diag_$tag.txt" | sed "s/^/$tag /" | say
      done
      t ;;
    c3phases)
      for opt in ${C3P_OPTS:-adam}; do
        for tag in old new new old; do
          d=$(tree $tag)
          for flag in "" --unchecked; do
            (cd "$d" && PYTHONPATH="$d" timeout 120 $PIN python3 tools/profile_step.py --device cuda --phases \
               --optimizer "$opt" $flag 2>&1 | tail -10 | sed "s/^/$tag $opt${flag:+ unchecked} /") >> "$OUT/phases_c3.txt"
            grep "^$tag $opt${flag:+ unchecked} host time" "$OUT/phases_c3.txt" | tail -1 | say
          done
        done
      done
      t ;;
    hostab)
      # The host path alone: configuration 3's step on a small table and batch (GPU work of
      # a few tens of microseconds), so a back-to-back step takes what its host path takes.
      for opt in "sgd --unchecked" "adam"; do
        for tag in old new new old old new; do
          d=$(tree $tag)
          (cd "$d" && PYTHONPATH="$d" timeout 60 $PIN python3 tools/profile_step.py --device cuda --phases --rows 100000 \
             --batch 4096 --optimizer $opt 2>&1 | grep "host time per step" | sed "s/^/$tag $opt: /") | say
        done
      done
      for tag in old new new old; do  # configuration 5's model on one GPU, 256 samples a step
        d=$(tree $tag)
        (cd "$d" && PYTHONPATH="$d" timeout 90 $PIN python3 tools/profile_step.py --device cuda --model dlrm --dlrm-batch 256 \
           2>&1 | grep "step on" | sed "s/^/$tag /") | say
      done
      t ;;
    waves)
      # The update grid of the working tree by VELOCE_UPDATE_WAVES (0: one group per position,
      # capped at 32768 blocks), one build: the kernel alone under ncu, then whole configuration-3 steps.
      for w in ${WAVES:-0 4 16 64}; do
        (PYTHONPATH="$NEW" VELOCE_UPDATE_WAVES=$w timeout 60 ncu --clock-control none --kernel-name regex:accumulate_update_kernel \
           --launch-skip 3 --launch-count 1 --section SpeedOfLight python3 tools/profile_step.py --device cuda \
           --optimizer adam --unchecked --phases > /tmp/ab_ncu.txt 2>&1)
        echo "adam waves=$w: $(grep -E ' Duration|DRAM Throughput' /tmp/ab_ncu.txt | awk '{printf "%s %s, ", $1, $NF}')" | say
      done
      B="$C3_BASE --back-to-back"
      for r in 1 2; do
        for w in ${WAVES:-0 4 16 64}; do
          (PYTHONPATH="$NEW" VELOCE_UPDATE_WAVES=$w timeout 200 $PIN python3 benchmarks/bench_embedding.py $B 2>&1 \
             | grep -E "^\| (sgd|adam)" | sed "s/^/waves=$w /") | say
        done
      done
      t ;;
    c5)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      for tag in old new new old old new; do c5_run $tag "$gpus"; done
      t ;;
    w1)
      for tag in old new new old; do c5_run $tag 1; done
      t ;;
    c5p)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      for tag in new new+prefetch new+prefetch new new new+prefetch; do
        if [ "$tag" = new ]; then c5_run new "$gpus"; else c5_run new+prefetch "$gpus" --prefetch; fi
      done
      t ;;
    c5v)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      IFS=';' read -r -a variants <<< "${VARIANTS:--}"
      for r in $(seq "${REPS:-2}"); do
        for i in "${!variants[@]}"; do
          v=${variants[$i]}; [ "$v" = - ] && v=""
          # shellcheck disable=SC2086  # a variant is several arguments
          c5_run "new+v$i" "$gpus" $v
          echo "   (v$i: ${v:-no extra arguments})" | say
        done
      done
      t ;;
    w1x4)
      # One GPU per process, every GPU at once, no communication: how much the host's and the
      # machine's sharing alone slows a one-GPU step (against the same run alone, after).
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      # OMP_NUM_THREADS=1 as torchrun sets it for several ranks: a one-rank torchrun does not,
      # and four processes with a thread per core each slow one another down.
      for g in $(seq 0 $((gpus - 1))); do OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=$g c5_run "new+solo$g" 1 & done
      wait
      OMP_NUM_THREADS=1 c5_run new+alone 1
      t ;;
    gpus)
      # OMP_NUM_THREADS=1 as torchrun sets it for several ranks (a one-rank torchrun does not).
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      { nvidia-smi topo -m; lscpu; echo "local CPUs per GPU:"; gpu_cpus; } > "$OUT/gpus_topology.txt" 2>&1
      nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv -lms 250 > "$OUT/gpus_smi.csv" 2>&1 &
      smi=$!
      for g in $(seq 0 $((gpus - 1))); do OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=$g c5_run "new+alone$g" 1; done
      echo "-- together, unpinned" | say
      pids=()
      for g in $(seq 0 $((gpus - 1))); do OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=$g c5_run "new+together$g" 1 & pids+=($!); done
      wait "${pids[@]}"
      echo "-- together, each on its GPU's local CPUs (taskset)" | say
      pids=()
      for g in $(seq 0 $((gpus - 1))); do
        cpus=$(gpu_cpus | awk -v g="$g" '$1 == g {print $2}')
        OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=$g PREFIX="taskset -c $cpus" c5_run "new+pinned$g" 1 & pids+=($!)
      done
      wait "${pids[@]}"
      kill "$smi" 2>/dev/null
      t ;;
    c5numa)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      for tag in new new+numa new+numa new new new+numa; do
        if [ "$tag" = new ]; then c5_run new "$gpus"; else TORCHRUN_ARGS="${TORCHRUN_ARGS:-} --numa-binding node" c5_run new+numa "$gpus"; fi
      done
      t ;;
    c5ab)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      # shellcheck disable=SC2086  # AB_ARGS is several arguments
      for tag in old new new old old new; do c5_run $tag "$gpus" ${AB_ARGS:-}; done
      t ;;
    summarize)
      (cd "$NEW" && PYTHONPATH="$NEW" python3 benchmarks/bench_distributed.py --summarize /tmp/ab_c5_*.json) \
        | tee "$OUT/c5_table.md" | tail -n +4 | cut -d'|' -f2-4,6-8,12-16 | say
      t ;;
    cprofile)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      # shellcheck disable=SC2086
      PYTHONPATH=$NEW timeout 200 torchrun --standalone --nproc_per_node="$gpus" benchmarks/bench_distributed.py \
        --sparse sync --nonfinite raise_next --steps 20 --profile-steps 2 --cprofile "$OUT/cprofile_w$gpus.txt" \
        ${CPROFILE_ARGS:-} > /tmp/ab_cprofile.log 2>&1 || tail -20 /tmp/ab_cprofile.log | say
      t ;;
    phases)
      gpus=${W:-$(nvidia-smi -L | wc -l)}
      PYTHONPATH=$NEW timeout 150 torchrun --standalone --nproc_per_node="$gpus" benchmarks/bench_distributed.py \
        --sparse sync --nonfinite raise_next --steps 20 --phases $PHASES_ARGS > "$OUT/phases_new_w$gpus.txt" 2>&1
      t ;;
    *)
      echo "unknown stage $stage (see this script's header)" | say; exit 2 ;;
  esac
done
echo "done" | say
