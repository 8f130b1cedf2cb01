"""The tables' health in the Trainer's step records: a bounded table's evictions per step,
returns and oldest row age in the JSON lines and the TensorBoard scalars; admission's keys
when a table's stats() has them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import veloce
from veloce.data import SyntheticClicks
from veloce.models import DLRM
from veloce.train.callbacks import TensorBoardLogger
from veloce.train.telemetry import TableTelemetry

pytestmark = pytest.mark.skipif(not veloce.ops.extension.loaded, reason="veloce._C is not built")

NUM_DENSE, NUM_SPARSE, ID_SPACE, ROWS = 4, 2, 400, 64


def model(**table_kwargs: Any) -> DLRM:
    torch.manual_seed(0)
    return DLRM(NUM_DENSE, NUM_SPARSE, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1),
                embedding_factory=lambda d: veloce.DynamicEmbedding(
                    d, mode="sum", optimizer=veloce.optim.SGD(lr=0.05), **table_kwargs))  # fmt: skip


class Records(veloce.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_log(self, trainer, record) -> None:
        self.steps.append(dict(record))


def fit(m: DLRM, tmp_path, **kw) -> Records:
    rec = Records()
    t = veloce.Trainer(m, optimizer=torch.optim.Adam(m.parameters(), lr=1e-2), progress=False, max_epochs=1,
                       log_every=4, log_dir=tmp_path, callbacks=[rec], **kw)  # fmt: skip
    t.fit(SyntheticClicks(512, batch_size=64, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=ID_SPACE,
                          seed=1))  # fmt: skip
    return rec


def test_a_bounded_table_logs_its_health(tmp_path):
    m = model(max_capacity=ROWS, eviction="lru")
    rec = fit(m, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    assert len(steps) == 2 and [r["step"] for r in steps] == [r["step"] for r in rec.steps]
    for i in range(NUM_SPARSE):
        p = f"tables/embeddings.sparse_{i}/"
        keys = {k[len(p):] for k in steps[0] if k.startswith(p)}
        assert keys == {"rows", "evicted_per_step", "evicted_within_n", "returned_within_n", "oldest_row_age"}
        assert all(r[p + "rows"] == ROWS for r in steps)  # full: 8 steps of 64 lookups over 400 ids
        assert sum(r[p + "evicted_per_step"] * 4 for r in steps) == pytest.approx(
            _table(m, i).num_evicted)  # every eviction, spread over the records' steps
        last = steps[-1]
        assert 0 < last[p + "returned_within_n"] <= last[p + "evicted_within_n"] <= _table(m, i).num_evicted
        assert 0 <= last[p + "oldest_row_age"] < 8


def _table(m: DLRM, i: int) -> veloce.table.HashTable:
    return dict(m.named_modules())[f"embeddings.sparse_{i}"].table


def test_the_health_keys_reach_tensorboard(tmp_path):
    m = model(max_capacity=ROWS, eviction="lfu")
    rec = fit(m, tmp_path)
    scalars: dict[str, float] = {}

    class Writer:
        def add_scalar(self, tag: str, value: float, step: int) -> None:
            scalars[tag] = value

        def flush(self) -> None:
            pass

    tb = TensorBoardLogger(tmp_path)
    tb.writer = Writer()
    tb.on_log(None, rec.steps[-1])
    p = "train/tables/embeddings.sparse_0/"
    keys = ("rows", "evicted_per_step", "evicted_within_n", "returned_within_n", "min_use_count")
    assert {p + k for k in keys} <= set(scalars)
    assert p + "oldest_row_age" not in scalars  # lfu: use counts, no age
    assert scalars[p + "min_use_count"] >= 1


def test_admission_keys_flow_when_a_table_reports_them():
    m = model()
    emb = dict(m.named_modules())["embeddings.sparse_0"]
    counts = {"admitted": 0, "refused": 0}
    real = emb.stats
    emb.stats = lambda reset=False: {**real(reset), **counts, "default_row_share": 0.25}
    telemetry = TableTelemetry(m)
    telemetry.mark()
    counts.update(admitted=30, refused=90)
    out = telemetry.window(3)
    p = "tables/embeddings.sparse_0/"
    got = (out[p + "admitted_per_step"], out[p + "refused_per_step"], out[p + "default_row_share"])
    assert got == (10, 30, 0.25)
    assert "tables/embeddings.sparse_1/admitted_per_step" not in out  # the other table reports no admission
    assert p + "evicted_per_step" not in out  # an unbounded table drops no rows
