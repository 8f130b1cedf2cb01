"""The ``veloce`` command: train and evaluate from a YAML config, inspect checkpoints.

    veloce train configs/dlrm_synthetic.yaml [--set trainer.max_epochs=2 ...]
    veloce evaluate configs/dlrm_synthetic.yaml --checkpoint runs/dlrm_synthetic/checkpoints
    veloce inspect runs/dlrm_synthetic/checkpoints/step_0000000489 [--json]
    torchrun --nproc-per-node 2 -m veloce.cli train configs/dlrm_criteo.yaml   # several ranks

The config's fields are documented in ``docs/config.md`` (schema: :mod:`veloce.config`).
Exit status: 0 on success, 1 on a runtime or checkpoint error, 2 on a config error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from veloce import checkpoint, metrics
from veloce.config import Config, ConfigError, load_config
from veloce.trainer import Trainer

__all__ = ["main", "build_model", "build_loaders", "build_trainer"]

_SPARSE_OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowWiseAdagrad", "adam": "Adam"}
_DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
_VAL_START = 10**9  # synthetic validation samples are drawn from here on: disjoint from training


# ---- building the pieces from a config ----------------------------------------------------------
def build_model(cfg: Config, device: torch.device) -> nn.Module:
    """The config's DLRM or DeepFM, with one ``DynamicEmbedding`` per sparse feature on ``device``."""
    import veloce
    from veloce.models import DLRM, DeepFM

    t, s = cfg.tables, cfg.optimizer.sparse
    initializers = {
        "normal": lambda: veloce.init.normal(std=t.init_scale),
        "uniform": lambda: veloce.init.uniform(-t.init_scale, t.init_scale),
        "zeros": veloce.init.zeros,
    }
    init = initializers[t.initializer]()
    eps = {"eps": s.eps} if s.eps is not None else {}
    sparse_cls = getattr(veloce.optim, _SPARSE_OPTIMIZERS[s.name])
    sparse_opt = sparse_cls(lr=s.lr, weight_decay=s.weight_decay, **eps)

    seeds = itertools.count(cfg.trainer.seed * 1000)  # one seed per table: features start apart

    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(
            dim, mode=t.mode, capacity=t.capacity, max_capacity=t.max_capacity, eviction=t.eviction,
            initializer=init, optimizer=sparse_opt, seed=next(seeds), device=device,
        )  # fmt: skip

    num_dense, num_sparse = _feature_counts(cfg)
    m = cfg.model
    if m.name == "dlrm":
        model = DLRM(num_dense, num_sparse, m.embedding_dim, m.bottom_mlp, m.top_mlp, embedding_factory=table)
    else:
        model = DeepFM(num_dense, num_sparse, m.embedding_dim, m.deep_mlp, embedding_factory=table)
    return model.to(device)


def build_loaders(cfg: Config, rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    """(train loader, validation loader) of this rank; a Criteo file is split by time (last rows validate)."""
    from torch.utils.data import DataLoader

    from veloce.data import CriteoTSV, SyntheticClicks

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
                f"config error: data.path is not a file: {path} (relative to the current directory)"
            )
        rows = d.rows or CriteoTSV(path).num_rows()
        split = int(rows * (1 - d.val_fraction))
        train = CriteoTSV(path, d.batch_size, stop=split, rank=rank, world_size=world_size)
        val = CriteoTSV(path, d.val_batch_size, start=split, stop=rows, rank=rank, world_size=world_size)
    def loader(ds: Any) -> DataLoader:
        return DataLoader(ds, batch_size=None, num_workers=d.num_workers)

    return loader(train), loader(val)


def build_trainer(cfg: Config, model: nn.Module, checkpoints: bool = True) -> Trainer:
    """A Trainer with the config's optimizers and settings, AUC / log loss / accuracy metrics,
    checkpoints in ``trainer.checkpoints()`` (if ``checkpoints``) and logs in ``run_dir``."""
    o, tr, st = cfg.optimizer.dense, cfg.trainer, cfg.strategy
    params = [p for p in model.parameters() if p.requires_grad]
    dense = _DENSE_OPTIMIZERS[o.name](params, lr=o.lr, weight_decay=o.weight_decay) if params else None
    return Trainer(
        model, optimizer=dense,
        metrics={"auc": metrics.AUC(), "logloss": metrics.LogLoss(), "accuracy": metrics.Accuracy()},
        strategy={"sparse": st.sparse, "staleness": st.staleness, "dense": st.dense},
        precision=tr.precision, accumulate_steps=tr.accumulate_steps, max_epochs=tr.max_epochs,
        max_steps=tr.max_steps, checkpoint_dir=tr.checkpoints() if checkpoints else None,
        checkpoint_every=tr.checkpoint_every if checkpoints else None, keep_last=tr.keep_last,
        log_every=tr.log_every, log_dir=tr.run_dir, progress=tr.progress, seed=tr.seed,
    )  # fmt: skip


