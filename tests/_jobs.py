"""Multi-process training jobs for the launcher tests (tests/cli/test_ray.py): a small config,
callbacks that record progress and kill a rank once, and a subprocess runner with a
timeout that names the ranks still running.

Run under torchrun, this file trains the config with those callbacks::

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \\
        tests/_jobs.py CONFIG PROGRESS_DIR [--kill-rank 1 --kill-step 7]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import yaml

import veloce

ROOT = Path(__file__).resolve().parents[1]
# DLRM(4 dense, 5 sparse, dim 8); 8 global batches of 256 (128 a rank on 2 ranks) an epoch,
# 2 epochs: 16 steps, checkpoints at steps 6, 8 (epoch end), 12, 16 (few: a report to Ray takes a while)
SMALL = {
    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
    "data": {"samples": 2048, "val_samples": 512, "batch_size": 256, "val_batch_size": 512, "num_dense": 4,
             "num_sparse": 5, "id_space": 2000},
    "tables": {"capacity": 1024},
    "optimizer": {"dense": {"lr": 0.01}, "sparse": {"lr": 0.2}},
    "trainer": {"max_epochs": 2, "checkpoint_every": 6, "log_every": 4, "progress": False, "device": "cpu"},
}  # fmt: skip


def write_config(run_dir: Path) -> str:
    """The SMALL config with ``run_dir``, written to ``run_dir/config.yaml``."""
    raw = {**SMALL, "trainer": {**SMALL["trainer"], "run_dir": str(run_dir)}}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class StepLog(veloce.Callback):
    """Per rank, in ``directory``: ``rank<R>.starts`` gets the step each fit started from (one
    line per attempt), ``rank<R>.step`` the last step finished."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def on_fit_start(self, trainer):
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"rank{trainer.rank}.starts", "a") as f:
            f.write(f"{trainer.global_step}\n")

    def on_step_end(self, trainer, step):
        (self.directory / f"rank{trainer.rank}.step").write_text(str(step))


def starts(directory: Path, rank: int) -> list[int]:
    """The steps rank ``rank``'s fits started from (see :class:`StepLog`)."""
    path = directory / f"rank{rank}.starts"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def last_steps(directory: Path) -> str:
    """'rank 0: step 5, rank 1: step 7' from a :class:`StepLog` directory."""
    found = sorted(directory.glob("rank*.step")) if directory.is_dir() else []
    return ", ".join(f"{p.stem}: step {p.read_text()}" for p in found) or "no rank finished a step"


class KillOnce(veloce.Callback):
    """Kills rank ``rank`` (``os._exit(1)``, no cleanup) after optimizer step ``step``, once:
    the marker file it creates first stops the restarted job's rank from dying again.

    Before dying it waits ``delay`` seconds (so a launcher has collected the reports made so
    far) and deletes ``wipe`` (the checkpoints a lost host held), if given."""

    def __init__(self, rank: int, step: int, marker: str | Path, delay: float = 0.0,
                 wipe: Optional[str | Path] = None) -> None:  # fmt: skip
        self.rank, self.step, self.marker, self.delay, self.wipe = rank, step, Path(marker), delay, wipe

    def on_step_end(self, trainer, step):
        if trainer.rank == self.rank and step == self.step and not self.marker.exists():
            self.marker.touch()
            time.sleep(self.delay)
            if self.wipe is not None:
                shutil.rmtree(self.wipe)
            os._exit(1)


def run_command(cmd: list[str], timeout: float, cwd: Optional[Path] = None,
                env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Runs ``cmd`` (with ``env`` added to the environment); fails naming the ranks still
    running after ``timeout`` seconds (processes under it started with ``RANK`` set), after
    killing every process under it."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        **(env or {}),
    }  # veloce from this checkout
    out = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        under = _processes_under(proc.pid)
        hung = sorted(f"rank {rank} (pid {pid})" for pid, rank in under.items() if rank is not None)
        for pid in [proc.pid, *under]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        running = ", ".join(hung) or "no rank (the launcher itself)"
        message = (
            f"{' '.join(cmd)} did not finish in {timeout:.0f} s; still running: {running}; output:\n{out}"
        )
        raise AssertionError(message) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _processes_under(root: int) -> dict[int, Optional[str]]:
    """pid -> its ``RANK`` environment variable (or None) for every process under ``root`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found: dict[int, Optional[str]] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        rank = [kv[5:].decode() for kv in env if kv.startswith(b"RANK=")]
        found[pid] = rank[0] if rank else None
    return found


def _main() -> None:
    p = argparse.ArgumentParser(description="train the config on this torchrun rank with StepLog / KillOnce")
    p.add_argument("config")
    p.add_argument("progress", help="StepLog directory")
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-step", type=int)
    args = p.parse_args()
    callbacks: list[veloce.Callback] = [StepLog(args.progress)]
    if args.kill_rank is not None:
        callbacks.append(KillOnce(args.kill_rank, args.kill_step, Path(args.progress) / "killed"))
    from veloce import cli
    from veloce.train.config import load_config

    cli.train(load_config(args.config), callbacks=callbacks, config_name=args.config)


if __name__ == "__main__":
    _main()
