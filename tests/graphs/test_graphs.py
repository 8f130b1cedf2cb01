"""veloce.graphs.CUDAGraphStep: a training step captured once and replayed trains as the same
steps run eagerly (with deferred inserts), grows its tables, follows an LR scheduler, and
reports bad offsets and NaN/Inf gradients as step() does; its refusals."""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch
from torch import nn

import veloce
from veloce.ops import extension as _ext

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")
CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not _ext.has_cuda_kernels(),
                          reason="needs a GPU and veloce's CUDA kernels")  # fmt: skip


class Tiny(nn.Module):
    """Two tables looked up together (one insert over both) and one alone, and an MLP."""

    def __init__(self, capacity: int, nonfinite: str = "raise") -> None:
        super().__init__()
        torch.manual_seed(0)

        def table(dim, mode, opt, seed):
            return veloce.DynamicEmbedding(dim, mode=mode, capacity=capacity, optimizer=opt, seed=seed,
                                           device="cuda", nonfinite_grad=nonfinite, defer_inserts=True)  # fmt: skip

        self.a = table(8, "sum", veloce.optim.Adagrad(lr=0.1), 1)
        self.b = table(8, "mean", veloce.optim.Adam(lr=0.01), 2)
        self.c = table(4, "sum", veloce.optim.SGD(lr=0.05), 3)
        self.mlp = nn.Sequential(nn.Linear(8 + 8 + 4 + 3, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()

    def forward(self, dense, ids_ab, ids_c, offsets_c):
        ea, eb = veloce.lookup_many([self.a, self.b], [ids_ab[:, :2], ids_ab[:, 2:]])
        ec = self.c(ids_c, offsets_c)
        return self.mlp(torch.cat([ea, eb, ec, dense], 1)).squeeze(1)


def batches(n, batch=64, seed=0, space=3000):
    """n batches; ids from a growing space, so every step inserts some."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        dense = torch.randn(batch, 3, generator=g)
        ids_ab = torch.randint(0, space + 200 * i, (batch, 5), generator=g)
        ids_c = torch.randint(-50, 400 + 30 * i, (batch * 2,), generator=g)
        offsets_c = torch.arange(0, batch * 2, 2)
        label = (torch.rand(batch, generator=g) < 0.3).float()
        out.append(tuple(x.cuda() for x in (dense, ids_ab, ids_c, offsets_c, label)))
    return out


def trainer(model, dense_lr=1e-2, detach=True):
    """The model's optimizer and training step; ``detach=False``: the step returns the loss
    itself, whose graph lives as long as the caller keeps it."""
    dense = torch.optim.Adam(model.mlp.parameters(), lr=dense_lr, capturable=True)
    opt = veloce.CombinedOptimizer(dense, model)
    loss_fn = nn.BCEWithLogitsLoss()

    def step(dense, ids_ab, ids_c, offsets_c, label):
        loss = loss_fn(model(dense, ids_ab, ids_c, offsets_c), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach() if detach else loss

    return opt, step


def assert_same_tables(x: Tiny, y: Tiny) -> None:
    for name in "abc":
        tx, ty = getattr(x, name), getattr(y, name)
        assert len(tx) == len(ty), name
        assert tx.step_count == ty.step_count, name
        assert tx.table.clock == ty.table.clock, name
        ex, ey = tx.export(), ty.export()
        ox, oy = torch.argsort(ex["keys"]), torch.argsort(ey["keys"])
        assert torch.equal(ex["keys"][ox], ey["keys"][oy]), name
        for k in ("weights", "optimizer_state"):
            torch.testing.assert_close(ex[k][ox], ey[k][oy], rtol=1e-5, atol=1e-6, msg=f"{name}.{k}")
        if "scores" in ex:
            assert torch.equal(ex["scores"][ox], ey["scores"][oy]), name


@CUDA
@pytest.mark.parametrize("capacity", [8192, 64])  # 64: the tables grow while replayed (captured again)
def test_replayed_steps_train_as_eager_steps(capacity):
    data = batches(12)
    eager = Tiny(capacity)
    _, eager_step = trainer(eager)
    want = [eager_step(*b).item() for b in data]

    graphed = Tiny(capacity)
    opt, fn = trainer(graphed)
    step = veloce.CUDAGraphStep(fn, graphed, opt, warmup=2)
    got = [step(*b).item() for b in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert step.captures >= (2 if capacity == 64 else 1)
    assert_same_tables(graphed, eager)
    for p, q in zip(graphed.mlp.parameters(), eager.mlp.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@CUDA
def test_an_eager_step_between_replays():
    """A short batch run eagerly between replays (the last batch of an epoch): the graph
    stays, and the next replays start from the state it left."""
    data = batches(8, seed=5)
    short = tuple(x[: x.shape[0] // 2] for x in data[4])  # 32 samples: 64 ids of c, 32 offsets
    eager = Tiny(8192)
    _, eager_step = trainer(eager)
    graphed = Tiny(8192)
    opt, fn = trainer(graphed)
    step = veloce.CUDAGraphStep(fn, graphed, opt, warmup=1)
    for i, b in enumerate(data):
        if i == 4:
            want, got = eager_step(*short).item(), step.eager(*short).item()
        else:
            want, got = eager_step(*b).item(), step(*b).item()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), i
        if i == 5:  # the replay after the eager step joined its updates' fences, and dropped them
            assert all(t._update_fence is None for t in step._tables)
    assert step.captures == 1
    assert_same_tables(graphed, eager)


@CUDA
@pytest.mark.parametrize("warmup", [1, 2])
def test_a_capture_after_eager_steps_whose_graphs_are_alive(warmup):
    """Eager steps before the first capture (a resumed epoch's short batch, the warm-up
    steps) whose autograd graphs the caller keeps alive (fn returns the loss itself, and the
    test keeps the losses): their parameters' AccumulateGrad nodes are still alive at the
    capture, which must work all the same (cudaErrorStreamCaptureImplicit when they were
    made on the default stream) and train as eager steps do."""
    data = batches(5, seed=11)
    short = tuple(x[: x.shape[0] // 2] for x in data[0])
    eager = Tiny(8192)
    _, eager_step = trainer(eager)
    want = [eager_step(*short).item()] + [eager_step(*b).item() for b in data]

    graphed = Tiny(8192)
    opt, fn = trainer(graphed, detach=False)
    step = veloce.CUDAGraphStep(fn, graphed, opt, warmup=warmup)
    kept = [step.eager(*short)]
    got = [kept[0].item()]
    for b in data:
        loss = step(*b)
        got.append(loss.item())  # (a replay returns the same tensor each time)
        kept.append(loss)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert all(x.grad_fn is not None for x in kept[: 1 + warmup])  # alive at the capture, with their graphs
    assert step.captures == 1
    assert_same_tables(graphed, eager)


_KEPT_OUTSIDE = """
import torch, veloce
from torch import nn
table = veloce.DynamicEmbedding(8, mode="sum", capacity=1024, device="cuda", defer_inserts=True)
mlp = nn.Linear(8, 1).cuda()
dense = torch.optim.Adam(mlp.parameters(), lr=1e-2, capturable=True)
model = nn.ModuleDict({"table": table, "mlp": mlp})
opt = veloce.CombinedOptimizer(dense, model)

def fn(ids, offsets, label):
    loss = nn.functional.binary_cross_entropy_with_logits(mlp(table(ids, offsets)).squeeze(1), label)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()

ids, offsets, label = torch.arange(64, device="cuda"), torch.arange(0, 64, 2, device="cuda"), torch.ones(32, device="cuda")
kept = nn.functional.binary_cross_entropy_with_logits(mlp(table(ids, offsets)).squeeze(1), label)
kept.backward()  # a step of its own, on the default stream; its loss (and graph) is kept
opt.step()
opt.zero_grad()
step = veloce.CUDAGraphStep(fn, model, opt, warmup=1)
step(ids, offsets, label)  # warm-up
try:
    step(ids, offsets, label)  # the capture
except RuntimeError as e:
    print("RAISED:", e, flush=True)
else:
    print("CAPTURED", flush=True)
"""


@CUDA
def test_a_graph_kept_from_a_step_outside_the_wrapper_is_named_when_it_breaks_the_capture(tmp_path):
    """A step run outside the wrapper on the default stream, its loss kept: the capture fails
    (autograd syncs the parameters' gradients with the default stream) with an error that
    says why and what to do. (A subprocess: a failed capture leaves torch's CUDA generator
    in capture mode for the rest of the process.)"""
    from _jobs import run_command

    script = tmp_path / "kept.py"
    script.write_text(_KEPT_OUTSIDE)
    out = run_command([sys.executable, str(script)], timeout=120).stdout
    assert "CAPTURED" not in out, out
    assert "RAISED: CUDAGraphStep: the capture of the step needed the default stream" in out, out
    assert ".detach()" in out and "CUDAGraphStep.eager()" in out, out


def test_the_default_stream_refusal_is_found_behind_the_capture_end_error():
    """(Any device.) torch's capture end raises 'invalidated' while handling CUDA's refusal
    to make the default stream depend on the capture: the wrapper finds the refusal in the
    chain (and only it) to say what to do."""
    from veloce.graphs.capture import _needed_default_stream

    refusal = RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking stream")
    try:
        try:
            raise refusal
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as e:
        assert _needed_default_stream(e)
    assert _needed_default_stream(refusal)
    assert not _needed_default_stream(RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    assert not _needed_default_stream(ValueError("CUDAGraphStep: fn steps a table twice"))


@CUDA
@pytest.mark.parametrize("dense_lr", [0.0, 1e-2])  # 1e-2: the dense lr changes too (a float: captured again)
def test_replays_follow_an_lr_scheduler(dense_lr):
    data = batches(8, seed=1)
    models, losses, steps = [], [], None
    for graph in (False, True):
        model = Tiny(8192)
        opt, fn = trainer(model, dense_lr=dense_lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5**i)
        run = steps = veloce.CUDAGraphStep(fn, model, opt) if graph else fn
        out = []
        with pytest.warns(RuntimeWarning, match="captured again") if graph and dense_lr else _no_warning():
            for b in data:
                out.append(run(*b).item())
                sched.step()  # outside the captured step: its new rates reach the next replay
        models.append(model)
        losses.append(out)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
    assert_same_tables(models[1], models[0])
    assert models[1].a._last_lr == pytest.approx(0.1 * 0.5**7)
    assert steps.captures == (1 if dense_lr == 0.0 else len(data) - 2)


def _no_warning():
    return contextlib.nullcontext()


class Twice(nn.Module):
    """One table looked up twice in a step (two inserts into it), and one looked up once."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.t = veloce.DynamicEmbedding(8, mode="sum", capacity=capacity, device="cuda", defer_inserts=True)
        self.u = veloce.DynamicEmbedding(8, mode="sum", capacity=capacity, device="cuda", defer_inserts=True)
        self.mlp = nn.Linear(24, 1).cuda()

    def forward(self, a, b):
        x, y, z = veloce.lookup_many([self.t, self.t, self.u], [a, b, a])
        return self.mlp(torch.cat([x, y, z], 1)).squeeze(1)


@CUDA
def test_a_table_looked_up_twice_has_room_for_both_lookups():
    g = torch.Generator().manual_seed(6)
    data = [(torch.randint(0, 100 + 400 * i, (64, 3), generator=g).cuda(),
             torch.randint(10**6, 10**6 + 100 + 400 * i, (64, 3), generator=g).cuda()) for i in range(10)]  # fmt: skip
    runs = []
    for graph in (False, True):
        model = Twice(64)  # grows several times
        opt = veloce.CombinedOptimizer(torch.optim.SGD(model.mlp.parameters(), lr=0.1), model)

        def fn(a, b, model=model, opt=opt):
            loss = model(a, b).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        run = veloce.CUDAGraphStep(fn, model, opt) if graph else fn
        with warnings.catch_warnings():  # no insert may run out of room (that would warn and drop a lookup)
            warnings.simplefilter("error", RuntimeWarning)
            runs.append(([run(*b).item() for b in data], model))
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), rtol=1e-5, atol=1e-6)
    for name in "tu":
        a, b = getattr(runs[1][1], name), getattr(runs[0][1], name)
        assert len(a) == len(b)
        ea, eb = a.export(), b.export()
        oa, ob = torch.argsort(ea["keys"]), torch.argsort(eb["keys"])
        torch.testing.assert_close(ea["weights"][oa], eb["weights"][ob], rtol=1e-5, atol=1e-6)


@CUDA
def test_stepping_a_table_twice_is_refused():
    model = Tiny(8192)
    opt, fn = trainer(model)

    def twice(*b):
        loss = fn(*b)
        model.a(b[1][:, 0].contiguous(), torch.arange(b[1].shape[0], device="cuda")).sum().backward()
        model.a.step()
        model.a.zero_grad()
        return loss

    step = veloce.CUDAGraphStep(twice, model, opt, warmup=1)
    data = batches(2, seed=7)
    step(*data[0])
    with pytest.raises(ValueError, match="steps a table twice"):
        step(*data[1])


def replaying(data, steps):
    """A Tiny model, its optimizer and its graphed step, after ``steps`` steps of ``data``
    (the first eager, the others replays)."""
    model = Tiny(8192)
    opt, fn = trainer(model)
    step = veloce.CUDAGraphStep(fn, model, opt, warmup=1)
    for b in data[:steps]:
        step(*b)
    return model, opt, step


@CUDA
def test_a_nan_gradient_is_raised_by_the_next_call_and_applies_nothing():
    data = batches(6, seed=2)
    model, opt, step = replaying(data, 3)
    len(model.a)  # reads the counts: the tables are settled
    before = {n: getattr(model, n).export() for n in "abc"}
    steps = model.a.step_count
    bad = list(data[3])
    bad[0] = torch.full_like(bad[0], float("nan"))  # every gradient NaN
    step(*bad)
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        step(*data[4])
    assert model.a.step_count == steps
    for n in "abc":
        after = getattr(model, n).export()
        keys_before = set(before[n]["keys"].tolist())
        mask = torch.tensor([k in keys_before for k in after["keys"].tolist()], device=after["keys"].device)
        o_before, o_after = torch.argsort(before[n]["keys"]), torch.argsort(after["keys"][mask])
        assert torch.equal(before[n]["weights"][o_before], after["weights"][mask][o_after]), n
    opt.zero_grad()
    step(*data[5])  # training goes on


@CUDA
def test_bad_offsets_are_raised_by_the_next_call():
    data = batches(5, seed=3)
    _, _, step = replaying(data, 2)
    bad = list(data[2])
    bad[3] = bad[3].flip(0)  # decreasing offsets
    step(*bad)
    with pytest.raises(ValueError, match="offsets"):
        step(*data[3])


@CUDA
def test_refusals():
    data = batches(3, seed=4)
    _, _, step = replaying(data, 2)
    _, fn = trainer(Tiny(64))
    with pytest.raises(ValueError, match="captured for inputs"):
        step(*(x[:32] for x in data[2][:2]), data[2][2][:64], data[2][3][:32], data[2][4][:32])
    with pytest.raises(TypeError, match="input 0 must be a tensor"):
        step(1.0, *data[2][1:])
    with pytest.raises(ValueError, match="nonfinite_grad='skip'"):
        veloce.CUDAGraphStep(fn, Tiny(64, nonfinite="skip"))


def test_refusals_on_any_machine():
    plain = nn.Linear(3, 1)
    with pytest.raises(TypeError, match="fn must be callable"):
        veloce.CUDAGraphStep(None, plain)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        veloce.CUDAGraphStep(lambda: None, plain, warmup=0)
    opt = veloce.CombinedOptimizer(torch.optim.Adam(plain.parameters()), plain)
    with pytest.raises(ValueError, match="capturable=True"):
        veloce.CUDAGraphStep(lambda: None, plain, opt)
    cpu = veloce.DynamicEmbedding(4)
    with pytest.raises(ValueError, match="on one CUDA device"):
        veloce.CUDAGraphStep(lambda: None, cpu)


@CUDA
def test_trainer_with_cuda_graph_trains_as_without():
    """Trainer(cuda_graph=True) on synthetic clicks (a short last batch included): the same
    losses per epoch and the same tables as the eager Trainer (deferred inserts)."""
    from veloce.data import SyntheticClicks
    from veloce.models import DLRM

    def run(cuda_graph):
        torch.manual_seed(0)
        table = lambda d: veloce.DynamicEmbedding(d, mode="sum", capacity=256, device="cuda", defer_inserts=True)
        model = DLRM(4, 3, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), embedding_factory=table).cuda()
        dense = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
        data = SyntheticClicks(num_samples=1000, batch_size=128, num_dense=4, num_sparse=3, seed=1)
        trainer = veloce.Trainer(model, optimizer=dense, max_epochs=2, progress=False, log_dir=None,
                                 cuda_graph=cuda_graph)  # fmt: skip
        history = trainer.fit(data)
        return model, [h["loss"] for h in history], trainer

    eager, eager_loss, _ = run(False)
    graphed, graph_loss, trainer = run(True)
    torch.testing.assert_close(torch.tensor(graph_loss), torch.tensor(eager_loss), rtol=1e-5, atol=1e-6)
    assert trainer._graph.captures >= 1
    for a, b in zip(graphed.embeddings.values(), eager.embeddings.values()):
        ea, eb = a.export(), b.export()
        oa, ob = torch.argsort(ea["keys"]), torch.argsort(eb["keys"])
        assert torch.equal(ea["keys"][oa], eb["keys"][ob])
        torch.testing.assert_close(ea["weights"][oa], eb["weights"][ob], rtol=1e-5, atol=1e-6)


