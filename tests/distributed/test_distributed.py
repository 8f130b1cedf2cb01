"""HybridParallel and the exchange ops: sharded training equals one process.

Multi-process tests run on local ranks through tests/_dist.py (gloo on CPU; each has a
timeout that names the ranks that hung). VELOCE_TEST_WORLD_SIZES="2,3,4" widens them on
bigger machines; VELOCE_TEST_NCCL=1 also runs them with NCCL on GPUs.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import veloce
from conftest import DEVICES, fmix64
from _dist import env_world_sizes, run_ranks
from veloce.distributed import ExchangeError, HybridParallel, all_to_all, bucketize_bags, combine_parts, owner_of

MASK = (1 << 64) - 1
WORLD_SIZES = env_world_sizes()


def ref_owner(i: int, w: int) -> int:
    """Pure-Python owner_hash (csrc/include/veloce/hash.h) mod w."""
    h = (fmix64((i & MASK) ^ 0x9E3779B97F4A7C15) * 0xD6E8FEB86659FD93) & MASK
    return h % w


def ref_bucketize(ids: list[int], offsets: list[int], w: int, pad):
    n = len(ids)
    bounds = offsets[1:] + [n]
    pos_by_owner = [[] for _ in range(w)]
    parts_by_owner = [[] for _ in range(w)]
    for b, (lo, hi) in enumerate(zip(offsets, bounds)):
        for i in range(lo, hi):
            if pad is not None and ids[i] == pad:
                continue
            o = ref_owner(ids[i], w)
            pos_by_owner[o].append(i)
            if parts_by_owner[o] and parts_by_owner[o][-1][0] == b:
                parts_by_owner[o][-1][1] += 1
            else:
                parts_by_owner[o].append([b, 1])
    perm = [i for p in pos_by_owner for i in p]
    parts = [p for ps in parts_by_owner for p in ps]
    return (perm, [len(p) for p in pos_by_owner], [p[0] for p in parts], [p[1] for p in parts],
            [len(p) for p in parts_by_owner])  # fmt: skip


ID = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 5))


# ---- the exchange ops ---------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(
    bags=st.lists(st.lists(ID, max_size=6), max_size=12),
    w=st.integers(1, 5),
    pad=st.one_of(st.none(), st.integers(-5, 5)),
    last=st.booleans(),
)
def test_bucketize_bags_matches_reference(device, bags, w, pad, last):
    ids = [i for b in bags for i in b]
    offsets = [sum(len(b) for b in bags[:k]) for k in range(len(bags))]
    t_ids = torch.tensor(ids, dtype=torch.long, device=device)
    t_off = torch.tensor(offsets + ([len(ids)] if last else []), dtype=torch.long, device=device)
    got = bucketize_bags(t_ids, t_off, w, include_last_offset=last, padding_id=pad)
    want = ref_bucketize(ids, offsets, w, pad)
    assert [t.tolist() for t in got] == list(want)
    assert owner_of(t_ids, w).tolist() == [ref_owner(i, w) for i in ids]
    # exact_sizes=False: the same values in N rows each (padding positions last in perm,
    # zeros after the parts)
    loose = bucketize_bags(t_ids, t_off, w, include_last_offset=last, padding_id=pad, exact_sizes=False)
    perm, id_splits, bag_of_part, part_lengths, part_splits = want
    rest = [0] * (len(ids) - len(bag_of_part))
    assert loose.perm.tolist() == perm + [i for i, x in enumerate(ids) if x == pad]
    assert loose.id_splits.tolist() == id_splits and loose.part_splits.tolist() == part_splits
    assert loose.bag_of_part.tolist() == bag_of_part + rest and loose.part_lengths.tolist() == part_lengths + rest


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [1, 8, 33, 64, 1000])
@pytest.mark.parametrize("aligned", [True, False])
def test_combine_parts_sums_in_part_order(device, dtype, dim, aligned):
    """Every pack width of the CUDA kernel (16-byte packs when dim allows and the rows are
    aligned, one element per lane otherwise) against a float64 reference."""
    g = torch.Generator().manual_seed(dim)
    bag = torch.tensor([0, 3, 3, 1, 0, 3, 5], device=device)
    flat = torch.randn(7 * dim + 1, generator=g, dtype=torch.float64).to(device, dtype)
    parts = flat[:-1].view(7, dim) if aligned else flat[1:].view(7, dim)  # storage offset of one element
    out = combine_parts(parts, bag, 7)
    want = torch.zeros(7, dim, dtype=torch.float64, device=device)
    for p, b in enumerate(bag.tolist()):
        want[b] += parts[p].double()
    low = dtype in (torch.bfloat16, torch.float16)
    torch.testing.assert_close(out.double(), want, rtol=1e-2 if low else 1e-6, atol=1e-2 if low else 1e-6)
    assert out[[2, 4, 6]].abs().sum() == 0  # bags without parts
    # check_bags=False (the sharded lookup's call: indices from bucketize_bags) sums alike
    assert torch.equal(torch.ops.veloce.combine_parts(parts, bag, 7, False), out)


@pytest.mark.parametrize("device", DEVICES)
def test_exchange_ops_opcheck(device):
    ids = torch.tensor([5, -3, 2**62, 5, 0, 9], device=device)
    offsets = torch.tensor([0, 2, 2, 5], device=device)
    torch.library.opcheck(torch.ops.veloce.owner_of.default, (ids, 3))
    torch.library.opcheck(torch.ops.veloce.bucketize_bags.default, (ids, offsets, False, 3, None))
    torch.library.opcheck(torch.ops.veloce.bucketize_bags.default, (ids, offsets, False, 2, 5))
    torch.library.opcheck(torch.ops.veloce.bucketize_bags.default, (ids, offsets, False, 3, None, False))
    torch.library.opcheck(torch.ops.veloce.bucketize_bags.default, (ids, offsets, False, 2, 5, False))
    parts = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    bag = torch.tensor([1, 0, 1, 3], device=device)
    torch.library.opcheck(torch.ops.veloce.combine_parts.default, (parts, bag, 4))
    torch.library.opcheck(torch.ops.veloce.combine_parts.default, (parts, bag, 4, False))
    assert torch.autograd.gradcheck(lambda p: combine_parts(p, bag, 4), (parts,))
    rows = torch.randn(7, 2, dtype=torch.float64, device=device, requires_grad=True)
    a, b = rows[:3].detach().requires_grad_(), rows[3:].detach().requires_grad_()
    counts = [1, 0, 2, 3, 1, 0]  # 2 groups x 3 peers
    torch.library.opcheck(torch.ops.veloce.regroup_blocks.default, ([rows], counts, 2, True))
    torch.library.opcheck(torch.ops.veloce.regroup_blocks.default, ([a, b], [1, 0, 2, 3, 0, 1], 2, False))
    assert torch.autograd.gradcheck(lambda r: torch.ops.veloce.regroup_blocks([r], counts, 2, True), (rows,))
    assert torch.autograd.gradcheck(lambda x, y: torch.ops.veloce.regroup_blocks([x, y], [1, 0, 2, 3, 0, 1], 2, False),
                                    (a, b))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_exchange_ops_bad_input(device):
    ids = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(RuntimeError, match="world_size must be >= 1, got 0"):
        owner_of(ids, 0)
    with pytest.raises(RuntimeError, match="ids must be torch.int64, got torch.int32"):
        owner_of(ids.int(), 2)
    with pytest.raises(RuntimeError, match=r"offsets must start at 0, got offsets\[0\] = 1"):
        bucketize_bags(ids, torch.tensor([1, 2], device=device), 2)
    with pytest.raises(RuntimeError, match=r"offsets\[1\] = 7 is past the end"):
        bucketize_bags(ids, torch.tensor([0, 7], device=device), 2)
    with pytest.raises(RuntimeError, match=r"offsets must be non-decreasing, got offsets\[1\] = 2 > offsets\[2\] = 1"):
        bucketize_bags(ids, torch.tensor([0, 2, 1], device=device), 2)
    with pytest.raises(RuntimeError, match=r"offsets\[1\] = 4 is past the end"):
        bucketize_bags(torch.empty(0, dtype=torch.long, device=device), torch.tensor([0, 4], device=device), 2)
    # exact_sizes=False: CPU still checks; CUDA does not (the caller checks the layout), and
    # stays in bounds: every part's bag is a bag, and the splits sum to at most N
    ids9 = torch.arange(9, device=device)
    for bad in ([1, 2], [0, 7, 3], [0, 20], [0, -5, 4], [-3], [5, 5, 5, 100]):
        off = torch.tensor(bad, device=device)
        if device == "cpu":
            with pytest.raises(RuntimeError, match="offsets"):
                bucketize_bags(ids9, off, 3, exact_sizes=False)
            continue
        b = bucketize_bags(ids9, off, 3, exact_sizes=False)
        P = int(b.part_splits.sum())
        assert int(b.id_splits.sum()) == 9 and 0 <= P <= 9
        assert P == 0 or (int(b.bag_of_part[:P].min()) >= 0 and int(b.bag_of_part[:P].max()) < len(bad))
        assert sorted(b.perm.tolist()) == list(range(9))
    parts = torch.randn(2, 4, device=device)
    with pytest.raises(RuntimeError, match=r"bag_of_part\[1\] = 5 is not a bag index in \[0, num_bags = 3\)"):
        combine_parts(parts, torch.tensor([0, 5], device=device), 3)
    if device == "cpu":  # the CPU kernel checks even with check_bags=False (it costs no sync there)
        with pytest.raises(RuntimeError, match=r"bag_of_part\[1\] = 5 is not a bag index"):
            torch.ops.veloce.combine_parts(parts, torch.tensor([0, 5], device=device), 3, False)
    with pytest.raises(RuntimeError, match=r"bag_of_part.size\(0\) must equal the number of parts .* \(2\), got 1"):
        combine_parts(parts, torch.tensor([0], device=device), 3)
    regroup = torch.ops.veloce.regroup_blocks
    rows = torch.randn(4, 2, device=device)
    with pytest.raises(ValueError, match="num_groups must be >= 1, got 0"):
        regroup([rows], [2, 2], 0, True)
    with pytest.raises(ValueError, match=r"counts must hold num_groups \* world_size entries \(num_groups = 2, .*got 3"):
        regroup([rows], [2, 1, 1], 2, True)
    with pytest.raises(ValueError, match=r"counts\[1\] = -1 is negative"):
        regroup([rows], [5, -1], 1, True)
    with pytest.raises(ValueError, match=r"sources\[0\] has 4 rows but counts give it 3"):
        regroup([rows], [2, 1], 2, True)
    with pytest.raises(ValueError, match=r"counts give sources\[0\] more rows than its 4 \(counts\[1\] = 3 after 2\)"):
        regroup([rows], [2, 3], 2, True)
    with pytest.raises(ValueError, match="sources must hold one tensor per group .* got 1"):
        regroup([rows], [2, 2], 2, False)
    with pytest.raises(ValueError, match="sources must hold one tensor .* to_group_major=True, got 2"):
        regroup([rows, rows], [2, 2], 2, True)
    with pytest.raises(ValueError, match=r"sources\[1\] is torch.float64 but sources\[0\] is torch.float32"):
        regroup([rows, rows.double()], [4, 4], 2, False)
    with pytest.raises(ValueError, match=r"sources\[1\] has shape \[4, 3\] but sources\[0\] has \[4, 2\]"):
        regroup([rows, torch.zeros(4, 3, device=device)], [4, 4], 2, False)
    with pytest.raises(ValueError, match=r"sources\[1\] has 4 rows but counts give it 3"):
        regroup([rows, rows], [4, 3], 2, False)
    with pytest.raises(ValueError, match="0-d tensor"):
        regroup([torch.tensor(1.0, device=device)], [0], 1, True)
    # counts that wrap int64 around to the source's size are refused before any copy
    with pytest.raises(ValueError, match=r"counts give sources\[0\] more rows than its 5 \(counts\[0\] = "):
        regroup([torch.arange(5, device=device)], [2**62, 2**62, 2**62, 2**62 + 5], 2, True)
    with pytest.raises(ValueError, match=r"counts\[3\] = 4611686018427387909 after 2"):
        regroup([torch.arange(5, device=device), torch.arange(5, device=device)], [2, 3, 2, 2**62 + 5], 2, False)
    from veloce.ops.exchange import regroup_blocks

    with pytest.raises(ValueError, match=r"counts must be G >= 1 lists of W >= 1 .* got lists of lengths \[3, 1\]"):
        regroup_blocks([rows], [[1, 2, 3], [4]], True)
    with pytest.raises(ValueError, match=r"got lists of lengths \[\]"):
        regroup_blocks([rows], [], True)
    if device != "cpu":
        with pytest.raises(RuntimeError, match=r"sources\[1\].*cpu"):
            regroup([rows, rows.cpu()], [4, 4], 2, False)


# ---- sharded training == one process -----------------------------------------------------
class Small(nn.Module):
    """Two tables (a jagged sum table with per-sample weights and growth, a mean table
    with padding over 2-D input) and an MLP."""

    def __init__(self, device="cpu"):
        super().__init__()
        torch.manual_seed(0)
        self.a = veloce.DynamicEmbedding(
            8, mode="sum", capacity=32, optimizer=veloce.optim.SGD(lr=0.5), seed=1, device=device
        )
        self.b = veloce.DynamicEmbedding(
            4, mode="mean", optimizer=veloce.optim.Adam(lr=0.02), seed=2, padding_idx=-1, device=device,
            initializer=veloce.init.uniform(-0.1, 0.1),
        )  # fmt: skip
        self.mlp = nn.Sequential(nn.Linear(8 + 4 + 3, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)

    def forward(self, dense, ids_a, offsets_a, psw_a, ids_b):
        ea = self.a(ids_a, offsets_a, per_sample_weights=psw_a)
        eb = self.b(ids_b)
        return self.mlp(torch.cat([ea, eb, dense], 1)).squeeze(1)

    def sparse_lookups(self, dense, ids_a, offsets_a, psw_a, ids_b):  # for HybridParallel.prefetch
        return [([self.a], [(ids_a, offsets_a, psw_a)]), ([self.b], [ids_b])]


def global_batch(step: int, size: int = 12):
    """A deterministic global batch: jagged bags (0-4 ids, some empty) over a few hundred
    ids (negative and huge ones included), a (size, 3) padded table, dense and labels."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 5, (size,), generator=g)
    pool = torch.tensor([-(2**63), 2**63 - 1, -7, 0, 1, 2**40])
    ids_a = torch.randint(-150, 150, (int(lengths.sum()),), generator=g)
    swap = torch.rand(ids_a.shape, generator=g) < 0.1
    ids_a[swap] = pool[torch.randint(0, len(pool), (int(swap.sum()),), generator=g)]
    psw_a = torch.rand(ids_a.shape, generator=g, dtype=torch.float32)
    ids_b = torch.randint(0, 60 + 10 * step, (size, 3), generator=g)
    ids_b[torch.rand(size, 3, generator=g) < 0.25] = -1
    dense = torch.randn(size, 3, generator=g)
    label = (torch.rand(size, generator=g) < 0.4).float()
    return lengths, ids_a, psw_a, ids_b, dense, label


