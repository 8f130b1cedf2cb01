"""RedisStore against a real redis-server (started here on a free port in a temp dir, and
stopped): round trips through the inference twin, the lease, deletion of superseded
versions, and an unreachable server. Skipped when redis-server or redis-py is missing."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from _twin_model import Trainer, TwoTables, eval_batches
from conftest import DEVICES
from veloce.serving import LeaseHeld, Publisher, inference_twin, refresh

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server is not installed (apt-get install redis-server)")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis")
    for _ in range(5):  # a port another process takes between the probe and the bind: try another
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        if proc.poll() is None:
            break
    else:
        pytest.skip("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trips(redis_url, device):
    from veloce.serving import RedisStore

    model = TwoTables(device=device)
    trainer = Trainer(model)
    store = RedisStore(redis_url, f"rt_{device}")
    pub = Publisher(store, model, keep_last=2, fold_every=3)
    twin = None
    for _ in range(5):
        trainer.steps(2)
        v = pub.publish()
        if twin is None:
            twin = inference_twin(TwoTables(device=device), RedisStore(redis_url, f"rt_{device}"))
        else:
            assert refresh(twin) == v
        batches = eval_batches(trainer)
        model.eval()
        with torch.no_grad():
            for x, w in batches:
                assert torch.equal(model(x, w), twin(x, w))
    assert store.committed() == [4, 5]  # v4 is a snapshot: 1 to 3 went
    assert not list(store.client.scan_iter(match=f"rt_{device}:p:1:*"))
    part = store.read_part(5, "t/a/r0")
    assert part["keys"].numel() == store.manifest(5)["tables"]["a"]["rows"][0]


def test_lease_and_broken_version(redis_url):
    from veloce.serving import RedisStore

    model = TwoTables()
    trainer = Trainer(model)
    store = RedisStore(redis_url, "lease")
    first = Publisher(store, model, lease_ttl=0.5)
    with pytest.raises(LeaseHeld, match="leased to another publisher"):
        Publisher(RedisStore(redis_url, "lease"), model)
    trainer.steps(1)
    first.publish()
    store.begin(2)  # a publisher that died after writing a part of version 2
    store.write_part(2, "t/a/r0", {"keys": torch.tensor([1]), "weights": torch.ones(1, 8), "removed": torch.tensor([], dtype=torch.long)})
    time.sleep(0.6)
    second = Publisher(RedisStore(redis_url, "lease"), model)
    assert second.publish() == 3 and store.committed() == [1, 3] and store.begun() == [1, 3]
    with pytest.raises(LeaseHeld):
        first.publish()
    second.close()


def test_unreachable():
    from veloce.serving import RedisStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match="cannot reach Redis"):
        RedisStore(f"redis://127.0.0.1:{port}/0", "x", timeout=2)
