"""RedisStore's lease against a real redis-server (test_redis.py's): it records its
holder's process, a refusal names it, the same owner renews it, ``take_over_from`` takes a
running lease only from the owner named, and a version that does not exist is refused
with what to do. Skipped when redis-server or redis-py is missing."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from _twin_model import Trainer, TwoTables
from test_redis import SERVER, redis_url  # noqa: F401 (the fixture)

from veloce.serving import LeaseHeld, Publisher, RedisStore, VersionMissing, inference_twin

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server is not installed (apt-get install redis-server)")


def test_lease_holder_refusal_and_take_over(redis_url):  # noqa: F811
    store = RedisStore(redis_url, "lease")
    store.acquire("job-a", 60)
    holder = store.lease()
    assert (holder["owner"], holder["pid"], holder["host"]) == ("job-a", os.getpid(), socket.gethostname())
    assert 50 < holder["expires"] - time.time() <= 60
    with pytest.raises(LeaseHeld) as info:
        Publisher(RedisStore(redis_url, "lease"), TwoTables())
    assert info.value.holder["owner"] == "job-a"
    assert f"'job-a', process {os.getpid()} on {socket.gethostname()}, until " in str(info.value)
    with pytest.raises(LeaseHeld, match="not known to be dead"):
        Publisher(RedisStore(redis_url, "lease"), TwoTables(), take_over=True)  # a live holder: this process
    store.acquire("job-a", 60)  # its own: renewed
    with pytest.raises(LeaseHeld):
        store.acquire("job-b", 60, take_over_from="job-c")  # only from the owner named
    store.acquire("job-b", 60, take_over_from="job-a")
    assert store.lease()["owner"] == "job-b"
    store.release("job-a")  # not its lease any more: kept
    assert store.lease()["owner"] == "job-b"
    store.release("job-b")
    assert store.lease() is None
    store.client.set(store._k("lease"), "bare-name", px=60_000)  # a lease of a bare name still names its owner
    with pytest.raises(LeaseHeld, match="'bare-name'"):
        store.acquire("job-a", 60)
    store.client.delete(store._k("lease"))


def test_missing_version_says_what_to_do(redis_url):  # noqa: F811
    store = RedisStore(redis_url, "missing")
    with pytest.raises(VersionMissing, match="it holds none .*publish one first, or check the namespace"):
        store.manifest(1)
    model = TwoTables()
    Trainer(model).steps(2)
    with Publisher(store, model) as pub:
        pub.publish()
    with pytest.raises(VersionMissing, match=r"no committed version 4 \(committed: \[1\]\); pass one of them, or None"):
        inference_twin(TwoTables(), store, version=4)
    with pytest.raises(VersionMissing, match=r"no committed version 4 \(committed: \[1\]\)"):
        store.read_part(4, "dense")
    assert json.loads(store.client.get(store._k("m", 1)))["version"] == 1
