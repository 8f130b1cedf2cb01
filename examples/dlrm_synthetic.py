"""Train a DLRM with veloce.DynamicEmbedding on the built-in synthetic click data (CPU or GPU).

    ./run.sh train                                   # fresh machine: sets up, builds, runs this
    python examples/dlrm_synthetic.py                # ~2 minutes on 2 CPU cores
    python examples/dlrm_synthetic.py --device cuda --samples 20000000 --batch 8192

26 sparse features of raw int64 ids (Zipf-distributed, no vocabulary) and 13 dense ones;
the labels come from a planted model, so the achievable AUC is known and printed. The
script trains one epoch with a plain PyTorch loop (CombinedOptimizer steps the dense
MLPs and every embedding table), then evaluates AUC / log loss on held-out samples,
prints throughput and writes a checkpoint (safetensors: no pickle, loads without running code).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file
from tqdm import tqdm

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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/dlrm_synthetic", help="where the checkpoint and metrics go")
    args = p.parse_args()
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
    opt = veloce.optim.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr), model)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    model.train()
    seen, start = 0, time.perf_counter()
    bar = tqdm(train, total=len(train), unit="batch", desc="train")
    for (dense, sparse), label in bar:
        dense, sparse, label = dense.to(device), sparse.to(device), label.to(device)
        loss = loss_fn(model(dense, sparse), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += label.numel()
        bar.set_postfix(loss=f"{loss.item():.4f}", samples_s=f"{seen / (time.perf_counter() - start):,.0f}")
    train_time = time.perf_counter() - start

    model.eval()
    auc, logloss = veloce.metrics.AUC(), veloce.metrics.LogLoss()
    with torch.no_grad():
        for (dense, sparse), label in tqdm(val, total=len(val), unit="batch", desc="eval"):
            logits = model(dense.to(device), sparse.to(device)).float().cpu()
            auc.update(logits, label)
            logloss.update(logits, label)
    tables = [m for m in model.modules() if isinstance(m, veloce.DynamicEmbedding)]
    result = {
        "val_auc": auc.compute(),
        "best_possible_auc": val.bayes_auc(),
        "val_logloss": logloss.compute(),
        "train_samples_per_s": seen / train_time,
        "train_seconds": train_time,
        "table_rows": sum(len(t) for t in tables),
        "device": str(device),
    }
    os.makedirs(args.out, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(args.out, "model.safetensors"), metadata={"step": str(len(train))})
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\nval AUC {result['val_auc']:.4f} (best possible {result['best_possible_auc']:.4f}), "
        f"val log loss {result['val_logloss']:.4f}\n"
        f"train: {result['train_samples_per_s']:,.0f} samples/s on {device}, "
        f"{result['table_rows']:,} embedding rows created from raw ids\n"
        f"checkpoint: {os.path.join(args.out, 'model.safetensors')}"
    )


if __name__ == "__main__":
    main()
