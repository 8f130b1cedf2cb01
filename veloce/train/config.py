"""The YAML config of ``veloce train`` / ``veloce evaluate``: a small, explicit, validated schema.

Seven sections, each a frozen dataclass; every field has a default, so a config only states
what it changes. ``docs/config.md`` documents every field. Loading checks types and
ranges and names the offending field::

    config error: optimizer.sparse.lr must be a positive number, got -1
    config error: unknown field trainer.max_epoch (did you mean max_epochs?)

Paths: ``data.path`` and ``tables.storage.path`` written in a config file are relative to
that file's directory (the config and its data move together); given with ``--set`` they
are relative to the current directory, as any path typed in a shell. :func:`load_config`
makes them absolute.
``trainer.run_dir``, ``trainer.checkpoint_dir`` and ``serving.path`` stay relative to the
current directory (outputs go where the command runs).

Example::

    cfg = load_config("configs/dlrm_synthetic.yaml", overrides=["trainer.max_epochs=2"])
    cfg.optimizer.sparse.lr   # 0.05
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml

__all__ = ["Config", "ConfigError", "load_config", "parse_config"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


class _FieldError(Exception):
    """Raised by a section's checks with the field's name; the loader adds the section's path."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(name, message)
        self.name, self.message = name, message


def _require(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise _FieldError(name, f"must be {what}, got {value!r}")


def _positive(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value is None or (math.isfinite(value) and value > 0), name, "a positive number", value)


def _non_negative(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value is None or (math.isfinite(value) and value >= 0), name, "a number >= 0", value)


@dataclass(frozen=True)
class ModelConfig:
    """``model``: which network and its sizes."""

    name: Literal["dlrm", "deepfm"] = "dlrm"
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 32, 1)
    deep_mlp: tuple[int, ...] = (64, 32)

    def __post_init__(self) -> None:
        _positive(self, "embedding_dim")
        for name in ("bottom_mlp", "top_mlp", "deep_mlp"):
            sizes = getattr(self, name)
            _require(all(s >= 1 for s in sizes), name, "a list of layer sizes >= 1", list(sizes))
        if self.name == "dlrm":
            ends = bool(self.bottom_mlp) and self.bottom_mlp[-1] == self.embedding_dim
            what = f"a list ending with embedding_dim ({self.embedding_dim})"
            _require(ends, "bottom_mlp", what, list(self.bottom_mlp))
            ends = bool(self.top_mlp) and self.top_mlp[-1] == 1
            _require(ends, "top_mlp", "a list ending with 1 (the logit)", list(self.top_mlp))


@dataclass(frozen=True)
class DataConfig:
    """``data``: where batches come from (synthetic clicks or a Criteo TSV file)."""

    kind: Literal["synthetic", "criteo"] = "synthetic"
    batch_size: int = 2048
    val_batch_size: int = 8192
    num_workers: int = 0
    # synthetic
    samples: int = 1_000_000
    val_samples: int = 100_000
    num_dense: int = 13
    num_sparse: int = 26
    id_space: int = 1_000_000
    zipf_alpha: float = 1.15
    seed: int = 0
    # criteo
    path: Optional[str] = None
    rows: Optional[int] = None
    val_fraction: float = 0.15
    strict: bool = True

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "val_batch_size", "samples", "val_samples", "num_sparse", "id_space",
                  "zipf_alpha", "rows")  # fmt: skip
        _non_negative(self, "num_workers", "num_dense", "seed")
        _require(0 < self.val_fraction < 1, "val_fraction", "a number in (0, 1)", self.val_fraction)
        if self.kind == "criteo":
            _require(self.path is not None, "path", "the Criteo TSV file when kind is criteo", self.path)


