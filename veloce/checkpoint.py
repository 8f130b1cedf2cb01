"""STAND-IN for ``veloce.checkpoint`` -- TO BE REPLACED by the real module when it lands on main.

It has exactly the real API's signatures (``save_in``, ``latest``, ``load``, ``describe``,
``CheckpointError``) so that the Trainer and the CLI are written against it, but none of its
guarantees beyond one process: the model is saved with ``model.state_dict()`` into one
safetensors file, the optimizer with ``torch.save`` (loaded with ``weights_only=True``),
and a ``manifest.json`` written last is the commit marker. No checksums, no resharding.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["CheckpointError", "save_in", "latest", "load", "describe"]

FORMAT_VERSION = 0  # the stand-in's format; the real module defines its own
_MANIFEST = "manifest.json"
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or not in this format."""


def save_in(
    directory: str | os.PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
    step: int, extra: Optional[dict[str, Any]] = None, keep_last: int = 3,
) -> Path:  # fmt: skip
    """Writes ``directory/step_<step>`` (replacing one of that step); keeps the newest ``keep_last``."""
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:010d}"
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    tables = [{"name": n, "rows": len(m), "dim": m.embedding_dim} for n, m in _tables(model)]
    manifest = {"format_version": FORMAT_VERSION, "world_size": 1, "step": step, "extra": extra or {},
                "tables": tables, "files": sorted(p.name for p in tmp.iterdir())}  # fmt: skip
    (tmp / _MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in _committed(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(directory: str | os.PathLike) -> Optional[Path]:
    """The newest committed checkpoint under ``directory``, or None."""
    root = Path(directory)
    found = _committed(root) if root.is_dir() else []
    return found[-1] if found else None


def load(path: str | os.PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         strict: bool = True) -> dict[str, Any]:  # fmt: skip
    """Loads a checkpoint into ``model`` (and ``optimizer``); returns step, extra, world_size,
    format_version."""
    from safetensors.torch import load_file

    manifest = _manifest(Path(path))
    state = load_file(str(Path(path) / "model.safetensors"))
    model.load_state_dict(state, strict=strict)
    if optimizer is not None:
        opt_file = Path(path) / "optimizer.pt"
        if not opt_file.is_file():
            raise CheckpointError(f"{path} holds no optimizer state")
        optimizer.load_state_dict(torch.load(opt_file, weights_only=True))
    return {k: manifest[k] for k in ("step", "extra", "world_size", "format_version")}


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest's summary: format_version, world_size, step, tables, files."""
    manifest = _manifest(Path(path))
    return {k: manifest[k] for k in ("format_version", "world_size", "step", "tables", "files")}


def _manifest(path: Path) -> dict[str, Any]:
    file = path / _MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{path} is not a committed checkpoint (no {_MANIFEST})")
    return json.loads(file.read_text())


def _committed(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{_PREFIX}*") if (p / _MANIFEST).is_file())


def _tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from veloce.embedding import DynamicEmbedding

    return [(n, m) for n, m in model.named_modules() if isinstance(m, DynamicEmbedding)]
