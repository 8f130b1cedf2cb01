"""Input checks: ``nn.EmbeddingBag``-style inputs validated before any table changes, and
the bag layouts' (offsets') check, read back alone or riding on the training insert."""

from __future__ import annotations

import copy
from typing import Any, Callable, NoReturn, Optional, Sequence, TypeVar

import torch

from veloce.ops.embedding import bag_layouts_bad
from veloce.runtime import capture as _capture
from veloce.table import HashTable

__all__ = ["InputChecks", "LayoutCheck", "check_offsets", "check_offsets_many", "insert_checked", "offsets_flags",
           "padded_args"]  # fmt: skip

_T = TypeVar("_T")


class InputChecks:
    """A table module's input checks (:class:`veloce.DynamicEmbedding`'s)."""

    def _bags(
        self, input: torch.Tensor, offsets: Optional[torch.Tensor], psw: Optional[torch.Tensor],
        deferred: Optional[list] = None, aranges: Optional[dict] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Validates nn.EmbeddingBag-style input and returns (ids (N,), offsets, psw (N,)).

        Checked here, before any lookup, so bad input leaves the table unchanged. The
        offsets' values (a device read) are checked here, or, with ``deferred``, appended
        to it for the caller to check before touching any table: several tables' at once
        (:func:`check_offsets_many`), or with the insert (:func:`insert_checked`).
        ``aranges``: a dict in which the offsets made for 2-D inputs are kept and reused
        (read-only) by calls with the same shape: a model's tables share one tensor (and
        one launch) in :func:`lookup_many`."""
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a tensor of int64 ids, got {type(input).__name__}")
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must hold int64 (or int32) ids, got dtype {input.dtype}")
        device = self.table.device
        if input.device != device:
            raise ValueError(f"input is on {input.device} but the table is on {device}; move one of them")
        ids = input.long()
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D (B, L): each row is one bag")
            b, bag_len = ids.shape
            num_offsets = b + int(self.include_last_offset)
            key = (device, num_offsets, bag_len)
            offsets = None if aranges is None else aranges.get(key)
            if offsets is None:
                if bag_len:
                    offsets = torch.arange(0, num_offsets * bag_len, bag_len, device=device)
                else:
                    offsets = torch.zeros(num_offsets, dtype=torch.long, device=device)
                if aranges is not None:
                    aranges[key] = offsets
            if psw is not None and psw.shape != input.shape:
                raise ValueError(
                    f"per_sample_weights must have the shape of input {tuple(input.shape)}, got {tuple(psw.shape)}"
                )
            ids = ids.reshape(-1)
            psw = None if psw is None else psw.reshape(-1)
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError("offsets is required when input is 1-D (the start of each bag in input)")
            if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32):
                got = offsets.dtype if isinstance(offsets, torch.Tensor) else type(offsets).__name__
                raise TypeError(f"offsets must be an int64 (or int32) tensor, got {got}")
            if offsets.dim() != 1:
                raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
            if offsets.device != device:
                raise ValueError(f"offsets is on {offsets.device} but the table is on {device}")
            offsets = offsets.long()
            if deferred is None:
                check_offsets(offsets, ids.numel(), self.include_last_offset)
            else:
                deferred.append((offsets, ids.numel(), self.include_last_offset))
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D (B, L), got shape {tuple(input.shape)}")
        if psw is not None:
            if self.mode != "sum":
                raise ValueError(f"per_sample_weights is only supported with mode='sum', got mode={self.mode!r}")
            if not isinstance(psw, torch.Tensor) or not psw.is_floating_point():
                raise TypeError("per_sample_weights must be a floating-point tensor")
            if psw.shape != ids.shape:
                raise ValueError(f"per_sample_weights must have shape ({ids.numel()},) like input, got {tuple(psw.shape)}")
            if psw.device != device:
                raise ValueError(f"per_sample_weights is on {psw.device} but the table is on {device}")
            psw = psw.to(self.table.dtype)
        return ids, offsets, psw

    def _check_ids(self, ids: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"{name} must be an int64 tensor of ids, got {got}")
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        return ids.to(self.table.device, torch.long)


def padded_args(x: Any) -> tuple:
    """One table's input to lookup_many (a tensor, or a tuple or list of the forward's
    arguments) as ``(input, offsets, per_sample_weights)``, the missing ones None."""
    if isinstance(x, torch.Tensor):  # the usual case, first
        return (x, None, None)
    a = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return a + (None,) * (3 - len(a))


def check_offsets(offsets: torch.Tensor, n: int, include_last_offset: bool) -> None:
    """nn.EmbeddingBag's bag layout rules, checked before the table is touched."""
    flags = offsets_flags([(offsets, n, include_last_offset)])
    if not any(bool(f) for f in flags.values()):  # one device sync; the details below only run for bad input
        return
    _raise_offsets_error(offsets, n)


