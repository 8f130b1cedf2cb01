"""veloce.storage.rocksdb.RocksDBStore against a reference dict of entries, its layout
check, persistence, chunked export, and its faults (a locked path, another layout, a full
disk, a writer killed mid-batch, bad paths)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from veloce.ops import rocksdb as rocksdb_ops
from veloce.storage import rocksdb as rocksdb_storage
from veloce.storage.rocksdb import RocksDB, RocksDBStore

pytestmark = pytest.mark.skipif(
    not rocksdb_ops.available(),
    reason="veloce._rocksdb is not built (RocksDB was not found at build time: apt-get install librocksdb-dev, "
    "then rebuild)",
)

DIM, STATE = 6, 3


def rows_of(ids: torch.Tensor, dtype: torch.dtype = torch.float32, dim: int = DIM, salt: int = 0) -> torch.Tensor:
    """Rows that are a function of (id, salt), exact in every dtype."""
    base = (ids.double().unsqueeze(1) * 0.5 + torch.arange(dim, dtype=torch.float64) + salt) % 512
    return base.to(dtype)


def state_of(ids: torch.Tensor, salt: int = 0, dim: int = STATE) -> torch.Tensor:
    return (-(ids.double().unsqueeze(1) % 1000) - torch.arange(dim, dtype=torch.float64) - salt).float()


class Reference:
    """The store's semantics over a dict: id -> (row, state, score)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def put(self, ids, weights, state, scores) -> None:
        for i, k in enumerate(ids.tolist()):
            self.entries[k] = (weights[i].clone(), state[i].clone(), int(scores[i]))

    def take(self, ids) -> None:
        for k in ids.tolist():
            self.entries.pop(k, None)

    def erase(self, ids) -> int:
        return sum(self.entries.pop(k, None) is not None for k in set(ids.tolist()))

    def lowest(self, n: int) -> list[int]:
        return [k for k, _ in sorted(self.entries.items(), key=lambda kv: (kv[1][2], kv[0]))[:n]]

    def check_entries(self, ids, entries) -> None:
        found, weights, state, scores = entries
        for i, k in enumerate(ids.tolist()):
            assert bool(found[i]) == (k in self.entries), k
            if k in self.entries:
                w, s, sc = self.entries[k]
                assert torch.equal(weights[i], w) and torch.equal(state[i], s) and int(scores[i]) == sc, k

    def check_all(self, store: RocksDBStore) -> None:
        assert len(store) == len(self.entries)
        seen = []
        for chunk in store.chunks(7):
            assert 1 <= chunk["keys"].numel() <= 7
            seen += chunk["keys"].tolist()
            self.check_entries(chunk["keys"], (torch.ones(len(chunk["keys"]), dtype=torch.bool), chunk["weights"],
                                               chunk["optimizer_state"], chunk["scores"]))  # fmt: skip
        assert seen == sorted(self.entries)


def open_store(path, dtype=torch.float32, **kwargs) -> RocksDBStore:
    return RocksDBStore(path, DIM, STATE, dtype, torch.float32, block_cache_bytes=1 << 20,
                        write_buffer_bytes=1 << 20, **kwargs)  # fmt: skip


def random_ids(rng: random.Random, n: int, space: list[int]) -> torch.Tensor:
    return torch.tensor(rng.sample(space, n), dtype=torch.int64)


