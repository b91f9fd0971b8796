"""Negotiation: every rank learns what every other rank has submitted, in lockstep.

Each engine cycle, every rank contributes one fixed-size slot to a single ``allgather`` on a
Gloo group of its own: a small header (payload length, flags) and the text records of the
requests it submitted since the last cycle. A payload larger than the slot travels in a
second allgather of exactly the overflow, and the slot grows for later cycles (every rank
sees every length, so all resize alike; it shrinks again after a long run of small rounds).
In the steady state a cycle therefore costs one small collective however many ops it
carries.

All ranks then hold the same :class:`Table` of announced-but-unfinished ops and apply the
same rules to it, so they agree on which ops are ready, in which order, and which failed a
consistency check — without a coordinator round trip. An op is ready when every member of
its process set that has not joined has announced it; ready ops run in the order in which
they were first announced (cycle, then rank, then submission order).

The steady state of an SPMD program takes a shortcut (the role Horovod's response cache
plays): when every rank's payload is byte-for-byte the same, every op in it is ready and
consistent, and the engine runs them straight from its own requests without building the
table at all (see ``Engine._agreed``).
"""

from __future__ import annotations

import datetime
import itertools
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from collectives.torch.requests import (
    FIELD,
    KIND_BY_TEXT,
    RECORD,
    Kind,
    check_alltoall,
    describe_mismatch,
    label,
    parse_signature,
)

__all__ = ["Entry", "Exchange", "Table"]

FLAG_LEAVING = 1  # this rank's engine stops after this cycle (hvd.shutdown())
FLAG_ABORT = 2  # the stall inspector gave up: every rank fails its pending ops

_HEADER = struct.Struct("<IB")
_MIN_SLOT = 512
_MAX_SLOT = 1 << 20
#: The slot halves after this many rounds in a row that used less than a quarter of it.
_SHRINK_AFTER = 256


