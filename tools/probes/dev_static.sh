# One device call for the static exchange and the graphed sharded step: the prebuilt
# extension (.gpu/b/new.so.gz, carry=[".gpu"]), the tests on every GPU count up to the
# machine's, then configuration 5 eager and graphed on all GPUs. Results under $OUT.
set -x
gunzip -c .gpu/b/new.so.gz > veloce/_C.abi3.so
export PYTHONPATH=$PWD
python3 -c "import veloce; assert veloce._ext.has_cuda_kernels(); print('kernels ok')"
nvidia-smi -L
W=$(nvidia-smi -L | wc -l)
sizes=2; [ "$W" -ge 4 ] && sizes=2,4
VELOCE_TEST_NCCL=1 VELOCE_TEST_WORLD_SIZES=$sizes timeout ${TEST_S:-280} python3 -m pytest tests/test_static_exchange.py -q -x \
  -p no:cacheprovider 2>&1 | tee $OUT/pytest_static.txt | tail -60
for mode in ${MODES:-graph eager}; do
  extra=""; [ $mode = graph ] && extra="--graph"
  timeout 130 torchrun --standalone --nproc_per_node=$W benchmarks/bench_distributed.py --sparse sync --nonfinite raise_next \
    --steps 30 --windows 3 $extra ${BENCH_ARGS:-} --json $OUT/c5_w${W}_$mode.json > $OUT/c5_w${W}_$mode.log 2>&1
  echo "w$W $mode rc=$?"; tail -3 $OUT/c5_w${W}_$mode.log | cut -c1-700
done
