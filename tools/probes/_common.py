"""What the graph probes share: the settle hook silenced during capture, and back-to-back timing."""
import time

import torch

from veloce import table as T

_settle = T.HashTable.settle


def _settle_unless_capturing(self, *a, **k):
    if torch.cuda.is_current_stream_capturing():  # a captured step must not read its deferred counts
        return
    return _settle(self, *a, **k)


T.HashTable.settle = _settle_unless_capturing  # applied on import


def back_to_back(fn, n):
    """ms per call of fn(0..n-1), run back to back between two device syncs."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n
