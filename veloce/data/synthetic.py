"""Synthetic click-through data with a planted signal: the built-in default data set.

Each sample has ``num_dense`` float features, ``num_sparse`` categorical ids and a
0/1 click label. How a sample is made:

1. For each sparse feature ``f``, a popularity rank ``r`` in ``[0, id_space)`` is drawn
   from a Zipf-like law: ``r = floor(x) - 1`` with ``x`` bounded-Pareto(``zipf_alpha``)
   on ``[1, id_space + 1)``, so ``P(r) ~ (r + 1) ** -zipf_alpha`` (rank 0 is the most
   popular id).
2. The rank becomes a raw id through a fixed bijective scramble of the int64 range that
   depends on the feature only (:func:`raw_ids`): ids look like hashed values, spread
   over all of int64, negatives included, and distinct ranks give distinct ids.
3. Dense features are standard normal.
4. The click logit is ``base_logit + sum_f w_f(id_f) + dense @ beta
   + sum_{f < g} <v_f(id_f), v_g(id_g)>``: hidden per-id weights ``w`` and factor
   vectors ``v`` (dimension 4) are a hash of ``(seed, f, id)``, ``beta`` is drawn from the
   seed. ``sparse_signal``, ``dense_signal`` and ``interaction_signal`` are the standard
   deviations of the three terms over random samples. The label is Bernoulli of the
   sigmoid of the logit.

The planted logit is the Bayes-optimal score, so :meth:`SyntheticClicks.optimal_logits`
gives the best achievable predictions and :meth:`SyntheticClicks.bayes_auc` the best
achievable AUC. A model learns the head ids quickly; tail ids are seen too rarely to
learn, so trained models stay below the optimum, as on real data.

Sample ``i`` is a pure function of ``(seed, i)`` and the generator's settings: it is the
same whatever the batch size, the number of DataLoader workers or of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from veloce.data._sharding import current_shard, rank_part

Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_BLOCK = 4096  # samples per random-number block; samples are generated block by block
_FACTOR_DIM = 4


def _mix64_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (a bijection of the 64-bit integers)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on a uint64 array (wraps modulo 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feature_salts(num_sparse: int) -> np.ndarray:
    return np.array([_mix64_int(_GOLDEN * (f + 1)) for f in range(num_sparse)], dtype=np.uint64)


def raw_ids(ranks: np.ndarray | torch.Tensor, features: np.ndarray | torch.Tensor | int) -> torch.Tensor:
    """Maps popularity ranks to raw int64 ids: a fixed bijection per feature.

    ``id = mix64(rank + salt[feature])`` viewed as int64, where ``mix64`` is splitmix64's
    finaliser (bijective on 64-bit integers) and ``salt`` depends on the feature index only.

    Args:
        ranks: non-negative integer ranks.
        features: feature indices, broadcastable against ``ranks``.

    Returns:
        int64 tensor of ids, the broadcast shape of ``ranks`` and ``features``.

    Example::

        >>> raw_ids(torch.arange(3), 0).shape
        torch.Size([3])
    """
    r = np.asarray(ranks, dtype=np.int64)
    f = np.asarray(features, dtype=np.int64)
    if (r < 0).any() or (f < 0).any():
        raise ValueError("raw_ids: ranks and features must be non-negative")
    salts = _feature_salts(int(f.max()) + 1 if f.size else 1)
    mixed = _mix64(r.astype(np.uint64) + salts[f])
    return torch.from_numpy(np.ascontiguousarray(mixed).view(np.int64))


def _unit_uniform(h: np.ndarray) -> np.ndarray:
    """Top 53 bits of a uint64 hash as a float64 in [0, 1)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def expected_auc(logits: np.ndarray | torch.Tensor) -> float:
    """AUC of ``logits`` as a score against labels drawn as Bernoulli(sigmoid(logits)).

    The expectation over labels is taken exactly (no label noise): it is
    ``sum_{i,j} p_i (1 - p_j) [s_i > s_j] / (sum_i p_i * sum_j (1 - p_j))``, with ties
    counted one half. Applied to the planted logits this is the Bayes-optimal AUC.

    Args:
        logits: the scores, which are also the true logits.

    Returns:
        The expected AUC as a float.
    """
    s = np.asarray(logits, dtype=np.float64).reshape(-1)
    p = 1.0 / (1.0 + np.exp(-s))
    order = np.argsort(s, kind="stable")
    s, p = s[order], p[order]
    q = 1.0 - p
    # group ties: pairs inside a group count one half
    _, first = np.unique(s, return_index=True)
    p_grp = np.add.reduceat(p, first)
    q_grp = np.add.reduceat(q, first)
    q_below = np.cumsum(q_grp) - q_grp
    num = float((p_grp * q_below).sum() + 0.5 * (p_grp * q_grp).sum())
    # pairs (i, i) inside a group are not pairs of distinct samples; remove them
    num -= 0.5 * float((p * q).sum())
    den = float(p.sum() * q.sum() - (p * q).sum())
    return num / den