def split_sizes(step: int, size: int, world: int) -> list[int]:
    """Uneven per-rank batch sizes; on some steps one rank gets nothing."""
    g = torch.Generator().manual_seed(7 + step)
    if step % 5 == 3:
        sizes = [0] * world
        sizes[step % world] = size
        return sizes
    cuts = sorted(torch.randint(0, size + 1, (world - 1,), generator=g).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [size])]


def rank_slice(batch, lo: int, hi: int):
    lengths, ids_a, psw_a, ids_b, dense, label = batch
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    a0, a1 = int(starts[lo]), int(starts[hi])
    offsets = starts[lo:hi] - a0
    return (dense[lo:hi], ids_a[a0:a1], offsets, psw_a[a0:a1], ids_b[lo:hi]), label[lo:hi]


STEPS = 20


def train(model, opt, world: int, rank: int, steps: int = STEPS, device="cpu", prefetch=False, clip=None):
    """Trains with the global batch split over ranks; each rank's loss is its share of the
    global mean (sum * world / global size), so DDP's average equals the global mean.
    ``prefetch``: each step's sparse exchange starts after the previous step (True), or
    after the previous forward ("forward", for prefetch_depth="header")
    (HybridParallel.prefetch, given the batch on the CPU as a loader yields it).
    ``clip``: a list; each step's gradients are clipped to norm 0.1 (veloce.clip_grad_norm_)
    and the total norm it returns appended."""

    def rank_batch(step):
        batch = global_batch(step)
        size = batch[0].numel()
        sizes = split_sizes(step, size, world)
        lo = sum(sizes[:rank])
        inputs, label = rank_slice(batch, lo, lo + sizes[rank])
        return inputs, label, size

    preds = []
    if prefetch:
        model.prefetch(*rank_batch(0)[0])
    for step in range(steps):
        inputs, label, size = rank_batch(step)
        out = model(*[t.to(device) for t in inputs])
        if prefetch == "forward" and step + 1 < steps:
            model.prefetch(*rank_batch(step + 1)[0])
        loss = nn.functional.binary_cross_entropy_with_logits(out, label.to(device), reduction="sum")
        (loss * world / size).backward()
        if clip is not None:
            clip.append(float(veloce.clip_grad_norm_(model, 0.1)))
        opt.step()
        opt.zero_grad()
        if prefetch is True and step + 1 < steps:
            model.prefetch(*rank_batch(step + 1)[0])
        preds.append(out.detach().cpu())
    return preds


def eval_preds(model, device="cpu"):
    model.eval()
    inputs, _ = rank_slice(global_batch(999), 0, 12)  # mostly unseen ids: the initializer's rows
    with torch.no_grad():
        out = model(*[t.to(device) for t in inputs]).cpu()
    model.train()
    return out


def tables_of(model, names="ab") -> dict:
    return {name: {k: v.cpu() for k, v in getattr(model, name).export().items()} for name in names}


def make_opt(model):
    return veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)


def _sharded_body(rank, world, device_kind, dedup=False, lookup_errors="raise", prefetch=False):
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    model = Small(device)
    depth = "header" if prefetch == "forward" else "inserts"
    hp = HybridParallel(model, sparse="sync", dedup=dedup, lookup_errors=lookup_errors, prefetch_depth=depth)
    from veloce.distributed import input_dist

    begin, calls = input_dist.begin_dispatch, []  # every first half starts there (prefetched or in its forward)
    input_dist.begin_dispatch = lambda *a, **k: calls.append(1) or begin(*a, **k)
    preds = train(hp, make_opt(hp), world, rank, device=device, prefetch=prefetch)
    input_dist.begin_dispatch = begin
    if not dedup:  # each lookup's first half ran once: prefetched, or in its forward
        assert len(calls) == 2 * STEPS and not model.a.backend.group.prefetched, (len(calls), prefetch)
    tables = tables_of(model)
    for name, t in tables.items():  # every key lives on its owner
        assert (owner_of(t["keys"], world) == rank).all(), f"table {name} holds keys it does not own"
    return {"preds": preds, "tables": tables, "eval": eval_preds(hp, device), "len": len(model.a)}


def reference():
    model = Small()
    preds = train(model, make_opt(model), 1, 0)
    return {"preds": preds, "tables": tables_of(model), "eval": eval_preds(model)}


def merged(tables: list[dict]) -> dict:
    out = {}
    for name in tables[0]:
        parts = [t[name] for t in tables]
        keys = torch.cat([p["keys"] for p in parts])
        order = keys.argsort()
        out[name] = {f: torch.cat([p[f] for p in parts])[order] for f in ("keys", "weights", "optimizer_state", "scores")}
    return out


def check_sharded_equals_reference(results, ref, world):
    for step in range(STEPS):
        sizes = split_sizes(step, 12, world)
        got = torch.cat([r["preds"][step] for r in results])
        assert [r["preds"][step].numel() for r in results] == sizes
        torch.testing.assert_close(got, ref["preds"][step], rtol=1e-5, atol=1e-5, msg=f"predictions of step {step}")
    for r in results:  # every rank evaluated the same whole batch
        torch.testing.assert_close(r["eval"], ref["eval"], rtol=1e-5, atol=1e-5)
    got = merged([r["tables"] for r in results])
    for name, want in ref["tables"].items():
        order = want["keys"].argsort()
        assert torch.equal(got[name]["keys"], want["keys"][order]), f"table {name}: keys differ"
        for f in ("weights", "optimizer_state"):
            torch.testing.assert_close(got[name][f], want[f][order], rtol=1e-5, atol=1e-5, msg=f"table {name}: {f}")
        assert torch.equal(got[name]["scores"], want["scores"][order]), f"table {name}: scores differ"
    assert sum(r["len"] for r in results) == len(ref["tables"]["a"]["keys"])


@pytest.mark.parametrize("dedup, lookup_errors, prefetch", [
    (False, "raise", False), (True, "raise", False), (False, "raise_next", False), (False, "raise_next", True),
    (False, "raise_next", "forward"),
], ids=["parts", "dedup", "parts, lookup_errors=raise_next", "parts, raise_next, prefetch",
        "parts, raise_next, prefetch the header after the forward"])  # fmt: skip
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sharded_sync_equals_one_process(world, dedup, lookup_errors, prefetch):
    results = run_ranks(_sharded_body, world, "cpu", dedup, lookup_errors, prefetch, timeout=90)
    check_sharded_equals_reference(results, reference(), world)


@pytest.mark.skipif(os.environ.get("VELOCE_TEST_NCCL") != "1", reason="NCCL tests run with VELOCE_TEST_NCCL=1")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sharded_sync_equals_one_process_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    for lookup_errors, prefetch in (("raise", False), ("raise_next", False), ("raise", True), ("raise_next", "forward")):
        results = run_ranks(_sharded_body, world, "cuda", False, lookup_errors, prefetch, timeout=120, backend="nccl")
        check_sharded_equals_reference(results, reference(), world)
    model = Grouped()
    ref = {"preds": train(model, make_opt(model), 1, 0), "tables": tables_of(model, "abcd"), "eval": eval_preds(model)}
    for dedup in (False, True):
        results = run_ranks(_grouped_body, world, "cuda", dedup, timeout=120, backend="nccl")
        check_sharded_equals_reference(results, ref, world)


