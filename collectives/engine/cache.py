"""The response cache: op descriptions every rank ran alike, the same table on every rank.

Horovod's response cache, for this engine. Every member of a process set keeps the same
least-recently-used table of op descriptions (kind, process set, name, signature, per-rank
part) that already ran with the same description on every member. Cycles of the set then
agree on ops by their place in the table instead of their full descriptions: see
:mod:`.rounds` for the rounds that do (one small allreduce per cycle, and the predicted
rounds of a repeating pattern).

Unnamed ops (``allreduce.noname.<counter>``) are cached under their kind, process set and
signature, with the counter left out of the key: the rounds compare counters separately.
The k-th unnamed op alike (kind, process set, signature) of a round has an entry of its own
(:func:`ordinal`), so a burst of unnamed ops is cached op by op as a named one is.

An op has one entry whatever its per-rank part (an allgather's first dimensions, an
alltoall's splits): only an op whose part was the same on every member is cached, so a
ragged op that ran with another part since replaces its entry, and a member whose part
differs from the entry's finds nothing (the cycle falls back to the full negotiation at
once). With an entry per part, members whose parts differed this time could each find an
older entry of their own, at different places, and the op waited as if only some members had
submitted it (HOLD_SECONDS per op, at every step of a variable-length allgather).

All members update the table from the same information in the same order (the ops that
ran, in the order they ran), so evictions happen alike everywhere and indices stay valid.
Only whoever holds the set's cycle lock touches it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from collectives.engine.requests import FIELD, NONAME_PREFIXES, Kind, Request

__all__ = [
    "DEFAULT_CAPACITY",
    "Key",
    "ResponseCache",
    "is_unnamed",
    "key_of",
    "keys_of",
    "ordinal",
    "request_key",
]

DEFAULT_CAPACITY = 1024

#: (kind, process set, name with an auto-name's counter replaced by "*", signature, part)
Key = tuple[int, int, str, str, str]


# In the key of an unnamed op, after its kind (and followed by its ordinal, if any): no op
# name holds FIELD (ops.submit refuses them), so no named op's key can look like it.
_UNNAMED = ".noname." + FIELD
_PREFIXES = [(prefix, len(prefix), prefix + FIELD) for prefix in NONAME_PREFIXES]


def key_of(kind: Kind, process_set_id: int, name: str, sig: str, var: str) -> tuple[Key, int]:
    """The cache key of an op, and its auto-name counter plus one (0 for named ops)."""
    prefix, length, pattern = _PREFIXES[kind]
    if name.startswith(prefix):
        counter = name[length:]
        if counter.isdigit():
            return (int(kind), process_set_id, pattern, sig, var), int(counter) + 1
    return (int(kind), process_set_id, name, sig, var), 0


def is_unnamed(key: Key) -> bool:
    """Whether a cache key is an unnamed op's (its entry then holds the counters too)."""
    return _UNNAMED in key[2]


def request_key(request: Request) -> tuple[Key, int]:
    return key_of(request.kind, request.process_set_id, request.name, request.sig, request.var)


def ordinal(key: Key, counter: int, seen: dict[Key, int]) -> Key:
    """The cache key of the k-th unnamed op of a round with this key (``seen`` counts them
    over the round); a named op's key as it is. Unnamed ops alike then have an entry each,
    told apart by their place in the round (the counters still decide whether they match)."""
    if not counter:
        return key
    k = seen.get(key, 0)
    seen[key] = k + 1
    return key if k == 0 else (key[0], key[1], f"{key[2]}{k}", key[3], key[4])


def keys_of(requests: Sequence[Request]) -> list[tuple[Key, int]]:
    """The cache keys of a round's ops in their order, and their counters (see key_of)."""
    seen: dict[Key, int] = {}
    keys = []
    for request in requests:
        key, counter = request_key(request)
        keys.append((ordinal(key, counter, seen), counter))
    return keys


class ResponseCache:
    """Op descriptions that ran alike on every rank, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._index: dict[tuple[int, int, str, str], int] = {}  # by key less its part
        self.keys: list[Key] = []  # by index
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0
        self.changes = 0  # keys added or replaced (what a layout derived from keys follows)

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, key: Key) -> int | None:
        """The entry's index, None unless it holds exactly this key (per-rank part too)."""
        index = self._index.get(key[:4])
        return index if index is not None and self.keys[index] == key else None

    def use(self, key: Key) -> int:
        """Marks the key as just used, adding it (evicting the least recently used entry
        when full; replacing the op's entry of another per-rank part); returns its index."""
        op = key[:4]
        index = self._index.get(op)
        if index is not None:
            self._lru.move_to_end(index)
            if self.keys[index] != key:
                # (counted as an eviction: whatever was derived from the old key is stale)
                self.keys[index] = key
                self.evictions += 1
                self.changes += 1
            return index
        if len(self.keys) < self.capacity:
            index = len(self.keys)
            self.keys.append(key)
        else:
            index, _ = self._lru.popitem(last=False)
            del self._index[self.keys[index][:4]]
            self.keys[index] = key
            self.evictions += 1
        self.changes += 1
        self._index[op] = index
        self._lru[index] = None
        return index
