"""Multi-GPU DLRM training step with HybridParallel (BENCHMARKS.md, configuration 5).

    torchrun --nproc_per_node=4 benchmarks/bench_distributed.py --sparse sync --json out/w4_sync.json
    python benchmarks/bench_distributed.py --summarize out/*.json     # the table over 1, 2, 4 GPUs

26 DynamicEmbedding tables (dim 128, bags of one id, RowWiseAdagrad) sharded row-wise
over the ranks, a DLRM MLP stack trained with DDP, `--batch` samples per GPU (weak
scaling: 16384 per GPU is a global batch of 65536 on 4 GPUs). Ids are Zipf(1.05)-like
over 1e7 per feature.

Reported per run (rank 0): the step time and global samples/s of `--steps` steps run
back to back (`--windows K`: K such windows, the ranks meeting between them; their mean,
and each window's) (as training runs them: async mode's exchange of one step may overlap the
next), and the median of the same steps each between two syncs of every rank
(`step_ms_synced`); then, in an
instrumented pass (a sync around every collective), the time and bytes of veloce's
exchanges per step against one `all_to_all_single` of the same bytes (bus bandwidth =
bytes * (n - 1) / n / time). `--summarize` adds weak-scaling efficiency
(samples/s per GPU over the 1-GPU figure) and async / sync. `--exchange-dtype bfloat16`
sends the partial sums and their gradients in bfloat16 (half the bytes; its runs are
labelled `+bfloat16` and compared with the 1-GPU run without it, which has no exchange).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import veloce
from veloce.distributed import _comm
from veloce.distributed import dedup as _dedup
from veloce.distributed import backward as _backward
from veloce.distributed import input_dist as _input_dist
from veloce.distributed import output_dist as _output_dist
from veloce.distributed import owner as _owner
from veloce.distributed import static_lookup as _static_lookup
from veloce.models import DLRM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _phases import Markers, marked_calls, print_idle_gaps  # noqa: E402


def zipf_ids(n: int, alpha: float, space: int, gen: torch.Generator, device) -> torch.Tensor:
    """Pareto-tailed ranks (rank k has probability ~ k^-alpha), clamped to the id space."""
    u = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
    rank = torch.floor((1 - u) ** (-1.0 / (alpha - 1.0))).clamp(max=space).long()
    return rank * 0x9E3779B97F4A7C1 + 12345  # spread ids over int64


def batches(args, rank: int, device) -> list:
    return dlrm_batches(args, args.warmup + args.steps + args.profile_steps, 1000 + rank, device)


def dlrm_batches(args, count: int, seed: int, device) -> list:
    """``count`` configuration-5 batches ``(dense (B, 13), sparse (B, F) ids, label (B,))`` of
    ``args.batch`` samples, ``args.features`` features of Zipf(``args.alpha``) ids."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        dense = torch.randn(args.batch, 13, generator=gen, device=device)
        sparse = torch.stack(
            [zipf_ids(args.batch, args.alpha, args.id_space, gen, device) + f for f in range(args.features)], 1
        )
        label = (torch.rand(args.batch, generator=gen, device=device) < 0.25).float()
        out.append((dense, sparse, label))
    return out


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_all(device) -> None:
    sync_device(device)
    dist.barrier()