@dataclass(frozen=True)
class StorageConfig:
    """``tables.storage``: where each table's rows live (``veloce.storage``)."""

    kind: Literal["device", "host_cached", "rocksdb"] = "device"
    cache_rows: Optional[int] = None
    cache_bytes: Optional[int] = None
    policy: Optional[Literal["lru", "lfu"]] = None
    path: Optional[str] = None

    def __post_init__(self) -> None:
        _positive(self, "cache_rows", "cache_bytes")
        cache = self.cache_rows is not None or self.cache_bytes is not None
        if self.kind == "device":
            for name in ("cache_rows", "cache_bytes", "policy", "path"):
                _require(getattr(self, name) is None, name, "null with kind device (every row on the device; "
                         "kind host_cached or rocksdb has a cache)", getattr(self, name))  # fmt: skip
            return
        _require(self.cache_rows is None or self.cache_bytes is None, "cache_bytes",
                 "null when cache_rows is set (give one of the two)", self.cache_bytes)  # fmt: skip
        if self.kind == "host_cached":
            _require(cache, "cache_rows", "set with kind host_cached (the rows its device cache holds), or "
                     "cache_bytes", self.cache_rows)  # fmt: skip
            _require(self.path is None, "path", "null with kind host_cached (rows in host memory; kind rocksdb "
                     "takes a path)", self.path)  # fmt: skip
        else:
            _require(isinstance(self.path, str) and self.path != "", "path",
                     "the RocksDB database's directory with kind rocksdb", self.path)  # fmt: skip


@dataclass(frozen=True)
class AdmissionConfig:
    """``tables.admission``: which ids get a row of their own (``veloce.admission``); the
    others read and train the table's default row. ``kind: frequency`` admits an id at its
    ``min_count``-th sighting, counted in a sketch of ``depth`` rows of ``width`` counters;
    ``kind: probability`` admits with probability ``p`` per sighting. ``width``, ``depth``
    and ``seed`` left null take ``veloce.admission``'s defaults."""

    kind: Literal["none", "frequency", "probability"] = "none"
    min_count: Optional[int] = None
    p: Optional[float] = None
    width: Optional[int] = None
    depth: Optional[int] = None
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        _positive(self, "min_count", "width", "depth")
        if self.p is not None:
            _require(0 < self.p <= 1, "p", "a probability in (0, 1] (1 admits every id)", self.p)
        sketch = ("min_count", "width", "depth")
        if self.kind == "none":
            for name in (*sketch, "p", "seed"):
                _require(getattr(self, name) is None, name, "null with kind none (every id gets a row; kind "
                         "frequency or probability admits)", getattr(self, name))  # fmt: skip
        elif self.kind == "frequency":
            _require(self.min_count is not None, "min_count", "set with kind frequency (the sighting that "
                     "admits an id: 2 gives rows to ids seen at least twice)", self.min_count)  # fmt: skip
            _require(self.p is None, "p", "null with kind frequency (kind probability takes p)", self.p)
        else:
            _require(self.p is not None, "p", "set with kind probability (the chance a sighting admits)", self.p)
            for name in sketch:
                _require(getattr(self, name) is None, name, "null with kind probability (kind frequency counts "
                         "sightings in a sketch)", getattr(self, name))  # fmt: skip


