"""The tables' telemetry in the Trainer's step records: each ``DynamicEmbedding``'s
``stats()`` (``docs/storage.md``) as a few numbers per table, keyed
``tables/<module path>/<name>``, every ``log_every`` steps.

Every table reports ``rows`` (of every tier). A tiered table (a ``storage`` other than
``Device()``) also reports, over the steps since the previous record: ``hit_rate`` (the
distinct ids of its training lookups found in the cache), ``fetched_per_step`` and
``written_back_per_step`` (rows moved between its tiers) and ``bytes_moved_per_step``.
The counts are differences of ``stats()``'s running counts: the Trainer never resets them
(after a reset by someone else, the counts since that reset).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from veloce.embedding import DynamicEmbedding
from veloce.storage import Device

__all__ = ["TableTelemetry"]

_COUNTS = ("hits", "misses", "fetched", "written_back", "bytes_fetched", "bytes_written_back")


class TableTelemetry:
    """The telemetry keys of ``model``'s tables for the Trainer's step records."""

    def __init__(self, model: nn.Module) -> None:
        self.tables = {name: m for name, m in model.named_modules() if isinstance(m, DynamicEmbedding)}
        self._last: dict[str, dict[str, float]] = {}  # running counts at the previous record

    def mark(self) -> None:
        """Starts a window: the next record counts from here (a fit's start)."""
        for name, m in self.tables.items():
            if not isinstance(m.storage, Device):
                stats = m.stats()
                self._last[name] = {k: stats.get(k, 0) for k in _COUNTS}

    def window(self, steps: int) -> dict[str, float]:
        """``tables/<name>/<key>`` -> value, the per-step ones over the last ``steps`` steps
        (read from ``stats()``: no host sync of its own)."""
        out: dict[str, float] = {}
        for name, m in self.tables.items():
            stats = m.stats()
            out.update(_numbers(f"tables/{name}", {"rows": stats.get("rows")}))
            if isinstance(m.storage, Device) or "hits" not in stats:
                continue
            now = {k: stats.get(k, 0) for k in _COUNTS}
            last = self._last.get(name, dict.fromkeys(_COUNTS, 0))
            self._last[name] = now
            d = {k: now[k] - last[k] if now[k] >= last[k] else now[k] for k in _COUNTS}  # (reset meanwhile)
            looked, per = d["hits"] + d["misses"], max(int(steps), 1)
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