class Grouped(nn.Module):
    """Four tables looked up together (veloce.lookup_many): three of dim 8 share one
    exchange (sum with learnable per-sample weights, mean with padding, sum), one of dim 4
    gets its own."""

    def __init__(self, device="cpu"):
        super().__init__()
        torch.manual_seed(0)
        E = veloce.DynamicEmbedding
        self.a = E(8, mode="sum", capacity=32, optimizer=veloce.optim.SGD(lr=0.5), seed=1, device=device)
        self.b = E(8, mode="mean", optimizer=veloce.optim.Adam(lr=0.02), seed=2, padding_idx=-1, device=device)
        self.c = E(8, mode="sum", optimizer=veloce.optim.RowWiseAdagrad(lr=0.1), seed=3, device=device)
        self.d = E(4, mode="mean", optimizer=veloce.optim.Adagrad(lr=0.1), seed=4, device=device)
        self.w = nn.Parameter(torch.tensor(1.5, device=device))  # scales the per-sample weights
        self.mlp = nn.Sequential(nn.Linear(8 * 3 + 4 + 3, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)

    def forward(self, dense, ids_a, offsets_a, psw_a, ids_b):
        tables = [self.a, self.b, self.c, self.d]
        outs = veloce.lookup_many(tables, [(ids_a, offsets_a, psw_a * self.w), ids_b, ids_b, ids_b])
        # An output changed in place, as nn.EmbeddingBag's may be: the sharded lookup's outputs
        # share one buffer (without being views), so this must touch b's rows only.
        outs[1].mul_(0.5)
        return self.mlp(torch.cat([*outs, dense], 1)).squeeze(1)


def _grouped_body(rank, world, device_kind, dedup=False):
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    model = Grouped(device)
    hp = HybridParallel(model, sparse="sync", dedup=dedup)
    preds = train(hp, make_opt(hp), world, rank, device=device)
    return {"preds": preds, "tables": tables_of(model, "abcd"), "eval": eval_preds(hp, device),
            "len": len(model.a), "w": model.w.item()}  # fmt: skip


@pytest.mark.parametrize("dedup", [False, True], ids=["parts", "dedup"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_grouped_lookup_equals_one_process(world, dedup):
    results = run_ranks(_grouped_body, world, "cpu", dedup, timeout=90)
    model = Grouped()
    ref = {"preds": train(model, make_opt(model), 1, 0), "tables": tables_of(model, "abcd"), "eval": eval_preds(model)}
    check_sharded_equals_reference(results, ref, world)
    # w's gradient sums many terms in another order per world size, and Adam normalises it.
    assert results[0]["w"] == pytest.approx(model.w.item(), rel=1e-4) and model.w.item() != 1.5


# ---- async ------------------------------------------------------------------------------
def _click_body(rank, world, modes, steps, batch):
    from veloce.data import SyntheticClicks
    from veloce.models import DLRM

    out = {}
    for mode in modes:
        torch.manual_seed(0)

        def table(dim):
            return veloce.DynamicEmbedding(dim, mode="sum", optimizer=veloce.optim.Adagrad(lr=0.05))

        model = DLRM(4, 6, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), embedding_factory=table)
        hp = HybridParallel(model, sparse=mode, staleness=1 if mode == "async" else 0)
        opt = make_opt(hp)
        data = SyntheticClicks(steps * batch, batch_size=batch // world, num_dense=4, num_sparse=6,
                               id_space=20_000, seed=3, rank=rank, world_size=world)  # fmt: skip
        for (dense, sparse), label in data:
            loss = nn.functional.binary_cross_entropy_with_logits(hp(dense, sparse), label)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if mode == "async":  # this step's gradients are still in flight, last step's applied
                assert all(m.backend.in_flight == 1 for _, m in hp.tables)
        hp.flush()
        assert all(not m.backend.in_flight and not m._pending for _, m in hp.tables)
        val = SyntheticClicks(20_000, batch_size=5000, num_dense=4, num_sparse=6, id_space=20_000, seed=3,
                              start=10**8)  # fmt: skip
        auc = veloce.metrics.AUC()
        hp.eval()
        with torch.no_grad():
            for (dense, sparse), label in val:
                auc.update(hp(dense, sparse), label)
        out[mode] = auc.compute()
    return out


def test_async_converges_like_sync():
    """Async (staleness 1) reaches the AUC of sync on a synthetic click task. Measured on
    2 ranks (60 steps of 512): sync 0.7328, async 0.7323 (|diff| 0.0005); the bound is 10x."""
    results = run_ranks(_click_body, 2, ("sync", "async"), 60, 512, timeout=120)
    sync, asyn = results[0]["sync"], results[0]["async"]
    assert results[1] == results[0]  # every rank evaluates the same model
    assert sync > 0.62, f"sync AUC {sync:.4f}: the task did not train"
    assert abs(sync - asyn) < 0.005, f"async AUC {asyn:.4f} vs sync {sync:.4f}"


# ---- errors -----------------------------------------------------------------------------
def _mismatch_body(rank, world):
    from veloce.distributed import Group

    dim = 4 if rank == 0 else 8  # rank 1 built its table with another dim
    model = nn.Sequential()
    model.add_module("t", veloce.DynamicEmbedding(dim, mode="sum"))
    hp = HybridParallel(model)
    msgs = []
    try:
        hp(torch.tensor([[1, 2], [3, 4]]))
    except ExchangeError as e:
        msgs.append(str(e))
    group = Group(None)
    try:
        all_to_all(group, torch.zeros(3), [1, 1], [1, 1])
    except ValueError as e:
        msgs.append(str(e))
    for dedup in (False, True):  # rank 0 would send rows in bfloat16, rank 1 in fp32
        model = nn.Sequential()
        model.add_module("t", veloce.DynamicEmbedding(8, mode="sum"))
        hp = HybridParallel(model, dedup=dedup, exchange_dtype=torch.bfloat16 if rank == 0 else None)
        try:
            hp(torch.tensor([[1, 2], [3, 4]]))
        except ExchangeError as e:
            msgs.append(str(e))
    return msgs


def test_mismatched_ranks_raise_on_every_rank():
    results = run_ranks(_mismatch_body, 2, timeout=60)
    for rank, msgs in enumerate(results):
        assert len(msgs) == 4, msgs
        assert f"rank {1 - rank} sent signature" in msgs[0] and "same order" in msgs[0]
        assert "send_splits sum to 2 but send has 3 rows" in msgs[1]
        for m in msgs[2:]:  # another exchange_dtype: the header says so, nobody hangs
            assert f"rank {1 - rank} sent signature" in m and "exchange_dtype" in m


def _unwrap_with_async_gradients_in_flight(rank, world):
    model = Small()
    hp = HybridParallel(model, sparse="async", staleness=1)
    opt = make_opt(hp)
    inputs, label = rank_slice(global_batch(0), 6 * rank, 6 * rank + 6)
    loss = nn.functional.binary_cross_entropy_with_logits(hp(*inputs), label, reduction="sum")
    (loss * world / 12).backward()
    opt.step()  # staleness 1: this step's sparse gradients stay in flight
    in_flight = [m.backend.in_flight for m in (model.a, model.b)]
    before = tables_of(model)
    hp.unwrap()  # they become the tables' pending gradients
    model.a.step()  # applies them (SGD: the same as one step of one process)
    return {"in_flight": in_flight, "before": before, "tables": tables_of(model)}


def test_unwrap_keeps_async_gradients_in_flight():
    """HybridParallel.unwrap() with async sparse gradients still in flight waits for them
    and keeps them as the tables' pending gradients: the next step() applies them, as one
    process's step would. (They used to be dropped.)"""
    results = run_ranks(_unwrap_with_async_gradients_in_flight, 2, timeout=90)
    assert all(r["in_flight"] == [1, 1] for r in results)
    model = Small()
    inputs, label = rank_slice(global_batch(0), 0, 12)
    nn.functional.binary_cross_entropy_with_logits(model(*inputs), label).backward()  # the global mean
    make_opt(model).step()
    got, want = merged([r["tables"] for r in results]), tables_of(model)
    before = merged([r["before"] for r in results])
    order = want["a"]["keys"].argsort()
    assert not torch.equal(got["a"]["weights"], before["a"]["weights"])
    torch.testing.assert_close(got["a"]["weights"], want["a"]["weights"][order], rtol=1e-5, atol=1e-5)


def _load_whole_table_body(rank, world, path):
    """Every rank loads one process's state dict (the DDP habit), then saves a checkpoint and
    loads it back: each shard keeps the rows it owns."""
    whole = torch.load(path, weights_only=True)
    model = Small()
    hp = HybridParallel(model)
    model.load_state_dict(whole)
    mine = owner_of(whole["a.keys"], world) == rank
    exported = model.a.export()
    order = exported["keys"].argsort()
    want = whole["a.keys"][mine].argsort()
    assert torch.equal(exported["keys"][order], whole["a.keys"][mine][want])
    assert torch.equal(exported["weights"][order], whole["a.weights"][mine][want])
    ckpt = os.path.join(os.path.dirname(path), "ckpt")
    veloce.checkpoint.save(ckpt, hp, make_opt(hp), step=1)
    veloce.checkpoint.load(ckpt, hp)  # the shards do not overlap
    return len(model.a), len(model.b), model.a.step_count


def test_a_whole_tables_state_dict_loads_into_its_shards(tmp_path):
    """load_state_dict on a sharded table keeps the ids this rank owns (it used to keep
    every row on every rank, and the next checkpoint's shards overlapped)."""
    src = Small()
    train(src, make_opt(src), 1, 0, steps=2)
    path = str(tmp_path / "whole.pt")
    torch.save(src.state_dict(), path)
    results = run_ranks(_load_whole_table_body, 2, path, timeout=90)
    assert sum(r[0] for r in results) == len(src.a) and sum(r[1] for r in results) == len(src.b)
    assert all(r[0] < len(src.a) for r in results) and {r[2] for r in results} == {src.a.step_count}


class _WithLocal(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=0.1))
        self.shared, self.local = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, ids, offsets):
        e = self.emb(ids, offsets)
        return self.shared(e).squeeze(1) + self.local(e).squeeze(1)


def _wrap_twice_and_own_ignores(rank, world):
    model = _WithLocal()
    DistributedDataParallel = torch.nn.parallel.DistributedDataParallel
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["local.weight", "local.bias"])
    try:
        HybridParallel(model, find_unused_parameter=True)  # a typo of a DDP argument
    except TypeError:
        pass
    else:
        raise AssertionError("the mistyped DDP argument was accepted")
    assert not model.emb.backend.sharded  # the failed call left no sharding behind
    hp = HybridParallel(model, find_unused_parameters=False)
    assert "local.weight" in model._ddp_params_and_buffers_to_ignore
    ids = torch.tensor([rank * 10 + 1, rank * 10 + 2])
    hp(ids, torch.tensor([0])).sum().mul(rank + 1).backward()
    return model.local.weight.grad.clone(), model.shared.weight.grad.clone()


def _plain_ddp(rank, world):
    """A model with a table wrapped in torch's DistributedDataParallel, trained one step;
    then a lookup_many of the table, and the per_rank opt-out. Returns what each raised
    and the table's size."""
    model = _WithLocal()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, offsets = torch.tensor([rank * 10 + 1, 2]), torch.tensor([0])
    errors = []
    for call in (lambda: ddp(ids, offsets).sum().backward(), lambda: veloce.lookup_many([model.emb], [(ids, offsets)])):
        try:
            call()
        except RuntimeError as e:
            errors.append(str(e))
    size_refused = len(model.emb)
    model.emb.per_rank = True  # each rank's own table, on purpose
    model(ids, offsets).sum().backward()
    model.emb.step()
    return errors, size_refused, len(model.emb)


def test_plain_ddp_around_a_model_with_tables_is_refused_with_use_hybrid_parallel():
    """DDP synchronises parameters only: each rank's table would drift apart. The first
    training lookup raises (nothing inserted) and names HybridParallel; per_rank=True
    trains each rank's own table."""
    for errors, size_refused, size_per_rank in run_ranks(_plain_ddp, 2, timeout=90):
        assert len(errors) == 2, errors
        ddp_error, many_error = errors
        assert "DistributedDataParallel does not synchronise DynamicEmbedding tables" in ddp_error
        for e in (ddp_error, many_error):
            assert "Use veloce.distributed.HybridParallel(model) instead of DistributedDataParallel(model)" in e
            assert "per_rank=True" in e
        assert size_refused == 0 and size_per_rank == 2


def _wrap_a_max_table(rank, world):
    tables = nn.ModuleList([veloce.DynamicEmbedding(4, mode="sum"), veloce.DynamicEmbedding(4, mode="max")])
    try:
        HybridParallel(tables, dense="none")
    except ValueError as e:
        return str(e), [not t.backend.sharded for t in tables]
    return None, [not t.backend.sharded for t in tables]


def test_hybrid_parallel_around_a_max_table_says_max_is_not_sharded():
    """An owner pools only its part of a bag, so mode="max" tables are refused over several
    ranks, before any table is sharded."""
    for error, unsharded in run_ranks(_wrap_a_max_table, 2, timeout=60):
        assert error is not None and "table(s) ['1'] pool with mode='max'" in error
        assert unsharded == [True, True]


def test_a_failed_wrap_can_be_retried_and_the_users_ddp_ignores_stay():
    (l0, s0), (l1, s1) = run_ranks(_wrap_twice_and_own_ignores, 2, timeout=90)
    assert torch.equal(s0, s1)  # averaged by DDP
    assert not torch.equal(l0, l1)  # the user's ignored parameter: each rank's own gradient


def _modes_disagree(rank, world, dedup):
    model = _WithLocal()
    hp = HybridParallel(model, dedup=dedup)
    if rank == 0:
        hp.eval()
    try:
        hp(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    except ExchangeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("dedup", [False, True])
def test_ranks_in_train_and_eval_mode_raise_instead_of_hanging(dedup):
    """A rank in eval and one in training used to pass the lookup's header and then wait in
    different collectives (the gradient exchange, the step's agreement) for ever."""
    for rank, msg in enumerate(run_ranks(_modes_disagree, 2, dedup, timeout=60)):
        assert msg is not None and f"rank {1 - rank} sent signature" in msg and "train or eval mode" in msg


def _validate_under_no_grad(rank, world, dedup):
    """A training step, then lookups under no_grad with the model still in training mode:
    through the module and through lookup_many; then rank 0 under no_grad, rank 1 not."""
    model = _WithLocal()
    hp = HybridParallel(model, dedup=dedup)
    opt = make_opt(hp)
    ids, offsets = torch.tensor([1, 2, 3]) + 10 * rank, torch.tensor([0, 2])
    hp(ids, offsets).sum().backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.emb.export().items()}
    new = torch.tensor([1, 500, 501, 502]) + 10 * rank  # mostly ids no rank has seen
    with torch.no_grad():
        got = hp(new, offsets)
        (many,) = veloce.lookup_many([model.emb], [(new, offsets)])
    after = model.emb.export()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    hp.eval()
    with torch.no_grad():
        want = hp(new, offsets)
    (looked_up,) = veloce.lookup_many([model.emb], [(new, offsets)])
    hp.train()
    try:  # the table itself: DDP's own forward would wait in a collective on the rank with gradients
        with torch.no_grad() if rank == 0 else torch.enable_grad():
            model.emb(ids, offsets)
    except ExchangeError as e:
        mixed = str(e)
    else:
        mixed = None
    return unchanged, torch.equal(got, want), torch.equal(many, looked_up), mixed


@pytest.mark.parametrize("dedup", [False, True], ids=["parts", "dedup"])
def test_validation_under_no_grad_in_train_mode_inserts_nothing_on_any_rank(dedup):
    for rank, (unchanged, same, same_many, mixed) in enumerate(run_ranks(_validate_under_no_grad, 2, dedup,
                                                                          timeout=60)):  # fmt: skip
        assert unchanged and same and same_many, rank
        assert mixed is not None and "torch.no_grad()" in mixed, (rank, mixed)


def _plain_torch_optimizer(rank, world, sparse):
    model = _WithLocal()
    hp = HybridParallel(model, sparse=sparse)
    opt = torch.optim.Adam(hp.parameters(), lr=0.01)  # no table among them
    ids, offsets = torch.tensor([1, 2, 3]) + 10 * rank, torch.tensor([0, 2])
    hp(ids, offsets).sum().backward()
    opt.step()
    opt.zero_grad()
    try:
        hp(ids, offsets)
    except (RuntimeError, ExchangeError) as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.parametrize("sparse", ["sync", "async"])
def test_plain_torch_optimizer_loop_over_hybrid_parallel_raises_on_every_rank(sparse):
    for rank, (kind, msg) in enumerate(run_ranks(_plain_torch_optimizer, 2, sparse, timeout=60)):
        assert kind == "RuntimeError" and "CombinedOptimizer" in msg, (rank, kind, msg)


def _clipped_body(rank, world):
    model = Small()
    hp = HybridParallel(model, sparse="sync")
    norms: list = []
    preds = train(hp, make_opt(hp), world, rank, steps=6, clip=norms)
    return {"preds": preds, "tables": tables_of(model), "norms": norms}


def test_clip_grad_norm_of_sharded_tables_equals_one_process():
    model = Small()
    ref_norms: list = []
    ref_preds = train(model, make_opt(model), 1, 0, steps=6, clip=ref_norms)
    assert min(ref_norms) > 0.1  # the clipping scales every step's gradients
    results = run_ranks(_clipped_body, 2, timeout=90)
    for r in results:  # every rank's total norm is the one process's
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
    for step in range(6):
        got = torch.cat([r["preds"][step] for r in results])
        torch.testing.assert_close(got, ref_preds[step], rtol=1e-5, atol=1e-5)
    got = merged([r["tables"] for r in results])
    for name, want in tables_of(model).items():
        order = want["keys"].argsort()
        assert torch.equal(got[name]["keys"], want["keys"][order])
        torch.testing.assert_close(got[name]["weights"], want["weights"][order], rtol=1e-5, atol=1e-5)


def _bad_input_in_a_later_exchange(rank, world):
    a = veloce.DynamicEmbedding(4, mode="sum")
    b = veloce.DynamicEmbedding(8, mode="sum")  # another dim: another exchange
    HybridParallel(nn.ModuleDict({"a": a, "b": b}))
    ids_b = torch.tensor([5.0]) if rank == 1 else torch.tensor([5])  # rank 1's is not ids
    try:
        veloce.lookup_many([a, b], [(torch.tensor([1, 2, 3]), torch.tensor([0])), (ids_b, torch.tensor([0]))])
    except (TypeError, ExchangeError) as e:
        return type(e).__name__, len(a), len(b)
    return None, len(a), len(b)