class ExchangeMeter:
    """Wraps veloce's exchange calls with a device sync and a clock (instrumented pass).

    ``aligned``: every rank also meets the others (a barrier) before the clock starts, as
    :func:`a2a_baseline` does before each of its runs: the time is then the transfer's
    alone. Without it, a call's time also counts the wait for the last rank to reach it
    (the ranks' host paths differ by a few hundred microseconds from step to step)."""

    def __init__(self, device) -> None:
        self.device, self.seconds, self.bytes, self.on, self.aligned = device, 0.0, 0, False, False
        self.calls: dict[str, list] = {}  # call site -> [seconds, bytes, calls]
        self._a2a, self._hdr = _comm.all_to_all, _comm.begin_headers
        timed = self._timed(self._a2a, count_bytes=True)
        # Every module that calls it, by the name it imported (the rows' exchanges call it from
        # _comm.all_to_all_rows, in the exchange dtype).
        for module in (_comm, _dedup, _input_dist, _backward):
            module.all_to_all = timed
        _input_dist.begin_headers = self._timed(self._hdr, count_bytes=False)  # the header swap's all-to-all

    def _timed(self, fn, count_bytes: bool):
        def wrapper(group, send, *rest, **kw):
            if not self.on:
                return fn(group, send, *rest, **kw)
            sync_all(self.device) if self.aligned else sync_device(self.device)
            t = time.perf_counter()
            out = fn(group, send, *rest, **kw)
            if isinstance(out, tuple) and len(out) == 2 and hasattr(out[1], "wait"):
                out[1].wait()
            sync_device(self.device)
            dt = time.perf_counter() - t
            nbytes = send.numel() * send.element_size() if count_bytes else 0
            self.seconds += dt
            self.bytes += nbytes
            caller = sys._getframe(1)
            if caller.f_code.co_name == "all_to_all_rows":  # named by the site that sends the rows
                caller = caller.f_back
            site = self.calls.setdefault(f"{caller.f_code.co_name}:{caller.f_lineno}", [0.0, 0, 0])
            site[0] += dt
            site[1] += nbytes
            site[2] += 1
            return out

        return wrapper


def _quantiles(ms: list[float]) -> dict:
    """Median, 10th and 90th percentiles of ``ms`` (the per-step intervals of one run)."""
    if not ms:
        return {}
    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1]}


