"""The tables' telemetry in the Trainer's step records: each ``DynamicEmbedding``'s
``stats()`` (``docs/storage.md``) as a few numbers per table, keyed
``tables/<module path>/<name>``, every ``log_every`` steps.

Every table reports ``rows`` (of every tier). A table that drops rows (a
``max_capacity``, or a policy that expires rows) also reports its health
(:mod:`veloce.table.health`): ``evicted_per_step`` over the steps since the previous
record, and ``evicted_within_n``, ``returned_within_n`` (evicted ids back in the table),
``oldest_row_age`` (lru, ttl, none) or ``min_use_count`` (lfu) as ``stats()`` gives them.
A table with admission reports ``admitted_per_step`` and ``refused_per_step`` (sightings)
and ``default_row_share`` (its lookups the default row served) when its ``stats()`` has
those keys. A tiered table (a ``storage`` other than ``Device()``) also reports, over the
steps since the previous record: ``hit_rate`` (the distinct ids of its training lookups
found in the cache), ``fetched_per_step`` and ``written_back_per_step`` (rows moved
between its tiers) and ``bytes_moved_per_step``. The per-step keys are differences of
``stats()``'s running counts: the Trainer never resets them (after a reset by someone
else, the counts since that reset).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from veloce.embedding import DynamicEmbedding
from veloce.storage import Device

__all__ = ["TableTelemetry"]

_COUNTS = ("hits", "misses", "fetched", "written_back", "bytes_fetched", "bytes_written_back")
# Running counts logged per step where a table's stats() has them: evictions, admission's sightings.
_PER_STEP = ("evicted", "admitted", "refused")
# Values logged as stats() gives them: a dropping table's health, admission's default-row share.
_HEALTH = ("evicted_within_n", "returned_within_n", "oldest_row_age", "min_use_count")
_ADMISSION = ("default_row_share",)


class TableTelemetry:
    """The telemetry keys of ``model``'s tables for the Trainer's step records."""

    def __init__(self, model: nn.Module) -> None:
        self.tables = {name: m for name, m in model.named_modules() if isinstance(m, DynamicEmbedding)}
        self._last: dict[str, dict[str, float]] = {}  # running counts at the previous record

    def mark(self) -> None:
        """Starts a window: the next record counts from here (a fit's start)."""
        for name, m in self.tables.items():
            stats = m.stats()
            self._last[name] = {k: stats.get(k, 0) for k in _COUNTS + _PER_STEP}

    def window(self, steps: int) -> dict[str, float]:
        """``tables/<name>/<key>`` -> value, the per-step ones over the last ``steps`` steps
        (read from ``stats()``, whose health keys read a few reductions back to the host:
        once per record, off the steps)."""
        out: dict[str, float] = {}
        per = max(int(steps), 1)
        for name, m in self.tables.items():
            stats = m.stats()
            prefix = f"tables/{name}"
            out.update(_numbers(prefix, {"rows": stats.get("rows")}))
            now = {k: stats.get(k, 0) for k in _COUNTS + _PER_STEP}
            last = self._last.get(name, dict.fromkeys(now, 0))
            self._last[name] = now
            d = {k: now[k] - last[k] if now[k] >= last[k] else now[k] for k in now}  # (reset meanwhile)
            keys = [k for k in ("admitted", "refused") if k in stats]
            if m.table.max_capacity is not None or m.table.eviction_policy.expires:  # a table that drops rows
                keys.append("evicted")
                out.update(_numbers(prefix, {k: stats.get(k) for k in _HEALTH}))
            out.update(_numbers(prefix, {f"{k}_per_step": d[k] / per for k in keys}))
            out.update(_numbers(prefix, {k: stats.get(k) for k in _ADMISSION}))
            if isinstance(m.storage, Device) or "hits" not in stats:
                continue
            looked = d["hits"] + d["misses"]
            out.update(_numbers(f"tables/{name}", {
                "hit_rate": d["hits"] / looked if looked else None,
                "fetched_per_step": d["fetched"] / per,
                "written_back_per_step": d["written_back"] / per,
                "bytes_moved_per_step": (d["bytes_fetched"] + d["bytes_written_back"]) / per,
            }))  # fmt: skip
        return out


def _numbers(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    """The ``values`` that are numbers (not bools, not None), keyed ``prefix/<key>``."""
    return {f"{prefix}/{k}": v for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
