"""The public checkpoint functions (:mod:`veloce.checkpoint` exports them): saving a
committed directory, loading it back, finding and describing checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from veloce.checkpoint import files as _io
from veloce.checkpoint import model as _model
from veloce.checkpoint import stream as _stream
from veloce.checkpoint.files import DENSE_FILE, ENTRIES, FORMAT_VERSION, MANIFEST, MARKER, CheckpointError

__all__ = ["save", "load", "latest", "save_in", "describe"]

_STEP_DIR = re.compile(r"step_\d{9}")
_DEBRIS = re.compile(r"\.step_\d{9}\.(tmp|old)-[0-9a-f]+")

PathLike = Union[str, os.PathLike]


# ---- the API -----------------------------------------------------------------------------
def save(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: int = 0,
    extra: Optional[dict] = None,
    overwrite: bool = False,
) -> Path:
    """Writes a checkpoint directory at ``path`` atomically (collective: every rank calls it).

    Args:
        path: the checkpoint directory (same on every rank; a shared file system).
        model: the model (a DDP-style wrapper whose ``.module`` is the model also works).
        optimizer: a :class:`veloce.CombinedOptimizer` or a torch optimizer, or None.
        step: the training step, returned by :func:`load`.
        extra: a JSON-serialisable dict (data position, RNG state as lists of ints, ...).
        overwrite: replace a committed checkpoint at ``path`` instead of refusing.

    Returns:
        ``path`` as a :class:`pathlib.Path`.
    """
    path, model = Path(path), _model.unwrap(model)
    rank, _ = _io.world()
    _check_save_args(step, extra)
    _io.agree(lambda: _model.check_flushed(model))
    tmp = Path(_io.broadcast(_io.agree(lambda: str(_prepare(path, overwrite)) if rank == 0 else None)))
    try:
        written = _io.gather(_io.agree(lambda: _write_rank_files(tmp, rank, model, optimizer)))
        _io.agree(lambda: _commit(tmp, path, _manifest(model, optimizer, step, extra, written)) if rank == 0 else None)
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Restores ``model`` (and ``optimizer``) from the checkpoint at ``path`` (collective).

    Everything is read and verified first (marker, manifest, format version, file sizes
    and sha256, table dims, optimizer widths, dense shapes), on every rank, before any
    rank changes its model. Sharded tables keep the keys this rank owns under the
    module's current sharding, whatever world size wrote the checkpoint.

    Args:
        path: a committed checkpoint directory (see :func:`latest`).
        model: the model to restore in place (wrapped or not).
        optimizer: the optimizer to restore, or None to leave optimizers alone.
        strict: refuse tables or dense tensors present on one side only (and optimizer
            state missing from the checkpoint); with False those are skipped.

    Returns:
        ``{"step": int, "extra": dict, "world_size": int, "format_version": int}``.

    Raises:
        CheckpointError: the checkpoint is refused; nothing was changed.
    """
    path, model = Path(path), _model.unwrap(model)
    _model.check_flushed(model, "loading")
    plan = _io.agree(lambda: _model.read(path, model, optimizer, strict))
    undo = _model.Undo(plan, optimizer)
    try:
        _io.agree(lambda: _model.apply(plan, optimizer))
    except Exception:  # here or on another rank: every rank rolls back
        undo.restore()
        raise
    return plan.info


def latest(directory: PathLike) -> Optional[Path]:
    """The newest committed checkpoint ``directory/step_<9 digits>``, or None.

    Directories without a valid ``COMMITTED`` marker (interrupted writes) are ignored."""
    for path in reversed(_step_dirs(Path(directory))):
        if _io.is_committed(path):
            return path
    return None


