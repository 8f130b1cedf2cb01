"""Runs a test function on several local ranks (gloo over TCP, or NCCL on GPUs), with a
timeout that names the ranks that hung.

The ranks rendezvous through a TCP store that the test process itself hosts on a port the
system picks (port 0): no port is picked free beforehand, where another process can take it
before a rank listens (EADDRINUSE, then a hang), and no file lock is needed (a file store hung
a CI machine in ``init_process_group``).

    def body(rank, world_size, arg):     # module level, so spawned ranks can import it
        ...                              # torch.distributed is initialised here
        return something_picklable

    results = run_ranks(body, 2, arg)    # [result of rank 0, result of rank 1]
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

GRACE_S = 5.0  # once a rank has failed, how long the others may still run (they are
# usually blocked in a collective with it and would otherwise hold the test until timeout)
KILL_WAIT_S = 10.0  # how long to wait for a killed rank to exit


def _worker(rank: int, world_size: int, backend: str, port: int, fn: Callable, args: tuple, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, whatever it is
        result = {"ok": False, "error": traceback.format_exc()}
    try:
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        if not result["ok"]:
            os._exit(1)  # a non-zero exit tells the parent at once (see GRACE_S)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, backend: str = "gloo") -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes with
    torch.distributed initialised; returns their results in rank order.

    Fails (AssertionError) naming every rank that raised (with its traceback) or did not
    finish within ``timeout`` seconds (those are killed). Once a rank has failed, the
    others get ``GRACE_S`` seconds before they are killed and reported as hung."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    # The store lives as long as this call: every rank is a client of it.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="veloce_ranks_") as out:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, backend, store.port, fn, args, out), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        _wait(procs, timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        unkillable = []
        for r in hung:
            procs[r].kill()
            procs[r].join(KILL_WAIT_S)  # never wait forever, even on a process stuck in the kernel
            if procs[r].is_alive():
                unkillable.append(r)
        results, failures = [], []
        for r in range(world_size):
            path = Path(out) / f"rank{r}.pt"
            if r in unkillable:
                failures.append(f"rank {r} hung (no result after {timeout:.0f} s) and survived SIGKILL")
            elif r in hung:
                failures.append(f"rank {r} hung (no result after {timeout:.0f} s; killed)")
            elif not path.exists():
                failures.append(f"rank {r} exited with code {procs[r].exitcode} without a result")
            else:
                res = torch.load(path, weights_only=False)
                if res["ok"]:
                    results.append(res["value"])
                else:
                    failures.append(f"rank {r} raised:\n{res['error']}")
        if failures:
            raise AssertionError(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(failures))
        return results


def _wait(procs: list, timeout: float) -> None:
    """Until every process exits, ``timeout`` passes, or ``GRACE_S`` after one failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.05)


def env_world_sizes(default: tuple[int, ...] = (2,)) -> tuple[int, ...]:
    """World sizes to test: VELOCE_TEST_WORLD_SIZES="2,3,4" on bigger machines."""
    env = os.environ.get("VELOCE_TEST_WORLD_SIZES")
    return tuple(int(x) for x in env.split(",")) if env else default
