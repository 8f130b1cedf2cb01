"""veloce.Trainer: learning, calling conventions, gradient accumulation, bf16, exact resume,
callbacks, early stopping, logs, argument checks; and the veloce CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

import veloce
from veloce.train.lockstep import move_to
from veloce.data import SyntheticClicks
from veloce.models import DLRM

NUM_DENSE, NUM_SPARSE = 4, 4


def data(n: int, batch: int, start: int = 0) -> SyntheticClicks:
    return SyntheticClicks(n, batch_size=batch, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=500,
                           seed=1, start=start)  # fmt: skip


def model(seed: int = 0, sparse_opt: veloce.optim.SparseOptimizer | None = None) -> DLRM:
    torch.manual_seed(seed)
    opt = sparse_opt or veloce.optim.Adagrad(lr=0.05)
    return DLRM(NUM_DENSE, NUM_SPARSE, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1),
                embedding_factory=lambda d: veloce.DynamicEmbedding(d, mode="sum", optimizer=opt))  # fmt: skip


def trainer(m: nn.Module, **kw) -> veloce.Trainer:
    kw.setdefault("optimizer", torch.optim.Adam(m.parameters(), lr=1e-2))
    kw.setdefault("progress", False)
    return veloce.Trainer(m, **kw)


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    """Dense parameters, and every table's rows and optimizer state sorted by key."""
    out = {k: v.detach().clone() for k, v in m.named_parameters()}
    for name, mod in m.named_modules():
        if isinstance(mod, veloce.DynamicEmbedding):
            e = mod.export()
            order = torch.argsort(e["keys"])
            for k in ("keys", "weights", "optimizer_state"):
                out[f"{name}.{k}"] = e[k][order]
    return out


