"""Launchers (veloce/cli/launch.py, veloce/cli/ray.py): ``veloce train --launcher torchrun`` on 2
CPU ranks, the same job on 2 Ray Train workers of a local Ray cluster, kill-and-resume
under torchrun (``--max-restarts=1``) and Ray (``max_failures=1``), and the option errors.

Every job is the SMALL config of ``tests/_jobs.py`` (DLRM, 2 ranks, 16 steps, checkpoints
every 6 steps); each is compared with the uninterrupted torchrun job: tables (sorted by
key) and predictions of the final checkpoint within 1e-5, and the validation history.
Every multi-process run has a timeout that names the ranks still running.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import pytest
import torch

import veloce
from _jobs import ROOT, KillOnce, StepLog, last_steps, run_command, starts, write_config
from veloce import checkpoint, cli
from veloce.cli import commands, launch
from veloce.train import build
from veloce.train.config import load_config

TIMEOUT = 120.0  # seconds per job (a Ray job with a restart starts two worker groups)
FINAL_STEP = 16
KILL_STEP = 7  # rank 1 dies after step 7; the last checkpoint before it is step 6
HEALTH_CHECK_S = 0.5  # how often the Ray Train controller polls its workers (and collects reports)


# ---- the reference: torchrun through the CLI, 2 ranks, uninterrupted ------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The SMALL job on 2 ranks through ``veloce train --launcher torchrun --workers 2``."""
    run_dir = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "veloce.cli", "train", write_config(run_dir), "--launcher", "torchrun",
           "--workers", "2"]  # fmt: skip
    done = run_command(cmd, TIMEOUT, cwd=ROOT)
    assert done.returncode == 0, done.stdout
    return {"state": final_state(run_dir), "output": done.stdout, "run_dir": run_dir}


def final_state(run_dir: Path) -> dict:
    """The newest checkpoint of a SMALL run, loaded in one process: step, tables sorted by key,
    predictions on the validation data, and the run's history (metrics.json)."""
    cfg = load_config(run_dir / "config.yaml")
    path = checkpoint.latest(cfg.trainer.checkpoints())
    assert path is not None, f"no checkpoint in {cfg.trainer.checkpoints()}"
    model = build.build_model(cfg, torch.device("cpu"))
    step = checkpoint.load(path, model)["step"]
    tables = {}
    for name, m in model.named_modules():
        if isinstance(m, veloce.DynamicEmbedding):
            e = m.export()
            order = e["keys"].argsort()
            tables[name] = {k: e[k][order] for k in ("keys", "weights", "optimizer_state")}
    model.eval()
    _, val = build.build_loaders(cfg)
    with torch.no_grad():
        preds = torch.cat([model(*inputs).reshape(-1) for inputs, _ in val])
    history = json.loads((run_dir / "metrics.json").read_text())["history"]
    return {"step": step, "world_size": checkpoint.describe(path)["world_size"], "tables": tables,
            "preds": preds, "history": history}  # fmt: skip


def assert_same_state(got: dict, want: dict) -> None:
    assert (got["step"], got["world_size"]) == (want["step"], want["world_size"]) == (FINAL_STEP, 2)
    assert got["tables"].keys() == want["tables"].keys() and len(want["tables"]) == 5
    for name, table in want["tables"].items():
        assert torch.equal(got["tables"][name]["keys"], table["keys"]), name
        for k in ("weights", "optimizer_state"):
            torch.testing.assert_close(
                got["tables"][name][k], table[k], rtol=1e-5, atol=1e-5, msg=f"{name}.{k}"
            )
    torch.testing.assert_close(got["preds"], want["preds"], rtol=1e-5, atol=1e-5)
    fields = ("epoch", "step", "samples", "val_auc", "val_logloss")
    assert len(got["history"]) == len(want["history"]) == 2
    for record, expected in zip(got["history"], want["history"]):
        assert {k: record[k] for k in fields} == pytest.approx({k: expected[k] for k in fields}, abs=1e-6)


def test_torchrun_launcher_runs_two_ranks(reference):
    """The CLI prints the torchrun command it runs; the job trains 2 epochs on 2 ranks."""
    assert "veloce: running " in reference["output"]
    assert (
        "-m torch.distributed.run --nproc-per-node=2 --standalone -m veloce.cli train" in reference["output"]
    )
    summary = json.loads((reference["run_dir"] / "metrics.json").read_text())
    assert summary["world_size"] == 2 and [r["step"] for r in summary["history"]] == [8, FINAL_STEP]
    assert summary["history"][-1]["val_auc"] > 0.55  # it learns (a model that learns nothing: 0.5)


