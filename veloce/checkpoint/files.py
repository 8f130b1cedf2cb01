"""How a checkpoint is stored (private to :mod:`veloce.checkpoint`): the directory's files,
their verification, optimizer state dicts as JSON + tensors, and the collectives.

Every durability point of a save goes through :func:`fsync` (the crash tests hook it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from veloce.runtime.progress import Bar

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
DENSE_FILE = "dense.safetensors"
ENTRIES = ("keys", "weights", "optimizer_state", "scores")
PROGRESS_ROWS = 1 << 20  # a progress bar is shown (rank 0) when more table rows than this move


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or is refused; the message names the file or field,
    what is wrong and what to do. A refused load leaves the model and optimizer unchanged."""


# ---- files --------------------------------------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Writes ``tensors`` to ``path`` durably; returns its manifest entry {size, sha256}."""
    save_file(_storable(tensors), str(path))
    fsync(path)
    return {"size": path.stat().st_size, "sha256": sha256(path)}


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, no two sharing memory (tied weights are stored twice)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def write_durably(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it."""
    with open(path, "wb") as f:
        f.write(data)
    fsync(path)


def fsync(path: Path) -> None:
    """Flushes a file or directory to disk (every durability point of a save goes through here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the manifest and the marker ------------------------------------------------------------
def is_committed(path: Path) -> bool:
    """Whether ``path`` holds a marker that matches its manifest (files are not read)."""
    try:
        open_manifest(path)
    except CheckpointError:
        return False
    return True


def require_dir(path: Path) -> None:
    """Refuses a ``path`` that is not a directory."""
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(f"{path} {what}; a checkpoint is a directory written by veloce.checkpoint.save")


def open_manifest(path: Path) -> dict:
    """The manifest of a committed checkpoint, checked against its marker; refuses
    anything else with a message that says why."""
    require_dir(path)
    if not (path / MARKER).is_file():
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"{path} is not a veloce checkpoint: it has no {MANIFEST} and no {MARKER} marker")
        raise CheckpointError(
            f"{path} is not committed: the {MARKER} marker is missing, so its writer was interrupted; "
            f"load the newest committed checkpoint instead (veloce.checkpoint.latest)"
        )
    data = read_bytes(path, MANIFEST, f"{MANIFEST} is missing although {MARKER} exists; the checkpoint is damaged")
    try:
        expected = json.loads((path / MARKER).read_text())["manifest_sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path / MARKER} is unreadable ({exc}); the checkpoint is not committed")
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(
            f"{path / MANIFEST}: sha256 {hashlib.sha256(data).hexdigest()[:16]}... differs from the one in "
            f"{MARKER} ({str(expected)[:16]}...); the manifest is corrupt or was edited"
        )
    return parse_manifest(path, data)


def parse_manifest(path: Path, data: bytes) -> dict:
    """The manifest in ``data`` (the bytes of ``path/manifest.json``), after checking that it
    is JSON of this format version with every field."""
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{path / MANIFEST} is not valid JSON ({exc}); the checkpoint is corrupt")
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / MANIFEST}: format_version is {version!r} but this veloce reads format_version "
            f"{FORMAT_VERSION}; load it with the veloce version that wrote it"
        )
    missing = [k for k in ("world_size", "step", "extra", "tables", "dense", "optimizer", "files") if k not in manifest]
    if missing:
        raise CheckpointError(f"{path / MANIFEST} lacks the field(s) {missing}; the checkpoint is corrupt")
    return manifest


def read_bytes(path: Path, name: str, missing: str) -> bytes:
    """The bytes of ``path/name``; CheckpointError with ``missing`` when it is absent."""
    try:
        return (path / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing}")


def verify_file(path: Path, fname: str, files: dict) -> None:
    """Refuses ``path/fname`` unless it is listed in the manifest's ``files`` and its size
    and sha256 are the listed ones."""
    meta = files.get(fname)
    if meta is None or Path(fname).name != fname:
        raise CheckpointError(f"{path / MANIFEST} lists no valid entry for {fname!r}; the checkpoint is corrupt")
    f = path / fname
    if not f.is_file():
        raise CheckpointError(f"{f} is missing (listed in {MANIFEST}); the checkpoint is incomplete")
    size = f.stat().st_size
    if size != meta["size"]:
        raise CheckpointError(
            f"{f} is {size} bytes but {MANIFEST} says {meta['size']}: the file was truncated or overwritten"
        )
    digest = sha256(f)
    if digest != meta["sha256"]:
        raise CheckpointError(
            f"{f}: sha256 {digest[:16]}... differs from {MANIFEST}'s {meta['sha256'][:16]}...: the file is corrupt"
        )


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ---- optimizer state dicts as JSON + tensors (no pickle) ------------------------------------
def encode(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for ``obj``; tensors go to ``tensors[key/...]`` and are referenced by name."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{key}/{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[encode(k, f"{key}/k{i}", tensors), encode(v, f"{key}/{k}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}  # fmt: skip
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"optimizer state {key!r} is a {type(obj).__name__}, which a checkpoint cannot store")


def decode(obj: Any, f) -> Any:
    """Inverse of :func:`encode`; tensors are read from the open safetensors file ``f``."""
    if isinstance(obj, list):
        return [decode(v, f) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        if obj["__tensor__"] not in f.keys():
            raise CheckpointError(f"{DENSE_FILE}: optimizer tensor {obj['__tensor__']!r} is missing")
        return f.get_tensor(obj["__tensor__"])
    if "__tuple__" in obj:
        return tuple(decode(v, f) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {decode(k, f): decode(v, f) for k, v in obj["__items__"]}
    return {k: decode(v, f) for k, v in obj.items()}


# ---- torch.distributed ----------------------------------------------------------------------
def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(obj: Any) -> list:
    """Every rank's ``obj`` (small JSON-like values), in rank order."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on this rank; if it raised on any rank, every rank raises CheckpointError
    naming the ranks (so no rank waits for the others forever). Returns ``fn()``."""
    if world()[1] == 1:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # reported to every rank below
        error = exc
    errors = gather(None if error is None else f"{type(error).__name__}: {error}")
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        text = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise CheckpointError(f"checkpoint failed on rank(s) {sorted(failed)}: {text}") from error
    return result


def progress(items: Iterable, rows: int, desc: str) -> Iterable:
    """``items`` with a progress bar on rank 0 when more than PROGRESS_ROWS rows move."""
    return Bar(items, desc=desc, disable=rows <= PROGRESS_ROWS or world()[0] != 0, leave=False)

