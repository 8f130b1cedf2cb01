#!/usr/bin/env bash
# veloce's two entry points on a fresh machine; each sets up, builds and runs.
#
#   ./run.sh train   build, then train the example DLRM on built-in synthetic data (CPU, ~2 min)
#   ./run.sh test    build (with RocksDB; redis-server for the serving tests; installed when missing), then run
#                    the test suite (what CI runs)
#
# Set-up: a virtualenv in .venv that also sees system packages, so a torch you already
# have (any version >= 2.4, CPU or CUDA) is used; with no torch at all, the CPU build of
# torch 2.13.0 is installed. VELOCE_PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")"

# RocksDB for the RocksDB tier (veloce._rocksdb, built only where it is found): installed
# with apt-get when missing and this runs as root; skipped (its tests skip) otherwise. Once
# RocksDB is there, VELOCE_ROCKSDB=1 makes a build that cannot use it fail.
rocksdb() {
  if [ ! -f /usr/include/rocksdb/db.h ] && [ -z "${ROCKSDB_ROOT:-}" ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "[veloce] installing librocksdb-dev (the RocksDB tier)"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq librocksdb-dev >/dev/null; } \
        || echo "[veloce] could not install librocksdb-dev: the RocksDB tier's tests will be skipped"
    else
      echo "[veloce] RocksDB not found and apt-get unavailable (or not root): the RocksDB tier's tests will be skipped"
    fi
  fi
  if [ -f /usr/include/rocksdb/db.h ] || [ -n "${ROCKSDB_ROOT:-}" ]; then
    export VELOCE_ROCKSDB="${VELOCE_ROCKSDB:-1}"
  fi
}

# redis-server for the serving store's tests (tests/serving/test_redis.py start their own
# on a free port): installed with apt-get when missing and this runs as root; else they skip.
redis_server() {
  if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "[veloce] installing redis-server (the serving store's tests)"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
        || echo "[veloce] could not install redis-server: the Redis store's tests will be skipped"
    else
      echo "[veloce] redis-server not found and apt-get unavailable (or not root): the Redis store's tests will be skipped"
    fi
  fi
}

setup() {
  local py="${VELOCE_PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv --system-site-packages .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
  if ! python -c "import torch" 2>/dev/null; then
    echo "[veloce] no torch found: installing torch==2.13.0 (CPU build)"
    python -m pip install -q "torch==2.13.0"
  fi
  python -m pip install -q numpy safetensors pyyaml tqdm ninja "pytest>=7" "hypothesis>=6" import-linter setuptools wheel
  echo "[veloce] building against torch $(python -c 'import torch; print(torch.__version__)')"
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" python -m pip install -q --no-build-isolation -e . \
    || { echo "[veloce] build failed"; exit 1; }
}

case "${1:-}" in
  train)
    setup
    shift
    python examples/dlrm_synthetic.py "$@"
    ;;
  test)
    rocksdb
    redis_server
    setup
    python -m pip install -q redis || echo "[veloce] could not install redis-py: the Redis store's tests will be skipped"
    # the launcher tests (tests/cli/test_ray.py) also run Ray Train; without it they skip
    python -m pip install -q "ray[train]>=2.9" \
      || echo "[veloce] could not install ray[train]: the Ray tests will be skipped"
    shift
    python -m pytest -q tests "$@"
    ;;
  *)
    echo "usage: ./run.sh train|test [extra args]" >&2
    exit 2
    ;;
esac