def test_bad_input_of_a_later_exchange_changes_no_table():
    """lookup_many checks every sharded table's input before the first exchange: rank 1's
    bad ids for the second table used to arrive after the first table's rows were inserted."""
    (e0, a0, b0), (e1, a1, b1) = run_ranks(_bad_input_in_a_later_exchange, 2, timeout=60)
    assert (e0, e1) == ("ExchangeError", "TypeError")
    assert a0 == a1 == b0 == b1 == 0


def _world_one_body(rank, world):
    model = Small()
    hp = HybridParallel(model)
    assert not model.a.backend.sharded and hp._ddp is None  # nothing extra at world size 1
    return train(hp, make_opt(hp), 1, 0, steps=3)


def test_world_size_one_is_plain_training():
    (preds,) = run_ranks(_world_one_body, 1, timeout=60)
    model = Small()
    want = train(model, make_opt(model), 1, 0, steps=3)
    for a, b in zip(preds, want):
        assert torch.equal(a, b)


def test_hybrid_parallel_arguments():
    with pytest.raises(ValueError, match="sparse must be 'sync' or 'async', got 'eventual'"):
        HybridParallel(Small(), sparse="eventual")
    with pytest.raises(ValueError, match="staleness must be an int >= 0, got -1"):
        HybridParallel(Small(), sparse="async", staleness=-1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        HybridParallel(Small())


# ---- the Trainer on several ranks ---------------------------------------------------------
NCCL_OR_GLOO = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    os.environ.get("VELOCE_TEST_NCCL") != "1" or torch.cuda.device_count() < 2,
    reason="NCCL tests run with VELOCE_TEST_NCCL=1 on 2+ GPUs"))]  # fmt: skip


def _trainer_run(rank, world, batch, strategy, ckpt_dir, device_kind="cpu"):
    from veloce.data import SyntheticClicks
    from veloce.models import DLRM

    torch.manual_seed(0)
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"

    def table(dim):
        return veloce.DynamicEmbedding(dim, mode="sum", optimizer=veloce.optim.Adagrad(lr=0.2), device=device)

    model = DLRM(4, 5, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), embedding_factory=table)
    train = SyntheticClicks(8192, batch_size=batch, num_dense=4, num_sparse=5, id_space=2000, seed=1,
                            rank=rank, world_size=world)  # fmt: skip
    val = SyntheticClicks(4096, batch_size=1024, num_dense=4, num_sparse=5, id_space=2000, seed=1, start=10**7,
                          rank=rank, world_size=world)  # fmt: skip
    trainer = veloce.Trainer(
        model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), metrics={"auc": veloce.metrics.AUC()},
        strategy=strategy, checkpoint_dir=ckpt_dir, checkpoint_every=5, progress=False, max_epochs=2, device=device,
    )  # fmt: skip
    history = trainer.fit(train, val)
    tables = {n: {k: v.cpu() for k, v in m.export().items()} for n, m in model.named_modules()
              if isinstance(m, veloce.DynamicEmbedding)}  # fmt: skip
    return {"history": history, "tables": tables}


@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
def test_trainer_on_two_ranks_equals_one_process(tmp_path, device_kind):
    """Trainer.fit under 2 ranks (sync HybridParallel, checkpoints on; gloo, or NCCL on
    GPUs) == one process on the same global batches of 512 (256 rows a rank): validation
    AUC (gathered over ranks) and the merged tables."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    two = run_ranks(_trainer_run, 2, 512, {"sparse": "sync"}, str(tmp_path / "two"), device_kind, timeout=120,
                    backend=backend)  # fmt: skip
    (one,) = run_ranks(_trainer_run, 1, 512, None, str(tmp_path / "one"), device_kind, timeout=120, backend=backend)
    assert two[0]["history"][-1]["val_auc"] == pytest.approx(one["history"][-1]["val_auc"], abs=1e-6)
    fields = ("epoch", "step", "loss", "samples", "val_auc")
    assert [{k: r[k] for k in fields} for r in two[0]["history"]] == [{k: r[k] for k in fields} for r in two[1]["history"]]
    assert one["history"][-1]["val_auc"] > 0.6
    for name in one["tables"]:
        want = one["tables"][name]
        got = merged([{name: r["tables"][name]} for r in two])[name]
        order = want["keys"].argsort()
        assert torch.equal(got["keys"], want["keys"][order])
        # 32 steps with an Adam-trained MLP: on GPUs the matmuls of a 256-row and a 512-row
        # batch round differently, and that reaches the tables (measured: 1.5e-5 off).
        tol = 1e-4 if device_kind == "cuda" else 1e-5
        torch.testing.assert_close(got["weights"], want["weights"][order], rtol=tol, atol=tol)
    assert veloce.checkpoint.describe(veloce.checkpoint.latest(tmp_path / "two"))["world_size"] == 2


@pytest.mark.parametrize("dedup", [False, True], ids=["parts", "dedup"])
def test_trainer_async_on_two_ranks_trains(tmp_path, dedup):
    """Async sparse mode through the Trainer: it flushes in-flight gradients before every
    evaluation and checkpoint (a checkpoint refuses gradients in flight)."""
    strategy = {"sparse": "async", "staleness": 1, "dedup": dedup}
    two = run_ranks(_trainer_run, 2, 512, strategy, str(tmp_path / "a"), timeout=120)
    assert two[0]["history"][-1]["val_auc"] > 0.6
    assert veloce.checkpoint.latest(tmp_path / "a") is not None


# ---- rows exchanged in a narrower dtype ---------------------------------------------------
class _Conversions(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype conversions (aten._to_copy) of rows of ``dim`` columns: a pass of
    their own over the exchanged rows."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim, self.seen = dim, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dim() == 2 and args[0].shape[1] == self.dim:
            self.seen.append((args[0].dtype, out.dtype, tuple(args[0].shape)))
        return out


def _exchange_dtype_body(rank, world, device_kind, wire, dedup, sparse, tables=1, table_dtype=torch.float32):
    """One step of ``tables`` sum tables (SGD, lr 1) looked up in one exchange over bags of
    one id, ids distinct across ranks: each output row is its id's row rounded to ``wire``,
    and each owner applies its row's gradient (averaged over ranks) rounded to ``wire``,
    exactly. Returns those checks, and the conversions of rows that ran as a pass of their
    own (none where the regroupings convert: several tables, parts)."""
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    dim, n = 16, 64

    def table(k):
        return veloce.DynamicEmbedding(dim, mode="sum", optimizer=veloce.optim.SGD(lr=1.0), seed=7 + k, device=device,
                                       dtype=table_dtype)  # fmt: skip

    embs = [table(k) for k in range(tables)]
    refs = [table(k).eval() for k in range(tables)]  # unsharded: unseen ids give the initial rows
    hp = HybridParallel(nn.ModuleList(embs), dense="none", sparse=sparse, dedup=dedup, exchange_dtype=wire)
    opt = veloce.CombinedOptimizer(None, hp)
    every = (torch.arange(world * n) * 1_000_003 + 11) * (-1) ** torch.arange(world * n)  # distinct ids, both signs
    g = torch.Generator().manual_seed(5)
    grads = [(torch.randn(world * n, dim, generator=g) * 3).to(table_dtype) for _ in range(tables)]
    mine = slice(rank * n, (rank + 1) * n)
    ids, offsets = every[mine].to(device), torch.arange(n, device=device)
    with torch.no_grad():
        init = [ref(every.to(device), torch.arange(world * n, device=device)).cpu() for ref in refs]
    rounded = (lambda t: t.to(wire).to(table_dtype)) if wire is not None else (lambda t: t)  # noqa: E731
    seeds = [gr[mine].to(device) for gr in grads]
    with _Conversions(dim) as conversions:  # the exchange alone: the checks' own conversions come after
        outs = veloce.lookup_many(embs, [(ids, offsets)] * tables)
        sum((o * gr).sum() for o, gr in zip(outs, seeds)).backward()
        opt.step()
        hp.flush()  # async: the update lands
    got = [all(torch.equal(o.detach().cpu(), rounded(i[mine])) for o, i in zip(outs, init))]
    at = {k: i for i, k in enumerate(every.tolist())}
    ok, owns = True, True
    for emb, i, gr in zip(embs, init, grads):
        shard = emb.export()
        rows = torch.tensor([at[k] for k in shard["keys"].tolist()], dtype=torch.long)
        ok = ok and torch.equal(shard["weights"].cpu(), i[rows] - rounded(gr[rows] / world))
        owns = owns and len(shard["keys"]) > 0
    return got + [ok, owns, conversions.seen]


@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
@pytest.mark.parametrize("wire, dedup, sparse, tables, table_dtype", [
    (torch.bfloat16, False, "sync", 1, torch.float32), (torch.float16, False, "sync", 1, torch.float32),
    (torch.bfloat16, True, "sync", 1, torch.float32), (torch.bfloat16, False, "async", 1, torch.float32),
    (None, False, "sync", 1, torch.float32),
    (torch.bfloat16, False, "sync", 3, torch.float32), (torch.bfloat16, False, "async", 3, torch.float32),
    (torch.bfloat16, True, "sync", 3, torch.float32), (torch.float16, False, "sync", 3, torch.float64),
], ids=["bf16", "fp16", "bf16, dedup", "bf16, async", "table dtype", "bf16, 3 tables", "bf16, 3 tables, async",
        "bf16, 3 tables, dedup", "fp16, 3 float64 tables"])  # fmt: skip
def test_rows_travel_in_the_exchange_dtype(wire, dedup, sparse, tables, table_dtype, device_kind):
    """HybridParallel(exchange_dtype=...): partial sums (or, with dedup, rows) and their
    gradients travel rounded to that dtype and come back in the table's; None is exact.
    Several tables share one exchange, whose regroupings narrow and widen the rows (and
    the requester sums the parts into the table's dtype): then no conversion of the rows
    is a pass of its own (checked on gloo, where the ranks run the mode's thread)."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    results = run_ranks(_exchange_dtype_body, 2, device_kind, wire, dedup, sparse, tables, table_dtype, timeout=60,
                        backend=backend)  # fmt: skip
    for rank, (forward, table, owns, conversions) in enumerate(results):
        assert forward, f"rank {rank}: the lookup's rows are not the initial rows rounded to {wire}"
        assert table, f"rank {rank}: the table after one step is not init - (gradient / 2) rounded to {wire}"
        assert owns, f"rank {rank} owns no row"
        if tables > 1 and not dedup and wire is not None and device_kind == "cpu":
            assert conversions == [], f"rank {rank}: rows converted in passes of their own: {conversions}"


def _exchange_dtype_close(rank, world, wire, name, dedup, prefetch):
    model = Small() if name == "small" else Grouped()
    hp = HybridParallel(model, sparse="sync", dedup=dedup, exchange_dtype=wire,
                        lookup_errors="raise_next" if prefetch else "raise")  # fmt: skip
    preds = train(hp, make_opt(hp), world, rank, prefetch=prefetch)
    return {"preds": preds, "tables": tables_of(model, "ab" if name == "small" else "abcd")}


# Bounds on predictions and table weights, about 4-10x the largest differences measured
# over the 20 steps (small: bf16 9.3e-5 / 2.4e-3, fp16 8.6e-6 / 2.5e-5; grouped, parts bf16
# 5.7e-3 / 1.7e-2, dedup bf16 5.0e-4 / 1.5e-3). They grow with the steps (Adam normalises
# the rounded gradients), from about 5e-6 after the first.
@pytest.mark.parametrize("name, wire, dedup, prefetch, bounds", [
    ("small", torch.bfloat16, False, False, (1e-3, 1e-2)), ("small", torch.float16, False, False, (1e-4, 2e-4)),
    ("small", torch.bfloat16, False, True, (1e-3, 1e-2)), ("grouped", torch.bfloat16, False, False, (3e-2, 8e-2)),
    ("grouped", torch.bfloat16, True, False, (5e-3, 1e-2)),
], ids=["bf16", "fp16", "bf16, prefetch", "grouped, bf16", "grouped, bf16, dedup"])  # fmt: skip
def test_narrow_exchange_trains_close_to_one_process(name, wire, dedup, prefetch, bounds):
    """20 steps with rows exchanged in 16 bits: the small model (uneven and empty batches,
    prefetched or not) and the grouped one (mean with padding, per-sample weights with a
    gradient, Adam / Adagrad / RowWiseAdagrad): predictions and tables stay within the
    16-bit rounding's drift from the exact run."""
    results = run_ranks(_exchange_dtype_close, 2, wire, name, dedup, prefetch, timeout=90)
    model = Small() if name == "small" else Grouped()
    ref = {"preds": train(model, make_opt(model), 1, 0), "tables": tables_of(model, "ab" if name == "small" else "abcd")}
    for step in range(STEPS):
        got = torch.cat([r["preds"][step] for r in results])
        torch.testing.assert_close(got, ref["preds"][step], rtol=0, atol=bounds[0], msg=f"predictions of step {step}")
    got = merged([r["tables"] for r in results])
    for name, want in ref["tables"].items():
        order = want["keys"].argsort()
        assert torch.equal(got[name]["keys"], want["keys"][order]), f"table {name}: keys differ"
        torch.testing.assert_close(got[name]["weights"], want["weights"][order], rtol=0, atol=bounds[1])


def _float16_overflow(rank, world, nonfinite):
    emb = veloce.DynamicEmbedding(4, mode="sum", nonfinite_grad=nonfinite)
    hp = HybridParallel(nn.ModuleList([emb]), dense="none", exchange_dtype=torch.float16)
    opt = veloce.CombinedOptimizer(None, hp)
    (emb(torch.tensor([[1], [2], [3]])).sum() * 1e6).backward()  # 5e5 per rank's share: past float16
    try:
        opt.step()
        if nonfinite == "raise_next":
            opt.step()  # the check of the last step is read here
    except FloatingPointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("nonfinite", ["raise", "raise_next"])
def test_a_float16_overflow_names_the_exchange_dtype(nonfinite):
    """Gradients past float16's range on the way to their owners: the NaN/Inf error says
    so and names bfloat16, on every rank."""
    for msg in run_ranks(_float16_overflow, 2, nonfinite, timeout=60):
        assert "NaN or Inf" in msg and "exchange_dtype=torch.float16" in msg and "bfloat16" in msg, msg


def test_wire_dtype_is_narrower_or_none():
    from veloce.distributed._comm import wire_dtype

    assert wire_dtype(torch.bfloat16, torch.float32) is torch.bfloat16
    assert wire_dtype(torch.float16, torch.float32) is torch.float16
    assert wire_dtype(None, torch.float32) is None
    for table in (torch.bfloat16, torch.float16):  # 16-bit tables send their own dtype
        assert wire_dtype(torch.bfloat16, table) is None and wire_dtype(torch.float16, table) is None


@pytest.mark.parametrize("bad", ["int8", torch.int32, torch.float64, torch.float32, "float32", 16, "fp8", "BF16"])
def test_exchange_dtype_refuses_what_it_cannot_send(bad):
    from veloce.distributed.hybrid import _exchange_dtype

    with pytest.raises(ValueError, match=r"exchange_dtype must be None .*got " + re.escape(repr(bad))):
        _exchange_dtype(bad)
    assert _exchange_dtype("bf16") is torch.bfloat16 and _exchange_dtype(None) is None
    assert _exchange_dtype(torch.float16) is torch.float16 and _exchange_dtype("table") is None


# ---- agreement between ranks -------------------------------------------------------------
def ids_owned_by(owner: int, world: int, n: int) -> list[int]:
    ids = torch.arange(1, 64 * n * world + 1)
    return ids[owner_of(ids, world) == owner][:n].tolist()


def _nan_on_one_owner(rank, world, device_kind="cpu"):
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device)
    HybridParallel(nn.Sequential(emb), dense="none")
    out = emb(torch.tensor([[ids_owned_by(1, world, 1)[0]]], device=device))
    (out * (float("nan") if rank == 0 else 1.0)).sum().backward()  # only rank 1 receives the NaN
    try:
        emb.step()
    except FloatingPointError as e:
        return str(e)
    return "stepped"


