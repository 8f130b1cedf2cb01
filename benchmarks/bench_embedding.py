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
* with ``--cache-fractions 1.0,0.8,0.5``, also ``DynamicEmbedding`` with
  ``storage=veloce.storage.HostCached``: the rows in host memory, a device cache holding
  each fraction of the table's rows (BENCHMARKS.md, config 7), and a second table of each
  tiered column against the ``DynamicEmbedding`` column: the ratio of their steps, the
  cache's hit rate, and the rows and bytes fetched / written back per timed step.
  ``--storage host_cached --cache-fraction F`` makes the ``DynamicEmbedding`` column
  itself tiered. ``--prefetch``: tiered tables prefetch the next batch's ids after each
  step, as the Trainer does.

Configuration 7 (config 3 with the HBM cache at 100 / 80 / 50 % of the rows)::

    python benchmarks/bench_embedding.py --device cuda --features 10 --ids-per-feature 1600000 \
        --batch 104857 --bag 1 --dim 128 --dist zipf --alpha 1.05 --optimizers adam --no-dict \
        --steps 50 --warmup 5 --cache-fractions 1.0,0.8,0.5

Prints a Markdown table (median ms/step and the ratio to EmbeddingBag) headed by the
device, torch version, dtype and configuration. Every table is warm: every id of the run
inserted before the timed steps, so a cache fraction is of the table's rows.
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


def cache_rows(fraction: float, rows_total: int) -> int:
    """The cache of a tiered table holding ``fraction`` of the table's rows (every id of the
    run is in the table before the timed steps)."""
    return max(1, round(fraction * rows_total))


