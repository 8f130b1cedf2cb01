"""An owner's regrouping of all-to-all blocks: ``regroup_blocks`` vs ``split`` + ``cat``.

    python benchmarks/bench_regroup.py                        # CPU
    python benchmarks/bench_regroup.py --device cuda --json out.json

A sharded lookup of K tables over W ranks receives one block of rows per (peer, table),
peer-major, and serves each table from one run (table-major); the partial sums and the
gradients go back the other way (:mod:`veloce.distributed.layout`). Configuration 5's
shapes: K = 26 tables, ``--batch`` samples per rank, bags of one id, so an owner gets
``batch * K`` rows a step from its W peers: the ids (int64) and the partial sums
(``--dim`` floats) each step, both directions.

Side by side, the same blocks:

* ``split + cat``: ``t.split`` into the K * W blocks, then ``torch.cat`` in the other
  order (what ``sharded.py`` did up to 128 blocks; one tensor per block on the host).
* ``regroup_blocks``: ``torch.ops.veloce.regroup_blocks`` (one op; on CUDA one launch per
  128 blocks).

With ``--wire bfloat16`` (or float16) it then times the conversions of an exchange that
sends rows in 16 bits (``HybridParallel(exchange_dtype=...)``), side by side: the owner
narrowing its float32 partial sums while regrouping them (``regroup_blocks(..., dtype=)``)
against regrouping then ``Tensor.to``; widening the received gradients the same way; and the
requester summing the 16-bit parts into float32 bags (``combine_parts(..., dtype=)``) against
``Tensor.to`` then ``combine_parts``.

Reports per call the host time (what the step's critical path pays on a host-bound GPU
step: the op returns once its work is queued) and, on CUDA, the time per call of a burst
of calls between two CUDA events: the larger of the device's and the host's time (the
device waits for work when the host is the slower), medians over ``--reps`` bursts.
Prints a Markdown table headed by the device, torch version and configuration.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import veloce  # noqa: F401  (loads the ops)
from veloce.ops.exchange import combine_parts, regroup_blocks


def split_cat(t, counts, to_group_major: bool, per_group=None):
    """The baseline: the blocks split out and concatenated in the other order."""
    G, W = len(counts), len(counts[0])
    if to_group_major:
        pieces = t.split([counts[g][p] for p in range(W) for g in range(G)])
        return torch.cat([pieces[p * G + g] for g in range(G) for p in range(W)])
    pieces = [x.split(list(c)) for x, c in zip(per_group, counts)]
    return torch.cat([pieces[g][p] for p in range(W) for g in range(G)])


def owner_counts(tables: int, world: int, batch: int) -> list[list[int]]:
    """counts[g][p]: the rows of table g an owner receives from peer p. An owner receives
    ``batch`` rows per table from all peers together: batch / W from each on average,
    uneven as Zipf ids make it."""
    share = torch.distributions.Dirichlet(torch.full((world,), 4.0)).sample((tables,))
    return (share * batch).round().long().tolist()


def time_calls(fn, device, calls: int, reps: int) -> tuple[float, float]:
    """(host µs per call, µs per call of the burst between CUDA events or nan) medians over
    reps bursts of calls."""
    host, dev = [], []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end) / calls * 1e3)
        else:
            dev.append(float("nan"))
    return statistics.median(host), statistics.median(dev)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes W")
    p.add_argument("--batch", type=int, default=16384, help="samples per rank (bags of one id per table)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=50, help="calls per timed burst")
    p.add_argument("--reps", type=int, default=7, help="timed bursts (the median is reported)")
    p.add_argument("--wire", choices=("bfloat16", "float16"), default=None,
                   help="also time the conversions of rows sent in this dtype (fused in the ops vs a pass of their own)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    print(f"## regroup_blocks vs split + cat: {name}, torch {torch.__version__}, {args.tables} tables, "
          f"{args.batch} samples per rank, dim {args.dim}\n")  # fmt: skip
    print("| W | blocks | rows | direction | split + cat host µs | regroup host µs | host ratio | "
          "split + cat burst µs | regroup burst µs | burst ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for W in [int(w) for w in args.worlds.split(",")]:
        G = args.tables
        counts = owner_counts(G, W, args.batch)
        rows = sum(map(sum, counts))
        for what, shape, dtype in (("ids", (), torch.int64), ("partial sums", (args.dim,), torch.float32)):
            received = torch.randn(rows, *shape, generator=gen).to(dtype).to(device)
            per_group = list(regroup_blocks([received], counts, True).split([sum(c) for c in counts]))
            assert torch.equal(split_cat(received, counts, True), regroup_blocks([received], counts, True))
            assert torch.equal(split_cat(None, counts, False, per_group), regroup_blocks(per_group, counts, False))
            for direction, to_gm in (("to table-major", True), ("to peer-major", False)):
                src = [received] if to_gm else per_group
                base = time_calls(lambda: split_cat(received, counts, to_gm, per_group), device, args.calls, args.reps)
                ours = time_calls(lambda: regroup_blocks(src, counts, to_gm), device, args.calls, args.reps)
                row = {"world": W, "blocks": G * W, "rows": rows, "what": what, "direction": direction,
                       "split_cat_host_us": base[0], "regroup_host_us": ours[0],
                       "split_cat_burst_us": base[1], "regroup_burst_us": ours[1]}  # fmt: skip
                out.append(row)
                on_device = (f"{base[1]:.1f} | {ours[1]:.1f} | {base[1] / ours[1]:.2f}x" if device.type == "cuda"
                             else "- | - | -")  # fmt: skip
                print(f"| {W} | {G * W} | {rows} {what} | {direction} | {base[0]:.1f} | {ours[0]:.1f} | "
                      f"{base[0] / ours[0]:.2f}x | {on_device} |")  # fmt: skip
    if args.wire:
        out += convert_rows(args, device, getattr(torch, args.wire), gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args), "rows": out}, f, indent=1)


def convert_rows(args, device, wire: torch.dtype, gen: torch.Generator) -> list[dict]:
    """The 16-bit exchange's three conversions at configuration 5's shapes, each in the op
    against a pass of its own (the results checked equal first)."""
    print(f"\n## the {wire} exchange's conversions: a pass of their own vs in the op\n")
    print("| W | rows | conversion | separate host µs | in the op host µs | separate burst µs | in the op burst µs "
          "| burst ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for W in [int(w) for w in args.worlds.split(",")]:
        counts = owner_counts(args.tables, W, args.batch)
        rows = sum(map(sum, counts))
        per_group = list(torch.randn(rows, args.dim, generator=gen).to(device).split([sum(c) for c in counts]))
        received = torch.randn(rows, args.dim, generator=gen).to(device, wire)
        bags = max(1, rows // W)
        bag = torch.randperm(rows, generator=gen).to(device) % bags  # W parts per bag on average
        cases = {
            "owner: partial sums narrowed (to peer-major)": (
                lambda: regroup_blocks(per_group, counts, False).to(wire),
                lambda: regroup_blocks(per_group, counts, False, dtype=wire)),
            "owner: gradients widened (to table-major)": (
                lambda: regroup_blocks([received], counts, True).float(),
                lambda: regroup_blocks([received], counts, True, dtype=torch.float32)),
            "requester: parts summed into float32 bags": (
                lambda: combine_parts(received.float(), bag, bags, check_bags=False),
                lambda: combine_parts(received, bag, bags, check_bags=False, dtype=torch.float32)),
        }  # fmt: skip
        for what, (separate, fused) in cases.items():
            assert torch.equal(separate(), fused())
            base = time_calls(separate, device, args.calls, args.reps)
            ours = time_calls(fused, device, args.calls, args.reps)
            out.append({"world": W, "rows": rows, "conversion": what, "separate_host_us": base[0],
                        "fused_host_us": ours[0], "separate_burst_us": base[1], "fused_burst_us": ours[1]})  # fmt: skip
            ratio = f"{base[1] / ours[1]:.2f}x" if device.type == "cuda" else "-"
            print(f"| {W} | {rows} | {what} | {base[0]:.1f} | {ours[0]:.1f} | {base[1]:.1f} | {ours[1]:.1f} | "
                  f"{ratio} |")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
