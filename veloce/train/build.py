"""The pieces of a ``veloce train`` run, built from its :class:`~veloce.train.config.Config`:
the model (:func:`build_model`), this rank's data loaders (:func:`build_loaders`), the
Trainer (:func:`build_trainer`), its serving callback (:func:`build_publish`) and the
device (:func:`config_device`).

Example::

    cfg = load_config("configs/dlrm_synthetic.yaml")
    model = build_model(cfg, torch.device("cpu"))
    train_loader, val_loader = build_loaders(cfg)
    build_trainer(cfg, model).fit(train_loader, val_loader)
"""

from __future__ import annotations

import importlib
import itertools
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

import veloce
from veloce import eviction as veloce_eviction
from veloce import init as veloce_init
from veloce import metrics, optim, storage
from veloce.data import CriteoTSV, SyntheticClicks
from veloce.data.criteo import NUM_DENSE, NUM_SPARSE
from veloce.embedding import DynamicEmbedding
from veloce.models import DLRM, DeepFM
from veloce.serving import FileStore, Publish, RedisStore, RocksDBStore, ServingStore
from veloce.train.callbacks import Callback
from veloce.train.config import AdmissionConfig, Config, ConfigError, StorageConfig
from veloce.train.trainer import Trainer

__all__ = ["build_admission", "build_loaders", "build_model", "build_publish", "build_storage", "build_trainer",
           "config_device"]  # fmt: skip

_SPARSE_OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowWiseAdagrad", "adam": "Adam",
                      "ftrl": "FTRL"}  # fmt: skip
_DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
_VAL_START = 10**9  # synthetic validation samples are drawn from here on: disjoint from training


def build_model(cfg: Config, device: torch.device) -> nn.Module:
    """The config's DLRM or DeepFM, with one ``DynamicEmbedding`` per sparse feature on ``device``."""
    t, s = cfg.tables, cfg.optimizer.sparse
    initializers = {
        "normal": lambda: veloce_init.normal(std=t.init_scale),
        "uniform": lambda: veloce_init.uniform(-t.init_scale, t.init_scale),
        "zeros": veloce_init.zeros,
    }
    init = initializers[t.initializer]()
    sparse_cls = getattr(optim, _SPARSE_OPTIMIZERS[s.name])
    sparse_opt = sparse_cls(**s.hyperparameters())
    eviction = veloce_eviction.TTL(steps=t.ttl_steps) if t.eviction == "ttl" else t.eviction

    seeds = itertools.count(cfg.trainer.seed * 1000)  # one seed per table: features start apart

    def table(dim: int) -> DynamicEmbedding:
        seed = next(seeds)
        admission = build_admission(t.admission)  # one per table: each counts its own ids
        return DynamicEmbedding(
            dim, mode=t.mode, capacity=t.capacity, max_capacity=t.max_capacity, eviction=eviction,
            initializer=init, optimizer=sparse_opt, seed=seed, device=device, defer_inserts=t.defer_inserts,
            storage=build_storage(t.storage, f"table_{seed - cfg.trainer.seed * 1000}"),
            **({} if admission is None else {"admission": admission}),
        )  # fmt: skip

    num_dense, num_sparse = _feature_counts(cfg)
    m = cfg.model
    if m.name == "dlrm":
        model = DLRM(num_dense, num_sparse, m.embedding_dim, m.bottom_mlp, m.top_mlp, embedding_factory=table)
    else:
        model = DeepFM(num_dense, num_sparse, m.embedding_dim, m.deep_mlp, embedding_factory=table)
    return model.to(device)


def build_storage(cfg: StorageConfig, name: str = "table_0") -> storage.StorageSpec:
    """The ``veloce.storage`` spec of ``tables.storage``; a rocksdb table's database is
    ``path/<name>`` (one directory per table under the configured one; on several ranks
    ``path/<name>/rank<R>``, each rank's shard). A run's databases are its working storage
    (its checkpoints are what it resumes from): a database left by an earlier run at the
    same path is cleared (``RocksDB(existing="clear")``).
    A rocksdb table needs ``veloce._rocksdb`` (built where RocksDB is found): without it,
    making the table raises an ImportError that says how to install it.
    """
    cache = {k: v for k, v in (("cache_rows", cfg.cache_rows), ("cache_bytes", cfg.cache_bytes)) if v is not None}
    if cfg.kind == "device":
        return storage.Device()
    if cfg.kind == "host_cached":
        return storage.HostCached(policy=cfg.policy, **cache)
    os.makedirs(str(cfg.path), exist_ok=True)  # the run's directory of databases
    return storage.RocksDB(os.path.join(str(cfg.path), name), policy=cfg.policy, existing="clear", **cache)


def build_admission(cfg: AdmissionConfig) -> Any:
    """The ``veloce.admission`` object of ``tables.admission`` (a fresh one per call: a
    table's admission keeps its own counts), or None with ``kind: none``.

    Raises:
        ConfigError: the kind needs ``veloce.admission`` and this veloce has none.
    """
    if cfg.kind == "none":
        return None
    module = getattr(veloce, "admission", None)
    if module is None:
        try:
            module = importlib.import_module("veloce.admission")
        except ImportError:
            module = None
    if module is None:
        raise ConfigError(
            f"config error: tables.admission.kind is {cfg.kind!r}, but this veloce has no veloce.admission "
            f"(veloce {getattr(veloce, '__version__', '?')}); use a veloce with admission, or set "
            f"tables.admission.kind: none"
        )  # fmt: skip
    if cfg.kind == "probability":
        return module.Probability(cfg.p, **({} if cfg.seed is None else {"seed": cfg.seed}))
    given = {k: getattr(cfg, k) for k in ("width", "depth", "seed") if getattr(cfg, k) is not None}
    return module.Frequency(cfg.min_count, **given)


