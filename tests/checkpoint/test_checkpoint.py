"""veloce.checkpoint: round trips, resume equal to an uninterrupted run, every refusal
(leaving the model and optimizer unchanged), crash consistency, and W -> W' ranks on gloo.
"""

from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import veloce
from veloce.checkpoint import files as checkpoint_files
from veloce import checkpoint as ckpt
from veloce.checkpoint import CheckpointError
from veloce.distributed import HybridParallel, owner_of, table_shard
from veloce.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from veloce.sparse import CombinedOptimizer

from _dist import run_ranks

ENTRIES = ("keys", "weights", "optimizer_state", "scores")


# ---- a small model: named tables of one dim, pooled and summed, then an MLP ----------------
class Net(nn.Module):
    """``emb[name]`` looks up ``ids[:, k]`` (k-th table); the pooled rows are summed."""

    def __init__(self, tables=None, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        tables = {"user": Adam(lr=0.01), "item": Adagrad(lr=0.05)} if tables is None else tables
        self.emb = nn.ModuleDict(
            {name: veloce.DynamicEmbedding(dim, mode="sum", optimizer=opt, seed=k) for k, (name, opt) in
             enumerate(tables.items())}
        )  # fmt: skip
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.register_buffer("seen", torch.zeros(()))  # persistent, changed by training
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = sum(emb(ids[:, k]) for k, emb in enumerate(self.emb.values()))
        return self.mlp(pooled).squeeze(1)


class Wrapper(nn.Module):
    """A DDP-like wrapper: everything lives under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def make(seed: int = 0, dense=torch.optim.Adam, **kw) -> tuple[Net, CombinedOptimizer]:
    torch.manual_seed(seed)
    model = Net(**kw)
    return model, CombinedOptimizer(dense(model.mlp.parameters(), lr=1e-2), model)


def batches(n: int, seed: int, tables: int = 2) -> list:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(-(2**62), 2**62, (300,), generator=g)
    return [(pool[torch.randint(0, 300, (16, tables, 2), generator=g)], torch.rand(16, generator=g)) for _ in range(n)]


def train(model, opt, data) -> None:
    for ids, y in data:
        F.binary_cross_entropy_with_logits(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
        getattr(model, "module", model).seen += 1  # HybridParallel holds the Net in .module


def table_state(m: veloce.DynamicEmbedding) -> dict:
    e = m.table.export()
    order = e["keys"].argsort()
    return {**{k: e[k][order] for k in ENTRIES}, "step": m.step_count, "clock": m.table.clock}


def state(model: nn.Module, opt) -> dict:
    """Everything a load may change, copied: tables (sorted by key), dense, optimizer."""
    tables = {n: table_state(m) for n, m in model.named_modules() if isinstance(m, veloce.DynamicEmbedding)}
    dense = {k: v.clone() for k, v in model.state_dict().items() if not any(k.startswith(t + ".") for t in tables)}
    return {"tables": tables, "dense": dense, "opt": copy.deepcopy(opt.state_dict())}


def assert_same(a, b, where: str = "", close: bool = False) -> None:
    """Equality of nested dicts / lists of tensors and plain values: bitwise, or with
    ``close`` floating tensors within 1e-5 (integer tensors and values still exact)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if close and a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=where)
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}", close)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}", close)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture
def trained():
    model, opt = make(seed=0)
    train(model, opt, batches(3, seed=1))
    return model, opt


@pytest.fixture
def saved(trained, tmp_path):
    model, opt = trained
    return ckpt.save(tmp_path / "ckpt", model, opt, step=3, extra={"epoch": 1})


# ---- round trips -----------------------------------------------------------------------------
def test_round_trip_restores_tables_dense_optimizer_step_and_clock(trained, tmp_path):
    model, opt = trained
    rng = torch.get_rng_state()
    extra = {"epoch": 2, "rng": rng.tolist(), "position": [3, 17]}
    path = ckpt.save(tmp_path / "c", model, opt, step=42, extra=extra)
    other, other_opt = make(seed=5)
    train(other, other_opt, batches(1, seed=9))
    info = ckpt.load(path, other, other_opt)
    assert info == {"step": 42, "extra": extra, "world_size": 1, "format_version": ckpt.FORMAT_VERSION}
    assert all(len(m) > 0 for m in model.emb.values())
    assert_same(state(model, opt), state(other, other_opt))
    assert isinstance(other_opt.dense.param_groups[0]["betas"], tuple)  # no JSON list in its place
    assert torch.equal(torch.tensor(info["extra"]["rng"], dtype=torch.uint8), rng)


