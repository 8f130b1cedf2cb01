"""All-to-all plumbing of the sparse exchange: split sizes first, then variable-size payloads.

Every exchange starts with a small all-to-all of a header per peer (split sizes plus a
signature of what is being exchanged), so the receiving side always knows how much comes
from whom, and ranks that disagree (another table, another dim) fail with an error on
every rank instead of hanging or reading garbage.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from veloce._device import host_tensor

__all__ = ["ExchangeError", "exchange_headers", "all_to_all", "abandon_exchange", "agree_sum", "Group"]


class ExchangeError(RuntimeError):
    """Ranks disagree on what they exchange (a different table, dim or call order)."""


class Group:
    """A process group with its size and this process's rank in it."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)


def exchange_headers(
    group: Group, sizes: Sequence[torch.Tensor], signature: Sequence[int], what: str
) -> tuple[list[list[int]], list[list[int]]]:
    """Sends ``sizes[k][r]`` to every rank ``r``; returns, per field ``k``, what this rank
    sends to each peer and what each peer sends to it (``sent[k][peer]``,
    ``received[k][peer]``).

    First the ranks swap ``signature`` (a fixed number of ints describing the exchange,
    with the number of fields prepended); if any peer's differs, every rank raises
    :class:`ExchangeError` (each sees at least one disagreeing peer) before the sizes,
    whose number may then differ, are exchanged."""
    w = group.size
    dev = sizes[0].device
    mine = [len(sizes), *signature]
    sig = host_tensor(mine, dev).expand(w, len(mine)).contiguous()
    theirs = torch.empty_like(sig)
    dist.all_to_all_single(theirs, sig, group=group.group)
    for peer, row in enumerate(theirs.tolist()):
        if row[0] == _ABANDONED:
            raise ExchangeError(
                f"{what}: rank {peer} could not take part in this lookup (its own error says why, e.g. bad "
                f"input); every rank stops here"
            )
        if row != mine:
            raise ExchangeError(
                f"{what}: rank {peer} sent signature {row} to rank {group.rank}, which expected {mine}. Every rank "
                f"must call its sharded tables in the same order, grouped the same way, with the same "
                f"configuration (embedding dim, per_sample_weights given or not and requiring grad or not)."
            )
    header = torch.stack([s.to(dev, torch.long) for s in sizes], 1).contiguous()
    recv = torch.empty_like(header)
    dist.all_to_all_single(recv, header, group=group.group)
    sent_rows, recv_rows = torch.stack([header, recv]).tolist()  # the host sync that sizes the payloads
    k = len(sizes)
    return _columns(sent_rows, k), _columns(recv_rows, k)


_ABANDONED = -1
SIGNATURE_WIDTH = 7  # the number of fields, then the 6 ints of a lookup's signature


def abandon_exchange(group: Group) -> None:
    """Takes part in the signature swap of an exchange this rank cannot run (it failed
    before it); the other ranks raise :class:`ExchangeError` instead of waiting."""
    w = group.size
    mine = torch.full((w, SIGNATURE_WIDTH), _ABANDONED, dtype=torch.long, device=_device(group))
    dist.all_to_all_single(torch.empty_like(mine), mine, group=group.group)


def agree_sum(group: Group, count: int) -> int:
    """The sum of ``count`` over the group's ranks (a collective: every rank calls it)."""
    return int(agree_sum_tensor(group, host_tensor([count], _device(group))).item())


def agree_sum_tensor(group: Group, counts: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of ``counts`` over the group's ranks, on the group's device;
    no host read-back (a collective: every rank calls it)."""
    t = counts.to(_device(group))
    dist.all_reduce(t, group=group.group)
    return t


def _device(group: Group) -> torch.device:
    """Where a group's small control tensors live (CUDA for NCCL)."""
    return torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")


def _columns(rows: list[list[int]], k: int) -> list[list[int]]:
    """The first k columns of a (peer, field) table, as field -> per-peer values."""
    return [[row[j] for row in rows] for j in range(k)]


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