def test_trainer_refuses_cuda_graph_off_a_gpu():
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="cuda_graph=True needs a model on a CUDA device"):
        veloce.Trainer(model, cuda_graph=True, progress=False)
    with pytest.raises(TypeError, match="cuda_graph must be a bool"):
        veloce.Trainer(model, cuda_graph="yes", progress=False)


@CUDA
def test_trainer_captures_a_full_batch_when_the_third_is_short():
    """A loader whose third batch is short: the Trainer runs it eagerly (also before the
    capture), captures a full batch, and trains as the eager Trainer."""
    from veloce.models import DLRM

    g = torch.Generator().manual_seed(8)
    sizes = [32, 32, 20, 32, 32, 32]
    loader = [((torch.randn(n, 4, generator=g), torch.randint(0, 500, (n, 3), generator=g)),
               (torch.rand(n, generator=g) < 0.3).float()) for n in sizes]  # fmt: skip

    def run(cuda_graph):
        torch.manual_seed(0)
        table = lambda d: veloce.DynamicEmbedding(d, mode="sum", capacity=1024, device="cuda", defer_inserts=True)
        model = DLRM(4, 3, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), embedding_factory=table).cuda()
        dense = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
        trainer = veloce.Trainer(model, optimizer=dense, max_epochs=2, progress=False, cuda_graph=cuda_graph)
        return [h["loss"] for h in trainer.fit(loader)], trainer

    eager_loss, _ = run(False)
    graph_loss, trainer = run(True)
    torch.testing.assert_close(torch.tensor(graph_loss), torch.tensor(eager_loss), rtol=1e-5, atol=1e-6)
    assert trainer._graph.captures == 1
    assert tuple(trainer._graph._static[0].shape) == (32, 4)