class SyntheticClicks(IterableDataset):
    """Synthetic click logs with Zipf-distributed raw int64 ids and a planted signal.

    An ``IterableDataset`` of ready-made batches: use it with
    ``DataLoader(ds, batch_size=None, num_workers=...)``. ``batch_size`` is the global
    batch: with ``world_size`` ranks, each global batch of consecutive samples is split
    into ``world_size`` contiguous, nearly equal parts and rank ``rank`` yields its part
    (an empty one when a last batch has fewer samples than ranks), so every rank yields
    the same number of batches and training does not depend on the world size (see
    ``veloce/data/_sharding.py``). A rank sees its batches in the same order for any
    ``num_workers``.

    Args:
        num_samples: number of samples (all ranks together).
        batch_size: samples per global batch (all ranks together; each rank yields about
            ``batch_size / world_size`` of them); the last batch may be smaller.
        num_dense: number of dense features.
        num_sparse: number of sparse (categorical) features.
        id_space: number of distinct ids per feature (an int, or one per feature).
        zipf_alpha: Zipf exponent of id popularity (> 0; larger is more skewed).
        seed: selects the planted model and the random draws (>= 0).
        start: index of the first sample; two data sets with the same seed and
            disjoint ``[start, start + num_samples)`` are disjoint draws from the same
            distribution (e.g. train and validation).
        sparse_signal: standard deviation of the summed per-id weights in the logit.
        dense_signal: standard deviation of the dense linear term in the logit.
        interaction_signal: standard deviation of the pairwise factor term in the logit.
        base_logit: constant term of the logit (sets the click rate, about 0.25 by default).
        drop_last: drop the last global batch if it is smaller than ``batch_size``.
        rank: this process's rank, for splitting batches across ranks.
        world_size: number of ranks.

    Shape:
        Each batch is ``((dense, sparse), label)``, ``B`` this rank's part of the global batch:

        - dense: ``(B, num_dense)`` float32.
        - sparse: ``(B, num_sparse)`` int64 raw ids.
        - label: ``(B,)`` float32 in {0, 1}.

    Example::

        >>> ds = SyntheticClicks(10_000, batch_size=512, seed=0)
        >>> (dense, sparse), label = next(iter(ds))
        >>> dense.shape, sparse.shape, label.shape
        (torch.Size([512, 13]), torch.Size([512, 26]), torch.Size([512]))
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int = 1024,
        num_dense: int = 13,
        num_sparse: int = 26,
        id_space: int | Sequence[int] = 10**6,
        zipf_alpha: float = 1.15,
        seed: int = 0,
        start: int = 0,
        sparse_signal: float = 1.2,
        dense_signal: float = 0.6,
        interaction_signal: float = 0.5,
        base_logit: float = -1.5,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        _check(num_samples >= 0, "num_samples", num_samples, "must be >= 0")
        _check(batch_size >= 1, "batch_size", batch_size, "must be >= 1")
        _check(num_dense >= 0, "num_dense", num_dense, "must be >= 0")
        _check(num_sparse >= 0, "num_sparse", num_sparse, "must be >= 0")
        _check(zipf_alpha > 0, "zipf_alpha", zipf_alpha, "must be > 0")
        _check(seed >= 0, "seed", seed, "must be >= 0")
        _check(start >= 0, "start", start, "must be >= 0")
        for name, value in (
            ("sparse_signal", sparse_signal),
            ("dense_signal", dense_signal),
            ("interaction_signal", interaction_signal),
        ):
            _check(value >= 0, name, value, "must be >= 0")
        _check(0 <= rank < world_size, "rank", rank, f"must be in [0, world_size={world_size})")
        sizes = [id_space] * num_sparse if isinstance(id_space, int) else list(id_space)
        _check(len(sizes) == num_sparse, "id_space", id_space, f"needs {num_sparse} entries")
        _check(all(1 <= s < 2**62 for s in sizes), "id_space", id_space, "entries must be in [1, 2**62)")

        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        self.id_space = sizes
        self.zipf_alpha = float(zipf_alpha)
        self.seed = seed
        self.start = start
        self.sparse_signal = float(sparse_signal)
        self.dense_signal = float(dense_signal)
        self.interaction_signal = float(interaction_signal)
        self.base_logit = float(base_logit)
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size

        # the planted model: a function of the seed only
        self._salts = _feature_salts(num_sparse)
        seed_key = _mix64_int(seed * _GOLDEN + 0x5EED)
        self._w_keys = np.array(
            [_mix64_int(seed_key ^ _mix64_int(f * 2 + 1)) for f in range(num_sparse)], dtype=np.uint64
        )
        self._v_keys = np.array(
            [
                [_mix64_int(seed_key ^ _mix64_int((f * _FACTOR_DIM + j) * 2 + 2)) for f in range(num_sparse)]
                for j in range(_FACTOR_DIM)
            ],
            dtype=np.uint64,
        )  # (FACTOR_DIM, num_sparse)
        beta = np.random.default_rng([seed, 0xBE7A]).standard_normal(num_dense)
        norm = float(np.linalg.norm(beta))
        self._beta = beta * (dense_signal / norm) if norm > 0 else beta
        # uniform(-a, a) has variance a^2 / 3
        self._w_amp = math.sqrt(3.0) * sparse_signal / math.sqrt(max(num_sparse, 1))
        pairs = num_sparse * (num_sparse - 1) // 2
        v_var = interaction_signal / math.sqrt(pairs * _FACTOR_DIM) if pairs else 0.0
        self._v_amp = math.sqrt(3.0 * v_var)

    # ------------------------------------------------------------------ sizes
    def num_batches(self) -> int:
        """Number of global batches (every rank yields one part of each)."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        """Number of batches this rank yields (all its DataLoader workers together): the
        number of global batches, the same on every rank."""
        return self.num_batches()

    # ------------------------------------------------------------------ data
    def __iter__(self) -> Iterator[Batch]:
        shard = current_shard(self.rank, self.world_size)
        for b in range(self.num_batches()):
            if shard.owns(b):
                yield self.batch(b)

    def batch(self, index: int) -> Batch:
        """This rank's part of global batch ``index`` (0-based): the whole batch with
        ``world_size=1``."""
        _check(0 <= index < self.num_batches(), "index", index, f"must be in [0, {self.num_batches()})")
        lo = self.start + index * self.batch_size
        rows = min(self.batch_size, self.num_samples - index * self.batch_size)
        mine_lo, mine_hi = rank_part(rows, self.rank, self.world_size)
        return self.samples(lo + mine_lo, lo + mine_hi)

    def samples(self, lo: int, hi: int) -> Batch:
        """Samples ``lo`` to ``hi - 1`` (absolute indices, ``start`` not added)."""
        _check(0 <= lo <= hi, "lo", lo, f"must satisfy 0 <= lo <= hi={hi}")
        parts = [self._cached_block(k) for k in range(lo // _BLOCK, (hi + _BLOCK - 1) // _BLOCK)]
        base = (lo // _BLOCK) * _BLOCK
        if parts:
            dense, sparse, label = (np.concatenate(x)[lo - base : hi - base] for x in zip(*parts))
        else:
            dense = np.zeros((0, self.num_dense), np.float32)
            sparse = np.zeros((0, self.num_sparse), np.int64)
            label = np.zeros(0, np.float32)
        return (torch.from_numpy(dense), torch.from_numpy(sparse)), torch.from_numpy(label)

    def _cached_block(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ``k``, remembering the last two so that small batches do not regenerate them."""
        cache = self.__dict__.setdefault("_blocks", {})
        if k not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            cache[k] = self._block(k)
        return cache[k]

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, k])))
        u = rng.random((_BLOCK, self.num_sparse))
        ranks = self._zipf_ranks(u)
        ids = (_mix64(ranks.astype(np.uint64) + self._salts[None, :])).view(np.int64)
        dense = rng.standard_normal((_BLOCK, self.num_dense), dtype=np.float32)
        logits = self._logits_np(dense, ids)
        label = (rng.random(_BLOCK) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return dense, ids, label

    def _zipf_ranks(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF of the bounded Pareto on [1, n + 1), floored, minus one."""
        n = np.asarray(self.id_space, dtype=np.float64)[None, :]
        a = self.zipf_alpha
        if abs(a - 1.0) < 1e-12:
            x = np.exp(u * np.log(n + 1.0))
        else:
            e = 1.0 - a
            x = (1.0 - u * (1.0 - (n + 1.0) ** e)) ** (1.0 / e)
        r = np.floor(x).astype(np.int64) - 1
        return np.clip(r, 0, np.asarray(self.id_space, dtype=np.int64)[None, :] - 1)

    # ------------------------------------------------------------------ the planted model
    def _logits_np(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        n = ids.shape[0]
        logits = np.full(n, self.base_logit, dtype=np.float64)
        if self.num_dense:
            logits += dense.astype(np.float64) @ self._beta
        if self.num_sparse:
            u64 = np.ascontiguousarray(ids).view(np.uint64)
            w = (2.0 * _unit_uniform(_mix64(u64 ^ self._w_keys[None, :])) - 1.0) * self._w_amp
            logits += w.sum(axis=1)
            if self._v_amp > 0:
                for j in range(_FACTOR_DIM):
                    v = (2.0 * _unit_uniform(_mix64(u64 ^ self._v_keys[j][None, :])) - 1.0) * self._v_amp
                    logits += 0.5 * (v.sum(axis=1) ** 2 - (v * v).sum(axis=1))
        return logits

    def optimal_logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """The planted (Bayes-optimal) logits of samples.

        Args:
            dense: ``(B, num_dense)`` dense features.
            sparse: ``(B, num_sparse)`` int64 raw ids.

        Returns:
            ``(B,)`` float32 logits; ``sigmoid`` of them is the click probability.
        """
        d = dense.detach().cpu().numpy()
        s = sparse.detach().cpu().numpy().astype(np.int64, copy=False)
        return torch.from_numpy(self._logits_np(d, s).astype(np.float32))

    def bayes_auc(self, num_samples: int = 200_000) -> float:
        """The AUC of the optimal predictor, estimated on ``num_samples`` fresh samples.

        The expectation over labels is exact (:func:`expected_auc`), so the estimate is
        precise to about 1e-3 at the default size.
        """
        (dense, sparse), _ = self.samples(0, num_samples)
        return expected_auc(self._logits_np(dense.numpy(), sparse.numpy()))


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"SyntheticClicks: {name} {why}, got {value!r}")
