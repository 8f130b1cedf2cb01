"""The Trainer's Publish callback: versions every few steps and at the end of fit, a twin
built from the store equal to the trained model in eval mode, clear argument errors."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

import veloce
from veloce.data import SyntheticClicks
from veloce.models import DLRM
from veloce.serving import FileStore, Publish, inference_twin, refresh
from veloce.train.lockstep import move_to

NUM_DENSE, NUM_SPARSE = 4, 3


def dlrm() -> DLRM:
    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(dim, mode="sum", max_capacity=160, optimizer=veloce.optim.Adagrad(lr=0.1))

    return DLRM(NUM_DENSE, NUM_SPARSE, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), embedding_factory=table)


def data(n: int, start: int = 0) -> SyntheticClicks:
    return SyntheticClicks(n, batch_size=32, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=400, seed=1,
                           start=start)  # fmt: skip


def assert_twin_equal(model: DLRM, twin: DLRM, device: str = "cpu") -> None:
    model.eval()
    with torch.no_grad():
        for (dense, sparse), _ in data(256, start=10**6):  # ids never trained on too
            dense, sparse = move_to((dense, sparse), torch.device(device))
            assert torch.equal(model(dense, sparse), twin(dense, sparse))


@pytest.mark.parametrize("device", DEVICES)
def test_publishes_every_n_steps_and_at_the_end_and_the_twin_equals_the_model(tmp_path, device):
    torch.manual_seed(0)
    model = dlrm().to(device)
    store = FileStore(tmp_path / "store")
    cb = Publish(store, every_n_steps=3, fold_every=3)
    trainer = veloce.Trainer(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), progress=False,
                             callbacks=[cb])  # fmt: skip
    trainer.fit(data(32 * 7))
    assert cb.published == [(3, 1), (6, 2), (7, 3)]
    assert [store.manifest(v)["kind"] for v in store.committed()] == ["full", "delta", "delta"]
    assert cb.publisher is None and cb.version == 3  # the lease is given back when fit returns
    twin = inference_twin(dlrm().to(device), store)
    assert all(t.table.device.type == torch.device(device).type for t in twin.embeddings.values())
    assert_twin_equal(model, twin, device)
    # a second fit goes on publishing into the same store; the twin follows with refresh
    trainer.max_epochs = 2
    trainer.fit(data(32 * 7))
    assert [v for _, v in cb.published] == [1, 2, 3, 4, 5, 6]
    assert refresh(twin) == 6
    assert_twin_equal(model, twin, device)


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


# ---- the config's serving section ---------------------------------------------------------------
def config(tmp_path, **serving):
    from veloce.train.config import parse_config

    return parse_config({
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "data": {"samples": 32 * 5, "val_samples": 64, "batch_size": 32, "num_dense": 4, "num_sparse": 2,
                 "id_space": 300},
        "trainer": {"run_dir": str(tmp_path / "run"), "progress": False},
        "serving": serving,
    })  # fmt: skip


def test_config_serving_section_publishes_a_run_whose_twin_equals_the_model(tmp_path):
    from veloce.train.build import build_loaders, build_model, build_trainer

    cfg = config(tmp_path, store="file", path=str(tmp_path / "store"), every_n_steps=2, dtype="float32")
    assert cfg.serving.namespace == "veloce" and cfg.serving.keep_last == 3
    model = build_model(cfg, torch.device("cpu"))
    train, _ = build_loaders(cfg)
    trainer = build_trainer(cfg, model, checkpoints=False)
    (cb,) = [c for c in trainer.callbacks if isinstance(c, Publish)]
    trainer.fit(train)
    assert cb.published == [(2, 1), (4, 2), (5, 3)]
    twin = inference_twin(build_model(cfg, torch.device("cpu")), FileStore(tmp_path / "store"))
    model.eval()
    with torch.no_grad():
        for (dense, sparse), _ in build_loaders(cfg)[1]:
            assert torch.equal(model(dense, sparse), twin(dense, sparse))
    assert not [c for c in build_trainer(cfg, model, publish=False).callbacks if isinstance(c, Publish)]


def test_config_serving_off_by_default_and_built_per_store(tmp_path):
    from veloce.ops import rocksdb
    from veloce.serving import RocksDBStore
    from veloce.train.build import build_publish

    assert build_publish(config(tmp_path)) is None
    cb = build_publish(config(tmp_path, store="file", path=str(tmp_path / "f"), dtype="bfloat16", fold_every=4))
    assert isinstance(cb.store, FileStore) and cb.at_end and cb.every_n_steps is None
    assert cb._publisher_args["dtype"] is torch.bfloat16 and cb._publisher_args["fold_every"] == 4
    if rocksdb.available():
        assert isinstance(build_publish(config(tmp_path, store="rocksdb", path=str(tmp_path / "r"))).store, RocksDBStore)


@pytest.mark.parametrize("serving, message", [
    ({"store": "file"}, "serving.path must be the store's directory with store file, got None"),
    ({"store": "file", "path": "x", "url": "redis://h"}, "serving.url must be null with store file"),
    ({"store": "redis"}, "serving.url must be the Redis server's URL"),
    ({"store": "redis", "url": "redis://h", "path": "x"}, "serving.path must be null with store redis"),
    ({"store": "file", "path": "x", "at_end": False}, "serving.at_end must be true when every_n_steps is null"),
    ({"store": "file", "path": "x", "every_n_steps": 0}, "serving.every_n_steps must be a positive number, got 0"),
    ({"store": "s3"}, "serving.store must be one of"),
])  # fmt: skip
def test_config_serving_errors_name_the_field(tmp_path, serving, message):
    from veloce.train.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, **serving)


def test_veloce_train_publishes_through_the_serving_section_and_evaluate_does_not(tmp_path, capsys):
    import yaml

    from veloce import cli

    raw = {"model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "data": {"samples": 256, "val_samples": 128, "batch_size": 64, "num_dense": 4, "num_sparse": 2,
                    "id_space": 300},
           "trainer": {"run_dir": str(tmp_path / "run"), "progress": False},
           "serving": {"store": "file", "path": str(tmp_path / "store"), "every_n_steps": 2}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(tmp_path / "c.yaml")]) == 0
    store = FileStore(tmp_path / "store")
    assert store.committed() == [1, 2]  # steps 2 and 4 (the last step: not published twice)
    assert cli.main(["evaluate", str(tmp_path / "c.yaml"), "--checkpoint", str(tmp_path / "run" / "checkpoints")]) == 0
    assert store.committed() == [1, 2]
    capsys.readouterr()
