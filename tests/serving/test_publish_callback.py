"""The Trainer's Publish callback: versions every few steps and at the end of fit, a twin
built from the store equal to the trained model in eval mode, clear argument errors."""

from __future__ import annotations

import pytest
import torch

import veloce
from veloce.data import SyntheticClicks
from veloce.models import DLRM
from veloce.serving import FileStore, Publish, inference_twin, refresh

NUM_DENSE, NUM_SPARSE = 4, 3


def dlrm() -> DLRM:
    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(dim, mode="sum", max_capacity=160, optimizer=veloce.optim.Adagrad(lr=0.1))

    return DLRM(NUM_DENSE, NUM_SPARSE, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), embedding_factory=table)


def data(n: int, start: int = 0) -> SyntheticClicks:
    return SyntheticClicks(n, batch_size=32, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=400, seed=1,
                           start=start)  # fmt: skip


def assert_twin_equal(model: DLRM, twin: DLRM) -> None:
    model.eval()
    with torch.no_grad():
        for (dense, sparse), _ in data(256, start=10**6):  # ids never trained on too
            assert torch.equal(model(dense, sparse), twin(dense, sparse))


def test_publishes_every_n_steps_and_at_the_end_and_the_twin_equals_the_model(tmp_path):
    torch.manual_seed(0)
    model = dlrm()
    store = FileStore(tmp_path / "store")
    cb = Publish(store, every_n_steps=3, fold_every=3)
    trainer = veloce.Trainer(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), progress=False,
                             callbacks=[cb])  # fmt: skip
    trainer.fit(data(32 * 7))
    assert cb.published == [(3, 1), (6, 2), (7, 3)]
    assert [store.manifest(v)["kind"] for v in store.committed()] == ["full", "delta", "delta"]
    assert cb.publisher is None and cb.version == 3  # the lease is given back when fit returns
    twin = inference_twin(dlrm(), store)
    assert_twin_equal(model, twin)
    # a second fit goes on publishing into the same store; the twin follows with refresh
    trainer.max_epochs = 2
    trainer.fit(data(32 * 7))
    assert [v for _, v in cb.published] == [1, 2, 3, 4, 5, 6]
    assert refresh(twin) == 6
    assert_twin_equal(model, twin)


def test_publishes_at_the_end_only(tmp_path):
    model = dlrm()
    cb = Publish(FileStore(tmp_path), at_end=True)
    veloce.Trainer(model, progress=False, callbacks=[cb], max_steps=4).fit(data(32 * 8))
    assert cb.published == [(4, 1)]


def test_bad_arguments(tmp_path):
    store = FileStore(tmp_path)
    with pytest.raises(ValueError, match="every_n_steps must be None or an int >= 1, got 0"):
        Publish(store, every_n_steps=0)
    with pytest.raises(ValueError, match="never publishes"):
        Publish(store, at_end=False)
    with pytest.raises(TypeError, match="store must be a veloce.serving store"):
        Publish(str(tmp_path))
