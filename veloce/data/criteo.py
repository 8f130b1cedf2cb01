"""A streaming reader for Criteo's raw click-log TSV (Kaggle DAC ``train.txt``/``test.txt``, 1TB days).

Layout, one impression per line, tab-separated: ``<label> <I1>..<I13> <C1>..<C26>``
(40 fields; the test layout has no label: 39 fields). ``I*`` are integers, possibly
negative; ``C*`` are 32-bit hashes written as 8 hex digits. Any field may be empty
(missing).

Reading is strict by default: a line with fewer or more fields than the layout is an
error, since a line cut short (a truncated or damaged file) would otherwise become a row
of missing values. Some copies strip trailing empty fields: ``strict=False`` reads their
short lines padded back with empty fields. The last line may lack its newline when it has
every field; a last line without newline and with too few fields is the cut end of a
truncated file: an error when strict, a warning otherwise.

How values become tensors, with no vocabulary pass:

- categorical: ``int(value, 16)`` (0 .. 2**32 - 1) as the int64 id of that feature;
  a missing value is :data:`MISSING_ID` (-1), which no hex value can produce. Each
  feature has its own table, so features need no offset.
- dense: ``log(1 + max(x, 0))`` (``log_dense=True``, the DLRM convention) or the raw
  value; missing is 0.
- label: 0 or 1.

Files are read as bytes, a batch of lines at a time, and converted with vectorised numpy;
a bad line raises :class:`~veloce.data.DataError` (a ``ValueError``) naming the file, the
line number and the field. Plain and gzip (``.gz``) files are read; a truncated or corrupt
``.gz`` raises ``DataError`` naming the file and the last line read.
"""

from __future__ import annotations

import gzip
import os
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Optional, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset

from veloce.data._errors import DataError
from veloce.data._sharding import current_shard

NUM_DENSE = 13
NUM_SPARSE = 26
MISSING_ID = -1
"""The id of an empty categorical field."""

DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

