"""What of a model goes into a checkpoint and how it comes back (private to
:mod:`veloce.checkpoint`): tables, dense tensors and optimizers of a model; the
verified load :class:`Plan`; applying it, and rolling back.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors import safe_open
from torch import nn

from veloce.checkpoint import files as _io
from veloce.checkpoint.files import DENSE_FILE, ENTRIES, MANIFEST, CheckpointError
from veloce.admission import COUNT_LIMIT
from veloce.checkpoint.stream import read_chunks
from veloce.distributed import owner_of, table_shard
from veloce.embedding import DynamicEmbedding
from veloce.sparse import CombinedOptimizer
from veloce.storage import Device


# ---- the model's pieces ---------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The user model inside DDP-style wrappers: while everything of ``model`` lives under
    its ``.module``, use that (so names carry no ``module.`` prefix)."""
    while isinstance(getattr(model, "module", None), nn.Module) and _all_under(model, "module."):
        model = model.module
    return model


def _all_under(model: nn.Module, prefix: str) -> bool:
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    names += [n for n, m in model.named_modules() if isinstance(m, DynamicEmbedding)]
    return all(n.startswith(prefix) for n in names)


def tables_of(model: nn.Module) -> dict[str, DynamicEmbedding]:
    """The model's DynamicEmbedding modules by ``named_modules`` name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, DynamicEmbedding)}


def dense_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers outside DynamicEmbedding tables, by state_dict name."""
    tables = list(tables_of(model))
    out = {}
    for prefix, m in model.named_modules():
        if any(prefix == t or prefix.startswith(t + ".") or t == "" for t in tables):
            continue
        pre = prefix + "." if prefix else ""
        out.update({pre + n: p for n, p in m._parameters.items() if p is not None})
        persistent = {n: b for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set}
        out.update({pre + n: b for n, b in persistent.items()})
    return out


def streamed(module: DynamicEmbedding) -> bool:
    """Whether a table is saved and loaded in chunks: a tiered one (``storage`` other than
    ``Device()``), whose rows may not fit in memory at once."""
    return not isinstance(module.storage, Device)


def shard_of(module: DynamicEmbedding) -> tuple[int, int]:
    """(rank, world size) of the table's sharding; (0, 1) when it is not sharded."""
    return tuple(table_shard(module))


def check_flushed(model: nn.Module, action: str = "saving") -> None:
    """Refuses to save (or load into) tables whose sparse gradients are still in flight
    (HybridParallel with sparse="async"): a checkpoint would silently miss those updates,
    and a load would have them applied to the restored rows later."""
    late = [n for n, m in tables_of(model).items() if m.backend.in_flight]
    if late:
        raise CheckpointError(
            f"table(s) {late} have sparse gradients in flight (HybridParallel sparse='async'); call "
            f"model.flush() on every rank before {action}: those updates belong to the current state"
        )


def split_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> tuple[Optional[torch.optim.Optimizer], dict]:
    """(dense torch optimizer or None, sparse groups by table name)."""
    if isinstance(optimizer, CombinedOptimizer):
        return optimizer.dense, optimizer.state_dict()["sparse"]
    return optimizer, {}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")


# ---- reading and verifying ------------------------------------------------------------------
@dataclass
class Plan:
    """Everything a load will change, read and verified; the model is not touched yet."""

    info: dict[str, Any]
    tables: dict[str, tuple[DynamicEmbedding, Any, int, int]]  # module, entries (or Streamed), step, clock
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name: (target, value)
    optimizer: Optional[dict] = None  # the state dict to load, or None to leave it
    admission: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name: admission state


def read(path: Path, model: nn.Module, optimizer, strict: bool) -> Plan:
    """Reads and verifies everything a load of ``path`` into ``model`` would change; the
    cheap checks (manifest, dims, files, dense shapes) come before the table shards."""
    manifest = _io.open_manifest(path)
    tables = _match_tables(manifest["tables"], tables_of(model), strict)
    needed = {s["file"] for name in tables for s in manifest["tables"][name]["shards"]} | {DENSE_FILE}
    needed |= {s["admission"] for name in tables for s in manifest["tables"][name]["shards"] if "admission" in s}
    for fname in sorted(needed):
        _io.verify_file(path, fname, manifest["files"])
    info = {"step": manifest["step"], "extra": manifest["extra"], "world_size": manifest["world_size"],
            "format_version": manifest["format_version"]}  # fmt: skip
    with safe_open(str(path / DENSE_FILE), "pt") as f:
        dense = _match_dense(manifest["dense"]["tensors"], dense_of(model), f, strict)
        opt = _match_optimizer(manifest["optimizer"], optimizer, f, strict)
    return Plan(info, _read_tables(path, manifest["tables"], tables), dense, opt,
                _read_admission(path, manifest["tables"], tables))