def save_in(
    directory: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: int,
    extra: Optional[dict] = None,
    keep_last: int = 3,
    overwrite: bool = False,
) -> Path:
    """:func:`save` to ``directory/step_<step:09d>``, then (rank 0) deletes committed
    checkpoints older than the newest ``keep_last`` and the debris of interrupted writes.

    One writer per ``directory``. "Newest" is by step number, as in :func:`latest`; the
    checkpoint just written is always kept. Collective. Returns the new checkpoint's path.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    directory = Path(directory)
    path = save(directory / f"step_{step:09d}", model, optimizer, step=step, extra=extra, overwrite=overwrite)
    rank, _ = _io.world()
    _io.agree(lambda: _prune(directory, keep_last, path) if rank == 0 else None)
    return path


def describe(path: PathLike, *, verify: bool = False) -> dict[str, Any]:
    """What a checkpoint holds, read from its manifest (no model needed; for ``veloce inspect``).

    Args:
        path: a checkpoint directory, committed or not.
        verify: also check every file's sha256 (reads everything).

    Returns:
        ``{"path", "committed", "format_version", "world_size", "step", "extra",
        "tables": [{"name", "dim", "rows", "state_width", "dtype", "optimizer", "shards"}],
        "dense": {"count", "bytes"}, "files": [{"name", "size", "present", "ok"}]}``
        (``ok`` is None unless ``verify``).
    """
    path = Path(path)
    _io.require_dir(path)
    manifest = _io.parse_manifest(path, _io.read_bytes(path, MANIFEST, f"{MANIFEST} is missing: not a checkpoint"))
    tables = [
        {"name": name, "dim": t["dim"], "rows": sum(s["rows"] for s in t["shards"]), "state_width": t["state_width"],
         "dtype": t["dtype"], "optimizer": t["optimizer"], "shards": len(t["shards"])}
        for name, t in manifest["tables"].items()
    ]  # fmt: skip
    files = []
    for name, meta in manifest["files"].items():
        f = path / name
        present = f.stat().st_size if f.is_file() else None
        ok = (present == meta["size"] and _io.sha256(f) == meta["sha256"]) if verify and present is not None else None
        files.append({"name": name, "size": meta["size"], "present": present, "ok": ok})
    dense = manifest["dense"]["tensors"]
    return {
        "path": str(path), "committed": _io.is_committed(path), "format_version": manifest["format_version"],
        "world_size": manifest["world_size"], "step": manifest["step"], "extra": manifest["extra"],
        "tables": tables, "dense": {"count": len(dense), "bytes": manifest["dense"]["bytes"]}, "files": files,
    }  # fmt: skip


# ---- writing ------------------------------------------------------------------------------
def _check_save_args(step: int, extra: Optional[dict]) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict or None, got {type(extra).__name__}")
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"extra must be JSON-serialisable (lists, dicts, str, int, finite float): {exc}")


def _prepare(path: Path, overwrite: bool) -> Path:
    """Rank 0: refuses to replace a committed checkpoint (unless ``overwrite``); returns a
    fresh temporary sibling directory."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; choose another checkpoint path")
    if _io.is_committed(path) and not overwrite:
        raise CheckpointError(f"{path} already holds a committed checkpoint; pass overwrite=True or another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def _write_rank_files(tmp: Path, rank: int, model: nn.Module, optimizer) -> dict[str, Any]:
    """Writes this rank's table shard (and, on rank 0, the dense file); returns their
    manifest entries: {"files": {name: {size, sha256}}, "shards": {table: shard entry},
    "optimizer": the dense optimizer's state dict as JSON (rank 0)}."""
    files, shards, opt_json = {}, {}, None
    mine = {name: m for name, m in _model.tables_of(model).items() if _model.shard_of(m)[1] > 1 or rank == 0}
    if mine:
        fname = f"tables.rank{rank:05d}.safetensors"
        tensors = {}
        rows = sum(len(m) for m in mine.values())
        sources = []  # tiered tables: streamed in chunks, never every row at once
        for name, m in _io.progress(mine.items(), rows, f"checkpoint: exporting tables (rank {rank})"):
            if _model.streamed(m):
                source = _stream.source(name, m)
                sources.append(source)
                n = source.rows
            else:
                out = m.table.export()
                tensors.update({f"{name}/{k}": out[k] for k in ENTRIES})
                n = out["keys"].numel()
            shard_rank = _model.shard_of(m)[0]
            shards[name] = {"file": fname, "rank": shard_rank, "rows": n,
                            "step": m.step_count, "clock": m.table.clock}  # fmt: skip
        if sources:  # (the Device tables beside them as one chunk each)
            sources += [_stream.whole(name, tensors) for name in {n.rsplit("/", 1)[0] for n in tensors}]
            files[fname] = _stream.write_streamed(tmp / fname, sources)
        else:
            files[fname] = _io.write_safetensors(tmp / fname, tensors)
        # Admission (veloce.admission): each table's sketch and default row, a small file per rank.
        # A shard saves the sightings it counted (the load sums the shards' sketches).
        admission = {f"{name}/{k}": (m.table.own_sketch() if k == "admission_counts" else v)
                     for name, m in mine.items() for k, v in m.table.admission_state().items()}  # fmt: skip
        if admission:
            aname = f"admission.rank{rank:05d}.safetensors"
            files[aname] = _io.write_safetensors(tmp / aname, admission)
            for name, m in mine.items():
                if m.table.admits:
                    shards[name]["admission"] = aname
    if rank == 0:
        tensors = {f"model/{n}": t for n, t in _model.dense_of(model).items()}
        dense_opt, _ = _model.split_optimizer(optimizer)
        if dense_opt is not None:
            opt_json = _io.encode(dense_opt.state_dict(), "optimizer", tensors)
        files[DENSE_FILE] = _io.write_safetensors(tmp / DENSE_FILE, tensors)
    return {"files": files, "shards": shards, "optimizer": opt_json}


def _manifest(model: nn.Module, optimizer, step: int, extra: Optional[dict], written: list[dict]) -> dict:
    """Rank 0: the manifest, from its own model plus every rank's written files."""
    tables = {}
    for name, m in _model.tables_of(model).items():
        tables[name] = {
            "dim": m.embedding_dim, "state_width": m.table.state_dim, "optimizer": type(m.optimizer).__name__,
            "dtype": _model.dtype_name(m.table.dtype), "state_dtype": _model.dtype_name(m.table.state_dtype),
            "shard_world": _model.shard_of(m)[1],
            "shards": [w["shards"][name] for w in written if name in w["shards"]],
        }  # fmt: skip
    dense = _model.dense_of(model)
    dense_opt, sparse = _model.split_optimizer(optimizer)
    opt = None
    if optimizer is not None:
        opt = {"dense_class": type(dense_opt).__name__ if dense_opt is not None else None,
               "dense": written[0]["optimizer"], "sparse": sparse}  # fmt: skip
    return {
        "format_version": FORMAT_VERSION, "world_size": _io.world()[1], "step": step, "extra": extra,
        "tables": tables,
        "dense": {
            "tensors": {n: {"shape": list(t.shape), "dtype": _model.dtype_name(t.dtype)} for n, t in dense.items()},
            "bytes": sum(t.numel() * t.element_size() for t in dense.values()),
        },
        "optimizer": opt,
        "files": {n: meta for w in written for n, meta in w["files"].items()},
    }  # fmt: skip


def _commit(tmp: Path, path: Path, manifest: dict) -> None:
    """Rank 0: manifest, rename into place, then the marker (the commit point)."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _io.write_durably(tmp / MANIFEST, data)
    _io.fsync(tmp)
    old = None
    if path.exists():  # an uncommitted leftover, or a committed one with overwrite=True
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        _uncommit(path)
        os.rename(path, old)
    os.rename(tmp, path)
    _io.fsync(path.parent)
    marker = json.dumps({"manifest_sha256": hashlib.sha256(data).hexdigest(), "format_version": FORMAT_VERSION})
    _io.write_durably(path / (MARKER + ".tmp"), marker.encode())
    os.replace(path / (MARKER + ".tmp"), path / MARKER)
    _io.fsync(path)
    _io.fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _uncommit(path: Path) -> None:
    """Removes the marker first, so an interrupted deletion never leaves a committed partial."""
    if (path / MARKER).exists():
        (path / MARKER).unlink()
        _io.fsync(path)


def _prune(directory: Path, keep_last: int, new: Path) -> None:
    """Rank 0: drops committed checkpoints beyond the newest ``keep_last`` (never ``new``),
    uncommitted ``step_*`` directories and temporary directories of interrupted saves."""
    committed = [p for p in _step_dirs(directory) if _io.is_committed(p)]
    doomed = [p for p in committed[:-keep_last] if p != new]
    doomed += [p for p in _step_dirs(directory) if p not in committed]
    doomed += [p for p in directory.iterdir() if _DEBRIS.fullmatch(p.name)]
    for p in doomed:
        _uncommit(p)
        shutil.rmtree(p)


def _step_dirs(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir())