@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
def test_nonfinite_gradient_raises_on_every_rank(device_kind):
    backend = "nccl" if device_kind == "cuda" else "gloo"
    for msg in run_ranks(_nan_on_one_owner, 2, device_kind, timeout=60, backend=backend):
        assert "over all ranks" in msg and "1 bag(s) holds NaN or Inf" in msg


def _nan_on_one_owner_raise_next(rank, world, device_kind="cpu"):
    """nonfinite_grad="raise_next" with a NaN reaching only rank 1's shard: no rank raises
    in that step(); every rank raises in the next one, and no rank counts the bad step."""
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device, nonfinite_grad="raise_next")
    HybridParallel(nn.Sequential(emb), dense="none")
    x = torch.tensor([[ids_owned_by(1, world, 1)[0]]], device=device)
    (emb(x) * (float("nan") if rank == 0 else 1.0)).sum().backward()
    emb.step()
    emb.zero_grad()
    emb(x).sum().backward()
    try:
        emb.step()
    except FloatingPointError as e:
        return str(e), emb.step_count
    return "stepped", emb.step_count


@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
def test_nonfinite_gradient_raise_next_raises_on_every_rank_one_step_later(device_kind):
    backend = "nccl" if device_kind == "cuda" else "gloo"
    for msg, steps in run_ranks(_nan_on_one_owner_raise_next, 2, device_kind, timeout=60, backend=backend):
        assert "previous step()" in msg and steps == 0


def _async_flush_after_a_failed_step(rank, world):
    """Async mode, "raise_next": a NaN gradient (sent by rank 0) fails the owners' check at
    the step that applies it; flush() then raises on every rank before moving anything, and
    the next flush() applies what is still in flight, leaving nothing pending."""
    emb = veloce.DynamicEmbedding(4, mode="sum", nonfinite_grad="raise_next", seed=5)
    hp = HybridParallel(nn.Sequential(emb), sparse="async", staleness=1, dense="none")
    x = torch.tensor([[ids_owned_by(0, world, 1)[0], ids_owned_by(1, world, 1)[0]]])
    out = []
    for scale in (1.0, float("nan") if rank == 0 else 1.0, 1.0):
        (emb(x) * scale).sum().backward()
        emb.step()  # applies the gradients sent one step earlier (the NaN ones at the third step)
        emb.zero_grad()
    try:
        hp.flush()
        out.append("flushed")
    except FloatingPointError as e:
        out.append("previous step()" in str(e))
    hp.flush()
    out += [emb.backend.in_flight, len(emb._pending), emb.step_count]
    return out


def test_async_flush_after_a_failed_raise_next_step():
    for got in run_ranks(_async_flush_after_a_failed_step, 2, timeout=60):
        assert got == [True, 0, 0, 2], got


def _adam_intermittent(rank, world, batches):
    emb = veloce.DynamicEmbedding(2, mode="sum", optimizer=veloce.optim.Adam(lr=0.1), seed=3)
    HybridParallel(nn.Sequential(emb), dense="none")
    for b in batches:
        emb(torch.tensor([b[rank]])).sum().backward()
        emb.step()
        emb.zero_grad()
    return emb.step_count, {k: v for k, v in emb.export().items() if k != "step"}


def test_adam_step_count_is_global_when_a_shard_gets_no_gradient():
    """Step 1 touches only rank 0's rows, step 2 only rank 1's: every shard still counts
    both steps (Adam's bias correction), as one process does."""
    a0, a1 = ids_owned_by(0, 2, 2), ids_owned_by(1, 2, 2)
    batches = [[[a0[0]], [a0[1]]], [[a1[0]], [a1[1]]]]
    results = run_ranks(_adam_intermittent, 2, batches, timeout=60)
    emb = veloce.DynamicEmbedding(2, mode="sum", optimizer=veloce.optim.Adam(lr=0.1), seed=3)
    for b in batches:
        (emb(torch.tensor([b[0], b[1]])).sum() / 2).backward()  # the global mean of the two ranks
        emb.step()
        emb.zero_grad()
    assert [r[0] for r in results] == [2, 2] == [emb.step_count] * 2
    got = merged([{"t": r[1]} for r in results])["t"]
    want = emb.export()
    order = want["keys"].argsort()
    torch.testing.assert_close(got["weights"], want["weights"][order], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["optimizer_state"], want["optimizer_state"][order], rtol=1e-6, atol=1e-6)


def _grouped_differently(rank, world):
    a, b = veloce.DynamicEmbedding(4, mode="sum"), veloce.DynamicEmbedding(4, mode="sum")
    HybridParallel(nn.ModuleList([a, b]), dense="none")
    x = torch.tensor([[1, 2]])
    try:
        veloce.lookup_many([a, b], [x, x]) if rank == 0 else [a(x), b(x)]
    except ExchangeError as e:
        return str(e)
    return "looked up"


def test_ranks_grouping_tables_differently_raise_on_every_rank():
    for rank, msg in enumerate(run_ranks(_grouped_differently, 2, timeout=60)):
        assert f"rank {1 - rank} sent signature" in msg and "grouped the same way" in msg


def _uneven_model(device):
    from veloce.models import DLRM

    torch.manual_seed(0)
    return DLRM(2, 2, embedding_dim=4, bottom_mlp=(4,), top_mlp=(4, 1),
                embedding_factory=lambda dim: veloce.DynamicEmbedding(dim, mode="sum", device=device))  # fmt: skip


def _uneven_data():
    """(batches of one process, each rank's batches) for training and validation: step k's
    batches of the ranks, concatenated, are one process's batch k. Training: rank 0 has 3
    batches, rank 1 one; validation: rank 0 none, rank 1 two."""
    from veloce.data import SyntheticClicks

    ds = SyntheticClicks(10**6, num_dense=2, num_sparse=2, id_space=50, seed=3)
    rows = lambda lo, hi: ds.samples(lo, hi)  # noqa: E731
    train = {0: [rows(0, 8), rows(16, 24), rows(24, 29)], 1: [rows(8, 16)]}
    val = {0: [], 1: [rows(100, 120), rows(120, 133)]}
    return ([rows(0, 16), rows(16, 24), rows(24, 29)], [rows(100, 120), rows(120, 133)]), (train, val)


def _uneven_batch_counts(rank, world, device_kind, sparse):
    import warnings

    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    model = _uneven_model(device)
    _, (train, val) = _uneven_data()
    strategy = {"sparse": sparse, "staleness": 1} if sparse == "async" else {"sparse": sparse}
    trainer = veloce.Trainer(model, strategy=strategy, progress=False, max_epochs=2, device=device,
                             metrics={"auc": veloce.metrics.AUC(), "logloss": veloce.metrics.LogLoss()})  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(train[rank], val_loader=val[rank])
    in_flight = sum(m.backend.in_flight for m in model.modules() if isinstance(m, veloce.DynamicEmbedding))
    return history, trainer.global_step, in_flight, [str(w.message) for w in caught]


