"""What feature admission costs a training step: admission on against off, side by side.

    python benchmarks/bench_admission_cost.py                     # CPU, scaled down
    python benchmarks/bench_admission_cost.py --device cuda --preset gpu --json out.json

Two phases (BENCHMARKS.md):

* ``steady`` (configuration 3): one warm table holding every id of the run (Zipf ids), the
  same steps timed in windows that alternate the table's policy: ``none``, then each
  ``--policies`` entry (``set_admission`` between windows, ``--warmup`` untimed steps after
  each switch). Every id already has a row, so the difference is the admission work itself:
  counting every sighting in the count-min sketch and the ``admit`` mask of the insert.
* ``cold`` (configuration 4's cold phase): an empty table fed fresh batches of ids drawn
  from a space of ``--space`` ids (Zipf), so most ids of the first steps are new. Each
  policy trains its own empty table over the same batches; the variants alternate over
  ``--repeats`` rounds. With admission the table inserts fewer rows (the rows column), so
  a cold step can be cheaper than without.

Each row reports the median ms per step and its ratio to ``none`` (the goal: within 10 %
on GPU). Prints Markdown headed by the device, torch version and configuration; ``--json``
writes the same rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics

import torch
from bench_embedding import SCRAMBLE, fill, sync, time_steps, veloce_optimizer

import veloce

PRESETS = {
    # steady: configuration 3 (10 features x 1.6M ids, 104,857 ids per feature and step, dim 128);
    # cold: configuration 4 sized to one GPU (26 features, batch 65,536, dim 64, capacity 2^25).
    "gpu": {"features": 10, "ids_per_feature": 1_600_000, "batch": 104_857, "dim": 128,
            "cold_features": 26, "cold_batch": 65_536, "cold_dim": 64, "capacity": 1 << 25, "space": 10**8},
    "cpu": {"features": 8, "ids_per_feature": 50_000, "batch": 2_048, "dim": 64,
            "cold_features": 26, "cold_batch": 1_024, "cold_dim": 64, "capacity": 1 << 21, "space": 10**8},
}  # fmt: skip


def policy(spec: str) -> veloce.admission.AdmissionPolicy:
    """``none``, ``frequency:K`` or ``probability:P``."""
    name, _, arg = spec.partition(":")
    if name == "none":
        return veloce.admission.NoAdmission()
    if name == "frequency":
        return veloce.admission.Frequency(min_count=int(arg or 2))
    if name == "probability":
        return veloce.admission.Probability(float(arg or 0.5))
    raise SystemExit(f"--policies: unknown policy {spec!r} (none, frequency:K, probability:P)")


def zipf_ranks(n: int, space: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` ranks in [0, space) with P(r) ~ (r + 1)^-alpha (the inverse CDF of the
    continuous power law, alpha != 1)."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    a = 1.0 - alpha
    rank = ((space**a - 1.0) * u + 1.0) ** (1.0 / a)
    return rank.long().clamp_(1, space) - 1


def feature_ids(ranks: torch.Tensor, features: int, space: int) -> torch.Tensor:
    """Position i is of feature ``i % features``: its id is (feature * space + rank), scrambled
    over the int64 range (a bijection), as raw ids are."""
    feature = torch.arange(ranks.numel()) % features
    return (feature * space + ranks) * SCRAMBLE


def steady_steps(args, gen) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
    """Configuration 3's steps over ``features * ids_per_feature`` ids (bags of one id)."""
    out = []
    for _ in range(args.warmup + args.steps):
        ranks = zipf_ranks(args.batch * args.features, args.ids_per_feature, args.alpha, gen)
        ids = feature_ids(ranks, args.features, args.ids_per_feature)
        out.append((ids, torch.arange(ids.numel()), None))
    return out


def cold_steps(args, gen) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
    """Configuration 4's first steps: 26 features of ids from a space of ``space`` ids each."""
    out = []
    n = args.cold_batch * args.cold_features
    for _ in range(args.cold_steps):
        ids = feature_ids(zipf_ranks(n, args.space, args.alpha, gen), args.cold_features, args.space)
        out.append((ids, torch.arange(n), None))
    return out


def table(args, dim: int, capacity: int, admission, device) -> veloce.DynamicEmbedding:
    return veloce.DynamicEmbedding(dim, mode="sum", capacity=capacity, optimizer=veloce_optimizer(args.optimizer, 0.01),
                                   device=device, admission=admission)  # fmt: skip


