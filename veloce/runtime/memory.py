"""Host-memory hints for large table tensors.

Embedding tables are read and written at random rows; with 4 KiB pages, a multi-GB
table spends much of a lookup on TLB misses. Where the kernel offers transparent huge
pages in ``madvise`` mode (the common default), asking for them on the table's memory
before it is first touched makes the kernel back it with 2 MiB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_MADV_HUGEPAGE = 14
_PAGE = 4096
_MIN_BYTES = 4 << 20  # below this the TLB is not the bottleneck
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _libc = None


def empty_table(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor for table state; large CPU tensors get huge pages when the
    kernel allows it (the hint is best effort and never fails)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if _libc is not None and t.device.type == "cpu" and nbytes >= _MIN_BYTES:
        start = t.data_ptr()
        aligned = (start + _PAGE - 1) // _PAGE * _PAGE
        length = (start + nbytes - aligned) // _PAGE * _PAGE
        if length > 0:
            _libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return t.zero_()