def assert_states_close(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


# ---- learning and evaluation -------------------------------------------------------------
def test_fit_learns_and_evaluate_returns_floats():
    m = model()
    metrics = {"auc": veloce.metrics.AUC(), "logloss": veloce.metrics.LogLoss()}
    history = trainer(m, metrics=metrics).fit(data(16_384, 256), data(8192, 4096, start=10**8))
    assert len(history) == 1 and history[0]["samples"] == 16_384 and history[0]["step"] == 64
    # measured 0.737 (the data's Bayes AUC is ~0.80; a model that learns nothing gets 0.5)
    assert history[0]["val_auc"] > 0.70
    result = trainer(m, metrics=metrics).evaluate(data(8192, 4096, start=10**8))
    assert set(result) == {"auc", "logloss"} and all(isinstance(v, float) for v in result.values())
    assert result["auc"] == pytest.approx(history[0]["val_auc"], abs=1e-12)  # same model, same data
    assert not any(len(t) == 0 for t in m.modules() if isinstance(t, veloce.DynamicEmbedding))


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = model()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.inner(dense, sparse)


class _SingleInput(_DictModel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.inner(x[:, :NUM_DENSE].float(), x[:, NUM_DENSE:].long())


_CONVENTIONS = {
    "tuple": lambda d, s: (d, s),
    "list": lambda d, s: [d, s],
    "dict": lambda d, s: {"dense": d, "sparse": s},
    "single": lambda d, s: torch.cat([d.double(), s.double()], dim=1),
}


@pytest.mark.parametrize("convention", list(_CONVENTIONS))
def test_input_conventions_train_the_same_model(convention):
    """model(*inputs) for tuples/lists, model(**inputs) for dicts, model(inputs) otherwise:
    each convention trains exactly the model the tuple convention trains."""

    def batches(pack):  # ids < 2**40 survive the trip through float64 of the single-tensor input
        return [(pack(d, s % 2**40), y) for (d, s), y in data(1024, 128)]

    m = _SingleInput() if convention == "single" else _DictModel()
    history = trainer(m).fit(batches(_CONVENTIONS[convention]))
    ref = _DictModel()
    ref_history = trainer(ref).fit(batches(_CONVENTIONS["tuple"]))
    assert history[0]["loss"] == ref_history[0]["loss"]
    assert_states_close(state(m), state(ref))


def test_move_to_walks_nested_containers():
    Pair = namedtuple("Pair", "a b")
    obj = {"x": (torch.ones(2), [torch.zeros(1), {"y": torch.ones(3)}]), "p": Pair(torch.ones(1), 5), "s": "keep"}
    moved = move_to(obj, torch.device("meta"))
    assert moved["x"][0].is_meta and moved["x"][1][0].is_meta and moved["x"][1][1]["y"].is_meta
    assert isinstance(moved["x"], tuple) and isinstance(moved["x"][1], list) and isinstance(moved["p"], Pair)
    assert moved["p"].a.is_meta and moved["p"].b == 5 and moved["s"] == "keep"


def test_loader_must_yield_pairs():
    with pytest.raises(TypeError, match=r"\(inputs, target\) pairs, got a tuple of length 3"):
        trainer(model()).fit([(torch.zeros(2, NUM_DENSE), torch.zeros(2, NUM_SPARSE, dtype=torch.long), torch.zeros(2))])


# ---- gradient accumulation and precision -------------------------------------------------
def test_accumulate_steps_equals_one_big_batch():
    """k micro-batches of b samples, then one step == one step on the k*b batch (SGD dense and sparse)."""
    k, b = 4, 64
    small, big = model(sparse_opt=veloce.optim.SGD(lr=0.5)), model(sparse_opt=veloce.optim.SGD(lr=0.5))
    h_small = trainer(small, optimizer=torch.optim.SGD(small.parameters(), lr=0.5), accumulate_steps=k).fit(data(1024, b))
    h_big = trainer(big, optimizer=torch.optim.SGD(big.parameters(), lr=0.5)).fit(data(1024, k * b))
    assert h_small[0]["step"] == h_big[0]["step"] == 4
    assert_states_close(state(small), state(big), atol=1e-5)
    assert state(small)["top.0.weight"].ne(state(model())["top.0.weight"]).any()  # it did train


def test_clip_grad_norm_clips_dense_and_table_gradients_as_veloce_clip_grad_norm_does():
    """Trainer(clip_grad_norm=c) == the loop that calls veloce.clip_grad_norm_(model, c) before each step."""
    clipped = model(sparse_opt=veloce.optim.SGD(lr=0.5))
    trainer(clipped, optimizer=torch.optim.SGD(clipped.parameters(), lr=0.5), clip_grad_norm=0.05).fit(data(512, 128))
    ref = model(sparse_opt=veloce.optim.SGD(lr=0.5))
    opt = veloce.CombinedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.5), ref)
    norms = []
    for (dense, sparse), label in data(512, 128):
        nn.BCEWithLogitsLoss()(ref(dense, sparse), label).backward()
        norms.append(float(veloce.clip_grad_norm_(ref, 0.05)))
        opt.step()
        opt.zero_grad()
    assert min(norms) > 0.05  # every step was clipped
    assert_states_close(state(clipped), state(ref), atol=1e-6)
    with pytest.raises(ValueError, match=r"clip_grad_norm must be None or a positive number, got -1"):
        trainer(model(), clip_grad_norm=-1)


def test_accumulate_steps_steps_a_last_partial_group():
    h = trainer(model(), accumulate_steps=3).fit(data(1024, 128))  # 8 micro-batches: 3 + 3 + 2
    assert h[0]["step"] == 3


class _DtypeProbe(_DictModel):
    def forward(self, dense, sparse):  # type: ignore[override]
        out = self.inner(dense, sparse)
        self.dtype = out.dtype
        return out


def test_bf16_autocasts_the_dense_part_and_learns():
    m = _DtypeProbe()
    h = trainer(m, precision="bf16", max_epochs=3).fit(data(2048, 128))
    assert m.dtype == torch.bfloat16
    assert h[2]["loss"] < h[0]["loss"]
    tables = [t for t in m.modules() if isinstance(t, veloce.DynamicEmbedding)]
    assert all(t.table.weights.dtype == torch.float32 for t in tables)


# ---- checkpoints and resume --------------------------------------------------------------
class _Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        (self.dense, self.sparse), self.label = data(n, n).batch(0)

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, i: int):
        return (self.dense[i], self.sparse[i]), self.label[i]