def _read_admission(path: Path, saved: dict, tables: dict[str, DynamicEmbedding]) -> dict:
    """Per table that admits and whose checkpoint kept its admission state: the state to
    load. The sketches of several shards add up (their counts are of disjoint id sets;
    a collision of ids of two shards in one counter adds what one shared sketch would have
    added, so the sum is the sketch of the whole table), and the default row is the first
    shard's (rank 0 keeps it). A table that admits without saved state keeps its own."""
    out = {}
    for name, m in tables.items():
        files = [s["admission"] for s in sorted(saved[name]["shards"], key=lambda s: s["rank"]) if "admission" in s]
        if not m.table.admits or not files:
            continue
        want = {k: tuple(v.shape) for k, v in m.table.admission_state().items()}
        state: dict[str, torch.Tensor] = {}
        for fname in files:
            with safe_open(str(path / fname), "pt") as f:
                for k, shape in want.items():
                    key = f"{name}/{k}"
                    got = _stored_shape(f, fname, key)
                    if got != shape:
                        raise CheckpointError(
                            f"table {name!r}: the checkpoint's {k} has shape {got}, the table's admission="
                            f"{m.table.admission!r} keeps {shape}; load it into a table with the saved sketch's shape"
                        )  # fmt: skip
                    t = f.get_tensor(key)
                    if k == "admission_counts" and k in state:
                        state[k] = (state[k].long() + t.long()).clamp_(max=COUNT_LIMIT).to(t.dtype)
                    else:
                        state.setdefault(k, t)
        out[name] = state
    return out


def _match_tables(saved: dict, tables: dict[str, DynamicEmbedding], strict: bool) -> dict[str, DynamicEmbedding]:
    """The model's tables that the checkpoint holds, after checking dims and state widths."""
    if strict:
        _refuse_one_sided("table", saved, tables, "DynamicEmbedding module names")
    out = {}
    for name in sorted(saved.keys() & tables.keys()):
        m, meta = tables[name], saved[name]
        if meta["dim"] != m.embedding_dim:
            raise CheckpointError(
                f"{MANIFEST}: table {name!r} has dim {meta['dim']} but the model's has embedding_dim "
                f"{m.embedding_dim}; build the model with the dims it was trained with"
            )
        if meta["state_width"] != m.table.state_dim:
            raise CheckpointError(
                f"{MANIFEST}: table {name!r} has optimizer state width {meta['state_width']} (saved with "
                f"{meta['optimizer']}) but the model's {type(m.optimizer).__name__} needs {m.table.state_dim}; "
                f"use the sparse optimizer it was trained with"
            )
        out[name] = m
    return out


def _refuse_one_sided(what: str, saved: Iterable[str], model: Iterable[str], hint: str) -> None:
    saved, model = set(saved), set(model)
    if model - saved:
        raise CheckpointError(
            f"{MANIFEST}: {len(model - saved)} {what}(s) of the model are not in the checkpoint: "
            f"{sorted(model - saved)[:5]}; check the {hint}, or load with strict=False to keep them as they are"
        )
    if saved - model:
        raise CheckpointError(
            f"{MANIFEST}: {len(saved - model)} {what}(s) of the checkpoint are not in the model: "
            f"{sorted(saved - model)[:5]}; check the {hint}, or load with strict=False to skip them"
        )


@dataclass
class Streamed:
    """A tiered table's entries in the checkpoint, read in chunks when the load is applied:
    ``(file, rows)`` per shard file of the table, and the table's sharding."""

    path: Path
    name: str
    files: list[tuple[str, int]]
    shard: tuple[int, int]

    def chunks(self) -> Iterable[dict[str, torch.Tensor]]:
        """The entries this rank owns, file by file, in chunks."""
        for fname, rows in self.files:
            yield from read_chunks(self.path / fname, self.name, rows, lambda e: _owned(e, self.shard))

    def rows(self) -> int:
        return sum(rows for _, rows in self.files)


