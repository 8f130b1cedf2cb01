"""Where a published model lives: versions of parts (tensors), each visible once its
manifest (the commit marker) exists, and the lease that lets one publisher write.

A version holds parts, each a dict of tensors under a name: ``dense`` (the model's dense
parameters and buffers), ``t/<table>/r<rank>`` (one rank's rows of one table: ``keys``
(N,), ``weights`` (N, D), ``removed`` (R,) tombstones; read back with ``keys`` ascending)
and, for a full snapshot,
``c/<table>/r<rank>`` (the ids changed since the version before, for readers' caches).
:class:`ServingStore` is the interface every store implements; :class:`FileStore` keeps
it in a directory (safetensors files, JSON manifests).
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from typing import Any, Iterator, Optional, Sequence

import torch

__all__ = ["FileStore", "LeaseHeld", "ServingStore", "VersionMissing", "lease_held", "lease_holder_gone", "lease_record"]


class LeaseHeld(RuntimeError):
    """Another publisher holds the store's lease (and it has not expired).

    Attributes:
        holder: the lease as the store keeps it (:func:`lease_record`: ``owner``,
            ``expires`` in Unix time, ``host`` and ``pid`` of the process that took it), or
            None where the store does not know it.
    """

    def __init__(self, message: str, holder: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.holder = holder


def _process_space() -> Optional[str]:
    """What makes a process id mean one process: this boot of the kernel and this process
    id namespace (containers sharing a host name have their own), or None where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def lease_record(owner: str, expires: float) -> dict[str, Any]:
    """A lease as a store keeps it: its owner, its end, and the process that took it (so
    that a publisher restarted on the same host can tell that the holder is gone)."""
    return {"owner": owner, "expires": float(expires), "host": socket.gethostname(), "pid": os.getpid(),
            "pid_space": _process_space()}  # fmt: skip


def lease_held(store: ServingStore, holder: dict[str, Any]) -> LeaseHeld:
    """The refusal of a lease held by ``holder``: who, until when, and what to do."""
    expires = float(holder.get("expires", time.time()))
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
    where = f", process {holder['pid']} on {holder['host']}" if holder.get("pid") is not None else ""
    return LeaseHeld(
        f"{store!r} is leased to another publisher, {holder.get('owner')!r}{where}, until {until} "
        f"({max(0.0, expires - time.time()):.0f} s from now): one publisher writes a store. Stop that publisher, "
        f"or, if it is dead (a run restarted after a crash): wait until then; restart with the dead one's owner "
        f"(Publisher(owner=...), serving.owner in a config), which renews its lease at once; or pass "
        f"take_over=True (serving.take_over), which breaks the lease only when its holder is a process of this "
        f"host that no longer runs. A shorter lease_ttl (serving.lease_ttl) ends a dead publisher's lease sooner",
        holder,
    )  # fmt: skip


def lease_holder_gone(holder: dict[str, Any]) -> bool:
    """Whether the process that took the lease ``holder`` is known to be gone: it ran on
    this host (by name), in this boot and process id namespace (a container sharing the
    host's name has its own), and no process of its id runs here now. Anything unknown
    counts as alive."""
    pid, space = holder.get("pid"), _process_space()
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    if space is None or holder.get("pid_space") != space:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        return False
    return False


class VersionMissing(LookupError):
    """A version that is not committed (never was, or was deleted as superseded)."""