class _Dropout(_DictModel):
    """Uses the RNG in training (dropout), so the resumed RNG state matters."""

    def forward(self, dense, sparse):  # type: ignore[override]
        return self.inner(nn.functional.dropout(dense, 0.3, self.training), sparse)


class _CrashAt(veloce.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            raise KeyboardInterrupt(f"simulated crash after step {step}")


def _resumable_run(tmp_path, name: str, seed: int, callbacks=(), resume_from=None):
    torch.manual_seed(seed)
    m = _Dropout()
    loader = torch.utils.data.DataLoader(_Samples(320), batch_size=64, shuffle=True)  # 5 steps an epoch
    t = trainer(m, metrics={"auc": veloce.metrics.AUC()}, max_epochs=2, checkpoint_dir=tmp_path / name,
                checkpoint_every=3, callbacks=list(callbacks))  # fmt: skip
    return m, t, t.fit(loader, val_loader=[next(iter(loader))], resume_from=resume_from)


def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path):
    ref_model, ref_trainer, ref_history = _resumable_run(tmp_path, "ref", seed=0)
    with pytest.raises(KeyboardInterrupt):  # crashes after step 7 (epoch 1); the newest checkpoint is step 6
        _resumable_run(tmp_path, "run", seed=0, callbacks=[_CrashAt(7)])
    assert veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path / "run"))["step"] == 6
    model_, trainer_, history = _resumable_run(tmp_path, "run", seed=123)  # fresh model, other init
    assert trainer_.global_step == ref_trainer.global_step == 10
    assert_states_close(state(model_), state(ref_model))
    dense_opt, ref_dense_opt = trainer_.optimizer.dense.state_dict(), ref_trainer.optimizer.dense.state_dict()
    for i in ref_dense_opt["state"]:
        for key, value in ref_dense_opt["state"][i].items():
            torch.testing.assert_close(dense_opt["state"][i][key], value, atol=0, rtol=0)
    drop = ("seconds", "samples_per_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in history] == [
        {k: v for k, v in r.items() if k not in drop} for r in ref_history
    ]
    # a finished run is not trained again
    again_model, again_trainer, again = _resumable_run(tmp_path, "run", seed=5)
    assert again == history and again_trainer.global_step == 10
    assert_states_close(state(again_model), state(ref_model))


class _KeepCheckpoints(veloce.Callback):
    """Copies every committed checkpoint elsewhere, as a launcher (Ray Train) does."""

    def __init__(self, keep: Path) -> None:
        self.keep, self.steps = keep, []

    def on_checkpoint(self, trainer, path):
        assert veloce.checkpoint.describe(path)["step"] == trainer.global_step
        self.steps.append(trainer.global_step)
        shutil.copytree(path, self.keep / path.name)


def test_on_checkpoint_and_resume_from_a_given_checkpoint(tmp_path):
    """on_checkpoint sees every committed checkpoint; fit(resume_from=...) resumes from one
    older than the newest in checkpoint_dir, replaces the later ones as it reaches their
    steps, and ends as the uninterrupted run."""
    kept = _KeepCheckpoints(tmp_path / "kept")
    ref_model, _, ref_history = _resumable_run(tmp_path, "run", seed=0, callbacks=[kept])
    assert kept.steps == [3, 5, 6, 9, 10]  # every 3 steps and every epoch's end (5 steps an epoch)
    again = _KeepCheckpoints(tmp_path / "again")
    model_, trainer_, history = _resumable_run(tmp_path, "run", seed=123, callbacks=[again],
                                               resume_from=tmp_path / "kept" / "step_000000005")  # fmt: skip
    assert again.steps == [6, 9, 10] and trainer_.global_step == 10  # "run" held steps 6, 9, 10 already
    assert_states_close(state(model_), state(ref_model))
    assert [r["loss"] for r in history] == [r["loss"] for r in ref_history]


def test_max_steps_stops_and_a_later_fit_continues(tmp_path):
    m = model()
    t = trainer(m, max_steps=3, checkpoint_dir=tmp_path)
    assert t.fit(data(1024, 128)) == [] and t.global_step == 3
    assert veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path))["step"] == 3
    t2 = trainer(model(seed=9), checkpoint_dir=tmp_path)
    h = t2.fit(data(1024, 128))
    assert t2.global_step == 8 and h[0]["samples"] == 1024
    ref = model()
    trainer(ref).fit(data(1024, 128))
    assert_states_close(state(t2.module), state(ref))