class Exchange:
    """The per-cycle allgather of every rank's announcements."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self._group = group
        self._rank = rank
        self._size = size
        self._small_rounds = 0
        self._resize(_MIN_SLOT)

    def _resize(self, slot: int) -> None:
        self._slot = slot
        self._small_rounds = 0
        # Tensors over bytearrays: Gloo writes straight into memory Python slices for free.
        self._send_raw = bytearray(slot)
        self._recv_raw = bytearray(slot * self._size)
        self._send = torch.frombuffer(self._send_raw, dtype=torch.uint8)
        self._recv = torch.frombuffer(self._recv_raw, dtype=torch.uint8)

    def _allgather(self, out: torch.Tensor, inp: torch.Tensor, timeout: float | None) -> None:
        if timeout is None:
            self._group._allgather_base(out, inp).wait()
            return
        opts = AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=timeout)
        self._group._allgather_base(out, inp, opts).wait()

    def round(
        self, payload: bytes, flags: int, timeout: float | None = None
    ) -> list[tuple[int, bytes]]:
        """Sends this rank's payload and flags; returns every rank's, in rank order."""
        slot, size = self._slot, self._size
        room = slot - _HEADER.size
        _HEADER.pack_into(self._send_raw, 0, len(payload), flags)
        head = payload[:room]
        self._send_raw[_HEADER.size : _HEADER.size + len(head)] = head
        self._allgather(self._recv, self._send, timeout)
        raw = self._recv_raw
        lengths, flag_list = [], []
        for peer in range(size):
            length, peer_flags = _HEADER.unpack_from(raw, peer * slot)
            lengths.append(length)
            flag_list.append(peer_flags)
        parts = [
            bytes(raw[p * slot + _HEADER.size : p * slot + _HEADER.size + min(n, room)])
            for p, n in enumerate(lengths)
        ]
        longest = max(lengths)
        if longest > room:
            extra = longest - room
            send = bytearray(extra)
            rest = payload[room:]
            send[: len(rest)] = rest
            recv = bytearray(extra * size)
            self._allgather(
                torch.frombuffer(recv, dtype=torch.uint8),
                torch.frombuffer(send, dtype=torch.uint8),
                timeout,
            )
            for p, n in enumerate(lengths):
                if n > room:
                    parts[p] += bytes(recv[p * extra : p * extra + n - room])
            grown = min(_MAX_SLOT, 1 << (longest + _HEADER.size - 1).bit_length())
            if grown > slot:
                self._resize(grown)
        # Every rank sees the same lengths, so all resize alike: a smaller slot is a
        # cheaper round, a larger one saves the overflow round.
        if (longest + _HEADER.size) * 4 <= slot and slot > _MIN_SLOT:
            self._small_rounds += 1
            if self._small_rounds >= _SHRINK_AFTER:
                self._resize(slot // 2)
        else:
            self._small_rounds = 0
        return list(zip(flag_list, parts, strict=True))


@dataclass(eq=False, slots=True)
class Entry:
    """An op that some rank announced and that has not run yet."""

    kind: Kind
    name: str
    process_set_id: int
    key: tuple[int, str]
    order: int
    first_seen: float
    sigs: dict[int, str] = field(default_factory=dict)
    vars: dict[int, str] = field(default_factory=dict)
    seen_at: dict[int, float] = field(default_factory=dict)
    warned_at: float = 0.0


class Table:
    """Announced ops, identical on every rank after each cycle."""

    def __init__(self, size: int) -> None:
        self._size = size
        self.entries: dict[tuple[int, str], Entry] = {}
        self.joined: dict[int, int] = {}  # rank -> cycle it joined in
        self._order = itertools.count()

    def add(self, rank: int, payload: bytes, cycle: int, now: float) -> tuple[list[Entry], bool]:
        """Records a rank's announcements; returns the entries touched, and whether it joined."""
        touched: list[Entry] = []
        joined = False
        if not payload:
            return touched, joined
        entries = self.entries
        for record in payload.decode().split(RECORD):
            kind_text, set_text, name, sig, var = record.split(FIELD)
            key = (int(set_text), name)
            entry = entries.get(key)
            if entry is None:
                kind = KIND_BY_TEXT[kind_text]
                entry = Entry(kind, name, key[0], key, next(self._order), now)
                entries[key] = entry
            entry.sigs[rank] = sig
            if var:
                entry.vars[rank] = var
            entry.seen_at[rank] = now
            if entry.kind == Kind.JOIN:
                self.joined[rank] = cycle
                joined = True
            touched.append(entry)
        return touched, joined

    def waiting_for(self, entry: Entry, members: list[int]) -> list[int]:
        """The ranks whose announcement the entry still needs."""
        if len(entry.sigs) == len(members) and entry.kind != Kind.JOIN:
            return []  # only members announce, so every member has
        if entry.kind == Kind.JOIN:
            return [r for r in range(self._size) if r not in entry.sigs]
        joined = self.joined
        return [r for r in members if r not in entry.sigs and r not in joined]

    def last_joined(self) -> int:
        """The rank that joined last (the highest rank among the last cycle's joiners)."""
        return max(self.joined.items(), key=lambda item: (item[1], item[0]))[0]

    def pop(self, entry: Entry) -> None:
        self.entries.pop(entry.key, None)


def check(entry: Entry, members: list[int], joined: dict[int, int]) -> str | None:
    """The consistency check of a ready entry: an error message, or None if all agree."""
    sigs = entry.sigs
    values = iter(sigs.values())
    first = next(values)
    for sig in values:
        if sig != first:
            return describe_mismatch(entry.kind, entry.name, sigs)
    if entry.kind == Kind.ALLTOALL:
        return check_alltoall(entry.name, members, entry.vars)
    if entry.kind == Kind.BROADCAST:
        root = int(parse_signature(entry.kind, first).common[0])
        if not 0 <= root < len(members):
            return (
                f"{label(entry.kind, entry.name)}: root_rank {root} is not a rank of the "
                f"process set (size {len(members)})"
            )
        if members[root] not in sigs:
            return (
                f"{label(entry.kind, entry.name)}: its root, rank {members[root]}, has joined "
                "and cannot broadcast"
            )
    return None