class ServingStore(abc.ABC):
    """The calls a :class:`~veloce.serving.Publisher` writes through and readers read
    through (see the module docstring). Parts of a version are written after
    :meth:`begin` and become visible with :meth:`commit`; a version begun and never
    committed is garbage that :meth:`delete` removes."""

    # ---- lease -----------------------------------------------------------------------------
    @abc.abstractmethod
    def acquire(self, owner: str, ttl: float, take_over_from: Optional[str] = None) -> None:
        """Takes (or renews) the lease for ``owner`` for ``ttl`` seconds.

        Args:
            owner: the publisher's name.
            ttl: seconds the lease lasts.
            take_over_from: the owner of a running lease to take anyway (atomically: only
                while that one still holds it). The caller has made sure that it is dead.

        Raises:
            LeaseHeld: another owner (not ``take_over_from``) holds a lease that has not
                expired; its ``holder`` says who.
        """

    @abc.abstractmethod
    def lease(self) -> Optional[dict[str, Any]]:
        """The running lease (:func:`lease_record`'s fields), or None when none runs."""

    @abc.abstractmethod
    def release(self, owner: str) -> None:
        """Gives the lease back if ``owner`` holds it."""

    # ---- versions --------------------------------------------------------------------------
    @abc.abstractmethod
    def committed(self) -> list[int]:
        """The committed versions, ascending."""

    @abc.abstractmethod
    def begun(self) -> list[int]:
        """Versions begun (written to), committed or not, ascending."""

    @abc.abstractmethod
    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of a committed version.

        Raises:
            VersionMissing: ``version`` is not committed.
        """

    @abc.abstractmethod
    def begin(self, version: int) -> None:
        """Marks ``version`` as being written (so that a publisher killed before its commit
        leaves garbage that the next one finds)."""

    @abc.abstractmethod
    def write_part(self, version: int, part: str, tensors: dict[str, torch.Tensor]) -> None:
        """Writes one part of a version begun (CPU tensors; a part of rows has its ``keys``
        in any order: a store that reads by id sorts them as it needs)."""

    @abc.abstractmethod
    def commit(self, version: int, manifest: dict[str, Any]) -> None:
        """Makes ``version`` visible: its manifest is the commit marker, written last and
        atomically."""

    @abc.abstractmethod
    def read_part(self, version: int, part: str) -> dict[str, torch.Tensor]:
        """Every tensor of one part of a committed version."""

    def lookup(self, parts: Sequence[tuple[int, str]], ids: torch.Tensor
               ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        """For each ``(version, part)`` of rows: ``(found (N,) bool, rows (N, D), removed
        (N,) bool)`` of ``ids`` (N,) distinct; rows where not found are unspecified.
        This one reads whole parts (kept in memory by :meth:`read_part`'s cache, if any)."""
        out = []
        for version, part in parts:
            data = self.read_part(version, part)
            keys, weights = data["keys"], data["weights"]
            at = torch.searchsorted(keys, ids).clamp(max=max(keys.numel() - 1, 0))
            found = keys[at] == ids if keys.numel() else torch.zeros_like(ids, dtype=torch.bool)
            rows = weights[at] if keys.numel() else weights.new_zeros(ids.numel(), weights.size(1))
            removed = torch.isin(ids, data["removed"])
            out.append((found, rows, removed & ~found))
        return out

    @abc.abstractmethod
    def delete(self, version: int) -> None:
        """Removes a version: its manifest first (it stops being visible), then its data."""

    def close(self) -> None:
        """Releases the store's resources."""


def _vname(version: int) -> str:
    return f"{int(version):012d}"


class FileStore(ServingStore):
    """A serving store in a local directory (or a mounted object store): per version a
    folder of safetensors files (one per part) and a JSON manifest beside them, written to
    a temporary name and renamed, so that a version is visible exactly when its manifest
    exists.

    Layout: ``data/<version>/<part>.safetensors``, ``manifests/<version>.json``,
    ``lease.json`` (guarded by ``lease.lock``).

    Args:
        path: the store's directory (created if missing).
        cache_parts: how many parts a reader keeps in memory (the parts of the versions it
            reads: a snapshot and its deltas).
    """

    def __init__(self, path: str | os.PathLike, cache_parts: int = 64) -> None:
        self.path = os.fspath(path)
        kind = type(self).__name__
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"{kind}: path {self.path!r} is a file, not a serving store's directory: pass the "
                             f"directory a Publisher wrote (or a new one, for a Publisher to start)")  # fmt: skip
        if os.path.isdir(self.path):
            entries = sorted(os.listdir(self.path))
            if entries and not {"manifests", "data"} & set(entries):
                raise ValueError(
                    f"{kind}: path {self.path!r} is not a serving store (it holds {entries[:5]}"
                    f"{' ...' if len(entries) > 5 else ''}, and no manifests/ or data/): pass the directory a "
                    f"Publisher wrote, or a new or empty one for a Publisher to start a store in"
                )  # fmt: skip
        os.makedirs(os.path.join(self.path, "data"), exist_ok=True)
        os.makedirs(os.path.join(self.path, "manifests"), exist_ok=True)
        self.cache_parts = int(cache_parts)
        self._parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    # ---- lease -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lease_lock(self) -> Iterator[None]:
        with open(os.path.join(self.path, "lease.lock"), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read_lease(self) -> Optional[dict[str, Any]]:
        try:
            with open(os.path.join(self.path, "lease.json")) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def acquire(self, owner: str, ttl: float, take_over_from: Optional[str] = None) -> None:
        with self._lease_lock():
            held = self._read_lease()
            now = time.time()
            if held is not None and held["owner"] not in (owner, take_over_from) and held["expires"] > now:
                raise lease_held(self, held)
            # not synced: the lease guards against a second live process, and a crash of the
            # machine ends its holder too (a lost or torn lease file reads as free)
            self._write_json("lease.json", lease_record(owner, now + float(ttl)), sync=False)

    def lease(self) -> Optional[dict[str, Any]]:
        with self._lease_lock():
            held = self._read_lease()
        return held if held is not None and held["expires"] > time.time() else None

    def release(self, owner: str) -> None:
        with self._lease_lock():
            held = self._read_lease()
            if held is not None and held["owner"] == owner:
                os.remove(os.path.join(self.path, "lease.json"))

    # ---- versions --------------------------------------------------------------------------
    def _write_json(self, name: str, value: Any, sync: bool = True) -> None:
        final = os.path.join(self.path, name)
        tmp = f"{final}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(value, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic: readers see the old file or the new one, whole

    def committed(self) -> list[int]:
        names = os.listdir(os.path.join(self.path, "manifests"))
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def begun(self) -> list[int]:
        names = os.listdir(os.path.join(self.path, "data"))
        return sorted({int(n) for n in names if n.isdigit()} | set(self.committed()))

    def manifest(self, version: int) -> dict[str, Any]:
        try:
            with open(os.path.join(self.path, "manifests", _vname(version) + ".json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise VersionMissing(f"{self!r} has no committed version {version} ({self._committed_text()})") from None

    def _committed_text(self) -> str:
        """The newest committed versions and what to do about a missing one, for errors."""
        have = self.committed()
        if not have:
            return "it holds none: publish one first (veloce.serving.Publisher)"
        return (f"committed: {'... ' if len(have) > 5 else ''}{have[-5:]}; pass one of them, or None for the newest "
                f"(older ones are deleted as superseded)")  # fmt: skip

    def _part_missing(self, version: int, part: str) -> VersionMissing:
        """The error for a part that is not in the store."""
        if int(version) not in self.committed():
            return VersionMissing(f"{self!r} has no committed version {version} ({self._committed_text()})")
        base = self._part_file(version, part)[: -len(".safetensors")]
        for suffix, kind in ((".rocksdb", "RocksDBStore"), (".safetensors", "FileStore")):
            if kind != type(self).__name__ and os.path.exists(base + suffix):
                return VersionMissing(f"{self!r}: the part {part!r} of version {version} was written by a {kind}: "
                                      f"open this directory with veloce.serving.{kind}({self.path!r})")  # fmt: skip
        return VersionMissing(f"{self!r}: version {version} has no part {part!r} (deleted as superseded, or never "
                              f"written); refresh() to the newest committed version")  # fmt: skip

    def begin(self, version: int) -> None:
        os.makedirs(os.path.join(self.path, "data", _vname(version)), exist_ok=True)

    def _part_file(self, version: int, part: str) -> str:
        return os.path.join(self.path, "data", _vname(version), part.replace("/", "~") + ".safetensors")

    def write_part(self, version: int, part: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if part.startswith("t/"):  # rows by id: read_part's lookups search them
            keys = tensors["keys"]
            if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
                order = torch.argsort(keys)
                tensors = {**tensors, "keys": keys.index_select(0, order),
                           "weights": tensors["weights"].index_select(0, order)}  # fmt: skip
        final = self._part_file(version, part)
        tmp = final + ".tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, final)

    def commit(self, version: int, manifest: dict[str, Any]) -> None:
        self._write_json(os.path.join("manifests", _vname(version) + ".json"), manifest)

    def read_part(self, version: int, part: str) -> dict[str, torch.Tensor]:
        key = (int(version), part)
        data = self._parts.get(key)
        if data is None:
            from safetensors.torch import load_file

            path = self._part_file(version, part)
            if not os.path.exists(path):
                raise self._part_missing(version, part)
            data = load_file(path)
            while len(self._parts) >= self.cache_parts:
                self._parts.pop(next(iter(self._parts)))
            self._parts[key] = data
        return data

    def delete(self, version: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, "manifests", _vname(version) + ".json"))
        shutil.rmtree(os.path.join(self.path, "data", _vname(version)), ignore_errors=True)
        for key in [k for k in self._parts if k[0] == version]:
            del self._parts[key]

    def nbytes(self) -> int:
        """Bytes of every file under the store's directory."""
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.path) for f in fs)
