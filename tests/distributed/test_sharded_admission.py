"""Feature admission on tables sharded by HybridParallel (2 gloo ranks on the CPU): the
owner counts every occurrence of its ids (from any rank, repeated in a batch, deduplicated
on the wire) and decides; the default row is one row, replicated on every rank and equal
to one process's; checkpoints move the sketch and the default row between world sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import veloce
from _dist import run_ranks
from veloce.admission import Frequency, sketch_slots
from veloce.distributed import HybridParallel, owner_of

WIDTH = 1 << 12
DIM = 4


class Model(nn.Module):
    """One sum-pooled table with admission at the second sighting and a linear head."""

    def __init__(self, min_count: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = veloce.DynamicEmbedding(DIM, mode="sum", seed=5, optimizer=veloce.optim.Adagrad(lr=0.1),
                                           admission=Frequency(min_count=min_count, width=WIDTH))  # fmt: skip
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, offsets):
        return self.head(self.emb(ids, offsets)).squeeze(1)

    def sparse_lookups(self, ids, offsets):  # for HybridParallel.prefetch
        return [([self.emb], [(ids, offsets)])]


def global_batch(step: int, size: int = 8):
    """Bags of 1-3 ids over 40 ids, many repeated within and across batches."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(1, 4, (size,), generator=g)
    ids = torch.randint(0, 40, (int(lengths.sum()),), generator=g) * 7919
    label = (torch.rand(size, generator=g) < 0.5).float()
    return lengths, ids, label


def rank_slice(step: int, rank: int, world: int):
    """This rank's half of the global batch (its bags, their offsets and labels)."""
    lengths, ids, label = global_batch(step)
    size = lengths.numel()
    lo, hi = rank * size // world, (rank + 1) * size // world
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    a, b = int(starts[lo]), int(starts[hi])
    return ids[a:b], starts[lo:hi] - a, label[lo:hi], size


def make_opt(model):
    return veloce.CombinedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)


def run_steps(model, opt, steps, world: int, rank: int, delayed: bool = False, clip=None) -> list:
    """Trains on the global batches of ``steps`` split over ranks (loss: the global mean).
    ``delayed``: one process applying each step's table gradient one step late, as async
    sharding with staleness 1 does (the dense gradient at once, as DDP). ``clip``: a list;
    each step's gradients are clipped to norm 0.05 (veloce.clip_grad_norm_, the default
    row's gradient included) and the total norm appended; ``"value"``: clamped to 0.002
    (veloce.clip_grad_value_)."""
    preds, late = [], None
    for step in steps:
        ids, offsets, label, size = rank_slice(step, rank, world)
        out = model(ids, offsets)
        loss = nn.functional.binary_cross_entropy_with_logits(out, label, reduction="sum")
        (loss * world / size).backward()
        if clip == "value":
            veloce.clip_grad_value_(model, 0.002)
        elif clip is not None:
            clip.append(float(veloce.clip_grad_norm_(model, 0.05)))
        if delayed:
            emb = model.emb
            now = emb.pending_state()
            emb.restore_pending_state(late)
            late = now
        opt.step()
        opt.zero_grad()
        preds.append(out.detach())
    if delayed and late is not None:
        model.emb.restore_pending_state(late)
        model.emb.step()
    return preds


def keys_of(model) -> set:
    return set(model.emb.export()["keys"].tolist())


def shard_results(model, preds) -> dict:
    emb = model.emb
    return {"preds": preds, "keys": keys_of(model), "default": emb.table.default_rows().clone(),
            "default_state": emb.table._buffers["default_state"].clone(),
            "sketch": emb.table.own_sketch().clone(), "stats": emb.stats()}  # fmt: skip


def check_no_collision(steps) -> None:
    """Every id used has a counter of its own in some sketch row: counts are exact, in one
    process as in each shard, so the admissions must agree."""
    ids = torch.cat([global_batch(s)[1] for s in steps]).unique()
    slots = sketch_slots(ids, 4, WIDTH, 0)
    unique = torch.zeros(ids.numel(), dtype=torch.bool)
    for row in slots:
        _, inverse, counts = row.unique(return_inverse=True, return_counts=True)
        unique |= counts[inverse] == 1
    assert unique.all()


