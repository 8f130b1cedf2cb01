"""Data sets that yield ready-made batches ``((dense, sparse), label)``.

- :class:`SyntheticClicks`: synthetic click logs with Zipf ids and a planted signal
  (the built-in default data set).
- :class:`CriteoTSV`: a streaming reader for Criteo's raw TSV (strict by default: a
  malformed or truncated file raises :class:`DataError` naming the file and line).

Both are ``IterableDataset``s that batch internally and have a length (batches of this
rank): use ``DataLoader(ds, batch_size=None, num_workers=...)``.
"""

from veloce.data._errors import DataError
from veloce.data.criteo import DENSE_NAMES, MISSING_ID, SPARSE_NAMES, CriteoTSV
from veloce.data.synthetic import SyntheticClicks, expected_auc, raw_ids

__all__ = [
    "DENSE_NAMES",
    "MISSING_ID",
    "SPARSE_NAMES",
    "CriteoTSV",
    "DataError",
    "SyntheticClicks",
    "expected_auc",
    "raw_ids",
]