@CUDA
def test_trainer_resumed_at_a_short_batch_captures_a_full_one(tmp_path):
    """A run resumed from a checkpoint whose next batch is the epoch's short last one: the
    captured shape comes from the batches the resume skips (a full one), so the short batch
    runs eagerly and the next epoch's full batches replay; it trains as an eager run resumed
    from the same point."""
    from veloce.models import DLRM

    g = torch.Generator().manual_seed(9)
    sizes = [32, 32, 20]
    loader = [((torch.randn(n, 4, generator=g), torch.randint(0, 500, (n, 3), generator=g)),
               (torch.rand(n, generator=g) < 0.3).float()) for n in sizes]  # fmt: skip

    def run(cuda_graph, where, max_steps):
        torch.manual_seed(0)
        table = lambda d: veloce.DynamicEmbedding(d, mode="sum", capacity=1024, device="cuda", defer_inserts=True)
        model = DLRM(4, 3, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), embedding_factory=table).cuda()
        dense = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
        trainer = veloce.Trainer(model, optimizer=dense, max_epochs=3, max_steps=max_steps, progress=False,
                                 checkpoint_dir=tmp_path / where, checkpoint_every=2, cuda_graph=cuda_graph)  # fmt: skip
        return [h["loss"] for h in trainer.fit(loader)], trainer

    for cuda_graph, where in ((False, "eager"), (True, "graphed")):
        run(cuda_graph, where, max_steps=2)  # stops at step 2: the checkpoint's next batch is the short one
    eager_loss, _ = run(False, "eager", max_steps=None)
    graph_loss, trainer = run(True, "graphed", max_steps=None)
    torch.testing.assert_close(torch.tensor(graph_loss), torch.tensor(eager_loss), rtol=1e-5, atol=1e-6)
    assert trainer._graph.captures == 1
    assert tuple(trainer._graph._static[0].shape) == (32, 4)


