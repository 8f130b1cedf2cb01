"""Runs :class:`veloce.Trainer` jobs on Ray Train (``pip install 'veloce[ray]'``).

Ray Train starts the workers and initialises ``torch.distributed`` (gloo on CPU, NCCL on
GPU); from there a worker is a rank like any other: the Trainer wraps the model in
``HybridParallel``, every worker reads its own shard of the data (``SyntheticClicks`` /
``CriteoTSV`` with ``rank`` and ``world_size``), and checkpoints are veloce's own. What
this module adds (the rest of veloce never imports Ray):

- :class:`ReportCallback` reports every committed checkpoint to Ray (rank 0 hands Ray the
  directory, which Ray copies to its ``storage_path``) and every epoch's record.
- :func:`fit`, inside a worker: ``trainer.fit`` with that callback, resuming from the
  checkpoint Ray kept (after a worker failure, or when a run of the same ``name`` and
  ``storage_path`` is started again).
- :func:`run` starts ``train_loop(config)`` on ``num_workers`` workers;
  :func:`run_config` trains a ``veloce train`` config (what ``--launcher ray`` runs).

Every worker must see ``checkpoint_dir`` (a checkpoint is written by all ranks into one
directory): one host, or a shared file system across hosts, as under torchrun.

Example::

    def train_loop(config):                        # runs on every worker
        ctx = ray.train.get_context()
        model = DLRM(13, 26, embedding_dim=16)
        train = SyntheticClicks(10**6, 2048, rank=ctx.get_world_rank(), world_size=ctx.get_world_size())
        trainer = veloce.Trainer(model, checkpoint_dir=config["ckpt"], checkpoint_every=500)
        veloce.cli.ray.fit(trainer, train)

    veloce.cli.ray.run(train_loop, {"ckpt": "/shared/run/ckpt"}, num_workers=4, max_failures=2,
                   storage_path="/shared/run/ray")
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch

try:
    import ray.train
    from ray.train.torch import TorchTrainer, get_device
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"veloce.ray needs Ray Train ({_exc}): pip install 'veloce[ray]'") from _exc

from veloce.cli.run import train
from veloce.train.callbacks import Callback
from veloce.train.config import Config, load_config
from veloce.train.trainer import Trainer

__all__ = ["ReportCallback", "fit", "run", "run_config"]


class ReportCallback(Callback):
    """Reports a Trainer's progress to Ray Train, from every worker at the same points.

    - Each committed checkpoint: ``ray.train.report(metrics, checkpoint)``, where rank 0
      passes the checkpoint directory and the other ranks None (Ray needs every worker to
      report, as often as the others). ``metrics`` is the epoch record when the checkpoint
      ends an epoch, else ``{"event": "checkpoint", "epoch": ..., "step": ...}``.
    - Each epoch's record (``loss``, ``val_<metric>``, ...) that no checkpoint followed
      (no ``checkpoint_dir``) is reported alone, before the next epoch starts or when
      ``fit`` ends.
    """

    def __init__(self) -> None:
        self._record: Optional[dict[str, Any]] = None  # an epoch record not reported yet

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Keeps the record for the epoch's checkpoint, which comes next."""
        self._record = record

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        """Reports the checkpoint (rank 0 passes the directory) with the epoch record, if any."""
        metrics = self._take() or {"event": "checkpoint", "epoch": trainer.epoch, "step": trainer.global_step}
        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if trainer.rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        """Reports the previous epoch's record if no checkpoint carried it."""
        self._report_record()

    def on_fit_end(self, trainer: Trainer, history: list[dict[str, Any]]) -> None:
        """Reports the last epoch's record if no checkpoint carried it."""
        self._report_record()

    def _take(self) -> Optional[dict[str, Any]]:
        record, self._record = self._record, None
        return record

    def _report_record(self) -> None:
        record = self._take()
        if record is not None:
            ray.train.report(record)


def fit(trainer: Trainer, train_loader: Any, val_loader: Any = None) -> list[dict[str, Any]]:
    """``trainer.fit`` inside a Ray Train worker: reports to Ray and resumes from Ray's checkpoint.

    Adds a :class:`ReportCallback` (unless the trainer has one) and resumes from
    ``ray.train.get_checkpoint()`` when Ray has one (the last checkpoint reported before a
    worker failed, or by an earlier run of the same name), else as ``Trainer.fit`` does
    (the newest checkpoint in ``checkpoint_dir``, if any).

    Args:
        trainer: the worker's Trainer (``torch.distributed`` is initialised by Ray Train).
        train_loader: this worker's shard of the training data.
        val_loader: this worker's shard of the validation data, or None.

    Returns:
        The Trainer's history.
    """
    if not any(isinstance(cb, ReportCallback) for cb in trainer.callbacks):
        trainer.callbacks.append(ReportCallback())
    kept = ray.train.get_checkpoint()
    if kept is None:
        return trainer.fit(train_loader, val_loader)
    with kept.as_directory() as path:  # local storage: the directory itself; remote: a download
        return trainer.fit(train_loader, val_loader, resume_from=path)


