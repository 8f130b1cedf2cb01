"""How ``veloce train`` starts its processes: ``--launcher local | torchrun | ray``.

    veloce train CONFIG                                          # local: this one process
    veloce train CONFIG --launcher torchrun --workers 4          # 4 ranks on this host
    veloce train CONFIG --launcher torchrun --workers 8 --nnodes 2 --rdzv-endpoint host0:29500
                                                                 # 2 hosts x 8 ranks (run on each)
    veloce train CONFIG --launcher ray --workers 16              # 16 Ray Train workers
    ... [--max-restarts K]                                       # torchrun / ray: restart K times,
                                                                 # resuming from the last checkpoint
    ... [--timeout SECONDS]                                      # local / torchrun: a collective fails
                                                                 # after waiting this long for a rank

``torchrun`` runs ``python -m torch.distributed.run ... -m veloce.cli train CONFIG`` (the
command is printed first), so each rank runs the local path with ``torch.distributed``
initialised from torchrun's environment. ``ray`` runs :func:`veloce.cli.ray.run_config`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading

from veloce.train.config import Config

__all__ = [
    "LAUNCHERS",
    "LauncherError",
    "add_arguments",
    "check_arguments",
    "launch",
    "torchrun_command",
    "torchrun_environment",
]

LAUNCHERS = ("local", "torchrun", "ray")
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_ENDPOINT = re.compile(r"^\S+:\d+$")


class LauncherError(ValueError):
    """The launcher options do not fit together; the message names the option."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--launcher``, ``--workers``, ``--nnodes``, ``--rdzv-endpoint``, ``--max-restarts``,
    ``--timeout``."""
    g = parser.add_argument_group("launching (docs/scaling.md)")
    g.add_argument("--launcher", choices=LAUNCHERS, default="local",
                   help="local: this process (or this rank, under torchrun); torchrun: start --workers ranks "
                        "per host with torchrun; ray: start --workers Ray Train workers")  # fmt: skip
    g.add_argument("--workers", type=int, metavar="N",
                   help="torchrun: ranks per host; ray: workers in all")  # fmt: skip
    g.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="torchrun: hosts taking part (run the command on each)")  # fmt: skip
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="torchrun with --nnodes > 1: the rendezvous, the same on every host")  # fmt: skip
    g.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="torchrun / ray: restart the job up to K times after a failure; it resumes from "
                        "the last checkpoint")  # fmt: skip
    g.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="several ranks (torchrun, or local under torchrun): seconds a rank waits in a collective "
                        "for the others before the run fails (default 600); raise it if saving a checkpoint or "
                        "evaluating can keep one rank that long")  # fmt: skip


def check_arguments(args: argparse.Namespace) -> None:
    """Raises :class:`LauncherError` naming the option when the launcher options disagree."""
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not timeout > 0:
        raise LauncherError(f"--timeout must be a number of seconds > 0, got {timeout}")
    if getattr(args, "overwrite", False) and getattr(args, "resume_from", None):
        raise LauncherError(
            "--overwrite starts the run from scratch and --resume-from resumes it: give one of them"
        )
    if args.launcher == "ray":
        options = (("--timeout", timeout), ("--resume-from", getattr(args, "resume_from", None)))
        given = [option for option, value in options if value]
        if given:
            raise LauncherError(f"{given[0]} is not available with --launcher ray (Ray Train makes the process group "
                                f"and resumes from its own checkpoints)")  # fmt: skip
    if args.launcher == "local":
        _check_local(args)
        return
    if args.workers is None:
        per = "ranks per host" if args.launcher == "torchrun" else "Ray Train workers in all"
        raise LauncherError(f"--launcher {args.launcher} needs --workers N ({per})")
    if args.workers < 1:
        raise LauncherError(f"--workers must be >= 1, got {args.workers}")
    if args.max_restarts < 0:
        raise LauncherError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.launcher == "ray":
        if args.nnodes != 1 or args.rdzv_endpoint:
            raise LauncherError("--nnodes and --rdzv-endpoint are torchrun options; with --launcher ray the "
                                "Ray cluster places the workers (--workers N in all)")  # fmt: skip
    else:
        _check_hosts(args)


def _check_local(args: argparse.Namespace) -> None:
    options = {"--workers": args.workers, "--nnodes": args.nnodes != 1,
               "--rdzv-endpoint": args.rdzv_endpoint, "--max-restarts": args.max_restarts}  # fmt: skip
    given = [option for option, value in options.items() if value]
    if given:
        raise LauncherError(f"{given[0]} needs --launcher torchrun or ray (local trains in this one process)")


def _check_hosts(args: argparse.Namespace) -> None:
    if args.nnodes < 1:
        raise LauncherError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise LauncherError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every host")
    if args.rdzv_endpoint and not _ENDPOINT.match(args.rdzv_endpoint):
        raise LauncherError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")


def torchrun_environment(args: argparse.Namespace) -> dict[str, str]:
    """Variables ``torchrun`` needs besides this process's environment.

    With restarts, the workers must not share the rendezvous agent's TCPStore: a restarted
    group would read the previous group's gloo/NCCL addresses from it and fail to connect
    (pytorch/pytorch#135712), so ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every
    attempt a fresh store."""
    return {_NO_SHARED_STORE: "1"} if args.max_restarts else {}


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The ``torchrun`` command line that runs ``veloce train`` on ``--workers`` ranks per host
    (in the environment :func:`torchrun_environment` adds).

    One host uses ``--standalone`` (a local rendezvous on a free port); several hosts (or an
    explicit ``--rdzv-endpoint``) use the c10d rendezvous at that endpoint, which also
    numbers the hosts, so no node rank is needed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.workers}"]
    if args.rdzv_endpoint:
        cmd += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    else:
        cmd += ["--standalone"]
    if args.max_restarts:
        cmd += [f"--max-restarts={args.max_restarts}"]
    cmd += ["-m", "veloce.cli", "train", args.config, *(f"--set={item}" for item in args.set)]
    # (not --overwrite: the launcher clears the run once, before starting the ranks)
    if getattr(args, "resume_from", None):
        cmd += [f"--resume-from={args.resume_from}"]
    if getattr(args, "timeout", None) is not None:
        cmd += [f"--timeout={args.timeout:g}"]
    if getattr(args, "traceback", False):
        cmd += ["--traceback"]
    return cmd


def _wait_leaving_ctrl_c(proc: subprocess.Popen) -> int:
    """Waits for torchrun and returns its exit status. A Ctrl-C in the terminal reaches
    torchrun and its ranks too: torchrun passes it on and waits while the ranks checkpoint
    their step, so this process ignores it rather than kill torchrun."""
    if threading.current_thread() is not threading.main_thread():
        return proc.wait()
    # (set after the start: torchrun gets Python's default handler, not this one)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def launch(args: argparse.Namespace, cfg: Config) -> int:
    """Runs ``veloce train`` through ``args.launcher`` (torchrun or ray); returns the exit status."""
    if args.launcher == "torchrun":
        cmd, env = torchrun_command(args), torchrun_environment(args)
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        print(f"veloce: running {shown + ' ' if shown else ''}{shlex.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, env={**os.environ, **env})
        return _wait_leaving_ctrl_c(proc)
    try:  # (Ray is an optional dependency: veloce.cli.ray imports it)
        from veloce.cli import ray as veloce_ray
    except ImportError as exc:
        raise LauncherError(f"--launcher ray: {exc}") from None
    result = veloce_ray.run_config(cfg, num_workers=args.workers, max_failures=args.max_restarts,
                                   config_name=args.config)  # fmt: skip
    print(f"ray: run {result.path}  last checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    return 0
