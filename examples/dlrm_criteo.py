"""Train a DLRM with veloce.DynamicEmbedding on Criteo click logs (raw hex ids, no vocabulary).

    python examples/dlrm_criteo.py                   # the Kaggle sample in ../shared/data: ~3 s on 2 CPU cores
    python examples/dlrm_criteo.py --data /data/criteo/day_0.gz --rows 10000000 --batch 4096 --device cuda

The file's rows are in time order: the first (1 - --val-fraction) of them train, the last
ones validate, as in production (train on the past, predict the future). Each of the 26
categorical features gets its own DynamicEmbedding keyed by the raw 32-bit hash
(``int(hex, 16)``); rows appear as ids are first seen. On the 8,018-row sample the
validation AUC is about 0.73, the same as a DLRM whose embeddings use an exact vocabulary
of the training ids (tests/models/test_criteo_auc.py, benchmarks/results/criteo_auc.md).
The same run from a config file: `veloce train configs/dlrm_criteo.yaml`.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch

import veloce
from veloce.data import CriteoTSV
from veloce.models import DLRM

DEFAULT_DATA = Path(os.environ.get("VELOCE_DATA_DIR", "../shared/data")) / "criteo" / "criteo_kaggle_train_sample.tsv"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DEFAULT_DATA), help="Criteo TSV file (plain or .gz), train layout")
    p.add_argument("--rows", type=int, default=None, help="use the first ROWS rows (default: all)")
    p.add_argument("--val-fraction", type=float, default=0.15, help="the latest rows held out for validation")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--lr", type=float, default=0.02, help="dense Adagrad learning rate")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="sparse Adagrad learning rate")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers parsing the TSV")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/dlrm_criteo", help="checkpoints and log.jsonl go here")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out (default: start over)")
    args = p.parse_args()
    if not Path(args.data).is_file():
        p.error(f"no Criteo file at {args.data}: pass --data PATH or set VELOCE_DATA_DIR")
    if not args.resume:
        shutil.rmtree(Path(args.out) / "checkpoints", ignore_errors=True)
        (Path(args.out) / "log.jsonl").unlink(missing_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    rows = args.rows or CriteoTSV(args.data).num_rows()
    split = int(rows * (1 - args.val_fraction))
    train = CriteoTSV(args.data, batch_size=args.batch, stop=split, total_rows=rows)  # (len() without a recount)
    val = CriteoTSV(args.data, batch_size=4096, start=split, stop=rows, total_rows=rows)
    loader = lambda ds: torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers)  # noqa: E731

    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=4096, optimizer=veloce.optim.Adagrad(lr=args.sparse_lr),
                                       device=device)  # fmt: skip

    model = DLRM(13, 26, embedding_dim=args.dim, embedding_factory=table).to(device)
    trainer = veloce.Trainer(
        model, optimizer=torch.optim.Adagrad(model.parameters(), lr=args.lr),
        metrics={"auc": veloce.metrics.AUC(), "logloss": veloce.metrics.LogLoss(), "accuracy": veloce.metrics.Accuracy()},
        max_epochs=args.epochs, checkpoint_dir=Path(args.out) / "checkpoints", keep_last=1, log_dir=args.out,
        log_every=10, seed=args.seed,
    )  # fmt: skip
    last = trainer.fit(loader(train), val_loader=loader(val))[-1]
    print(
        f"\n{split:,} rows trained, {rows - split:,} validated (the latest)\n"
        f"val AUC {last['val_auc']:.4f}, log loss {last['val_logloss']:.4f}, accuracy {last['val_accuracy']:.4f} "
        f"(clicks: {float(sum(y.sum() for _, y in val)) / (rows - split):.1%})\n"
        f"train: {last['samples_per_s']:,.0f} samples/s on {device}; "
        f"checkpoint: {veloce.checkpoint.latest(Path(args.out) / 'checkpoints')}"
    )


if __name__ == "__main__":
    main()