@dataclass(frozen=True)
class TablesConfig:
    """``tables``: the settings of every ``DynamicEmbedding``."""

    capacity: int = 16384
    max_capacity: Optional[int] = None
    eviction: Literal["lru", "lfu", "none", "ttl"] = "lru"
    ttl_steps: Optional[int] = None
    mode: Literal["sum", "mean"] = "sum"
    initializer: Literal["normal", "uniform", "zeros"] = "normal"
    init_scale: float = 0.01
    defer_inserts: bool = False
    storage: StorageConfig = field(default_factory=StorageConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        _positive(self, "capacity", "max_capacity", "ttl_steps")
        _non_negative(self, "init_scale")
        if self.max_capacity is not None:
            what = f"null or >= capacity ({self.capacity})"
            _require(self.max_capacity >= self.capacity, "max_capacity", what, self.max_capacity)
        if self.eviction == "ttl":
            _require(self.ttl_steps is not None, "ttl_steps", "set with eviction ttl (rows unseen for this many "
                     "steps are dropped)", self.ttl_steps)  # fmt: skip
        else:
            _require(self.ttl_steps is None, "ttl_steps", f"null unless eviction is ttl (eviction is "
                     f"{self.eviction})", self.ttl_steps)  # fmt: skip
        # a cache ranks its rows by the table's scores: last-seen steps (lru, none, ttl) or use counts (lfu)
        policy = self.storage.policy
        if policy == "lru" and self.eviction == "lfu":
            raise _FieldError("storage.policy", "must be lfu or null with eviction lfu (the table keeps use "
                              "counts, not last-seen steps), got 'lru'")  # fmt: skip
        if policy == "lfu" and self.eviction != "lfu":
            raise _FieldError("storage.policy", f"must be lru or null with eviction {self.eviction} (the table "
                              f"keeps last-seen steps; eviction lfu keeps use counts), got 'lfu'")  # fmt: skip


@dataclass(frozen=True)
class DenseOptimizerConfig:
    """``optimizer.dense``: the torch optimizer of the dense parameters."""

    name: Literal["adam", "adagrad", "sgd"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "lr")
        _non_negative(self, "weight_decay")


_FTRL_FIELDS = ("lr_power", "l1", "l2", "initial_accumulator_value", "beta")


@dataclass(frozen=True)
class SparseOptimizerConfig:
    """``optimizer.sparse``: the fused optimizer of the embedding tables. Its own
    hyperparameters (null: the optimizer's default): ``eps`` (adagrad, rowwise_adagrad,
    adam), ``betas`` (adam), and FTRL's ``lr_power``, ``l1``, ``l2``,
    ``initial_accumulator_value``, ``beta``."""

    name: Literal["adagrad", "rowwise_adagrad", "sgd", "adam", "ftrl"] = "adagrad"
    lr: float = 0.05
    eps: Optional[float] = None
    weight_decay: float = 0.0
    betas: Optional[tuple[float, ...]] = None
    lr_power: Optional[float] = None
    l1: Optional[float] = None
    l2: Optional[float] = None
    initial_accumulator_value: Optional[float] = None
    beta: Optional[float] = None

    def __post_init__(self) -> None:
        _positive(self, "lr", "initial_accumulator_value")
        _non_negative(self, "eps", "weight_decay", "l1", "l2", "beta")
        if self.lr_power is not None:
            _require(math.isfinite(self.lr_power) and self.lr_power <= 0, "lr_power", "a number <= 0", self.lr_power)
        if self.eps is not None:
            _require(self.name not in ("sgd", "ftrl"), "eps", f"null with {self.name} (it has no eps)", self.eps)
        if self.betas is not None:
            _require(self.name == "adam", "betas", f"null with {self.name} (betas are adam's)", list(self.betas))
            ok = len(self.betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in self.betas)
            _require(ok, "betas", "a list of two numbers in [0, 1)", list(self.betas))
        if self.name != "ftrl":
            for name in _FTRL_FIELDS:
                _require(getattr(self, name) is None, name, f"null with {self.name} ({name} is ftrl's)",
                         getattr(self, name))  # fmt: skip

    def hyperparameters(self) -> dict[str, Any]:
        """The optimizer's keyword arguments: ``lr``, ``weight_decay`` and the set ones of its own."""
        own = ("eps", "betas", *_FTRL_FIELDS)
        out = {"lr": self.lr, "weight_decay": self.weight_decay}
        out.update({k: getattr(self, k) for k in own if getattr(self, k) is not None})
        return out


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``dense`` and ``sparse``."""

    dense: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    sparse: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)


@dataclass(frozen=True)
class TrainerConfig:
    """``trainer``: the :class:`veloce.Trainer`'s settings and where outputs go."""

    max_epochs: int = 1
    max_steps: Optional[int] = None
    precision: Literal["fp32", "bf16"] = "fp32"
    accumulate_steps: int = 1
    clip_grad_norm: Optional[float] = None
    log_every: int = 50
    run_dir: str = "runs/veloce"
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None
    keep_last: int = 3
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        _positive(self, "max_epochs", "max_steps", "accumulate_steps", "log_every", "checkpoint_every",
                  "clip_grad_norm")
        _require(not self.cuda_graph or self.clip_grad_norm is None, "clip_grad_norm",
                 "null with trainer.cuda_graph (the norm is read on the host, which a captured step cannot do)",
                 self.clip_grad_norm)  # fmt: skip
        _require(not self.cuda_graph or self.accumulate_steps == 1, "accumulate_steps",
                 "1 with trainer.cuda_graph (a captured step is a whole optimizer step)", self.accumulate_steps)  # fmt: skip
        _positive(self, "keep_last")
        _non_negative(self, "seed")
        _require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"), "device",
                 "auto, cpu, cuda or cuda:N", self.device)  # fmt: skip

    def checkpoints(self) -> Path:
        """Where checkpoints go: ``checkpoint_dir``, else ``run_dir/checkpoints``."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"


@dataclass(frozen=True)
class StrategyConfig:
    """``strategy``: ``HybridParallel``'s settings, used when training on several ranks."""

    sparse: Literal["sync", "async"] = "sync"
    staleness: int = 1
    dense: Literal["ddp"] = "ddp"
    lookup_errors: Literal["raise", "raise_next"] = "raise"
    exchange_dtype: Literal["table", "bfloat16", "float16"] = "table"

    def __post_init__(self) -> None:
        _non_negative(self, "staleness")


