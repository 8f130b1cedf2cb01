"""The training side of serving: :class:`Publisher` writes a model's versions to a
:class:`~veloce.serving.store.ServingStore`, a full snapshot first and deltas after it.

A publication (one :meth:`Publisher.publish`) is one version:

1. rank 0 renews the lease, deletes what a killed publisher left (versions begun, never
   committed) and picks the version number, one past every version begun;
2. every rank writes its part of every table: a delta holds the rows changed since the
   last publication and the ids removed since (:meth:`veloce.DynamicEmbedding.export`
   ``since`` its clock then), a full snapshot every row (each ``fold_every``-th
   publication, the first one, and whenever a table cannot answer ``since`` exactly); a
   table without row versions (``eviction="lfu"``) is written whole every time, marked
   ``whole`` in the manifest (readers look no further back for its rows);
   rank 0 writes the dense parameters and buffers whole;
3. after a barrier, rank 0 writes the manifest: the commit marker. A version is visible to
   readers only from here, whole;
4. the tombstones published are dropped from the tables, and rank 0 deletes the versions
   that no one of the last ``keep_last`` needs (a version needs its snapshot and the deltas
   between), so the store stays bounded.
"""

from __future__ import annotations

import math
import os
import socket
import time
import uuid
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from veloce.embedding import DynamicEmbedding
from veloce.serving.store import LeaseHeld, ServingStore, lease_holder_gone
from veloce.table.versions import VersionsUnavailable

__all__ = ["FORMAT", "Publisher", "dense_state", "dense_tensors", "sparse_tables"]

#: The manifests' format tag: a reader refuses other formats.
FORMAT = "veloce-serving/1"
_DTYPES = {None: None, torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a ``HybridParallel`` or ``DistributedDataParallel`` wrapper."""
    while type(model).__name__ in ("HybridParallel", "DistributedDataParallel") and isinstance(
        getattr(model, "module", None), nn.Module
    ):
        model = model.module
    return model


def sparse_tables(model: nn.Module) -> dict[str, DynamicEmbedding]:
    """The model's ``DynamicEmbedding`` modules by their path in it (a wrapper's skipped)."""
    return {name: m for name, m in _unwrap(model).named_modules() if isinstance(m, DynamicEmbedding)}


def dense_tensors(model: nn.Module, skip: tuple[type, ...] = (DynamicEmbedding,)) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers outside its ``skip`` modules (its
    tables), by their ``state_dict`` names: the tensors themselves."""
    out: dict[str, torch.Tensor] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        if isinstance(m, skip):
            return
        for n, p in m._parameters.items():
            if p is not None:
                out[prefix + n] = p
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out[prefix + n] = b
        for n, c in m._modules.items():
            if c is not None:
                walk(c, prefix + n + ".")

    walk(_unwrap(model), "")
    return out


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """:func:`dense_tensors` as detached CPU copies (what a publication writes)."""
    return {n: t.detach().cpu().clone() for n, t in dense_tensors(model).items()}


