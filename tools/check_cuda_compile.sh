#!/usr/bin/env bash
# Compiles every csrc/cuda/*.cu for sm_90 into /tmp, so the CUDA kernels can be checked on
# a machine without a GPU (CPU-only torch is enough: its headers include c10/cuda). Fails
# on any compiler warning and on register spills in veloce's kernels. With -v prints
# ptxas' registers / stack frame / spills per kernel.
#
#   tools/check_cuda_compile.sh          # compile, warnings are errors
#   tools/check_cuda_compile.sh -v       # also print the ptxas resource usage per kernel
#
# Environment: PYTHON (default: python3 that imports torch), NVCC (default: nvcc on PATH
# or /usr/local/cuda/bin/nvcc), ARCH (default 90), OUT_DIR (default /tmp/veloce_cuda_check),
# SRCS (default every csrc/cuda/*.cu), JOBS (files compiled at once, default every core).
set -euo pipefail
cd "$(dirname "$0")/.."

VERBOSE=0
[ "${1:-}" = "-v" ] && VERBOSE=1

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for p in python3 /work/venv/bin/python python; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c "import torch" 2>/dev/null; then PYTHON="$p"; break; fi
  done
fi
[ -n "$PYTHON" ] || { echo "no python with torch found; set PYTHON" >&2; exit 2; }
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { echo "nvcc not found; set NVCC" >&2; exit 2; }
ARCH="${ARCH:-90}"
OUT_DIR="${OUT_DIR:-/tmp/veloce_cuda_check}"
mkdir -p "$OUT_DIR"

read -r TORCH_INC TORCH_API_INC PY_INC ABI < <("$PYTHON" - <<'PY'
import os, sysconfig, torch
inc = os.path.join(os.path.dirname(torch.__file__), "include")
print(inc, os.path.join(inc, "torch", "csrc", "api", "include"), sysconfig.get_paths()["include"],
      int(torch._C._GLIBCXX_USE_CXX11_ABI))
PY
)

STD=$("$PYTHON" -c "import torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('c++20' if v >= (2, 10) else 'c++17')")
FLAGS=(-c -std="$STD" -O3 --expt-relaxed-constexpr --extended-lambda
       -gencode "arch=compute_${ARCH},code=sm_${ARCH}"
       -I csrc/include -isystem "$TORCH_INC" -isystem "$TORCH_API_INC" -isystem "$PY_INC"
       -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DVELOCE_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=_C
       -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE  # a CPU-only torch lacks the generated c10/cuda/impl/cuda_cmake_macros.h
       -Xcompiler -Wall -Xptxas -warn-spills)
[ "$VERBOSE" = 1 ] && FLAGS+=(-Xptxas -v)

# Kernels whose __launch_bounds__ minimum of resident blocks caps their registers below
# what they would take unbounded, with the most spill-store bytes each may have: the
# occupancy was measured to gain more than the few spilled words (in L1) cost. A spill
# above the limit, or in any other kernel, fails the check. (The fused update loads each
# run's head one work item ahead: fp32 spills 56 / 48 bytes and fp64 84 / 80 at 80
# registers, int64 / int32 keys, and half rows of 4 packs per lane 8 / 4 bytes at the
# 255-register cap; with those spills it is faster than without the head ahead.)
ALLOWED_SPILLS="accumulate_update_kernel:96"
allowed_spills_removed() {  # stdin: warning lines; prints those not allowed
  local line name limit bytes ok
  while IFS= read -r line; do
    ok=0
    for entry in $ALLOWED_SPILLS; do
      name=${entry%%:*}; limit=${entry##*:}
      if [[ "$line" == *"Registers are spilled"*"$name"* ]]; then
        bytes=$(sed -E 's/.* ([0-9]+) bytes spill stores.*/\1/' <<<"$line")
        [ "$bytes" -le "$limit" ] && ok=1
      fi
    done
    [ "$ok" = 1 ] || echo "$line"
  done
}

check_one() {  # check_one SRC: compile it; 0 when it compiled without a warning that counts
  local src=$1 obj log
  obj="$OUT_DIR/$(basename "${src%.cu}").o"
  log="$OUT_DIR/$(basename "${src%.cu}").log"
  if ! "$NVCC" "${FLAGS[@]}" "$src" -o "$obj" >"$log" 2>&1; then
    echo "== $src"; cat "$log"; return 1
  fi
  echo "== $src"
  if [ "$VERBOSE" = 1 ]; then
    # One line per kernel: demangled name, registers, spills, stack frame.
    "$PYTHON" - "$log" <<'PY'
import re, subprocess, sys
lines = open(sys.argv[1]).read().splitlines()
name = None
for i, line in enumerate(lines):
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        name = m.group(1)
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                          " ".join(lines[max(0, i - 2):i + 1]))
        dem = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
        dem = dem.replace("veloce::cuda::(anonymous namespace)::", "").replace("void ", "")
        dem = re.sub(r"\(.*", "", dem)
        print(f"   {m.group(1):>3} regs  frame/spill-st/spill-ld {'/'.join(frame.groups()) if frame else '?'}  {dem}")
        name = None
PY
  fi
  # Any compiler warning fails the check, except ptxas spill warnings inside CUB's own
  # kernels (not ours to fix) and the small spills that a kernel bounded for occupancy
  # trades on purpose (ALLOWED_SPILLS above).
  ! grep -i -E "warning|error" "$log" | grep -v -E "_ZN3cub|^ptxas info" | allowed_spills_removed | grep .
}

# The files compile side by side, JOBS at a time (default: every core); each one's report
# is printed whole when it is done.
JOBS="${JOBS:-$(nproc)}"
status=0
pids=()
for src in ${SRCS:-csrc/cuda/*.cu}; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  check_one "$src" >"$OUT_DIR/$(basename "${src%.cu}").report" 2>&1 &
  pids+=("$!:$src")
done
for entry in "${pids[@]}"; do
  src=${entry#*:}
  wait "${entry%%:*}" || status=1
  cat "$OUT_DIR/$(basename "${src%.cu}").report"
done
[ "$status" = 0 ] && echo "all CUDA sources compiled" || echo "CUDA compile FAILED"
exit "$status"