# ids spanning the int64 range (key order must be id order across the sign bit)
SPACE = [-(2**63), -(2**63) + 1, -5, -1, 0, 1, 2, 7, 1000, 2**40, 2**63 - 2, 2**63 - 1] + list(range(100, 160))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_ops_match_reference(tmp_path: Path, dtype: torch.dtype) -> None:
    rng = random.Random(dtype.itemsize)
    ref, store = Reference(), open_store(tmp_path / "db", dtype)
    for step in range(150):
        op = rng.choice(["get", "take", "put", "put", "put_fresh", "erase", "lowest", "reopen", "clear"])
        ids = random_ids(rng, rng.randint(0, 12), SPACE)
        if op == "get":
            ref.check_entries(ids, store.get(ids))
        elif op == "take":
            ref.check_entries(ids, store.take(ids))
            ref.take(ids)
        elif op in ("put", "put_fresh"):
            if op == "put_fresh":
                ids = ids[[k not in ref.entries for k in ids.tolist()]]
            scores = torch.tensor([rng.randint(0, 5) for _ in ids.tolist()], dtype=torch.int64)
            args = (ids, rows_of(ids, dtype, salt=step), state_of(ids, step), scores)
            store.put(*args, fresh=op == "put_fresh")
            ref.put(*args)
        elif op == "erase":
            ids = torch.cat([ids, ids[:2]])  # duplicates are counted once
            assert store.erase(ids) == ref.erase(ids)
        elif op == "lowest":
            n = rng.randint(0, 15)
            assert store.lowest(n).tolist() == ref.lowest(n)
        elif op == "reopen":
            store.close()
            store = open_store(tmp_path / "db", dtype)
        elif op == "clear" and rng.random() < 0.3:
            store.clear()
            ref.entries.clear()
        assert len(store) == len(ref.entries), (step, op)
    ref.check_all(store)
    store.close()


def test_state_machine(tmp_path_factory: pytest.TempPathFactory) -> None:
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

    id_lists = st.lists(st.sampled_from(SPACE[:20]), max_size=8, unique=True).map(
        lambda xs: torch.tensor(xs, dtype=torch.int64)
    )

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.path = tmp_path_factory.mktemp("sm") / "db"
            self.store, self.ref, self.step = open_store(self.path), Reference(), 0

        @rule(ids=id_lists, score=st.integers(-3, 3))
        def put(self, ids, score):
            self.step += 1
            args = (ids, rows_of(ids, salt=self.step), state_of(ids, self.step), torch.full_like(ids, score))
            self.store.put(*args)
            self.ref.put(*args)

        @rule(ids=id_lists)
        def take(self, ids):
            self.ref.check_entries(ids, self.store.take(ids))
            self.ref.take(ids)

        @rule(ids=id_lists)
        def get(self, ids):
            self.ref.check_entries(ids, self.store.get(ids))

        @rule(ids=id_lists)
        def erase(self, ids):
            assert self.store.erase(ids) == self.ref.erase(ids)

        @rule(n=st.integers(0, 25))
        def lowest(self, n):
            assert self.store.lowest(n).tolist() == self.ref.lowest(n)

        @rule()
        def reopen(self):
            self.store.close()
            self.store = open_store(self.path)

        @invariant()
        def count(self):
            assert len(self.store) == len(self.ref.entries)

        def teardown(self):
            self.ref.check_all(self.store)
            self.store.close()

    hypothesis.stateful.run_state_machine_as_test(
        StoreMachine, settings=settings(max_examples=20, stateful_step_count=15, deadline=None)
    )


def test_reopen_keeps_entries_and_count(tmp_path: Path) -> None:
    ids = torch.arange(-50, 50)
    with open_store(tmp_path / "db") as store:
        store.put(ids, rows_of(ids), state_of(ids), ids.clone())
        store.take(ids[:10])
        store.erase(ids[10:20])
        store.flush()
    with open_store(tmp_path / "db") as store:
        assert len(store) == 80
        found, w, s, sc = store.get(ids)
        assert found.tolist() == [False] * 20 + [True] * 80
        assert torch.equal(w[20:], rows_of(ids[20:])) and torch.equal(s[20:], state_of(ids[20:]))
        assert torch.equal(sc[20:], ids[20:])
        assert store.lowest(3).tolist() == [-30, -29, -28]