PathLike = Union[str, "os.PathLike[str]"]
Batch = tuple[tuple[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]

_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_SHIFTS = np.arange(28, -1, -4, dtype=np.int64)  # nibble weights of 8 hex digits


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line with its newline) of one file; a file that cannot be
    read to its end (a truncated or corrupt ``.gz``, an I/O error) raises DataError."""
    lineno = 0
    try:
        with _open(path) as f:
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except (EOFError, OSError, zlib.error) as exc:
        raise DataError(_unreadable(path, f"after line {lineno}" if lineno else "at its start", exc), path,
                        lineno + 1) from exc  # fmt: skip


def _unreadable(path: str, after: str, exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return (f"{path}: the compressed data ends {after}, before the end of the gzip stream "
                f"(a truncated .gz file?)")  # fmt: skip
    if isinstance(exc, (gzip.BadGzipFile, zlib.error)):
        return f"{path}: corrupt gzip data {after}: {exc}"
    return f"{path}: cannot be read {after}: {getattr(exc, 'strerror', None) or exc}"


def _count_lines(path: str) -> int:
    """Lines of one file, a last line without newline included (reads the whole file)."""
    total, last = 0, b"\n"
    try:
        with _open(path) as f:
            while chunk := f.read(1 << 22):
                total += chunk.count(b"\n")
                last = chunk[-1:]
    except (EOFError, OSError, zlib.error) as exc:
        where = f"after {total} or more lines" if total else "at its start"
        raise DataError(_unreadable(path, where, exc), path) from exc
    return total + (last != b"\n")


class CriteoTSV(IterableDataset):
    """Criteo raw TSV as an ``IterableDataset`` of batches.

    Use it with ``DataLoader(ds, batch_size=None, num_workers=...)``: the data set makes
    the batches itself. Rows ``[start, stop)`` (0-based over the concatenated files) are
    cut into global batches of ``batch_size`` consecutive rows; with ``world_size`` ranks
    each global batch is split into ``world_size`` contiguous, nearly equal parts and rank
    ``rank`` parses and yields its part (an empty one when a last batch has fewer rows than
    ranks). Every rank yields the same number of batches, each row is parsed exactly once
    over all ranks and DataLoader workers, and a rank sees its batches in file order for
    any ``num_workers`` (see ``veloce/data/_sharding.py``): training and metrics do not
    depend on the world size.

    Args:
        paths: one file or a list of files, read as one concatenated stream.
        batch_size: rows per global batch (all ranks together; each rank yields about
            ``batch_size / world_size`` of them); the last batch may be smaller.
        has_label: True for the train layout (40 fields), False for the test layout (39).
        start: first row to read (0-based), e.g. for a time-based split.
        stop: one past the last row to read; None reads to the end.
        log_dense: transform dense values with ``log(1 + max(x, 0))``; else keep them raw.
        drop_last: drop the last global batch if it is smaller than ``batch_size``.
        rank: this process's rank, for splitting batches across ranks.
        world_size: number of ranks.
        strict: a line with too few fields is an error (a line cut short); with False such
            lines are padded with empty (missing) fields, for copies that strip trailing
            empty fields. Lines with too many fields are an error either way.
        total_rows: the rows the files hold (or at least the rows up to ``stop``), when
            known: ``len()`` and :meth:`num_rows` then need no counting pass over the
            files, and reading raises ``DataError`` if the files end before that many rows
            (before ``stop``, when it is smaller).

    Raises:
        DataError: while reading, a malformed line (naming file, line and field), a line
            cut short, a truncated or corrupt ``.gz``, files shorter than ``total_rows``.

    Shape:
        Each batch is ``((dense, sparse), label)``, ``B`` this rank's part of the global batch:

        - dense: ``(B, 13)`` float32.
        - sparse: ``(B, 26)`` int64; ``C`` values in ``[0, 2**32)``, missing = ``MISSING_ID``.
        - label: ``(B,)`` float32 in {0, 1}, or None when ``has_label=False``.

    Example::

        >>> ds = CriteoTSV("criteo_kaggle_train_sample.tsv", batch_size=1024, stop=7000)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        >>> for (dense, sparse), label in loader:
        ...     logits = model(dense, sparse)
    """

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        batch_size: int = 4096,
        has_label: bool = True,
        start: int = 0,
        stop: int | None = None,
        log_dense: bool = True,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        strict: bool = True,
        total_rows: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("CriteoTSV: paths is empty")
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"CriteoTSV: no such file: {p}")
        if batch_size < 1:
            raise ValueError(f"CriteoTSV: batch_size must be >= 1, got {batch_size}")
        if start < 0:
            raise ValueError(f"CriteoTSV: start must be >= 0, got {start}")
        if stop is not None and stop < start:
            raise ValueError(f"CriteoTSV: stop must be None or >= start={start}, got {stop}")
        if not 0 <= rank < world_size:
            raise ValueError(f"CriteoTSV: rank must be in [0, world_size={world_size}), got {rank}")
        if not isinstance(strict, bool):
            raise TypeError(f"CriteoTSV: strict must be a bool, got {strict!r}")
        if total_rows is not None and total_rows < 0:
            raise ValueError(f"CriteoTSV: total_rows must be None or >= 0, got {total_rows}")
        self.batch_size = batch_size
        self.has_label = has_label
        self.start = start
        self.stop = stop
        self.log_dense = log_dense
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.strict = strict
        self.total_rows = total_rows
        self.num_fields = NUM_DENSE + NUM_SPARSE + (1 if has_label else 0)

    # ------------------------------------------------------------------ sizes
    def num_rows(self) -> int:
        """Rows in ``[start, stop)`` that the files hold.

        Counts the lines of every file once (the count is kept), unless ``total_rows``
        was given."""
        total = self.total_rows
        if total is None:
            total = self.__dict__.get("_counted")
            if total is None:
                total = self._counted = sum(_count_lines(p) for p in self.paths)
        stop = total if self.stop is None else min(self.stop, total)
        return max(stop - self.start, 0)

    def num_batches(self) -> int:
        """Number of global batches (each split over the ranks: every rank yields this many)."""
        full, rest = divmod(self.num_rows(), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        """Number of batches this rank yields (all its DataLoader workers together): the
        number of global batches, the same on every rank; see :meth:`num_rows` for what it
        reads."""
        return self.num_batches()

    # ------------------------------------------------------------------ reading
    def _lines(self) -> Iterator[tuple[bytes, str, int]]:
        """(line, path, 1-based line number) for rows start..stop-1."""
        row = 0
        for p in self.paths:
            for lineno, line in _read_lines(p):
                if self.stop is not None and row >= self.stop:
                    return
                if row >= self.start:
                    yield line, p, lineno
                row += 1
        want = self.total_rows
        if want is not None and self.stop is not None:
            want = min(self.stop, want)
        if want is not None and row < want:
            files = self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} .. {self.paths[-1]}"
            raise DataError(
                f"{files}: the data ends after {row} rows, but total_rows={self.total_rows} rows were announced "
                f"(a truncated file, or a row count larger than the file)",
                self.paths[-1],
            )

    def __iter__(self) -> Iterator[Batch]:
        shard = current_shard(self.rank, self.world_size)
        bs = self.batch_size
        full = slice(*shard.part(bs))  # this rank's lines of a full global batch
        pending: list[tuple[bytes, str, int]] = []  # the lines of the global batch being read
        for i, item in enumerate(self._lines()):
            if shard.owns(i // bs):
                pending.append(item)
                if len(pending) == bs:
                    yield self._parse_part(pending[full])
                    pending = []
        # the last global batch is short: its parts are cut by its own length
        if pending and not self.drop_last:
            yield self._parse_part(pending[slice(*shard.part(len(pending)))])

    def _parse_part(self, items: list[tuple[bytes, str, int]]) -> Batch:
        """This rank's part of a global batch; zero rows (a last batch of fewer rows than ranks)
        give tensors of zero rows."""
        if items:
            return self._parse(items)
        label = torch.zeros(0, dtype=torch.float32) if self.has_label else None
        dense = torch.zeros(0, NUM_DENSE, dtype=torch.float32)
        return (dense, torch.zeros(0, NUM_SPARSE, dtype=torch.int64)), label

    # ------------------------------------------------------------------ parsing
    def _parse(self, items: list[tuple[bytes, str, int]]) -> Batch:
        n = self.num_fields
        rows = []
        for line, path, lineno in items:
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) > n:
                raise DataError(
                    f"{path}:{lineno}: {len(fields)} tab-separated fields, expected at most {n} "
                    f"({self._layout()}{'' if self.has_label else '; use has_label=True for the train layout'})",
                    path, lineno,
                )  # fmt: skip
            if len(fields) < n:
                self._short_line(line, len(fields), path, lineno)
                fields.extend([b""] * (n - len(fields)))
            rows.append(fields)
        lab_off = 1 if self.has_label else 0
        try:
            label = None
            if self.has_label:
                lab = np.array([r[0] for r in rows])  # numpy picks the width: nothing is cut
                if lab.dtype.itemsize != 1 or not ((lab == b"0") | (lab == b"1")).all():
                    raise _Bad
                label = torch.from_numpy((lab == b"1").astype(np.float32))
            dense_s = np.array([r[lab_off : lab_off + NUM_DENSE] for r in rows])
            dense_s[dense_s == b""] = b"0"
            dense = dense_s.astype(np.int64)
            cat = np.array([r[lab_off + NUM_DENSE :] for r in rows])
            if cat.dtype.itemsize > 8:
                raise _Bad
            sparse = _hex_ids(cat.astype("S9"))
        except (ValueError, OverflowError, _Bad):
            self._raise_first_error(rows, items)
            raise  # _raise_first_error always raises; this keeps linters content
        if self.log_dense:
            dense_f = np.log1p(np.maximum(dense, 0).astype(np.float64)).astype(np.float32)
        else:
            dense_f = dense.astype(np.float32)
        return (torch.from_numpy(dense_f), torch.from_numpy(sparse)), label

    def _layout(self) -> str:
        return f"{'label, ' if self.has_label else ''}13 integer and 26 categorical fields"

    def _short_line(self, line: bytes, count: int, path: str, lineno: int) -> None:
        """A line with ``count`` < num_fields fields: an error when strict; else padded, with
        a warning when it is the file's unterminated last line (maybe a cut one)."""
        n, where = self.num_fields, f"{path}:{lineno}"
        if not line.endswith(b"\n"):
            what = f"the file ends inside this line ({count} of {n} tab-separated fields and no newline)"
            if not self.strict:
                warnings.warn(f"CriteoTSV: {where}: {what}; read with its missing fields empty (strict=False), "
                              f"but if the file was cut short this row is damaged", stacklevel=4)  # fmt: skip
                return
            raise DataError(f"{where}: {what}: a truncated file?", path, lineno)
        if self.strict:
            hint = "; use has_label=False for the test layout" if self.has_label and count == n - 1 else ""
            raise DataError(
                f"{where}: {count} tab-separated fields, expected {n} ({self._layout()}): a line cut short, or a copy "
                f"that strips trailing empty fields (strict=False, config data.strict: false, reads those as "
                f"missing values){hint}",
                path, lineno,
            )  # fmt: skip

    def _raise_first_error(self, rows: list[list[bytes]], items: list[tuple[bytes, str, int]]) -> None:
        lab_off = 1 if self.has_label else 0
        for fields, (_, path, lineno) in zip(rows, items):
            where = f"{path}:{lineno}"
            if self.has_label and fields[0] not in (b"0", b"1"):
                raise DataError(f"{where}: label must be 0 or 1, got {fields[0]!r}", path, lineno)
            for j, v in enumerate(fields[lab_off : lab_off + NUM_DENSE]):
                if v:
                    try:
                        x = int(v)
                        if not -(2**63) <= x < 2**63:
                            raise OverflowError
                    except (ValueError, OverflowError):
                        raise DataError(
                            f"{where}: field {DENSE_NAMES[j]} (column {lab_off + j + 1}) must be an "
                            f"integer or empty, got {v!r}",
                            path, lineno,
                        ) from None  # fmt: skip
            for j, v in enumerate(fields[lab_off + NUM_DENSE :]):
                if v and (len(v) != 8 or any(_HEX[c] == 255 for c in v)):
                    raise DataError(
                        f"{where}: field {SPARSE_NAMES[j]} (column {lab_off + NUM_DENSE + j + 1}) must be "
                        f"8 hex digits or empty, got {v!r}",
                        path, lineno,
                    )  # fmt: skip
        raise DataError(f"{items[0][1]}: malformed batch at line {items[0][2]}", items[0][1])  # unreachable


class _Bad(Exception):
    pass


def _hex_ids(cat: np.ndarray) -> np.ndarray:
    """(B, 26) array of 'S9' hex strings -> (B, 26) int64 ids; raises _Bad on a malformed value."""
    b = cat.shape[0]
    raw = np.ascontiguousarray(cat).view(np.uint8).reshape(b, NUM_SPARSE, 9)
    empty = raw[:, :, 0] == 0
    nib = _HEX[raw[:, :, :8]]
    good = empty | ((nib != 255).all(axis=2) & (raw[:, :, 8] == 0))
    if not good.all():
        raise _Bad
    ids = (nib.astype(np.int64) << _SHIFTS).sum(axis=2)
    ids[empty] = MISSING_ID
    return ids
