"""Feature admission on the Criteo sample: validation AUC and table rows of a DLRM whose
``DynamicEmbedding`` tables admit ids at their ``min_count``-th sighting, against plain
PyTorch embeddings, on the CPU.

    VELOCE_DATA_DIR=../shared/data python benchmarks/bench_admission.py --json out.json
    python benchmarks/bench_admission.py --data criteo_kaggle_train_sample.tsv --seeds 20 --min-counts 1,2,3,5

Data: the sample's rows in time order; the first ``1 - --val-fraction`` train (``--epochs``
passes, in file order), the last rows validate. Model: ``veloce.models.DLRM(13, 26, dim)``
(bottom MLP 64-16, top MLP 64-32-1), batch 128, rows initialised normal(0, 0.01), Adagrad
lr 0.05 for the rows and lr 0.02 for the dense layers (``tests/models/test_criteo_auc.py``'s
setup). The variants differ only in their embeddings:

- ``veloce min_count=k``: ``DynamicEmbedding(admission=veloce.admission.Frequency(k))`` on the
  raw ids (``k = 1``: no admission argument, every id gets a row); an id not admitted reads
  and trains the table's default row. Without ``veloce.admission`` only ``k = 1`` runs.
- ``(a) one row per training id``: ``nn.EmbeddingBag`` over a vocabulary of every training
  id (ids unseen in training read one row that never trains);
- ``(b) 2^16 hashed buckets``: ``nn.EmbeddingBag`` over ``id mod 2^16`` per feature;
- ``(c) vocabulary of ids seen >= k times``: ``nn.EmbeddingBag`` over the ids seen at least
  ``k`` times in the training rows; every other id reads one shared row, which trains. Its
  counts come from the whole training split before training (an oracle that admission,
  counting as it trains, does not have).
- ``(d) streaming admission at sighting k``: plain PyTorch doing what admission
  does, with exact counts: over ``(c)``'s vocabulary, a training occurrence reads the id's
  own row from the id's ``k``-th occurrence in the training stream on (in row order), the
  shared row before; validation as ``(c)``. It is the reference ``veloce min_count=k``
  should match (up to how repeats within a batch count, and the sketch's collisions).

Seeds are paired: seed ``s`` gives every variant the same dense weights and the same data
order, so that the difference of two variants' AUC on one seed is free of the dense
initialisation's noise; the report gives each variant's mean AUC, its mean difference from
``veloce min_count=1`` over the seeds with the standard deviation of the differences and a
95 % interval of the mean (t distribution), and the table rows (summed over the 26 tables;
the baselines' allocated rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import veloce
from veloce.data import CriteoTSV
from veloce.models import DLRM

ROOT = Path(__file__).resolve().parents[1]
BATCH, DIM, INIT_STD = 128, 16, 0.01
DENSE_LR, SPARSE_LR = 0.02, 0.05
HASH_BUCKETS = 1 << 16
# two-sided 95 % quantiles of Student's t by degrees of freedom (beyond 30: the normal's)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
        12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 19: 2.09, 24: 2.06, 29: 2.05}  # fmt: skip


def t95(df: int) -> float:
    return _T95.get(df) or (_T95[max(k for k in _T95 if k <= df)] if df < 30 else 1.96)


def load(path: Path, rows: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (dense, sparse), label = next(iter(CriteoTSV(path, batch_size=1 << 20, stop=rows)))
    return dense, sparse, label


def embedding_bag(num: int, seed: int) -> nn.EmbeddingBag:
    """Rows from normal(0, INIT_STD) drawn by their own generator: the dense layers' init
    (torch's global generator) stays the same across variants of a seed."""
    weight = torch.empty(num, DIM).normal_(0.0, INIT_STD, generator=torch.Generator().manual_seed(seed))
    return nn.EmbeddingBag(num, DIM, mode="sum", sparse=True, _weight=weight)


def vocabulary(sparse: torch.Tensor, split: int, min_count: int) -> tuple[torch.Tensor, list[int]]:
    """Per feature, the ids seen at least ``min_count`` times in rows ``[0, split)`` -> 1..V,
    every other id -> 0; and the V + 1 rows of each feature."""
    out, sizes = torch.empty_like(sparse), []
    for f in range(sparse.shape[1]):
        col = sparse[:, f].contiguous()
        ids, counts = torch.unique(col[:split], return_counts=True)
        vocab = ids[counts >= min_count]
        if not vocab.numel():
            out[:, f], sizes = 0, sizes + [1]
            continue
        pos = torch.searchsorted(vocab, col).clamp(max=len(vocab) - 1)
        out[:, f] = torch.where(vocab[pos] == col, pos + 1, 0)
        sizes.append(len(vocab) + 1)
    return out, sizes


def variants(min_counts: list[int]) -> list[str]:
    names = [f"veloce min_count={k}" for k in min_counts]
    names += ["(a) one row per training id", "(b) 2^16 hashed buckets"]
    names += [f"(c) vocabulary of ids seen >= {k} times" for k in min_counts if k > 1]
    return names + [f"(d) streaming admission at sighting {k}" for k in min_counts if k > 1]


def occurrences(col: torch.Tensor) -> torch.Tensor:
    """For each position of ``col``, how many times its id occurred up to it (1 = first)."""
    ids, order = torch.sort(col, stable=True)
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    out = torch.empty_like(col)
    out[order] = torch.arange(col.numel()) - starts + 1
    return out


def streaming(sparse: torch.Tensor, split: int, min_count: int) -> tuple[torch.Tensor, list[int]]:
    """:func:`vocabulary` of ``min_count``, with each training occurrence before the id's
    ``min_count``-th sent to the shared row 0."""
    ids, sizes = vocabulary(sparse, split, min_count)
    for f in range(sparse.shape[1]):
        early = occurrences(sparse[:split, f].contiguous()) < min_count
        ids[:split, f] = torch.where(early, 0, ids[:split, f])
    return ids, sizes


def admission_module() -> Any:
    return getattr(veloce, "admission", None)


def build(name: str, sparse: torch.Tensor, split: int, seed: int) -> tuple[torch.Tensor, Callable, Callable]:
    """(ids the model sees, embedding factory, rows of the built model) of one variant."""
    if name.startswith("veloce"):
        k = int(name.split("=")[1])
        module = admission_module()

        def table(dim: int) -> veloce.DynamicEmbedding:
            extra = {} if k == 1 else {"admission": module.Frequency(min_count=k)}
            return veloce.DynamicEmbedding(dim, mode="sum", initializer=veloce.init.normal(std=INIT_STD),
                                           optimizer=veloce.optim.Adagrad(lr=SPARSE_LR), seed=seed, **extra)  # fmt: skip

        def rows(model: nn.Module) -> int:
            return sum(len(m) for m in model.modules() if isinstance(m, veloce.DynamicEmbedding))

        return sparse, table, rows
    if name.startswith("(b)"):
        return torch.remainder(sparse, HASH_BUCKETS), lambda dim: embedding_bag(HASH_BUCKETS, seed), bag_rows
    if name.startswith("(d)"):
        ids, sizes = streaming(sparse, split, int(name.rsplit(" ", 1)[1]))
    else:
        k = 1 if name.startswith("(a)") else int(name.split(">= ")[1].split()[0])
        ids, sizes = vocabulary(sparse, split, k)
    it = iter(sizes)
    return ids, lambda dim: embedding_bag(next(it), seed), bag_rows


def bag_rows(model: nn.Module) -> int:
    return sum(m.num_embeddings for m in model.modules() if isinstance(m, nn.EmbeddingBag))


def batches(dense, ids, label, lo: int, hi: int, size: int) -> list:
    return [((dense[i : min(i + size, hi)], ids[i : min(i + size, hi)]), label[i : min(i + size, hi)])
            for i in range(lo, hi, size)]  # fmt: skip


def table_stats(model: nn.Module) -> dict[str, float]:
    """Admission's counts summed over the tables (where their stats() has them)."""
    out: dict[str, float] = {}
    for m in model.modules():
        if isinstance(m, veloce.DynamicEmbedding):
            for k, v in m.stats().items():
                if k in ("admitted", "refused") and isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
    return out


def run(name: str, data, split: int, seed: int, epochs: int) -> dict[str, Any]:
    dense, sparse, label = data
    ids, factory, rows = build(name, sparse, split, seed)
    torch.manual_seed(seed)
    model = DLRM(13, 26, DIM, embedding_factory=factory)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    bag_params = [p for n, p in model.named_parameters() if n.startswith("embeddings.")]
    groups = [{"params": dense_params, "lr": DENSE_LR}]
    groups += [{"params": bag_params, "lr": SPARSE_LR}] if bag_params else []  # (veloce's tables step themselves)
    trainer = veloce.Trainer(model, optimizer=torch.optim.Adagrad(groups), metrics={"auc": veloce.metrics.AUC()},
                             progress=False, seed=seed, max_epochs=epochs)  # fmt: skip
    start = time.perf_counter()
    train, val = batches(dense, ids, label, 0, split, BATCH), batches(dense, ids, label, split, len(label), 4096)
    history = trainer.fit(train, val)
    return {"auc": history[-1]["val_auc"], "rows": rows(model), "seconds": time.perf_counter() - start,
            **table_stats(model)}  # fmt: skip


def summarize(results: dict[str, list[dict[str, Any]]], reference: str) -> list[dict[str, Any]]:
    ref = [r["auc"] for r in results[reference]]
    one_row = statistics.mean(r["rows"] for r in results.get("(a) one row per training id", results[reference]))
    out = []
    for name, runs in results.items():
        aucs = [r["auc"] for r in runs]
        diffs = [a - b for a, b in zip(aucs, ref)]
        n = len(diffs)
        sd = statistics.stdev(diffs) if n > 1 else 0.0
        half = t95(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
        rows = statistics.mean(r["rows"] for r in runs)
        out.append({
            "variant": name, "seeds": n, "auc_mean": statistics.mean(aucs),
            "auc_sd": statistics.stdev(aucs) if n > 1 else 0.0, "diff_mean": statistics.mean(diffs), "diff_sd": sd,
            "diff_ci95": [statistics.mean(diffs) - half, statistics.mean(diffs) + half], "rows": rows,
            "fewer_rows_than_a": one_row / rows if rows else float("nan"),
            "seconds_per_run": statistics.mean(r["seconds"] for r in runs), "aucs": aucs,
        })  # fmt: skip
    return out


def markdown(summary: list[dict[str, Any]], reference: str) -> str:
    lines = [f"| variant | seeds | table rows | (a)'s rows / rows | AUC mean (sd) | AUC - {reference}: mean (sd) "
             f"[95 % interval] |", "|---|---|---|---|---|---|"]  # fmt: skip
    for s in summary:
        lo, hi = s["diff_ci95"]
        diff = f"{s['diff_mean']:+.4f} ({s['diff_sd']:.4f}) [{lo:+.4f}, {hi:+.4f}]"
        diff = "-" if s["variant"] == reference else diff
        lines.append(f"| {s['variant']} | {s['seeds']} | {s['rows']:,.0f} | {s['fewer_rows_than_a']:.2f}x | "
                     f"{s['auc_mean']:.4f} ({s['auc_sd']:.4f}) | {diff} |")  # fmt: skip
    return "\n".join(lines)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(os.environ.get("VELOCE_DATA_DIR", ROOT.parent / "shared" / "data")) / "criteo"
    p.add_argument("--data", default=str(default / "criteo_kaggle_train_sample.tsv"), help="a Criteo TSV file")
    p.add_argument("--rows", type=int, default=None, help="read only the first rows (default: all)")
    p.add_argument("--val-fraction", type=float, default=0.15, help="the last rows that validate")
    p.add_argument("--seeds", type=int, default=10, help="paired seeds 0 .. N-1")
    p.add_argument("--min-counts", default="1,2,3,5", help="admission thresholds (1: no admission)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training rows")
    p.add_argument("--only-veloce", action="store_true", help="run the veloce variants alone (no baselines)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    min_counts = sorted({int(k) for k in args.min_counts.split(",")} | {1})
    torch.set_num_threads(min(2, torch.get_num_threads()))
    data = load(Path(args.data), args.rows)
    split = int(len(data[2]) * (1 - args.val_fraction))
    names = variants(min_counts)
    if args.only_veloce:
        names = [n for n in names if n.startswith("veloce")]
    skipped = []
    if admission_module() is None:  # this veloce has no admission: only min_count 1 runs on veloce
        skipped = [n for n in names if n.startswith("veloce") and not n.endswith("=1")]
        names = [n for n in names if n not in skipped]
    reference = "veloce min_count=1"
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad on sparse grads
        for seed in range(args.seeds):  # seeds outside: every variant of a seed runs in the same conditions
            for name in names:
                results[name].append(run(name, data, split, seed, args.epochs))
            print(f"seed {seed}: " + ", ".join(f"{n.split()[0]} {results[n][-1]['auc']:.4f}" for n in names),
                  file=sys.stderr, flush=True)  # fmt: skip
    summary = summarize(results, reference)
    head = (f"Criteo DLRM with admission: CPU ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads), torch {torch.__version__}, commit {commit()}; "
            f"{split} training rows ({args.epochs} epoch(s)), {len(data[2]) - split} validation rows, dim {DIM}")  # fmt: skip
    print(head)
    print()
    print(markdown(summary, reference))
    if skipped:
        print(f"\nnot run (this veloce has no veloce.admission): {', '.join(skipped)}")
    if args.json:
        out = {"header": head, "args": vars(args), "torch": torch.__version__, "commit": commit(),
               "train_rows": split, "val_rows": len(data[2]) - split, "skipped": skipped, "rows": summary,
               "runs": results}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({"variants": len(summary), "skipped": len(skipped)}))


if __name__ == "__main__":
    main()