@dataclass(frozen=True)
class ServingConfig:
    """``serving``: publish the model while it trains (``veloce.serving.Publish``); off
    while ``store`` is null."""

    store: Optional[Literal["file", "redis", "rocksdb"]] = None
    path: Optional[str] = None
    url: Optional[str] = None
    namespace: str = "veloce"
    every_n_steps: Optional[int] = None
    at_end: bool = True
    keep_last: int = 3
    fold_every: int = 10
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    lease_ttl: float = 600.0
    owner: Optional[str] = None
    take_over: bool = False

    def __post_init__(self) -> None:
        _positive(self, "every_n_steps", "keep_last", "fold_every", "lease_ttl")
        _require(self.owner is None or self.owner.strip() != "", "owner",
                 "null (a name of host, process and a random tag) or a non-empty name", self.owner)  # fmt: skip
        if self.store in ("file", "rocksdb"):
            _require(isinstance(self.path, str) and self.path != "", "path",
                     f"the store's directory with store {self.store}", self.path)  # fmt: skip
            _require(self.url is None, "url", f"null with store {self.store} (a directory: give path)", self.url)
        elif self.store == "redis":
            _require(isinstance(self.url, str) and self.url != "", "url",
                     "the Redis server's URL (redis://host:port/db) with store redis", self.url)  # fmt: skip
            _require(self.path is None, "path", "null with store redis (a server: give url)", self.path)
            _require(self.namespace != "", "namespace", "a non-empty name with store redis", self.namespace)
        if self.store is not None:
            _require(self.every_n_steps is not None or self.at_end, "at_end",
                     "true when every_n_steps is null (else nothing is ever published)", self.at_end)  # fmt: skip