def check_offsets_many(
    layouts: Sequence[tuple], flags: dict[torch.device, torch.Tensor] | None = None
) -> None:
    """:func:`check_offsets` for several ``(offsets, n, include_last_offset)`` with one
    device read-back per device for all of them (a lookup of K tables waits once).
    ``flags``: their :func:`offsets_flags`, when the caller has them already."""
    flags = offsets_flags(layouts) if flags is None else flags
    if any(bool(f) for f in flags.values()):  # one read per device
        _raise_first_offsets_error(layouts)


def offsets_flags(layouts: Sequence[tuple]) -> dict[torch.device, torch.Tensor]:
    """Per device, whether any of the bag layouts ``(offsets, n, include_last_offset)`` there
    breaks a rule: one (1,) bool tensor on that device (one ``bag_layouts_bad`` call for all
    of them; nothing read back). Layouts with empty offsets are checked on the host by
    :func:`_host_checked_offsets` and add no flag; no device flag at all gives an empty dict."""
    by_device: dict[torch.device, list[tuple]] = {}
    for lay in layouts:
        if _host_checked_offsets(*lay):
            continue
        by_device.setdefault(lay[0].device, []).append(lay)
    return {dev: bag_layouts_bad(*zip(*lays)) for dev, lays in by_device.items()}


def insert_checked(
    layouts: Sequence[tuple], tables: Sequence[HashTable],
    insert: Callable[[torch.Tensor | None, Callable[[], None] | None], _T],
) -> tuple[_T, "LayoutCheck"]:  # fmt: skip
    """``insert(bad_input, on_refused)``, a find_or_insert into ``tables``, run so that it
    changes no table unless every bag layout in ``layouts`` (deferred by
    :meth:`DynamicEmbedding._bags`) is good; a bad one raises :func:`check_offsets`'s error.
    Returns the insert's result and the check (:class:`LayoutCheck`), whose ``guard`` the
    caller applies to each bag layout it then looks up with (the identity, unless the
    insert may have deferred, below).

    Why: reading the layouts' flag back would cost a host sync of its own (on a GPU, the
    device idles while Python runs), and the insert reads the device back anyway (CUDA
    find_or_insert's counters of the new ids, before it changes anything). So
    the layouts' flags are combined into one and passed to the op as ``bad_input``: it
    travels in that same copy, and the op refuses the call (ValueError, nothing changed)
    when it is set. A training forward then waits for the device once instead of twice.
    The detailed error is built only then, on the error path, where reading is fine.

    The flag rides only when it is one tensor on the device of all the tables (one op
    call); otherwise (layouts on several devices, tables on several devices) the layouts
    are read back first, as :func:`check_offsets_many` does.

    A deferred insert (``defer_inserts``) reads nothing back: a bad layout makes it change
    nothing and give slots of -1, and the error is raised when its counts are read (by the
    next ``step()`` at the latest: ``on_refused``, once for the call). The lookup still runs, so ``guard``
    replaces the checked layouts' offsets on the device, when the flag is set, by a good
    layout: zeros (and the number of ids last, with include_last_offset), every bag empty
    but the last, over ids whose slots are -1 (zero rows, no gradient). The kernels then
    never read past the ids."""
    flags = offsets_flags(layouts)
    if not flags:  # nothing to check on the device
        return insert(None, None), LayoutCheck()
    if len(flags) > 1 or set(flags) != {t.device for t in tables}:
        check_offsets_many(layouts, flags)
        return insert(None, None), LayoutCheck()
    (flag,) = flags.values()
    check = LayoutCheck(flag, layouts)
    try:
        result = insert(flag, check.refused)
    except ValueError:
        if not bool(flag):  # not refused for the offsets: someone else's error
            raise
    else:
        check.deferring = _capture.ACTIVE is not None or any(t.defer for t in tables)
        return result, check
    _raise_first_offsets_error(layouts)  # outside the except: the refusal is no part of the user's error


