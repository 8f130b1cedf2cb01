"""Checkpoints of models with :class:`veloce.DynamicEmbedding` tables: atomic, verified,
world-size agnostic, and loaded without executing code.

A checkpoint is a directory (the full reference is ``docs/checkpoint.md``)::

    step_000001000/
        manifest.json                  format_version, world_size, step, extra, tables,
                                       dense tensors, optimizer JSON, files (size + sha256)
        dense.safetensors              dense parameters / persistent buffers ("model/<name>")
                                       and the dense optimizer's tensors ("optimizer/...")
        tables.rank00000.safetensors   rank 0's table entries: "<table>/keys" (M,),
        tables.rank00001.safetensors   "<table>/weights" (M, D), "<table>/optimizer_state"
        ...                            (M, S), "<table>/scores" (M,)
        COMMITTED                      written last: {"manifest_sha256": ...}

Writing (:func:`save`, collective under ``torch.distributed``): every rank writes its
files into a temporary sibling directory and fsyncs them; rank 0 writes the manifest,
renames the directory into place and writes ``COMMITTED`` last. A directory without a
valid marker is not a checkpoint: :func:`latest` skips it and :func:`load` refuses it.

Loading (:func:`load`): the marker, manifest, format version, the size and sha256 of
every file read, table dims, optimizer state widths and dense shapes are all checked
before the model changes; every refusal raises :class:`CheckpointError` and leaves the
model and optimizer as they were. Each rank keeps the keys it owns under its table's
current sharding (``veloce.distributed.owner_of``), so W ranks' checkpoints load on W'.
Only JSON and safetensors are read: no pickle, no ``torch.load``.

Example::

    ckpt = veloce.checkpoint.save_in("runs/x/ckpt", model, opt, step=step, extra={"epoch": 3})
    last = veloce.checkpoint.latest("runs/x/ckpt")
    if last is not None:
        info = veloce.checkpoint.load(last, model, opt)   # {"step": ..., "extra": {...}, ...}
"""

from veloce.checkpoint.api import describe, latest, load, save, save_in
from veloce.checkpoint.files import FORMAT_VERSION, CheckpointError

__all__ = ["CheckpointError", "FORMAT_VERSION", "save", "load", "latest", "save_in", "describe"]