def a2a_baseline(total_bytes: int, world: int, device, reps: int = 10) -> float:
    """Median seconds of one all_to_all_single moving total_bytes from this rank."""
    n = max(world, (total_bytes // 4) // world * world)
    send = torch.randn(n, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(reps + 3):
        sync_all(device)
        t = time.perf_counter()
        dist.all_to_all_single(recv, send)
        sync_device(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def pin_to_cores(per_rank: int, local_rank: int, local_world: int) -> list[int]:
    """Restricts this process (its threads now and the ones it starts later: NCCL's, the
    autograd engine's) to ``per_rank`` cores of its own: local rank r takes the r-th run of
    them, after core 0 when there is room (it often serves interrupts). On a GPU machine a
    one-process step pinned to one core has a shorter, steadier host path. Returns the cores."""
    count = os.cpu_count() or 1
    if per_rank * local_world > count:
        raise SystemExit(f"--pin-cores {per_rank}: {local_world} ranks need {per_rank * local_world} cores, "
                         f"this machine has {count}")  # fmt: skip
    first = (1 if per_rank * local_world < count else 0) + local_rank * per_rank
    cores = list(range(first, first + per_rank))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)
    return cores


def run(args) -> None:
    faulthandler.dump_traceback_later(args.watchdog, exit=True)  # a hang prints every thread's stack
    if args.pin_cores:
        pin_to_cores(args.pin_cores, int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32  # the dense MLPs' matmuls (PyTorch's default: off)
    torch.manual_seed(0)

    def table(dim):
        return veloce.DynamicEmbedding(
            dim, mode="sum", capacity=args.capacity, optimizer=veloce.optim.RowWiseAdagrad(lr=0.01), device=device,
            nonfinite_grad=args.nonfinite, defer_inserts=args.defer_inserts,
        )

    model = DLRM(13, args.features, embedding_dim=args.dim, bottom_mlp=(512, 256, args.dim),
                 top_mlp=(1024, 1024, 512, 256, 1), embedding_factory=table).to(device)  # fmt: skip
    lookup_errors = args.lookup_errors or ("raise_next" if args.nonfinite == "raise_next" else "raise")
    with _nccl_priority(args.nccl_priority):
        hp = veloce.distributed.HybridParallel(model, sparse=args.sparse, staleness=args.staleness, dedup=args.dedup,
                                               lookup_errors=lookup_errors, prefetch_depth=args.prefetch_depth,
                                               exchange_dtype=args.exchange_dtype)  # fmt: skip
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3, capturable=args.graph), hp)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = batches(args, rank, device)
    meter = ExchangeMeter(device)

    # --prefetch: each step's sparse exchange starts right after the step before it (or, with
    # --prefetch-at backward, after its backward: beside its tail on the GPU), from the batch on
    # the CPU (pinned, as a loader's pin_memory yields it); the forward is given the same batch
    # on the device.
    on_cpu = [(d.cpu().pin_memory(), s.cpu().pin_memory()) if cuda else (d, s) for d, s, _ in data]

    def prefetch(i, end):  # batch i's exchange, unless i is past the run's last step
        if args.prefetch and i < end:
            hp.prefetch(*on_cpu[i])

    def step(b, following=None):  # following: (i, end) of the batch to prefetch after this step
        dense, sparse, label = b
        loss = loss_fn(hp(dense, sparse), label)
        if following is not None and args.prefetch_at == "forward":
            prefetch(*following)
        loss.backward()
        if following is not None and args.prefetch_at == "backward":
            prefetch(*following)
        opt.step()
        opt.zero_grad()
        if following is not None and args.prefetch_at == "step":
            prefetch(*following)

    graphed = None
    if args.graph:  # the whole step as CUDA graphs (sharded: static exchanges, veloce.graphs.CUDAGraphStep)
        graphed = veloce.graphs.CUDAGraphStep(whole_step(hp, loss_fn, opt), hp, opt,
                                              lookups=lambda dense, sparse, label: model.sparse_lookups(dense, sparse))

        def step(b, following=None):  # noqa: F811 - the graphed step replaces the eager one
            # --graph-ahead: the next batch's counting phase runs beside this step
            ahead = args.graph_ahead and following is not None and following[0] < following[1]
            graphed(*b, next_inputs=data[following[0]] if ahead else None)

    gc.disable()  # collector pauses land in random steps (and stall every rank's collectives)
    times = []
    prefetch(0, 1)
    for i, b in enumerate(data[: args.warmup + args.steps]):
        sync_all(device)
        t = time.perf_counter()
        step(b, (i + 1, args.warmup + args.steps))
        sync_device(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    hp.flush()
    # Throughput: the same steps back to back, as a training loop runs them (no sync between
    # steps, so async mode's exchange of step t can overlap step t + 1), every update
    # applied (flush) before the clock stops.
    # Each step's start is also marked on the device (an event, no sync): the intervals
    # between the marks give the back-to-back steps' spread, which the window's mean hides.
    # --windows K: the window K times, the ranks meeting between them (does a run's pace
    # persist across windows, or does each start afresh?).
    windows, spreads = [], []
    # --whatif-find: the odd windows find instead of inserting (tables filled first)
    find_only = [args.whatif_find and w % 2 == 1 for w in range(args.windows)]
    if args.whatif_find:
        _fill_tables(hp, data, device)
    for w in range(args.windows):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if cuda else []
        sync_all(device)
        t = time.perf_counter()
        with _find_only(find_only[w]):
            prefetch(args.warmup, args.warmup + 1)
            for i, b in enumerate(data[args.warmup : args.warmup + args.steps], args.warmup):
                if cuda:
                    marks[i - args.warmup].record()
                step(b, (i + 1, args.warmup + args.steps))
            if cuda:
                marks[-1].record()
            hp.flush()
        sync_all(device)
        windows.append((time.perf_counter() - t) / args.steps)
        spreads.append(_quantiles([a.elapsed_time(b) for a, b in zip(marks, marks[1:])]) if cuda else {})
    window_s, spread = statistics.mean(t for t, f in zip(windows, find_only) if not f), spreads[0]
    if args.cprofile:  # rank 0's host time by Python function, over the same steps again
        with _find_only(args.whatif_find):  # --whatif-find: the steps without the insert's host sync
            _cprofile(step, data, prefetch, hp, args, device, rank)
    gc.enable()
    if args.profile:  # every rank: a profiled rank alone would fall behind the others
        sync_all(device)
        again = (0, 1) if args.graph_ahead else None  # (graphed: the same batch next, counted ahead)
        if args.profile == "-":
            _profile(lambda: step(data[0], again), device, sys.stdout if rank == 0 else open(os.devnull, "w"))
        else:
            with open(f"{args.profile}.rank{rank}.txt", "w") as f:
                _profile(lambda: step(data[0], again), device, f)
    hp.flush()
    if args.phases:
        _phases(hp, loss_fn, opt, data, args, device, rank)
    # Instrumented passes: exchange time and bytes per step; then the same steps with the
    # ranks aligned before each exchange (the transfers' own time, as the baseline's).
    passes = {False: (0.0, 0, {}), True: (0.0, 0, {})}
    for aligned in () if args.graph else (False, True):  # (a graph's exchanges are not Python calls to time)
        meter.seconds, meter.bytes, meter.calls, meter.aligned, meter.on = 0.0, 0, {}, aligned, True
        for b in data[args.warmup + args.steps :]:
            step(b)
        meter.on = False
        hp.flush()
        passes[aligned] = (meter.seconds, meter.bytes, {
            site: {"ms": v[0] * 1e3 / args.profile_steps, "MB": v[1] / 2**20 / args.profile_steps,
                   "calls": v[2] / args.profile_steps} for site, v in meter.calls.items()})  # fmt: skip
    ex_s = passes[False][0] / args.profile_steps
    ex_bytes = passes[False][1] // args.profile_steps
    # The baseline moves the ranks' mean exchange bytes (all ranks must move the same amount).
    mean_bytes = torch.tensor([float(ex_bytes)], device=device)
    dist.all_reduce(mean_bytes)
    base_s = a2a_baseline(int(mean_bytes.item() / world), world, device) if world > 1 and ex_bytes else 0.0
    step_s = window_s
    row = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__, "world_size": world,
        "sparse": args.sparse + ("+dedup" if args.dedup else "") + ("+prefetch" if args.prefetch else "")
                  + (f"+{args.exchange_dtype}" if args.exchange_dtype else "")
                  + (f"@{args.prefetch_at}" if args.prefetch and args.prefetch_at != "step" else "")
                  + ("/header" if args.prefetch and args.prefetch_depth == "header" else "")
                  + ("+defer" if args.defer_inserts else "") + ("+graph" if args.graph else "") + ("+ahead" if args.graph and args.graph_ahead else ""),
        "captures": graphed.captures if graphed is not None else None,
        "nccl_priority": args.nccl_priority, "nonfinite_grad": args.nonfinite, "tf32": bool(args.tf32 and cuda),
        "pin_cores": args.pin_cores,
        "staleness": args.staleness if args.sparse == "async" else 0,
        "batch_per_gpu": args.batch, "features": args.features, "dim": args.dim,
        "step_ms": step_s * 1e3, "samples_per_s": world * args.batch / step_s,
        "step_ms_synced": statistics.median(times) * 1e3,
        "step_ms_b2b": spread,  # device-side intervals between back-to-back steps' starts
        "windows_ms": [w * 1e3 for w in windows],  # each window's mean (--windows), and its intervals' median
        "windows_b2b_median_ms": [q.get("median") for q in spreads],
        "windows_find_only": find_only,
        "exchange_ms": ex_s * 1e3, "exchange_MB": ex_bytes / 2**20,
        "a2a_same_bytes_ms": base_s * 1e3,
        "exchange_busbw_GBs": ex_bytes * (world - 1) / world / ex_s / 1e9 if world > 1 and ex_s else None,
        "a2a_busbw_GBs": ex_bytes * (world - 1) / world / base_s / 1e9 if world > 1 and base_s else None,
        "rows_per_rank": sum(len(m) for _, m in hp.tables),
        "exchange_calls": passes[False][2],
        "exchange_aligned_ms": passes[True][0] / args.profile_steps * 1e3,
        "exchange_aligned_calls": passes[True][2],
    }  # fmt: skip
    if rank == 0:
        print(json.dumps(row))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    if graphed is not None:  # the graphs hold the communicators' work: dropped first
        torch.cuda.synchronize()
        graphed.reset()  # (the counting phase's graph too; every rank calls it)
        gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def _nccl_priority(which: str):
    """--nccl-priority: HybridParallel's lookup group and/or async gradient group created with
    high-priority NCCL streams (an experiment: their kernels then get SMs ahead of compute
    kernels queued before them). HybridParallel creates the lookup group first, then, in
    async mode, the gradient group; its prefetch group passes options of its own."""
    if which == "none":
        yield
        return
    from veloce.distributed.hybrid import _high_priority

    new_group, made = dist.new_group, []

    def urgent_group(*a, **k):
        role = ("lookup", "grad")[len(made)] if "pg_options" not in k and len(made) < 2 else None
        if role is not None:
            made.append(role)
            if which in (role, "both"):
                k["pg_options"] = _high_priority(k.get("backend") or dist.get_backend())
        return new_group(*a, **k)

    dist.new_group = urgent_group
    try:
        yield
    finally:
        dist.new_group = new_group


def _fill_tables(hp, data, device) -> None:
    """--whatif-find: every id of every batch inserted (training forwards without backward),
    so that a later lookup of these batches finds every id and needs no insert."""
    with torch.no_grad():
        for dense, sparse, _ in data:
            hp(dense, sparse)
    sync_all(device)


@contextlib.contextmanager
def _find_only(on: bool):
    """--whatif-find's odd windows: the training lookups' inserts replaced by ``find`` (no
    host sync; valid only because _fill_tables put every id in). Not a training mode: a
    measurement of what a forward without the insert's host sync would take."""
    if not on:
        yield
        return
    import veloce.sparse.lookup

    def find_only(tables, ids, *_, **__):  # padding_ids, bad_input, on_refused, allow_defer: unused
        return [t.find(i) for t, i in zip(tables, ids)]

    modules = (veloce.sparse.lookup, _owner, _static_lookup)  # every caller, by the name it imported
    saved = [m.find_or_insert_many for m in modules]
    for m in modules:
        m.find_or_insert_many = find_only
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.find_or_insert_many = f


def _cprofile(step, data, prefetch, hp, args, device, rank: int) -> None:
    """The timed window's steps once more, rank 0 under cProfile (every rank runs them, so
    the collectives meet): where the host's time goes, by Python function. cProfile slows
    Python code down (about 2x), not the waits, so compare functions with each other."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    n = args.warmup + args.steps
    sync_all(device)
    prefetch(args.warmup, n)
    if rank == 0:
        prof.enable()
    for i, b in enumerate(data[args.warmup : n], args.warmup):
        step(b, (i + 1, n))
    sync_device(device)
    if rank == 0:
        prof.disable()
        with open(args.cprofile, "w") as f:
            f.write(f"cProfile of rank 0, {args.steps} steps (divide by that for per step)\n")
            st = pstats.Stats(prof, stream=f)
            st.sort_stats("tottime").print_stats(45)
            st.sort_stats("cumulative").print_stats(60)
    hp.flush()


def _phases(hp, loss_fn, opt, data, args, device, rank: int) -> None:
    """Markers at the host-side steps of the sharded lookup and the training step (every
    rank runs them; rank 0 prints): where the host waits and where the GPU waits."""
    import veloce.sparse.lookup

    markers = Markers(device)
    # each call where it is made (the module whose name for it is looked up at the call)
    targets = [
        (veloce.sparse.lookup, "find_or_insert_many", "forward: local insert returned (host sync)"),
        (_input_dist, "bucketize_bags", "forward: bucketized"),
        (_input_dist, "begin_headers", "forward: header queued"),
        (_input_dist, "finish_headers", "forward: header exchanged (host sync)"),
        (_owner, "find_or_insert_many", "forward: owner insert returned (host sync)"),
        (_owner, "agree_sum", "agree_sum returned (host sync)"),
        (_input_dist, "all_to_all", "all_to_all queued"),
        (_output_dist, "all_to_all_rows", "all_to_all queued"),  # the partial sums'
        (_backward, "all_to_all_rows", "all_to_all queued"),  # the gradients'
        (_output_dist, "combine_parts", "forward: parts combined"),
        (torch.ops.veloce, "accumulate_and_update_many", "step: update launched"),
    ]

    def marked(b, following):
        dense, sparse, label = b
        markers.mark("start")
        out = hp(dense, sparse)
        markers.mark("forward returned")
        loss = loss_fn(out, label)
        if following is not None and args.prefetch_at == "forward":
            hp.prefetch(*following)
            markers.mark("prefetch returned")
        loss.backward()
        markers.mark("backward returned")
        early = following is not None and args.prefetch_at == "backward"
        if early:  # --prefetch-at backward: the next step's exchange beside this one's tail
            hp.prefetch(*following)
            markers.mark("prefetch returned")
        opt.step()
        markers.mark("step returned")
        opt.zero_grad()
        markers.mark("zero_grad returned")
        if following is not None and args.prefetch_at == "step":  # --prefetch: the next step's exchange, from the CPU
            hp.prefetch(*following)
            markers.mark("prefetch returned")

    # The ids each owner inserts per step: Zipf-hot ids make some owners' share larger.
    received = []
    insert = _owner.find_or_insert_many

    def counted(tables, ids, *a, **k):
        received.append(sum(i.numel() for i in ids))
        return insert(tables, ids, *a, **k)

    n = args.warmup + args.steps
    gc.disable()
    _owner.find_or_insert_many = counted
    try:
        for _ in range(2):  # a warm-up pass through the markers, then the measured one
            markers.clear()
            received.clear()
            with marked_calls(markers, targets):
                ahead = [(d.cpu(), s_.cpu()) for d, s_, _ in data[args.warmup : n]] if args.prefetch else None
                if ahead:
                    hp.prefetch(*ahead[0])
                for i, b in enumerate(data[args.warmup : n]):
                    marked(b, ahead[i + 1] if ahead and i + 1 < len(ahead) else None)
                sync_device(device)
    finally:
        _owner.find_or_insert_many = insert
    gc.enable()
    if rank == 0:
        print(markers.report(f"rank 0 of {dist.get_world_size()}, {args.sparse}", args.steps), flush=True)
    # Every rank's view: where the ranks wait for each other (a collective ends when the
    # last rank reaches it), and how evenly the owners' work is shared.
    mine = {"phases": markers.medians(args.steps), "ids_per_step": sum(received) / max(args.steps, 1)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        w = len(every)
        print(f"\nevery rank (host ms since the step's start / GPU lag), {args.sparse}:")
        print(f"{'marker':<46}" + "".join(f" {'rank ' + str(r):>15}" for r in range(w)))
        for i, (name, _, _) in enumerate(every[0]["phases"][0]):
            cells = []
            for e in every:
                rows = e["phases"][0]
                cells.append(f"{rows[i][1]:7.3f}/{rows[i][2]:6.3f}" if i < len(rows) and rows[i][0] == name else "-")
            print(f"{name:<46}" + "".join(f" {c:>15}" for c in cells))
        print(f"{'host ms per step':<46}" + "".join(f" {e['phases'][1]:>15.3f}" for e in every))
        print(f"{'ids inserted per step (owner)':<46}" + "".join(f" {e['ids_per_step']:>15,.0f}" for e in every),
              flush=True)  # fmt: skip


def _profile(step, device, out, steps: int = 5) -> None:
    """This rank's view of ``steps`` steps (every rank is profiled, so none runs ahead):
    the ops taking the most host and device time, the host syncs per step and the device's
    idle gaps, written to ``out``."""
    import contextlib
    import io

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync_device(device)
    events = prof.key_averages()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print(events.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
        if device.type == "cuda":
            print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
        for e in events:
            if e.key.startswith("cuda") and any(w in e.key for w in ("Synchronize", "Memcpy", "Launch", "Event", "Wait")):
                print(f"per step: {e.count / steps:8.1f} x {e.key} ({e.cpu_time_total / steps / 1e3:.3f} ms host)")
        if device.type == "cuda":
            print_idle_gaps(prof, steps, top=25)
    out.write(buf.getvalue())


def summarize(paths: list[str]) -> None:
    rows = [json.load(open(p)) for p in paths]
    for r in rows:  # runs of another nonfinite_grad policy are rows of their own
        nf = r.get("nonfinite_grad", "raise")
        r["label"] = r["sparse"] + ("" if nf == "raise" else f", {nf}") + (", tf32" if r.get("tf32") else "")
        r["label"] += f", {r['pin_cores']} core(s) per rank" if r.get("pin_cores") else ""
    base = {r["label"]: r["samples_per_s"] for r in rows if r["world_size"] == 1}
    sync = {(r["world_size"], r["label"].replace("async", "sync")): r["samples_per_s"] for r in rows
            if r["sparse"].startswith("sync")}  # fmt: skip
    r0 = rows[0]
    print(f"device: {r0['device']}, torch {r0['torch']}, fp32, {r0['features']} tables, dim {r0['dim']}, "
          f"bag 1, {r0['batch_per_gpu']} samples per GPU\n")  # fmt: skip
    print("| GPUs | sparse | step ms | synced step ms | samples/s | weak-scaling eff. | async/sync | exchange ms | "
          "exchange MB | a2a same bytes ms | exchange / a2a busbw | payload ms | payload / a2a busbw | "
          "payload ms, ranks aligned | aligned payload / a2a busbw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["world_size"], r["label"])):
        w, s = r["world_size"], r["label"]
        # One GPU has no exchange: the runs with an exchange dtype compare with the plain one.
        one = base.get(s, base.get(s.replace("+bfloat16", "").replace("+float16", "")))
        eff = r["samples_per_s"] / (w * one) if one else float("nan")
        key = (w, s.replace("async", "sync"))
        ratio = r["samples_per_s"] / sync[key] if s.startswith("async") and key in sync else float("nan")
        bw = (r["a2a_same_bytes_ms"] / r["exchange_ms"]) if w > 1 and r["exchange_ms"] else float("nan")
        synced = f"{r['step_ms_synced']:.2f}" if "step_ms_synced" in r else "-"
        # The header swaps move no payload; their time is mostly the ranks meeting (each
        # exchange starts with one), so the payload all-to-alls alone are shown too.
        payload = sum(c["ms"] for c in r.get("exchange_calls", {}).values() if c["MB"] > 0)
        pbw = r["a2a_same_bytes_ms"] / payload if w > 1 and payload else float("nan")
        # With the ranks aligned before each call (a barrier, as the baseline's runs have),
        # the time is the transfers' own, without the wait for the last rank to arrive.
        apay = sum(c["ms"] for c in r.get("exchange_aligned_calls", {}).values() if c["MB"] > 0)
        apbw = r["a2a_same_bytes_ms"] / apay if w > 1 and apay else float("nan")
        print(f"| {w} | {s} | {r['step_ms']:.2f} | {synced} | {r['samples_per_s']:,.0f} | {eff:.1%} | {ratio:.2f} | "
              f"{r['exchange_ms']:.2f} | {r['exchange_MB']:.1f} | {r['a2a_same_bytes_ms']:.2f} | {bw:.1%} | "
              f"{payload:.2f} | {pbw:.1%} | {apay:.2f} | {apbw:.1%} |")


def whole_step(model, loss_fn, opt):
    """A training step as one function of the batch, what ``veloce.CUDAGraphStep`` captures:
    forward, loss, backward, the optimizer's step and zero_grad; returns the loss, detached."""

    def step(dense, sparse, label):
        loss = loss_fn(model(dense, sparse), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, for a quick check")
    p.add_argument("--batch", type=int, default=16384, help="samples per GPU")
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--id-space", type=int, default=10**7)
    p.add_argument("--capacity", type=int, default=1 << 20, help="initial slots per table (grows when needed)")
    p.add_argument("--sparse", choices=("sync", "async"), default="sync")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--nonfinite", choices=("raise", "raise_next", "apply"), default="raise",
                   help="the tables' nonfinite_grad policy (raise_next: step() does not wait for the NaN/Inf check)")
    p.add_argument("--lookup-errors", choices=("raise", "raise_next"), default=None,
                   help="HybridParallel(lookup_errors=...); default: raise_next with --nonfinite raise_next (neither "
                        "waits for the device in the step), else raise")  # fmt: skip
    p.add_argument("--prefetch", action="store_true",
                   help="HybridParallel.prefetch: each step's sparse exchange starts after the previous step")
    p.add_argument("--prefetch-at", choices=("step", "backward", "forward"), default="step",
                   help="--prefetch: start the next batch's exchange after step(), after backward() (beside "
                        "the backward's tail on the GPU; its update is queued after the inserts) or, with "
                        "--prefetch-depth header, right after the forward")
    p.add_argument("--prefetch-depth", choices=("inserts", "header"), default="inserts",
                   help="--prefetch: HybridParallel(prefetch_depth=...): the exchange up to the owners' inserts, or "
                        "only the bucketing and the header (no host sync in prefetch)")
    p.add_argument("--cprofile", default=None, metavar="PATH",
                   help="write rank 0's cProfile of the timed steps (run again) to PATH")
    p.add_argument("--tf32", action="store_true",
                   help="TF32 matmuls for the dense MLPs (torch.backends.cuda.matmul.allow_tf32; off by default, as in PyTorch)")
    p.add_argument("--dedup", action="store_true", help="HybridParallel(dedup=True): one row per distinct id")
    p.add_argument("--exchange-dtype", choices=("bfloat16", "float16"), default=None,
                   help="HybridParallel(exchange_dtype=...): partial sums and gradients travel in it "
                        "(default: the tables' fp32)")
    p.add_argument("--pin-cores", type=int, default=0, metavar="K",
                   help="pin each rank's process to K cores of its own (default: not pinned)")
    p.add_argument("--graph-ahead", action="store_true",
                   help="with --graph: pass each step the next batch (next_inputs=), so that its counting phase runs "
                        "beside the step")
    p.add_argument("--graph", action="store_true",
                   help="each step as CUDA graphs (veloce.graphs.CUDAGraphStep; sharded: static exchanges)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=1,
                   help="time the back-to-back steps this many times (the ranks meet between windows); "
                        "step_ms is their mean")
    p.add_argument("--whatif-find", action="store_true",
                   help="a what-if, not training: fill the tables with every batch's ids, then time the windows "
                        "alternately as usual (even windows) and with the inserts replaced by find (odd ones: no "
                        "insert host sync); use an even --windows")
    p.add_argument("--defer-inserts", action="store_true",
                   help="DynamicEmbedding(defer_inserts=True): the local (unsharded) training inserts read their "
                        "counts back at step() instead of in the forward (no host sync there)")
    p.add_argument("--nccl-priority", choices=("none", "lookup", "grad", "both"), default="none",
                   help="an experiment: the lookup group's and/or the async gradient group's NCCL streams at high "
                        "priority")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", nargs="?", const="-", default=None,
                   help="profile 5 steps on every rank: print rank 0's ops, host syncs and device idle gaps, or "
                        "with a path prefix write each rank's to PREFIX.rankN.txt")  # fmt: skip
    p.add_argument("--phases", action="store_true",
                   help="print rank 0's host path of back-to-back steps (markers at each host sync and collective)")
    p.add_argument("--watchdog", type=float, default=240, help="seconds before a stuck run dumps its stacks and exits")
    p.add_argument("--summarize", nargs="+", default=None, help="JSON files of earlier runs: print the table")
    args = p.parse_args()
    if args.prefetch_at == "forward" and args.prefetch_depth != "header":
        p.error("--prefetch-at forward needs --prefetch-depth header (the inserts of the next batch would run "
                "before this step's backward)")
    if args.profile_steps < 1:
        p.error(f"--profile-steps must be >= 1 (the exchanges are timed over them), got {args.profile_steps}")
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args)


if __name__ == "__main__":
    main()