# ---- callbacks, early stopping, logs -----------------------------------------------------
class _Recorder(veloce.Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_fit_start(self, trainer):
        self.calls.append(("fit_start",))

    def on_epoch_start(self, trainer, epoch):
        self.calls.append(("epoch_start", epoch))

    def on_step_end(self, trainer, step):
        self.calls.append(("step", step))

    def on_log(self, trainer, record):
        self.calls.append(("log", record["step"]))

    def on_epoch_end(self, trainer, record):
        self.calls.append(("epoch_end", record["epoch"], round(record.get("val_auc", 0.0), 6)))

    def on_fit_end(self, trainer, history):
        self.calls.append(("fit_end", len(history)))


def test_callbacks_are_called_in_order():
    rec = _Recorder()
    val = data(512, 512, start=10**8)
    h = trainer(model(), metrics={"auc": veloce.metrics.AUC()}, max_epochs=2, callbacks=[rec]).fit(data(512, 128), val)
    steps = lambda lo, hi: [("step", s) for s in range(lo, hi)]  # noqa: E731
    assert rec.calls == (
        [("fit_start",), ("epoch_start", 0)] + steps(1, 5) + [("epoch_end", 0, round(h[0]["val_auc"], 6))]
        + [("epoch_start", 1)] + steps(5, 9) + [("epoch_end", 1, round(h[1]["val_auc"], 6)), ("fit_end", 2)]
    )  # fmt: skip
    # on_log is for the loggers on rank 0 and for callbacks alike
    rec2 = _Recorder()
    trainer(model(), log_every=3, callbacks=[rec2]).fit(data(1024, 128))
    assert [c for c in rec2.calls if c[0] == "log"] == [("log", 3), ("log", 6)]


class _StopAt(veloce.Callback):
    def on_step_end(self, trainer, step):
        trainer.should_stop = step == 3


def test_a_callback_stops_training_mid_epoch():
    t = trainer(model(), max_epochs=3, callbacks=[_StopAt()])
    assert t.fit(data(1024, 128)) == [] and t.global_step == 3


class _Constant(veloce.metrics.Metric):
    def update(self, preds, target):
        pass

    def compute(self):
        return 0.5

    def reset(self):
        pass


def test_early_stopping_stops_after_patience_epochs_without_improvement(tmp_path):
    stop = veloce.EarlyStopping("val_const", mode="max", patience=1)
    t = trainer(model(), metrics={"const": _Constant()}, max_epochs=10, callbacks=[stop], checkpoint_dir=tmp_path)
    h = t.fit(data(256, 128), val_loader=data(128, 128, start=10**8))
    assert len(h) == 3 and stop.wait == 2  # epoch 0 sets the best, 1 and 2 do not improve
    # the early stop is remembered: a resumed fit does not train again
    again = trainer(model(), metrics={"const": _Constant()}, max_epochs=10, checkpoint_dir=tmp_path,
                    callbacks=[veloce.EarlyStopping("val_const", patience=1)])  # fmt: skip
    assert again.fit(data(256, 128)) == h and again.global_step == t.global_step


def test_early_stopping_names_the_missing_key():
    t = trainer(model(), callbacks=[veloce.EarlyStopping("loss_typo")])
    with pytest.raises(KeyError, match="loss_typo.*need val_loader"):
        t.fit(data(256, 128))
    with pytest.raises(ValueError, match="mode must be 'max' or 'min'"):
        veloce.EarlyStopping("loss", mode="up")


@pytest.mark.parametrize("case", ["val without metrics", "early stop without val", "early stop on no metric",
                                  "unwritable checkpoint_dir"])  # fmt: skip
def test_fit_refuses_what_would_fail_after_an_epoch_before_training(tmp_path, case):
    """Each of these used to fail only at the first epoch's end (or first checkpoint), after
    an epoch of training that was then lost."""
    val = data(128, 128, start=10**8)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    kwargs, fit_val, pattern = {
        "val without metrics": ({}, val, "val_loader is given but the Trainer has no metrics"),
        "early stop without val": ({"callbacks": [veloce.EarlyStopping("val_auc")]}, None,
                                   "EarlyStopping monitors 'val_auc', which needs a val_loader"),
        "early stop on no metric": ({"metrics": {"auc": veloce.metrics.AUC()},
                                     "callbacks": [veloce.EarlyStopping("val_logloss", mode="min")]}, val,
                                    r"monitors 'val_logloss', but the metrics are \['auc'\]"),
        "unwritable checkpoint_dir": ({"checkpoint_dir": blocker / "ck"}, None, "cannot be written"),
    }[case]  # fmt: skip
    t = trainer(model(), **kwargs)
    with pytest.raises((ValueError, veloce.checkpoint.CheckpointError), match=pattern):
        t.fit(data(256, 128), val_loader=fit_val)
    assert t.global_step == 0


def test_json_lines_log_has_every_logged_step_and_epoch(tmp_path):
    trainer(model(), log_every=2, log_dir=tmp_path, max_epochs=2).fit(data(768, 128))  # 6 steps an epoch
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records] == (
        [("step", 2), ("step", 4), ("step", 6), ("epoch", 6), ("step", 8), ("step", 10), ("step", 12), ("epoch", 12)]
    )  # fmt: skip
    assert all(r["loss"] > 0 and r["samples_per_s"] > 0 for r in records)
    assert records[0]["lr"] == 1e-2


