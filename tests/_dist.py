"""Run a test function on ``world_size`` processes joined in a gloo process group (CPU only).

Each rank is a fresh (spawned) process that joins ``init_process_group("gloo",
init_method="tcp://127.0.0.1:<free port>")``, calls ``fn(rank, world_size, *args)`` and
sends back its return value (pickled, so return tensors, dicts, lists). The parent waits
at most ``timeout`` seconds; a rank that raised, or did not finish, fails the test with an
AssertionError that names it and shows its traceback. Once one rank fails, the others get
a few seconds to finish before they are killed (they are usually stuck in a collective).

``fn`` must be importable by a fresh process: a module-level function of a test module.

Example::

    def _check_sum(rank, world_size, scale):
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t)
        return scale * t.item()

    def test_sum():
        assert run_ranks(_check_sum, 3, 60, 2.0) == [6.0, 6.0, 6.0]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

GRACE_S = 5.0  # how long the other ranks may still run once one rank has failed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable[..., Any], world_size: int, timeout: float = 60, *args: Any) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns each rank's
    result in rank order. Raises AssertionError naming the ranks that failed or hung."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="veloce-ranks-") as out:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, timeout, out, args), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        _wait(procs, timeout)
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, problems = [], []
        for rank, p in enumerate(procs):
            status, value = _result(Path(out), rank)
            if rank in hung:
                problems.append(f"rank {rank} did not finish within {timeout:g}s (hung; killed)")
            elif status == "error":
                problems.append(f"rank {rank} failed:\n{value}")
            elif status is None:
                problems.append(f"rank {rank} exited with code {p.exitcode} and reported nothing")
            results.append(value)
    if problems:
        name = getattr(fn, "__name__", repr(fn))
        raise AssertionError(f"run_ranks({name}, world_size={world_size}):\n" + "\n".join(problems))
    return results


def _wait(procs: list, timeout: float) -> None:
    """Until all exit, ``timeout`` passes, or GRACE_S after the first failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.05)


def _result(out: Path, rank: int) -> tuple[Any, Any]:
    f = out / f"rank{rank}.pkl"
    return pickle.loads(f.read_bytes()) if f.exists() else (None, None)


def _rank_main(fn, rank: int, world_size: int, port: int, timeout: float, out: str, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        report = ("ok", fn(rank, world_size, *args))
    except BaseException:
        report = ("error", traceback.format_exc())
    tmp = Path(out) / f".rank{rank}.pkl"
    tmp.write_bytes(pickle.dumps(report))
    tmp.rename(Path(out) / f"rank{rank}.pkl")
    if report[0] == "error":
        os._exit(1)  # the others may be stuck in a collective with this rank; do not wait for them
    dist.barrier()  # rank 0 hosts the store: nobody leaves while others still use it
    dist.destroy_process_group()
