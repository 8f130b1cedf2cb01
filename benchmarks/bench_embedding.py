"""One training step of DynamicEmbedding vs nn.EmbeddingBag(sparse=True) (BENCHMARKS.md, config 6).

    python benchmarks/bench_embedding.py                       # CPU defaults: batch 2048, dim 64
    python benchmarks/bench_embedding.py --device cuda --batch 65536 --dim 128 --json out.json

A step = forward (pooled lookup over B * F bags of `--bag` ids) + backward + sparse
optimizer update, on one table holding every feature's ids. Side by side, same ids:

* ``EmbeddingBag``: ``nn.EmbeddingBag(F * ids_per_feature, sparse=True)`` with the
  matching torch optimizer (SGD, Adagrad, SparseAdam) — a pre-sized table.
* ``EmbeddingBag+dict``: the same, with raw ids remapped through a Python dict every
  step — what users do today for dynamic ids.
* ``DynamicEmbedding``: raw int64 ids, no vocabulary, warm table (every id inserted).
* with ``--raise-next``, also ``DynamicEmbedding`` with ``nonfinite_grad="raise_next"``:
  the same check, read by the host one step later (step() does not wait for it).
* with ``--unchecked``, also ``DynamicEmbedding`` with ``nonfinite_grad="apply"``: no
  NaN/Inf check of the gradient before the update (the default "raise" reads every
  gradient once more; torch's optimizers and FBGEMM's TBE do not check).

Prints a Markdown table (median ms/step and the ratio to EmbeddingBag) headed by the
device, torch version, dtype and configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch

import veloce

SCRAMBLE = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd int64: id -> id * SCRAMBLE is a bijection


def make_ids(args, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: (table index (N,), offsets (B*F,)). Index = feature * ids_per_feature + local id."""
    n_bags = args.batch * args.features
    n = n_bags * args.bag
    if args.dist == "zipf":
        probs = 1.0 / torch.arange(1, args.ids_per_feature + 1, dtype=torch.float64) ** args.alpha
        perm = torch.randperm(args.ids_per_feature, generator=gen)
    steps = []
    for _ in range(args.warmup + args.steps):
        if args.dist == "zipf":
            local = perm[torch.multinomial(probs, n, replacement=True, generator=gen)]
        else:
            local = torch.randint(0, args.ids_per_feature, (n,), generator=gen)
        feature = torch.arange(n_bags).repeat_interleave(args.bag) % args.features
        offsets = torch.arange(0, n, args.bag)
        steps.append((feature * args.ids_per_feature + local, offsets))
    return steps


def torch_optimizer(name, params, lr):
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=lr),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=lr),
        "adam": lambda: torch.optim.SparseAdam(params, lr=lr),
    }[name]()


