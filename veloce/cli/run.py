"""One process's run of a ``veloce train`` config: alone, as a torchrun rank or as a Ray
worker (:func:`train`), with the run directory's checks (:func:`prepare_run_dir`)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from veloce import checkpoint
from veloce.train.build import build_loaders, build_model, build_trainer, config_device
from veloce.train.callbacks import Callback
from veloce.train.config import Config
from veloce.train.lockstep import broadcast
from veloce.train.trainer import Trainer

__all__ = ["DEFAULT_TIMEOUT", "RunDirError", "prepare_run_dir", "process_group", "train"]

DEFAULT_TIMEOUT = 600
"""Seconds a rank waits in a collective for the others (``--timeout``) before the run fails."""


class RunDirError(Exception):
    """The run directory does not fit the command (it holds a finished run); the message
    says what to do instead."""


@contextlib.contextmanager
def process_group(device: torch.device, timeout: Optional[float] = None) -> Iterator[tuple[int, int]]:
    """Joins the process group that ``torchrun`` describes (WORLD_SIZE > 1) unless a launcher
    (Ray Train) already did; yields ``(rank, world_size)``; leaves the group it joined.
    ``timeout``: seconds a collective waits for the other ranks (default
    :data:`DEFAULT_TIMEOUT`)."""
    dist = torch.distributed
    if dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        yield 0, 1
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seconds = DEFAULT_TIMEOUT if timeout is None else timeout
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
    try:
        yield dist.get_rank(), world_size
    finally:  # left to interpreter exit, gloo's threads can abort the process
        dist.destroy_process_group()


FitFn = Callable[[Trainer, Any, Any], list]


def train(
    cfg: Config,
    *,
    device: Optional[torch.device] = None,
    callbacks: Sequence[Callback] = (),
    fit: Optional[FitFn] = None,
    config_name: str = "",
    resume_from: Optional[str] = None,
    overwrite: bool = False,
    refuse_finished: bool = False,
    timeout: Optional[float] = None,
) -> list[dict[str, Any]]:
    """Trains the config's model on this process: one process, a torchrun rank or a Ray worker.

    Joins the process group a launcher describes (unless one is already initialised),
    builds the model, this rank's data shard and the Trainer, and fits (resuming from the
    config's checkpoints); rank 0 writes ``run_dir/metrics.json`` and prints a summary.

    Args:
        cfg: the config.
        device: where to train; default: the config's ``trainer.device``.
        callbacks: extra :class:`veloce.Callback` objects for the Trainer.
        fit: ``fit(trainer, train_loader, val_loader) -> history``; default ``Trainer.fit``
            (:func:`veloce.cli.ray.fit` adds reporting to Ray and resuming from its checkpoint).
        config_name: the config's file name, recorded in ``metrics.json``.
        resume_from: a checkpoint to resume from instead of the newest one in the
            config's checkpoint directory (default ``fit`` only).
        overwrite: delete the run's checkpoints and logs first (rank 0), and train from
            scratch.
        refuse_finished: raise :class:`RunDirError` when the checkpoint the run would
            resume from has nothing left to train (``veloce train`` sets it).
        timeout: seconds a collective waits for the other ranks when this call joins the
            process group (default :data:`DEFAULT_TIMEOUT`).

    Returns:
        The Trainer's history.

    Raises:
        RunDirError: see ``refuse_finished``.
    """
    device = device if device is not None else config_device(cfg)
    if resume_from is not None:
        if fit is not None:
            raise ValueError("train: resume_from works with the default fit only")
        fit = functools.partial(Trainer.fit, resume_from=resume_from)
    with process_group(device, timeout) as (rank, world_size):
        if overwrite or refuse_finished:  # rank 0 looks (and clears), every rank learns the answer
            problem = broadcast(prepare_run_dir(cfg, overwrite, resume_from) if rank == 0 else None)
            if problem is not None:
                raise RunDirError(problem)
        torch.manual_seed(cfg.trainer.seed)  # the model's initial dense weights
        model = build_model(cfg, device)
        train_loader, val_loader = build_loaders(cfg, rank, world_size)
        trainer = build_trainer(cfg, model, callbacks=callbacks)
        history = (fit or Trainer.fit)(trainer, train_loader, val_loader)
    if rank == 0:
        _summarize(cfg, history, config_name, device, world_size)
    return history


def prepare_run_dir(cfg: Config, overwrite: bool = False, resume_from: Optional[str] = None) -> Optional[str]:
    """Clears the run's checkpoints and logs (``overwrite``), or says why training would do
    nothing: the checkpoint it resumes from (``resume_from``, else the newest in the
    config's checkpoint directory) is the end of the run the config asks for. Returns that
    message, or None when there is something to train."""
    tr = cfg.trainer
    ckpts = tr.checkpoints()
    if overwrite:
        _clear_run(Path(tr.run_dir), ckpts)
        return None
    found = Path(resume_from) if resume_from is not None else checkpoint.latest(ckpts)
    if found is None:
        return None
    extra = checkpoint.describe(found)["extra"]
    if not isinstance(extra, dict) or not {"epoch", "global_step"} <= extra.keys():
        return None  # not a Trainer's checkpoint: the Trainer refuses it with its own message
    epoch, step = extra["epoch"], extra["global_step"]
    if extra.get("finished"):
        why = f"stopped early by a callback (such as EarlyStopping) at step {step}, epoch {epoch}"
        more = "--set trainer.max_epochs/max_steps does not restart a stopped run"
    elif epoch >= tr.max_epochs:
        why = f"epoch {epoch} of {tr.max_epochs} done, step {step}"
        more = f"to train further, --set trainer.max_epochs={epoch + 1} (or more)"
    elif tr.max_steps is not None and step >= tr.max_steps:
        why = f"step {step} of trainer.max_steps={tr.max_steps} done"
        more = "to train further, a larger --set trainer.max_steps=... (or null)"
    else:
        return None
    return (f"run dir {tr.run_dir} already holds a finished run ({why}; checkpoint {found}): nothing to train; "
            f"{more}; to start again, --overwrite (deletes its checkpoints and logs) or a new run dir "
            f"(--set trainer.run_dir=...)")  # fmt: skip


def _clear_run(run_dir: Path, ckpts: Path) -> None:
    """Deletes the checkpoints in ``ckpts`` (and the debris of interrupted writes) and the
    logs ``veloce train`` writes in ``run_dir``; other files stay."""
    if ckpts.is_dir():
        for entry in ckpts.iterdir():
            if entry.is_dir() and (entry.name.startswith("step_") or entry.name.startswith(".step_")):
                shutil.rmtree(entry)
    for name in ("log.jsonl", "metrics.json"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)


def _summarize(cfg: Config, history: list, config_name: str, device: torch.device, world_size: int) -> None:
    summary = {"history": history, "config": config_name, "device": str(device), "world_size": world_size}
    Path(cfg.trainer.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.trainer.run_dir) / "metrics.json").write_text(json.dumps(summary, indent=1))
    if history:
        last = history[-1]
        vals = ", ".join(f"{k[4:]} {v:.4f}" for k, v in last.items() if k.startswith("val_"))
        print(f"epoch {last['epoch']}: {vals}; {last['samples_per_s']:,.0f} samples/s on {device}")
    print(f"checkpoints: {cfg.trainer.checkpoints()}  log: {Path(cfg.trainer.run_dir) / 'log.jsonl'}")