@dataclass(frozen=True)
class Config:
    """A whole ``veloce train`` config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tables: TablesConfig = field(default_factory=TablesConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    def __post_init__(self) -> None:
        # torch's Adagrad keeps its step count on the host: a CUDA graph would not advance it.
        _require(not self.trainer.cuda_graph or self.optimizer.dense.name != "adagrad", "optimizer.dense.name",
                 "adam or sgd with trainer.cuda_graph (their state stays on the device)", self.optimizer.dense.name)  # fmt: skip


# ---- loading ---------------------------------------------------------------------------------
def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config, applies ``key.sub=value`` overrides (values parsed as YAML), validates.

    ``data.path`` and ``tables.storage.path`` are made absolute: from the file, relative to
    the file's directory; from an override, relative to the current directory (``$VARS``
    and ``~`` expanded first).

    Raises:
        ConfigError: naming the file, the override or the field that is wrong.
    """
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"config error: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config error: {path} is not valid YAML: {exc}") from None
    raw = {} if raw is None else raw
    if isinstance(raw, Mapping):
        raw = _resolve_paths(raw, Path(path).resolve().parent)
        cwd = Path.cwd()
        raw = _resolve_paths(_apply_overrides(raw, overrides), cwd) if overrides else raw
        overrides = ()
    return parse_config(raw, overrides)


_PATHS = (("data",), ("tables", "storage"))  # the sections whose ``path`` is a file or directory to read


def _resolve_paths(raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """``raw`` with each relative ``path`` of :data:`_PATHS` (a string) made absolute against ``base``."""
    out = _copy(raw)
    for sections in _PATHS:
        node: Any = out
        for name in sections:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get("path"), str):
            expanded = os.path.expanduser(os.path.expandvars(node["path"]))
            node["path"] = expanded if os.path.isabs(expanded) else os.path.normpath(base / expanded)
    return out


def parse_config(raw: Any, overrides: Sequence[str] = ()) -> Config:
    """Validates a config given as nested dicts (what YAML gives), after the overrides."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config error: the config must be a mapping of sections, got {type(raw).__name__}")
    raw = _apply_overrides(raw, overrides)
    return _build(Config, raw, "")


def _apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    out = _copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"config error: --set needs key.sub=value, got {item!r}")
        *parents, leaf = key.strip().split(".")
        node = out
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config error: --set {key}: {'.'.join(parents[: i + 1])} is not a section")
        node[leaf] = yaml.safe_load(text)
    return out


def _copy(raw: Any) -> Any:
    return {k: _copy(v) for k, v in raw.items()} if isinstance(raw, Mapping) else raw


def _build(cls: type, raw: Mapping[str, Any], path: str) -> Any:
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; known fields: {', '.join(names)}"
            raise ConfigError(f"config error: unknown field {_join(path, key)}{hint}")
    values = {k: _coerce(v, hints[k], _join(path, k)) for k, v in raw.items()}
    try:
        return cls(**values)
    except _FieldError as exc:
        raise ConfigError(f"config error: {_join(path, exc.name)} {exc.message}") from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked against the field's type (ints stay ints where a float is allowed)."""
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if value is None:  # a section whose fields are all commented out: every field's default
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"config error: {path} must be a section (a mapping of fields), got {value!r}")
        return _build(hint, value, path)
    if origin is Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return _coerce(value, inner, path)
    if origin is Literal:
        if value not in get_args(hint):
            choices = ", ".join(get_args(hint))
            raise ConfigError(f"config error: {path} must be one of {choices}, got {value!r}")
        return value
    if origin is tuple:
        if get_args(hint)[0] is float:
            numbers = [_float_or_same(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else None
            if numbers is None or not all(_is_number(v) for v in numbers):
                raise ConfigError(f"config error: {path} must be a list of numbers, got {value!r}")
            return tuple(float(v) for v in numbers)
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise ConfigError(f"config error: {path} must be a list of integers, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        value = _float_or_same(value)
    checks = {bool: (lambda v: isinstance(v, bool), "true or false"), int: (_is_int, "an integer"),
              float: (_is_number, "a number"), str: (lambda v: isinstance(v, str), "a string")}  # fmt: skip
    ok, what = checks[hint]
    if not ok(value):
        raise ConfigError(f"config error: {path} must be {what}, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_or_same(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text
