"""The elastic driver's decisions (launcher.supervision.membership), without processes."""

from __future__ import annotations

from launcher.spec.hosts import HostSpec
from launcher.spec.options import ElasticOptions
from launcher.supervision.discovery import FixedHosts
from launcher.supervision.membership import Membership, Publish, Stop, Wait


def membership(
    hosts: list[tuple[str, int]], num_proc: int, min_np: int, **options: object
) -> Membership:
    specs = [HostSpec(name, slots) for name, slots in hosts]
    elastic = ElasticOptions(min_np=min_np, discovery=FixedHosts(specs), **options)  # type: ignore[arg-type]
    members = Membership(elastic, num_proc, rejoin_timeout=10.0)
    members.discovered = specs
    return members


def start_all(members: Membership, now: float = 0.0) -> None:
    for host in members.hosts_to_start(now):
        members.ready(host)


def publish(members: Membership, now: float = 0.0) -> Publish:
    decision = members.decide(now)
    assert isinstance(decision, Publish), decision
    members.published(members.generation + 1)
    for host in decision.members:
        host.state = "running"
    return decision


def test_older_hosts_keep_the_low_ranks() -> None:
    members = membership([("a", 1), ("b", 2), ("c", 1)], num_proc=4, min_np=2, max_np=None)
    start_all(members)
    first = publish(members)
    assert [(s.hostname, s.rank) for s in first.slots] == [("a", 0), ("b", 1), ("b", 2), ("c", 3)]
    assert members.decide(1.0) is None  # nothing changed
    members.fail(members.hosts["a"], now=1.0)
    members.retire_finished()
    second = publish(members, now=1.0)
    assert [(s.hostname, s.rank, s.size) for s in second.slots] == [
        ("b", 0, 3),
        ("b", 1, 3),
        ("c", 2, 3),
    ]
    assert members.resets == 1


def test_max_np_caps_the_hosts_started() -> None:
    members = membership([("a", 2), ("b", 2), ("c", 2)], num_proc=2, min_np=2, max_np=3)
    started = members.hosts_to_start(0.0)
    assert [(h.name, h.slots) for h in started] == [("a", 2), ("b", 1)]


def test_first_generation_waits_for_np_or_every_started_host() -> None:
    members = membership([("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None)
    a, b = members.hosts_to_start(0.0)
    members.ready(a)
    assert isinstance(members.decide(0.0), Wait)  # b is still starting and -np is 2
    members.fail(b, now=0.5)
    decision = members.decide(0.5)  # nothing starts any more: go with min-np
    assert isinstance(decision, Publish) and len(decision.slots) == 1


def test_too_few_slots_wait_then_stop_after_the_elastic_timeout() -> None:
    members = membership(
        [("a", 1), ("b", 1)], num_proc=2, min_np=2, max_np=None, elastic_timeout=5.0
    )
    start_all(members)
    publish(members)
    members.fail(members.hosts["b"], now=1.0)
    members.discovered = [HostSpec("a", 1)]
    waited = members.decide(1.0)
    assert isinstance(waited, Wait) and waited.message is not None
    assert "1 slot(s) available, --min-np is 2" in waited.message
    assert members.decide(3.0) == Wait(None)
    stop = members.decide(6.5)
    assert isinstance(stop, Stop)
    assert "for longer than the elastic timeout (5 s), fewer than --min-np 2" in stop.message


def test_reset_limit_and_every_worker_gone() -> None:
    members = membership([("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None, reset_limit=0)
    start_all(members)
    publish(members)
    members.fail(members.hosts["b"], now=1.0)
    stop = members.decide(1.0)
    assert isinstance(stop, Stop) and "more than --reset-limit 0" in stop.message
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=None)
    start_all(members)
    publish(members)
    members.fail(members.hosts["a"], now=1.0)
    stop = members.decide(1.0)
    assert isinstance(stop, Stop) and "every worker of the elastic job has failed" in stop.message


def test_rejoin_timeout_fails_the_members_that_do_not_rejoin() -> None:
    members = membership([("a", 1), ("b", 1), ("c", 1)], num_proc=3, min_np=2, max_np=None)
    start_all(members)
    publish(members)
    waiting = {("a", 0), ("c", 0)}
    assert members.rejoin_failures(1.0, waiting) == []
    assert members.rejoin_failures(10.5, waiting) == []
    (hung,) = members.rejoin_failures(11.5, waiting)
    assert hung.name == "b"
    # everyone waits: a transient error, the next generation is due at once
    assert members.rejoin_failures(12.0, {("a", 0), ("b", 0), ("c", 0)}) == []
    assert members.need_publish


def test_a_host_discovery_drops_is_removed_and_a_failed_one_comes_back_after_cooldown() -> None:
    members = membership(
        [("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None, cooldown=(1.0, 4.0)
    )
    start_all(members)
    publish(members)
    members.discovered = [HostSpec("a", 1)]
    (dropped,) = members.drop_undiscovered()
    assert dropped.name == "b" and dropped.state == "removed" and members.need_publish
    members.fail(members.hosts["a"], now=0.0)
    members.retire_finished()
    assert members.hosts_to_start(0.5) == []  # cooling down
    (back,) = members.hosts_to_start(1.0)
    assert back.name == "a"