def test_a_resumed_trainer_takes_the_graph_shape_from_the_batches_it_skips():
    """(Any device.) The shape a resumed Trainer(cuda_graph=True) captures is the first
    skipped batch's, not that of the batch the resumed epoch starts at."""
    from veloce.train.lockstep import rng_state

    trainer = veloce.Trainer(nn.Linear(4, 1), progress=False, log_dir=None)
    trainer._graph = object()  # as cuda_graph=True sets it (only its presence is read here)
    loader = [(torch.zeros(n, 4), torch.zeros(n)) for n in (8, 8, 3)]
    trainer.batches_in_epoch = 2
    trainer._epoch_rng = rng_state()
    it, last = trainer._epoch_iter(loader)
    first = next(it)
    assert first[0].shape == (3, 4)  # the resumed epoch starts at its short batch
    assert last[0].shape == (8, 4)  # the last batch skipped: the form of zero-row batches if the loader is done
    spec, shapes = trainer._graph_spec
    assert shapes == [(torch.Size([8, 4]), torch.float32), (torch.Size([8]), torch.float32)]
    assert spec == torch.utils._pytree.tree_flatten((torch.zeros(8, 4), torch.zeros(8)))[1]


def test_a_captured_insert_needs_room_for_every_insert_of_the_step():
    """The capture hook of HashTable._deferrable (any device): a captured insert defers
    (whatever ``defer`` says) while the table has room for it and for the step's earlier
    inserts into the same table; otherwise it asks the wrapper to grow the table."""
    from veloce.runtime import capture as _capture
    from veloce.table import HashTable

    t = HashTable(4, 0, capacity=64, grow_at=0.5)  # room for 32 ids
    other = HashTable(4, 0, capacity=64, grow_at=0.5)
    assert not t.defer
    _capture.ACTIVE = _capture.Capture()
    try:
        assert t._deferrable([torch.arange(20)])
        _capture.ACTIVE.inserts.append(_capture.InsertLog([other, t], [30, 20], None, None))
        assert t._deferrable([torch.arange(12)])  # 20 + 12 = 32: fits
        with pytest.raises(_capture.NeedsRoom) as e:
            t._deferrable([torch.arange(13)])  # 20 + 13 = 33: does not
        assert e.value.table is t and e.value.n == 33
        assert other._deferrable([torch.arange(2)])  # its own 30 + 2
    finally:
        _capture.ACTIVE = None
    assert not t._deferrable([torch.arange(1)])  # no capture: the table's own setting again


def test_a_requeued_check_and_a_renewed_layout_check_read_again():
    """What the wrapper makes per replay (any device): a NaN/Inf check that reads the flags
    as they are now (a replay rewrote them), and a bag-layout check that raises again."""
    from veloce.sparse import FiniteCheck as _FiniteCheck
    from veloce.sparse import LayoutCheck as _LayoutCheck

    emb = veloce.DynamicEmbedding(4, mode="sum")
    emb(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    check = _FiniteCheck([emb])
    assert check.result() == {id(emb): True}
    check._flags = {d: torch.ones_like(f) for d, f in check._flags.items()}  # as a replay rewrites them
    assert check.result() == {id(emb): True}  # read once
    assert check.requeued().result() == {id(emb): False}

    offsets = torch.tensor([0, 3, 1])  # decreasing
    layouts = [(offsets, 4, False)]
    refusal = _LayoutCheck(torch.tensor([True]), layouts)
    with pytest.raises(ValueError, match="offsets"):
        refusal.refused()
    refusal.refused()  # once per check
    with pytest.raises(ValueError, match="offsets"):
        refusal.renewed().refused()
