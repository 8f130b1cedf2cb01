"""The static exchange (veloce.distributed.static): padded, equal-split all-to-alls whose
shapes a CUDA graph can hold. Run eagerly here (gloo on CPU; NCCL on GPUs with
VELOCE_TEST_NCCL=1), it must train exactly like the eager exchange and like one process:
uneven and empty per-rank batches, empty bags, several tables in one exchange, mean and
sum tables, growth, and a batch that holds the padding id itself (that step runs eagerly).
The same exchange inside a captured step is tested in test_graphs.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import veloce
from _dist import env_world_sizes, run_ranks
from veloce.distributed import HybridParallel, owner_of
from veloce.distributed import static

WORLD_SIZES = env_world_sizes()
STEPS = 12
SENTINEL_STEP = 7  # the step whose batch holds static.SENTINEL as an id


class Model(nn.Module):
    """Three dim-8 tables in one exchange (a jagged sum table that grows, a 2-D mean table,
    a 2-D sum table) and a dim-4 table in an exchange of its own."""

    def __init__(self, device="cpu"):
        super().__init__()
        torch.manual_seed(0)
        E = veloce.DynamicEmbedding
        self.a = E(8, mode="sum", capacity=32, optimizer=veloce.optim.SGD(lr=0.5), seed=1, device=device)
        self.b = E(8, mode="mean", optimizer=veloce.optim.Adam(lr=0.02), seed=2, device=device)
        self.c = E(8, mode="sum", optimizer=veloce.optim.RowWiseAdagrad(lr=0.1), seed=3, device=device)
        self.d = E(4, mode="mean", optimizer=veloce.optim.Adagrad(lr=0.1), seed=4, device=device)
        self.mlp = nn.Sequential(nn.Linear(8 * 3 + 4 + 3, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)

    def forward(self, dense, ids_a, offsets_a, ids_b):
        outs = veloce.lookup_many([self.a, self.b, self.c, self.d], self._inputs(ids_a, offsets_a, ids_b))
        return self.mlp(torch.cat([*outs, dense], 1)).squeeze(1)

    @staticmethod
    def _inputs(ids_a, offsets_a, ids_b):
        return [(ids_a, offsets_a), ids_b, ids_b + 1000, ids_b]

    def sparse_lookups(self, dense, ids_a, offsets_a, ids_b):
        return [([self.a, self.b, self.c, self.d], self._inputs(ids_a, offsets_a, ids_b))]


def global_batch(step: int, size: int = 12):
    g = torch.Generator().manual_seed(500 + step)
    lengths = torch.randint(0, 5, (size,), generator=g)  # empty bags too
    ids_a = torch.randint(-150, 150, (int(lengths.sum()),), generator=g)
    ids_a[::7] = 2**63 - 1  # huge ids
    if step == SENTINEL_STEP and ids_a.numel():
        ids_a[0] = static.SENTINEL
    ids_b = torch.randint(0, 40 + 10 * step, (size, 3), generator=g)
    dense = torch.randn(size, 3, generator=g)
    label = (torch.rand(size, generator=g) < 0.4).float()
    return lengths, ids_a, ids_b, dense, label


def split_sizes(step: int, size: int, world: int) -> list[int]:
    """Uneven per-rank batch sizes; on some steps one rank gets nothing."""
    if step % 4 == 2:
        sizes = [0] * world
        sizes[step % world] = size
        return sizes
    g = torch.Generator().manual_seed(9 + step)
    cuts = sorted(torch.randint(0, size + 1, (world - 1,), generator=g).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [size])]


def rank_inputs(step: int, world: int, rank: int):
    lengths, ids_a, ids_b, dense, label = global_batch(step)
    size = lengths.numel()
    sizes = split_sizes(step, size, world)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    a0, a1 = int(starts[lo]), int(starts[hi])
    return (dense[lo:hi], ids_a[a0:a1], starts[lo:hi] - a0, ids_b[lo:hi]), label[lo:hi], size


def train(model, world, rank, device, planner=None):
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    preds, eager_steps, caps = [], [], []
    for step in range(STEPS):
        inputs, label, size = rank_inputs(step, world, rank)
        inputs = [t.to(device) for t in inputs]
        if planner is not None:
            counted = planner.count(model.module.sparse_lookups(*inputs))
            fitted = planner.fit(counted, static.agree(counted).tolist())
            if fitted is None:
                eager_steps.append(step)
            else:
                static.PLANNED.extend(static.prepare(c, k) for c, k in zip(counted, fitted))
                caps.append(fitted)
        out = model(*inputs)
        assert not static.PLANNED, "a planned exchange was not taken"
        loss = nn.functional.binary_cross_entropy_with_logits(out, label.to(device), reduction="sum")
        (loss * world / size).backward()
        opt.step()
        opt.zero_grad()
        preds.append(out.detach().cpu())
    return preds, eager_steps, caps


def tables_of(model) -> dict:
    return {n: {k: v.cpu() for k, v in getattr(model, n).export().items()} for n in "abcd"}


def _body(rank, world, device_kind, use_static):
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    model = Model(device)
    hp = HybridParallel(model, sparse="sync")
    preds, eager_steps, caps = train(hp, world, rank, device, static.Planner() if use_static else None)
    tables = tables_of(model)
    for name, t in tables.items():
        assert (owner_of(t["keys"], world) == rank).all(), f"table {name} holds keys it does not own"
    return {"preds": preds, "tables": tables, "eager": eager_steps, "caps": caps}


def _merged(results) -> dict:
    out = {}
    for name in "abcd":
        parts = [r["tables"][name] for r in results]
        keys = torch.cat([p["keys"] for p in parts])
        order = keys.argsort()
        out[name] = {f: torch.cat([p[f] for p in parts])[order] for f in ("keys", "weights", "optimizer_state", "scores")}
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_static_exchange_equals_eager_exchange_and_one_process(world):
    got = run_ranks(_body, world, "cpu", True, timeout=120)
    eager = run_ranks(_body, world, "cpu", False, timeout=120)
    model = Model()
    ref_preds, _, _ = train_one(model)
    ref_tables = tables_of(model)
    for r in got:
        # every rank ran the step that holds the padding id eagerly, and no other
        assert r["eager"] == [SENTINEL_STEP], r["eager"]
        # the capacities never shrink; the blocks' are the same on every rank
        for before, after in zip(r["caps"], r["caps"][1:]):
            for b, a in zip(before, after):
                assert a.ids >= b.ids and a.parts >= b.parts
                assert all(x >= y for x, y in zip(a.table_ids + a.table_parts, b.table_ids + b.table_parts))
        assert [[(c.ids, c.parts) for c in caps] for caps in r["caps"]] == \
            [[(c.ids, c.parts) for c in caps] for caps in got[0]["caps"]]
    for step in range(STEPS):
        static_preds = torch.cat([r["preds"][step] for r in got])
        # bit for bit the eager exchange's
        assert torch.equal(static_preds, torch.cat([r["preds"][step] for r in eager])), f"step {step}"
        torch.testing.assert_close(static_preds, ref_preds[step], rtol=1e-5, atol=1e-5, msg=f"step {step}")
    mine, theirs = _merged(got), _merged(eager)
    for name in "abcd":
        for f, v in mine[name].items():
            assert torch.equal(v, theirs[name][f]), f"table {name}: {f} differs from the eager exchange's"
        want = ref_tables[name]
        order = want["keys"].argsort()
        assert torch.equal(mine[name]["keys"], want["keys"][order])
        for f in ("weights", "optimizer_state"):
            torch.testing.assert_close(mine[name][f], want[f][order], rtol=1e-5, atol=1e-5)
    assert len(mine["a"]["keys"]) > 32  # table a grew past its first capacity


def train_one(model):
    """One process on the global batch."""
    return train(model, 1, 0, "cpu")


@pytest.mark.skipif(os.environ.get("VELOCE_TEST_NCCL") != "1", reason="NCCL tests run with VELOCE_TEST_NCCL=1")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_static_exchange_equals_eager_exchange_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    got = run_ranks(_body, world, "cuda", True, timeout=180, backend="nccl")
    eager = run_ranks(_body, world, "cuda", False, timeout=180, backend="nccl")
    for step in range(STEPS):
        assert torch.equal(torch.cat([r["preds"][step] for r in got]), torch.cat([r["preds"][step] for r in eager]))
    mine, theirs = _merged(got), _merged(eager)
    for name in "abcd":
        for f, v in mine[name].items():
            assert torch.equal(v, theirs[name][f]), f"table {name}: {f}"


def test_levels_grow_by_an_eighth_and_never_shrink():
    assert static._level(0, 0) == 0
    assert static._level(5, 64) == 64  # fits: unchanged
    for n in (1, 7, 100, 4096, 4097, 123457):
        cap = static._level(n, 0)
        assert n + n // 8 < cap <= (n + n // 8 + 1) * 17 // 16 + 1, (n, cap)
    a = static.Caps(64, 32, (10, 0), (5, 1))
    b = a.fit(static.Caps(10, 40, (3, 9), (5, 2)))
    assert b.ids == 64 and b.parts > 40 and b.table_ids[0] == 10 and b.table_ids[1] > 9 and b.table_parts[1] > 2


def _refusals(rank, world):
    out = []
    for kwargs, table_kwargs in (({"sparse": "async"}, {}), ({"dedup": True}, {}), ({}, {"padding_idx": -1})):
        model = nn.ModuleDict({"t": veloce.DynamicEmbedding(4, **table_kwargs)})
        HybridParallel(model, **kwargs)
        try:
            static.check_static([model["t"]])
        except ValueError as e:
            out.append(str(e))
    model = nn.ModuleDict({"t": veloce.DynamicEmbedding(4)})
    HybridParallel(model)
    ids = torch.tensor([1, 2])
    try:
        static.check_static([model["t"]], [(ids, torch.tensor([0]), torch.ones(2))])
    except ValueError as e:
        out.append(str(e))
    return out


def test_static_exchange_refuses_what_it_cannot_pad():
    msgs = run_ranks(_refusals, 2, timeout=60)[0]
    assert len(msgs) == 4
    for msg, what in zip(msgs, ("sparse='async'", "dedup=True", "padding_idx", "per-sample weights")):
        assert what in msg, msg


# ---- a captured step of sharded tables (CUDAGraphStep over HybridParallel, NCCL) ---------
GRAPH_STEPS = 14
GRAPH_SENTINEL_STEP = 9


class Fixed(nn.Module):
    """Model's tables with inputs of fixed shapes (a graph's): a 1-D jagged table whose bags
    change (empty ones too) over a fixed number of ids, and three 2-D tables."""

    def __init__(self, device):
        super().__init__()
        self.inner = Model(device)
        self.inner.a.table.grow_at = 0.5

    def forward(self, dense, ids_a, offsets_a, ids_b):
        return self.inner(dense, ids_a, offsets_a, ids_b)

    def sparse_lookups(self, dense, ids_a, offsets_a, ids_b):
        return self.inner.sparse_lookups(dense, ids_a, offsets_a, ids_b)


def fixed_batch(step: int, rank: int, device):
    """Rank ``rank``'s batch of step ``step``: 6 + 3 * rank samples (uneven over ranks)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    size = 6 + 3 * rank
    n = 2 * size
    cuts = torch.sort(torch.randint(0, n + 1, (size - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    ids_a = torch.randint(-200, 200 + 40 * step, (n,), generator=g)
    if step == GRAPH_SENTINEL_STEP and rank == 0:
        ids_a[3] = static.SENTINEL
    ids_b = torch.randint(0, 40 + 10 * step, (size, 3), generator=g)
    dense = torch.randn(size, 3, generator=g)
    label = (torch.rand(size, generator=g) < 0.4).float()
    return [t.to(device) for t in (dense, ids_a, offsets, ids_b, label)]


def _graph_body(rank, world, graphed, ahead=False):
    from veloce.graphs import CUDAGraphStep

    device = torch.device("cuda", rank)
    model = Fixed(device)
    hp = HybridParallel(model, sparse="sync")
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, capturable=True), hp)
    for m in (model.inner.a, model.inner.b, model.inner.c, model.inner.d):
        m.defer_inserts = True  # what a captured step does (the eager reference alike)

    def train_step(dense, ids_a, offsets_a, ids_b, label):
        out = hp(dense, ids_a, offsets_a, ids_b)
        loss = nn.functional.binary_cross_entropy_with_logits(out, label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return out.detach()

    step = CUDAGraphStep(train_step, hp, opt, lookups=lambda d, i, o, b, y: model.sparse_lookups(d, i, o, b)) \
        if graphed else train_step
    batches = [fixed_batch(s, rank, device) for s in range(GRAPH_STEPS)]
    preds = []
    for s in range(GRAPH_STEPS):
        if ahead:  # the next batch's counting phase beside this step (the last step: none)
            out = step(*batches[s], next_inputs=batches[s + 1] if s + 1 < GRAPH_STEPS else None)
        else:
            out = step(*batches[s])
        preds.append(out.clone().cpu())
    torch.cuda.synchronize()
    out = {"preds": preds, "tables": tables_of(model.inner), "captures": getattr(step, "captures", 0),
           "sizes": [len(getattr(model.inner, n)) for n in "abcd"]}  # fmt: skip
    if ahead:  # a call that passes other tensors than those announced is refused (every rank alike)
        step(*batches[0], next_inputs=batches[1])
        with pytest.raises(ValueError, match="next_inputs announced other tensors"):
            step(*[x.clone() for x in batches[1]])
        step.reset()
    return out


@pytest.mark.skipif(os.environ.get("VELOCE_TEST_NCCL") != "1", reason="NCCL tests run with VELOCE_TEST_NCCL=1")
@pytest.mark.parametrize("ahead", [False, True], ids=["counted in the call", "counted ahead"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_captured_sharded_step_equals_eager(world, ahead):
    """Sharded tables trained by replays of a captured step (static exchanges), with a table
    that grows while replayed (captured again on its rank alone), uneven batches over the
    ranks and a step whose batch holds the padding id (run eagerly on every rank): the
    same predictions and tables as eager steps; also with each step's counting phase run
    beside the step before (next_inputs=)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    got = run_ranks(_graph_body, world, True, ahead, timeout=240, backend="nccl")
    want = run_ranks(_graph_body, world, False, timeout=240, backend="nccl")
    assert all(r["captures"] >= 1 for r in got)
    for s in range(GRAPH_STEPS):
        for r, w in zip(got, want):
            # the dense gradients are averaged by another all-reduce than DDP's: not bit for bit
            torch.testing.assert_close(r["preds"][s], w["preds"][s], rtol=1e-5, atol=1e-5, msg=f"step {s}")
    mine, theirs = _merged(got), _merged(want)
    for name in "abcd":
        assert torch.equal(mine[name]["keys"], theirs[name]["keys"]), f"table {name}: keys"
        for f in ("weights", "optimizer_state"):
            torch.testing.assert_close(mine[name][f], theirs[name][f], rtol=1e-5, atol=1e-5, msg=f"{name}: {f}")
    assert [r["sizes"] for r in got] == [r["sizes"] for r in want]


def _nan_body(rank, world):
    """Steps counted ahead (next_inputs) with a NaN in rank 0's batch 5: the calls that
    raise FloatingPointError, per rank (the verdict is agreed, so every rank raises at the
    same calls; none waits in a replay another rank skipped)."""
    from veloce.graphs import CUDAGraphStep

    device = torch.device("cuda", rank)
    model = Fixed(device)
    hp = HybridParallel(model, sparse="sync")
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, capturable=True), hp)

    def train_step(dense, ids_a, offsets_a, ids_b, label):
        loss = nn.functional.binary_cross_entropy_with_logits(hp(dense, ids_a, offsets_a, ids_b), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = CUDAGraphStep(train_step, hp, opt, lookups=lambda d, i, o, b, y: model.sparse_lookups(d, i, o, b))
    n = GRAPH_SENTINEL_STEP  # (the batches before the padding id's)
    batches = [fixed_batch(s, rank, device) for s in range(n)]
    if rank == 0:
        batches[5][0] = torch.full_like(batches[5][0], float("nan"))
    raised = []
    for s in range(n):
        try:
            step(*batches[s], next_inputs=batches[s + 1] if s + 1 < n else None)
        except FloatingPointError:
            raised.append(s)
            opt.zero_grad()
    torch.cuda.synchronize()
    step.reset()
    return raised


@pytest.mark.skipif(os.environ.get("VELOCE_TEST_NCCL") != "1", reason="NCCL tests run with VELOCE_TEST_NCCL=1")
def test_a_nan_step_counted_ahead_raises_on_every_rank_at_the_next_call():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    got = run_ranks(_nan_body, 2, timeout=240, backend="nccl")
    assert got[0] == got[1], got
    assert got[0] and got[0][0] == 6, got


def _trainer_body(rank, world, cuda_graph):
    """The Trainer over HybridParallel (2 epochs of a small DLRM): uneven batches over the
    ranks, and rank 0's last batch short (so every rank runs that step eagerly)."""
    from veloce.models import DLRM

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    table = lambda d: veloce.DynamicEmbedding(d, mode="sum", capacity=256, device=device, defer_inserts=True)
    model = DLRM(4, 3, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), embedding_factory=table).to(device)
    dense = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    g = torch.Generator().manual_seed(10 + rank)
    sizes = [16 + 8 * rank] * 6 + [9 if rank == 0 else 16 + 8 * rank]
    loader = [((torch.randn(n, 4, generator=g), torch.randint(-300, 300 + 40 * i, (n, 3), generator=g)),
               (torch.rand(n, generator=g) < 0.3).float()) for i, n in enumerate(sizes)]  # fmt: skip
    trainer = veloce.Trainer(model, optimizer=dense, strategy={"sparse": "sync"}, max_epochs=2, progress=False,
                             cuda_graph=cuda_graph)  # fmt: skip
    history = trainer.fit(loader)
    tables = {n: {k: v.cpu() for k, v in m.export().items()} for n, m in model.embeddings.items()}
    captures = trainer._graph.captures if cuda_graph else 0
    if cuda_graph:
        trainer._graph.reset()
    return {"loss": [h["loss"] for h in history], "tables": tables, "captures": captures}


@pytest.mark.skipif(os.environ.get("VELOCE_TEST_NCCL") != "1", reason="NCCL tests run with VELOCE_TEST_NCCL=1")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_trainer_cuda_graph_over_sharded_tables_trains_as_eager(world):
    """Trainer(cuda_graph=True) on several ranks: replays of the captured sharded step, the
    next batch counted ahead, an epoch's last batch run eagerly on every rank because one
    rank's is short: the same losses and tables as the eager Trainer."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    got = run_ranks(_trainer_body, world, True, timeout=240, backend="nccl")
    want = run_ranks(_trainer_body, world, False, timeout=240, backend="nccl")
    assert all(r["captures"] >= 1 for r in got)
    for r, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(w["loss"]), rtol=1e-5, atol=1e-6)
        for name in r["tables"]:
            a, b = r["tables"][name], w["tables"][name]
            oa, ob = a["keys"].argsort(), b["keys"].argsort()
            assert torch.equal(a["keys"][oa], b["keys"][ob]), name
            torch.testing.assert_close(a["weights"][oa], b["weights"][ob], rtol=1e-5, atol=1e-5, msg=name)


def _agreement_body(rank, world):
    """A rank that cannot run a step makes every rank raise in the counting phase; eval-mode
    tables and lookups that lookups() did not announce are refused."""
    from veloce.distributed import ExchangeError

    model = Model()
    HybridParallel(model, sparse="sync")
    planner = static.Planner()
    inputs, _, _ = rank_inputs(0, world, rank)
    out = []
    counted = planner.count(model.sparse_lookups(*inputs))
    status = torch.tensor([int(rank == world - 1)])
    try:
        planner.fit(counted, static.agree(counted, status).tolist())
    except ExchangeError as e:
        out.append(str(e))
    # the next step goes on (nothing was left half done)
    counted = planner.count(model.sparse_lookups(*inputs))
    out.append(planner.fit(counted, static.agree(counted).tolist()) is not None)
    model.d.eval()
    try:
        planner.count(model.sparse_lookups(*inputs))
    except ValueError as e:
        out.append(str(e))
    model.d.train()
    static.EXPECTING = True
    try:
        model(*inputs)
    except ValueError as e:
        out.append(str(e))
    finally:
        static.EXPECTING = False
    return out


def test_a_rank_that_cannot_run_the_step_stops_every_rank():
    for msgs in run_ranks(_agreement_body, 2, timeout=60):
        assert "another rank could not run this step" in msgs[0], msgs
        assert msgs[1] is True
        assert "eval mode" in msgs[2], msgs
        assert "after the lookups its lookups() said" in msgs[3], msgs


# ---- layouts and settings the static exchange must carry exactly ------------------------
def _edge_tables(cfg):
    torch.manual_seed(0)
    E = veloce.DynamicEmbedding
    m = nn.Module()
    m.a = E(8, mode=cfg.get("a_mode", "sum"), include_last_offset=True, optimizer=veloce.optim.SGD(lr=0.5), seed=1)
    m.b = E(8, mode="mean", include_last_offset=cfg.get("b_ilo", False), optimizer=veloce.optim.Adam(lr=0.02),
            seed=2)  # fmt: skip
    m.z = E(8, mode="sum", optimizer=veloce.optim.RowWiseAdagrad(lr=0.1), seed=3)  # bags of no id: (B, 0)
    return m


def _edge_groups(m, cfg, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    size = 0 if (step % 3 == 1 and rank == 0) else 3 + 2 * rank
    lengths = torch.randint(0, 4, (size,), generator=g)
    ids_a = torch.randint(-50, 50, (int(lengths.sum()),), generator=g)
    offs_a = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])  # include_last_offset
    ids_b = torch.randint(0, 30, (size, 2), generator=g)
    b_in = (ids_b.reshape(-1), torch.arange(0, 2 * size + 1, 2)) if cfg.get("b_ilo") else ids_b
    groups = [([m.a, m.b, m.z], [(ids_a, offs_a), b_in, torch.zeros(size, 0, dtype=torch.long)])]
    if cfg.get("two_groups"):  # a second exchange that looks table b up again
        groups.append(([m.b], [ids_b + 7]))
    return groups


def _edge_body(rank, world, cfg, use_static):
    m = _edge_tables(cfg)
    HybridParallel(m, sparse="sync", exchange_dtype=cfg.get("wire"))
    planner = static.Planner()
    preds = []
    for step in range(6):
        groups = _edge_groups(m, cfg, step, rank)
        if use_static:
            counted = planner.count(groups)
            fitted = planner.fit(counted, static.agree(counted).tolist())
            static.PLANNED.extend(static.prepare(c, k) for c, k in zip(counted, fitted))
        outs = [o for tables, inputs in groups for o in veloce.lookup_many(tables, inputs)]
        assert not static.PLANNED
        sum(((o * (k + 1)) ** 2).sum() for k, o in enumerate(outs)).backward()
        for t in (m.a, m.b, m.z):
            t.step()
            t.zero_grad()
        preds.append([o.detach() for o in outs])
    return {"preds": preds, "tables": {n: getattr(m, n).export() for n in "abz"}}


@pytest.mark.parametrize("cfg", [
    {}, {"a_mode": "mean"}, {"b_ilo": True}, {"wire": torch.bfloat16}, {"two_groups": True},
], ids=["include_last_offset", "mean with include_last_offset", "2-D as 1-D", "bfloat16 exchange", "two exchanges"])  # fmt: skip
def test_static_exchange_carries_every_layout_exactly(cfg):
    """1-D bags with include_last_offset (sum and mean), bags of no id, a rank with no batch,
    rows sent in bfloat16, a table looked up in two exchanges of one step: bit for bit the
    eager exchange's outputs and tables."""
    world = WORLD_SIZES[-1]
    got = run_ranks(_edge_body, world, cfg, True, timeout=120)
    want = run_ranks(_edge_body, world, cfg, False, timeout=120)
    for r, (a, b) in enumerate(zip(got, want)):
        for s, (pa, pb) in enumerate(zip(a["preds"], b["preds"])):
            for k, (x, y) in enumerate(zip(pa, pb)):
                assert torch.equal(x, y), f"rank {r} step {s} output {k}"
        for t in "abz":
            for f in ("keys", "weights", "optimizer_state", "scores"):
                assert torch.equal(a["tables"][t][f], b["tables"][t][f]), f"rank {r} table {t}: {f}"


def test_staged_counting_results_are_copies_the_step_reads():
    """static.staged gives the step tensors of its own (the counting phase may refill its
    own while the step runs); static.stage copies the counting phase's values into them."""
    from dataclasses import fields

    t = lambda *v: torch.tensor(v)
    c = static.Counted([], None, None, t(5, 6, 7), [3], t(0), t(2, 0, 1), t(0, 1, 0), t(1, 2, 0), t(3), t(3),
                       t([3]), t([3]), t(3, 3), [], ((3,),))  # fmt: skip
    tensors = [f.name for f in fields(c) if isinstance(getattr(c, f.name), torch.Tensor)]
    assert len(tensors) == 10
    mine = static.staged(c)
    for n in tensors:
        a, b = getattr(c, n), getattr(mine, n)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), n
    c.ids.fill_(9)
    c.perm.copy_(t(1, 2, 0))
    assert mine.ids.tolist() == [5, 6, 7]
    static.stage(mine, c)
    assert mine.ids.tolist() == [9, 9, 9] and mine.perm.tolist() == [1, 2, 0]
    assert mine.modules is c.modules and mine.num_bags == c.num_bags