def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(reference, tmp_path):
    """TESTING.md kill-and-resume: torchrun --max-restarts=1, rank 1 killed after step 7; the
    restarted ranks resume from the step-6 checkpoint and end equal to the uninterrupted job."""
    progress = tmp_path / "progress"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", str(ROOT / "tests" / "_jobs.py"), write_config(tmp_path), str(progress),
           "--kill-rank", "1", "--kill-step", str(KILL_STEP)]  # fmt: skip
    done = run_command(
        cmd, TIMEOUT, cwd=tmp_path, env=launch.torchrun_environment(argparse.Namespace(max_restarts=1))
    )
    assert done.returncode == 0, done.stdout
    assert (progress / "killed").exists()
    assert starts(progress, 0) == starts(progress, 1) == [0, 6]  # fresh, then resumed at step 6
    assert_same_state(final_state(tmp_path), reference["state"])


# ---- Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with 2 CPUs whose workers import this checkout; shut down after."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'veloce[ray]'")
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed: pip install 'veloce[ray]'")
    path = f"{ROOT}:{ROOT / 'tests'}"
    env = {"PYTHONPATH": path, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(HEALTH_CHECK_S)}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


def run_on_ray(run_dir: Path, progress: Path, callbacks=(), timeout: float = TIMEOUT, **kwargs):
    """``veloce.cli.ray.run_config`` of the SMALL config on 2 workers (StepLog on), with a timeout
    that names each rank's last step."""
    import veloce.cli.ray

    out: dict = {}

    def target() -> None:
        try:
            out["result"] = veloce.cli.ray.run_config(write_config(run_dir), num_workers=2,
                                                  callbacks=[StepLog(progress), *callbacks],
                                                  **kwargs)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"the Ray job did not finish in {timeout:.0f} s; {last_steps(progress)}")
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_ray_job_equals_torchrun(ray_cluster, reference, tmp_path):
    """2 Ray Train workers == 2 torchrun ranks; every checkpoint is reported to Ray, the last
    one with its epoch record."""
    result = run_on_ray(tmp_path, tmp_path / "progress")
    state = final_state(tmp_path)
    assert_same_state(state, reference["state"])
    kept = Path(result.checkpoint.path)  # Ray's copy of the last veloce checkpoint
    assert (
        checkpoint.describe(kept, verify=True)["step"] == FINAL_STEP
        and kept.parent.parent == tmp_path / "ray"
    )
    assert result.metrics["step"] == FINAL_STEP
    assert result.metrics["val_auc"] == pytest.approx(state["history"][-1]["val_auc"], abs=1e-12)


def test_ray_restarts_a_killed_worker_from_the_last_checkpoint(ray_cluster, reference, tmp_path):
    """Rank 1 killed after step 7, and the Trainer's own checkpoints lost with it; Ray
    (max_failures=1) restarts both workers from its copy of the last reported checkpoint
    (step 6), and the job ends equal to the uninterrupted one."""
    progress = tmp_path / "progress"
    kill = KillOnce(
        1, KILL_STEP, progress / "killed", delay=4 * HEALTH_CHECK_S, wipe=tmp_path / "checkpoints"
    )
    run_on_ray(tmp_path, progress, max_failures=1, callbacks=[kill])
    assert (progress / "killed").exists()
    assert starts(progress, 0) == starts(progress, 1) == [0, 6]
    assert_same_state(final_state(tmp_path), reference["state"])


def test_report_callback_reports_every_checkpoint_and_every_epoch(tmp_path, monkeypatch):
    """The reports' cadence, in one process (``ray.train.report`` recorded): each checkpoint
    with the epoch record it ends, else alone; an epoch record without its own checkpoint
    alone, before the next epoch or at the end."""
    ray_train = pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install 'veloce[ray]'")
    import veloce.cli.ray

    reports = []

    def report(metrics, checkpoint=None):
        reports.append((metrics["event"], metrics["step"], checkpoint and Path(checkpoint.path).name))

    monkeypatch.setattr(ray_train, "report", report)
    # one process: 8 global batches of 256 an epoch; checkpoints every 4 steps: the one of an
    # epoch's last step is the epoch's own (saved once, at its end, with its record)
    cfg = load_config(write_config(tmp_path), ["data.samples=2048", "trainer.checkpoint_every=4"])
    cli.train(cfg, callbacks=[veloce.cli.ray.ReportCallback()])
    assert reports == [
        ("checkpoint", 4, "step_000000004"), ("epoch", 8, "step_000000008"),
        ("checkpoint", 12, "step_000000012"), ("epoch", 16, "step_000000016"),
    ]  # fmt: skip
    reports.clear()
    cfg = load_config(write_config(tmp_path / "b"), ["data.samples=2048", "trainer.checkpoint_every=6"])
    cli.train(cfg, callbacks=[veloce.cli.ray.ReportCallback()])
    assert reports == [
        ("checkpoint", 6, "step_000000006"), ("epoch", 8, "step_000000008"),
        ("checkpoint", 12, "step_000000012"), ("epoch", 16, "step_000000016"),
    ]  # fmt: skip


