"""The documented Criteo run (``configs/dlrm_criteo.yaml``) on 1, 2 and 3 ranks: the same rows,
the same validation metrics.

Each rank runs ``veloce.cli.train`` (what ``veloce train ... --launcher torchrun --workers N``
runs on every rank) on the real Criteo sample, cut short so that the test is fast: 905
rows, of which 769 train (6 global batches of 128 and one of a single row) and 136
validate (batches of 135 and 1). The single-row batches leave some ranks an empty batch.
``batch_size`` is the global batch, so every world size trains on the same batches with the
same loss weights and evaluates every validation row once: the epoch record and the
validation metrics equal one process's up to float summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _dist import run_ranks
from conftest import data_dir

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = data_dir() / "criteo" / "criteo_kaggle_train_sample.tsv"
pytestmark = pytest.mark.skipif(
    not SAMPLE.is_file(), reason=f"Criteo sample not found: {SAMPLE} (set VELOCE_DATA_DIR)"
)

ROWS, TRAIN_ROWS, VAL_ROWS = 905, 769, 136  # int(905 * 0.85) = 769


def _overrides(run_dir: Path) -> list[str]:
    return [f"data.path={SAMPLE}", f"data.rows={ROWS}", "data.val_batch_size=135", f"trainer.run_dir={run_dir}",
            "trainer.progress=false", "trainer.device=cpu", "trainer.log_every=100"]  # fmt: skip


def _train(rank: int, world_size: int, run_dir: str) -> list[dict]:
    from veloce import cli
    from veloce.train.config import load_config

    return cli.train(load_config(ROOT / "configs" / "dlrm_criteo.yaml", _overrides(Path(run_dir))))


FIELDS = ("loss", "val_auc", "val_logloss", "val_accuracy")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    (record,) = _train(0, 1, str(tmp_path_factory.mktemp("one")))
    return record


@pytest.mark.parametrize("world_size", [2, 3])
def test_criteo_run_on_several_ranks_gives_the_one_process_validation_metrics(one_process, tmp_path, world_size):
    assert one_process["samples"] == TRAIN_ROWS and one_process["val_auc"] > 0.6
    results = run_ranks(_train, world_size, str(tmp_path / "run"), timeout=60)
    for (record,) in results:  # every rank has the run's record
        assert record["samples"] == TRAIN_ROWS and record["step"] == one_process["step"] == 7
        got = {k: record[k] for k in FIELDS}
        assert got == pytest.approx({k: one_process[k] for k in FIELDS}, abs=1e-5), world_size