def veloce_optimizer(name, lr):
    return {
        "sgd": veloce.optim.SGD(lr=lr),
        "adagrad": veloce.optim.Adagrad(lr=lr),
        "adam": veloce.optim.Adam(lr=lr),
        "rowwise": veloce.optim.RowWiseAdagrad(lr=lr),
    }[name]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step_fn, steps, warmup, device, back_to_back: bool = False) -> list[float]:
    """ms per step (after ``warmup`` steps), each between two device syncs; with
    ``back_to_back``, one value: the mean of the timed steps run as training runs them,
    with no sync between them (the host prepares a step while the GPU runs the last).
    Python's cyclic garbage collector is paused meanwhile (as ``timeit`` does): its pauses
    land in random steps of host-bound GPU runs and moved medians by tenths of a millisecond."""
    times = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if back_to_back:
            for batch in steps[:warmup]:
                step_fn(*batch)
            sync(device)
            t0 = time.perf_counter()
            for batch in steps[warmup:]:
                step_fn(*batch)
            sync(device)
            return [(time.perf_counter() - t0) * 1e3 / max(len(steps) - warmup, 1)]
        for i, batch in enumerate(steps):
            sync(device)
            t0 = time.perf_counter()
            step_fn(*batch)
            sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        if was_enabled:
            gc.enable()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--ids-per-feature", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bag", type=int, default=20)
    p.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--alpha", type=float, default=1.15)
    p.add_argument("--optimizers", default="sgd,adagrad,adam")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-dict", action="store_true", help="skip the Python-dict remapping baseline")
    p.add_argument("--unchecked", action="store_true",
                   help="also time DynamicEmbedding with nonfinite_grad='apply' (no NaN/Inf check)")
    p.add_argument("--raise-next", action="store_true",
                   help="also time DynamicEmbedding with nonfinite_grad='raise_next' (the check read a step late)")
    p.add_argument("--back-to-back", action="store_true",
                   help="time the steps back to back (no device sync between them), as training runs them")
    p.add_argument("--whatif-find", action="store_true",
                   help="a what-if, not training: each DynamicEmbedding variant again with its insert replaced by "
                        "find (every id is present), which has no host sync")
    p.add_argument("--defer-inserts", action="store_true",
                   help="also time each DynamicEmbedding variant with defer_inserts=True (the insert's counts read "
                        "later, no host sync in the forward): one table per variant, its timed windows alternating "
                        "between read-back and deferred inserts (--ab-windows)")
    p.add_argument("--ab-windows", type=int, default=6,
                   help="with --defer-inserts: timed windows per variant, alternately read-back and deferred")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    steps_cpu = make_ids(args, gen)
    rows_total = args.features * args.ids_per_feature
    steps = [(i.to(device), o.to(device)) for i, o in steps_cpu]
    raw_steps = [((i * SCRAMBLE), o) for i, o in steps]  # raw int64 ids, spread over the int64 range
    grad = torch.randn(args.batch * args.features, args.dim, device=device) * 1e-3
    results = []
    variants = [("DynamicEmbedding", "raise")]
    variants += [("raise_next", "raise_next")] if args.raise_next else []
    variants += [("unchecked", "apply")] if args.unchecked else []
    base = list(variants)
    if args.whatif_find:  # the same steps with the insert (and its host sync) replaced by find
        variants += [(f"{c} find-only", nf) for c, nf in base]
    extras = [c for c, _ in variants[1:]]
    if args.defer_inserts:  # each variant's windows alternate with deferred inserts (one table)
        extras += [f"{c} deferred" for c, _ in variants]

    for opt_name in args.optimizers.split(","):
        row = {"optimizer": opt_name}
        if opt_name != "rowwise":
            bag = torch.nn.EmbeddingBag(rows_total, args.dim, mode="sum", sparse=True).to(device)
            topt = torch_optimizer(opt_name, bag.parameters(), args.lr)

            def eb_step(idx, offsets, bag=bag, topt=topt):
                bag(idx, offsets).backward(grad)
                topt.step()
                topt.zero_grad()

            row["EmbeddingBag"] = statistics.median(time_steps(eb_step, steps, args.warmup, device, args.back_to_back))
            if not args.no_dict:
                vocab: dict[int, int] = {}

                def dict_step(raw, offsets, bag=bag, topt=topt, vocab=vocab):
                    idx = [vocab.setdefault(k, len(vocab)) for k in raw.tolist()]
                    eb_step(torch.tensor(idx, device=device), offsets)

                row["EmbeddingBag+dict"] = statistics.median(time_steps(dict_step, raw_steps, args.warmup, device))
            del bag, topt, eb_step  # eb_step's defaults hold the table and optimizer state
            if not args.no_dict:
                del dict_step
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for col, nonfinite in variants:
            # Load about 0.5 once every id is in (two-choice buckets grow near 0.9).
            emb = veloce.DynamicEmbedding(
                args.dim, mode="sum", capacity=2 * rows_total, optimizer=veloce_optimizer(opt_name, args.lr),
                device=device, nonfinite_grad=nonfinite,
            )
            for chunk in torch.arange(rows_total, device=device).split(1 << 21):  # warm: every id present
                emb.table.find_or_insert(chunk * SCRAMBLE)
            if col.endswith("find-only"):  # every id is present: find returns the insert's slots
                emb.table.find_or_insert = lambda ids, *_, t=emb.table, **__: t.find(ids)

            def dyn_step(raw, offsets, emb=emb):
                emb(raw, offsets).backward(grad)
                emb.step()
                emb.zero_grad()

            if not args.defer_inserts:
                row[col] = statistics.median(time_steps(dyn_step, raw_steps, args.warmup, device, args.back_to_back))
            else:  # alternate windows on one table: read-back, deferred, read-back, ...
                times: dict[bool, list[float]] = {False: [], True: []}
                for w in range(args.ab_windows):
                    emb.defer_inserts = w % 2 == 1
                    times[emb.defer_inserts] += time_steps(dyn_step, raw_steps, args.warmup, device,
                                                           args.back_to_back)  # fmt: skip
                row[col], row[f"{col} deferred"] = (statistics.median(times[d]) for d in (False, True))
                row.setdefault("windows", {})[col] = {"read_back": times[False], "deferred": times[True]}
            del emb, dyn_step
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results.append(row)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    n_ids = args.batch * args.features * args.bag
    print(f"\n### One training step: {name}, torch {torch.__version__}, fp32")
    print(
        f"batch {args.batch}, {args.features} features, {args.ids_per_feature:,} ids/feature "
        f"(one table, {rows_total:,} rows), dim {args.dim}, bag {args.bag} ({n_ids:,} ids/step), sum, "
        f"{args.dist}{f' alpha {args.alpha}' if args.dist == 'zipf' else ''}; "
        + (f"mean of {args.steps} steps back to back\n" if args.back_to_back
           else f"median of {args.steps} steps, each between two syncs\n")
    )
    cols = ["EmbeddingBag", "EmbeddingBag+dict", "DynamicEmbedding"] + extras
    extra = "".join(f" | {c} speedup" for c in extras)
    print("| optimizer | " + " | ".join(f"{c} ms" for c in cols) + f" | speedup vs EmbeddingBag | vs +dict{extra} |")
    print("|---" * (len(cols) + 3 + len(extras)) + "|")
    for r in results:
        cells = [f"{r[c]:.2f}" if c in r else "-" for c in cols]
        su = f"{r['EmbeddingBag'] / r['DynamicEmbedding']:.2f}x" if "EmbeddingBag" in r else "-"
        sd = f"{r['EmbeddingBag+dict'] / r['DynamicEmbedding']:.2f}x" if "EmbeddingBag+dict" in r else "-"
        for c in extras:
            sd += f" | {r['EmbeddingBag'] / r[c]:.2f}x" if "EmbeddingBag" in r else " | -"
        print(f"| {r['optimizer']} | " + " | ".join(cells) + f" | {su} | {sd} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "config": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
