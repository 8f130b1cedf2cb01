"""veloce.data: the Criteo TSV reader on real sample files, and the synthetic generator."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from veloce.data import MISSING_ID, CriteoTSV, DataError, SyntheticClicks, expected_auc, raw_ids
from veloce.metrics import AUC

_REPO = Path(__file__).resolve().parents[2]


def _data_dir() -> Path | None:
    """$VELOCE_DATA_DIR, else ../shared/data next to the repository (or next to the
    folder holding it, for a git worktree kept one level deeper)."""
    env = os.environ.get("VELOCE_DATA_DIR")
    if env:
        return Path(env)
    for cand in (_REPO.parent / "shared" / "data", _REPO.parent.parent / "shared" / "data"):
        if cand.is_dir():
            return cand
    return None


DATA = _data_dir()
TRAIN = DATA / "criteo" / "criteo_kaggle_train_sample.tsv" if DATA else None
TEST = DATA / "criteo" / "criteo_kaggle_test_sample.tsv" if DATA else None
needs_criteo = pytest.mark.skipif(
    TRAIN is None or not TRAIN.is_file() or not TEST.is_file(),
    reason="Criteo samples not found: set VELOCE_DATA_DIR or put shared/data next to the repository "
    "(../shared/data/criteo/criteo_kaggle_{train,test}_sample.tsv)",
)


def read_all(ds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    dense, sparse, label = [], [], []
    for (d, s), y in ds:
        dense.append(d)
        sparse.append(s)
        label.append(y)
    lab = None if label[0] is None else torch.cat(label)
    return torch.cat(dense), torch.cat(sparse), lab


def hex_ids(text: str) -> list[int]:
    return [int(v, 16) if v else MISSING_ID for v in text.split(",")]


# ---------------------------------------------------------------------------------- Criteo


@needs_criteo
def test_criteo_train_sample_rows_labels_and_batches():
    ds = CriteoTSV(TRAIN, batch_size=1000)
    batches = list(ds)
    assert [len(y) for _, y in batches] == [1000] * 8 + [18]
    dense, sparse, label = read_all(batches)
    assert dense.shape == (8018, 13) and dense.dtype == torch.float32
    assert sparse.shape == (8018, 26) and sparse.dtype == torch.int64
    assert label.dtype == torch.float32 and int(label.sum()) == 1912  # 23.8 % clicks
    assert ds.num_rows() == 8018
    assert (dense >= 0).all()  # log(1 + max(x, 0))
    assert sparse.max() < 2**32 and sparse.min() == MISSING_ID
    # C22 is missing in about 77 % of rows (README: "I12 77%, C22 77%")
    assert 0.6 < (sparse[:, 21] == MISSING_ID).float().mean() < 0.9
    assert len(list(CriteoTSV(TRAIN, batch_size=1000, drop_last=True))) == 8


@needs_criteo
def test_criteo_first_line_known_values():
    (dense, sparse), label = next(iter(CriteoTSV(TRAIN, batch_size=4, log_dense=False)))
    assert label.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert dense[0].tolist() == [1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2]  # I12 empty -> 0
    expected = hex_ids(
        "68fd1e64,80e26c9b,fb936136,7b4723c4,25c83c98,7e0ccccf,de7995b8,1f89b562,a73ee510,a8cd5504,"
        "b2cb9c98,37c9c164,2824a5f6,1adce6ef,8ba8b39a,891b62e7,e5ba7672,f54016b9,21ddcdc9,b1252a9d,"
        "07b5194c,,3a171ecb,c5c50484,e8b83407,9727dd16"
    )
    assert sparse[0].tolist() == expected
    assert sparse[1, 1].item() == 0xF0CF0024
    (dense_log, _), _ = next(iter(CriteoTSV(TRAIN, batch_size=4)))
    torch.testing.assert_close(dense_log, torch.log1p(dense.clamp(min=0)))


@needs_criteo
def test_criteo_test_layout():
    ds = CriteoTSV(TEST, batch_size=4096, has_label=False, log_dense=False)
    dense, sparse, label = read_all(ds)
    assert label is None and dense.shape == (8041, 13) and sparse.shape == (8041, 26)
    assert dense[0].tolist() == [0, 29, 50, 5, 7260, 437, 1, 4, 14, 0, 1, 0, 6]
    assert sparse[0, :6].tolist() == hex_ids("5a9ed9b0,a0e12995,a1e14474,08a40877,25c83c98,")
    assert sparse[1, 25].item() == 0xEE63DD9B
    # the wrong layout is refused with the file and line
    with pytest.raises(ValueError, match=r"criteo_kaggle_test_sample\.tsv:1: 39 tab-separated fields.*has_label=False"):
        next(iter(CriteoTSV(TEST, batch_size=8)))
    with pytest.raises(ValueError, match=r"train_sample\.tsv:1: 40 tab-separated fields.*has_label=True"):
        next(iter(CriteoTSV(TRAIN, batch_size=8, has_label=False)))


@needs_criteo
def test_criteo_pads_lines_with_stripped_trailing_fields_when_not_strict(tmp_path):
    # The raw-TSV copies in circulation strip trailing empty fields (README: pad to 40).
    lines = TRAIN.read_bytes().split(b"\n")[:400]
    stripped = [line.rstrip(b"\t") for line in lines]
    assert sum(len(s.split(b"\t")) < 40 for s in stripped) > 10  # the fixture does strip some
    short = tmp_path / "stripped.txt"
    short.write_bytes(b"\n".join(stripped) + b"\n")
    with pytest.raises(DataError, match=r"stripped\.txt:\d+: \d+ tab-separated fields, expected 40"):
        read_all(CriteoTSV(short, batch_size=128))  # strict by default
    got = read_all(CriteoTSV(short, batch_size=128, strict=False))
    want = read_all(CriteoTSV(TRAIN, batch_size=128, stop=400))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert CriteoTSV(short).num_rows() == 400


def assert_ranks_split_each_global_batch(per_rank: list[list], whole: list) -> None:
    """Every rank has as many batches as one process; step k's batches, concatenated in rank
    order, are one process's batch k; the ranks' parts differ by at most one row."""
    assert all(len(batches) == len(whole) for batches in per_rank)
    for k, want in enumerate(whole):
        parts = [batches[k] for batches in per_rank]
        sizes = [len(y) for _, y in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (k, sizes)
        for g, w in zip(read_all(parts), read_all([want])):
            assert torch.equal(g, w), k


@needs_criteo
@pytest.mark.parametrize("world_size", [2, 3])
def test_criteo_ranks_split_every_global_batch_without_dropping_a_row(world_size):
    """batch_size is the global batch: 3001 rows in batches of 256 are 12 steps on any number
    of ranks, the last of 185 rows; with batch_size 2 (fewer rows than 3 ranks in the last
    batch) a rank gets an empty batch rather than none. DataLoader workers keep the order."""
    whole = list(CriteoTSV(TRAIN, batch_size=256, stop=3001))
    assert len(whole) == 12 and len(whole[-1][1]) == 185
    per_rank = [list(CriteoTSV(TRAIN, batch_size=256, stop=3001, rank=r, world_size=world_size))
                for r in range(world_size)]  # fmt: skip
    assert_ranks_split_each_global_batch(per_rank, whole)
    with_workers = [list(DataLoader(CriteoTSV(TRAIN, batch_size=256, stop=3001, rank=r, world_size=world_size),
                                    batch_size=None, num_workers=2)) for r in range(world_size)]  # fmt: skip
    assert_ranks_split_each_global_batch(with_workers, whole)
    tiny = [list(CriteoTSV(TRAIN, batch_size=2, start=10, stop=15, rank=r, world_size=world_size))
            for r in range(world_size)]  # fmt: skip
    assert [[len(y) for _, y in t] for t in tiny][-1] == ([1, 1, 0] if world_size == 2 else [0, 0, 0])
    assert_ranks_split_each_global_batch(tiny, list(CriteoTSV(TRAIN, batch_size=2, start=10, stop=15)))
    (dense, sparse), label = tiny[-1][-1]
    assert dense.shape == (0, 13) and sparse.shape == (0, 26) and label.shape == (0,)


@needs_criteo
def test_criteo_workers_cover_each_row_once_in_order():
    full = read_all(CriteoTSV(TRAIN, batch_size=256, stop=3000))
    ds = CriteoTSV(TRAIN, batch_size=256, stop=3000)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    for g, w in zip(read_all(loader), full):
        assert torch.equal(g, w)


@needs_criteo
def test_criteo_row_range_for_time_split():
    full = read_all(CriteoTSV(TRAIN, batch_size=4096))
    tail = read_all(CriteoTSV(TRAIN, batch_size=300, start=7000, stop=10**9))
    head = read_all(CriteoTSV(TRAIN, batch_size=300, stop=7000))
    for f, h, t in zip(full, head, tail):
        assert torch.equal(torch.cat([h, t]), f)
    assert CriteoTSV(TRAIN, start=7000).num_rows() == 1018


@needs_criteo
def test_criteo_reads_gzip(tmp_path):
    lines = TRAIN.read_bytes().split(b"\n")[:50]
    gz = tmp_path / "part.tsv.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    for g, w in zip(
        read_all(CriteoTSV(gz, batch_size=64)), read_all(CriteoTSV(TRAIN, batch_size=64, stop=50))
    ):
        assert torch.equal(g, w)


GOOD = "0\t1\t\t-3\t" + "\t" * 10 + "\t".join(["0a1b2c3d"] * 26)


@pytest.mark.parametrize(
    "bad, message",
    [
        (GOOD + "\textra", r"bad\.tsv:3: 41 tab-separated fields, expected at most 40"),
        (GOOD.replace("0a1b2c3d", "zz1b2c3d", 1), r"bad\.tsv:3: field C1 \(column 15\) must be 8 hex digits"),
        (GOOD.replace("0a1b2c3d", "a1b2c3d", 1), r"bad\.tsv:3: field C1 .* got b'a1b2c3d'"),
        (GOOD.replace("0a1b2c3d", "0a1b2c3d0", 1), r"bad\.tsv:3: field C1 .* got b'0a1b2c3d0'"),
        ("2" + GOOD[1:], r"bad\.tsv:3: label must be 0 or 1, got b'2'"),
        (GOOD.replace("\t1\t", "\t1.5\t", 1), r"bad\.tsv:3: field I1 \(column 2\) must be an integer"),
        (GOOD.replace("\t1\t", "\t" + "9" * 30 + "\t", 1), r"bad\.tsv:3: field I1"),
        ("", r"bad\.tsv:3: 1 tab-separated fields, expected 40"),
        ("\t".join(GOOD.split("\t")[:39]), r"bad\.tsv:3: 39 tab-separated fields, expected 40 .*has_label=False"),
    ],
)
def test_criteo_malformed_line_names_file_line_and_field(tmp_path, bad, message):
    path = tmp_path / "bad.tsv"
    path.write_text(f"{GOOD}\n{GOOD}\n{bad}\n{GOOD}" + "\n")
    assert len(list(CriteoTSV(path, batch_size=2, stop=2))) == 1  # the good lines parse
    with pytest.raises(ValueError, match=message):
        list(CriteoTSV(path, batch_size=2))


def test_a_criteo_file_cut_in_its_last_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "cut.tsv"
    path.write_text(f"{GOOD}\n{GOOD}\n{GOOD[:25]}")  # a copy interrupted mid-field: no final newline
    with pytest.raises(DataError, match=r"cut\.tsv:3: the file ends inside this line \(\d+ of 40 .*no newline"):
        list(CriteoTSV(path, batch_size=2))
    path.write_text(f"{GOOD}\n{GOOD}\n" + "\t".join(GOOD.split("\t")[:20]))  # cut at a field's end
    with pytest.warns(UserWarning, match=r"cut\.tsv:3: the file ends inside this line \(20 of 40"):
        assert len(list(CriteoTSV(path, batch_size=2, strict=False))) == 2  # lenient: read, but said
    path.write_text(f"{GOOD}\n{GOOD}\n{GOOD}")  # a whole last line needs no newline
    assert CriteoTSV(path).num_rows() == 3 and next(iter(CriteoTSV(path)))[0][0].shape == (3, 13)


def test_a_criteo_line_cut_short_is_an_error_unless_strict_is_false(tmp_path):
    path = tmp_path / "short.tsv"
    short = "\t".join(GOOD.split("\t")[:20])
    path.write_text(f"{GOOD}\n{short}\n{GOOD}\n")
    with pytest.raises(DataError, match=r"short\.tsv:2: 20 tab-separated fields, expected 40 .*strict=False") as info:
        list(CriteoTSV(path, batch_size=8))
    assert (info.value.path, info.value.line) == (str(path), 2) and isinstance(info.value, ValueError)
    (dense, sparse), _ = next(iter(CriteoTSV(path, batch_size=8, strict=False, log_dense=False)))
    assert (sparse[1, 6:] == MISSING_ID).all() and (sparse[1, :6] == 0x0A1B2C3D).all() and dense[1, 0] == 1


def _gzip_lines(path: Path, n: int) -> bytes:
    lines = (GOOD.replace("0a1b2c3d", f"{i * 2654435761 % 2**32:08x}") for i in range(n))  # not too compressible
    data = gzip.compress("".join(f"{line}\n" for line in lines).encode(), mtime=0)
    path.write_bytes(data)
    return data


def test_a_truncated_gzip_names_the_file(tmp_path):
    path = tmp_path / "day.tsv.gz"
    data = _gzip_lines(path, 3000)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"day\.tsv\.gz: the compressed data ends after line \d+, before the end"):
        list(iter(CriteoTSV(path, batch_size=512)))  # (iter: list() would ask len(), which counts first)
    with pytest.raises(DataError, match=r"day\.tsv\.gz: the compressed data ends (after \d+ or more lines|at its start)"):
        CriteoTSV(path).num_rows()


def test_a_corrupt_gzip_names_the_file(tmp_path):
    path = tmp_path / "day.tsv.gz"
    data = bytearray(_gzip_lines(path, 3000))
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"day\.tsv\.gz: corrupt gzip data after line \d+"):
        list(iter(CriteoTSV(path, batch_size=512)))  # (iter: list() would ask len(), which counts first)
    path.write_bytes(b"not gzip at all\n")
    with pytest.raises(DataError, match=r"day\.tsv\.gz: corrupt gzip data at its start"):
        list(iter(CriteoTSV(path)))


@pytest.mark.parametrize("drop_last", [False, True])
def test_criteo_len_is_the_batches_each_rank_and_loader_yields(tmp_path, drop_last):
    path = tmp_path / "rows.tsv"
    path.write_text(f"{GOOD}\n" * 1000)
    for world in (1, 2, 3):
        for rank in range(world):
            ds = CriteoTSV(path, batch_size=64, start=30, stop=990, drop_last=drop_last, rank=rank, world_size=world)
            loader = DataLoader(ds, batch_size=None, num_workers=2 if rank == 0 else 0)
            assert len(loader) == len(ds) == len(list(loader)) > 0


def test_criteo_total_rows_spares_the_count_and_is_checked(tmp_path, monkeypatch):
    from veloce.data import criteo

    path = tmp_path / "rows.tsv"
    path.write_text(f"{GOOD}\n" * 100)
    monkeypatch.setattr(criteo, "_count_lines", lambda p: pytest.fail("counted the file"))
    ds = CriteoTSV(path, batch_size=16, stop=80, total_rows=100)
    assert len(ds) == 5 and len(list(ds)) == 5
    with pytest.raises(DataError, match=r"rows\.tsv: the data ends after 100 rows, but total_rows=120"):
        list(CriteoTSV(path, batch_size=16, total_rows=120))


def test_criteo_parses_negatives_missing_and_uppercase(tmp_path):
    path = tmp_path / "ok.tsv"
    path.write_text(GOOD.replace("0a1b2c3d", "FFFFFFFF", 1) + "\n" + "1" + "\t" * 39 + "\n")
    (dense, sparse), label = next(iter(CriteoTSV(path, log_dense=False)))
    assert label.tolist() == [0.0, 1.0]
    assert dense[0, :3].tolist() == [1, 0, -3]
    assert sparse[0, :2].tolist() == [0xFFFFFFFF, 0x0A1B2C3D]
    assert (sparse[1] == MISSING_ID).all() and (dense[1] == 0).all()
    (dense_log, _), _ = next(iter(CriteoTSV(path)))
    assert dense_log[0, 2].item() == 0.0  # negative -> log(1 + 0)


def test_criteo_argument_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        CriteoTSV(tmp_path / "missing.tsv")
    (tmp_path / "x.tsv").write_text(GOOD + "\n")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        CriteoTSV(tmp_path / "x.tsv", batch_size=0)
    with pytest.raises(ValueError, match="stop must be"):
        CriteoTSV(tmp_path / "x.tsv", start=5, stop=2)


# ---------------------------------------------------------------------------------- synthetic


def test_synthetic_shapes_and_determinism():
    a = SyntheticClicks(5000, batch_size=1000, seed=3)
    (dense, sparse), label = a.batch(0)
    assert dense.shape == (1000, 13) and dense.dtype == torch.float32
    assert sparse.shape == (1000, 26) and sparse.dtype == torch.int64
    assert label.shape == (1000,) and set(label.unique().tolist()) <= {0.0, 1.0}
    assert len(a) == 5
    # same seed: same data, whatever the batch size (crosses an internal block boundary)
    x = read_all(SyntheticClicks(5000, batch_size=1000, seed=3))
    y = read_all(SyntheticClicks(5000, batch_size=333, seed=3))
    for u, v in zip(x, y):
        assert torch.equal(u, v)
    z = read_all(SyntheticClicks(5000, batch_size=1000, seed=4))
    assert not torch.equal(x[1], z[1])
    # start: an offset window of the same stream
    w = read_all(SyntheticClicks(1000, batch_size=500, seed=3, start=4000))
    assert torch.equal(w[1], x[1][4000:])


def test_synthetic_ids_are_scrambled_zipf_ranks():
    ds = SyntheticClicks(40_000, batch_size=40_000, id_space=1000, zipf_alpha=1.15)
    (_, sparse), label = ds.batch(0)
    assert (sparse < 0).any() and (sparse.abs() > 2**40).float().mean() > 0.99  # not small integers
    assert 0.15 < label.mean() < 0.4  # about Criteo's click rate
    for f in (0, 25):
        universe = raw_ids(torch.arange(1000), f)
        assert len(universe.unique()) == 1000  # bijective on ranks
        assert torch.isin(sparse[:, f], universe).all()
        # most frequent id is rank 0, with the bounded-Pareto probability
        p0 = (1 - 2 ** (1 - 1.15)) / (1 - 1001 ** (1 - 1.15))
        assert (sparse[:, f] == universe[0]).float().mean() == pytest.approx(p0, abs=0.01)
    assert not torch.equal(raw_ids(torch.arange(10), 0), raw_ids(torch.arange(10), 1))


def test_synthetic_workers_and_ranks_split_every_global_batch():
    ds = SyntheticClicks(3000, batch_size=256, seed=1)
    full = read_all(ds)
    for g, w in zip(read_all(DataLoader(ds, batch_size=None, num_workers=2)), full):
        assert torch.equal(g, w)
    ranks = [SyntheticClicks(3000, batch_size=256, seed=1, rank=r, world_size=3) for r in range(3)]
    assert [len(r) for r in ranks] == [12, 12, 12]
    assert_ranks_split_each_global_batch([list(r) for r in ranks], list(ds))
    with_workers = [list(DataLoader(r, batch_size=None, num_workers=2)) for r in ranks]
    assert_ranks_split_each_global_batch(with_workers, list(ds))
    # a last batch of 1 sample over 3 ranks: ranks 1 and 2 get an empty batch
    last = [list(SyntheticClicks(257, batch_size=256, seed=1, rank=r, world_size=3))[-1] for r in range(3)]
    assert [len(y) for _, y in last] == [1, 0, 0] and last[2][0][1].shape == (0, 26)


def test_expected_auc_matches_brute_force():
    logits = np.array([-1.0, 0.0, 0.0, 2.0, 0.5, -3.0])  # one tie
    p = 1 / (1 + np.exp(-logits))
    num = den = 0.0
    for i in range(len(p)):
        for j in range(len(p)):
            if i != j:
                w = p[i] * (1 - p[j])
                den += w
                num += w * (1.0 if logits[i] > logits[j] else 0.5 if logits[i] == logits[j] else 0.0)
    assert expected_auc(logits) == pytest.approx(num / den, abs=1e-12)


def test_synthetic_planted_signal():
    ds = SyntheticClicks(50_000, batch_size=50_000, seed=0)
    bayes = ds.bayes_auc(50_000)
    assert 0.75 < bayes < 0.85
    (dense, sparse), label = ds.batch(0)
    m = AUC()
    m.update(ds.optimal_logits(dense, sparse), label)
    assert m.compute() == pytest.approx(bayes, abs=0.01)  # labels follow the planted logits


def test_synthetic_argument_errors():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        SyntheticClicks(10, batch_size=0)
    with pytest.raises(ValueError, match="id_space needs 3 entries"):
        SyntheticClicks(10, num_sparse=3, id_space=[10, 10])
    with pytest.raises(ValueError, match="zipf_alpha must be > 0"):
        SyntheticClicks(10, zipf_alpha=0)
    (_, sparse), _ = SyntheticClicks(10, zipf_alpha=1.0, id_space=5).batch(0)  # the alpha = 1 branch
    assert sparse.shape == (10, 26)
