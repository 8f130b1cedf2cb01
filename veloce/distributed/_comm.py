"""All-to-all plumbing of the sparse exchange: split sizes first, then variable-size payloads.

Every exchange starts with a small all-to-all of a fixed-width header per peer (a
signature of what is being exchanged, then the split sizes), so the receiving side always
knows how much comes from whom, and ranks that disagree (another table, another dim) fail
with an error on every rank instead of hanging or reading garbage.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from veloce.runtime.device import HostCopy, host_tensor

__all__ = ["ExchangeError", "exchange_headers", "begin_headers", "finish_headers", "Header", "all_to_all",
           "all_to_all_rows", "wire_dtype", "wire_code",
           "abandon_exchange", "agree_sum", "Group", "DeferredFailure", "raise_deferred_failures"]  # fmt: skip


class ExchangeError(RuntimeError):
    """Ranks disagree on what they exchange (a different table, dim or call order)."""


class Group:
    """A process group with its size and this process's rank in it."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        # Owners' failures agreed on the device and not read back yet (lookup_errors="raise_next").
        self.unread: list[DeferredFailure] = []
        # Forwards' first halves dispatched ahead by HybridParallel.prefetch, oldest first.
        self.prefetched: deque = deque()
        # Called before a DeferredFailure raises: drops the failed forward's gradients.
        self.on_failure: Optional[Callable[[], None]] = None