def fill(emb, rows_total: int, device) -> None:
    """Inserts every id of the run (the table is warm), in chunks a tiered table's cache
    holds: each chunk's rows are pinned until ``after_step`` (a no-op for a Device table)."""
    chunk = min(1 << 21, max(1, getattr(emb.table, "cache_rows", 1 << 23) // 4))
    for ids in torch.arange(rows_total, device=device).split(chunk):
        emb.table.find_or_insert(ids * SCRAMBLE)
        emb.table.after_step()


def tier_row(stats: dict, steps: int, rows: int) -> dict:
    """A tiered table's counts over the timed steps (its stats reset before them)."""
    return {"cache_rows": rows, "hit_rate": stats["hit_rate"], "fetched_per_step": stats["fetched"] / steps,
            "written_back_per_step": stats["written_back"] / steps,
            "mb_moved_per_step": (stats["bytes_fetched"] + stats["bytes_written_back"]) / steps / 1e6}  # fmt: skip


def table_bytes(emb) -> int:
    """The bytes of every row of the table, in every tier: (weights + optimizer state) per row."""
    t = emb.table  # len(): the rows of every tier
    return len(t) * (t.dim * t.dtype.itemsize + t.state_dim * t.state_dtype.itemsize)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step_fn, steps, warmup, device, back_to_back: bool = False, on_timed=None) -> list[float]:
    """ms per step (after ``warmup`` steps), each between two device syncs; with
    ``back_to_back``, one value: the mean of the timed steps run as training runs them,
    with no sync between them (the host prepares a step while the GPU runs the last).
    Python's cyclic garbage collector is paused meanwhile (as ``timeit`` does): its pauses
    land in random steps of host-bound GPU runs and moved medians by tenths of a millisecond.
    ``on_timed()``, if given, runs once between the warmup and the timed steps, untimed."""
    times = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if back_to_back:
            for batch in steps[:warmup]:
                step_fn(*batch)
            sync(device)
            if on_timed is not None:
                on_timed()
            t0 = time.perf_counter()
            for batch in steps[warmup:]:
                step_fn(*batch)
            sync(device)
            return [(time.perf_counter() - t0) * 1e3 / max(len(steps) - warmup, 1)]
        for i, batch in enumerate(steps):
            sync(device)
            if i == warmup and on_timed is not None:
                on_timed()
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
    p.add_argument("--storage", choices=["device", "host_cached"], default="device",
                   help="where the DynamicEmbedding column's rows live: all on --device, or in host memory under a "
                        "device cache of --cache-fraction of the rows (veloce.storage.HostCached)")
    p.add_argument("--cache-fraction", type=float, default=1.0,
                   help="with --storage host_cached: the share of the table's rows its cache holds, in (0, 1]")
    p.add_argument("--cache-fractions", default="",
                   help="comma-separated shares, e.g. 1.0,0.8,0.5: one more column per share, a HostCached table "
                        "whose cache holds that share of the rows, timed beside the DynamicEmbedding column")
    p.add_argument("--prefetch", action="store_true",
                   help="tiered tables prefetch the next batch's ids after each step (inside the timed step)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="cap the device memory veloce may use (torch.cuda.set_per_process_memory_fraction) and "
                        "report the table's bytes against the cap (a table larger than the device)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the EmbeddingBag columns (their table must fit on the device)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args()
    fractions = [float(f) for f in args.cache_fractions.split(",") if f.strip()]
    for f in fractions + [args.cache_fraction]:
        if not 0 < f <= 1:
            p.error(f"cache fractions must be in (0, 1], got {f}")
    if args.whatif_find and args.storage != "device":
        p.error("--whatif-find replaces inserts by the cache's find: use it with --storage device")
    device = torch.device(args.device)
    if args.memory_fraction is not None:
        if device.type != "cuda" or not 0 < args.memory_fraction <= 1:
            p.error("--memory-fraction takes a fraction in (0, 1] of a CUDA device's memory")
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device.index or torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    steps_cpu = make_ids(args, gen)
    rows_total = args.features * args.ids_per_feature
    steps = [(i.to(device), o.to(device)) for i, o in steps_cpu]
    raw_steps = [((i * SCRAMBLE), o) for i, o in steps]  # raw int64 ids, spread over the int64 range
    # (ids, offsets, the next step's ids): what a tiered table prefetches after its step
    raw_next = [(i, o, raw_steps[k + 1][0] if k + 1 < len(raw_steps) else None) for k, (i, o) in enumerate(raw_steps)]
    grad = torch.randn(args.batch * args.features, args.dim, device=device) * 1e-3
    results = []
    main_fraction = args.cache_fraction if args.storage == "host_cached" else None
    variants = [("DynamicEmbedding", "raise", main_fraction)]  # (column, nonfinite_grad, cache fraction or None)
    variants += [("raise_next", "raise_next", main_fraction)] if args.raise_next else []
    variants += [("unchecked", "apply", main_fraction)] if args.unchecked else []
    base = list(variants)
    if args.whatif_find:  # the same steps with the insert (and its host sync) replaced by find
        variants += [(f"{c} find-only", nf, fr) for c, nf, fr in base]
    extras = [c for c, _, _ in variants[1:]]
    if args.defer_inserts:  # each variant's windows alternate with deferred inserts (one table)
        extras += [f"{c} deferred" for c, _, _ in variants]
    tiered = [(f"HostCached {f * 100:g}%", "raise", f) for f in fractions]
    variants += tiered
    extras += [c for c, _, _ in tiered]

    for opt_name in args.optimizers.split(","):
        row = {"optimizer": opt_name}
        if opt_name != "rowwise" and not args.no_baseline:
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
        for col, nonfinite, fraction in variants:
            # Load about 0.5 once every id is in (two-choice buckets grow near 0.9).
            storage = None
            if fraction is not None:
                storage = veloce.storage.HostCached(cache_rows=cache_rows(fraction, rows_total))
            emb = veloce.DynamicEmbedding(
                args.dim, mode="sum", capacity=2 * rows_total, optimizer=veloce_optimizer(opt_name, args.lr),
                device=device, nonfinite_grad=nonfinite, storage=storage,
            )
            fill(emb, rows_total, device)  # warm: every id present
            if col.endswith("find-only"):  # every id is present: find returns the insert's slots
                emb.table.find_or_insert = lambda ids, *_, t=emb.table, **__: t.find(ids)
            prefetch = args.prefetch and storage is not None

            def dyn_step(raw, offsets, nxt, emb=emb, prefetch=prefetch):
                emb(raw, offsets).backward(grad)
                emb.step()
                emb.zero_grad()
                if prefetch and nxt is not None:
                    emb.prefetch(nxt)

            def on_timed(emb=emb, storage=storage):  # the tier counts cover the timed steps
                if storage is not None:
                    emb.stats(reset=True)

            if not args.defer_inserts or storage is not None:
                row[col] = statistics.median(time_steps(dyn_step, raw_next, args.warmup, device, args.back_to_back,
                                                        on_timed))  # fmt: skip
            else:  # alternate windows on one table: read-back, deferred, read-back, ...
                times: dict[bool, list[float]] = {False: [], True: []}
                for w in range(args.ab_windows):
                    emb.defer_inserts = w % 2 == 1
                    times[emb.defer_inserts] += time_steps(dyn_step, raw_next, args.warmup, device,
                                                           args.back_to_back)  # fmt: skip
                row[col], row[f"{col} deferred"] = (statistics.median(times[d]) for d in (False, True))
                row.setdefault("windows", {})[col] = {"read_back": times[False], "deferred": times[True]}
            if storage is not None:
                row.setdefault("tiers", {})[col] = tier_row(emb.stats(), args.steps, storage.cache_rows)
            if device.type == "cuda":
                row.setdefault("peak_device_gb", {})[col] = torch.cuda.max_memory_allocated(device) / 1e9
                torch.cuda.reset_peak_memory_stats(device)
            row.setdefault("table_gb", {})[col] = table_bytes(emb) / 1e9
            del emb, dyn_step, on_timed
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results.append(row)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    n_ids = args.batch * args.features * args.bag
    where = "all on the device" if main_fraction is None else f"HostCached, cache {main_fraction:g} of the rows"
    print(f"\n### One training step: {name}, torch {torch.__version__}, fp32")
    print(
        f"batch {args.batch}, {args.features} features, {args.ids_per_feature:,} ids/feature "
        f"(one table, {rows_total:,} rows), dim {args.dim}, bag {args.bag} ({n_ids:,} ids/step), sum, "
        f"DynamicEmbedding {where}{', tiered tables prefetch the next batch' if args.prefetch else ''}; "
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
    if any("tiers" in r for r in results):
        print("\nTiered tables (counts per timed step; x DynamicEmbedding: the ratio of their steps):\n")
        print("| optimizer | table | cache rows | ms | x DynamicEmbedding | hit rate | fetched rows "
              "| written-back rows | MB moved |")  # fmt: skip
        print("|---" * 9 + "|")
        for r in results:
            for c, t in r.get("tiers", {}).items():
                print(f"| {r['optimizer']} | {c} | {t['cache_rows']:,} ({t['cache_rows'] / rows_total:.0%}) "
                      f"| {r[c]:.2f} | {r[c] / r['DynamicEmbedding']:.2f}x | {t['hit_rate']:.4f} "
                      f"| {t['fetched_per_step']:,.0f} | {t['written_back_per_step']:,.0f} "
                      f"| {t['mb_moved_per_step']:,.1f} |")  # fmt: skip
    if args.memory_fraction is not None:
        cap = args.memory_fraction * torch.cuda.get_device_properties(device).total_memory / 1e9
        print(f"\nDevice memory capped at {cap:.1f} GB (fraction {args.memory_fraction:g}):\n")
        print("| optimizer | table | table GB (every tier) | x the cap | peak device GB |\n|---|---|---|---|---|")
        for r in results:
            for c, gb in r["table_gb"].items():
                print(f"| {r['optimizer']} | {c} | {gb:.1f} | {gb / cap:.2f}x | {r['peak_device_gb'][c]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "config": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