def _feature_counts(cfg: Config) -> tuple[int, int]:
    if cfg.data.kind == "criteo":
        from veloce.data.criteo import NUM_DENSE, NUM_SPARSE

        return NUM_DENSE, NUM_SPARSE
    return cfg.data.num_dense, cfg.data.num_sparse


def _device(cfg: Config) -> torch.device:
    name = cfg.trainer.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{os.environ['LOCAL_RANK']}"
    return torch.device(name)


def _init_distributed(device: torch.device) -> tuple[int, int]:
    """Joins the process group that ``torchrun`` describes (WORLD_SIZE > 1); (rank, world_size)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dist = torch.distributed
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank(), world_size) if world_size > 1 else (0, 1)


# ---- commands ------------------------------------------------------------------------------------
def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    device = _device(cfg)
    rank, world_size = _init_distributed(device)
    torch.manual_seed(cfg.trainer.seed)  # the model's initial dense weights
    model = build_model(cfg, device)
    train, val = build_loaders(cfg, rank, world_size)
    trainer = build_trainer(cfg, model)
    history = trainer.fit(train, val)
    if rank == 0:
        summary = {"history": history, "config": args.config, "device": str(device), "world_size": world_size}
        Path(cfg.trainer.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.trainer.run_dir) / "metrics.json").write_text(json.dumps(summary, indent=1))
        if history:
            last = history[-1]
            vals = ", ".join(f"{k[4:]} {v:.4f}" for k, v in last.items() if k.startswith("val_"))
            print(f"epoch {last['epoch']}: {vals}; {last['samples_per_s']:,.0f} samples/s on {device}")
        print(f"checkpoints: {cfg.trainer.checkpoints()}  log: {Path(cfg.trainer.run_dir) / 'log.jsonl'}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    device = _device(cfg)
    rank, world_size = _init_distributed(device)
    model = build_model(cfg, device)
    path = Path(args.checkpoint)
    found = path if (path / "manifest.json").exists() else checkpoint.latest(path)
    if found is None:
        raise checkpoint.CheckpointError(f"no committed checkpoint at or under {path}")
    trainer = build_trainer(cfg, model, checkpoints=False)  # shards the tables first on several ranks
    step = checkpoint.load(found, trainer.model)["step"]
    _, val = build_loaders(cfg, rank, world_size)
    result = trainer.evaluate(val)
    if rank == 0:
        print(json.dumps({"checkpoint": str(found), "step": step, **result}))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    info = checkpoint.describe(args.checkpoint)
    print(json.dumps(info, indent=1) if args.json else format_description(info))
    return 0


def format_description(info: dict[str, Any]) -> str:
    """``checkpoint.describe()``'s dict as text: the header fields, one row per table, the files."""
    lines = [f"{k}: {info[k]}" for k in ("path", "committed", "format_version", "world_size", "step") if k in info]
    extra = info.get("extra") or {}
    if extra:
        lines.append(f"extra: {', '.join(sorted(extra))}")
    dense = info.get("dense")
    if dense:
        lines.append(f"dense: {dense['count']} tensors, {dense['bytes']:,} bytes")
    tables = info.get("tables", [])
    lines.append(f"tables: {len(tables)}")
    cols = ["name", "rows", "dim", "state_width", "dtype", "optimizer", "shards"]
    if tables:
        cells = [[str(t.get(c, "")) for c in cols] for t in tables]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        for row in [cols, *cells]:
            lines.append(("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths))).rstrip())
    files = info.get("files", [])
    lines.append(f"files: {len(files)}")
    for f in files:
        state = "" if f.get("present") == f.get("size") else f"  (on disk: {f.get('present')})"
        lines.append(f"  {f['name']}  {f['size']:,} bytes{state}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="veloce", description="Train, evaluate and inspect veloce models.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "train from a YAML config (resumes from its checkpoints)"),
                        ("evaluate", "evaluate a checkpoint on the config's validation data")):  # fmt: skip
        c = sub.add_parser(name, help=help_)
        c.add_argument("config", help="YAML config (fields: docs/config.md)")
        c.add_argument("--set", action="append", default=[], metavar="KEY.SUB=VALUE",
                       help="override a field, e.g. --set trainer.max_epochs=2 (repeatable)")  # fmt: skip
        if name == "evaluate":
            c.add_argument("--checkpoint", required=True, help="a checkpoint, or a folder of them (newest)")
    c = sub.add_parser("inspect", help="print a checkpoint's manifest: step, world size, tables, files")
    c.add_argument("checkpoint", help="a checkpoint directory")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the ``veloce`` command line; returns the exit status."""
    args = _parser().parse_args(argv)
    command = {"train": _train, "evaluate": _evaluate, "inspect": _inspect}[args.command]
    try:
        return command(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except checkpoint.CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
