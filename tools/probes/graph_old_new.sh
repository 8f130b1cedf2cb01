# The graphed configuration-5 step of two trees in one call, interleaved: the working tree
# and .gpu/old.tar (git archive of a baseline), same prebuilt extension. carry=[".gpu"].
gunzip -c .gpu/b/new.so.gz > veloce/_C.abi3.so
mkdir -p /tmp/old && tar -xf .gpu/old.tar -C /tmp/old && cp veloce/_C.abi3.so /tmp/old/veloce/
W=$(nvidia-smi -L | wc -l)
for tag in old new; do
  d=$PWD; [ $tag = old ] && d=/tmp/old
  rm -f $OUT/$tag.json
  (cd $d && PYTHONPATH=$d torchrun --standalone --nproc_per_node=$W benchmarks/bench_distributed.py --sparse sync \
    --nonfinite raise_next --steps 20 --windows 2 --graph ${ARGS:-} --json $OUT/$tag.json > $OUT/$tag.log 2>&1) &
  pid=$!; n=0
  while [ ! -s $OUT/$tag.json ] && [ $n -lt 70 ]; do sleep 1; n=$((n+1)); done
  sleep 3; pkill -f bench_distributed.py; wait $pid 2>/dev/null
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'step_ms %.2f windows %s' % (d['step_ms'], [round(x,2) for x in d['windows_ms']]))" $OUT/$tag.json $tag 2>/dev/null || echo "$tag: no result"
done