@pytest.mark.parametrize("sparse", ["sync", "async"])
@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
def test_ranks_with_different_batch_counts_train_every_batch_like_one_process(device_kind, sparse):
    """Rank 0's loader has 3 batches, rank 1's one; for validation rank 0 has none and rank 1
    two. The ranks step together until both are done (rank 1, then rank 0, runs zero-row
    batches meanwhile): no batch is dropped, nothing warns, evaluation does not hang, and
    no async gradient is left in flight when fit returns. With sync sparse updates, each
    rank's loss weighted by its share of the step's samples, the run equals one process
    on the concatenated batches: same epoch loss over 29 samples, same validation
    metrics over all 33 validation samples."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    results = run_ranks(_uneven_batch_counts, 2, device_kind, sparse, timeout=60, backend=backend)
    (one_train, one_val), _ = _uneven_data()
    ref = veloce.Trainer(_uneven_model("cpu"), progress=False, max_epochs=2,
                         metrics={"auc": veloce.metrics.AUC(), "logloss": veloce.metrics.LogLoss()})  # fmt: skip
    want = ref.fit(one_train, val_loader=one_val)
    for history, steps, in_flight, warned in results:
        assert steps == 6 and in_flight == 0 and not warned
        assert [r["samples"] for r in history] == [29, 29] and [r["step"] for r in history] == [3, 6]
        if sparse == "sync":
            fields = ("loss", "val_auc", "val_logloss")
            for got, expected in zip(history, want):
                assert {k: got[k] for k in fields} == pytest.approx({k: expected[k] for k in fields}, abs=1e-6)


def _insert_foreign(rank, world):
    emb = veloce.DynamicEmbedding(4, mode="sum")
    HybridParallel(nn.Sequential(emb), dense="none")
    mine, theirs = ids_owned_by(rank, world, 2), ids_owned_by(1 - rank, world, 1)
    emb.insert(torch.tensor(mine), torch.ones(2, 4))
    try:
        emb.insert(torch.tensor(mine + theirs), torch.ones(3, 4))
    except ValueError as e:
        return len(emb), str(e)
    return len(emb), None


def test_insert_on_a_shard_refuses_ids_of_other_ranks():
    for rank, (size, msg) in enumerate(run_ranks(_insert_foreign, 2, timeout=60)):
        assert size == 2 and msg is not None
        assert "ids[2] = " in msg and f"belongs to rank {1 - rank}, not to this rank ({rank})" in msg


def _one_rank_fails(rank, world, case, grouped):
    a = veloce.DynamicEmbedding(4, mode="sum", max_capacity=32, eviction="none")
    b = veloce.DynamicEmbedding(4, mode="sum")
    HybridParallel(nn.ModuleList([a, b]), dense="none")
    x = torch.tensor([[1], [2]])
    xa = xb = x
    if case == "bad input" and rank == 0:
        xa = xb = x.float()  # only rank 0 passes bad input
    if case == "full table":  # rank 0 asks for more new ids than rank 1's shard may hold
        xa = xb = torch.tensor(ids_owned_by(1, world, 40)).view(-1, 1) if rank == 0 else x
    # Bad offsets on rank 0, checked on the device and read back with the exchange's header:
    # past the end (the concatenated layout of the tables is bad too), or (second table) not
    # starting at 0, which only the per-table check finds.
    flat = torch.tensor([1, 2, 3])
    if case == "offsets past the end":
        xa = xb = (flat, torch.tensor([0, 5] if rank == 0 else [0, 2]))
    if case == "offsets not from 0":
        xa, xb = (flat, torch.tensor([0, 2])), (flat, torch.tensor([1, 2] if rank == 0 else [0, 2]))
    if case == "lookup fails" and rank == 0:  # an owner's lookup fails after its inserts (e.g. out of memory)
        from veloce.distributed import owner

        def failing_serve(*args):
            raise RuntimeError("simulated: out of memory in the owner's lookup")

        owner.serve_all = failing_serve
    try:
        veloce.lookup_many([a, b], [xa, xb]) if grouped else (a(*xb) if isinstance(xb, tuple) else a(xb))
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.parametrize("grouped", [False, True], ids=["one table", "lookup_many"])
@pytest.mark.parametrize("case", ["bad input", "full table", "offsets past the end", "offsets not from 0",
                                  "lookup fails"])  # fmt: skip
def test_an_error_on_one_rank_stops_every_rank(case, grouped):
    """Bad input on one rank, or a full table on one owner, raises there and an
    ExchangeError on the others, instead of leaving them waiting in the exchange."""
    (t0, m0), (t1, m1) = run_ranks(_one_rank_fails, 2, case, grouped, timeout=60)
    if case == "bad input":
        assert t0 == "TypeError" and "input must hold int64" in m0
        assert t1 == "ExchangeError" and "rank 0 could not take part" in m1
    elif case.startswith("offsets"):
        want = r"offsets\[-1\] = 5 is past the end" if case.endswith("end") else "offsets must start at 0"
        assert t0 == "ValueError" and re.search(want, m0), m0
        assert t1 == "ExchangeError" and "rank 0 could not take part" in m1
    elif case == "lookup fails":
        assert t0 == "RuntimeError" and "simulated" in m0
        assert t1 == "ExchangeError" and "failed on 1 other rank(s)" in m1
    else:
        assert t1 == "TableFullError" and "eviction='none'" in m1
        assert t0 == "ExchangeError" and "failed on 1 other rank(s)" in m0


def _owner_fails_deferred(rank, world, case, where, device_kind="cpu"):
    """lookup_errors="raise_next": an owner fails in a forward; the forward returns on every
    rank, and every rank raises at `where` (nothing of the step applied), then trains on."""
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    torch.manual_seed(0)
    a = veloce.DynamicEmbedding(4, mode="sum", max_capacity=32, eviction="none", device=device)
    b = veloce.DynamicEmbedding(4, mode="sum", device=device)
    lin = nn.Linear(4, 1).to(device)
    hp = HybridParallel(nn.ModuleList([a, b, lin]), dense="none", lookup_errors="raise_next")
    opt = veloce.CombinedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), hp)
    x = torch.tensor([[1], [2]], device=device)
    ok = x
    if case == "full table":  # rank 0 asks for more new ids than rank 1's shard of `a` may hold
        x = torch.tensor(ids_owned_by(1, world, 40), device=device).view(-1, 1) if rank == 0 else x
    veloce.lookup_many([a, b], [ok, ok])[0].sum().backward()  # a step that works, pending
    if case == "lookup fails" and rank == 0:
        from veloce.distributed import owner

        real = owner.serve_all

        def failing_serve(*args):
            owner.serve_all = real  # fails once
            raise RuntimeError("simulated: out of memory in the owner's lookup")

        owner.serve_all = failing_serve
    before = ([t.export() for t in (a, b)], [p.detach().clone() for p in lin.parameters()], a.step_count)
    pa, pb = veloce.lookup_many([a, b], [x, x])  # returns on every rank
    (lin(pa + pb).sum()).backward()
    # The failed owner served zeros for both tables (its insert op or lookup serves them
    # together): exactly the rows of the ids it owns are zero.
    failed = 1 if case == "full table" else 0
    owned = owner_of(x.view(-1).cpu(), world) == failed
    got = [all(torch.equal((p == 0).all(1).cpu(), owned) for p in (pa, pb))]
    try:
        if where == "step":
            opt.step()
        elif where == "lookup":
            veloce.lookup_many([a, b], [ok, ok])
        elif where == "unwrap":
            hp.unwrap()  # raises first: the model stays wrapped
        else:
            hp.flush()
        got.append(("none", ""))
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        got.append((type(e).__name__, str(e)))
    after = ([t.export() for t in (a, b)], [p.detach() for p in lin.parameters()], a.step_count)
    same = before[2] == after[2] and all(torch.equal(p, q) for p, q in zip(before[1], after[1]))
    for e0, e1 in zip(before[0], after[0]):  # every row there before: its weights and state untouched
        at = {k: i for i, k in enumerate(e1["keys"].tolist())}
        rows = torch.tensor([at[k] for k in e0["keys"].tolist()], dtype=torch.long)
        same = same and torch.equal(e0["weights"], e1["weights"][rows])
        same = same and torch.equal(e0["optimizer_state"], e1["optimizer_state"][rows])
    got.append(same)
    # Raised once: the ranks go on training together.
    opt.zero_grad()
    veloce.lookup_many([a, b], [ok, ok])[0].sum().backward()
    opt.step()
    got.append(a.step_count)
    return got


@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
@pytest.mark.parametrize("where", ["step", "lookup", "flush", "unwrap"])
@pytest.mark.parametrize("case", ["full table", "lookup fails"])
def test_a_deferred_owner_failure_raises_on_every_rank_at_the_next_step(case, where, device_kind):
    """HybridParallel(lookup_errors="raise_next"): an owner's failure (a full table, a
    failed lookup) does not stop the forward; every rank raises at its next step(), lookup,
    flush() or unwrap(): the failed owner its own error, the others ExchangeError, before
    anything of the step (dense or sparse) is applied. Then training goes on without a hang."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    results = run_ranks(_owner_fails_deferred, 2, case, where, device_kind, timeout=90, backend=backend)
    failed = 1 if case == "full table" else 0
    for rank, (zeros_where_failed, (kind, msg), unchanged, steps) in enumerate(results):
        assert zeros_where_failed, rank
        if rank == failed:
            want = ("TableFullError", "eviction='none'") if case == "full table" else ("RuntimeError", "simulated")
            assert kind == want[0] and want[1] in msg, (rank, kind, msg)
        else:
            assert kind == "ExchangeError" and "failed on 1 other rank(s)" in msg, (rank, kind, msg)
        assert unchanged, rank  # nothing of the failed step applied: tables, dense parameters, step count
        assert steps == 1, rank  # the next step works (the failed one was not counted)


def _model_prefetched(rank, world, name, prefetch, device_kind, sparse="sync", at="step"):
    """``at``: where the next batch is prefetched: after "step", "backward", or "forward"
    (the last with prefetch_depth="header")."""
    from veloce.models import DLRM, DeepFM

    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    torch.manual_seed(0)

    def table(dim):  # small: the tables grow while prefetched
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=16, device=device)

    cls = DLRM if name == "DLRM" else DeepFM
    model = cls(2, 3, embedding_dim=4, **({"bottom_mlp": (4,), "top_mlp": (4, 1)} if name == "DLRM" else {}),
                embedding_factory=table).to(device)  # fmt: skip
    hp = HybridParallel(model, sparse=sparse, lookup_errors="raise_next",
                        prefetch_depth="header" if at == "forward" else "inserts")  # fmt: skip
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), hp)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 2, generator=g), torch.randint(0, 200, (8, 3), generator=g)) for _ in range(6)]
    preds = []
    from veloce.distributed import input_dist

    begin, calls = input_dist.begin_dispatch, []  # every first half starts there (prefetched or in its forward)
    input_dist.begin_dispatch = lambda *a, **k: calls.append(1) or begin(*a, **k)
    if prefetch:
        hp.prefetch(*batches[0])  # on the CPU, as a loader yields them
    for i, (dense, sparse) in enumerate(batches):
        out = hp(dense.to(device), sparse.to(device))
        if prefetch and at == "forward" and i + 1 < len(batches):
            hp.prefetch(*batches[i + 1])
        out.square().mean().backward()
        # at="backward": the next batch's inserts run before this step's update is queued (the
        # update finds rows moved by a growth by their ids), beside the backward's tail.
        if prefetch and at == "backward" and i + 1 < len(batches):
            hp.prefetch(*batches[i + 1])
        opt.step()
        opt.zero_grad()
        if prefetch and at == "step" and i + 1 < len(batches):
            hp.prefetch(*batches[i + 1])
        preds.append(out.detach().cpu())
    hp.flush()
    input_dist.begin_dispatch = begin
    groups = 1 if name == "DLRM" else 2  # DeepFM looks its embeddings and first-order weights up apart
    assert len(calls) == groups * len(batches), len(calls)  # each first half once: prefetched ones were taken
    tables = {n: {k: v.cpu() for k, v in m.export().items()} for n, m in model.named_modules()
              if isinstance(m, veloce.DynamicEmbedding)}  # fmt: skip
    return preds, tables


@pytest.mark.parametrize("device_kind", NCCL_OR_GLOO)
@pytest.mark.parametrize("name, sparse, at", [
    ("DLRM", "sync", "step"), ("DeepFM", "sync", "step"), ("DLRM", "sync", "backward"), ("DeepFM", "async", "backward"),
    ("DLRM", "sync", "forward"), ("DeepFM", "async", "forward"),
])  # fmt: skip
def test_prefetched_training_equals_training_without(name, sparse, at, device_kind):
    """HybridParallel.prefetch with veloce.models (one exchange of 3 tables, or two), called
    after step() or after backward(), in sync or async mode: the same predictions and
    tables, bit for bit, as without it, while the tables grow."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    runs = [run_ranks(_model_prefetched, 2, name, p, device_kind, sparse, at, timeout=90, backend=backend)
            for p in (False, True)]  # fmt: skip
    for (p0, t0), (p1, t1) in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
        for n in t0:
            o0, o1 = t0[n]["keys"].argsort(), t1[n]["keys"].argsort()
            assert t0[n]["keys"].numel() > 16  # grown
            for k in ("keys", "weights", "optimizer_state"):
                assert torch.equal(t0[n][k][o0], t1[n][k][o1]), (n, k)


def _prefetch_misuse(rank, world, case, depth):
    model = Small()
    hp = HybridParallel(model, dedup=case == "dedup", prefetch_depth=depth)
    inputs, _ = rank_slice(global_batch(0), 6 * rank, 6 * rank + 6)
    try:
        if case == "no sparse_lookups":
            HybridParallel(nn.ModuleList([veloce.DynamicEmbedding(4)])).prefetch(torch.tensor([[1]]))
        if case == "bad input" and rank == 0:
            inputs = (*inputs[:4], inputs[4].float())  # only rank 0's, of the second table
        hp.prefetch(*inputs)
        if case == "bad input":  # with depth "header", rank 1 learns of it in its forward's header
            hp(*inputs)
        if case == "two ahead":
            hp.prefetch(*inputs)
        if case == "two ahead, bad input on one rank":  # the misuse is found first, on every rank
            hp.prefetch(*((inputs[0], inputs[1].float(), *inputs[2:]) if rank == 0 else inputs))  # the first table's
        if case == "table changed":  # between prefetch and forward: the prefetched slots are stale
            model.a.table.resize(model.a.table.capacity * 2)  # (with depth "header", nothing was inserted yet)
            hp(*inputs)
        if case == "other shapes":
            hp(*rank_slice(global_batch(0), 4 * rank, 4 * rank + 4)[0])
        elif case == "eval":
            hp.eval()
            hp(*inputs)
    except (TypeError, ValueError, ExchangeError) as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.parametrize("depth", ["inserts", "header"])
@pytest.mark.parametrize("case", ["no sparse_lookups", "dedup", "other shapes", "eval", "bad input", "two ahead",
                                  "two ahead, bad input on one rank", "table changed"])  # fmt: skip
def test_prefetch_misuse_raises_on_every_rank(case, depth):
    want = {
        "no sparse_lookups": ("TypeError", "has no sparse_lookups"),
        "dedup": ("ValueError", "not available with dedup=True"),
        "other shapes": ("ValueError", "differ in shape"),
        "eval": ("ValueError", "is not the one prefetched next"),
        "two ahead": ("ValueError", "already have a prefetched lookup that no forward has taken"),
        "two ahead, bad input on one rank": ("ValueError", "already have a prefetched lookup that no forward has taken"),
        "table changed": ("ValueError", "changed between prefetch and this forward") if depth == "inserts" else ("ok", ""),
    }.get(case)
    for rank, (kind, msg) in enumerate(run_ranks(_prefetch_misuse, 2, case, depth, timeout=60)):
        if case == "bad input":  # rank 0's own error; rank 1 learns of it in the prefetch's exchange
            want = ("TypeError", "input must hold int64") if rank == 0 else ("ExchangeError", "could not take part")
        assert kind == want[0] and want[1] in msg, (rank, kind, msg)


class _OneTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = veloce.DynamicEmbedding(4, mode="sum", seed=3)
        self.w = nn.Linear(4, 1)

    def forward(self, ids):
        return self.w(self.a(ids)).squeeze(1)

    def sparse_lookups(self, ids):
        return [([self.a], [ids])]


def _one_rank_forwards_other_inputs(rank, world, lookup_errors, one_lookup):
    model = _OneTable() if one_lookup else Small()
    hp = HybridParallel(model, lookup_errors=lookup_errors)
    opt = make_opt(hp)
    if one_lookup:
        inputs = (torch.arange(6).view(3, 2) + 10 * rank,)
    else:
        inputs, _ = rank_slice(global_batch(0), 6 * rank, 6 * rank + 6)
    hp.prefetch(*inputs)
    if rank == 0:  # only rank 0 passes other inputs to the forward than it prefetched
        inputs = (torch.arange(4).view(2, 2),) if one_lookup else rank_slice(global_batch(0), 0, 4)[0]
    where = "forward"
    try:
        hp(*inputs).sum().backward()
        where = "step"
        opt.step()
    except (ValueError, ExchangeError) as e:
        return where, type(e).__name__, str(e)
    return where, "ok", ""


@pytest.mark.parametrize("lookup_errors, one_lookup", [("raise", False), ("raise_next", False), ("raise_next", True)],
                         ids=["raise", "raise_next, two lookups", "raise_next, one lookup"])  # fmt: skip
def test_a_prefetch_mismatch_on_one_rank_raises_on_every_rank(lookup_errors, one_lookup):
    """Rank 0's forward is given inputs of other shapes than it prefetched; rank 1's are
    right. Rank 0 still takes part in every collective: every rank raises, none waits: in
    the forward ("raise"; or "raise_next" at the model's next lookup), or at step()
    ("raise_next" with one lookup: rank 0's forward goes on with zeros, its backward sends
    zeros, and nothing is applied)."""
    results = run_ranks(_one_rank_forwards_other_inputs, 2, lookup_errors, one_lookup, timeout=60)
    where = "step" if one_lookup else "forward"
    (w0, k0, m0), (w1, k1, m1) = results
    assert (w0, k0) == (where, "ValueError") and "differ in shape" in m0, results[0]
    assert (w1, k1) == (where, "ExchangeError") and "failed on 1 other rank(s)" in m1, results[1]


class _WeightedTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = veloce.DynamicEmbedding(4, mode="sum", seed=3)
        self.w = nn.Linear(4, 1)

    def forward(self, ids, offsets, psw):
        return self.w(self.a(ids, offsets, per_sample_weights=psw)).squeeze(1)

    def sparse_lookups(self, ids, offsets, psw):
        return [([self.a], [(ids, offsets, psw)])]


def _prefetched_then_other(rank, world, lookup_errors, case):
    hp = HybridParallel(_WeightedTable(), lookup_errors=lookup_errors)
    opt = make_opt(hp)
    ids, offsets, psw = torch.arange(6) + 10 * rank, torch.tensor([0, 2, 4]), torch.rand(6, requires_grad=True)
    hp.prefetch(ids, offsets, psw)
    if rank == 0:  # rank 0's forward is given other input than it prefetched
        if case == "weights without grad":  # the other ranks' backward exchanges weight gradients: so must it
            ids, offsets, psw = ids[:4], offsets[:2], torch.rand(4)
        elif case == "no weights":
            ids, offsets, psw = ids[:4], offsets[:2], None
        else:  # bad input: its check fails before any exchange
            psw = psw[:5]
    out = []
    for attempt in ("forward", "step", "again"):  # then the ranks train on together
        try:
            if attempt == "step":
                opt.step()
            else:
                hp(ids, offsets, psw).sum().backward()
            out.append("ok")
        except (ValueError, ExchangeError) as e:
            out.append(f"{type(e).__name__}: {e}")
            opt.zero_grad()
            ids, offsets, psw = torch.arange(6) + 10 * rank, torch.tensor([0, 2, 4]), torch.rand(6)
    return out


@pytest.mark.parametrize("lookup_errors, case", [
    ("raise_next", "weights without grad"), ("raise_next", "no weights"), ("raise", "bad input"),
])  # fmt: skip
def test_a_refused_prefetch_keeps_every_collective(lookup_errors, case):
    """A rank whose forward cannot take its prefetched exchange still runs what the others
    run (the per-sample weights' gradient exchange in backward too, which the prefetched
    signature asked for), then every rank raises together and the ranks train on."""
    (r0, r1) = run_ranks(_prefetched_then_other, 2, lookup_errors, case, timeout=60)
    if lookup_errors == "raise":
        assert r0[0].startswith("ValueError: per_sample_weights must have shape") and r0[1:] == ["ok", "ok"], r0
        assert r1[0].startswith("ExchangeError") and r1[1:] == ["ok", "ok"], r1
    else:
        assert r0[0] == "ok" and "differ in shape" in r0[1] and r0[2] == "ok", r0
        assert r1[0] == "ok" and r1[1].startswith("ExchangeError") and r1[2] == "ok", r1


class _LearnedWeights(_WeightedTable):
    """Per-sample weights computed by the model from a parameter: they require grad."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids, offsets, psw):
        return super().forward(ids, offsets, psw * self.scale)

    def sparse_lookups(self, ids, offsets, psw):
        return super().sparse_lookups(ids, offsets, psw * self.scale)


def _learned_weights(rank, world, prefetch):
    torch.manual_seed(0)
    model = _LearnedWeights()
    hp = HybridParallel(model, lookup_errors="raise_next")
    opt = make_opt(hp)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, 50, (6,), generator=g), torch.tensor([0, 2, 4]), torch.rand(6, generator=g))
               for _ in range(4)]  # fmt: skip
    outs = []
    for i, b in enumerate(batches):
        if prefetch:
            hp.prefetch(*b)
        out = hp(*b)
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs, model.scale.detach().clone()


