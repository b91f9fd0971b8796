"""The elastic driver's decisions about spare hosts and slots that --max-np capped
(launcher.supervision.membership), without processes: a spare host started for a failed one
joins in the same reset, a capped host's slots are remembered apart from the workers it runs,
and --dry-run plans the first generation the driver would publish."""

from __future__ import annotations

from launcher.spec.hosts import HostSpec
from launcher.spec.options import ElasticOptions
from launcher.supervision.discovery import FixedHosts
from launcher.supervision.membership import START_WINDOW, Publish, Wait, first_generation
from tests.launcher.test_membership import membership, publish, start_all


def test_a_spare_started_for_a_failed_host_joins_in_the_same_reset() -> None:
    # scen_maxnp: -np 1 --max-np 2 --reset-limit 2; discovery adds b and c, only b fits; b
    # fails and c starts in its place: one reset for both, as in Horovod.
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=2, reset_limit=2)
    start_all(members)
    publish(members)  # generation 1: a
    members.discovered = [HostSpec("a", 1), HostSpec("b", 1), HostSpec("c", 1)]
    start_all(members, now=1.0)
    assert set(members.hosts) == {"a", "b"}  # c is a spare: --max-np 2
    publish(members, now=1.0)  # generation 2: a, b (reset 1)
    members.fail(members.hosts["b"], now=2.0)
    members.retire_finished()
    (spare,) = members.hosts_to_start(2.0)
    assert spare.name == "c"
    assert members.decide(2.0) == Wait(None)  # c is on its way: no survivors-only generation
    members.ready(spare)
    decision = publish(members, now=2.5)
    assert [h.name for h in decision.members] == ["a", "c"]
    assert members.resets == 2  # within --reset-limit 2
    assert members.decide(3.0) is None


def test_a_failure_without_a_spare_on_its_way_publishes_at_once() -> None:
    """Recovery latency: nothing waits where no host is starting, nor once the spare's start
    failed, nor longer than the start window for a slow one."""
    members = membership([("a", 1), ("b", 1), ("c", 1)], num_proc=3, min_np=1, max_np=None)
    start_all(members)
    publish(members)
    members.fail(members.hosts["c"], now=1.0)  # blacklisted: nothing takes its place
    members.retire_finished()
    assert members.hosts_to_start(1.0) == []
    publish(members, now=1.0)
    members.discovered = [HostSpec("a", 1), HostSpec("b", 1), HostSpec("d", 1), HostSpec("e", 1)]
    members.fail(members.hosts["b"], now=2.0)
    members.retire_finished()
    d, e = members.hosts_to_start(2.0)
    assert members.decide(2.0) == Wait(None)
    members.fail(d, now=2.5)  # its agent could not start ...
    assert members.decide(START_WINDOW + 1.9) == Wait(None)  # ... e still may, in the window
    decision = members.decide(START_WINDOW + 2.1)  # the window closed: go without e
    assert isinstance(decision, Publish) and [h.name for h in decision.members] == ["a"]
    members.published(members.generation + 1)
    members.ready(e)  # e joins later, in a generation of its own
    decision = members.decide(START_WINDOW + 3.0)
    assert isinstance(decision, Publish) and [h.name for h in decision.members] == ["a", "e"]


def test_hosts_discovery_adds_together_join_in_one_generation() -> None:
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=None)
    start_all(members)
    publish(members)
    members.discovered = [HostSpec("a", 1), HostSpec("b", 1), HostSpec("c", 1)]
    b, c = members.hosts_to_start(1.0)
    members.ready(b)
    assert members.decide(1.0) == Wait(None)  # c is still starting
    members.ready(c)
    decision = publish(members, now=1.5)
    assert [h.name for h in decision.members] == ["a", "b", "c"] and members.resets == 1


def test_a_host_capped_by_max_np_takes_freed_slots_until_its_workers_start() -> None:
    members = membership([("a", 1), ("b", 1), ("c", 2)], num_proc=2, min_np=1, max_np=3)
    a, b, c = members.hosts_to_start(0.0)
    assert (c.slots, c.offered) == (1, 2)  # capped by --max-np 3
    members.ready(a)
    members.ready(b)
    assert members.decide(0.0) == Wait(None)
    publish(members, now=START_WINDOW + 1)  # c was slow: generation 1 is a and b
    members.fail(b, now=10.0)
    members.retire_finished()
    assert members.hosts_to_start(10.0) == []
    assert c.slots == 2  # b's slot is free: c, not started yet, runs both of its slots
    members.ready(c)
    decision = publish(members, now=10.5)
    assert [s.hostname for s in decision.slots] == ["a", "c", "c"]


def test_a_running_host_keeps_its_workers_and_is_not_said_to_have_changed() -> None:
    # d4.sh: discovery lists localhost:4 for -np 2 --max-np 2: it runs 2, nothing changed.
    members = membership([("a", 4)], num_proc=2, min_np=2, max_np=2)
    start_all(members)
    publish(members)
    assert members.notices(None, []) == []
    members.discovered = [HostSpec("a", 3)]  # a real change is said, once
    assert members.notices(None, []) == [
        "discovery lists host a with 3 slot(s); it keeps the 2 it started with while its "
        "workers run (a changed count applies when the host joins again)"
    ]
    # scen_cap: a 2 + b 1 (of 2) under --max-np 3; a fails. b's agent started its one worker:
    # it keeps it (Horovod would start a second worker on b).
    members = membership([("a", 2), ("b", 2)], num_proc=2, min_np=1, max_np=3)
    start_all(members)
    publish(members)
    members.fail(members.hosts["a"], now=1.0)
    members.retire_finished()
    assert members.hosts_to_start(1.0) == []
    decision = publish(members, now=1.0)
    assert [(s.hostname, s.local_size) for s in decision.slots] == [("b", 1)]
    assert members.notices(None, []) == []


def test_the_first_generation_is_the_drivers_whatever_np_says() -> None:
    """What --dry-run shows: every discovered slot up to --max-np, at least --min-np."""

    def planned(
        hosts: list[tuple[str, int]], num_proc: int, min_np: int, max_np: int | None
    ) -> list[str]:
        specs = [HostSpec(name, slots) for name, slots in hosts]
        options = ElasticOptions(min_np=min_np, max_np=max_np, discovery=FixedHosts(specs))
        return [slot.hostname for slot in first_generation(options, num_proc, specs)]

    assert planned([("a", 2), ("b", 2)], 2, 2, 3) == ["a", "a", "b"]
    assert planned([("a", 2)], 1, 1, None) == ["a", "a"]
    assert planned([("a", 2)], 4, 2, None) == ["a", "a"]  # fewer than -np: it starts with 2
    assert planned([("a", 1)], 4, 2, None) == ["a"]  # fewer than --min-np: it waits with 1
    assert planned([], 1, 1, None) == []