def test_float64_rows_and_state(tmp_path: Path) -> None:
    ids = torch.tensor([3, 1, 2])
    w, s = torch.randn(3, DIM, dtype=torch.float64), torch.randn(3, STATE, dtype=torch.float64)
    with RocksDBStore(tmp_path / "db", DIM, STATE, torch.float64) as store:
        assert store.state_dtype == torch.float64
        store.put(ids, w, s, torch.zeros(3, dtype=torch.int64))
        found, w2, s2, _ = store.get(ids.flip(0))
        assert found.all() and torch.equal(w2, w.flip(0)) and torch.equal(s2, s.flip(0))


def test_chunks_of_100k_entries_are_bounded(tmp_path: Path) -> None:
    n = 100_000
    ids = torch.randperm(4 * n)[:n] - 2 * n
    with RocksDBStore(tmp_path / "db", 4, 0, write_buffer_bytes=4 << 20) as store:
        for part in ids.split(16_384):
            store.put(part, rows_of(part, dim=4), torch.zeros(len(part), 0), part.clone(), fresh=True)
        assert len(store) == n
        seen = 0
        last = None
        for chunk in store.chunks(3000):
            keys = chunk["keys"]
            assert 1 <= keys.numel() <= 3000 and chunk["optimizer_state"].shape == (keys.numel(), 0)
            assert bool((keys[1:] > keys[:-1]).all()) and (last is None or int(keys[0]) > last)
            assert torch.equal(chunk["weights"], rows_of(keys, dim=4)) and torch.equal(chunk["scores"], keys)
            seen, last = seen + keys.numel(), int(keys[-1])
        assert seen == n
        assert store.lowest(5).tolist() == ids.sort().values[:5].tolist()
        assert store.stats()["rocksdb_entries"] == n


def test_log_files_stay_bounded(tmp_path: Path) -> None:
    """Every batch also writes the count record, in a family whose memtable never fills: the
    write-ahead logs must still be freed as the rows' memtables are flushed."""
    path = tmp_path / "db"
    with RocksDBStore(path, 64, 64, write_buffer_bytes=1 << 20) as store:
        for b in range(40):  # 40 batches of 512 KiB: 20 write buffers
            ids = torch.arange(b * 1024, (b + 1) * 1024)
            store.put(ids, rows_of(ids, dim=64), state_of(ids, dim=64), ids, fresh=True)
        logs = sum(f.stat().st_size for f in path.glob("*.log"))
        assert logs <= 4 << 20, f"{logs} bytes of write-ahead log for 2 MiB of write buffers"
        store.compact()
        per_row = sum(f.stat().st_size for f in path.iterdir()) / len(store)
        assert per_row < 1.1 * (8 + 64 * 4 + 64 * 4 + 8) + 100  # the payload, a few percent, the small files


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    with open_store(tmp_path / "db") as store:
        with pytest.raises(ValueError, match="ids must be distinct, got 4 more than once"):
            store.get(torch.tensor([4, 1, 4]))
        with pytest.raises(ValueError, match="ids must be int64"):
            store.get(torch.tensor([4, 1], dtype=torch.int32))
        ids = torch.tensor([1, 2])
        with pytest.raises(ValueError, match="weights must be Float .*got Half"):
            store.put(ids, rows_of(ids, torch.float16), state_of(ids), ids)
        with pytest.raises(ValueError, match=r"optimizer_state must have shape \[2, 3\]"):
            store.put(ids, rows_of(ids), state_of(ids, dim=2), ids)
        assert len(store) == 0
    with pytest.raises(RuntimeError, match="is closed"):
        len(store)


def test_another_layout_is_refused_naming_both(tmp_path: Path) -> None:
    open_store(tmp_path / "db").close()
    with pytest.raises(ValueError, match=r"another table layout.*dim=6 state_dim=3 dtype=float32.*"
                                         r"dim=6 state_dim=3 dtype=bfloat16"):  # fmt: skip
        open_store(tmp_path / "db", torch.bfloat16)
    with pytest.raises(ValueError, match=r"holds \[.*dim=6 .*\] but this table is \[.*dim=7 "):
        RocksDBStore(tmp_path / "db", 7, STATE)
    open_store(tmp_path / "db").close()  # the refused opens left it usable