def test_prefetch_with_per_sample_weights_the_model_computes():
    """Weights that require grad (computed from a parameter, in sparse_lookups as in
    forward): the prefetched exchange matches the forward's, and training equals training
    without prefetch, the weights' parameter included."""
    base, pre = (run_ranks(_learned_weights, 2, p, timeout=60) for p in (False, True))
    for (o0, s0), (o1, s1) in zip(base, pre):
        assert all(torch.equal(a, b) for a, b in zip(o0, o1)) and torch.equal(s0, s1)
        assert not torch.equal(s0, torch.ones(1))  # the weights' parameter learned


def _async_failure(rank, world):
    a = veloce.DynamicEmbedding(4, mode="sum", max_capacity=32, eviction="none", seed=5)
    hp = HybridParallel(nn.ModuleList([a]), sparse="async", staleness=1, dense="none", lookup_errors="raise_next")
    mine = torch.tensor(ids_owned_by(0, world, 2)).view(-1, 1)  # rows of rank 0, which does not fail
    a(mine).sum().backward()
    a.step()  # applied one step late: by the flush
    a.zero_grad()
    hp.flush()  # nothing in flight
    full = torch.tensor(ids_owned_by(1, world, 40)).view(-1, 1) if rank == 0 else mine
    (a(torch.cat([mine, full])).sum()).backward()  # rank 1's shard is too small: it fails
    try:
        a.step()
        got = "none"
    except Exception as e:  # noqa: BLE001
        got = type(e).__name__
    a.zero_grad()
    before = a.export()["weights"].clone()
    for _ in range(3):  # nothing of the failed step is applied later, in flight or not
        a.step()
    hp.flush()
    return got, torch.equal(before, a.export()["weights"])


def test_a_deferred_failure_drops_the_async_gradients_in_flight():
    (g0, same0), (g1, same1) = run_ranks(_async_failure, 2, timeout=60)
    assert (g0, g1) == ("ExchangeError", "TableFullError")
    assert same0 and same1


def _many_tables(rank, world, counts):
    """rank r looks up counts[r] tables of dim 2 together; returns the pooled rows (or the
    error) and the shards' exported keys."""
    torch.manual_seed(0)
    tables = [veloce.DynamicEmbedding(2, mode="sum", seed=k) for k in range(max(counts))]
    HybridParallel(nn.ModuleList(tables), dense="none")
    mine = tables[: counts[rank]]
    ids = torch.arange(8).view(4, 2) + 100 * rank
    try:
        outs = veloce.lookup_many(mine, [ids + 1000 * k for k in range(len(mine))])
    except ExchangeError as e:
        return str(e)
    return [o.detach() for o in outs]


def test_lookup_of_more_tables_than_the_header_holds():
    """40 tables need 82 size fields: more than the fixed-width header carries, so they
    follow in a second all-to-all; the result is still that of one process."""
    results = run_ranks(_many_tables, 2, [40, 40], timeout=60)
    for rank, outs in enumerate(results):
        assert len(outs) == 40
        for k, o in enumerate(outs):
            ref = veloce.DynamicEmbedding(2, mode="sum", seed=k)
            torch.testing.assert_close(o, ref(torch.arange(8).view(4, 2) + 100 * rank + 1000 * k))


def test_ranks_disagreeing_on_the_number_of_tables_raise_not_hang():
    """Rank 0 sends its sizes with the header (2 tables), rank 1 needs a second round (40):
    the headers have one width, so both see the other's signature and raise."""
    for rank, msg in enumerate(run_ranks(_many_tables, 2, [2, 40], timeout=60)):
        assert isinstance(msg, str) and f"rank {1 - rank} sent signature" in msg


def _local_table_fails(rank, world):
    """A local (unsharded) table and a sharded one in one lookup_many; rank 0's input to
    the local table is bad."""
    local = veloce.DynamicEmbedding(2, mode="sum", per_rank=True)
    sharded = veloce.DynamicEmbedding(2, mode="sum")
    HybridParallel(nn.ModuleList([sharded]), dense="none")
    x = torch.tensor([1, 2])
    offsets = torch.tensor([1]) if rank == 0 else torch.tensor([0])
    try:
        veloce.lookup_many([local, sharded], [(x, offsets), x.view(-1, 1)])
    except (ValueError, ExchangeError) as e:
        return type(e).__name__, str(e)
    return "looked up", ""