def test_progress_bar_and_summary_are_printed(capsys):
    trainer(model(), progress=True, log_every=2).fit(data(512, 128))
    err = capsys.readouterr().err
    assert "epoch 0" in err and "samples_s=" in err and "loss" in err


# ---- arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp8"}, "precision must be one of .*'fp8'"),
        ({"accumulate_steps": 0}, "accumulate_steps must be an int >= 1, got 0"),
        ({"max_epochs": 1.5}, "max_epochs must be an int >= 1, got 1.5"),
        ({"max_steps": 0}, "max_steps must be None or an int >= 1, got 0"),
        ({"checkpoint_every": 10}, "checkpoint_every must be None when checkpoint_dir is None"),
        ({"log_every": -1}, "log_every must be an int >= 1, got -1"),
        ({"keep_last": 0}, "keep_last must be an int >= 1"),
        ({"metrics": {"auc": 3}}, r"metrics\['auc'\] must be an object with update"),
        ({"loss_fn": "bce"}, "loss_fn must be callable"),
        ({"callbacks": [print]}, "callbacks must be a list of veloce.Callback"),
        ({"seed": -1}, "seed must be an int >= 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        trainer(model(), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        veloce.Trainer(lambda x: x)


def test_a_plain_torch_optimizer_is_combined_with_the_tables():
    m = model()
    t = trainer(m)
    assert isinstance(t.optimizer, veloce.CombinedOptimizer) and len(t.optimizer.tables) == NUM_SPARSE
    t.fit(data(256, 128))
    table = m.embeddings["sparse_0"]
    keys = table.export()["keys"]
    trained, _ = table.find(keys)
    initial = veloce.DynamicEmbedding(4, mode="sum").eval()(keys.view(-1, 1))  # eval: unknown ids read their init
    assert len(keys) > 0 and (trained - initial).abs().min(dim=1).values.gt(0).all()  # every row was stepped


# ---- metrics over several ranks ----------------------------------------------------------
def test_metrics_over_ranks_see_every_rank_predictions(monkeypatch):
    """With 2 ranks, veloce's metrics are computed on the predictions of both ranks."""
    from veloce.train import evaluation as evaluation_mod

    other = (torch.tensor([3.0, -3.0]), torch.tensor([1.0, 0.0]))
    monkeypatch.setattr(evaluation_mod, "gather", lambda mine: [mine, other])
    sink = evaluation_mod.MetricSink({"auc": veloce.metrics.AUC()}, world_size=2)
    sink.update(torch.tensor([0.2, 0.1]), torch.tensor([0.0, 1.0]))  # alone: AUC 0
    assert sink.compute() == {"auc": pytest.approx(0.75)}  # 4 samples: 3 of 4 pairs ordered


def test_max_steps_reached_by_a_last_partial_group_stops_the_run():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.lin = veloce.DynamicEmbedding(4, mode="sum"), nn.Linear(4, 1)

        def forward(self, x):
            return self.lin(self.e(x)).squeeze(1)

    data = [((torch.tensor([[i]]),), torch.tensor([1.0])) for i in range(5)]  # 3 steps per epoch
    trainer = veloce.Trainer(M(), accumulate_steps=2, max_epochs=3, max_steps=3, progress=False)
    trainer.fit(data)
    assert trainer.global_step == 3


def test_max_steps_at_an_epochs_last_batch_ends_the_epoch(tmp_path):
    """A run stopped by max_steps on the last batch of an epoch still validates it, records
    it and checkpoints its end: a later fit goes on with the next epoch, and its history is
    that of an uninterrupted run."""
    val = data(256, 128, start=10**8)
    metrics = {"auc": veloce.metrics.AUC()}
    t = trainer(model(), metrics=metrics, max_epochs=2, max_steps=8, checkpoint_dir=tmp_path)
    h = t.fit(data(1024, 128), val)  # 8 steps per epoch
    assert [r["epoch"] for r in h] == [0] and "val_auc" in h[0]
    assert veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path))["extra"]["epoch"] == 1
    t2 = trainer(model(seed=9), metrics={"auc": veloce.metrics.AUC()}, max_epochs=2, checkpoint_dir=tmp_path)
    h2 = t2.fit(data(1024, 128), val)
    ref = trainer(model(), metrics={"auc": veloce.metrics.AUC()}, max_epochs=2).fit(data(1024, 128), val)
    assert [r["epoch"] for r in h2] == [0, 1]
    assert [r["val_auc"] for r in h2] == pytest.approx([r["val_auc"] for r in ref], abs=1e-6)