def _read_tables(path: Path, saved: dict, tables: dict[str, DynamicEmbedding]) -> dict:
    """Per table: (module, entries this rank owns, step, clock); one shard file at a time.
    A tiered table's entries are checked (names, shapes) but read later, in chunks
    (:class:`Streamed`)."""
    out = {}
    for name, m in list(tables.items()):
        if streamed(m):
            shards = saved[name]["shards"]
            for s in shards:
                with safe_open(str(path / s["file"]), "pt") as f:
                    _entries(f, s["file"], name, saved[name], read=False)
            files = [(s["file"], s["rows"]) for s in shards]
            out[name] = (m, Streamed(path, name, files, shard_of(m)), *_step_clock(saved[name], shard_of(m)))
    tables = {name: m for name, m in tables.items() if name not in out}
    by_file = defaultdict(list)
    for name in tables:
        for s in saved[name]["shards"]:
            by_file[s["file"]].append(name)
    parts = defaultdict(list)
    rows = sum(s["rows"] for name in tables for s in saved[name]["shards"])
    for fname in _io.progress(sorted(by_file), rows, "checkpoint: reading table shards"):
        with safe_open(str(path / fname), "pt") as f:
            for name in by_file[fname]:
                parts[name].append(_owned(_entries(f, fname, name, saved[name]), shard_of(tables[name])))
    for name, m in tables.items():
        entries = {k: torch.cat([p[k] for p in parts[name]]) for k in ENTRIES}
        if entries["keys"].unique().numel() != entries["keys"].numel():
            raise CheckpointError(f"table {name!r}: some keys appear in more than one shard file; the shards overlap")
        out[name] = (m, entries, *_step_clock(saved[name], shard_of(m)))
    return out


def _entries(f, fname: str, name: str, meta: dict, read: bool = True) -> dict[str, torch.Tensor]:
    """Table ``name``'s entries in the open shard file ``f``, checked against the manifest;
    with ``read=False`` only checked (names and shapes), and none returned."""
    rows = next(s["rows"] for s in meta["shards"] if s["file"] == fname)
    want = {"keys": (rows,), "weights": (rows, meta["dim"]), "optimizer_state": (rows, meta["state_width"]),
            "scores": (rows,)}  # fmt: skip
    entries = {}
    for k, shape in want.items():
        key = f"{name}/{k}"
        got = _stored_shape(f, fname, key)
        if got != shape:
            raise CheckpointError(f"{fname}: {key!r} has shape {got}, {MANIFEST} says {shape}")
        if read:
            entries[k] = f.get_tensor(key)
    return entries


def _owned(entries: dict[str, torch.Tensor], shard: tuple[int, int]) -> dict[str, torch.Tensor]:
    rank, world = shard
    if world == 1:
        return entries
    keep = owner_of(entries["keys"], world) == rank
    return {k: v[keep] for k, v in entries.items()}


def _step_clock(meta: dict, shard: tuple[int, int]) -> tuple[int, int]:
    """The shard's own step and clock when the sharding is unchanged, else the largest."""
    same = [s for s in meta["shards"] if meta["shard_world"] == shard[1] and s["rank"] == shard[0]]
    pick = same or meta["shards"]
    return max(s["step"] for s in pick), max(s["clock"] for s in pick)


def _match_dense(saved: dict, dense: dict[str, torch.Tensor], f, strict: bool) -> dict:
    """(target, value) per dense tensor to load, after checking names and shapes."""
    if strict:
        _refuse_one_sided("dense tensor", saved, dense, "model's parameter and buffer names")
    out = {}
    for name in sorted(saved.keys() & dense.keys()):
        shape = tuple(saved[name]["shape"])
        if shape != tuple(dense[name].shape):
            raise CheckpointError(
                f"{DENSE_FILE}: dense tensor {name!r} has shape {shape} but the model's is "
                f"{tuple(dense[name].shape)}; build the model with the sizes it was trained with"
            )
        out[name] = (dense[name], f.get_tensor(f"model/{name}"))
    return out


def _match_optimizer(saved: Optional[dict], optimizer, f, strict: bool) -> Optional[dict]:
    """The optimizer state to load (decoded, checked against ``optimizer``), or None."""
    if optimizer is None:
        return None
    if saved is None:
        if strict:
            raise CheckpointError(
                f"{MANIFEST}: the checkpoint holds no optimizer state but an optimizer was passed; "
                f"pass optimizer=None, or strict=False to keep the optimizer as it is"
            )
        return None
    dense_opt, _ = split_optimizer(optimizer)
    have, had = dense_opt is not None, saved["dense"] is not None
    dense_class = type(dense_opt).__name__ if have else None
    if (have and had and dense_class != saved["dense_class"]) or (strict and have != had):
        raise CheckpointError(
            f"{MANIFEST}: optimizer.dense_class is {saved['dense_class']!r} but the dense optimizer passed is "
            f"{dense_class!r}; use the optimizer it was trained with"
        )
    state = None
    if have and had:
        state = _io.decode(saved["dense"], f)
        _check_optimizer_state(state, dense_opt)
    return {"dense": state, "sparse": saved["sparse"]}


