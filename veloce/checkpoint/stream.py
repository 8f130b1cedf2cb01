"""Tables written and read in chunks (private to :mod:`veloce.checkpoint`): the rows of a
tiered table (``storage`` other than ``Device()``, possibly larger than RAM) never sit in
memory all at once.

A rank's table file stays one safetensors file (what the loader of every veloce version
reads): :func:`write_streamed` lays out its header from the tables' row counts, then
writes each chunk of ``export_chunks`` at its rows' place in each tensor.
:func:`read_chunks` reads a table's entries back in slices of :data:`CHUNK_ROWS` rows.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from safetensors import safe_open

from veloce.checkpoint.files import ENTRIES, CheckpointError, fsync, sha256

__all__ = ["CHUNK_ROWS", "TableSource", "read_chunks", "source", "whole", "write_streamed"]

CHUNK_ROWS = 1 << 20  # entries per chunk written or read: the most rows of a table in memory at once

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}  # fmt: skip


class TableSource(NamedTuple):
    """One table's part of a streamed file: ``rows`` entries of the given widths and dtypes
    (per entry name), yielded by ``chunks()`` in dicts of at most :data:`CHUNK_ROWS`."""

    name: str
    rows: int
    widths: dict[str, tuple[int, ...]]  # keys: (), weights: (dim,), optimizer_state: (S,), scores: ()
    dtypes: dict[str, torch.dtype]
    chunks: Callable[[], Iterable[dict[str, torch.Tensor]]]


def source(name: str, module: Any) -> TableSource:
    """A tiered table's :class:`TableSource`: its ``export_chunks(CHUNK_ROWS)``."""
    t = module.table
    return TableSource(name, len(t), {"keys": (), "weights": (t.dim,), "optimizer_state": (t.state_dim,), "scores": ()},
                       {"keys": torch.int64, "weights": t.dtype, "optimizer_state": t.state_dtype,
                        "scores": torch.int64}, lambda: t.export_chunks(CHUNK_ROWS))  # fmt: skip


def whole(name: str, tensors: dict[str, torch.Tensor]) -> TableSource:
    """A table exported whole (``tensors[name/<entry>]``) as a :class:`TableSource` of one chunk."""
    out = {k: tensors[f"{name}/{k}"] for k in ENTRIES}
    return TableSource(name, out["keys"].numel(), {k: tuple(v.shape[1:]) for k, v in out.items()},
                       {k: v.dtype for k, v in out.items()}, lambda: [out])  # fmt: skip


def write_streamed(path: Path, sources: list[TableSource]) -> dict[str, Any]:
    """Writes the tables of ``sources`` to the safetensors file ``path`` chunk by chunk,
    durably; returns its manifest entry {size, sha256}.

    Raises:
        CheckpointError: a table yields more or fewer entries than ``rows`` (it changed
            while it was saved).
    """
    header: dict[str, Any] = {}
    at: dict[str, int] = {}  # tensor name -> its first byte in the data section
    offset = 0
    for src in sources:
        for k in ENTRIES:
            shape = [src.rows, *src.widths[k]]
            size = math.prod(shape) * src.dtypes[k].itemsize
            header[f"{src.name}/{k}"] = {"dtype": _DTYPES[src.dtypes[k]], "shape": shape,
                                         "data_offsets": [offset, offset + size]}  # fmt: skip
            at[f"{src.name}/{k}"] = offset
            offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        base = f.tell()
        f.truncate(base + offset)
        for src in sources:
            done = 0
            for chunk in src.chunks():
                n = chunk["keys"].numel()
                if done + n > src.rows:
                    done += n
                    break
                for k in ENTRIES:
                    t = chunk[k].detach().to("cpu", src.dtypes[k]).contiguous().reshape(-1)
                    f.seek(base + at[f"{src.name}/{k}"] + done * math.prod(src.widths[k]) * src.dtypes[k].itemsize)
                    f.write(t.view(torch.uint8).numpy().tobytes())
                done += n
            if done != src.rows:
                raise CheckpointError(
                    f"table {src.name!r} exported {'more' if done > src.rows else 'fewer'} entries than the "
                    f"{src.rows} it held when the save began: it changed while it was saved; save with no training "
                    f"step running"
                )  # fmt: skip
    fsync(path)
    return {"size": path.stat().st_size, "sha256": sha256(path)}


def read_chunks(path: Path, name: str, rows: int,
                keep: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:  # fmt: skip
    """Table ``name``'s ``rows`` entries in the safetensors file ``path``, in slices of at
    most :data:`CHUNK_ROWS` rows, each passed through ``keep`` (the rows this rank owns)."""
    with safe_open(str(path), "pt") as f:
        slices = {k: f.get_slice(f"{name}/{k}") for k in ENTRIES}
        for start in range(0, rows, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, rows)
            yield keep({k: s[start:end] for k, s in slices.items()})