def test_a_database_of_another_program_is_refused(tmp_path: Path) -> None:
    """A RocksDB database written through RocksDB's C API (only the default column family)."""
    name = ctypes.util.find_library("rocksdb")
    if name is None:
        pytest.skip("librocksdb is not on the library path")
    lib = ctypes.CDLL(name)
    lib.rocksdb_options_create.restype = lib.rocksdb_writeoptions_create.restype = ctypes.c_void_p
    lib.rocksdb_open.restype = ctypes.c_void_p
    lib.rocksdb_open.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
    lib.rocksdb_put.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p)]  # fmt: skip
    lib.rocksdb_options_set_create_if_missing.argtypes = [ctypes.c_void_p, ctypes.c_ubyte]
    lib.rocksdb_close.argtypes = [ctypes.c_void_p]
    options, err = lib.rocksdb_options_create(), ctypes.c_char_p()
    lib.rocksdb_options_set_create_if_missing(options, 1)
    db = lib.rocksdb_open(options, str(tmp_path / "db").encode(), ctypes.byref(err))
    assert db and not err.value, err.value
    lib.rocksdb_put(db, lib.rocksdb_writeoptions_create(), b"key", 3, b"value", 5, ctypes.byref(err))
    lib.rocksdb_close(db)
    with pytest.raises(RuntimeError, match=r"is not a veloce store \(its column families are default\)"):
        open_store(tmp_path / "db")