def _check_optimizer_state(state: dict, opt: torch.optim.Optimizer) -> None:
    """Refuses a dense optimizer state of other parameter counts or shapes than ``opt``'s."""
    groups = state.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        raise CheckpointError(
            f"{MANIFEST}: optimizer param_groups hold {[len(g['params']) for g in groups]} parameters but the "
            f"optimizer passed holds {[len(g['params']) for g in opt.param_groups]}; build it over the same parameters"
        )
    params = {i: p for g, mine in zip(groups, opt.param_groups) for i, p in zip(g["params"], mine["params"])}
    for i, entry in state.get("state", {}).items():
        if i not in params:
            raise CheckpointError(f"{MANIFEST}: optimizer state for parameter {i!r}, which no param_group lists")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != params[i].shape:
                raise CheckpointError(
                    f"{DENSE_FILE}: optimizer state {key!r} of parameter {i} has shape {tuple(value.shape)} but the "
                    f"parameter is {tuple(params[i].shape)}; use the optimizer it was trained with"
                )


# ---- applying a verified plan ---------------------------------------------------------------
@torch.no_grad()
def apply(plan: Plan, optimizer) -> None:
    """Loads a verified plan into the model's tables, dense tensors and the optimizer."""
    for name, (m, entries, step, clock) in plan.tables.items():
        try:
            if isinstance(entries, Streamed):
                m.table.load_chunks(entries.chunks())
            else:
                m.table.load_entries(entries)
        except (ValueError, RuntimeError) as exc:
            rows = entries.rows() if isinstance(entries, Streamed) else entries["keys"].numel()
            raise CheckpointError(f"table {name!r}: cannot hold the checkpoint's {rows} rows: {exc}")
        m.step_count, m.table.clock = step, clock  # drops the last step's unread check
        m.restore_pending_state(None)
        if name in plan.admission:
            m.load_admission_state(plan.admission[name])  # shapes checked by read()
    for target, value in plan.dense.values():
        target.copy_(value)
    if plan.optimizer is not None:
        dense_opt, _ = split_optimizer(optimizer)
        if plan.optimizer["dense"] is not None:
            dense_opt.load_state_dict(plan.optimizer["dense"])
        if isinstance(optimizer, CombinedOptimizer):
            optimizer.load_state_dict({"dense": None, "sparse": plan.optimizer["sparse"]})


class Undo:
    """What :func:`apply` may change, kept so a failed load can be rolled back (table
    buffers are replaced, not overwritten, by a load: keeping references is enough)."""

    @torch.no_grad()
    def __init__(self, plan: Plan, optimizer) -> None:
        for m, *_ in plan.tables.values():  # exact sizes; a refused deferred insert is forgotten (the load replaces)
            m.table.settle(refusals=False)
        self.tables = [
            (m, m.table.snapshot(), m.step_count, m.pending_state()) for m, *_ in plan.tables.values()
        ]
        self.admission = [(m, {k: v.clone() for k, v in m.table.admission_state().items()}, m.table._sketch_base)
                          for m, *_ in plan.tables.values()]  # fmt: skip
        self.dense = [(target, target.detach().clone()) for target, _ in plan.dense.values()]
        self.optimizer = optimizer
        self.opt_state = copy.deepcopy(optimizer.state_dict()) if plan.optimizer is not None else None

    @torch.no_grad()
    def restore(self) -> None:
        """Puts back what was kept (idempotent)."""
        for m, table, step, pending in self.tables:
            m.table.restore(table)
            m.step_count = step
            m.restore_pending_state(pending)  # with a "raise_next" error the failed load had dropped
        for m, state, base in self.admission:
            m.table.load_admission_state(state)
            m.table._sketch_base = base
        for target, value in self.dense:
            target.copy_(value)
        if self.opt_state is not None:
            self.optimizer.load_state_dict(self.opt_state)




def _stored_shape(f: Any, fname: str, key: str) -> tuple[int, ...]:
    """The shape of tensor ``key`` in the open safetensors file ``f`` (named ``fname``).

    Raises:
        CheckpointError: the file lacks it (the checkpoint is corrupt).
    """
    if key not in f.keys():
        raise CheckpointError(f"{fname}: tensor {key!r} is missing; the checkpoint is corrupt")
    return tuple(f.get_slice(key).get_shape())
