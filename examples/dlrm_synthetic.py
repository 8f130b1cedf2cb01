"""Train a DLRM with veloce.DynamicEmbedding on the built-in synthetic click data (CPU or GPU).

    ./run.sh train                                   # fresh machine: sets up, builds, runs this
    python examples/dlrm_synthetic.py                # 1M samples: ~1 minute on 2 idle CPU cores (19k samples/s)
    python examples/dlrm_synthetic.py --resume       # continue from runs/dlrm_synthetic/checkpoints
    python examples/dlrm_synthetic.py --device cuda --samples 20000000 --batch 8192

26 sparse features of raw int64 ids (Zipf-distributed, no vocabulary) and 13 dense ones;
the labels come from a planted model, so the achievable AUC is known and printed.
veloce.Trainer trains one epoch (dense Adam + sparse Adagrad in one CombinedOptimizer,
progress bar, JSON-lines log, a checkpoint at the end of the epoch), then the
held-out AUC / log loss, the throughput and the checkpoint's path are printed.
The same run from a config file: `veloce train configs/dlrm_synthetic.yaml`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

import veloce
from veloce.data import SyntheticClicks
from veloce.models import DLRM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1_000_000, help="training samples (one epoch)")
    p.add_argument("--val-samples", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--lr", type=float, default=1e-3, help="dense Adam learning rate")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="sparse Adagrad learning rate")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/dlrm_synthetic", help="checkpoints, log.jsonl and metrics.json go here")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out (default: start over)")
    args = p.parse_args()
    out = Path(args.out)
    if not args.resume:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        (out / "log.jsonl").unlink(missing_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    train = SyntheticClicks(args.samples, batch_size=args.batch, seed=args.seed)
    val = SyntheticClicks(args.val_samples, batch_size=8192, seed=args.seed, start=10**9)  # disjoint draws

    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(
            dim, mode="sum", capacity=1 << 14, initializer=veloce.init.normal(std=0.01),
            optimizer=veloce.optim.Adagrad(lr=args.sparse_lr), device=device,
        )  # fmt: skip

    model = DLRM(train.num_dense, train.num_sparse, embedding_dim=args.dim, embedding_factory=table).to(device)
    trainer = veloce.Trainer(
        model, loss_fn=torch.nn.BCEWithLogitsLoss(), optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
        metrics={"auc": veloce.metrics.AUC(), "logloss": veloce.metrics.LogLoss()}, precision=args.precision,
        checkpoint_dir=out / "checkpoints", keep_last=1, log_dir=out, log_every=20, seed=args.seed,
    )  # fmt: skip
    last = trainer.fit(train, val_loader=val)[-1]

    result = {
        "val_auc": last["val_auc"],
        "best_possible_auc": val.bayes_auc(),
        "val_logloss": last["val_logloss"],
        "train_samples_per_s": last["samples_per_s"],
        "train_seconds": last["seconds"],
        "table_rows": sum(len(t) for t in model.modules() if isinstance(t, veloce.DynamicEmbedding)),
        "device": str(device),
    }
    (out / "metrics.json").write_text(json.dumps(result, indent=1))
    print(
        f"\nval AUC {result['val_auc']:.4f} (best possible {result['best_possible_auc']:.4f}), "
        f"val log loss {result['val_logloss']:.4f}\n"
        f"train: {result['train_samples_per_s']:,.0f} samples/s on {device}, "
        f"{result['table_rows']:,} embedding rows created from raw ids\n"
        f"checkpoint: {veloce.checkpoint.latest(out / 'checkpoints')} (veloce inspect PATH shows it)"
    )


if __name__ == "__main__":
    main()
