"""Slot assignment: which rank runs where.

Ranks fill hosts in the order given, all of a host's slots before the next host. A host's
``cross_rank`` is its index among the hosts that have a slot with the same ``local_rank``,
so heterogeneous host lists (``a:1,b:2``) get consistent cross ranks and sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place among its peers (Horovod's rank vocabulary)."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def assign_slots(hosts: Sequence[tuple[str, int]], num_proc: int) -> list[SlotInfo]:
    """Assign ``num_proc`` ranks to ``(hostname, slots)`` pairs; raises ValueError if short."""
    if num_proc < 1:
        raise ValueError(f"the number of processes must be at least 1, got {num_proc}")
    total = sum(slots for _, slots in hosts)
    if num_proc > total:
        raise ValueError(f"{num_proc} processes requested but the hosts have only {total} slots")

    per_host: list[tuple[str, int]] = []  # (hostname, slots used)
    remaining = num_proc
    for hostname, slots in hosts:
        if remaining == 0:
            break
        used = min(slots, remaining)
        per_host.append((hostname, used))
        remaining -= used

    # hosts_with_local_rank[l] lists host indices that run a slot with local_rank l.
    max_local = max(used for _, used in per_host)
    hosts_with_local_rank = [
        [index for index, (_, used) in enumerate(per_host) if used > local_rank]
        for local_rank in range(max_local)
    ]

    result: list[SlotInfo] = []
    for host_index, (hostname, used) in enumerate(per_host):
        for local_rank in range(used):
            peers = hosts_with_local_rank[local_rank]
            result.append(
                SlotInfo(
                    hostname=hostname,
                    rank=len(result),
                    size=num_proc,
                    local_rank=local_rank,
                    local_size=used,
                    cross_rank=peers.index(host_index),
                    cross_size=len(peers),
                )
            )
    return result