class _NoLen:
    """A loader without len(): the Trainer learns that an epoch ended only when it does."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("sized", [True, False])
def test_an_epoch_ending_at_a_step_checkpoint_every_saved_is_checkpointed_as_ended(tmp_path, sized):
    """checkpoint_every falls on the epoch's last step. The epoch's end (its record, the
    next epoch's position) must be what the newest checkpoint holds, or a resumed fit
    repeats the epoch's validation and records it twice: a loader with len() saves once,
    at the epoch's end; one without saves at the step and then replaces that checkpoint."""
    saved = []

    class Saves(veloce.Callback):
        def on_checkpoint(self, trainer, path):
            saved.append(path.name)

    train = data(1024, 128) if sized else _NoLen(list(data(1024, 128)))
    t = trainer(model(), metrics={"auc": veloce.metrics.AUC()}, checkpoint_dir=tmp_path, checkpoint_every=4,
                callbacks=[Saves()])  # fmt: skip
    h = t.fit(train, data(256, 128, start=10**8))  # 8 steps
    assert saved == (["step_000000004", "step_000000008"] if sized else ["step_000000004"] + ["step_000000008"] * 2)
    extra = veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path))["extra"]
    assert (extra["epoch"], extra["batches_in_epoch"], len(extra["history"])) == (1, 0, 1)
    again = trainer(model(seed=3), metrics={"auc": veloce.metrics.AUC()}, checkpoint_dir=tmp_path, max_epochs=1)
    assert again.fit(data(1024, 128), data(256, 128, start=10**8)) == h


def test_nan_in_an_epoch_record_is_checkpointed_and_resumed(tmp_path):
    """An epoch without samples has a NaN loss: the checkpoint's strict JSON keeps it, and a
    resumed run reads it back."""
    t = trainer(model(), checkpoint_dir=tmp_path)
    with pytest.warns(UserWarning, match="an epoch without samples"):
        h = t.fit([])
    assert len(h) == 1 and h[0]["loss"] != h[0]["loss"]  # NaN
    h2 = trainer(model(), checkpoint_dir=tmp_path).fit([])
    assert len(h2) == 1 and h2[0]["loss"] != h2[0]["loss"] and h2[0]["samples"] == 0