def test_round_trip_of_other_sparse_and_dense_optimizers(tmp_path):
    tables = {"a": RowWiseAdagrad(lr=0.1), "b": SGD(lr=0.1)}  # state widths 1 and 0
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    model, opt = make(seed=0, tables=tables, dense=sgd)
    train(model, opt, batches(2, seed=3))
    ckpt.save(tmp_path / "c", model, opt)
    other, other_opt = make(seed=1, tables=tables, dense=sgd)
    ckpt.load(tmp_path / "c", other, other_opt)
    assert_same(state(model, opt), state(other, other_opt))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_round_trip_of_a_bare_table_in_other_dtypes(dtype, tmp_path):
    table = veloce.DynamicEmbedding(8, optimizer=Adam(), dtype=dtype)  # the model is the table: name ""
    table.table.load_entries(_random_entries(100, 8, 16, seed=0))
    table.step_count = 4
    ckpt.save(tmp_path / "c", table)
    other = veloce.DynamicEmbedding(8, optimizer=Adam(), dtype=dtype)
    ckpt.load(tmp_path / "c", other)
    assert other.table.weights.dtype == dtype and ckpt.describe(tmp_path / "c")["tables"][0]["name"] == ""
    assert_same(table_state(table), table_state(other))


def _dlrm_setup(seed: int):
    torch.manual_seed(seed)
    model = veloce.models.DLRM(num_dense=4, num_sparse=3, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))
    return model, CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model)


