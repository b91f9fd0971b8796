"""Slot assignment: which rank runs where.

Under hvdrun (:func:`assign_slots`) ranks fill hosts in the order given, all of a host's
slots before the next host. Under another launcher (:func:`derive_slots`) that launcher has
placed the ranks already, and the table is derived from the hosts they register from. Either
way a host's ``cross_rank`` is its index among the hosts that have a slot with the same
``local_rank``, so heterogeneous jobs (``a:1,b:2``) get consistent cross ranks and sizes.
:func:`visible_devices` gives each slot its host's GPUs where a scheduler (Ray, Spark) gave
them to the slots one by one.
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


def slots_used(hosts: Sequence[tuple[str, int]], num_proc: int) -> list[tuple[str, int]]:
    """``(hostname, workers)`` of the hosts that get workers: the first ``num_proc`` slots,
    filled host by host in the order given."""
    per_host: list[tuple[str, int]] = []
    remaining = num_proc
    for hostname, slots in hosts:
        if remaining <= 0:
            break
        used = min(slots, remaining)
        per_host.append((hostname, used))
        remaining -= used
    return per_host


def assign_slots(hosts: Sequence[tuple[str, int]], num_proc: int) -> list[SlotInfo]:
    """Assign ``num_proc`` ranks to ``(hostname, slots)`` pairs; raises ValueError if short."""
    if num_proc < 1:
        raise ValueError(f"the number of processes must be at least 1, got {num_proc}")
    total = sum(slots for _, slots in hosts)
    if num_proc > total:
        raise ValueError(f"{num_proc} processes requested but the hosts have only {total} slots")

    per_host = slots_used(hosts, num_proc)

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


def derive_slots(hosts: Sequence[str], local_ranks: Sequence[int | None]) -> list[SlotInfo]:
    """The slot table of a job whose ranks another launcher placed: rank ``i`` runs on
    ``hosts[i]`` with local rank ``local_ranks[i]`` (None: the launcher did not say).

    A host's ranks count its local ranks in rank order where the launcher gave none; its
    local size is the number of ranks that registered from it. Cross ranks count hosts in
    the order of their lowest rank, as :func:`assign_slots` does. Raises ValueError when the
    launcher's local ranks do not number a host's ranks 0, 1, ...
    """
    if len(hosts) != len(local_ranks):
        raise ValueError("one local rank (or None) per host entry")
    on_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        on_host.setdefault(host, []).append(rank)
    local: dict[int, int] = {}
    for host, ranks in on_host.items():
        given = [local_ranks[rank] for rank in ranks]
        if all(value is None for value in given):
            local.update({rank: index for index, rank in enumerate(ranks)})
            continue
        if None in given:
            without = [rank for rank in ranks if local_ranks[rank] is None]
            raise ValueError(
                f"{len(ranks)} ranks registered from host {host!r}, and the launcher gave a "
                f"local rank (LOCAL_RANK or its like) to some of them but not to rank(s) "
                f"{without}: set it on every rank, or on none"
            )
        if sorted(v for v in given if v is not None) != list(range(len(ranks))):
            pairs = ", ".join(f"rank {r}: {local_ranks[r]}" for r in ranks)
            raise ValueError(
                f"{len(ranks)} ranks registered from host {host!r}, but their local ranks "
                f"are not 0..{len(ranks) - 1} ({pairs}); do several machines share that "
                "host name?"
            )
        local.update({rank: int(local_ranks[rank]) for rank in ranks})  # type: ignore[arg-type]
    order = list(on_host)  # dicts keep insertion order: hosts by their lowest rank
    widest = max(len(ranks) for ranks in on_host.values())
    with_local_rank = [
        [host for host in order if len(on_host[host]) > local_rank] for local_rank in range(widest)
    ]
    return [
        SlotInfo(
            hostname=host,
            rank=rank,
            size=len(hosts),
            local_rank=local[rank],
            local_size=len(on_host[host]),
            cross_rank=with_local_rank[local[rank]].index(host),
            cross_size=len(with_local_rank[local[rank]]),
        )
        for rank, host in enumerate(hosts)
    ]


def visible_devices(slots: Sequence[SlotInfo], gpus: Sequence[Sequence[str]]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for each slot, given the GPU ids a scheduler gave each slot:
    all the GPUs of the slot's host, in local-rank order, so that local rank ``k`` uses CUDA
    device ``k`` (one GPU per slot). Each GPU is listed once: slots that share one (a
    fractional GPU each) would otherwise repeat its id, and CUDA takes a list with a
    repeated id as invalid (no GPU visible at all)."""
    by_host: dict[str, list[tuple[int, Sequence[str]]]] = {}
    for slot, ids in zip(slots, gpus, strict=True):
        by_host.setdefault(slot.hostname, []).append((slot.local_rank, ids))
    joined = {
        host: ",".join(dict.fromkeys(gpu for _, ids in sorted(pairs) for gpu in ids))
        for host, pairs in by_host.items()
    }
    return [joined[slot.hostname] for slot in slots]
