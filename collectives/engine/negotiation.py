"""Negotiation: every rank learns what every other rank has submitted, in lockstep.

Each engine cycle, every rank contributes one fixed-size slot to a single ``allgather`` on a
Gloo group of its own: a small header (payload length, the length it wanted to send, flags),
the text records of the requests it submitted since the last cycle and, when they fit, the
data of small allreduces (see :mod:`eager`). A payload larger than the slot travels in a
second allgather of exactly the overflow, and the slot grows for later cycles to fit what
any rank sent or wanted to send (every rank sees every length, so all resize alike; it
shrinks again after a run of small rounds).
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from collectives.engine.requests import (
    FIELD,
    KIND_BY_TEXT,
    RECORD,
    Kind,
    adasum_name,
    check_alltoall,
    describe_mismatch,
    label,
    parse_signature,
)
from collectives.errors import (
    CollectiveError,
    InvalidArgumentsError,
    NotSupportedWithJoinError,
    TensorMismatchError,
)

__all__ = ["Entry", "Exchange", "Table"]

FLAG_LEAVING = 1  # this rank's engine stops after this cycle (hvd.shutdown())
FLAG_ABORT = 2  # the stall inspector gave up: every rank fails its pending ops
FLAG_FLUSH = 4  # flush the arrival accounting after this round (see :mod:`.insight`)
FLAG_FAILED = 8  # with FLAG_LEAVING: this rank's script failed; how follows its records

_HEADER = struct.Struct("<IIB")  # payload length, payload length wanted, flags
_MIN_SLOT = 512
_MAX_SLOT = 1 << 20
#: The slot shrinks after a run of rounds that used less than a quarter of it: as many as
#: move about this many bytes of slot per rank, within these bounds.
_WASTE = 2 << 20
_MIN_PATIENCE = 4
_MAX_PATIENCE = 256


class Exchange:
    """The per-cycle allgather of every rank's announcements."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self._group = group
        self._rank = rank
        self._size = size
        self.wants: list[int] = []  # each rank's wanted payload length in the last round
        self._resize(_MIN_SLOT)

    def close(self) -> Any:
        """Forgets the process group (after a failure: see ``Engine._abandon_groups``) and
        returns it; no round can run after this."""
        group, self._group = self._group, None
        return group

    def _resize(self, slot: int) -> None:
        self._slot = slot
        self._small_rounds = 0
        self._recent = 0  # the largest of the current run of small rounds
        # Tensors over bytearrays: Gloo writes straight into memory Python slices for free.
        self._send_raw = bytearray(slot)
        self._recv_raw = bytearray(slot * self._size)
        self._send = torch.frombuffer(self._send_raw, dtype=torch.uint8)
        self._recv = torch.frombuffer(self._recv_raw, dtype=torch.uint8)

    @property
    def room(self) -> int:
        """The payload bytes the next round carries without an overflow round."""
        return self._slot - _HEADER.size

    def _allgather(self, out: torch.Tensor, inp: torch.Tensor, timeout: float | None) -> None:
        if self._size == 1:  # (a rank alone gathers its own: no collective, as for _sum)
            out.copy_(inp)
            return
        if timeout is None:
            self._group._allgather_base(out, inp).wait()
            return
        opts = AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=timeout)
        self._group._allgather_base(out, inp, opts).wait()

    def round(
        self,
        payload: bytes,
        flags: int,
        timeout: float | None = None,
        data: Sequence[torch.Tensor] = (),
        want: int = 0,
    ) -> list[tuple[int, bytes | memoryview]]:
        """Sends this rank's payload and flags; returns every rank's, in rank order.

        ``data`` (flat uint8 tensors) follows the payload; the caller makes sure that
        both fit in :attr:`room`. ``want`` is the payload size this rank would have liked
        to send (see :attr:`wants`): the slot grows to fit it. A rank's payload comes back
        as a view of the receive buffer, valid until the next round (as bytes when it
        overflowed the slot).
        """
        slot, size = self._slot, self._size
        room = slot - _HEADER.size
        length = len(payload) + sum([t.numel() for t in data])
        _HEADER.pack_into(self._send_raw, 0, length, max(want, length), flags)
        head = payload[:room]
        start = _HEADER.size + len(head)
        self._send_raw[_HEADER.size : start] = head
        if data:
            if length > room:
                raise ValueError(f"{length} bytes of payload do not fit a round of {room}")
            torch.cat(list(data), out=self._send[start : _HEADER.size + length])
        self._allgather(self._recv, self._send, timeout)
        raw = memoryview(self._recv_raw)
        lengths, wants, flag_list = [], [], []
        for peer in range(size):
            peer_length, peer_want, peer_flags = _HEADER.unpack_from(raw, peer * slot)
            lengths.append(peer_length)
            wants.append(peer_want)
            flag_list.append(peer_flags)
        parts: list[bytes | memoryview] = [
            raw[p * slot + _HEADER.size : p * slot + _HEADER.size + min(n, room)]
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
                    parts[p] = bytes(parts[p]) + bytes(recv[p * extra : p * extra + n - room])
        self.wants = wants
        self._adapt(longest, max(wants))
        return list(zip(flag_list, parts, strict=True))

    def _adapt(self, longest: int, wanted: int) -> None:
        """Every rank sees the same lengths, so all resize alike. The slot grows to fit the
        largest payload any rank sent or wanted to send (saving the overflow round next
        time, letting small allreduces ride). Every round moves the whole slot, so after a
        run of rounds that used less than a quarter of it, it shrinks to fit them: the
        larger the slot, the sooner (it wastes at most about ``_WASTE`` bytes per rank)."""
        slot = self._slot
        needed = max(longest, wanted) + _HEADER.size
        if needed > slot:
            grown = min(_MAX_SLOT, 1 << (needed - 1).bit_length())
            if grown > slot:
                self._resize(grown)
            return
        if needed * 4 > slot or slot == _MIN_SLOT:
            self._small_rounds = 0
            self._recent = 0
            return
        self._small_rounds += 1
        self._recent = max(self._recent, needed)
        if self._small_rounds >= max(_MIN_PATIENCE, min(_MAX_PATIENCE, _WASTE // slot)):
            self._resize(max(_MIN_SLOT, 1 << (self._recent - 1).bit_length()))

    def gather(
        self, data: Sequence[torch.Tensor], nbytes: int, timeout: float | None
    ) -> list[torch.Tensor]:
        """Allgathers ``nbytes`` from every rank (``data``: flat uint8 tensors, back to
        back); returns each rank's bytes, in rank order. Every rank must pass the same
        ``nbytes``: agree on it in a round first."""
        send = data[0] if len(data) == 1 else torch.cat(list(data))
        recv = torch.empty(nbytes * self._size, dtype=torch.uint8)
        self._allgather(recv, send, timeout)
        return list(recv.split(nbytes))


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
        # The ranks of ``joined``, as an immutable snapshot replaced whenever it changes:
        # the one thing other threads read (other sets' stall inspectors, see :mod:`.stall`).
        self.joined_ranks: frozenset[int] = frozenset()
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
                self.joined_ranks = frozenset(self.joined)
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

    def last_joiners(self) -> list[int]:
        """The ranks whose joins reached the latest cycle that carried one (usually one)."""
        latest = max(self.joined.values())
        return [rank for rank, cycle in self.joined.items() if cycle == latest]

    def pop(self, entry: Entry) -> None:
        self.entries.pop(entry.key, None)

    def clear_joins(self) -> None:
        """Every rank has joined: ``hvd.join()`` returns, and no rank is joined any more."""
        self.joined.clear()
        self.joined_ranks = frozenset()


#: What hvd.join() supports (as in Horovod): joined ranks add neutral values to an allreduce
#: and skip a barrier; an op that needs every member's data or its root cannot run.
_JOIN_UNSUPPORTED = frozenset((Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL, Kind.REDUCESCATTER))


def check(entry: Entry, members: list[int], joined: dict[int, int]) -> CollectiveError | None:
    """The consistency check of a ready entry: the error every submitter gets, or None."""
    sigs = entry.sigs
    values = iter(sigs.values())
    first = next(values)
    for sig in values:
        if sig != first:
            if entry.kind == Kind.BROADCAST:
                roots = _root_mismatch(entry, members)
                if roots is not None:
                    return TensorMismatchError(roots)
            return TensorMismatchError(describe_mismatch(entry.kind, entry.name, sigs))
    if joined and entry.kind in _JOIN_UNSUPPORTED:
        gone = [r for r in members if r in joined]
        if gone:
            kind = entry.kind.label
            what = f"as in Horovod {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
            hint = "only allreduce can"
            if adasum_name(entry.kind, entry.name) is not None:  # (travels as an allgather)
                what, hint = "an Adasum allreduce", "allreduces with another op can"
            elif entry.kind == Kind.ALLGATHER:  # (sparse gradients are reduced by allgathers)
                hint += "; with sparse gradients pass sparse_as_dense=True to DistributedOptimizer"
            return NotSupportedWithJoinError(
                f"{label(entry.kind, entry.name)}: rank(s) {gone} called hvd.join(), and "
                f"{what} cannot run while a rank has joined ({hint})"
            )
    if entry.kind == Kind.ALLTOALL:
        error = check_alltoall(entry.name, members, entry.vars)
        return None if error is None else InvalidArgumentsError(error)
    if entry.kind == Kind.BROADCAST:
        root = parse_signature(entry.kind, first).root()
        if not 0 <= root < len(members):
            return InvalidArgumentsError(
                f"{label(entry.kind, entry.name)}: root_rank {root} is not a rank of the "
                f"process set (size {len(members)})"
            )
    return None


def _root_mismatch(entry: Entry, members: list[int]) -> str | None:
    """Ranks that disagree on a broadcast's root, named by global ranks as the callers
    passed them (requests carry the root's position in the set)."""
    roots: dict[int, int] = {}
    for rank_, sig in entry.sigs.items():
        index = parse_signature(entry.kind, sig).root()
        roots[rank_] = members[index] if 0 <= index < len(members) else index
    if len(set(roots.values())) < 2:
        return None
    shown = "; ".join(f"rank {rank_}: {root}" for rank_, root in sorted(roots.items()))
    return f"{label(entry.kind, entry.name)}: ranks disagree on the root_rank: {shown}"