def step_fn(emb, grad):
    def step(ids, offsets, _next):
        emb(ids, offsets).backward(grad)
        emb.step()
        emb.zero_grad()

    return step


def steady(args, device, policies) -> list[dict]:
    """Windows over one warm table, alternating the policies."""
    gen = torch.Generator().manual_seed(0)
    steps = [(i.to(device), o.to(device), n) for i, o, n in steady_steps(args, gen)]
    rows_total = args.features * args.ids_per_feature
    emb = table(args, args.dim, 2 * rows_total, None, device)
    fill(emb, rows_total, device)
    grad = torch.randn(steps[0][1].numel(), args.dim, device=device) * 1e-3
    times: dict[str, list[float]] = {spec: [] for spec in policies}
    for _ in range(args.windows):
        for spec in policies:
            emb.table.set_admission(policy(spec))
            times[spec] += time_steps(step_fn(emb, grad), steps, args.warmup, device)
    del emb
    return summarize("steady", times, {})


def cold(args, device, policies) -> list[dict]:
    """Each policy trains a fresh empty table over the same cold steps, alternating."""
    gen = torch.Generator().manual_seed(1)
    steps = [(i.to(device), o.to(device), n) for i, o, n in cold_steps(args, gen)]
    grad = torch.randn(steps[0][1].numel(), args.cold_dim, device=device) * 1e-3
    times: dict[str, list[float]] = {spec: [] for spec in policies}
    rows: dict[str, int] = {}
    for _ in range(args.repeats):
        for spec in policies:
            emb = table(args, args.cold_dim, args.capacity, policy(spec), device)
            times[spec] += time_steps(step_fn(emb, grad), steps, 0, device)
            rows[spec] = len(emb.table)
            del emb
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return summarize("cold", times, rows)


def summarize(phase: str, times: dict[str, list[float]], rows: dict[str, int]) -> list[dict]:
    base = statistics.median(times["none"])
    return [{"phase": phase, "policy": spec, "ms": statistics.median(t), "vs_none": statistics.median(t) / base,
             "steps": len(t), "rows": rows.get(spec)} for spec, t in times.items()]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="sizes (default: cpu, or gpu on cuda)")
    p.add_argument("--phases", default="steady,cold", help="steady (configuration 3), cold (configuration 4)")
    p.add_argument("--policies", default="frequency:2,probability:0.5", help="compared with none")
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adagrad", "adam", "rowwise"])
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--steps", type=int, default=20, help="timed steps per steady window")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after each policy switch (steady)")
    p.add_argument("--windows", type=int, default=3, help="steady windows per policy")
    p.add_argument("--cold-steps", type=int, default=10, help="steps from an empty table (cold)")
    p.add_argument("--repeats", type=int, default=3, help="cold runs per policy")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    for key in PRESETS["gpu"]:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="overrides the preset")
    args = p.parse_args()
    device = torch.device(args.device)
    preset = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    policies = ["none"] + [s for s in args.policies.split(",") if s and s != "none"]
    for spec in policies:
        policy(spec)  # a bad spec fails before any work
    rows = []
    for phase in args.phases.split(","):
        if phase not in ("steady", "cold"):
            p.error(f"--phases: unknown phase {phase!r} (steady, cold)")
        rows += (steady if phase == "steady" else cold)(args, device, policies)
        sync(device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    print(f"\n### Admission cost: {name}, torch {torch.__version__}, fp32, {args.optimizer}, Zipf {args.alpha}")
    print(f"steady: {args.features} features x {args.ids_per_feature:,} ids, {args.batch:,} ids per feature and step, "
          f"dim {args.dim}, warm table, {args.windows} alternating windows of {args.steps} steps; "
          f"cold: {args.cold_features} features x batch {args.cold_batch:,} from {args.space:,} ids each, dim "
          f"{args.cold_dim}, capacity {args.capacity:,}, {args.cold_steps} steps from empty x {args.repeats}\n")  # fmt: skip
    print("| phase | admission | ms per step (median) | vs none | steps timed | rows after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['policy']} | {r['ms']:.2f} | {r['vs_none']:.3f}x | {r['steps']} "
              f"| {'' if r['rows'] is None else format(r['rows'], ',')} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