def test_a_local_table_error_stops_every_rank_of_the_sharded_lookup():
    """The rank whose local table fails abandons the call's sharded exchange, so the other
    rank raises instead of waiting in it."""
    (k0, m0), (k1, m1) = run_ranks(_local_table_fails, 2, timeout=60)
    assert k0 == "ValueError" and "offsets must start at 0" in m0
    assert k1 == "ExchangeError" and "rank 0 could not take part" in m1


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-7, 9)), min_size=0, max_size=6), st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_shift_segments_adds_the_sizes_of_the_segments_before(segments, seed):
    """layout.shift_segments: segment k of ``values`` (``lengths[k]`` entries) plus the sum
    of ``sizes`` of the segments before it, as a per-segment loop computes it."""
    from veloce.distributed.layout import shift_segments

    lengths = [n for n, _ in segments]
    sizes = [s for _, s in segments]
    values = torch.randint(-100, 100, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    want, start, base = [], 0, 0
    for n, s in zip(lengths, sizes):
        want.append(values[start : start + n] + base)
        start += n
        base += s
    want = torch.cat(want) if want else values
    assert torch.equal(shift_segments(values, lengths, sizes), want)


def _blocks(tables, world, row_shape, dtype, seed):
    """Random blocks of rows, one per (table, peer), some empty: ``(counts, received, per_table)``
    with ``received`` peer-major and ``per_table[k]`` table k's blocks in peer order."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (tables, world), generator=g)
    counts[0, 0] = 0
    counts = counts.tolist()
    blocks = {(k, p): (torch.randn(counts[k][p], *row_shape, generator=g) * 100).to(dtype)
              for k in range(tables) for p in range(world)}  # fmt: skip
    received = torch.cat([blocks[k, p] for p in range(world) for k in range(tables)])
    per_table = [torch.cat([blocks[k, p] for p in range(world)]) for k in range(tables)]
    return counts, received, per_table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tables, world", [(1, 4), (3, 1), (3, 2), (26, 5), (40, 8)])
def test_regrouping_received_blocks_table_major_and_back(device, tables, world):
    """An owner's received rows (one block per (peer, table), peer-major, some empty) come out
    table-major, each table's blocks in peer order, and go back in received order (40 x 8
    blocks, 230 of them not empty: two launches on CUDA)."""
    from veloce.distributed import layout

    counts, received, per_table = _blocks(tables, world, (3,), torch.float32, tables * 31 + world)
    received = received.to(device)
    got = layout.table_major(received, counts)
    assert torch.equal(got.cpu(), torch.cat(per_table))
    pieces = list(got.split([sum(r) for r in counts]))
    assert torch.equal(layout.received_order(pieces, counts), received)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, row_shape", [
    (torch.int64, ()), (torch.float32, (128,)), (torch.float32, (3,)), (torch.float32, (2, 2)),
    (torch.bfloat16, ()), (torch.uint8, (3,)), (torch.float64, (0,)),
])  # fmt: skip
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "storage offset"])
def test_regroup_blocks_every_copy_width(device, dtype, row_shape, offset):
    """regroup_blocks in both directions for rows of 16, 8, 4, 2 and 1 bytes' alignment (the
    CUDA kernel's copy units; a storage offset of one element narrows them), empty rows and
    sources given as non-contiguous views, against split + cat."""
    from veloce.ops.exchange import regroup_blocks

    tables, world = 5, 3
    counts, received, per_table = _blocks(tables, world, row_shape, dtype, 7)

    def shifted(t):  # the same values at a storage offset of `offset` elements, on the device
        flat = torch.zeros(t.numel() + offset, dtype=dtype, device=device)
        flat[offset:] = t.reshape(-1).to(device)
        return flat[offset:].view(t.shape)

    got = regroup_blocks([shifted(received)], counts, to_group_major=True)
    assert got.dtype == dtype and got.shape == (received.shape[0], *row_shape)
    assert torch.equal(got.cpu(), torch.cat(per_table))
    back = regroup_blocks([shifted(t) for t in per_table], counts, to_group_major=False)
    assert torch.equal(back.cpu(), received)
    if row_shape == (128,):  # non-contiguous sources are copied first

        def strided(t):  # every other element of a wider tensor
            return torch.stack([t, -t], 2).to(device)[..., 0]

        assert torch.equal(regroup_blocks([strided(received)], counts, to_group_major=True).cpu(),
                           torch.cat(per_table))  # fmt: skip
        assert torch.equal(regroup_blocks([strided(t) for t in per_table], counts, False).cpu(), received)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks", [128, 129, 257])
def test_regroup_blocks_across_launches(device, blocks):
    """On CUDA a launch copies at most 128 blocks: exactly 128 non-empty blocks are one
    launch, 129 and 257 two and three, the next launch's output starting where the last
    one's ended."""
    from veloce.ops.exchange import regroup_blocks

    one = [[1 + p % 3 for p in range(blocks)]]  # one group from `blocks` peers
    rows = sum(one[0])
    t = torch.arange(rows * 3, dtype=torch.float32, device=device).view(rows, 3)
    assert torch.equal(regroup_blocks([t], one, True), t)  # one group: the order is the same
    # two groups over (blocks + 1) // 2 peers, one block empty for an odd count: `blocks` non-empty
    counts = [[1 + (g * 7 + p) % 3 for p in range((blocks + 1) // 2)] for g in range(2)]
    if blocks % 2:
        counts[0][-1] = 0
    assert sum(c > 0 for row in counts for c in row) == blocks
    per_table = [torch.arange(sum(c), dtype=torch.int64, device=device) + 1000 * g for g, c in enumerate(counts)]
    pm = regroup_blocks(per_table, counts, False)
    pieces = [x.split(c) for x, c in zip(per_table, counts)]
    assert torch.equal(pm, torch.cat([pieces[g][p] for p in range(len(counts[0])) for g in range(2)]))
    assert torch.equal(regroup_blocks([pm], counts, True), torch.cat(per_table))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["first 128", "last 72"])
def test_regroup_blocks_a_launch_of_empty_blocks(device, empty):
    """200 blocks of which one launch's worth (on CUDA, 128 blocks: the first ones, or the
    last 72) are empty: the empty launch is skipped (a grid of no blocks would be an error)
    and the other blocks land where they belong, both directions."""
    from veloce.ops.exchange import regroup_blocks

    live = [1 + p % 3 for p in range(72)]
    sizes = [0] * 128 + live if empty == "first 128" else (live + live)[:128] + [0] * 72
    t = torch.arange(sum(sizes) * 2, dtype=torch.float32, device=device).view(-1, 2)
    for direction in (True, False):  # one group: the same order either way, in 200 blocks
        assert torch.equal(regroup_blocks([t], [sizes], direction), t)
    # Two groups over 100 peers, peers 0-63 (or 36-99) empty in both: peer-major, the first
    # (or last) 128 blocks.
    quiet = range(64) if empty == "first 128" else range(36, 100)
    counts = [[0 if p in quiet else 1 + (g + p) % 3 for p in range(100)] for g in range(2)]
    per_group = [torch.arange(sum(c) * 2, dtype=torch.float32, device=device).view(-1, 2) + 1000 * g
                 for g, c in enumerate(counts)]  # fmt: skip
    pm = regroup_blocks(per_group, counts, False)
    pieces = [x.split(c) for x, c in zip(per_group, counts)]
    assert torch.equal(pm, torch.cat([pieces[g][p] for p in range(100) for g in range(2)]))
    assert torch.equal(regroup_blocks([pm], counts, True), torch.cat(per_group))


@pytest.mark.parametrize("device", DEVICES)
def test_regroup_blocks_empty(device):
    """No rows at all, a group without rows, rows of no elements: shapes kept, nothing read."""
    from veloce.ops.exchange import regroup_blocks

    none = torch.empty(0, 4, device=device)
    assert regroup_blocks([none], [[0, 0], [0, 0]], True).shape == (0, 4)
    assert regroup_blocks([none, none], [[0, 0], [0, 0]], False).shape == (0, 4)
    b = torch.arange(6.0, device=device).view(3, 2)
    out = regroup_blocks([none[:, :2], b], [[0, 0], [1, 2]], False)  # group 0 has no rows
    assert torch.equal(out, b)
    assert regroup_blocks([torch.empty(5, 0, device=device)], [[2, 3]], True).shape == (5, 0)


_FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src, dst", [(a, b) for a in _FLOATS for b in _FLOATS if a != b])
@pytest.mark.parametrize("row_shape, offset", [((128,), 0), ((128,), 1), ((3,), 0), ((2, 2), 0)],
                         ids=["4 at a time", "storage offset", "one at a time", "2-d rows"])  # fmt: skip
def test_regroup_blocks_converts_as_tensor_to_does(device, src, dst, row_shape, offset):
    """regroup_blocks(..., dtype=) (the op regroup_blocks_as) in both directions equals split
    + cat + Tensor.to bit for bit: every pair of float dtypes, 4 elements per thread on CUDA
    where the rows and pointers allow and one at a time where they do not (rows of 3, a
    storage offset of one element), over 40 x 8 blocks (two launches on CUDA)."""
    from veloce.ops.exchange import regroup_blocks

    counts, received, per_table = _blocks(40, 8, row_shape, src, 11)

    def shifted(t):  # the same values at a storage offset of `offset` elements, on the device
        flat = torch.zeros(t.numel() + offset, dtype=src, device=device)
        flat[offset:] = t.reshape(-1).to(device)
        return flat[offset:].view(t.shape)

    got = regroup_blocks([shifted(received)], counts, to_group_major=True, dtype=dst)
    assert got.dtype == dst and got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), torch.cat(per_table).to(dst))
    assert torch.equal(got, torch.cat(per_table).to(device).to(dst))  # the device's own Tensor.to
    back = regroup_blocks([shifted(t) for t in per_table], counts, to_group_major=False, dtype=dst)
    assert torch.equal(back.cpu(), received.to(dst))
    none = regroup_blocks([received[:0].to(device)], [[0] * 8] * 40, True, dtype=dst)
    assert none.dtype == dst and none.shape == (0, *row_shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src, dst", [(a, b) for a in _FLOATS for b in _FLOATS if a != b])
@pytest.mark.parametrize("dim, aligned", [(128, True), (128, False), (33, True)],
                         ids=["4 at a time", "storage offset", "dim 33"])  # fmt: skip
def test_combine_parts_as_sums_then_converts_once(device, src, dst, dim, aligned):
    """combine_parts(..., dtype=) (the op combine_parts_as) accumulates in float64 when the
    parts or the output are float64, else in float32, and converts each sum once: bit for
    bit the sums of the parts converted to that type, converted. So bfloat16 partial sums
    summed straight into float32 (or float64) bags equal widening them first, without that
    pass."""
    g = torch.Generator().manual_seed(dim)
    bag = torch.tensor([0, 3, 3, 1, 0, 3, 5] * 9, device=device)
    P = bag.numel()
    flat = (torch.randn(P * dim + 1, generator=g, dtype=torch.float64) * 10).to(device, src)
    parts = flat[:-1].view(P, dim) if aligned else flat[1:].view(P, dim)
    acc = torch.float64 if torch.float64 in (src, dst) else torch.float32
    want = combine_parts(parts.to(acc), bag, 7).to(dst)
    for check_bags in (True, False):
        got = combine_parts(parts, bag, 7, check_bags=check_bags, dtype=dst)
        assert got.dtype == dst and torch.equal(got, want)
    none = combine_parts(parts[:0], bag[:0], 3, dtype=dst)  # no parts: zeros of dtype
    assert none.dtype == dst and torch.equal(none.cpu(), torch.zeros(3, dim, dtype=dst))


@pytest.mark.parametrize("device", DEVICES)
def test_converting_exchange_ops_gradients_and_opcheck(device):
    """regroup_blocks_as and combine_parts_as pass opcheck, and their gradients come back in
    the inputs' dtype: the output's gradient regrouped back (converted) and gathered per
    part (converted)."""
    from veloce.ops.exchange import regroup_blocks

    counts = [[1, 0, 2], [3, 1, 0]]  # 2 groups x 3 peers
    a = torch.randn(3, 4, device=device, requires_grad=True)
    b = torch.randn(4, 4, device=device, requires_grad=True)
    flat = [c for row in counts for c in row]
    torch.library.opcheck(torch.ops.veloce.regroup_blocks_as.default, ([a, b], flat, 2, False, torch.bfloat16))
    rows = torch.randn(7, 4, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.veloce.regroup_blocks_as.default, ([rows], flat, 2, True, torch.float16))
    pm = regroup_blocks([a, b], counts, False, dtype=torch.bfloat16)
    grad = torch.randn(7, 4, device=device).to(torch.bfloat16)
    pm.backward(grad)
    back = regroup_blocks([grad], counts, True).float()
    assert a.grad.dtype == torch.float32 and torch.equal(a.grad, back[:3]) and torch.equal(b.grad, back[3:])
    tm = regroup_blocks([rows], counts, True, dtype=torch.float64)
    g64 = torch.randn(7, 4, dtype=torch.float64, device=device)
    tm.backward(g64)
    assert rows.grad.dtype == torch.float32
    assert torch.equal(rows.grad, regroup_blocks([g64[:3], g64[3:]], counts, False).float())

    parts = torch.randn(5, 8, device=device).to(torch.bfloat16).requires_grad_()
    bag = torch.tensor([1, 0, 1, 3, 1], device=device)
    torch.library.opcheck(torch.ops.veloce.combine_parts_as.default, (parts, bag, 4, True, torch.float32))
    torch.library.opcheck(torch.ops.veloce.combine_parts_as.default, (parts, bag, 4, False, torch.float32))
    out = combine_parts(parts, bag, 4, dtype=torch.float32)
    g = torch.randn(4, 8, device=device)
    out.backward(g)
    assert parts.grad.dtype == torch.bfloat16 and torch.equal(parts.grad, g[bag].to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_converting_exchange_ops_refuse_what_they_cannot_convert(device):
    """Integer rows (ids) keep their dtype: a conversion to or from them is refused with the
    op, the argument and both dtypes named; keeping the dtype is regroup_blocks itself."""
    ids = torch.arange(6, device=device)
    with pytest.raises(ValueError, match=r"regroup_blocks_as: cannot convert sources from torch.int64 to dtype torch.float32"):
        torch.ops.veloce.regroup_blocks_as([ids], [3, 3], 1, True, torch.float32)
    rows = torch.randn(6, 2, device=device)
    with pytest.raises(ValueError, match=r"regroup_blocks_as: cannot convert sources from torch.float32 to dtype torch.int64"):
        torch.ops.veloce.regroup_blocks_as([rows], [3, 3], 1, True, torch.int64)
    with pytest.raises(ValueError, match=r"combine_parts_as: cannot convert parts from torch.float32 to dtype torch.int32"):
        torch.ops.veloce.combine_parts_as(rows, torch.zeros(6, dtype=torch.long, device=device), 1, True, torch.int32)
    same = torch.ops.veloce.regroup_blocks_as([ids], [3, 3], 1, True, torch.int64)
    assert torch.equal(same, ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_counts_per_owner_and_table_equal_a_scatter_add(device, world):
    """The sharded lookup's per-(owner, table) part and id counts (a search over sorted
    keys) equal the plain scatter-add over every part, with empty tables and empty bags."""
    from veloce.distributed.input_dist import counts_per_owner_and_table

    g = torch.Generator().manual_seed(world)
    num_bags = [5, 0, 7, 1, 0, 9]
    K = len(num_bags)
    lengths = torch.randint(0, 4, (sum(num_bags),), generator=g)
    ids = torch.randint(-(2**62), 2**62, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)[:-1]])
    b = bucketize_bags(ids.to(device), offsets.to(device), world)
    parts_nk, ids_nk = counts_per_owner_and_table(b, num_bags, world, torch.device(device))
    # the sharded lookup's call: padding parts after the real ones change nothing
    loose = bucketize_bags(ids.to(device), offsets.to(device), world, exact_sizes=False)
    assert loose.bag_of_part.numel() > b.bag_of_part.numel()  # some bags are empty or repeat an owner
    for got, want in zip(counts_per_owner_and_table(loose, num_bags, world, torch.device(device)), (parts_nk, ids_nk)):
        assert torch.equal(got, want)
    bounds = torch.tensor([0, *torch.tensor(num_bags).cumsum(0).tolist()][:-1], device=device)
    table = torch.searchsorted(bounds, b.bag_of_part, right=True) - 1
    owner = torch.repeat_interleave(torch.arange(world, device=device), b.part_splits)
    cell = owner * K + table
    want_parts = torch.zeros(world * K, dtype=torch.long, device=device).index_add_(0, cell, torch.ones_like(cell))
    want_ids = torch.zeros(world * K, dtype=torch.long, device=device).index_add_(0, cell, b.part_lengths)
    assert torch.equal(parts_nk, want_parts) and torch.equal(ids_nk, want_ids)
    assert int(ids_nk.sum()) == ids.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_requester_ops_never_wait_for_the_device():
    """What a sharded lookup runs before its header's read-back (bucketize_bags with
    exact_sizes=False, the per-(owner, table) counts) and combine_parts(check_bags=False)
    queue without a host synchronization, so the header's read is the forward's first."""
    from veloce.distributed.input_dist import counts_per_owner_and_table

    ids = torch.randint(-(2**62), 2**62, (5000,), device="cuda")
    offsets = torch.arange(0, 5000, 5, device="cuda")
    parts = torch.randn(4000, 64, device="cuda")
    bag_of_part = torch.randint(0, 1000, (4000,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b = bucketize_bags(ids, offsets, 3, exact_sizes=False)
        counts = counts_per_owner_and_table(b, [400, 600], 3, torch.device("cuda"))
        out = torch.ops.veloce.combine_parts(parts, bag_of_part, 1000, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exact = bucketize_bags(ids, offsets, 3)
    P = int(exact.part_splits.sum())
    assert torch.equal(b.bag_of_part[:P], exact.bag_of_part) and torch.equal(b.part_lengths[:P], exact.part_lengths)
    assert int(counts[1].sum()) == 5000
    assert torch.equal(out, combine_parts(parts, bag_of_part, 1000))


def _table_listed_twice(rank, world):
    a, b = veloce.DynamicEmbedding(4, mode="sum", seed=1), veloce.DynamicEmbedding(4, mode="sum", seed=2)
    HybridParallel(nn.ModuleList([a, b]), dense="none")
    x = torch.arange(8).view(4, 2) + 100 * rank
    outs = veloce.lookup_many([a, b, a], [x, x, x + 50])  # `a` twice: its second part inserts when served
    return [o.detach() for o in outs], len(a)


def test_sharded_lookup_of_a_table_listed_twice_equals_one_process():
    results = run_ranks(_table_listed_twice, 2, timeout=60)
    a, b = veloce.DynamicEmbedding(4, mode="sum", seed=1), veloce.DynamicEmbedding(4, mode="sum", seed=2)
    for rank, (outs, _) in enumerate(results):
        x = torch.arange(8).view(4, 2) + 100 * rank
        for got, want in zip(outs, [a(x), b(x), a(x + 50)]):
            torch.testing.assert_close(got, want)
    assert sum(n for _, n in results) == 32  # every id of `a` once, on its owner