def test_a_one_class_validation_split_fails_the_fit_naming_the_metric(tmp_path):
    """An AUC over validation samples of one class has no value: fit raises MetricError
    naming the metric, the samples and why, instead of recording NaN. The epoch's training
    is checkpointed: a fit with a usable validation split validates it without training
    it again, and ends as the run that had that split from the start."""
    one_class = [(x, torch.zeros_like(y)) for x, y in data(256, 128, start=10**8)]
    metrics = lambda: {"auc": veloce.metrics.AUC(), "logloss": veloce.metrics.LogLoss()}  # noqa: E731
    t = trainer(model(), metrics=metrics(), checkpoint_dir=tmp_path)
    with pytest.raises(veloce.metrics.MetricError, match=r"metric 'auc' computed to NaN over the 256 evaluation "
                       r"samples of all 1 rank\(s\) \(AUC.compute: AUC is undefined when all 256 targets are negative"):
        t.fit(data(512, 128), one_class)
    assert t.global_step == 4 and t.history == []
    val = data(256, 128, start=10**8)
    again = trainer(model(seed=5), metrics=metrics(), checkpoint_dir=tmp_path)
    h = again.fit(data(512, 128), val)
    ref = trainer(model(), metrics=metrics()).fit(data(512, 128), val)
    assert again.global_step == 4 and len(h) == 1
    assert {k: h[0][k] for k in ("loss", "samples", "val_auc")} == {k: ref[0][k] for k in ("loss", "samples", "val_auc")}


def test_evaluate_on_an_empty_loader_raises_instead_of_returning_nan():
    t = trainer(model(), metrics={"logloss": veloce.metrics.LogLoss()})
    with pytest.raises(veloce.metrics.MetricError, match="metric 'logloss' computed to NaN over the 0 evaluation"):
        t.evaluate([])


def test_epoch_loss_is_the_mean_over_every_sample():
    """A short last batch weighs by its samples: the epoch loss is the mean over all of them."""
    losses = []

    class Record(nn.BCEWithLogitsLoss):
        def forward(self, preds, target):
            loss = super().forward(preds, target)
            losses.append((loss.item(), len(target)))
            return loss

    (record,) = trainer(model(), loss_fn=Record()).fit(data(300, 128))  # batches of 128, 128 and 44
    assert [n for _, n in losses] == [128, 128, 44] and record["samples"] == 300
    assert record["loss"] == pytest.approx(sum(v * n for v, n in losses) / 300, rel=1e-12)


def test_a_nan_loss_applies_nothing_dense_or_sparse():
    """The tables' NaN/Inf check (nonfinite_grad="raise") runs before the dense step: a
    NaN loss raises with every parameter and every table as they were."""
    m = model()
    t = trainer(m)
    t.fit(data(256, 128))
    before = state(m)
    x, y = next(iter(data(128, 128, start=7)))
    loss = m(*x).sum() * float("nan")
    loss.backward()
    with pytest.raises(FloatingPointError, match="nothing was applied"):
        t.optimizer.step()
    assert_states_close(state(m), before)


def test_resuming_from_a_checkpoint_no_trainer_wrote_is_refused_before_loading(tmp_path):
    src = model(seed=4)
    veloce.checkpoint.save_in(tmp_path, src, step=5, extra={"note": "mine"})
    m = model()
    before = state(m)
    with pytest.raises(veloce.checkpoint.CheckpointError, match="not written by a Trainer.*lacks epoch"):
        trainer(m, checkpoint_dir=tmp_path).fit(data(256, 128))
    assert_states_close(state(m), before)


def test_an_empty_epoch_has_a_nan_loss_and_warns():
    t = trainer(model())
    with pytest.warns(UserWarning, match="an epoch without samples"):
        h = t.fit([])
    assert len(h) == 1 and h[0]["loss"] != h[0]["loss"] and h[0]["samples"] == 0


def test_a_resumed_epoch_counts_the_time_before_the_interruption(tmp_path, monkeypatch):
    """The epoch's seconds (and so samples/s) include the training before a resume: the
    clock used to restart at the resume, which made the throughput of a resumed epoch
    absurd."""
    clock = iter(range(0, 10**6, 10))  # every read of the clock is 10 s after the one before
    monkeypatch.setattr(veloce.train.totals.time, "perf_counter", lambda: float(next(clock)))
    t = trainer(model(), max_steps=4, checkpoint_dir=tmp_path)
    t.fit(data(1024, 128))
    saved = veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path))["extra"]["ranks"][0]["totals"]["seconds"]
    assert saved > 0
    t2 = trainer(model(), checkpoint_dir=tmp_path)
    (record,) = t2.fit(data(1024, 128))
    assert record["seconds"] > saved