def _table_meta(emb: DynamicEmbedding, dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """What a reader needs to rebuild the table's forward and its rows of unknown ids."""
    t = emb.table
    init = t.initializer
    default = t.default_rows()  # admission's trained row of ids without their own, or None
    return {
        "dim": emb.embedding_dim, "mode": emb.mode, "padding_idx": emb.padding_idx,
        "include_last_offset": bool(emb.include_last_offset), "unknown": emb.unknown,
        "initializer": [int(init.kind), float(init.a), float(init.b)], "seed": int(t.seed),
        "row_dtype": str(t.dtype).replace("torch.", ""),
        "stored_dtype": str(dtype or t.dtype).replace("torch.", ""),
        "sharded": bool(emb.backend.sharded),
        "default_row": None if default is None else default[0].detach().float().cpu().tolist(),
    }  # fmt: skip


class Publisher:
    """Publishes a training model's versions to a serving store (see the module docstring).

    Call :meth:`publish` between training steps (after a synchronous ``step()``); under
    ``torch.distributed``, on every rank together.

    Args:
        store: where the versions go (:class:`~veloce.serving.FileStore`,
            :class:`~veloce.serving.RedisStore`).
        model: the training model (or its ``HybridParallel`` / DDP wrapper).
        keep_last: the versions kept readable (each with the snapshot and deltas it needs).
        fold_every: every ``fold_every``-th publication is a full snapshot, which bounds
            the deltas a reader reads and lets older versions go.
        dtype: the published rows' dtype: None (the table's), ``torch.float16`` or
            ``torch.bfloat16`` (half the bytes; readers compute in the table's dtype).
        lease_ttl: seconds the lease lasts past each publication: a publisher that dies
            leaves the store to the next one after at most this long.
        owner: the lease holder's name (default: host, pid and a random tag). A publisher
            of the same name renews the lease as its own: a run restarted after its
            publisher died goes on at once under the dead one's name (never give two live
            publishers one name).
        take_over: take a running lease whose holder is a process of this host that no
            longer runs (a publisher killed on this machine); a lease of a live process,
            or of another host, is still refused.

    Raises:
        ValueError: bad arguments, or a model without ``DynamicEmbedding`` modules.
        veloce.serving.LeaseHeld: another publisher holds the store's lease (the message
            says who, until when, and the ways on).
    """

    def __init__(self, store: ServingStore, model: nn.Module, keep_last: int = 3, fold_every: int = 10,
                 dtype: Optional[torch.dtype] = None, lease_ttl: float = 600.0,
                 owner: Optional[str] = None, take_over: bool = False) -> None:  # fmt: skip
        if not isinstance(store, ServingStore):
            raise TypeError(f"store must be a veloce.serving store (FileStore, RedisStore), got {type(store).__name__}")
        for name, value in (("keep_last", keep_last), ("fold_every", fold_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Publisher: {name} must be an int >= 1, got {value!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"Publisher: dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, (int, float)) or not 0 < lease_ttl < math.inf:
            raise ValueError(f"Publisher: lease_ttl must be a number of seconds > 0, got {lease_ttl!r}")
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ValueError(f"Publisher: owner must be None or a non-empty str, got {owner!r}")
        self.store, self.model = store, model
        self.tables = sparse_tables(model)
        if not self.tables:
            raise ValueError(f"Publisher: {type(model).__name__} has no DynamicEmbedding module to publish")
        self.keep_last, self.fold_every, self.dtype, self.lease_ttl = keep_last, fold_every, dtype, float(lease_ttl)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.owner = self._broadcast(owner)
        self.version: Optional[int] = None  # the last version this publisher committed
        self._clocks: Optional[dict[str, int]] = None  # each table's clock at that version (this rank's)
        self._since_full = 0  # publications since the last full snapshot
        if self.rank == 0:
            self._take_lease(bool(take_over))

    def _take_lease(self, take_over: bool) -> None:
        """The first acquire: with ``take_over``, a lease of a dead process of this host is taken."""
        try:
            self.store.acquire(self.owner, self.lease_ttl)
        except LeaseHeld as exc:
            if not take_over or exc.holder is None:
                raise
            if not lease_holder_gone(exc.holder):
                raise LeaseHeld(f"{exc}. (take_over=True was given, but the holder is not known to be dead: it is "
                                f"not a process of this host, {socket.gethostname()}, that no longer runs)",
                                exc.holder) from None  # fmt: skip
            self.store.acquire(self.owner, self.lease_ttl, take_over_from=exc.holder["owner"])
            warnings.warn(f"Publisher: took over the lease of {self.store!r} from {exc.holder['owner']!r}, whose "
                          f"process ({exc.holder.get('pid')} on this host) no longer runs", RuntimeWarning,
                          stacklevel=3)  # fmt: skip

    # ---- collectives (no-ops in one process) ------------------------------------------------
    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _any(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    # ---- publishing ---------------------------------------------------------------------------
    def publish(self) -> int:
        """Writes one version (see the module docstring) and returns its number.

        Raises:
            veloce.serving.LeaseHeld: the lease expired and another publisher took it.
        """
        store = self.store
        version, committed = None, []
        if self.rank == 0:
            store.acquire(self.owner, self.lease_ttl)
            committed, begun = store.committed(), store.begun()
            version = (begun[-1] if begun else 0) + 1  # past a broken version too: a number is never reused
            for v in sorted(set(begun) - set(committed)):  # what a killed publisher left
                store.delete(v)
            if self.version is not None and (not committed or committed[-1] != self.version):
                self._clocks = None  # the store moved under this publisher: start over with a snapshot
            store.begin(version)
        version = self._broadcast(version)
        full = self._clocks is None or self._since_full + 1 >= self.fold_every
        deltas: dict[str, dict[str, torch.Tensor]] = {}
        if not full:
            try:
                deltas = {n: e.export(since=self._clocks[n], values_only=True) for n, e in self.tables.items()
                          if e.table.eviction_policy.last_seen_scores}  # (lfu tables go whole every time)
                ok = True
            except VersionsUnavailable:
                ok = False
            full = self._any(not ok)  # one rank's table that cannot answer makes it a snapshot everywhere
        stats = self._write_tables(version, full, deltas)
        if self.rank == 0:
            store.write_part(version, "dense", dense_state(self.model))
        all_stats = self._gather(stats)  # (a barrier: every rank wrote its parts)
        if self.rank == 0:
            store.commit(version, self._manifest(version, full, all_stats, committed[-1] if committed else None))
        self._broadcast(None)  # every rank waits for the commit before dropping its tombstones
        clocks = {n: int(e.table.clock) for n, e in self.tables.items()}
        for n, e in self.tables.items():
            if e.table.eviction_policy.last_seen_scores:
                e.forget_removed(clocks[n])
        self._clocks, self.version = clocks, version
        self._since_full = 0 if full else self._since_full + 1
        if self.rank == 0:
            self._drop_superseded()
        return version

    def _write_tables(self, version: int, full: bool, deltas: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Writes this rank's part of every table; returns its counts per table."""
        stats: dict[str, Any] = {}
        for name, emb in self.tables.items():
            if self.rank != 0 and not emb.backend.sharded:
                continue  # a table held whole by every rank: rank 0's copy is published
            part = f"t/{name}/r{self.rank}"
            changes: Optional[torch.Tensor] = None
            versions = emb.table.eviction_policy.last_seen_scores
            whole = full or not versions  # a table without row versions (lfu) is written whole
            if whole:
                if versions and self._clocks is not None:
                    try:
                        d = emb.export(since=self._clocks[name], values_only=True)
                        changes = torch.cat([d["keys"], d["removed"]])
                    except VersionsUnavailable:
                        pass
                if versions and not emb.table.tracks_removed():
                    emb.track_removed()  # before the export: no removal between them goes unlisted
                rows = emb.export(values_only=True)  # on the table's device; the stores write host tensors
                keys, weights, removed = rows["keys"].cpu(), rows["weights"].cpu(), torch.empty(0, dtype=torch.long)
                if changes is not None:
                    self.store.write_part(version, f"c/{name}/r{self.rank}", {"ids": changes.unique()})
            else:
                d = deltas[name]
                keys, weights, removed = d["keys"], d["weights"], d["removed"].unique()
                removed = removed[~torch.isin(removed, keys)]  # removed, then back: its row supersedes
            # in slot order: a store that needs them by id sorts them (RocksDB and Redis do not)
            weights = weights.to(self.dtype or weights.dtype)
            self.store.write_part(version, part, {"keys": keys, "weights": weights, "removed": removed})
            stats[name] = {"rows": int(keys.numel()), "removed": int(removed.numel()),
                           "changes": bool(whole and changes is not None),
                           "whole": whole, "clock": int(emb.table.clock)}  # fmt: skip
        return stats

    def _manifest(self, version: int, full: bool, all_stats: list[dict[str, Any]],
                  previous: Optional[int]) -> dict[str, Any]:  # fmt: skip
        chain = [version] if full else [*self.store.manifest(self.version)["chain"], version]
        tables = {}
        for name, emb in self.tables.items():
            ranks = [r for r, s in enumerate(all_stats) if name in s]
            meta = _table_meta(emb, self.dtype)
            meta.update(ranks=ranks, rows=[all_stats[r][name]["rows"] for r in ranks],
                        removed=[all_stats[r][name]["removed"] for r in ranks],
                        clocks=[all_stats[r][name]["clock"] for r in ranks],
                        changes=all(all_stats[r][name]["changes"] for r in ranks),
                        whole=all(all_stats[r][name]["whole"] for r in ranks))  # fmt: skip
            tables[name] = meta
        return {"format": FORMAT, "version": version, "kind": "full" if full else "delta", "chain": chain,
                "previous": previous,
                "world_size": self.world_size, "tables": tables, "model": type(_unwrap(self.model)).__name__,
                "publisher": self.owner, "time": time.time()}  # fmt: skip

    def _drop_superseded(self) -> None:
        """Deletes the committed versions that none of the last ``keep_last`` needs."""
        committed = self.store.committed()
        needed: set[int] = set()
        for v in committed[-self.keep_last:]:
            needed.update(self.store.manifest(v)["chain"])
        for v in committed:
            if v not in needed:
                self.store.delete(v)

    def close(self) -> None:
        """Gives the lease back (rank 0); the publisher is not used afterwards."""
        if self.rank == 0:
            self.store.release(self.owner)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
