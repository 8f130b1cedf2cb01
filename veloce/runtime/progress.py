"""veloce's progress bars: tqdm with a write lock of this process alone.

tqdm's default lock pairs a thread lock with a multiprocessing lock that every process
forked after the first bar shares. A forked process killed while holding it (a checkpoint
writer stopped by SIGKILL mid-save, say) leaves every later bar of the parent waiting
forever, even a disabled one: creating a bar takes the lock. veloce's bars write from one
process at a time (rank 0), so a thread lock is all they need.
"""

from __future__ import annotations

import threading

from tqdm.auto import tqdm

__all__ = ["Bar"]


class Bar(tqdm):
    """``tqdm.auto.tqdm`` whose lock is not shared with forked processes."""


Bar.set_lock(threading.RLock())