# ---- Ctrl-C ------------------------------------------------------------------------------
class _SigintAt(veloce.Callback):
    """Sends this process SIGINT (a Ctrl-C) during step ``step``'s end, on rank ``rank``."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, trainer, step):
        if step == self.step and trainer.rank == self.rank:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_checkpoints_the_step_reached_and_the_resume_equals_the_uninterrupted_run(tmp_path):
    ref_model, ref_trainer, ref_history = _resumable_run(tmp_path, "ref", seed=0)
    with pytest.raises(veloce.train.TrainingInterrupted, match=r"interrupted at step 7 \(epoch 1\)") as info:
        _resumable_run(tmp_path, "run", seed=0, callbacks=[_SigintAt(7)])
    assert info.value.step == 7 and info.value.checkpoint == tmp_path / "run" / "step_000000007"
    assert veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path / "run"))["step"] == 7  # not 6
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # fit gave Ctrl-C back
    model_, trainer_, history = _resumable_run(tmp_path, "run", seed=123)
    assert trainer_.global_step == ref_trainer.global_step == 10
    assert_states_close(state(model_), state(ref_model))
    drop = ("seconds", "samples_per_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in history] == [
        {k: v for k, v in r.items() if k not in drop} for r in ref_history
    ]


class _SigintInValidation(veloce.metrics.AUC):
    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def update(self, preds, target):
        super().update(preds, target)
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_during_validation_checkpoints_the_trained_epoch_and_the_resume_validates_it(tmp_path):
    def run(metric):
        torch.manual_seed(0)
        m = model()
        t = trainer(m, metrics={"auc": metric}, max_epochs=1, checkpoint_dir=tmp_path / "run")
        return t, t.fit(data(512, 128), val_loader=data(512, 128, start=10**6))

    with pytest.raises(veloce.train.TrainingInterrupted, match="interrupted at step 4 \\(epoch 0\\)"):
        run(_SigintInValidation())
    t, history = run(veloce.metrics.AUC())
    assert t.global_step == 4 and [r["epoch"] for r in history] == [0] and 0 <= history[0]["val_auc"] <= 1


def _ctrl_c_on_one_rank_body(rank: int, world_size: int, root: str) -> dict:
    def run(name: str, callbacks=()):
        torch.manual_seed(0)
        m = model()
        t = trainer(m, metrics={"auc": veloce.metrics.AUC()}, max_epochs=2, checkpoint_dir=Path(root) / name,
                    callbacks=list(callbacks))  # fmt: skip
        ds = SyntheticClicks(1024, batch_size=128, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=500,
                             seed=1, rank=rank, world_size=world_size)  # fmt: skip
        return t.fit(ds, val_loader=data(256, 128, start=10**6))

    drop = ("seconds", "samples_per_s")
    ref = run("ref")
    try:
        run("run", [_SigintAt(step=3, rank=1)])  # only rank 1 is interrupted
        interrupted = None
    except veloce.train.TrainingInterrupted as exc:
        interrupted = exc.step
    history = run("run")
    return {"interrupted": interrupted, "same": [{k: v for k, v in r.items() if k not in drop} for r in history]
            == [{k: v for k, v in r.items() if k not in drop} for r in ref]}  # fmt: skip


def test_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step_and_resumes_exactly(tmp_path):
    from _dist import run_ranks

    results = run_ranks(_ctrl_c_on_one_rank_body, 2, str(tmp_path), timeout=120)
    assert results == [{"interrupted": 3, "same": True}] * 2


def test_ctrl_c_without_a_checkpoint_dir_is_a_plain_keyboard_interrupt():
    t = trainer(model(), callbacks=[_SigintAt(2)])
    with pytest.raises(KeyboardInterrupt) as info:
        t.fit(data(512, 128))
    assert type(info.value) is KeyboardInterrupt
