"""The serving side: :class:`InferenceEmbedding` (a table read from a serving store, with
``DynamicEmbedding``'s forward and an LRU cache of rows) and :func:`inference_twin` /
:func:`refresh`, which turn a freshly constructed model into its published twin and move
it to the newest committed version."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from veloce.embedding import DynamicEmbedding
from veloce.ops.hash_table import initialize
from veloce.serving.publisher import FORMAT, dense_tensors, sparse_tables
from veloce.serving.store import ServingStore, VersionMissing
from veloce.sparse.base import MODES
from veloce.sparse.inputs import InputChecks
from veloce.table import HashTable, TableFullError

__all__ = ["InferenceEmbedding", "inference_twin", "refresh"]

#: Distinct ids read from the store, their rows and whether the version holds each.
_Fetched = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _newest(store: ServingStore) -> int:
    committed = store.committed()
    if not committed:
        raise VersionMissing(f"{store!r} holds no committed version: publish one first (veloce.serving.Publisher)")
    return committed[-1]


def _checked_manifest(store: ServingStore, version: int) -> dict[str, Any]:
    manifest = store.manifest(version)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{store!r} version {version} has format {manifest.get('format')!r}, not {FORMAT!r}: a store "
                         f"written by another tool or version of veloce")  # fmt: skip
    return manifest


class InferenceEmbedding(InputChecks, nn.Module):
    """One published table, for inference: ``DynamicEmbedding``'s forward (pooling
    ``sum`` / ``mean`` / ``max``, per-sample weights, ``padding_idx``, 1-D input with
    offsets or 2-D bags) over the rows of a committed version of ``store``, with no
    optimizer state. Rows read from the store stay in an LRU cache of ``cache_rows`` rows;
    an id the version does not hold gets what the training table gives it in eval mode
    (its initializer's row, a function of the seed and the id, or zeros). It never changes
    the store. :meth:`refresh` moves it to a newer version, dropping from the cache exactly
    the ids that changed between the two.

    Args:
        store: the serving store.
        name: the table's path in the published model (``"emb"``, ``"tables.0"``).
        version: the version to read (None: the newest committed).
        cache_rows: the most rows kept in memory.
        device: where the cache lives and the lookups run.

    Raises:
        veloce.serving.VersionMissing: no such committed version.
        ValueError: the version holds no table ``name``.
    """

    def __init__(self, store: ServingStore, name: str, version: Optional[int] = None, cache_rows: int = 1 << 20,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        super().__init__()
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 1:
            raise ValueError(f"InferenceEmbedding: cache_rows must be an int >= 1, got {cache_rows!r}")
        self.store, self.name, self.cache_rows = store, name, cache_rows
        self.version = _newest(store) if version is None else int(version)
        self.manifest = _checked_manifest(store, self.version)
        meta = self._meta(self.manifest)
        self.embedding_dim = int(meta["dim"])
        self.mode = meta["mode"]
        self.padding_idx = meta["padding_idx"]
        self.include_last_offset = bool(meta["include_last_offset"])
        self.unknown = meta["unknown"]
        self.init_kind, self.init_a, self.init_b = meta["initializer"]
        self.seed = int(meta["seed"])
        self.default_row = _default_row(meta)
        dtype = getattr(torch, meta["row_dtype"])
        # The cache: a hash table of rows (LRU by the clock of the forward that last read them).
        self.table = HashTable(self.embedding_dim, 0, capacity=min(cache_rows, 1 << 16), max_capacity=cache_rows,
                               eviction="lru", dtype=dtype, device=device)  # fmt: skip
        self._manifests: dict[int, dict[str, Any]] = {self.version: self.manifest}
        self.hits = self.misses = 0

    def _meta(self, manifest: dict[str, Any]) -> dict[str, Any]:
        tables = manifest["tables"]
        if self.name not in tables:
            raise ValueError(f"{self.store!r} version {manifest['version']} holds no table {self.name!r} (it holds "
                             f"{sorted(tables)}): a store of another model; pass the name of a published table, or open the "
                             f"store that model published to")  # fmt: skip
        return tables[self.name]

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.embedding_dim}, mode={self.mode!r}, version={self.version}, cached={len(self.table)}"

    def train(self, mode: bool = True) -> "InferenceEmbedding":
        return super().train(False)  # inference only: the lookups change nothing

    # ---- lookups -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        """Pooled embeddings of ``input`` bags, as ``DynamicEmbedding`` in eval mode, pooled
        straight from the cache's slots (the rows of the ids it lacks, read from the store,
        ride along as the op's extra rows and are cached after it)."""
        ids, offsets, psw = self._bags(input, offsets, per_sample_weights)
        slots, extra, fetched = self._slots(ids, self.padding_idx)
        cache = self.table
        if self.mode == "max":
            out = cache.max_pooled(slots, offsets, self.include_last_offset, extra)[0]
        else:  # the offsets passed _bags' checks and the slots come from the cache: no re-check
            out = cache.pooled(slots, offsets, psw, MODES[self.mode], self.include_last_offset, extra,
                               check_inputs=False)  # fmt: skip
        if fetched is not None:
            self._remember(*fetched)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (N,) at this version: cached, read from the store, or the rows
        of unknown ids; (N, D) in the table's dtype, on the cache's device."""
        slots, extra, fetched = self._slots(ids, None)
        cache = self.table
        if extra is None:
            out = cache.rows(slots)
        else:
            hit = slots < cache.capacity
            out = torch.empty(ids.numel(), self.embedding_dim, dtype=cache.dtype, device=ids.device)
            out[hit] = cache.rows(slots[hit])
            out[~hit] = extra[slots[~hit] - cache.capacity]
            self._remember(*fetched)
        return out

    def _slots(self, ids: torch.Tensor, padding_idx: Optional[int]) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                             Optional[_Fetched]]:  # fmt: skip
        """The slots of ``ids`` for the pooling ops: the cache's slot of each cached id (its
        LRU score set to this lookup's clock), -1 at ``padding_idx``, and for the others
        ``capacity + k``, row ``k`` of the extra rows (their distinct ids' rows at this
        version, read from the store in one batch and copied to the cache's device at
        once). Returns ``(slots, extra, fetched)``: extra and fetched (what
        :meth:`_remember` caches) are None when the cache held every id."""
        cache = self.table
        slots = cache.find(ids)
        missing = slots < 0
        if padding_idx is not None:
            pad = ids == padding_idx
            slots = slots.masked_fill(pad, -1)
            missing &= ~pad
            n_missing, n_pad = torch.stack([missing.sum(), pad.sum()]).tolist()  # (one device read)
        else:
            n_missing, n_pad = int(missing.sum()), 0
        counts = self.__dict__  # (plain attributes: nn.Module.__setattr__ costs microseconds a lookup)
        counts["hits"] += ids.numel() - n_missing - n_pad
        counts["misses"] += n_missing
        cache.clock += 1
        if n_missing == 0 and n_pad == 0:  # every id cached (the warm path): no index of the hits to make
            cache.scores.index_fill_(0, slots, cache.clock)  # read now: the last to go
            return slots, None, None
        cache.scores.index_fill_(0, slots[slots >= 0], cache.clock)
        if n_missing == 0:
            return slots, None, None
        at = missing.nonzero().squeeze(1)
        miss, inverse = torch.unique(ids[at], return_inverse=True)
        extra, known = self._fetch(miss)
        slots = slots.index_put((at,), inverse + cache.capacity)
        return slots, extra, (miss, extra, known)

    def _remember(self, ids: torch.Tensor, rows: torch.Tensor, known: torch.Tensor) -> None:
        """Caches the rows of distinct ``ids`` read from the store (those of ids the version
        lacks too, unless they read the version's default row)."""
        if self.default_row is not None:  # the default row changes with each version: not cached
            ids, rows = ids[known], rows[known]
        keep = min(ids.numel(), self.cache_rows)
        try:
            self.table.insert(ids[:keep], rows[:keep])
        except TableFullError:  # buckets too full to place them all: start the cache over
            self.table.clear()

    def _manifest_of(self, version: int) -> dict[str, Any]:
        m = self._manifests.get(version)
        if m is None:
            m = self._manifests[version] = _checked_manifest(self.store, version)
        return m

    def _fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``ids`` at this version, on their device: each id's row in the newest
        version of the chain (snapshot, then deltas) that holds it or removed it, read on
        the host and copied in one batch, else the row of an unknown id; and which ids the
        version holds."""
        parts = []
        for v in reversed(self.manifest["chain"]):
            m = self._manifest_of(v)
            meta = self._meta(m)
            parts += [(v, f"t/{self.name}/r{r}") for r in meta["ranks"]]
            if meta.get("whole", m["kind"] == "full"):
                break  # every row of the table is here: older versions do not count
        host = ids.cpu()
        dtype = self.table.dtype
        read = torch.empty(host.numel(), self.embedding_dim, dtype=dtype)  # (the rows of unknown ids follow)
        decided = torch.zeros(host.numel(), dtype=torch.bool)
        known = torch.zeros(host.numel(), dtype=torch.bool)
        for found, got, removed in self.store.lookup(parts, host):
            take = found & ~decided
            if bool(take.any()):
                read[take] = got[take].to(dtype)
                known |= take
            decided |= found | removed
        rows = read.to(ids.device)
        if not bool(known.all()):
            unknown = (~known).nonzero().squeeze(1).to(ids.device)
            rows[unknown] = self._unknown_rows(ids[unknown])
        return rows, known.to(ids.device)

    def _unknown_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """What the training table gives ``ids`` it does not hold in eval mode, made on their
        device as it makes them there (the initializer's rows of the CPU and the GPU may
        differ in the last bit)."""
        dtype, n = self.table.dtype, ids.numel()
        if self.unknown == "zeros":
            return torch.zeros(n, self.embedding_dim, dtype=dtype, device=ids.device)
        if self.default_row is not None:  # the table admits ids: the others read its default row
            return self.default_row.to(device=ids.device, dtype=dtype).expand(n, -1)
        return initialize(ids, self.embedding_dim, self.seed, int(self.init_kind), float(self.init_a),
                          float(self.init_b), dtype)  # fmt: skip

    # ---- versions ------------------------------------------------------------------------------
    def refresh(self, version: Optional[int] = None) -> bool:
        """Moves to ``version`` (None: the newest committed), dropping from the cache the ids
        changed between the two (every row when the versions between are not all readable).
        Returns whether the version changed.

        Raises:
            veloce.serving.VersionMissing: ``version`` is not committed.
            ValueError: the new version's table differs in layout (dim, pooling).
        """
        target = _newest(self.store) if version is None else int(version)
        if target == self.version:
            return False
        manifest = _checked_manifest(self.store, target)
        meta = self._meta(manifest)
        if int(meta["dim"]) != self.embedding_dim or meta["mode"] != self.mode:
            raise ValueError(f"{self.store!r} version {target}: table {self.name!r} has dim {meta['dim']} and mode "
                             f"{meta['mode']!r}, this one {self.embedding_dim} and {self.mode!r}: rebuild the "
                             f"inference model")  # fmt: skip
        changed = self._changed(self.version, target)
        if changed is None:
            self.table.clear()
        elif changed.numel():
            self.table.erase(changed.to(self.table.device))
        self.version, self.manifest = target, manifest
        self.default_row = _default_row(meta)
        self._manifests = {v: m for v, m in self._manifests.items() if v in manifest["chain"]}
        self._manifests[target] = manifest
        return True

    def _changed(self, old: int, new: int) -> Optional[torch.Tensor]:
        """The ids changed after ``old`` up to ``new``, or None when they are not known (a
        version between them is gone, a newer one is older, or a snapshot lists none)."""
        if new < old:
            return None
        ids = []
        v = new
        try:
            while v != old:
                m = self._manifest_of(v)
                meta = self._meta(m)
                if not meta.get("whole", m["kind"] == "full"):
                    for r in meta["ranks"]:
                        d = self.store.read_part(v, f"t/{self.name}/r{r}")
                        ids += [d["keys"], d["removed"]]
                elif meta.get("changes"):
                    ids += [self.store.read_part(v, f"c/{self.name}/r{r}")["ids"] for r in meta["ranks"]]
                else:
                    return None
                v = m.get("previous")
                if v is None or v < old:
                    return None
        except VersionMissing:
            return None
        return torch.cat(ids).unique() if ids else torch.empty(0, dtype=torch.long)


def inference_twin(model: nn.Module, store: ServingStore, version: Optional[int] = None,
                   cache_rows: int = 1 << 20) -> nn.Module:  # fmt: skip
    """Turns ``model`` (a freshly constructed model of the published architecture: only its
    structure is used) into its inference twin, in place: every ``DynamicEmbedding``
    becomes an :class:`InferenceEmbedding` of ``store`` on the table's device, the dense
    parameters and buffers are loaded from the version, and the model is put in eval mode.

    Args:
        model: the model.
        store: the serving store.
        version: the version (None: the newest committed).
        cache_rows: each table's cache size in rows.

    Returns:
        ``model``.

    Raises:
        veloce.serving.VersionMissing: no such committed version.
        ValueError: the store holds another model (other tables, dims or dense tensors).
    """
    version = _newest(store) if version is None else int(version)
    manifest = _checked_manifest(store, version)
    tables = sparse_tables(model)
    published = manifest["tables"]
    if set(tables) != set(published):
        raise ValueError(f"{store!r} version {version} holds the tables {sorted(published)}, the model has "
                         f"{sorted(tables)}: a store of another model; construct the architecture that published it, or "
                         f"open the store this model published to")  # fmt: skip
    for name, emb in tables.items():
        meta = published[name]
        if int(meta["dim"]) != emb.embedding_dim or meta["mode"] != emb.mode:
            raise ValueError(f"{store!r}: table {name!r} was published with dim {meta['dim']} and mode "
                             f"{meta['mode']!r}, the model's has {emb.embedding_dim} and {emb.mode!r}: construct the model with "
                             f"the published table's dim and mode, or open the store this model published to")  # fmt: skip
        twin = InferenceEmbedding(store, name, version, cache_rows, device=emb.table.device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, twin)
    _load_dense(model, store, version)
    return model.eval()


def _load_dense(model: nn.Module, store: ServingStore, version: int) -> None:
    state = store.read_part(version, "dense")
    own = dense_tensors(model, skip=(DynamicEmbedding, InferenceEmbedding))
    if set(state) != set(own):
        extra, lacking = sorted(set(state) - set(own)), sorted(set(own) - set(state))
        raise ValueError(f"{store!r} version {version}: the published dense state does not match the model: "
                         f"{len(extra)} published tensor(s) the model lacks {extra[:5]}, {len(lacking)} of the model's "
                         f"not published {lacking[:5]}: a store of another model")  # fmt: skip
    with torch.no_grad():
        for name, tensor in own.items():
            value = state[name]
            if value.shape != tensor.shape:
                raise ValueError(f"{store!r} version {version}: {name} has shape {tuple(value.shape)}, the model's "
                                 f"{tuple(tensor.shape)}: a store of another model")  # fmt: skip
            tensor.copy_(value)


def refresh(model: nn.Module, version: Optional[int] = None) -> int:
    """Moves an :func:`inference_twin` (its dense state and every table) to ``version``
    (None: the newest committed); returns the version.

    Raises:
        ValueError: ``model`` has no :class:`InferenceEmbedding`.
    """
    tables = [m for m in model.modules() if isinstance(m, InferenceEmbedding)]
    if not tables:
        raise ValueError(f"refresh: {type(model).__name__} has no InferenceEmbedding (make it with inference_twin)")
    store = tables[0].store
    version = _newest(store) if version is None else int(version)
    _load_dense(model, store, version)
    for t in tables:
        t.refresh(version)
    return version


def _default_row(meta: dict[str, Any]) -> Optional[torch.Tensor]:
    """The published default row of a table with admission (its ids without a row of their
    own read it), or None."""
    row = meta.get("default_row")
    return None if row is None else torch.tensor(row, dtype=torch.float32)