def test_bad_paths(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="file exists and is not a directory"):
        open_store(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_store(tmp_path / "missing" / "db")


def _child(code: str, *args: str, **popen) -> subprocess.Popen:
    """``code`` in a fresh Python that imports this checkout's veloce."""
    prelude = "import sys, torch\nfrom veloce.storage.rocksdb import RocksDBStore\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code), *args], env=dict(os.environ),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)  # fmt: skip


def test_path_held_by_another_process(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    child = _child("""
        store = RocksDBStore(sys.argv[1], 6, 3)
        print("ready", flush=True)
        sys.stdin.readline()
    """, path, stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with pytest.raises(RuntimeError, match=f"{path} is in use by another process"):
            open_store(path)
    finally:
        child.communicate("\n", timeout=60)
    open_store(path).close()  # free once the holder exits


# a writer of numbered batches: batch b puts ids [b*B, (b+1)*B) (and with "erase", erases
# the first half of batch b-1), and prints b once the store returned
WRITER = """
    import resource, signal
    path, limit, erase, B = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "erase", 500
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    store = RocksDBStore(path, 16, 32, write_buffer_bytes=8 << 20)
    for b in range(100000):
        ids = torch.arange(b * B, (b + 1) * B)
        try:
            store.put(ids, ids.float().unsqueeze(1).expand(B, 16), -ids.float().unsqueeze(1).expand(B, 32), ids)
            if erase:
                store.erase(torch.arange((b - 1) * B, (b - 1) * B + B // 2))
        except RuntimeError as e:
            print("error", str(e).replace(chr(10), " "), flush=True)
            break
        print(b, flush=True)
"""
B = 500


def _batches_held(path: str, erase: bool) -> tuple[int, int]:
    """Reopens the writer's store and returns (batches whose puts are held, entries); asserts
    that they are a prefix of the batches, each whole, with the count exact."""
    with RocksDBStore(path, 16, 32) as store:
        n = len(store)
        top = max((c["keys"].max().item() for c in store.chunks(10_000)), default=-1)
        k = (top + 1) // B  # batches 0..k-1 put
        ids = torch.arange(0, (k + 2) * B)
        found, w, s, sc = store.get(ids)
        expect = torch.zeros(len(ids), dtype=torch.bool)
        expect[: k * B] = True
        for b in range(k - 2 if erase else 0):  # each later batch erased the first half of the one before it
            expect[b * B : b * B + B // 2] = False
        if erase and k >= 2:  # the last batch's erase (its own WriteBatch) may not have run
            half = found[(k - 2) * B : (k - 2) * B + B // 2]
            assert half.all() or not half.any(), "an erase landed in part"
            expect[(k - 2) * B : (k - 2) * B + B // 2] = half
        assert torch.equal(found, expect), f"not a prefix of whole batches (k={k})"
        assert n == int(expect.sum()), "the count record disagrees with the entries"
        assert torch.equal(w[found][:, 0], ids[found].float()) and torch.equal(s[found][:, 5], -ids[found].float())
        assert torch.equal(sc[found], ids[found])
        return k, n


def test_full_disk_fails_the_write_and_keeps_the_batches_before(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    child = _child(WRITER, path, str(3 << 20), "put")
    out, err = child.communicate(timeout=300)
    lines = out.split("\n")
    error = [line for line in lines if line.startswith("error")]
    assert error, f"the writer never hit the file size limit: {out[-500:]} {err[-2000:]}"
    assert "RocksDB put at" in error[0] and "failed and wrote none of its 500 records" in error[0]
    assert "full disk or a file size limit" in error[0], error[0]
    done = [int(line) for line in lines if line.strip().isdigit()]
    assert len(done) >= 10
    k, n = _batches_held(path, erase=False)
    assert k == len(done) and n == k * B


def test_killed_writer_leaves_a_prefix_of_whole_batches(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    child = _child(WRITER, path, "0", "erase")
    done = 0
    for line in child.stdout:
        done = int(line)
        if done >= 30:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    k, _ = _batches_held(path, erase=True)
    assert k >= done + 1, "a batch the writer saw returned is missing"


def test_spec_validation_and_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RocksDB: give exactly one of cache_rows"):
        RocksDB(str(tmp_path / "db"))
    with pytest.raises(ValueError, match="policy must be 'lru', 'lfu' or None"):
        RocksDB(str(tmp_path / "db"), cache_rows=10, policy="fifo")
    with pytest.raises(ValueError, match="cache_rows must be an int >= 1, got 0"):
        RocksDB(str(tmp_path / "db"), cache_rows=0)
    with pytest.raises(ValueError, match="write_buffer_bytes must be an int >= 1048576"):
        RocksDB(str(tmp_path / "db"), cache_rows=10, write_buffer_bytes=10)
    with pytest.raises(ValueError, match="path must be a directory path"):
        RocksDB("", cache_rows=10)
    spec = RocksDB(str(tmp_path / "db"), cache_bytes=1 << 20)
    # the cache's bytes per row are HostCached's: row, state, key, score, digest at 1.25 slots a row
    assert spec.rows_for(128, 256, torch.float32) == int((1 << 20) // (1553 / 0.8))
    assert RocksDB(str(tmp_path / "db"), cache_rows=5).rows_for(128, 256, torch.float32) == 5
    with pytest.raises(ValueError, match="holds no row"):
        RocksDB(str(tmp_path / "db"), cache_bytes=100).rows_for(128, 256, torch.float32)


def test_make_table_builds_the_tiered_table_over_the_store(tmp_path: Path) -> None:
    from veloce.storage import TieredTable

    spec = RocksDB(str(tmp_path / "db"), cache_rows=100, policy="lfu")
    table = spec.make_table(dim=8, state_dim=16, dtype=torch.bfloat16, seed=3, eviction="lfu")
    assert isinstance(table, TieredTable) and isinstance(table.store, RocksDBStore)
    store = table.store
    assert (store.dim, store.state_dim, store.dtype, store.state_dtype) == (8, 16, torch.bfloat16, torch.float32)
    assert table.stats()["cache_capacity"] == 100
    store.close()


def test_missing_extension_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rocksdb_ops, "_loaded", False)
    with pytest.raises(ImportError, match=r"apt-get install librocksdb-dev.*pip install"):
        RocksDB(str(tmp_path / "db"), cache_rows=10).make_table(dim=4, state_dim=0)
    with pytest.raises(ImportError, match="apt-get install librocksdb-dev"):
        RocksDBStore(tmp_path / "db", 4, 0)
