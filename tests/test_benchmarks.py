"""The benchmarks run: a tiny configuration of each instrumented one on the CPU, so that a
benchmark reaching into veloce's modules (to time or mark their calls) breaks here, not on
the GPU machine."""

import json
import os
import subprocess
import sys

import pytest

from veloce.ops import rocksdb as rocksdb_ops

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


def test_bench_embedding_runs_tiered_tables_beside_the_device_table(tmp_path):
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_embedding.py"), "--device", "cpu", "--features", "2",
           "--ids-per-feature", "500", "--batch", "64", "--bag", "1", "--dim", "8", "--dist", "zipf", "--alpha", "1.05",
           "--optimizers", "adam", "--no-dict", "--steps", "2", "--warmup", "1", "--cache-fractions", "1.0,0.5",
           "--prefetch", "--json", str(out_json)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["DynamicEmbedding"] > 0 and row["HostCached 100%"] > 0 and row["HostCached 50%"] > 0
    full, half = row["tiers"]["HostCached 100%"], row["tiers"]["HostCached 50%"]
    assert (full["cache_rows"], half["cache_rows"]) == (1000, 500)
    assert full["hit_rate"] == 1.0 and full["fetched_per_step"] == 0
    assert half["fetched_per_step"] > 0 and half["written_back_per_step"] > 0
    assert "x DynamicEmbedding" in done.stdout


@pytest.mark.skipif(not rocksdb_ops.available(),
                    reason="veloce._rocksdb is not built (apt-get install librocksdb-dev, then rebuild)")  # fmt: skip
def test_bench_rocksdb_table_runs_a_tiny_configuration(tmp_path):
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_rocksdb_table.py"), "--rows", "4000",
           "--dim", "8", "--batch", "32", "--bag", "4", "--warmup", "2", "--steps", "2", "--dir", str(tmp_path),
           "--json", str(out_json)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tables = json.loads(out_json.read_text())["tables"]
    assert set(tables) == {"memory", "rocksdb+ram", "rocksdb"} and all(t["step_ms"] > 0 for t in tables.values())
    assert tables["rocksdb+ram"]["ram_rows"] == 500 and tables["rocksdb+ram"]["read_up_per_step"] >= 0
    assert "| table | ms/step | ratio |" in done.stdout


def test_bench_serving_runs_a_tiny_configuration(tmp_path):
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_serving.py"), "--rows", "3000", "--dim", "8",
           "--delta", "500", "--repeat", "1", "--iters", "20", "--every", "1", "4", "--step-ids", "128",
           "--warm-steps", "5", "--publications", "1", "--dir", str(tmp_path), "--json", str(out_json)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out_json.read_text())
    assert result["publish"]["file"]["rows"] == 500 and all(r["publish_s"] > 0 for r in result["publish"].values())
    if rocksdb_ops.available():
        assert result["publish"]["rocksdb"]["raw_s"] > 0
    batches = {(r["batch"], r["what"]) for r in result["lookup"]}
    assert {(b, w) for b in (1, 64, 4096) for w in ("nn.EmbeddingBag", "file cold", "warm (any store)")} <= batches
    assert [r["every"] for r in result["bytes"]] == [1, 4] and all(r["delta_bytes"] > 0 for r in result["bytes"])
    assert "| store | rows | publish rows/s |" in done.stdout and "| publish every |" in done.stdout


def test_bench_admission_runs_a_tiny_study(tmp_path):
    from conftest import data_dir

    sample = data_dir() / "criteo" / "criteo_kaggle_train_sample.tsv"
    if not sample.is_file():
        pytest.skip(f"Criteo sample not found: {sample} (set VELOCE_DATA_DIR)")
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_admission.py"), "--data", str(sample), "--rows",
           "800", "--seeds", "2", "--min-counts", "1,2", "--json", str(out_json)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in out["rows"]}
    assert {"veloce min_count=1", "(a) one row per training id", "(b) 2^16 hashed buckets",
            "(c) vocabulary of ids seen >= 2 times"} <= set(rows)  # fmt: skip
    assert all(r["seeds"] == 2 and 0 < r["auc_mean"] < 1 for r in rows.values())
    one_row = rows["(a) one row per training id"]["rows"]
    assert rows["veloce min_count=1"]["rows"] == one_row - 26  # every training id, less (a)'s 26 rows of unseen ids
    assert rows["(c) vocabulary of ids seen >= 2 times"]["rows"] < one_row / 2
    assert rows["veloce min_count=1"]["diff_mean"] == 0
    assert ("veloce min_count=2" in rows) != bool(out["skipped"])  # run where veloce has admission
    assert "| variant | seeds | table rows |" in done.stdout


def test_bench_admission_cost_compares_each_policy_with_none(tmp_path):
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_admission_cost.py"), "--steps", "2", "--warmup", "1",
           "--windows", "1", "--cold-steps", "2", "--repeats", "1", "--features", "2", "--ids-per-feature", "500",
           "--batch", "64", "--cold-batch", "32", "--capacity", "8192", "--json", str(out_json)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {(r["phase"], r["policy"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {(p, q) for p in ("steady", "cold") for q in ("none", "frequency:2", "probability:0.5")}
    assert all(r["ms"] > 0 and r["vs_none"] > 0 for r in rows.values())
    assert rows[("steady", "none")]["steps"] == 2 and rows[("cold", "none")]["steps"] == 2
    # With min_count=2, only ids sighted twice in the first two cold steps got a row.
    assert 0 < rows[("cold", "frequency:2")]["rows"] < rows[("cold", "none")]["rows"]