# ---- options --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, message",
    [
        (["--workers", "2"], "--workers needs --launcher torchrun or ray (local trains in this one process)"),
        (["--max-restarts", "1"], "--max-restarts needs --launcher torchrun or ray"),
        (["--launcher", "torchrun"], "--launcher torchrun needs --workers N (ranks per host)"),
        (["--launcher", "ray"], "--launcher ray needs --workers N (Ray Train workers in all)"),
        (["--launcher", "ray", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["--launcher", "torchrun", "--workers", "2", "--max-restarts", "-1"],
         "--max-restarts must be >= 0, got -1"),
        (["--launcher", "torchrun", "--workers", "2", "--nnodes", "2"],
         "--nnodes 2 needs --rdzv-endpoint HOST:PORT, the same on every host"),
        (["--launcher", "torchrun", "--workers", "2", "--nnodes", "2", "--rdzv-endpoint", "host0"],
         "--rdzv-endpoint must be HOST:PORT, got 'host0'"),
        (["--launcher", "ray", "--workers", "2", "--nnodes", "2"],
         "--nnodes and --rdzv-endpoint are torchrun options; with --launcher ray the Ray cluster places"),
    ],
)  # fmt: skip
def test_launcher_option_errors_name_the_option(tmp_path, capsys, options, message):
    assert cli.main(["train", write_config(tmp_path), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("veloce train: ") and message in err
    assert not (tmp_path / "checkpoints").exists()  # nothing ran


def test_launcher_ray_without_ray_says_how_to_install(tmp_path):
    # in a fresh process where ``import ray`` fails (this one may be running Ray)
    code = "import sys; sys.modules['ray'] = None; from veloce import cli; sys.exit(cli.main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "train", write_config(tmp_path), "--launcher", "ray", "--workers", "2"]
    done = run_command(cmd, 60)
    assert done.returncode == 2, done.stdout
    assert "veloce train: --launcher ray: veloce.ray needs Ray Train" in done.stdout
    assert "pip install 'veloce[ray]'" in done.stdout


def test_config_errors_come_before_launching(tmp_path, capsys):
    config = write_config(tmp_path)
    assert (
        cli.main(
            ["train", config, "--launcher", "torchrun", "--workers", "2", "--set", "trainer.max_epochs=0"]
        )
        == 2
    )
    assert "config error: trainer.max_epochs must be a positive number, got 0" in capsys.readouterr().err


def test_torchrun_command_one_host_and_several_hosts():
    args = commands.parser().parse_args(["train", "c.yaml", "--launcher", "torchrun", "--workers", "8",
                                     "--set", "trainer.max_epochs=2"])  # fmt: skip
    assert launch.torchrun_command(args)[1:] == [
        "-m", "torch.distributed.run", "--nproc-per-node=8", "--standalone",
        "-m", "veloce.cli", "train", "c.yaml", "--set=trainer.max_epochs=2"]  # fmt: skip
    assert launch.torchrun_environment(args) == {}
    args = commands.parser().parse_args(["train", "c.yaml", "--launcher", "torchrun", "--workers", "8",
                                     "--nnodes", "2", "--rdzv-endpoint", "host0:29500",
                                     "--max-restarts", "3"])  # fmt: skip
    assert launch.torchrun_command(args)[1:] == [
        "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=host0:29500", "--max-restarts=3", "-m", "veloce.cli", "train", "c.yaml"]  # fmt: skip
    assert launch.torchrun_environment(args) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # restarts work


def test_launcher_ray_passes_the_options_to_veloce_ray(tmp_path, capsys, monkeypatch):
    """``--launcher ray --workers N --max-restarts K`` -> ``veloce.cli.ray.run_config`` (the job
    itself is tested above through the same function)."""
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed: pip install 'veloce[ray]'")
    import veloce.cli.ray

    calls = []

    class _Result:
        path, checkpoint = "storage/run", None

    monkeypatch.setattr(veloce.cli.ray, "run_config", lambda cfg, **kw: calls.append((cfg, kw)) or _Result())
    config = write_config(tmp_path)
    assert cli.main(["train", config, "--launcher", "ray", "--workers", "3", "--max-restarts", "2",
                     "--set", "trainer.max_epochs=5"]) == 0  # fmt: skip
    ((cfg, kw),) = calls
    assert cfg.trainer.max_epochs == 5 and kw == {"num_workers": 3, "max_failures": 2, "config_name": config}
    assert "ray: run storage/run" in capsys.readouterr().out