def _dlrm_batches(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(-(2**62), 2**62, (200,), generator=g)
    return [
        ((torch.randn(16, 4, generator=g), pool[torch.randint(0, 200, (16, 3), generator=g)]), torch.rand(16, generator=g))
        for _ in range(n)
    ]


def _train_dlrm(model, opt, data) -> None:
    for args, y in data:
        F.binary_cross_entropy_with_logits(model(*args), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("kind", ["two_tables", "dlrm"])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(kind, tmp_path):
    setup, data_of, step = {
        "two_tables": (lambda s: make(seed=s), lambda: batches(8, seed=2), train),
        "dlrm": (_dlrm_setup, lambda: _dlrm_batches(8, seed=2), _train_dlrm),
    }[kind]
    data = data_of()
    ref, ref_opt = setup(0)
    step(ref, ref_opt, data)

    first, first_opt = setup(0)
    step(first, first_opt, data[:3])
    path = ckpt.save_in(tmp_path, first, first_opt, step=3)
    resumed, resumed_opt = setup(7)  # other dense init: everything must come from the checkpoint
    assert ckpt.load(ckpt.latest(tmp_path), resumed, resumed_opt)["step"] == 3
    step(resumed, resumed_opt, data[3:])
    assert path == ckpt.latest(tmp_path)
    assert_same(state(ref, ref_opt), state(resumed, resumed_opt))


def test_wrapped_and_unwrapped_models_interchange(trained, tmp_path):
    model, opt = trained
    ckpt.save(tmp_path / "wrapped", Wrapper(Wrapper(model)), opt)
    names = {t["name"] for t in ckpt.describe(tmp_path / "wrapped")["tables"]}
    assert names == {"emb.user", "emb.item"}
    plain, plain_opt = make(seed=3)
    ckpt.load(tmp_path / "wrapped", plain, plain_opt)
    assert_same(state(model, opt), state(plain, plain_opt))

    ckpt.save(tmp_path / "plain", plain, plain_opt)
    wrapped, wrapped_opt = make(seed=4)
    ckpt.load(tmp_path / "plain", Wrapper(wrapped), wrapped_opt)
    assert_same(state(model, opt), state(wrapped, wrapped_opt))


def test_a_module_attribute_next_to_other_state_is_not_a_wrapper(trained, tmp_path):
    model, _ = trained
    outer = Wrapper(model)
    outer.head = nn.Linear(2, 2)  # state outside .module: names keep their "module." prefix
    ckpt.save(tmp_path / "c", outer)
    desc = ckpt.describe(tmp_path / "c")
    assert {t["name"] for t in desc["tables"]} == {"module.emb.user", "module.emb.item"}
    assert desc["dense"]["count"] == 4 + 1 + 2  # mlp (4), seen, head (2); not scratch


def test_strict_false_loads_the_tables_both_sides_have(saved):
    other, other_opt = make(seed=2, tables={"user": Adam(lr=0.01), "extra": Adagrad()})
    untouched = table_state(other.emb["extra"])
    ckpt.load(saved, other, other_opt, strict=False)
    model_user = json.loads((saved / "manifest.json").read_text())["tables"]["emb.user"]
    assert len(other.emb["user"]) == model_user["shards"][0]["rows"]
    assert_same(untouched, table_state(other.emb["extra"]))


def test_no_pickle_is_written_or_read(saved, trained, monkeypatch):
    assert sorted(p.name for p in saved.iterdir()) == [
        "COMMITTED", "dense.safetensors", "manifest.json", "tables.rank00000.safetensors",
    ]  # fmt: skip

    def forbidden(*args, **kwargs):
        raise AssertionError("checkpoint.load must not unpickle")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, forbidden)
    other, other_opt = make(seed=1)
    ckpt.load(saved, other, other_opt)
    assert_same(state(*trained), state(other, other_opt))


def test_describe_reports_tables_dense_files_and_commit(saved, trained):
    model, _ = trained
    desc = ckpt.describe(saved, verify=True)
    assert (desc["committed"], desc["step"], desc["world_size"], desc["extra"]) == (True, 3, 1, {"epoch": 1})
    tables = {t["name"]: t for t in desc["tables"]}
    assert tables["emb.user"] == {
        "name": "emb.user", "dim": 8, "rows": len(model.emb["user"]), "state_width": 16, "dtype": "float32",
        "optimizer": "Adam", "shards": 1,
    }  # fmt: skip
    assert tables["emb.item"]["state_width"] == 8 and tables["emb.item"]["rows"] == len(model.emb["item"])
    assert desc["dense"] == {"count": 5, "bytes": 4 * (8 * 16 + 16 + 16 + 1 + 1)}
    assert {f["name"]: (f["size"], f["ok"]) for f in desc["files"]} == {
        n: ((saved / n).stat().st_size, True) for n in ("dense.safetensors", "tables.rank00000.safetensors")
    }
    _flip_byte(saved / "dense.safetensors")
    (saved / "COMMITTED").unlink()
    desc = ckpt.describe(saved, verify=True)
    assert not desc["committed"] and {f["name"]: f["ok"] for f in desc["files"]}["dense.safetensors"] is False


# ---- refusals: each leaves the model and optimizer as they were ----------------------------------
def _flip_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _rewrite_manifest(path: Path, change) -> None:
    """Edits the manifest and re-seals the marker, as a writer of another version would."""
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    data = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(data)
    marker = {"manifest_sha256": hashlib.sha256(data).hexdigest(), "format_version": 1}
    (path / "COMMITTED").write_text(json.dumps(marker))


def _target(**kw):
    model, opt = make(seed=11, **kw)
    train(model, opt, batches(2, seed=12, tables=len(model.emb)))
    return model, opt


def _case(name):
    """Returns (path to load, model, optimizer, expected message regex) for a refusal."""
    def corrupt(path, tmp_path):
        if name == "uncommitted":
            (path / "COMMITTED").unlink()
            return path, *_target(), r"not committed: the COMMITTED marker is missing"
        if name == "truncated":
            f = path / "tables.rank00000.safetensors"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            return path, *_target(), r"tables.rank00000.safetensors is \d+ bytes but manifest.json says \d+: .*truncated"
        if name in ("bit_flip_dense", "bit_flip_tables"):
            _flip_byte(path / ("dense.safetensors" if name == "bit_flip_dense" else "tables.rank00000.safetensors"))
            return path, *_target(), r"safetensors: sha256 \w+\.\.\. differs from manifest.json's .*corrupt"
        if name == "manifest_edited":
            (path / "manifest.json").write_text((path / "manifest.json").read_text().replace('"step": 3', '"step": 4'))
            return path, *_target(), r"manifest.json: sha256 .* differs from the one in COMMITTED"
        if name == "format_version":
            _rewrite_manifest(path, lambda m: m.update(format_version=99))
            return path, *_target(), r"format_version is 99 but this veloce reads format_version 1"
        if name == "missing_file":
            (path / "tables.rank00000.safetensors").unlink()
            return path, *_target(), r"tables.rank00000.safetensors is missing \(listed in manifest.json\)"
        if name == "dim":
            return path, *_target(dim=4), r"table 'emb.item' has dim 8 but the model's has embedding_dim 4"
        if name == "state_width":
            model, opt = _target(tables={"user": Adagrad(), "item": Adagrad()})
            return path, model, opt, r"'emb.user' has optimizer state width 16 \(saved with Adam\) .* Adagrad needs 8"
        if name == "table_not_in_checkpoint":
            model, opt = _target(tables={"user": Adam(lr=0.01), "item": Adagrad(), "extra": Adagrad()})
            return path, model, opt, r"1 table\(s\) of the model are not in the checkpoint: \['emb.extra'\]"
        if name == "table_not_in_model":
            model, opt = _target(tables={"user": Adam(lr=0.01)})
            return path, model, opt, r"1 table\(s\) of the checkpoint are not in the model: \['emb.item'\]"
        if name == "dense_shape":
            return path, *_target(hidden=4), r"dense tensor 'mlp.0.bias' has shape \(16,\) but the model's is \(4,\)"
        if name == "dense_optimizer_class":
            return path, *_target(dense=torch.optim.Adagrad), r"dense_class is 'Adam' but .* is 'Adagrad'"
        if name == "no_optimizer_saved":
            bare = tmp_path / "bare"
            ckpt.save(bare, make(seed=0)[0])
            return bare, *_target(), r"holds no optimizer state but an optimizer was passed"
        if name == "empty_dir":
            (tmp_path / "empty").mkdir()
            return tmp_path / "empty", *_target(), r"is not a veloce checkpoint: it has no manifest.json"
        if name == "a_file":
            (tmp_path / "file").write_text("x")
            return tmp_path / "file", *_target(), r"file is not a directory"
        if name == "nonexistent":
            return tmp_path / "nope", *_target(), r"nope does not exist"
        if name == "too_many_rows":  # passes every check; the table cannot hold the rows: rolled back
            model, opt = _target()
            model.emb["user"] = veloce.DynamicEmbedding(8, mode="sum", optimizer=Adam(lr=0.01), max_capacity=32)
            opt = CombinedOptimizer(opt.dense, model)
            return path, model, opt, r"table 'emb.user': cannot hold the checkpoint's \d+ rows"
        raise AssertionError(name)

    return corrupt


REFUSALS = [
    "uncommitted", "truncated", "bit_flip_dense", "bit_flip_tables", "manifest_edited", "format_version",
    "missing_file", "dim", "state_width", "table_not_in_checkpoint", "table_not_in_model", "dense_shape",
    "dense_optimizer_class", "no_optimizer_saved", "empty_dir", "a_file", "nonexistent", "too_many_rows",
]  # fmt: skip


@pytest.mark.parametrize("name", REFUSALS)
def test_refusal_names_the_problem_and_changes_nothing(name, saved, tmp_path):
    path, model, opt, message = _case(name)(saved, tmp_path)
    before = state(model, opt)
    with pytest.raises(CheckpointError, match=message):
        ckpt.load(path, model, opt)
    assert_same(before, state(model, opt))


def test_a_rolled_back_model_trains_like_one_never_loaded_into(saved):
    path, model, opt, _ = _case("too_many_rows")(saved, None)
    twin = copy.deepcopy(model)
    twin_opt = CombinedOptimizer(torch.optim.Adam(twin.mlp.parameters(), lr=1e-2), twin)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    with pytest.raises(CheckpointError):
        ckpt.load(path, model, opt)  # emb.item is loaded, then emb.user fails: both roll back
    data = batches(2, seed=5)
    train(model, opt, data)
    train(twin, twin_opt, data)
    assert_same(state(twin, twin_opt), state(model, opt))


def test_save_refuses_to_overwrite_unless_asked(trained, tmp_path):
    model, opt = trained
    path = ckpt.save(tmp_path / "c", model, opt, step=1)
    with pytest.raises(CheckpointError, match=r"already holds a committed checkpoint; pass overwrite=True"):
        ckpt.save(path, model, opt, step=2)
    assert json.loads((path / "manifest.json").read_text())["step"] == 1
    ckpt.save(path, model, opt, step=2, overwrite=True)
    other, other_opt = make(seed=1)
    assert ckpt.load(path, other, other_opt)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the replaced one is gone


def test_save_refuses_tables_with_gradients_in_flight(trained, tmp_path):
    model, opt = trained
    model.emb["item"].backend = SimpleNamespace(in_flight=1, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match=r"\['emb.item'\] have sparse gradients in flight .* call model.flush\(\)"):
        ckpt.save(tmp_path / "c", model, opt)
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_extra_that_is_not_json(trained, tmp_path):
    with pytest.raises(CheckpointError, match="extra must be JSON-serialisable"):
        ckpt.save(tmp_path / "c", trained[0], extra={"t": torch.ones(1)})
    assert not (tmp_path / "c").exists()


# ---- latest / save_in ---------------------------------------------------------------------------
def test_latest_is_the_newest_committed_checkpoint(trained, tmp_path):
    model, opt = trained
    assert ckpt.latest(tmp_path / "none") is None and ckpt.latest(tmp_path) is None
    one = ckpt.save_in(tmp_path, model, opt, step=1)
    two = ckpt.save_in(tmp_path, model, opt, step=2)
    partial = ckpt.save(tmp_path / "step_000000003", model, opt, step=3)
    (partial / "COMMITTED").unlink()
    (tmp_path / ".step_000000004.tmp-0123abcd").mkdir()
    (tmp_path / "step_000000005").write_text("a file, not a checkpoint")
    assert ckpt.latest(tmp_path) == two
    (two / "COMMITTED").write_text("{")  # a torn marker is no marker
    assert ckpt.latest(tmp_path) == one


def test_save_in_keeps_the_last_and_removes_debris(trained, tmp_path):
    model, opt = trained
    for step in (1, 2, 3):
        ckpt.save_in(tmp_path, model, opt, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002", "step_000000003"]
    debris = [tmp_path / ".step_000000009.tmp-00ff", tmp_path / ".step_000000003.old-0a", tmp_path / "step_000000007"]
    for d in debris:
        d.mkdir()
        (d / "tables.rank00000.safetensors").write_bytes(b"partial")
    keep = tmp_path / "notes"
    keep.mkdir()
    path = ckpt.save_in(tmp_path, model, opt, step=8, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_000000003", "step_000000008"]
    assert ckpt.latest(tmp_path) == path
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.save_in(tmp_path, model, opt, step=9, keep_last=0)


# ---- crash consistency --------------------------------------------------------------------------
def _fork(target, *args) -> mp.Process:
    p = mp.get_context("fork").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _save_and_die_at(k: int, directory: Path, model, opt) -> None:
    """Child: save_in(step 2), exiting abruptly at the k-th durability point (fsync)."""
    torch.set_num_threads(1)
    calls = [0]
    fsync = checkpoint_files.fsync

    def dying_fsync(path):
        calls[0] += 1
        if calls[0] == k:
            os._exit(17)
        fsync(path)

    checkpoint_files.fsync = dying_fsync
    ckpt.save_in(directory, model, opt, step=2)
    os._exit(0)


def _check_after_crash(directory: Path, states: dict) -> Path:
    """The newest committed checkpoint loads and equals what was saved; a newer step
    directory (the interrupted one) is refused. Returns the newest committed one."""
    last = ckpt.latest(directory)
    assert last is not None
    model, opt = make(seed=9)
    ckpt.load(last, model, opt)
    assert_same(states[last.name], state(model, opt))
    for p in directory.glob("step_*"):
        if p.name > last.name:
            with pytest.raises(CheckpointError, match="not committed"):
                ckpt.load(p, *make(seed=9))
    return last


def test_a_writer_dying_at_any_durability_point_leaves_the_previous_checkpoint(trained, tmp_path, monkeypatch):
    model, opt = trained
    synced = []
    fsync = checkpoint_files.fsync
    monkeypatch.setattr(checkpoint_files, "fsync", lambda p: (synced.append(Path(p)), fsync(p)))
    ckpt.save(tmp_path / "probe", model, opt)
    monkeypatch.undo()
    names = ["<parent>" if p == tmp_path else "<tmp>" if p.name.startswith(".probe.tmp-") else p.name for p in synced]
    assert names == [  # the protocol: files, manifest, their directory, the rename, the marker last
        "tables.rank00000.safetensors", "dense.safetensors", "manifest.json", "<tmp>", "<parent>",
        "COMMITTED.tmp", "probe", "<parent>",
    ]  # fmt: skip
    first = ckpt.save_in(tmp_path / "run", model, opt, step=1)
    states = {first.name: state(model, opt)}
    train(model, opt, batches(1, seed=4))
    states["step_000000002"] = state(model, opt)
    outcomes = set()
    for k in range(1, len(synced) + 1):
        p = _fork(_save_and_die_at, k, tmp_path / "run", model, opt)
        p.join(60)
        assert p.exitcode == 17, f"fsync #{k}: the child exited with {p.exitcode}"
        outcomes.add(_check_after_crash(tmp_path / "run", states).name)
        if ckpt.latest(tmp_path / "run").name == "step_000000002":  # died after the commit point
            shutil.rmtree(tmp_path / "run" / "step_000000002")
    assert outcomes == {"step_000000001", "step_000000002"}  # before / after the marker
    ckpt.save_in(tmp_path / "run", model, opt, step=2)
    assert ckpt.latest(tmp_path / "run").name == "step_000000002"


def _save_forever(directory: Path, model) -> None:
    """Child: saves a large table again and again, until killed."""
    torch.set_num_threads(1)
    step = int(ckpt.latest(directory).name[len("step_"):]) + 1
    while True:
        ckpt.save_in(directory, model, step=step, keep_last=2)
        step += 1


def test_sigkill_at_random_times_leaves_a_loadable_checkpoint(tmp_path):
    torch.manual_seed(0)
    big = nn.ModuleDict({"t": veloce.DynamicEmbedding(16, mode="sum", capacity=1 << 18)})
    n = 150_000
    big["t"].table.load_entries(_random_entries(n, 16, 16, seed=0))
    ckpt.save_in(tmp_path, big, step=1)
    expected = table_state(big["t"])
    rng, steps = random.Random(0), [1]
    for trial in range(4):
        p = _fork(_save_forever, tmp_path, big)
        time.sleep(rng.uniform(0.05, 1.5))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        last = ckpt.latest(tmp_path)
        steps.append(int(last.name[len("step_"):]))
        assert last is not None, f"trial {trial}: no committed checkpoint left"
        other = nn.ModuleDict({"t": veloce.DynamicEmbedding(16, mode="sum")})
        ckpt.load(last, other)
        assert_same(expected, table_state(other["t"]), f"trial {trial}: {last.name}")
        for d in tmp_path.glob("step_*"):
            if d.name > last.name:
                with pytest.raises(CheckpointError, match="not committed"):
                    ckpt.load(d, other)
    assert steps[-1] > 1 and steps == sorted(steps), f"no progress was committed: {steps}"


def _random_entries(n: int, dim: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=g).unique()
    m = keys.numel()
    return {
        "keys": keys[torch.randperm(m, generator=g)],
        "weights": torch.randn(m, dim, generator=g),
        "optimizer_state": torch.rand(m, width, generator=g),
        "scores": torch.randint(0, 1000, (m,), generator=g),
    }


# ---- W ranks write, W' ranks load (gloo) ---------------------------------------------------------
N_USER, N_ITEM = 3000, 500


def _sharded_model(rank: int, world: int, fill: bool) -> tuple[nn.Module, Net]:
    """(model, net): ``net`` under ``HybridParallel`` on ``world`` > 1 ranks, with ``user``
    sharded and ``item`` a replica; with ``fill`` the tables hold the reference entries
    (``user``: this rank's share)."""
    torch.manual_seed(0)
    net = Net()
    model = HybridParallel(net, dense="none") if world > 1 else net
    net.emb["item"].backend = veloce.sparse.LocalBackend()  # a replica on every rank, as after HybridParallel.unwrap()
    assert table_shard(net.emb["user"]) == (rank, world)
    if fill:
        user = _random_entries(N_USER, 8, 16, seed=1)
        mine = owner_of(user["keys"], world) == rank
        net.emb["user"].table.load_entries({k: v[mine] for k, v in user.items()})
        net.emb["item"].table.load_entries(_random_entries(N_ITEM, 8, 8, seed=2))
        net.emb["user"].step_count, net.emb["user"].table.clock = 5, 10 + rank
        net.emb["item"].step_count, net.emb["item"].table.clock = 7, 20
    return model, net


def _load_rank(rank: int, world: int, path: str) -> dict:
    model, net = _sharded_model(rank, world, fill=False)
    info = ckpt.load(path, model, CombinedOptimizer(torch.optim.Adam(net.mlp.parameters()), model))
    return {"info": info, **{n: table_state(net.emb[n]) for n in ("user", "item")}}


def _write_rank(rank: int, world: int, path: str) -> dict:
    model, net = _sharded_model(rank, world, fill=True)
    opt = CombinedOptimizer(torch.optim.Adam(net.mlp.parameters()), model)
    ckpt.save(path, model, opt, step=11, extra={"writer": world})
    return _load_rank(rank, world, path)  # W -> W on the same ranks


def _check_sharded_load(results: list, world: int, written_by: int) -> None:
    user, item = _random_entries(N_USER, 8, 16, seed=1), _random_entries(N_ITEM, 8, 8, seed=2)
    for rank, r in enumerate(results):
        assert r["info"] == {"step": 11, "extra": {"writer": written_by}, "world_size": written_by, "format_version": 1}
        assert (owner_of(r["user"]["keys"], world) == rank).all(), f"rank {rank} holds keys it does not own"
        assert_same(table_state_of(item, step=7, clock=20), r["item"], f"rank {rank} item")
        same = world == written_by
        assert (r["user"]["step"], r["user"]["clock"]) == (5, 10 + rank if same else 10 + written_by - 1)
    union = {k: torch.cat([r["user"][k] for r in results]) for k in ENTRIES}
    assert union["keys"].unique().numel() == union["keys"].numel(), "a key has more than one owner"
    order = union["keys"].argsort()
    expected = table_state_of(user, step=None, clock=None)
    assert_same({k: expected[k] for k in ENTRIES}, {k: union[k][order] for k in ENTRIES}, "union of user shards")


def table_state_of(entries: dict, step, clock) -> dict:
    order = entries["keys"].argsort()
    return {**{k: entries[k][order] for k in ENTRIES}, "step": step, "clock": clock}


def test_written_by_two_ranks_loads_on_one_two_and_three(tmp_path):
    path = str(tmp_path / "c")
    _check_sharded_load(run_ranks(_write_rank, 2, path, timeout=60), world=2, written_by=2)
    desc = ckpt.describe(path)
    assert desc["world_size"] == 2
    assert {t["name"]: (t["rows"], t["shards"]) for t in desc["tables"]} == {
        "emb.user": (N_USER, 2), "emb.item": (N_ITEM, 1),
    }  # fmt: skip
    _check_sharded_load([_load_rank(0, 1, path)], world=1, written_by=2)
    _check_sharded_load(run_ranks(_load_rank, 3, path, timeout=60), world=3, written_by=2)


def test_written_by_one_process_loads_on_two_ranks(tmp_path):
    path = str(tmp_path / "c")
    model, _ = _sharded_model(0, 1, fill=True)
    ckpt.save(path, model, CombinedOptimizer(torch.optim.Adam(model.mlp.parameters()), model), step=11,
              extra={"writer": 1})  # fmt: skip
    _check_sharded_load(run_ranks(_load_rank, 2, path, timeout=60), world=2, written_by=1)


def _train_and_save(rank: int, world: int, path: str) -> None:
    """3 steps of HybridParallel (sync) training on this rank's half of each batch, saved."""
    torch.manual_seed(0)
    net = Net()
    model = HybridParallel(net, sparse="sync")
    opt = CombinedOptimizer(torch.optim.Adam(net.mlp.parameters(), lr=1e-2), model)
    train(model, opt, [(ids[rank::world], y[rank::world]) for ids, y in batches(3, seed=2)])
    ckpt.save(path, model, opt, step=3)


def test_sharded_training_resumed_in_one_process_equals_the_uninterrupted_run(tmp_path):
    data = batches(8, seed=2)
    ref, ref_opt = make(seed=0)
    train(ref, ref_opt, data)
    run_ranks(_train_and_save, 2, str(tmp_path / "c"), timeout=60)
    resumed, resumed_opt = make(seed=5)
    ckpt.load(tmp_path / "c", resumed, resumed_opt)
    train(resumed, resumed_opt, data[3:])
    assert_same(state(ref, ref_opt), state(resumed, resumed_opt), close=True)


def _resume_on_ranks(rank: int, world: int, path: str) -> dict:
    """Loads the 2-rank checkpoint on ``world`` ranks and trains the 5 remaining steps,
    each rank on its share of every batch (loss scaled so DDP's mean is the global mean)."""
    torch.manual_seed(5)  # another init: everything must come from the checkpoint
    net = Net()
    model = HybridParallel(net, sparse="sync")
    opt = CombinedOptimizer(torch.optim.Adam(net.mlp.parameters(), lr=1e-2), model)
    ckpt.load(path, model, opt)
    for ids, y in batches(8, seed=2)[3:]:
        out = model(ids[rank::world])
        loss = F.binary_cross_entropy_with_logits(out, y[rank::world], reduction="sum") * world / y.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"tables": {n: table_state(net.emb[n]) for n in ("user", "item")},
            "mlp": {k: v.clone() for k, v in net.mlp.state_dict().items()}}  # fmt: skip


def test_sharded_training_resumed_on_three_ranks_equals_the_uninterrupted_run(tmp_path):
    """Written by 2 ranks after 3 steps, loaded by 3: the 5 more steps end where one process
    training all 8 steps on the whole batches ends (keys re-routed to their new owners)."""
    ref, ref_opt = make(seed=0)
    train(ref, ref_opt, batches(8, seed=2))
    run_ranks(_train_and_save, 2, str(tmp_path / "c"), timeout=60)
    results = run_ranks(_resume_on_ranks, 3, str(tmp_path / "c"), timeout=90)
    for name in ("user", "item"):
        want = table_state(ref.emb[name])
        parts = [r["tables"][name] for r in results]
        keys = torch.cat([p["keys"] for p in parts])
        order = keys.argsort()
        got = {k: torch.cat([p[k] for p in parts])[order] for k in ENTRIES}
        assert_same({k: want[k] for k in ENTRIES}, got, f"table {name}", close=True)
        assert all((p["step"], p["clock"]) == (want["step"], want["clock"]) for p in parts), name
    for r in results:
        assert_same({k: v for k, v in ref.mlp.state_dict().items()}, r["mlp"], "mlp", close=True)


def _die_holding_the_bar_lock() -> None:
    """Child: killed while it holds the progress bars' write lock (as a checkpoint writer
    can be, mid-bar)."""
    from veloce.runtime.progress import Bar

    Bar.get_lock().acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_forked_process_killed_mid_bar_leaves_the_parents_bars_working():
    """tqdm's default lock is shared with forked processes: a child SIGKILLed while holding
    it left every later bar of the parent (even a disabled one) waiting forever, which hung
    test_sigkill_at_random_times_leaves_a_loadable_checkpoint once in CI. veloce's bars
    (checkpoint progress, the Trainer's) lock within their process only."""
    from veloce.checkpoint.files import progress
    from veloce.runtime.progress import Bar

    list(Bar(range(3), disable=True))  # the lock exists before the fork, as in a training process
    p = _fork(_die_holding_the_bar_lock)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    done = threading.Event()

    def bars():
        list(progress(range(5), rows=1, desc="rows"))
        list(Bar(range(5), disable=True))
        done.set()

    threading.Thread(target=bars, daemon=True).start()
    assert done.wait(30), "a progress bar waited for a lock a killed child holds"
