"""torch.compile and torch.export of models with DynamicEmbedding tables (veloce/sparse/compile.py).

A lookup is one opaque op in the graph: no graph break in the forward, no recompile when a
table grows, ``fullgraph=True`` works, and a compiled training step trains the same rows as
the eager one. torch.export takes the eval-mode forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

import veloce
from veloce.ops import extension as _ext
from veloce.models import DLRM, DeepFM

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")

from conftest import DEVICES  # noqa: E402  (cpu, and cuda where it exists)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch, and fails on any recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def table(dim: int = 8, device: str = "cpu", **kw) -> veloce.DynamicEmbedding:
    kw.setdefault("mode", "sum")
    kw.setdefault("capacity", 32)
    return veloce.DynamicEmbedding(dim, device=device, **kw)


def dlrm(device: str = "cpu", **kw) -> DLRM:
    torch.manual_seed(0)
    return DLRM(4, 3, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1),
                embedding_factory=lambda d: table(d, device, **kw)).to(device)  # fmt: skip


def batch(step: int, device: str = "cpu", b: int = 32, features: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    dense = torch.randn(b, 4, generator=g)
    sparse = torch.randint(-(10**12), 10**12, (b, features), generator=g)
    sparse[: b // 2] = sparse[: b // 2] % 50  # ids seen again across steps, beside new ones
    return dense.to(device), sparse.to(device)


def rows(emb: veloce.DynamicEmbedding) -> dict[int, torch.Tensor]:
    e = emb.export()
    return {int(k): w for k, w in zip(e["keys"].tolist(), e["weights"].cpu())}


def assert_same_tables(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-5) -> None:
    tables_a = [m for m in a.modules() if isinstance(m, veloce.DynamicEmbedding)]
    tables_b = [m for m in b.modules() if isinstance(m, veloce.DynamicEmbedding)]
    assert len(tables_a) == len(tables_b) > 0
    for ta, tb in zip(tables_a, tables_b):
        ra, rb = rows(ta), rows(tb)
        assert ra.keys() == rb.keys()
        for k in ra:
            torch.testing.assert_close(ra[k], rb[k], atol=atol, rtol=1e-5)
        assert ta.step_count == tb.step_count


def train(model: torch.nn.Module, forward, steps: range, device: str = "cpu") -> list[float]:
    opt = veloce.CombinedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    losses = []
    for i in steps:
        dense, sparse = batch(i, device)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(dense, sparse), (sparse[:, 0] % 2).float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---- one graph, no breaks, no recompiles ---------------------------------------------------
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_forward_of_one_table_is_one_graph_without_breaks(training):
    emb, head = table(), torch.nn.Linear(8, 1)
    emb.train(training)

    def step(x, offsets, w):
        return head(emb(x, offsets, w)).sum()

    x, offsets, w = torch.randint(0, 100, (20,)), torch.tensor([0, 3, 3, 11]), torch.rand(20, requires_grad=True)
    explained = torch._dynamo.explain(step)(x, offsets, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert torch.compile(step, fullgraph=True)(x, offsets, w).requires_grad


@pytest.mark.parametrize("model_cls", [DLRM, DeepFM])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_model_forward_over_lookup_many_is_one_graph_without_breaks(model_cls, training):
    torch.manual_seed(0)
    model = model_cls(4, 3, embedding_dim=8, **({"bottom_mlp": (16, 8)} if model_cls is DLRM else {}))
    model.train(training)
    explained = torch._dynamo.explain(model)(*batch(0))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    lookups = [op for op in ops if op in (torch.ops.veloce.lookup, torch.ops.veloce.lookup.default)]
    assert len(lookups) == (1 if model_cls is DLRM else 2)  # one node per lookup_many call (DeepFM makes two)


def test_tables_growing_inside_compiled_training_cause_no_recompile():
    model = dlrm()
    compiled = torch.compile(model, fullgraph=True)
    before = [m.capacity for m in model.embeddings.values()]
    train(model, compiled, range(12))  # error_on_recompile (fixture)
    after = [m.capacity for m in model.embeddings.values()]
    assert all(a >= 4 * b for a, b in zip(after, before)), (before, after)  # each table doubled twice or more
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ---- the same training as eager ------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_steps_train_the_same_rows_as_eager(device):
    eager = dlrm(device, optimizer=veloce.optim.Adagrad(lr=0.1))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    eager_losses = train(eager, eager, range(6), device)
    compiled_losses = train(compiled_model, compiled, range(6), device)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    assert_same_tables(eager, compiled_model)
    for p, q in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,include_last_offset,psw", [("sum", False, True), ("sum", True, True),
                                                          ("mean", True, False), ("mean", False, False),
                                                          ("max", False, False), ("max", True, False)])  # fmt: skip
def test_compiled_lookup_with_offsets_and_per_sample_weights_matches_eager(mode, include_last_offset, psw):
    eager = table(mode=mode, include_last_offset=include_last_offset, padding_idx=7)
    compiled_emb = copy.deepcopy(eager)

    def loss_of(emb, x, offsets, w):
        return (emb(x, offsets, w) ** 2).sum()

    compiled = torch.compile(loss_of, fullgraph=True)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 40, (30,), generator=g, dtype=torch.int32)
        x[::5] = 7  # padding
        offsets = torch.tensor([0, 4, 4, 17, 30] if include_last_offset else [0, 4, 4, 17], dtype=torch.int32)
        w = torch.rand(30, generator=g, requires_grad=True) if psw else None
        w2 = None if w is None else w.detach().clone().requires_grad_()
        out_eager = loss_of(eager, x, offsets, w)
        out_compiled = compiled(compiled_emb, x, offsets, w2)
        torch.testing.assert_close(out_compiled, out_eager)
        out_eager.backward()
        out_compiled.backward()
        if psw:
            torch.testing.assert_close(w2.grad, w.grad)
        eager.step()
        compiled_emb.step()
    assert_same_tables(eager, compiled_emb)


@pytest.mark.parametrize("unknown", ["init", "zeros"])
def test_fullgraph_compile_of_eval_forward_matches_eager(unknown):
    model = dlrm(unknown=unknown, padding_idx=3)
    train(model, model, range(2))  # some rows trained
    model.eval()
    sizes = [len(m) for m in model.embeddings.values()]
    compiled = torch.compile(model, fullgraph=True)
    for step in range(5, 8):  # batches with ids the tables never saw
        dense, sparse = batch(step)
        sparse[0, 0] = 3
        torch.testing.assert_close(compiled(dense, sparse), model(dense, sparse))
    assert [len(m) for m in model.embeddings.values()] == sizes  # eval inserts nothing


def test_eval_lookup_under_compile_gives_per_sample_weights_their_gradient():
    emb = table()
    emb(torch.arange(10), torch.tensor([0]))  # rows 0..9
    emb.eval()
    x, offsets = torch.tensor([1, 2, 99, 3, 1]), torch.tensor([0, 2])  # 99 is unknown: its initializer row
    w = torch.rand(5, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    (emb(x, offsets, w) * torch.arange(8.0)).sum().backward()
    (torch.compile(emb, fullgraph=True)(x, offsets, w2) * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(w2.grad, w.grad)


def test_autograd_grad_through_compiled_lookup_leaves_the_table_untrained():
    emb = table()
    x, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    w = torch.rand(3, requires_grad=True)
    compiled = torch.compile(lambda x, o, w: emb(x, o, w).pow(2).sum(), fullgraph=True)
    loss = compiled(x, offsets, w)
    before = rows(emb)  # the rows the lookup inserted
    (grad,) = torch.autograd.grad(loss, [w])
    expected = 2 * (emb.find(x)[0] * emb(x, offsets, w).detach()[torch.tensor([0, 1, 1])]).sum(1)
    torch.testing.assert_close(grad, expected)
    emb.step()  # nothing pending: autograd.grad gives a table no gradient, as it leaves weight.grad alone
    assert emb.step_count == 0
    assert {k: v.tolist() for k, v in rows(emb).items()} == {k: v.tolist() for k, v in before.items()}


def test_compiled_loss_that_ignores_a_table_steps_only_the_other():
    a, b = table(), table()

    def loss_of(x):
        out_a, _ = veloce.lookup_many([a, b], [x, x])
        return out_a.sum()

    torch.compile(loss_of, fullgraph=True)(torch.randint(0, 100, (8, 2))).backward()
    veloce.step_tables([a, b])
    assert (a.step_count, b.step_count) == (1, 0)  # as in eager: an unused lookup sends no gradient


def test_compiled_no_grad_lookup_changes_the_table_as_eager_does():
    eager = table()
    compiled_emb = copy.deepcopy(eager)
    x = torch.randint(0, 100, (16, 2))
    with torch.no_grad():
        out = eager(x)
        out_compiled = torch.compile(compiled_emb, fullgraph=True)(x)
    torch.testing.assert_close(out_compiled, out)
    assert len(compiled_emb) == len(eager)


def test_compiled_copies_of_a_model_look_up_their_own_tables():
    model = dlrm()
    clone = copy.deepcopy(model)

    def forward(m, dense, sparse):
        return m(dense, sparse)

    compiled = torch.compile(forward)
    compiled(model, *batch(0))
    with torch._dynamo.config.patch(error_on_recompile=False):  # another module: its own guards
        compiled(clone, *batch(1))
    assert all(len(m) > 0 for m in clone.embeddings.values())
    seen_by_model = set().union(*(rows(m) for m in model.embeddings.values()))
    seen_by_clone = set().union(*(rows(m) for m in clone.embeddings.values()))
    assert seen_by_model != seen_by_clone


def test_bad_offsets_in_a_compiled_forward_raise_the_eager_error():
    emb = table()
    compiled = torch.compile(emb, fullgraph=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    assert len(emb) == 0  # refused before anything was inserted


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_lookup_op_passes_opcheck(training):
    from veloce.sparse import autograd_anchor

    emb = table()
    emb.train(training)
    x, offsets, w = torch.randint(0, 50, (6,)), torch.tensor([0, 2]), torch.rand(6, requires_grad=True)
    args = (autograd_anchor(x.device), [x], [offsets], [w], [True], [True], [emb._handle], [8], [0], [training],
            [False], [False], True, False)  # fmt: skip
    torch.library.opcheck(torch.ops.veloce.lookup.default, args)


def test_compiled_forward_of_3d_input_raises_the_eager_error():
    emb = table()
    with pytest.raises(ValueError, match="must be 1-D"):
        torch.compile(emb)(torch.zeros(2, 2, 2, dtype=torch.long))


# ---- torch.export --------------------------------------------------------------------------
@pytest.mark.parametrize("unknown", ["init", "zeros"])
def test_torch_export_of_an_eval_model_matches_eager(unknown):
    model = dlrm(unknown=unknown)
    train(model, model, range(2))
    model.eval()
    program = torch.export.export(model, batch(0))
    exported = program.module()
    for step in (0, 7):  # known and never-seen ids
        torch.testing.assert_close(exported(*batch(step)), model(*batch(step)))


def test_torch_export_of_a_training_model_says_to_export_in_eval_mode():
    model = dlrm()
    with pytest.raises(Exception, match=r"model\.eval\(\)"):
        torch.export.export(model, batch(0))


# ---- sharded tables ------------------------------------------------------------------------
def _sharded_body(rank: int, world: int) -> dict:
    from veloce.distributed import HybridParallel

    eager_model = dlrm()
    compiled_model = copy.deepcopy(eager_model)
    eager, sharded = HybridParallel(eager_model), HybridParallel(compiled_model)
    explained = torch._dynamo.explain(sharded)(*batch(100 + rank))
    emb = compiled_model.embeddings["sparse_0"]
    try:
        torch.compile(lambda x: emb(x).sum(), fullgraph=True)(batch(100 + rank)[1][:, :1])
        fullgraph_error = ""
    except Exception as e:  # noqa: BLE001 - its message is the result
        fullgraph_error = str(e)
    compiled = torch.compile(sharded)
    steps = range(rank * 10, rank * 10 + 3)  # each rank its own batches
    return {"eager": train(eager, eager, steps), "compiled": train(sharded, compiled, steps),
            "reasons": [r.reason for r in explained.break_reasons], "fullgraph_error": fullgraph_error}  # fmt: skip


def test_compiled_model_with_sharded_tables_looks_them_up_eagerly_and_says_so():
    from _dist import run_ranks

    for result in run_ranks(_sharded_body, 2, timeout=300):
        assert result["compiled"] == pytest.approx(result["eager"], rel=1e-5, abs=1e-6)
        assert any("HybridParallel" in r for r in result["reasons"]), result["reasons"]
        assert "HybridParallel" in result["fullgraph_error"], result["fullgraph_error"]
