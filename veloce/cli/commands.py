"""The ``veloce`` command's parser and subcommands (``train``, ``evaluate``, ``inspect``) and
how their errors become one line and an exit status (:func:`main`; the package docstring
lists the commands and statuses)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from veloce import checkpoint, metrics
from veloce.cli import launch
from veloce.cli.run import DEFAULT_TIMEOUT, RunDirError, prepare_run_dir, process_group, train
from veloce.data import DataError
from veloce.train.build import build_loaders, build_model, build_trainer, config_device
from veloce.train.config import ConfigError, load_config
from veloce.train.interrupt import TrainingInterrupted

__all__ = ["format_description", "main", "parser"]


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
    device = config_device(cfg)
    with process_group(device, args.timeout) as (rank, world_size):
        model = build_model(cfg, device)
        path = Path(args.checkpoint)
        found = path if (path / "manifest.json").exists() else checkpoint.latest(path)
        if found is None:
            raise checkpoint.CheckpointError(f"no committed checkpoint at or under {path}")
        trainer = build_trainer(cfg, model, checkpoints=False, publish=False)  # shards the tables first on several ranks
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


def parser() -> argparse.ArgumentParser:
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
    args = parser().parse_args(argv)
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