def build_loaders(cfg: Config, rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    """(train loader, validation loader) of this rank; a Criteo file is split by time (last rows validate)."""
    d = cfg.data
    if d.kind == "synthetic":
        common = dict(num_dense=d.num_dense, num_sparse=d.num_sparse, id_space=d.id_space,
                      zipf_alpha=d.zipf_alpha, seed=d.seed, rank=rank, world_size=world_size)  # fmt: skip
        train = SyntheticClicks(d.samples, d.batch_size, **common)
        val = SyntheticClicks(d.val_samples, d.val_batch_size, start=_VAL_START, **common)
    else:
        path = os.path.expanduser(os.path.expandvars(d.path))
        if not Path(path).is_file():
            raise ConfigError(
                f"config error: data.path is not a file: {path} (in a config file, a relative data.path is relative "
                f"to the file's directory; with --set, to the current directory)"
            )  # fmt: skip
        rows = d.rows or CriteoTSV(path).num_rows()  # (the count is the one pass over the file before training)
        split = int(rows * (1 - d.val_fraction))
        common = dict(rank=rank, world_size=world_size, strict=d.strict, total_rows=rows)
        train = CriteoTSV(path, d.batch_size, stop=split, **common)
        val = CriteoTSV(path, d.val_batch_size, start=split, stop=rows, **common)

    def loader(ds: Any) -> DataLoader:
        init = _worker_ignores_sigint if d.num_workers else None
        return DataLoader(ds, batch_size=None, num_workers=d.num_workers, worker_init_fn=init)

    return loader(train), loader(val)


def build_trainer(
    cfg: Config,
    model: nn.Module,
    checkpoints: bool = True,
    callbacks: Sequence[Callback] = (),
    publish: bool = True,
) -> Trainer:
    """A Trainer with the config's optimizers and settings, AUC / log loss / accuracy metrics,
    checkpoints in ``trainer.checkpoints()`` (if ``checkpoints``), logs in ``run_dir``,
    ``callbacks``, and the ``serving`` section's :class:`~veloce.serving.Publish` (if
    ``publish``; :func:`build_publish`)."""
    o, tr, st = cfg.optimizer.dense, cfg.trainer, cfg.strategy
    params = [p for p in model.parameters() if p.requires_grad]
    # A captured step (trainer.cuda_graph) needs Adam's state, its step count too, on the device.
    extra = {"capturable": True} if tr.cuda_graph and o.name == "adam" else {}
    dense = _DENSE_OPTIMIZERS[o.name](params, lr=o.lr, weight_decay=o.weight_decay, **extra) if params else None
    serving = build_publish(cfg) if publish else None
    callbacks = [*callbacks, serving] if serving is not None else list(callbacks)
    return Trainer(
        model, optimizer=dense,
        metrics={"auc": metrics.AUC(), "logloss": metrics.LogLoss(), "accuracy": metrics.Accuracy()},
        strategy={"sparse": st.sparse, "staleness": st.staleness, "dense": st.dense, "lookup_errors": st.lookup_errors,
                  "exchange_dtype": st.exchange_dtype},
        precision=tr.precision, accumulate_steps=tr.accumulate_steps, max_epochs=tr.max_epochs,
        max_steps=tr.max_steps, checkpoint_dir=tr.checkpoints() if checkpoints else None,
        checkpoint_every=tr.checkpoint_every if checkpoints else None, keep_last=tr.keep_last,
        log_every=tr.log_every, log_dir=tr.run_dir, progress=tr.progress, seed=tr.seed, callbacks=callbacks,
        cuda_graph=tr.cuda_graph, clip_grad_norm=tr.clip_grad_norm,
    )  # fmt: skip


def build_publish(cfg: Config) -> Optional[Publish]:
    """The ``serving`` section's :class:`~veloce.serving.Publish` callback (None while
    ``serving.store`` is null). A Redis store connects here: an unreachable server fails
    before training starts."""
    s = cfg.serving
    if s.store is None:
        return None
    store: ServingStore
    if s.store == "file":
        store = FileStore(s.path)
    elif s.store == "rocksdb":
        store = RocksDBStore(s.path)
    else:
        store = RedisStore(s.url, s.namespace)
    dtype = None if s.dtype == "float32" else getattr(torch, s.dtype)
    return Publish(store, every_n_steps=s.every_n_steps, at_end=s.at_end, keep_last=s.keep_last,
                   fold_every=s.fold_every, dtype=dtype, lease_ttl=s.lease_ttl, owner=s.owner,
                   take_over=s.take_over)  # fmt: skip


def _worker_ignores_sigint(worker_id: int) -> None:
    """A DataLoader worker leaves Ctrl-C to the training process, which checkpoints and
    stops at the end of its step: a worker ended by it would fail that step's next batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _feature_counts(cfg: Config) -> tuple[int, int]:
    if cfg.data.kind == "criteo":
        return NUM_DENSE, NUM_SPARSE
    return cfg.data.num_dense, cfg.data.num_sparse


def config_device(cfg: Config) -> torch.device:
    """The config's ``trainer.device`` (``auto``: CUDA when torch sees a GPU; ``cuda``: this
    rank's GPU under torchrun), or ConfigError when torch does not see it."""
    name = cfg.trainer.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{os.environ['LOCAL_RANK']}"
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"config error: trainer.device is {cfg.trainer.device!r} but torch sees no CUDA device "
                              f"(torch {torch.__version__}); use trainer.device=cpu or auto")  # fmt: skip
        if device.index is not None and device.index >= count:
            raise ConfigError(f"config error: trainer.device is {name!r} but torch sees {count} CUDA device(s)")
    return device
