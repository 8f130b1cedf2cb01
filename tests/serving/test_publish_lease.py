"""The publisher's lease on a FileStore: a refusal says who holds it, until when and the
ways on; a publisher of the same owner renews it (a restarted run goes on at once);
``take_over=True`` takes the lease of a dead process of this host only; the YAML
``serving:`` section passes lease_ttl, owner and take_over to the publisher."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _twin_model import Trainer, TwoTables, eval_batches

from veloce.serving import FileStore, LeaseHeld, Publisher, inference_twin
from veloce.serving.store import lease_holder_gone, lease_record

ROOT = Path(__file__).resolve().parents[2]

# A publisher that takes the store's lease under ``owner``, publishes, and is killed.
KILLED = """
import os, signal, sys
sys.path.insert(0, {here!r})
from _twin_model import TwoTables
from veloce.serving import FileStore, Publisher
Publisher(FileStore({path!r}), TwoTables(), owner={owner!r}).publish()
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_publisher(path: str, owner: str) -> None:
    """Runs :data:`KILLED` to its SIGKILL: its lease (600 s) runs on, its process is gone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    script = KILLED.format(here=str(Path(__file__).parent), path=path, owner=owner)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def assert_twin_equal(model, store):
    twin = inference_twin(TwoTables(), store)
    batches = eval_batches(Trainer(model, seed=5))
    model.eval()
    with torch.no_grad():
        for x, w in batches:
            assert torch.equal(model(x, w), twin(x, w))


def test_refusal_names_the_holder_its_end_and_the_ways_on(tmp_path):
    first = Publisher(FileStore(tmp_path), TwoTables(), owner="ctr-job", lease_ttl=120)
    with pytest.raises(LeaseHeld) as info:
        Publisher(FileStore(tmp_path), TwoTables())
    message, holder = str(info.value), info.value.holder
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["expires"]))
    for text in ("leased to another publisher, 'ctr-job'", f"process {os.getpid()} on {socket.gethostname()}",
                 f"until {until}", "s from now", "owner", "take_over=True", "serving.lease_ttl"):  # fmt: skip
        assert text in message, (text, message)
    assert holder["owner"] == "ctr-job" and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert 100 < holder["expires"] - time.time() <= 120
    assert FileStore(tmp_path).lease()["owner"] == "ctr-job"
    first.close()
    assert FileStore(tmp_path).lease() is None


def test_a_restart_under_the_same_owner_goes_on_at_once(tmp_path):
    path = str(tmp_path / "store")
    killed_publisher(path, owner="ctr-job")
    store = FileStore(path)
    assert store.committed() == [1] and store.lease()["owner"] == "ctr-job"
    with pytest.raises(LeaseHeld, match="'ctr-job'"):
        Publisher(store, TwoTables())  # another name: refused while the dead one's lease runs
    model = TwoTables()
    trainer = Trainer(model)
    pub = Publisher(store, model, owner="ctr-job")  # the same name: its own lease, renewed
    trainer.steps(2)
    assert pub.publish() == 2 and store.committed() == [1, 2]
    assert_twin_equal(model, store)
    pub.close()


def test_take_over_takes_the_lease_of_a_dead_process_of_this_host_only(tmp_path):
    path = str(tmp_path / "store")
    killed_publisher(path, owner="dead-job")
    store = FileStore(path)
    holder = store.lease()
    assert holder["owner"] == "dead-job" and holder["host"] == socket.gethostname() and lease_holder_gone(holder)

    # a live holder (this process) is never taken over, nor one of another host
    live = Publisher(FileStore(tmp_path / "live"), TwoTables(), owner="live-job")
    with pytest.raises(LeaseHeld, match="take_over=True was given, but the holder is not known to be dead"):
        Publisher(FileStore(tmp_path / "live"), TwoTables(), take_over=True)
    live.close()
    other = tmp_path / "other"
    FileStore(other)
    record = {**lease_record("remote-job", time.time() + 600), "host": "not-" + socket.gethostname(), "pid": 1}
    (other / "lease.json").write_text(json.dumps(record))
    assert not lease_holder_gone(record)
    with pytest.raises(LeaseHeld, match=f"not a process of this host, {socket.gethostname()}"):
        Publisher(FileStore(other), TwoTables(), take_over=True)

    # the dead one's
    model = TwoTables()
    trainer = Trainer(model)
    with pytest.warns(RuntimeWarning, match="took over the lease .* from 'dead-job'"):
        pub = Publisher(store, model, take_over=True)
    assert store.lease()["owner"] == pub.owner and store.lease()["pid"] == os.getpid()
    trainer.steps(2)
    assert pub.publish() == 2
    assert_twin_equal(model, store)
    with pytest.raises(LeaseHeld):
        Publisher(FileStore(path), TwoTables(), take_over=True)  # held by a live process (this one)
    pub.close()


def test_lease_arguments_are_checked(tmp_path):
    for bad in (0, -1.0, float("inf"), "60", True):
        with pytest.raises(ValueError, match=f"lease_ttl must be a number of seconds > 0, got {bad!r}"):
            Publisher(FileStore(tmp_path), TwoTables(), lease_ttl=bad)
    with pytest.raises(ValueError, match="owner must be None or a non-empty str, got ''"):
        Publisher(FileStore(tmp_path), TwoTables(), owner="")


def test_config_serving_section_passes_the_lease_settings(tmp_path):
    from veloce.train.build import build_publish
    from veloce.train.config import ConfigError, parse_config

    serving = {"store": "file", "path": str(tmp_path / "f")}
    cb = build_publish(parse_config({"serving": {**serving, "lease_ttl": 30, "owner": "ctr-job", "take_over": True}}))
    assert {k: cb._publisher_args[k] for k in ("lease_ttl", "owner", "take_over")} == \
        {"lease_ttl": 30, "owner": "ctr-job", "take_over": True}  # fmt: skip
    defaults = build_publish(parse_config({"serving": serving}))._publisher_args
    assert (defaults["lease_ttl"], defaults["owner"], defaults["take_over"]) == (600.0, None, False)
    for bad, message in (({"lease_ttl": 0}, "serving.lease_ttl must be a positive number, got 0"),
                         ({"lease_ttl": "soon"}, "serving.lease_ttl must be a number, got 'soon'"),
                         ({"owner": ""}, "serving.owner must be null"),
                         ({"take_over": "yes"}, "serving.take_over must be true or false, got 'yes'")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            parse_config({"serving": {**serving, **bad}})
