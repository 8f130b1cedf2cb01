"""A mixin for modules whose per-step bookkeeping attributes are set directly."""

from __future__ import annotations

from typing import Any

__all__ = ["PlainAttrs"]


class PlainAttrs:
    """A mixin for modules whose per-step bookkeeping attributes (the names in the class's
    ``_PLAIN_ATTRS``) are set directly. nn.Module.__setattr__ first looks for a parameter,
    buffer or submodule of the name: a few microseconds per set on the host path of a
    GPU step. Those names must never be one."""

    _PLAIN_ATTRS: frozenset = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._PLAIN_ATTRS:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)
