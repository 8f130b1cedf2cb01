"""Shared test fixtures: devices, data location, a pure-Python reference of the initializer."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch

import veloce

MASK = (1 << 64) - 1


def devices() -> list:
    """cpu always; cuda when a GPU and veloce's CUDA kernels exist (else skipped with a reason)."""
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device on this machine"
    elif not veloce.ops.extension.has_cuda_kernels():
        reason = "veloce was built without CUDA kernels"
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(reason is not None, reason=reason or ""))]


DEVICES = devices()


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True, warn_only: bool = False):
    """``torch.use_deterministic_algorithms(enabled, warn_only=warn_only)`` inside the block,
    the previous setting restored after it (also after an error). On CUDA, deterministic
    mode makes veloce's inserts place conflicting new ids in order of first occurrence."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def data_dir() -> Path:
    """../shared/data beside the repository (VELOCE_DATA_DIR overrides)."""
    env = os.environ.get("VELOCE_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK
    k ^= k >> 33
    return k


def probe(key: int, num_buckets: int) -> tuple[int, int, int]:
    """(bucket_a, bucket_b, digest) of ``key`` in a table of ``num_buckets`` buckets
    (csrc/include/veloce/hash.h): each bucket is a hash's low 32 bits times the bucket
    count, over 2^32."""
    h = fmix64(key & MASK)
    h2 = fmix64(((h >> 32) | (h << 32)) & MASK)
    return ((h & 0xFFFFFFFF) * num_buckets) >> 32, ((h2 & 0xFFFFFFFF) * num_buckets) >> 32, (h >> 56) or 1


def keys_in_buckets_0_and_1(num_buckets: int, n: int) -> list[int]:
    """``n`` keys whose two bucket choices both fall in buckets 0 and 1 of a table of
    ``num_buckets`` buckets: more than 64 of them overflow that bucket pair."""
    out, key = [], 0
    while len(out) < n:
        key += 1
        a, b, _ = probe(key, num_buckets)
        if a < 2 and b < 2:
            out.append(key)
    return out


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _unit(bits: int) -> float:
    return ((bits >> 11) + 0.5) * (1.0 / 9007199254740992.0)


def ref_init_value(seed: int, key: int, col: int, kind: int, a: float, b: float) -> float:
    """Pure-Python reference of init_value (csrc/include/veloce/init.h)."""
    if kind == 0:
        return 0.0
    if kind == 1:
        return a
    row = splitmix64((seed & MASK) ^ fmix64(key & MASK))
    if kind == 2:
        return a + (b - a) * _unit(splitmix64((row + col) & MASK))
    pair = col >> 1
    u1 = _unit(splitmix64((row + 2 * pair) & MASK))
    u2 = _unit(splitmix64((row + 2 * pair + 1) & MASK))
    r = math.sqrt(-2.0 * math.log(u1))
    t = 6.283185307179586 * u2
    return a + b * (r * math.sin(t) if col & 1 else r * math.cos(t))


def ref_init_rows(ids, dim: int, init: veloce.init.Initializer, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """(len(ids), dim) initial rows computed in pure Python."""
    rows = [[ref_init_value(seed, int(i), j, init.kind, init.a, init.b) for j in range(dim)] for i in ids]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), dim).to(dtype)


def counting_syncs(fn, capfd, deterministic: bool | None = None):
    """``fn()`` under CUDA's sync debug mode, which reports each device-to-host read on
    stderr (and under ``torch.use_deterministic_algorithms(deterministic)`` unless None):
    its result and the number of host syncs it made."""
    torch.cuda.synchronize()
    capfd.readouterr()
    mode = deterministic_algorithms(deterministic, warn_only=True) if deterministic is not None else None
    with mode or contextlib.nullcontext():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, capfd.readouterr().err.count("called a synchronizing CUDA operation")
