"""The error of a data file that cannot be read as what it should hold."""

from __future__ import annotations

from typing import Optional

__all__ = ["DataError"]


class DataError(ValueError):
    """A data file is malformed, truncated or unreadable; the message names the file and,
    where there is one, the line (``path:line: what is wrong``).

    Attributes:
        path: the file, or None when the error is not about one file.
        line: the 1-based line number, or None.
    """

    def __init__(self, message: str, path: Optional[str] = None, line: Optional[int] = None) -> None:
        super().__init__(message)
        self.path, self.line = path, line

    def __reduce__(self) -> tuple:  # keeps path and line through pickling (DataLoader workers, ranks)
        return (type(self), (str(self), self.path, self.line))
