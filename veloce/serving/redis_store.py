"""A serving store in Redis (:class:`RedisStore`), through ``redis-py``: imported when a
store is made, never by ``import veloce``.

Keys, under ``<namespace>:``:

- ``lease``: the publisher's name and process (JSON, :func:`~veloce.serving.store.lease_record`
  without its end), with the lease's expiry as the key's TTL;
- ``begun``: a set of the versions begun; ``committed``: a sorted set of the committed
  ones; ``m:<version>``: a manifest (JSON). A commit writes the manifest and adds the
  version to ``committed`` in one transaction: the commit marker;
- ``p:<version>:<part>``: a part of rows, a hash from each id (8 bytes, little-endian) to
  its row's bytes, or to the empty string for a removed id; other parts (``dense``, the
  changed ids of a snapshot) are one string each (safetensors bytes).

Reads of rows are ``HMGET`` of every part a lookup needs, sent in one pipeline; writes are
``HSET`` in pipelined batches.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional, Sequence

import torch

from veloce.serving.store import ServingStore, VersionMissing, lease_held, lease_record

__all__ = ["RedisStore"]

_BATCH = 8192  # fields per HSET / HMGET command
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ImportError("veloce.serving.RedisStore needs redis-py: pip install redis") from exc
    return redis


class RedisStore(ServingStore):
    """A serving store in Redis (see the module docstring).

    Args:
        url: the server, ``redis://host:port/db``.
        namespace: the prefix of every key of this store (one published model).
        timeout: seconds a connection or a command may take.

    Raises:
        ImportError: redis-py is not installed.
        ConnectionError: the server cannot be reached (checked with a ``PING``).
    """

    def __init__(self, url: str, namespace: str, timeout: float = 30.0) -> None:
        redis = _redis()
        if not namespace or not isinstance(namespace, str):
            raise ValueError(f"RedisStore: namespace must be a non-empty str, got {namespace!r}")
        self.url, self.namespace = url, namespace
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            self.client.ping()
        except redis.exceptions.ConnectionError as exc:
            raise ConnectionError(f"RedisStore: cannot reach Redis at {url!r} ({exc}); start redis-server there or "
                                  f"pass the url of a running one") from exc  # fmt: skip
        self._meta: dict[tuple[int, str], dict[str, Any]] = {}  # (version, part) -> its row dtype and dim

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, {self.namespace!r})"

    def _k(self, *parts: Any) -> str:
        return ":".join([self.namespace, *map(str, parts)])

    # ---- lease -----------------------------------------------------------------------------
    @staticmethod
    def _holder(raw: bytes, left_ms: int) -> dict[str, Any]:
        """The lease record of the ``lease`` key's value (JSON; a bare name is its owner)."""
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = None
        if not isinstance(holder, dict) or "owner" not in holder:
            holder = {"owner": raw.decode(errors="replace")}
        holder["expires"] = time.time() + max(0, left_ms) / 1000
        return holder

    def acquire(self, owner: str, ttl: float, take_over_from: Optional[str] = None) -> None:
        ms = max(1, int(ttl * 1000))
        key = self._k("lease")
        record = lease_record(owner, 0.0)
        del record["expires"]  # the key's TTL
        value = json.dumps(record)
        if self.client.set(key, value, nx=True, px=ms):
            return
        with self.client.pipeline() as p:  # ours already (or taken over): renew it, unless it changed hands meanwhile
            p.watch(key)
            held = p.get(key)
            if held is not None:
                holder = self._holder(held, p.pttl(key))
                if holder["owner"] not in (owner, take_over_from):
                    p.reset()
                    raise lease_held(self, holder)
            p.multi()
            p.set(key, value, px=ms)
            p.execute()

    def lease(self) -> Optional[dict[str, Any]]:
        with self.client.pipeline(transaction=True) as p:
            p.get(self._k("lease"))
            p.pttl(self._k("lease"))
            held, left = p.execute()
        return None if held is None else self._holder(held, left)

    def release(self, owner: str) -> None:
        key = self._k("lease")
        held = self.client.get(key)
        if held is not None and self._holder(held, 0)["owner"] == owner:
            self.client.delete(key)

    # ---- versions --------------------------------------------------------------------------
    def committed(self) -> list[int]:
        return sorted(int(v) for v in self.client.zrange(self._k("committed"), 0, -1))

    def begun(self) -> list[int]:
        return sorted({int(v) for v in self.client.smembers(self._k("begun"))} | set(self.committed()))

    def manifest(self, version: int) -> dict[str, Any]:
        raw = self.client.get(self._k("m", int(version)))
        if raw is None:
            raise self._missing(version)
        return json.loads(raw)

    def _missing(self, version: int) -> VersionMissing:
        have = self.committed()
        if not have:
            return VersionMissing(f"{self!r} has no committed version {version}: it holds none (a namespace no "
                                  f"Publisher wrote to yet, or another one): publish one first, or check the "
                                  f"namespace")  # fmt: skip
        return VersionMissing(f"{self!r} has no committed version {version} (committed: {'... ' if len(have) > 5 else ''}"
                              f"{have[-5:]}); pass one of them, or None for the newest (older ones are deleted as "
                              f"superseded)")  # fmt: skip

    def _part_missing(self, version: int, part: str) -> VersionMissing:
        if int(version) not in self.committed():
            return self._missing(version)
        return VersionMissing(f"{self!r}: version {version} has no part {part!r} (deleted as superseded, or never "
                              f"written); refresh() to the newest committed version")  # fmt: skip

    def begin(self, version: int) -> None:
        self.client.sadd(self._k("begun"), int(version))

    def write_part(self, version: int, part: str, tensors: dict[str, torch.Tensor]) -> None:
        key = self._k("p", int(version), part)
        if not part.startswith("t/"):
            from safetensors.torch import save

            self.client.set(key, save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))
            return
        keys, weights, removed = tensors["keys"], tensors["weights"], tensors["removed"]
        self.client.hset(self._k("pm", int(version)), part,
                         json.dumps([str(weights.dtype).replace("torch.", ""), int(weights.size(1))]))  # fmt: skip
        id_bytes = keys.numpy().astype("<i8").tobytes()
        row_bytes = weights.contiguous().view(torch.uint8).numpy().tobytes()
        width = weights.size(1) * weights.element_size()
        with self.client.pipeline(transaction=False) as p:
            for s in range(0, keys.numel(), _BATCH):
                e = min(s + _BATCH, keys.numel())
                p.hset(key, mapping={id_bytes[8 * i:8 * i + 8]: row_bytes[width * i:width * (i + 1)] for i in range(s, e)})
            gone = removed.numpy().astype("<i8").tobytes()
            for s in range(0, removed.numel(), _BATCH):
                e = min(s + _BATCH, removed.numel())
                p.hset(key, mapping={gone[8 * i:8 * i + 8]: b"" for i in range(s, e)})
            if not keys.numel() and not removed.numel():
                p.hset(key, mapping={b"": b""})  # an empty part still exists
            p.execute()

    def commit(self, version: int, manifest: dict[str, Any]) -> None:
        with self.client.pipeline(transaction=True) as p:
            p.set(self._k("m", int(version)), json.dumps(manifest))
            p.zadd(self._k("committed"), {str(int(version)): int(version)})
            p.execute()

    def _part_meta(self, version: int, part: str) -> tuple[torch.dtype, int]:
        meta = self._meta.get((version, part))
        if meta is None:
            raw = self.client.hget(self._k("pm", int(version)), part)
            if raw is None:
                raise self._part_missing(version, part)
            meta = self._meta[(version, part)] = json.loads(raw)
        return _TORCH[meta[0]], int(meta[1])

    def read_part(self, version: int, part: str) -> dict[str, torch.Tensor]:
        key = self._k("p", int(version), part)
        if not part.startswith("t/"):
            from safetensors.torch import load

            raw = self.client.get(key)
            if raw is None:
                raise self._part_missing(version, part)
            return load(raw)
        dtype, dim = self._part_meta(version, part)
        fields = self.client.hgetall(key)
        live = [(k, v) for k, v in fields.items() if v and len(k) == 8]
        gone = [k for k, v in fields.items() if not v and len(k) == 8]
        keys = torch.frombuffer(bytearray(b"".join(k for k, _ in live)), dtype=torch.int64) if live else \
            torch.empty(0, dtype=torch.long)  # fmt: skip
        rows = self._rows(b"".join(v for _, v in live), dtype, dim)
        order = torch.argsort(keys)
        removed = torch.frombuffer(bytearray(b"".join(gone)), dtype=torch.int64) if gone else torch.empty(0, dtype=torch.long)
        return {"keys": keys[order], "weights": rows[order], "removed": removed.sort().values}

    @staticmethod
    def _rows(raw: bytes, dtype: torch.dtype, dim: int) -> torch.Tensor:
        if not raw:
            return torch.empty(0, dim, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(-1, dim)

    def lookup(self, parts: Sequence[tuple[int, str]], ids: torch.Tensor
               ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        fields = [bytes(b) for b in (ids.numpy().astype("<i8").tobytes()[8 * i:8 * i + 8] for i in range(ids.numel()))]
        metas = [self._part_meta(v, part) for v, part in parts]
        with self.client.pipeline(transaction=False) as p:
            for v, part in parts:
                for s in range(0, len(fields), _BATCH):
                    p.hmget(self._k("p", int(v), part), fields[s:s + _BATCH])
            replies = p.execute()
        out, k = [], 0
        per_part = max(1, -(-len(fields) // _BATCH))
        for dtype, dim in metas:
            values = [x for r in replies[k:k + per_part] for x in r] if fields else []
            k += per_part
            found = torch.tensor([bool(x) for x in values], dtype=torch.bool)
            removed = torch.tensor([x == b"" for x in values], dtype=torch.bool)
            blank = bytes(dim * torch.tensor([], dtype=dtype).element_size())
            rows = self._rows(b"".join(x if x else blank for x in values), dtype, dim)
            out.append((found, rows, removed))
        return out

    def delete(self, version: int) -> None:
        version = int(version)
        with self.client.pipeline(transaction=True) as p:
            p.zrem(self._k("committed"), str(version))
            p.delete(self._k("m", version))
            p.execute()
        keys = list(self.client.scan_iter(match=self._k("p", version, "*"), count=1000))
        if keys:
            self.client.delete(*keys)
        self.client.delete(self._k("pm", version))
        self.client.srem(self._k("begun"), version)
        self._meta = {k: v for k, v in self._meta.items() if k[0] != version}

    def nbytes(self) -> int:
        """Bytes Redis uses for this namespace's keys (``MEMORY USAGE`` of each)."""
        return sum(int(self.client.memory_usage(k) or 0) for k in self.client.scan_iter(match=self._k("*"), count=1000))

    def close(self) -> None:
        self.client.close()