def exchange_headers(
    group: Group, sizes: torch.Tensor | Sequence[torch.Tensor], signature: Sequence[int], what: str,
    bad_input: Optional[torch.Tensor] = None, raise_bad_input: Optional[Callable[[], None]] = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Sends ``sizes[r, k]`` to every rank ``r`` (``sizes``: (world size, fields), one
    column per field, on the group's device; or a sequence of (world size,) fields);
    returns, per field ``k``, what this rank
    sends to each peer and what each peer sends to it (``sent[k][peer]``,
    ``received[k][peer]``).

    Every rank sends each peer one row of a fixed width: ``signature`` (a fixed number of
    ints describing the exchange, with the number of fields prepended), then the sizes when
    there are at most ``INLINE_FIELDS`` of them. If any peer's signature differs, every
    rank raises :class:`ExchangeError` (each sees at least one disagreeing peer). The
    fixed width is what makes one all-to-all (and one host read) enough: ranks that
    disagree on the number of fields still exchange rows of the same size, so none hangs.
    More fields than fit follow in a second all-to-all, once the signatures agree.

    ``bad_input``: a bool on the device, this rank's input check not yet read back. It
    travels in the header (this rank then abandons the exchange, as
    :func:`abandon_exchange` does) and is read back with it: when set, this rank calls
    ``raise_bad_input`` (which raises the detailed error) and the others raise
    :class:`ExchangeError`."""
    return finish_headers(group, begin_headers(group, sizes, signature, bad_input), what, raise_bad_input)


class Header:
    """A header swap queued by :func:`begin_headers`, not read back yet."""

    def __init__(self, mine: list[int], fields: torch.Tensor, inline: bool, rows: HostCopy) -> None:
        self.mine, self.fields, self.inline, self.rows = mine, fields, inline, rows


def begin_headers(
    group: Group, sizes: torch.Tensor | Sequence[torch.Tensor], signature: Sequence[int],
    bad_input: Optional[torch.Tensor] = None,
) -> Header:
    """The first half of :func:`exchange_headers`: queues the header swap and the copy of
    its rows to the host, without waiting for either. :func:`finish_headers` reads them
    (the swap's host sync) and checks the signatures. Between the two, this rank may
    queue other work; every rank must finish the swap before the group's next collective."""
    w = group.size
    if not isinstance(sizes, torch.Tensor):  # one (w,) tensor per field
        sizes = torch.stack([s.to(sizes[0].device, torch.long) for s in sizes], 1)
    dev = sizes.device
    if sizes.dim() != 2 or sizes.shape[0] != w:
        raise ValueError(f"exchange_headers: sizes must have shape ({w}, fields), got {tuple(sizes.shape)}")
    k = sizes.shape[1]
    mine = [k, *signature]
    if len(mine) != SIGNATURE_WIDTH:
        raise ValueError(f"exchange_headers: a signature holds {SIGNATURE_WIDTH - 1} ints, got {len(signature)}")
    inline = k <= INLINE_FIELDS
    row = torch.zeros(w, HEADER_WIDTH, dtype=torch.long, device=dev)
    row[:, :SIGNATURE_WIDTH] = host_tensor(mine, dev)
    fields = sizes.long()
    if inline:
        row[:, SIGNATURE_WIDTH : SIGNATURE_WIDTH + k] = fields
    if bad_input is not None:
        row[:, 0].masked_fill_(bad_input.to(dev), _ABANDONED)
    theirs = torch.empty_like(row)
    dist.all_to_all_single(theirs, row, group=group.group)
    return Header(mine, fields, inline, HostCopy(torch.stack([row, theirs])))


def finish_headers(
    group: Group, header: Header, what: str, raise_bad_input: Optional[Callable[[], None]] = None
) -> tuple[list[list[int]], list[list[int]]]:
    """The second half of :func:`exchange_headers` (which says what it returns and raises):
    the header rows read back (the host sync that sizes the payloads) and checked."""
    mine, k, inline = header.mine, header.fields.shape[1], header.inline
    sent_rows, recv_rows = header.rows.tolist()
    if sent_rows and sent_rows[0][0] == _ABANDONED:
        if raise_bad_input is not None:
            raise_bad_input()
        raise ExchangeError(f"{what}: this rank's input was flagged bad, but its check found nothing")
    for peer, got in enumerate(recv_rows):
        sig = got[:SIGNATURE_WIDTH]
        if sig[0] == _ABANDONED:
            raise ExchangeError(
                f"{what}: rank {peer} could not take part in this lookup (its own error says why, e.g. bad "
                f"input); every rank stops here"
            )
        if sig != mine:
            raise ExchangeError(
                f"{what}: rank {peer} sent signature {sig} to rank {group.rank}, which expected {mine}. Every rank "
                f"must call its sharded tables in the same order, grouped the same way, with the same "
                f"configuration (embedding dim, per_sample_weights given or not and requiring grad or not, "
                f"train or eval mode (a lookup under torch.no_grad() is an evaluation lookup), HybridParallel's "
                f"dedup and exchange_dtype)."
            )
    if inline:
        return _columns(sent_rows, SIGNATURE_WIDTH, k), _columns(recv_rows, SIGNATURE_WIDTH, k)
    fields = header.fields.contiguous()
    recv = torch.empty_like(fields)
    dist.all_to_all_single(recv, fields, group=group.group)
    sent_rows, recv_rows = torch.stack([fields, recv]).tolist()
    return _columns(sent_rows, 0, k), _columns(recv_rows, 0, k)


_ABANDONED = -1
SIGNATURE_WIDTH = 7  # the number of fields, then the 6 ints of a lookup's signature
INLINE_FIELDS = 66  # size fields sent with the signature: a lookup of up to 32 tables
HEADER_WIDTH = SIGNATURE_WIDTH + INLINE_FIELDS


def abandon_exchange(group: Group) -> None:
    """Takes part in the header swap of an exchange this rank cannot run (it failed
    before it); the other ranks raise :class:`ExchangeError` instead of waiting."""
    w = group.size
    mine = torch.full((w, HEADER_WIDTH), _ABANDONED, dtype=torch.long, device=_device(group))
    dist.all_to_all_single(torch.empty_like(mine), mine, group=group.group)


def agree_sum(group: Group, count: int) -> int:
    """The sum of ``count`` over the group's ranks (a collective: every rank calls it)."""
    return int(agree_sum_tensor(group, host_tensor([count], _device(group))).item())


def agree_sum_tensor(group: Group, counts: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The element-wise sum (``op="max"``: the largest) of ``counts`` over the group's
    ranks, on the group's device; no host read-back (a collective: every rank calls it).
    Reduces in place when ``counts`` is on that device already."""
    t = counts.to(_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group.group)
    return t


class DeferredFailure:
    """Whether an owner failed in one sharded forward, agreed over the group on the device
    and read back later (``HybridParallel(lookup_errors="raise_next")``).

    The all-reduce of one count per rank is queued without a host read: the forward goes
    on (a failed owner sends zero partial sums), and :func:`raise_deferred_failures`
    raises on every rank at the next step(), sharded lookup or flush(), when the device
    finished the count long ago, as a rule."""

    def __init__(self, group: Group, error: Optional[BaseException], what: str) -> None:
        self.count = HostCopy(agree_sum_tensor(group, host_tensor([int(error is not None)], _device(group))))
        self.error = error
        self.what = what

    def raise_if_failed(self) -> None:
        failed = int(self.count.tolist()[0])
        if self.error is not None:
            note = getattr(self.error, "add_note", None)
            if note is not None:
                note(f"(raised late: {self.what} failed on this owner in an earlier forward; "
                     f"HybridParallel(lookup_errors='raise_next') reports it here)")  # fmt: skip
            raise self.error
        if failed:
            raise ExchangeError(
                f"{self.what}: a sharded lookup of an earlier forward failed on {failed} other rank(s) (their errors "
                f"say why, e.g. a full table). With lookup_errors='raise_next' this is raised at the next step(), "
                f"lookup or flush(): no sparse update of that forward was applied (with CombinedOptimizer no dense "
                f"one either) and its sparse gradients were dropped; every rank stops here"
            )  # fmt: skip


def raise_deferred_failures(group: Group) -> None:
    """Reads the group's unread :class:`DeferredFailure` checks (a host read each, of a count
    the device has usually finished) and raises the first failure: this rank's own error,
    or :class:`ExchangeError` when only other ranks failed. Every rank reads the same
    counts, so every rank raises in the same call."""
    checks, group.unread = group.unread, []
    for check in checks:
        try:
            check.raise_if_failed()
        except BaseException:
            group.prefetched.clear()  # every rank stops: what was prefetched is not taken
            if group.on_failure is not None:
                group.on_failure()
            raise


def _device(group: Group) -> torch.device:
    """Where a group's small control tensors live (CUDA for NCCL)."""
    return torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")


def _columns(rows: list[list[int]], start: int, k: int) -> list[list[int]]:
    """Columns start .. start + k - 1 of a (peer, field) table, as field -> per-peer values."""
    return [[row[start + j] for row in rows] for j in range(k)]


def all_to_all(
    group: Group,
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    async_op: bool = False,
):
    """``all_to_all_single`` of rows of ``send`` (split along dim 0) into a new tensor.

    Returns the received tensor, or ``(tensor, work)`` with ``async_op=True``. Split
    sizes are checked here, before any communication."""
    if len(send_splits) != group.size or len(recv_splits) != group.size:
        raise ValueError(
            f"all_to_all: send_splits and recv_splits need one entry per rank ({group.size}), got "
            f"{len(send_splits)} and {len(recv_splits)}"
        )
    if sum(send_splits) != send.shape[0]:
        raise ValueError(f"all_to_all: send_splits sum to {sum(send_splits)} but send has {send.shape[0]} rows")
    send = send.contiguous()
    recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group.group,
        async_op=async_op,
    )  # fmt: skip
    return (recv, work) if async_op else recv


_WIRE_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def wire_dtype(wanted: Optional[torch.dtype], table_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype rows of ``table_dtype`` travel in when ``exchange_dtype`` is ``wanted``:
    ``wanted`` when it has fewer bytes than the table's (bfloat16 or float16 for fp32
    tables), else None (as they are: 16-bit tables gain nothing from another 16-bit type)."""
    if wanted is None or wanted.itemsize >= table_dtype.itemsize:
        return None
    return wanted


def modes_code(training: Sequence[bool]) -> int:
    """Whether each of an exchange's lookups is a training lookup (the table in training
    mode, gradients enabled), for its signature (bits 16 and up): ranks whose lookups
    differ fail the header instead of waiting in different collectives (training ranks
    exchange gradients, evaluating ranks do not)."""
    return sum(1 << (16 + k) for k, t in enumerate(training[:32]) if t)


def wire_code(wire: Optional[torch.dtype]) -> int:
    """``wire`` (:func:`wire_dtype`'s result) as a small int for an exchange's signature:
    ranks that would send rows in different dtypes fail the header instead of the payload."""
    return _WIRE_CODES[wire]


def all_to_all_rows(
    group: Group,
    rows: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    wire: Optional[torch.dtype] = None,
    async_op: bool = False,
):
    """:func:`all_to_all` of float rows (partial sums, embedding rows, their gradients)
    that travel as ``wire``: ``torch.bfloat16`` or ``torch.float16`` halves the bytes of
    fp32 rows (``HybridParallel(exchange_dtype=...)``); None sends them as they are.

    The received rows stay in the wire's dtype: the caller converts them back where that
    is cheapest (after regrouping them, which then moves half the bytes). Returns them,
    or with ``async_op=True`` a function that waits for them and returns them."""
    if wire is not None and wire != rows.dtype:
        rows = rows.to(wire)
    if not async_op:
        return all_to_all(group, rows, send_splits, recv_splits)
    recv, work = all_to_all(group, rows, send_splits, recv_splits, async_op=True)

    def landed() -> torch.Tensor:
        work.wait()
        return recv

    return landed
