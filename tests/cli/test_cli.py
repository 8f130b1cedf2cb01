"""The veloce command (train, evaluate, inspect) and its config validation."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from veloce import checkpoint, cli
from veloce.cli import commands, launch
from veloce.cli import run as cli_run
from veloce.data import DataError
from veloce.train import build
from veloce.train.config import Config, ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "data": {"samples": 1024, "val_samples": 512, "batch_size": 128, "val_batch_size": 512, "num_dense": 4,
             "num_sparse": 4, "id_space": 500},
    "tables": {"capacity": 256},
    "optimizer": {"dense": {"lr": 0.01}},
    "trainer": {"max_epochs": 2, "checkpoint_every": 4, "log_every": 4, "progress": False},
}  # fmt: skip


def write_config(tmp_path: Path, raw: dict) -> str:
    raw = json.loads(json.dumps(raw))
    raw["trainer"]["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_train_whose_validation_metric_is_nan_exits_1_naming_it(tmp_path, capsys):
    """A validation split of one sample has no AUC: ``veloce train`` prints one line naming
    the metric and why, and exits 1, instead of reporting NaN and exiting 0."""
    config = write_config(tmp_path, TINY)
    assert cli.main(["train", config, "--set", "data.val_samples=1", "--set", "trainer.max_epochs=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("veloce train: Trainer.evaluate: metric 'auc' computed to NaN over the 1 evaluation samples")
    assert "AUC is undefined when all 1 targets are" in err and err.count("\n") == 1


def test_train_evaluate_inspect(tmp_path, capsys):
    config = write_config(tmp_path, TINY)
    assert cli.main(["train", config]) == 0
    out = capsys.readouterr().out
    assert re.search(r"epoch 1: auc 0\.\d+, logloss", out)
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["step"] for r in summary["history"]] == [8, 16]
    assert (tmp_path / "run" / "log.jsonl").read_text().count('"event": "step"') == 4
    latest = checkpoint.latest(tmp_path / "run" / "checkpoints")
    assert latest is not None and checkpoint.describe(latest)["step"] == 16

    # evaluate: loads the checkpoint into a fresh model; same data, same AUC as the last epoch
    assert cli.main(["evaluate", config, "--checkpoint", str(tmp_path / "run" / "checkpoints")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 16 and result["auc"] == pytest.approx(summary["history"][-1]["val_auc"], abs=1e-12)

    assert cli.main(["inspect", str(latest)]) == 0
    text = capsys.readouterr().out
    assert "step: 16" in text and re.search(r"embeddings\.sparse_3\s+\d+\s+4", text)
    assert cli.main(["inspect", str(latest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in info["tables"]] == [f"embeddings.sparse_{i}" for i in range(4)]
    assert all(t["rows"] > 0 for t in info["tables"])


def test_train_resumes_and_set_overrides(tmp_path, capsys):
    config = write_config(tmp_path, TINY)
    assert cli.main(["train", config, "--set", "trainer.max_epochs=1"]) == 0
    assert cli.main(["train", config, "--set", "trainer.max_epochs=2"]) == 0  # resumes: trains epoch 1 only
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    assert [r["epoch"] for r in history] == [0, 1] and history[1]["step"] == 16


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.sparse.lr=-1", "config error: optimizer.sparse.lr must be a positive number, got -1"),
        ("trainer.max_epoch=2", "config error: unknown field trainer.max_epoch (did you mean max_epochs?)"),
        ("model.name=resnet", "config error: model.name must be one of dlrm, deepfm, got 'resnet'"),
        ("model.bottom_mlp=[8,8]", "config error: model.bottom_mlp must be a list ending with embedding_dim (4)"),
        ("model.top_mlp=[8,x]", "config error: model.top_mlp must be a list of integers, got [8, 'x']"),
        ("data.kind=criteo", "config error: data.path must be the Criteo TSV file when kind is criteo, got None"),
        ("data.batch_size=big", "config error: data.batch_size must be an integer, got 'big'"),
        ("trainer.precision=fp8", "config error: trainer.precision must be one of fp32, bf16, got 'fp8'"),
        ("tables=5", "config error: tables must be a section (a mapping of fields), got 5"),
        ("tables.max_capacity=16", "config error: tables.max_capacity must be null or >= capacity (256), got 16"),
        ("strategy.sparse=eventually", "config error: strategy.sparse must be one of sync, async"),
        ("strategy.exchange_dtype=int8", "config error: strategy.exchange_dtype must be one of table, bfloat16, float16"),
        ("trainer.progress=1", "config error: trainer.progress must be true or false, got 1"),
        ("trainer.clip_grad_norm=-1", "config error: trainer.clip_grad_norm must be a positive number, got -1"),
        ("trainer", "config error: --set needs key.sub=value, got 'trainer'"),
        ("colour=red", "config error: unknown field colour; known fields: model, data,"),
    ],
)
def test_config_errors_name_the_field(tmp_path, capsys, override, message):
    config = write_config(tmp_path, TINY)
    with pytest.raises(ConfigError) as info:
        load_config(config, [override])
    assert str(info.value).startswith(message)
    assert cli.main(["train", config, "--set", override]) == 2  # the command prints it and exits 2
    assert message in capsys.readouterr().err


def test_config_clip_grad_norm_reaches_the_trainer(tmp_path):
    cfg = load_config(write_config(tmp_path, TINY), ["trainer.clip_grad_norm=0.5"])
    model = build.build_model(cfg, torch.device("cpu"))
    assert build.build_trainer(cfg, model, checkpoints=False).clip_grad_norm == 0.5


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    assert parse_config({}) == Config()
    assert load_config(write_config(tmp_path, TINY), ["optimizer.dense.lr=1e-3"]).optimizer.dense.lr == 1e-3


def test_shipped_configs_load_and_every_field_is_documented():
    for name in ("dlrm_synthetic", "dlrm_criteo"):
        load_config(ROOT / "configs" / f"{name}.yaml")
    doc = (ROOT / "docs" / "config.md").read_text()
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    assert all(f"## `{s}`" in doc for s in sections)

    def documented(cls) -> None:
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                documented(f.default_factory)
            else:
                assert f"| `{f.name}` |" in doc, f"{cls.__name__}.{f.name} is not in docs/config.md"

    for f in dataclasses.fields(Config):
        documented(f.default_factory)


def test_inspect_verify_checks_every_sha256(tmp_path, capsys):
    import torch

    from veloce.models import DLRM

    model = DLRM(4, 2, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1))
    model(torch.randn(3, 4), torch.tensor([[1, 2], [3, 4], [5, 6]]))
    path = checkpoint.save_in(tmp_path, model, step=1)
    assert cli.main(["inspect", str(path), "--verify"]) == 0
    assert capsys.readouterr().out.count("sha256 ok") == len(checkpoint.describe(path)["files"])
    victim = path / "dense.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # the same size, another sha256
    victim.write_bytes(bytes(data))
    assert cli.main(["inspect", str(path)]) == 0  # without --verify only sizes are compared
    assert cli.main(["inspect", str(path), "--verify"]) == 1
    out, err = capsys.readouterr()
    assert "dense.safetensors" in err and "sha256 MISMATCH" in out


def test_an_empty_section_takes_every_default():
    cfg = parse_config(yaml.safe_load("model:\ntrainer:\n  # max_epochs: 3\n"))
    assert cfg.trainer == Config().trainer and cfg.model == Config().model


def test_a_cuda_device_without_cuda_is_a_config_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    raw = json.loads(json.dumps(TINY))
    raw["trainer"]["device"] = "cuda"
    assert cli.main(["train", write_config(tmp_path, raw)]) == 2
    assert "trainer.device is 'cuda' but torch sees no CUDA device" in capsys.readouterr().err


def test_inspect_refuses_a_directory_without_a_checkpoint(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert "checkpoint error" in capsys.readouterr().err


def test_strategy_reaches_hybrid_parallel(tmp_path, monkeypatch):
    """The config's strategy section is what the Trainer hands HybridParallel on several
    ranks (every field, exchange_dtype included)."""
    import torch

    seen = {}
    monkeypatch.setattr(build, "Trainer", lambda model, **kw: seen.update(kw["strategy"]))
    cfg = load_config(write_config(tmp_path, TINY), ["strategy.exchange_dtype=bfloat16", "strategy.sparse=async"])
    build.build_trainer(cfg, build.build_model(cfg, torch.device("cpu")), checkpoints=False)
    assert seen == {"sparse": "async", "staleness": 1, "dense": "ddp", "lookup_errors": "raise",
                    "exchange_dtype": "bfloat16"}  # fmt: skip


def test_tables_defer_inserts_reaches_every_table_and_trains_alike(tmp_path, capsys):
    """tables.defer_inserts=true: every DynamicEmbedding defers its training inserts, and
    training ends where it ends without (the CPU op is the same; only when counts are read
    differs)."""
    import torch

    from veloce import DynamicEmbedding

    cfg = load_config(write_config(tmp_path, TINY), ["tables.defer_inserts=true"])
    tables = [m for m in build.build_model(cfg, torch.device("cpu")).modules() if isinstance(m, DynamicEmbedding)]
    assert len(tables) == 4 and all(t.defer_inserts for t in tables)
    history = []
    for defer in ("false", "true"):
        path = tmp_path / defer
        path.mkdir()
        assert cli.main(["train", write_config(path, TINY), "--set", f"tables.defer_inserts={defer}"]) == 0
        timeless = ("seconds", "samples_per_s")
        history.append([{k: v for k, v in r.items() if k not in timeless}
                        for r in json.loads((path / "run" / "metrics.json").read_text())["history"]])  # fmt: skip
    capsys.readouterr()
    assert history[0] == history[1] and len(history[0]) == 2


# ---- run handling ------------------------------------------------------------------------
def _history(run: Path) -> list[dict]:
    drop = ("seconds", "samples_per_s")
    records = json.loads((run / "metrics.json").read_text())["history"]
    return [{k: v for k, v in r.items() if k not in drop} for r in records]


def test_rerunning_a_finished_run_refuses_and_says_what_to_do(tmp_path, capsys):
    config = write_config(tmp_path, TINY)
    assert cli.main(["train", config]) == 0
    capsys.readouterr()
    assert cli.main(["train", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"veloce train: run dir {tmp_path / 'run'} already holds a finished run (epoch 2 of 2 done, step 16" in err
    assert "--set trainer.max_epochs=3" in err and "--overwrite" in err
    assert cli.main(["train", config, "--set", "trainer.max_epochs=3"]) == 0  # trains one more epoch
    assert [r["step"] for r in _history(tmp_path / "run")] == [8, 16, 24]
    assert cli.main(["train", config, "--overwrite"]) == 0  # from scratch: 2 epochs again
    assert [r["step"] for r in _history(tmp_path / "run")] == [8, 16]
    assert checkpoint.describe(checkpoint.latest(tmp_path / "run" / "checkpoints"))["step"] == 16


def test_resume_from_an_older_checkpoint_when_the_newest_is_damaged(tmp_path, capsys):
    config = write_config(tmp_path, TINY)
    assert cli.main(["train", config]) == 0
    reference = _history(tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    assert cli.main(["train", config, "--overwrite", "--set", "trainer.max_steps=13"]) == 0  # steps 8, 12, 13
    newest = checkpoint.latest(ckpts)
    assert newest.name == "step_000000013"
    damaged = newest / "dense.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8] + bytes(8))
    capsys.readouterr()
    assert cli.main(["train", config]) == 1
    assert "checkpoint error" in capsys.readouterr().err
    assert cli.main(["train", config, "--resume-from", str(ckpts / "step_000000012")]) == 0
    assert _history(tmp_path / "run") == reference  # the damaged step 13 was replaced on the way
    assert cli.main(["train", config, "--resume-from", str(tmp_path / "nothing")]) == 1


def _criteo_lines(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return ["\t".join([str(rng.randint(0, 1))] + [str(rng.randint(0, 50)) for _ in range(13)]
                      + [f"{rng.randrange(40):08x}" for _ in range(26)]) for _ in range(n)]  # fmt: skip


def _criteo_config(tmp_path: Path, text: str, **data) -> str:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "day.tsv").write_text(text)
    raw = {**TINY, "data": {"kind": "criteo", "path": "data/day.tsv", "batch_size": 64, "val_batch_size": 64, **data}}
    raw["trainer"] = {**TINY["trainer"], "max_epochs": 1}
    return write_config(tmp_path, raw)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_truncated_criteo_file_prints_one_line_naming_file_and_line(tmp_path, capsys, num_workers):
    lines = _criteo_lines(300)
    config = _criteo_config(tmp_path, "\n".join(lines[:250] + [lines[250][:60]] + lines[251:]) + "\n",
                            num_workers=num_workers)  # fmt: skip
    assert cli.main(["train", config]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"data error: {tmp_path / 'data' / 'day.tsv'}:251: ") and "fields, expected 40" in err
    with pytest.raises(DataError):  # --traceback shows the error itself
        cli.main(["train", config, "--traceback"])


def test_config_data_path_is_relative_to_the_config_file_and_set_paths_to_the_cwd(tmp_path, monkeypatch, capsys):
    config = _criteo_config(tmp_path, "\n".join(_criteo_lines(300)) + "\n")
    monkeypatch.chdir(tmp_path / "data")  # anywhere but the config's folder
    assert load_config(config).data.path == str(tmp_path / "data" / "day.tsv")
    assert load_config(config, ["data.path=day.tsv"]).data.path == str(tmp_path / "data" / "day.tsv")
    assert load_config(config, ["data.path=../x.tsv"]).data.path == str(tmp_path / "x.tsv")
    assert cli.main(["train", config]) == 0


def test_criteo_progress_bar_has_a_total(tmp_path):
    config = _criteo_config(tmp_path, "\n".join(_criteo_lines(300)) + "\n", val_fraction=0.2)
    train_loader, val_loader = build.build_loaders(load_config(config))
    assert len(train_loader) == 4 == len(list(train_loader)) and len(val_loader) == 1  # 240 and 60 rows
    t = build.build_trainer(load_config(config), build.build_model(load_config(config), torch.device("cpu")),
                          checkpoints=False)  # fmt: skip
    t.fit(train_loader)
    assert t.steps_per_epoch() == 4


def test_process_group_timeout_is_passed_to_init_process_group(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def init(backend, **kwargs):
        seen.append(kwargs["timeout"])
        raise Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for timeout, want in ((None, cli_run.DEFAULT_TIMEOUT), (45.0, 45.0)):
        with pytest.raises(Stop), cli_run.process_group(torch.device("cpu"), timeout):
            pass
        assert seen[-1].total_seconds() == want
    args = commands.parser().parse_args(["train", "c.yaml", "--launcher", "torchrun", "--workers", "2", "--timeout", "45",
                                     "--resume-from", "ck", "--overwrite"])  # fmt: skip
    with pytest.raises(launch.LauncherError, match="--overwrite starts the run from scratch"):
        launch.check_arguments(args)
    args.overwrite = False
    assert launch.torchrun_command(args)[-2:] == ["--resume-from=ck", "--timeout=45"]
    args.timeout = 0
    with pytest.raises(launch.LauncherError, match="--timeout must be a number of seconds > 0, got 0"):
        launch.check_arguments(args)


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    config = write_config(tmp_path, {**TINY, "trainer": {**TINY["trainer"], "max_epochs": 1}})
    assert cli.main(["train", config]) == 0
    latest = checkpoint.latest(tmp_path / "run" / "checkpoints")
    read, write = os.pipe()
    os.close(read)  # `| head` that has exited already: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "veloce.cli", "inspect", str(latest)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141


def test_ctrl_c_during_veloce_train_checkpoints_and_the_rerun_ends_like_an_uninterrupted_run(tmp_path):
    raw = {**TINY, "data": {**TINY["data"], "samples": 6400, "batch_size": 64},  # 100 steps
           "trainer": {**TINY["trainer"], "max_epochs": 1, "checkpoint_every": None, "log_every": 5, "device": "cpu"}}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("ref", "run"):
        (tmp_path / name).mkdir()
    ref, run = write_config(tmp_path / "ref", raw), write_config(tmp_path / "run", raw)
    assert cli.main(["train", ref]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "veloce.cli", "train", run], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    log = tmp_path / "run" / "run" / "log.jsonl"
    deadline = time.monotonic() + 120
    while not (log.is_file() and '"event": "step"' in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    match = re.search(r"veloce train: interrupted at step (\d+) \(epoch 0\); checkpoint (\S+); run the same", err)
    assert match and "Traceback" not in err, err
    step = int(match.group(1))
    assert 5 <= step < 100 and checkpoint.describe(match.group(2))["step"] == step  # mid-epoch, not at its end
    assert cli.main(["train", run]) == 0
    assert _history(tmp_path / "run" / "run") == _history(tmp_path / "ref" / "run")


def test_ctrl_c_under_launcher_torchrun_is_left_to_torchrun(tmp_path, monkeypatch):
    class _Torchrun:  # gets the terminal's Ctrl-C like the launcher, and ends after its ranks saved
        def __init__(self, cmd, env):
            self.cmd = cmd

        def wait(self):
            os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C reaches the launcher while it waits
            return 130

    monkeypatch.setattr(subprocess, "Popen", _Torchrun)
    config = write_config(tmp_path, TINY)
    assert cli.main(["train", config, "--launcher", "torchrun", "--workers", "2"]) == 130  # not killed by it
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