# ---- the k-th sighting across ranks and repeats ------------------------------------------------
def _kth_body(rank, world, dedup, prefetch):
    model = Model(min_count=3)
    hp = HybridParallel(model, dedup=dedup)
    opt = make_opt(hp)
    a, b = 11, 12  # a: one sighting per rank and step; b: twice in rank 0's first batch
    batches = {0: [[a, b, b], [a]], 1: [[a], [b]]}[rank]  # step 0: a twice, b twice; step 1: a 3rd, b 3rd
    seen = []
    for ids in batches:
        t = torch.tensor(ids)
        if prefetch:  # the owners insert (and count) here, the forward takes the prefetched exchange
            hp.prefetch(t, torch.zeros(1, dtype=torch.long))
        out = hp(t, torch.zeros(1, dtype=torch.long))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        seen.append(keys_of(model))
    return seen, model.emb.stats()


@pytest.mark.parametrize("dedup, prefetch", [(False, False), (True, False), (False, True)],
                         ids=["parts", "dedup", "prefetch"])  # fmt: skip
def test_kth_sighting_counts_every_rank_and_every_repeat(dedup, prefetch):
    (seen0, stats0), (seen1, stats1) = run_ranks(_kth_body, 2, dedup, prefetch, timeout=90)
    first = seen0[0] | seen1[0]
    assert first == set(), "the 2nd sighting admitted an id (min_count=3)"
    assert seen0[1] | seen1[1] == {11, 12}, "the 3rd sighting, from either rank, inserts"
    for key in (11, 12):  # each on its owner
        owner = int(owner_of(torch.tensor([key]), 2))
        assert key in (seen0, seen1)[owner][1]
    # telemetry per shard: every sighting booked once, by its owner (dedup counts repeats too)
    assert stats0["refused"] + stats1["refused"] == 4 and stats0["admitted"] + stats1["admitted"] == 2


# ---- sharded training equals one process ---------------------------------------------------------
STEPS = list(range(6))


def _train_body(rank, world, sparse, dedup, clip):
    model = Model()
    hp = HybridParallel(model, sparse=sparse, staleness=1, dedup=dedup)
    opt = make_opt(hp)
    norms = [] if clip == "norm" else clip
    preds = run_steps(hp, opt, STEPS, world, rank, clip=norms)
    hp.flush()
    return {**shard_results(model, preds), "norms": norms}


def _reference(delayed: bool, clip: bool) -> dict:
    model = Model()
    norms = [] if clip == "norm" else clip
    preds = run_steps(model, make_opt(model), STEPS, 1, 0, delayed=delayed, clip=norms)
    return {**shard_results(model, preds), "norms": norms}


def check_equal(results, ref) -> None:
    for step in STEPS:
        got = torch.cat([r["preds"][step] for r in results])
        torch.testing.assert_close(got, ref["preds"][step], rtol=1e-5, atol=1e-6, msg=f"predictions of step {step}")
    assert results[0]["keys"] | results[1]["keys"] == ref["keys"], "the admitted ids differ"
    assert not results[0]["keys"] & results[1]["keys"]
    assert ref["stats"]["refused"] > 0 and ref["stats"]["admitted"] > 0  # both paths ran
    assert not torch.equal(ref["default"], Model().emb.table.default_rows()), "the default row was not trained"
    assert torch.equal(results[0]["default"], results[1]["default"]), "the default row's replicas differ"
    assert torch.equal(results[0]["default_state"], results[1]["default_state"])
    torch.testing.assert_close(results[0]["default"], ref["default"], rtol=0, atol=1e-6)
    torch.testing.assert_close(results[0]["default_state"], ref["default_state"], rtol=0, atol=1e-6)
    assert torch.equal(results[0]["sketch"] + results[1]["sketch"], ref["sketch"]), "the summed sketch differs"
    for key in ("admitted", "refused"):  # the telemetry per shard adds up to one process's
        assert results[0]["stats"][key] + results[1]["stats"][key] == ref["stats"][key]


@pytest.mark.parametrize("sparse, dedup, clip", [("sync", False, "norm"), ("sync", True, "value"),
                                                 ("async", False, None)],
                         ids=["sync-clip-norm", "sync-dedup-clip-value", "async"])  # fmt: skip
def test_two_ranks_train_like_one_process(sparse, dedup, clip):
    check_no_collision(STEPS)
    results = run_ranks(_train_body, 2, sparse, dedup, clip, timeout=90)
    ref = _reference(delayed=sparse == "async", clip=clip)
    check_equal(results, ref)
    if clip == "norm":  # the same total norm on every rank as in one process, and some steps clipped
        for r in results:
            torch.testing.assert_close(r["norms"], ref["norms"], rtol=1e-5, atol=1e-7)
        assert max(ref["norms"]) > 0.05


