"""The benchmarks run: a tiny configuration of each instrumented one on the CPU, so that a
benchmark reaching into veloce's modules (to time or mark their calls) breaks here, not on
the GPU machine."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--device", "cpu", "--batch", "64", "--warmup", "1", "--steps", "2", "--features", "4", "--dim", "8",
        "--capacity", "1024"]  # fmt: skip


def run_distributed(*extra: str, world: int = 1) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.join(ROOT, "benchmarks", "bench_distributed.py"), *TINY, *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("extra", [[], ["--phases"]], ids=["timed", "phases"])
def test_bench_distributed_runs_a_tiny_configuration(extra):
    out = run_distributed(*extra)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["world_size"] == 1 and result["step_ms"] > 0
    if extra:
        assert "host ms per step" in out
