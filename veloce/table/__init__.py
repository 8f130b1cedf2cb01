"""The hash table behind a :class:`veloce.DynamicEmbedding`: ids -> slots, where the rows
and their optimizer state live, growth and eviction.

- :class:`HashTable`: one table's state as tensors, its lookups, inserts and growth.
- :func:`find_or_insert_many`: one insert into several tables.
- :mod:`veloce.table.capacity`: growth sizes and the final size of a bounded table.
- :mod:`veloce.table.eviction`: the eviction policies.
"""

from veloce.table.batch import find_or_insert_many, insert_beside_updates
from veloce.table.capacity import (
    BUCKET_SIZE, FULL_LOAD, STATE_NAMES, TableFullError, final_capacity, is_int64, round_capacity, state_dtype,
)  # fmt: skip
from veloce.table.hash_table import HashTable

__all__ = [
    "HashTable", "TableFullError", "BUCKET_SIZE", "FULL_LOAD", "STATE_NAMES", "find_or_insert_many",
    "final_capacity", "insert_beside_updates", "is_int64", "round_capacity", "state_dtype",
]  # fmt: skip