# ---- checkpoints between world sizes --------------------------------------------------------------
def _ckpt_body(rank, world, first, second):
    model = Model()
    hp = HybridParallel(model)
    opt = make_opt(hp)
    veloce.checkpoint.load(first, hp, opt)
    preds = run_steps(hp, opt, range(3, 6), world, rank)
    veloce.checkpoint.save(second, hp, opt, step=6)
    return preds


def test_checkpoints_move_admission_between_one_and_two_ranks(tmp_path):
    check_no_collision(range(9))
    ref = Model()
    ref_opt = make_opt(ref)
    ref_preds = run_steps(ref, ref_opt, range(9), 1, 0)

    one = Model()
    one_opt = make_opt(one)
    run_steps(one, one_opt, range(3), 1, 0)
    veloce.checkpoint.save(tmp_path / "a", one, one_opt, step=3)  # 1 process -> 2 ranks
    two_preds = run_ranks(_ckpt_body, 2, tmp_path / "a", tmp_path / "b", timeout=90)
    for i, step in enumerate(range(3, 6)):
        torch.testing.assert_close(torch.cat([p[i] for p in two_preds]), ref_preds[step], rtol=1e-5, atol=1e-6)

    back = Model()  # 2 ranks -> 1 process: the summed sketch counts each sighting once
    back_opt = make_opt(back)
    veloce.checkpoint.load(tmp_path / "b", back, back_opt)
    mid = Model()
    run_steps(mid, make_opt(mid), range(6), 1, 0)
    assert torch.equal(back.emb.table.own_sketch(), mid.emb.table.own_sketch())
    assert keys_of(back) == keys_of(mid)
    torch.testing.assert_close(back.emb.table.default_rows(), mid.emb.table.default_rows(), rtol=0, atol=1e-6)
    preds = run_steps(back, back_opt, range(6, 9), 1, 0)
    for i, step in enumerate(range(6, 9)):
        torch.testing.assert_close(preds[i], ref_preds[step], rtol=1e-5, atol=1e-6)
    assert keys_of(back) == keys_of(ref)


# ---- publishing --------------------------------------------------------------------------------
def _publish_body(rank, world, root):
    from veloce.serving import FileStore, Publisher

    model = Model()
    hp = HybridParallel(model)
    opt = make_opt(hp)
    run_steps(hp, opt, range(3), world, rank)
    version = Publisher(FileStore(root), hp).publish()
    return version, model.emb.table.default_rows().clone()


def test_two_ranks_publish_one_default_row(tmp_path):
    from veloce.serving import FileStore, inference_twin

    (v0, row0), (v1, row1) = run_ranks(_publish_body, 2, str(tmp_path / "store"), timeout=90)
    assert v0 == v1 and torch.equal(row0, row1)
    store = FileStore(str(tmp_path / "store"))
    meta = store.manifest(v0)["tables"]["emb"]
    assert meta["ranks"] == [0, 1] and meta["sharded"]
    assert torch.equal(torch.tensor([meta["default_row"]]), row0.float())  # one row: rank 0's replica
    twin = inference_twin(Model(), store, version=v0)
    assert torch.equal(twin.emb.default_row, row0.view_as(twin.emb.default_row))


# ---- loading a state dict, and ranks that disagree -----------------------------------------------
def _state_dict_body(rank, world, state, out):
    model = Model()
    hp = HybridParallel(model)
    model.load_state_dict(torch.load(state, weights_only=True))  # every rank loads the whole sketch
    veloce.checkpoint.save(out, hp, make_opt(hp), step=3)


def test_a_state_dict_loaded_on_two_ranks_saves_each_sighting_once(tmp_path):
    one = Model()
    run_steps(one, make_opt(one), range(3), 1, 0)
    torch.save(one.state_dict(), tmp_path / "one.pt")
    run_ranks(_state_dict_body, 2, str(tmp_path / "one.pt"), str(tmp_path / "ckpt"), timeout=90)
    back = Model()
    veloce.checkpoint.load(tmp_path / "ckpt", back, make_opt(back))
    assert int(one.emb.table.own_sketch().sum()) > 0
    assert torch.equal(back.emb.table.own_sketch(), one.emb.table.own_sketch())  # not twice


def _disagree_body(rank, world):
    model = Model(min_count=2 + rank)
    try:
        HybridParallel(model)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_whose_tables_differ_in_admission_are_refused():
    messages = run_ranks(_disagree_body, 2, timeout=90)
    assert all(m is not None and "differ in feature admission" in m and "min_count=3" in m for m in messages)