def run(
    train_loop: Callable[[dict[str, Any]], None],
    config: Optional[dict[str, Any]] = None,
    *,
    num_workers: int,
    use_gpu: bool = False,
    max_failures: int = 0,
    storage_path: Optional[str | os.PathLike] = None,
    name: Optional[str] = None,
    keep_last: Optional[int] = None,
) -> ray.train.Result:
    """Runs ``train_loop(config)`` on ``num_workers`` Ray Train workers (a ``TorchTrainer``).

    Uses the Ray cluster this process is connected to (``ray.init``; ``RAY_ADDRESS``), or
    starts a local one.

    Args:
        train_loop: picklable; builds the model and Trainer and calls :func:`fit`.
        config: passed to ``train_loop`` (picklable).
        num_workers: workers (ranks) in all.
        use_gpu: one GPU per worker (NCCL); else CPU (gloo).
        max_failures: restarts after a worker fails; each resumes from the last checkpoint.
        storage_path: where Ray keeps the reported checkpoints (a shared file system or a
            cloud URI on several hosts); default Ray's (``~/ray_results``).
        name: the run's name under ``storage_path``; starting a run with the name of an
            earlier one resumes it from its last checkpoint.
        keep_last: checkpoints Ray keeps (None: all).

    Returns:
        Ray's ``Result`` (``path``, ``checkpoint``: the last one reported).

    Raises:
        ValueError: ``num_workers`` < 1 or ``max_failures`` < 0.
        ray.train.TrainingFailedError: the job failed more than ``max_failures`` times.
    """
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"veloce.cli.ray.run: num_workers must be an int >= 1, got {num_workers!r}")
    if not isinstance(max_failures, int) or max_failures < 0:
        raise ValueError(f"veloce.cli.ray.run: max_failures must be an int >= 0, got {max_failures!r}")
    run_config = ray.train.RunConfig(
        name=name, storage_path=None if storage_path is None else str(storage_path),
        failure_config=ray.train.FailureConfig(max_failures=max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep_last),
    )  # fmt: skip
    scaling = ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)
    return TorchTrainer(
        train_loop, train_loop_config=config, scaling_config=scaling, run_config=run_config
    ).fit()


def run_config(
    config: Config | str | os.PathLike,
    *,
    num_workers: int,
    overrides: Sequence[str] = (),
    use_gpu: Optional[bool] = None,
    max_failures: int = 0,
    storage_path: Optional[str | os.PathLike] = None,
    name: Optional[str] = None,
    callbacks: Sequence[Callback] = (),
    config_name: str = "",
) -> ray.train.Result:
    """Trains a ``veloce train`` config on ``num_workers`` Ray Train workers.

    Each worker runs :func:`veloce.cli.train` on its shard of the data. Relative paths of
    the config (``run_dir``, ``checkpoint_dir``, ``data.path``) are made absolute here, as
    Ray workers run in their own directories; they must be visible to every worker.

    Args:
        config: a :class:`veloce.train.Config` or a YAML file.
        num_workers: workers (ranks) in all.
        overrides: ``key.sub=value`` overrides of a YAML file.
        use_gpu: one GPU per worker; default: when ``trainer.device`` is ``cuda``, or
            ``auto`` and this machine has a GPU.
        max_failures: restarts after a worker fails, each resuming from the last checkpoint.
        storage_path: where Ray keeps the checkpoints; default ``run_dir/ray``.
        name: the Ray run's name; default the name of ``run_dir`` (so the same config
            started again resumes from Ray's last checkpoint).
        callbacks: extra Trainer callbacks (picklable), run on every worker.
        config_name: recorded in ``metrics.json``.

    Returns:
        Ray's ``Result``.
    """
    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    cfg = _absolute_paths(cfg)
    if use_gpu is None:
        device = cfg.trainer.device
        use_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    run_dir = Path(cfg.trainer.run_dir)
    loop_config = {"config": cfg, "callbacks": list(callbacks), "config_name": config_name}
    return run(_config_loop, loop_config, num_workers=num_workers, use_gpu=use_gpu, max_failures=max_failures,
               storage_path=storage_path if storage_path is not None else run_dir / "ray",
               name=name or run_dir.name, keep_last=cfg.trainer.keep_last)  # fmt: skip


def _config_loop(loop_config: dict[str, Any]) -> None:
    """One worker of :func:`run_config`."""
    train(loop_config["config"], device=get_device(), callbacks=loop_config["callbacks"], fit=fit,
          config_name=loop_config["config_name"])  # fmt: skip


def _absolute_paths(cfg: Config) -> Config:
    def absolute(path: Optional[str]) -> Optional[str]:
        return None if path is None else os.path.abspath(os.path.expanduser(os.path.expandvars(path)))

    trainer = dataclasses.replace(cfg.trainer, run_dir=absolute(cfg.trainer.run_dir),
                                  checkpoint_dir=absolute(cfg.trainer.checkpoint_dir))  # fmt: skip
    return dataclasses.replace(
        cfg, trainer=trainer, data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path))
    )