class LayoutCheck:
    """The bag layouts' check that rode on a training insert (:func:`insert_checked`): its
    flag (None: nothing left to check), the guard of the layouts looked up after it, and
    the refusal that a deferred insert raises when its counts are read, once for every
    insert that carried the flag."""

    def __init__(self, flag: torch.Tensor | None = None, layouts: Sequence[tuple] = ()) -> None:
        self.flag = flag
        self.layouts = layouts
        self.deferring = False  # some table of the insert defers: the guard replaces flagged layouts
        self.raised = False

    def guard(self, offsets: torch.Tensor, n: int, include_last_offset: bool) -> torch.Tensor:
        """``offsets`` (of ``n`` ids), or, when the insert may have deferred and the layout
        is one of the checked ones, a good layout of as many bags where the flag is set
        (zeros, and ``n`` last with include_last_offset; on the device, nothing read back)."""
        if not self.deferring or not offsets.numel():
            return offsets
        if not any(o is offsets and m == n and i == include_last_offset for o, m, i in self.layouts):
            return offsets
        if not include_last_offset:
            return torch.where(self.flag, 0, offsets)  # one kernel (masked_fill out of place: a copy and a fill)
        good = torch.zeros_like(offsets)
        good[-1:].fill_(n)  # a kernel (an indexed assignment copies from the host, which a capture refuses)
        return torch.where(self.flag, good, offsets)

    def renewed(self) -> "LayoutCheck":
        """The same check, not raised yet (for a replay of a captured step)."""
        again = copy.copy(self)
        again.raised = False
        return again

    def refused(self) -> None:
        """Raises the first bad layout's error (the first time only). When the offsets were
        changed in place since (none breaks a rule now), a ValueError says so."""
        if self.raised:
            return
        self.raised = True
        try:
            _raise_first_offsets_error(self.layouts)
        except AssertionError:
            pass
        raise ValueError(
            "the bag layout (offsets) of an earlier training forward broke a rule of nn.EmbeddingBag's offsets; "
            "that forward changed no table and read zeros. Its offsets were changed in place since, so the rule "
            "it broke is unknown"
        )


def _raise_first_offsets_error(layouts: Sequence[tuple]) -> NoReturn:
    """Raises the detailed error of the first bad layout, once a flag said some layout is
    bad (reads each layout back: for error paths only)."""
    for lay in layouts:
        check_offsets(*lay)
    raise AssertionError("a bag layout was flagged bad, but none breaks a rule")


def _host_checked_offsets(offsets: torch.Tensor, n: int, include_last_offset: bool) -> bool:
    """Checks the rules of empty offsets (their shape alone) on the host, raising when one
    is broken; returns whether ``offsets`` is empty: nothing left for the device to check."""
    if offsets.numel():
        return False
    if include_last_offset:
        raise ValueError("offsets must hold at least one entry with include_last_offset=True, got 0")
    if n:
        raise ValueError(f"offsets is empty (0 bags) but input holds {n} ids")
    return True


def _raise_offsets_error(offsets: torch.Tensor, n: int) -> None:
    """Raises the error that says which rule a bad bag layout breaks."""
    first = int(offsets[0])
    if first != 0:
        raise ValueError(f"offsets must start at 0, got offsets[0] = {first}")
    if offsets.numel() > 1:
        dec = (offsets[1:] < offsets[:-1]).nonzero()
        if dec.numel():
            i = int(dec[0, 0])
            raise ValueError(
                f"offsets must be non-decreasing, got offsets[{i}] = {int(offsets[i])} > "
                f"offsets[{i + 1}] = {int(offsets[i + 1])}"
            )
    last = int(offsets[-1])
    if last > n:
        raise ValueError(f"offsets[-1] = {last} is past the end of input ({n} ids)")
    raise ValueError(f"with include_last_offset=True, offsets[-1] must equal the number of ids ({n}), got {last}")
