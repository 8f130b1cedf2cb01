"""The ``veloce`` command: train and evaluate from a YAML config, inspect checkpoints.

    veloce train configs/dlrm_synthetic.yaml [--set trainer.max_epochs=2 ...]
    veloce evaluate configs/dlrm_synthetic.yaml --checkpoint runs/dlrm_synthetic/checkpoints
    veloce inspect runs/dlrm_synthetic/checkpoints/step_000000489 [--json] [--verify]
    veloce train configs/dlrm_criteo.yaml --launcher torchrun --workers 2      # several ranks
    veloce train configs/dlrm_criteo.yaml --launcher ray --workers 4           # on Ray Train

The config's fields are documented in ``docs/config.md`` (schema: :mod:`veloce.train.config`);
the launchers in ``docs/scaling.md`` (code: :mod:`veloce.launch`).

Errors the user can act on (config, options, a run directory holding a finished run, a
checkpoint, a data file) print one line naming the field, file or line, without a
traceback (``--traceback`` or ``VELOCE_TRACEBACK=1`` shows it). Exit status: 0 on success,
1 on a runtime, checkpoint or data error or a validation metric that computed to NaN
(``veloce.metrics.MetricError``), 2 on a config or option error (a finished run directory
included), 130 after Ctrl-C (the step reached is checkpointed), 141 when the reader of the
output went away (``veloce inspect ... | head``); torchrun's own status when it launches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from veloce import checkpoint, launch, metrics
from veloce.train.callbacks import Callback
from veloce.train.config import Config, ConfigError, load_config
from veloce.data import DataError
from veloce.train.trainer import Trainer, TrainingInterrupted

__all__ = ["main", "build_model", "build_loaders", "build_trainer", "train"]

_SPARSE_OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowWiseAdagrad", "adam": "Adam"}
_DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
_VAL_START = 10**9  # synthetic validation samples are drawn from here on: disjoint from training
DEFAULT_TIMEOUT = 600
"""Seconds a rank waits in a collective for the others (``--timeout``) before the run fails."""


class RunDirError(Exception):
    """The run directory does not fit the command (it holds a finished run); the message
    says what to do instead."""


# ---- building the pieces from a config ----------------------------------------------------------
def build_model(cfg: Config, device: torch.device) -> nn.Module:
    """The config's DLRM or DeepFM, with one ``DynamicEmbedding`` per sparse feature on ``device``."""
    import veloce
    from veloce.models import DLRM, DeepFM

    t, s = cfg.tables, cfg.optimizer.sparse
    initializers = {
        "normal": lambda: veloce.init.normal(std=t.init_scale),
        "uniform": lambda: veloce.init.uniform(-t.init_scale, t.init_scale),
        "zeros": veloce.init.zeros,
    }
    init = initializers[t.initializer]()
    eps = {"eps": s.eps} if s.eps is not None else {}
    sparse_cls = getattr(veloce.optim, _SPARSE_OPTIMIZERS[s.name])
    sparse_opt = sparse_cls(lr=s.lr, weight_decay=s.weight_decay, **eps)

    seeds = itertools.count(cfg.trainer.seed * 1000)  # one seed per table: features start apart

    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(
            dim, mode=t.mode, capacity=t.capacity, max_capacity=t.max_capacity, eviction=t.eviction,
            initializer=init, optimizer=sparse_opt, seed=next(seeds), device=device, defer_inserts=t.defer_inserts,
        )  # fmt: skip

    num_dense, num_sparse = _feature_counts(cfg)
    m = cfg.model
    if m.name == "dlrm":
        model = DLRM(num_dense, num_sparse, m.embedding_dim, m.bottom_mlp, m.top_mlp, embedding_factory=table)
    else:
        model = DeepFM(num_dense, num_sparse, m.embedding_dim, m.deep_mlp, embedding_factory=table)
    return model.to(device)


def build_loaders(cfg: Config, rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    """(train loader, validation loader) of this rank; a Criteo file is split by time (last rows validate)."""
    from torch.utils.data import DataLoader

    from veloce.data import CriteoTSV, SyntheticClicks

    d = cfg.data
    if d.kind == "synthetic":
        common = dict(num_dense=d.num_dense, num_sparse=d.num_sparse, id_space=d.id_space,
                      zipf_alpha=d.zipf_alpha, seed=d.seed, rank=rank, world_size=world_size)  # fmt: skip
        train = SyntheticClicks(d.samples, d.batch_size, **common)
        val = SyntheticClicks(d.val_samples, d.val_batch_size, start=_VAL_START, **common)
    else:
        path = os.path.expanduser(os.path.expandvars(d.path))
        if not Path(path).is_file():
            raise ConfigError(
                f"config error: data.path is not a file: {path} (in a config file, a relative data.path is relative "
                f"to the file's directory; with --set, to the current directory)"
            )  # fmt: skip
        rows = d.rows or CriteoTSV(path).num_rows()  # (the count is the one pass over the file before training)
        split = int(rows * (1 - d.val_fraction))
        common = dict(rank=rank, world_size=world_size, strict=d.strict, total_rows=rows)
        train = CriteoTSV(path, d.batch_size, stop=split, **common)
        val = CriteoTSV(path, d.val_batch_size, start=split, stop=rows, **common)

    def loader(ds: Any) -> DataLoader:
        init = _worker_ignores_sigint if d.num_workers else None
        return DataLoader(ds, batch_size=None, num_workers=d.num_workers, worker_init_fn=init)

    return loader(train), loader(val)


def build_trainer(
    cfg: Config, model: nn.Module, checkpoints: bool = True, callbacks: Sequence[Callback] = ()
) -> Trainer:
    """A Trainer with the config's optimizers and settings, AUC / log loss / accuracy metrics,
    checkpoints in ``trainer.checkpoints()`` (if ``checkpoints``), logs in ``run_dir``, and
    ``callbacks``."""
    o, tr, st = cfg.optimizer.dense, cfg.trainer, cfg.strategy
    params = [p for p in model.parameters() if p.requires_grad]
    # A captured step (trainer.cuda_graph) needs Adam's state, its step count too, on the device.
    extra = {"capturable": True} if tr.cuda_graph and o.name == "adam" else {}
    dense = _DENSE_OPTIMIZERS[o.name](params, lr=o.lr, weight_decay=o.weight_decay, **extra) if params else None
    return Trainer(
        model, optimizer=dense,
        metrics={"auc": metrics.AUC(), "logloss": metrics.LogLoss(), "accuracy": metrics.Accuracy()},
        strategy={"sparse": st.sparse, "staleness": st.staleness, "dense": st.dense, "lookup_errors": st.lookup_errors,
                  "exchange_dtype": st.exchange_dtype},
        precision=tr.precision, accumulate_steps=tr.accumulate_steps, max_epochs=tr.max_epochs,
        max_steps=tr.max_steps, checkpoint_dir=tr.checkpoints() if checkpoints else None,
        checkpoint_every=tr.checkpoint_every if checkpoints else None, keep_last=tr.keep_last,
        log_every=tr.log_every, log_dir=tr.run_dir, progress=tr.progress, seed=tr.seed, callbacks=callbacks,
        cuda_graph=tr.cuda_graph, clip_grad_norm=tr.clip_grad_norm,
    )  # fmt: skip


def _worker_ignores_sigint(worker_id: int) -> None:
    """A DataLoader worker leaves Ctrl-C to the training process, which checkpoints and
    stops at the end of its step: a worker ended by it would fail that step's next batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _feature_counts(cfg: Config) -> tuple[int, int]:
    if cfg.data.kind == "criteo":
        from veloce.data.criteo import NUM_DENSE, NUM_SPARSE

        return NUM_DENSE, NUM_SPARSE
    return cfg.data.num_dense, cfg.data.num_sparse


def _device(cfg: Config) -> torch.device:
    name = cfg.trainer.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{os.environ['LOCAL_RANK']}"
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"config error: trainer.device is {cfg.trainer.device!r} but torch sees no CUDA device "
                              f"(torch {torch.__version__}); use trainer.device=cpu or auto")  # fmt: skip
        if device.index is not None and device.index >= count:
            raise ConfigError(f"config error: trainer.device is {name!r} but torch sees {count} CUDA device(s)")
    return device


@contextlib.contextmanager
def _process_group(device: torch.device, timeout: Optional[float] = None) -> Iterator[tuple[int, int]]:
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


# ---- training on this process ------------------------------------------------------------------
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
            (:func:`veloce.ray.fit` adds reporting to Ray and resuming from its checkpoint).
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
    device = device if device is not None else _device(cfg)
    if resume_from is not None:
        if fit is not None:
            raise ValueError("train: resume_from works with the default fit only")
        fit = functools.partial(Trainer.fit, resume_from=resume_from)
    with _process_group(device, timeout) as (rank, world_size):
        if overwrite or refuse_finished:  # rank 0 looks (and clears), every rank learns the answer
            from veloce.train.lockstep import broadcast

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


# ---- commands ------------------------------------------------------------------------------------
def _train(args: argparse.Namespace) -> int:
    launch.check_arguments(args)
    cfg = load_config(args.config, args.set)  # config errors show before any process starts
    if args.resume_from is not None:
        _check_checkpoint(args.resume_from, "--resume-from")
    if args.launcher != "local":
        # Checked (and cleared) once, here: the ranks of a restarted job must not clear again.
        problem = prepare_run_dir(cfg, args.overwrite, args.resume_from)
        if problem is not None:
            raise RunDirError(problem)
        return launch.launch(args, cfg)
    train(cfg, config_name=args.config, resume_from=args.resume_from, overwrite=args.overwrite,
          refuse_finished=True, timeout=args.timeout)  # fmt: skip
    return 0


def _check_checkpoint(path: str, option: str) -> None:
    """A committed checkpoint at ``path``, or CheckpointError naming the option."""
    if not checkpoint.describe(path)["committed"]:
        raise checkpoint.CheckpointError(
            f"{option} {path}: the checkpoint was not committed (an interrupted write)"
        )


def _evaluate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    device = _device(cfg)
    with _process_group(device, args.timeout) as (rank, world_size):
        model = build_model(cfg, device)
        path = Path(args.checkpoint)
        found = path if (path / "manifest.json").exists() else checkpoint.latest(path)
        if found is None:
            raise checkpoint.CheckpointError(f"no committed checkpoint at or under {path}")
        trainer = build_trainer(cfg, model, checkpoints=False)  # shards the tables first on several ranks
        step = checkpoint.load(found, trainer.model)["step"]
        _, val = build_loaders(cfg, rank, world_size)
        result = trainer.evaluate(val)
    if rank == 0:
        print(json.dumps({"checkpoint": str(found), "step": step, **result}))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    info = checkpoint.describe(args.checkpoint, verify=args.verify)
    print(json.dumps(info, indent=1) if args.json else format_description(info))
    bad = [f["name"] for f in info["files"] if f["ok"] is False or f["present"] is None]
    if args.verify and bad:
        print(f"checkpoint error: {len(bad)} file(s) missing or not matching their sha256: {', '.join(bad)}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def format_description(info: dict[str, Any]) -> str:
    """``checkpoint.describe()``'s dict as text: the header fields, one row per table, the files."""
    lines = [f"{k}: {info[k]}" for k in ("path", "committed", "format_version", "world_size", "step") if k in info]
    extra = info.get("extra") or {}
    if extra:
        lines.append(f"extra: {', '.join(sorted(extra))}")
    dense = info.get("dense")
    if dense:
        lines.append(f"dense: {dense['count']} tensors, {dense['bytes']:,} bytes")
    tables = info.get("tables", [])
    lines.append(f"tables: {len(tables)}")
    cols = ["name", "rows", "dim", "state_width", "dtype", "optimizer", "shards"]
    if tables:
        cells = [[str(t.get(c, "")) for c in cols] for t in tables]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        for row in [cols, *cells]:
            lines.append(("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths))).rstrip())
    files = info.get("files", [])
    lines.append(f"files: {len(files)}")
    for f in files:
        state = "" if f.get("present") == f.get("size") else f"  (on disk: {f.get('present')})"
        ok = {True: "  sha256 ok", False: "  sha256 MISMATCH"}.get(f.get("ok"), "")
        lines.append(f"  {f['name']}  {f['size']:,} bytes{state}{ok}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="veloce", description="Train, evaluate and inspect veloce models.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "train from a YAML config (resumes from its checkpoints)"),
                        ("evaluate", "evaluate a checkpoint on the config's validation data")):  # fmt: skip
        c = sub.add_parser(name, help=help_)
        c.add_argument("config", help="YAML config (fields: docs/config.md)")
        c.add_argument("--set", action="append", default=[], metavar="KEY.SUB=VALUE",
                       help="override a field, e.g. --set trainer.max_epochs=2 (repeatable); a relative "
                            "data.path given here is relative to the current directory")  # fmt: skip
        if name == "evaluate":
            c.add_argument("--checkpoint", required=True, help="a checkpoint, or a folder of them (newest)")
            c.add_argument("--timeout", type=float, metavar="SECONDS",
                           help=f"several ranks: seconds a rank waits for the others (default {DEFAULT_TIMEOUT})")
        else:
            c.add_argument("--resume-from", metavar="CHECKPOINT",
                           help="resume from this checkpoint instead of the newest one (e.g. an older one when the "
                                "newest is damaged); later checkpoints are replaced as the run reaches their steps")
            c.add_argument("--overwrite", action="store_true",
                           help="delete the run's checkpoints and logs first and train from scratch")
            launch.add_arguments(c)
        _add_traceback(c)
    c = sub.add_parser("inspect", help="print a checkpoint's manifest: step, world size, tables, files")
    c.add_argument("checkpoint", help="a checkpoint directory")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.add_argument("--verify", action="store_true",
                   help="also check every file's sha256 (reads everything); exit status 1 if one does not match")
    _add_traceback(c)
    return p


def _add_traceback(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traceback", action="store_true",
                        help="show the traceback of config, data, checkpoint and run errors (or VELOCE_TRACEBACK=1)")


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line. An error raised in a DataLoader worker comes back
    as "Caught X in DataLoader worker ... Original Traceback ...": its last line is the
    original message."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        _, sep, message = lines[-1].partition(f"{type(exc).__name__}: ")
        return message if sep else lines[-1]
    return " ".join(line.strip() for line in lines)


def _stdout_gone() -> int:
    """The reader of stdout went away (``| head``): stop quietly, as a command killed by
    SIGPIPE does. Later writes (the interpreter's last flush) go to /dev/null."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the ``veloce`` command line; returns the exit status."""
    args = _parser().parse_args(argv)
    command = {"train": _train, "evaluate": _evaluate, "inspect": _inspect}[args.command]
    if args.traceback or os.environ.get("VELOCE_TRACEBACK", "") not in ("", "0"):
        try:
            return command(args)
        except BrokenPipeError:
            return _stdout_gone()
    try:
        return command(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (launch.LauncherError, RunDirError) as exc:
        print(f"veloce {args.command}: {exc}", file=sys.stderr)
        return 2
    except checkpoint.CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        return 1
    except metrics.MetricError as exc:  # a validation metric without a value (NaN) fails the run
        print(f"veloce {args.command}: {exc}", file=sys.stderr)
        return 1
    except DataError as exc:
        print(f"data error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _stdout_gone()
    except TrainingInterrupted as exc:
        print(f"veloce {args.command}: interrupted at step {exc.step} (epoch {exc.epoch}); "
              f"checkpoint {exc.checkpoint}; run the same command to resume", file=sys.stderr)  # fmt: skip
        return 128 + signal.SIGINT
    except KeyboardInterrupt:
        print(f"veloce {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
