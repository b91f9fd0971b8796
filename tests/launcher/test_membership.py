"""The elastic driver's decisions (launcher.supervision.membership), without processes."""

from __future__ import annotations

import itertools

from launcher.spec.hosts import HostSpec
from launcher.spec.options import ElasticOptions
from launcher.supervision.discovery import FixedHosts
from launcher.supervision.membership import (
    LEAVE_GRACE,
    START_WINDOW,
    SYNC_WAIT,
    HostRecord,
    Membership,
    Publish,
    Stop,
    Wait,
)


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


_workers = itertools.count()


def publish(members: Membership, now: float = 0.0, synced: bool = True) -> Publish:
    """Publishes the next generation: its new hosts get workers; with ``synced`` every
    member's workers then report holding the training state in it."""
    decision = members.decide(now)
    assert isinstance(decision, Publish), decision
    members.published(members.generation + 1)
    for host in decision.members:
        if host.state == "ready":
            host.workers = {next(_workers): local for local in range(host.slots)}
        host.state = "running"
    if synced:
        sync(members, *decision.members)
    return decision


def sync(members: Membership, *hosts: HostRecord) -> None:
    """The hosts' workers report holding the state, synced in the current generation."""
    held = dict(members.holders)
    for host in hosts:
        held.update(dict.fromkeys(host.workers, members.generation))
    members.note_holders(held)


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


def test_the_wait_for_min_np_at_start_is_announced_once_nothing_else_is_starting() -> None:
    members = membership([("a", 1), ("b", 1)], num_proc=2, min_np=2, max_np=None)
    a, b = members.hosts_to_start(0.0)
    members.ready(a)
    assert members.decide(0.0) == Wait(None)  # b may still bring the slot
    members.fail(b, now=2.0)
    waited = members.decide(2.0)
    assert waited == Wait(
        "1 slot(s) available, --min-np is 2: waiting up to 598 s for more hosts"
    )  # (from when the wait began)
    assert members.decide(3.0) == Wait(None)  # said once


def test_discovery_listing_no_host_keeps_the_running_ones_for_the_elastic_timeout() -> None:
    members = membership(
        [("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None, elastic_timeout=5.0
    )
    start_all(members)
    publish(members)
    members.discovered = []  # a discovery script that failed for a moment
    assert members.drop_undiscovered(1.0) == [] and members.unlisted_since == 1.0
    (notice,) = members.notices(None, [])
    assert "they keep running, with the training state" in notice
    assert members.decide(1.0) is None  # nothing changed: the job trains on
    members.discovered = [HostSpec("a", 1), HostSpec("b", 1)]
    assert members.drop_undiscovered(2.0) == [] and members.unlisted_since is None
    assert members.notices(1.0, []) == ["discovery lists hosts again; the job goes on"]
    # Listed nowhere for longer than the elastic timeout: removed, and the job stops saying so.
    members.discovered = []
    assert members.drop_undiscovered(3.0) == []
    assert {h.name for h in members.drop_undiscovered(8.5)} == {"a", "b"}
    for host in members.all_hosts():
        host.agent_finished = True  # (their workers left)
    members.retire_finished()
    stop = members.decide(8.5)
    assert isinstance(stop, Stop) and stop.message == (
        "discovery has listed none of the elastic job's hosts for longer than --elastic-timeout "
        "(5 s): its workers are gone, and its training state with them; stopping the job"
    )


def test_a_changed_slot_count_of_a_running_host_is_noted_once() -> None:
    members = membership([("a", 2)], num_proc=2, min_np=1, max_np=None)
    start_all(members)
    publish(members)
    members.discovered = [HostSpec("a", 3)]
    assert members.drop_undiscovered(1.0) == []
    assert members.notices(None, []) == [
        "discovery lists host a with 3 slot(s); it keeps the 2 it started with while its "
        "workers run (a changed count applies when the host joins again)"
    ]
    assert members.notices(None, []) == []  # said once
    members.discovered = [HostSpec("a", 2)]
    assert members.notices(None, []) == []
    members.discovered = [HostSpec("a", 3)]
    assert len(members.notices(None, [])) == 1  # changed again: said again


def test_reset_limit_and_every_worker_gone() -> None:
    members = membership([("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None, reset_limit=0)
    start_all(members)
    publish(members)
    members.fail(members.hosts["b"], now=1.0)
    stop = members.decide(1.0)
    assert isinstance(stop, Stop) and stop.message.splitlines() == [
        "Horovod was shutdown because number of resets during elastic job exceeded limit: 0",
        "the elastic job would need reset 1, more than --reset-limit 0; stopping the job",
    ]
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=None)
    start_all(members)
    publish(members)
    members.fail(members.hosts["a"], now=1.0)
    stop = members.decide(1.0)
    assert isinstance(stop, Stop) and stop.message.splitlines() == [
        "Horovod detected that one or more processes exited with non-zero status, thus "
        "causing the job to be terminated.",
        "every worker of the elastic job has failed or left, and its training state with "
        "them; stopping the job",
    ]


def test_rejoin_timeout_fails_the_members_that_do_not_rejoin() -> None:
    members = membership([("a", 1), ("b", 1), ("c", 1)], num_proc=3, min_np=2, max_np=None)
    start_all(members)
    publish(members)
    waiting = {("a", 0), ("c", 0)}
    nobody: set[int] = set()
    assert members.rejoin_failures(1.0, waiting, lambda roll: nobody) == []
    assert members.rejoin.roll_due  # the window opens: the roll is called
    members.rejoin.roll, members.rejoin.roll_due = 1, False
    assert members.rejoin_failures(10.5, waiting, lambda roll: nobody) == []
    asked: list[int] = []
    (hung,) = members.rejoin_failures(11.5, waiting, lambda roll: asked.append(roll) or nobody)
    assert hung == (members.hosts["b"], False) and asked == [1]
    assert members.rejoin.failure(False, 7) == (
        "its workers did not rejoin within 10 s after the others' collectives failed: worker 7 "
        "is stopped"
    )
    # everyone waits: a transient error, the next generation is due at once
    assert members.rejoin_failures(12.0, {("a", 0), ("b", 0), ("c", 0)}, lambda roll: nobody) == []
    assert members.need_publish


def test_a_member_busy_in_its_own_code_is_not_failed_for_not_rejoining_at_once() -> None:
    # b's worker answers the roll call (its watch thread runs) but is in a long step of its
    # own when the others' collectives fail: it fails only after the elastic timeout.
    members = membership(
        [("a", 1), ("b", 1), ("c", 1)], num_proc=3, min_np=2, max_np=None, elastic_timeout=60.0
    )
    start_all(members)
    publish(members)
    b_workers = set(members.hosts["b"].workers)
    waiting = {("a", 0), ("c", 0)}
    assert members.rejoin_failures(0.0, waiting, lambda roll: b_workers) == []
    for now in (10.0, 20.0, 50.0):
        assert members.rejoin_failures(now, waiting, lambda roll: b_workers) == []
        assert members.rejoin.roll_due  # called again at each check: it must keep answering
        members.rejoin.roll_due = False
    (busy,) = members.rejoin_failures(60.0, waiting, lambda roll: b_workers)
    assert busy == (members.hosts["b"], True)
    assert members.rejoin.failure(True).startswith(
        "its workers did not rejoin within 60 s (the elastic timeout) after the others' "
        "collectives failed, though they answer"
    )
    # One that stops answering fails at the next check.
    assert members.rejoin_failures(61.0, waiting, lambda roll: b_workers) == []
    assert members.rejoin_failures(71.0, waiting, lambda roll: set()) == [
        (members.hosts["b"], False)
    ]


def test_a_host_discovery_drops_is_removed_and_a_failed_one_comes_back_after_cooldown() -> None:
    members = membership(
        [("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None, cooldown=(1.0, 4.0)
    )
    start_all(members)
    publish(members)
    members.discovered = [HostSpec("a", 1)]
    (dropped,) = members.drop_undiscovered(0.0)
    assert dropped.name == "b" and dropped.state == "removed" and members.need_publish
    members.fail(members.hosts["a"], now=0.0)
    members.retire_finished()
    assert members.hosts_to_start(0.5) == []  # cooling down
    (back,) = members.hosts_to_start(1.0)
    assert back.name == "a"


def test_only_a_generation_that_trained_counts_as_a_reset() -> None:
    members = membership([("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None, reset_limit=0)
    start_all(members)
    publish(members, synced=False)  # nobody synced: generation 1 never trained
    members.fail(members.hosts["a"], now=1.0)
    members.retire_finished()
    publish(members, now=1.0)  # replaces an untrained generation: not a reset
    assert members.resets == 0
    members.discovered = [HostSpec("b", 1), HostSpec("c", 1)]
    start_all(members, now=2.0)
    stop = members.decide(2.0)  # generation 2 trained: replacing it is reset 1
    assert isinstance(stop, Stop) and "number of resets" in stop.message


def test_the_first_generation_waits_a_start_window_for_hosts_still_starting() -> None:
    members = membership([("a", 2), ("b", 2)], num_proc=2, min_np=1, max_np=None)
    a, b = members.hosts_to_start(0.0)
    members.ready(a)  # a alone has -np slots, but b is still starting
    assert members.decide(0.0) == Wait(None)
    assert members.decide(START_WINDOW - 0.1) == Wait(None)
    members.ready(b)  # b came up within the window: one generation of both
    decision = members.decide(START_WINDOW - 0.05)
    assert isinstance(decision, Publish) and [h.name for h in decision.members] == ["a", "b"]
    late = membership([("a", 2), ("b", 2)], num_proc=2, min_np=1, max_np=None)
    a, _ = late.hosts_to_start(0.0)
    late.ready(a)
    assert late.decide(0.0) == Wait(None)
    decision = late.decide(START_WINDOW + 0.1)  # the window closed: go without b
    assert isinstance(decision, Publish) and [h.name for h in decision.members] == ["a"]


def test_no_generation_starts_without_a_holder_of_the_training_state() -> None:
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=None, cooldown=(1.0, 1.0))
    start_all(members)
    publish(members)  # a holds the state
    members.discovered = [HostSpec("a", 1), HostSpec("b", 1)]
    start_all(members, now=1.0)
    grown = publish(members, now=1.0, synced=False)  # b joins, but never gets the state
    assert [h.name for h in grown.members] == ["a", "b"]
    members.fail(members.hosts["a"], now=2.0)  # the last holder dies
    stop = members.decide(2.0)
    assert isinstance(stop, Stop) and "the training state is lost" in stop.message
    assert "(b) never received it" in stop.message


def test_rank_0_goes_to_a_holder_of_the_training_state() -> None:
    members = membership([("a", 1), ("b", 1)], num_proc=2, min_np=1, max_np=None)
    start_all(members)
    first = publish(members, synced=False)
    sync(members, members.hosts["b"])  # only b's worker synced (a's failed mid-sync)
    members.need_publish = True
    second = publish(members, now=1.0)
    assert [s.hostname for s in first.slots] == ["a", "b"]
    assert [s.hostname for s in second.slots] == ["b", "a"]  # rank 0 syncs everyone


def added_then_original_removed(**options: object) -> Membership:
    """a trains alone (generation 1), b joins (generation 2, not synced yet), then
    discovery drops a."""
    members = membership([("a", 2)], num_proc=2, min_np=2, max_np=None, **options)
    start_all(members)
    publish(members).members[0].agent = object()  # a's agent runs while it leaves
    members.discovered = [HostSpec("a", 2), HostSpec("b", 2)]
    start_all(members, now=1.0)
    publish(members, now=1.0, synced=False)
    members.discovered = [HostSpec("b", 2)]
    (removed,) = members.drop_undiscovered(0.0)
    assert removed.name == "a" and members.need_publish
    members.retire_finished()
    return members


def test_a_removal_after_the_new_host_synced_goes_on_with_it() -> None:
    members = added_then_original_removed()
    a, b = members.retired[0], members.hosts["b"]
    sync(members, a, b)  # generation 2 trained on both
    decision = members.decide(2.0)
    assert isinstance(decision, Publish) and [s.hostname for s in decision.slots] == ["b", "b"]
    assert members.resets == 2


def test_a_removal_while_the_new_host_syncs_waits_for_that_sync() -> None:
    members = added_then_original_removed()
    a, b = members.retired[0], members.hosts["b"]
    waiting = members.decide(2.0)  # b's workers still receive the state from a's
    assert waiting == Wait(
        "the workers on b are still receiving the training state from a, which discovery "
        f"removed: the removal waits for them to hold it (up to {SYNC_WAIT:g} s)"
    )
    assert members.removed_to_stop(4, now=2.0) == []  # a's workers still hand it on
    assert members.decide(2.0 + SYNC_WAIT - 1) == Wait(None)
    sync(members, a, b)
    decision = members.decide(2.0 + SYNC_WAIT - 0.5)
    assert isinstance(decision, Publish) and [h.name for h in decision.members] == ["b"]
    members.published(members.generation + 1)
    # The generation without a is complete: a's workers leave by themselves, or are
    # stopped after the grace.
    assert members.removed_to_stop(2, now=3.0) == []
    assert members.still_leaving()
    assert members.removed_to_stop(2, now=3.0 + LEAVE_GRACE) == [a]
    assert not members.still_leaving()
    assert members.removed_to_stop(2, now=3.0 + LEAVE_GRACE + 1) == []  # once


def test_a_removed_host_is_stopped_as_soon_as_its_workers_left() -> None:
    members = added_then_original_removed()
    a, b = members.retired[0], members.hosts["b"]
    sync(members, a, b)
    assert isinstance(members.decide(2.0), Publish)
    members.published(members.generation + 1)
    assert members.removed_to_stop(1, now=3.0) == []  # b's generation is not complete yet
    assert members.removed_to_stop(2, now=3.0) == []
    a.workers = {0: 0, 1: 1}
    a.exits[0] = 0
    assert members.removed_to_stop(2, now=4.0) == []
    a.exits[1] = 0  # both left (exit 0 after 'leaving the elastic job')
    assert members.removed_to_stop(2, now=4.0) == [a]


def test_a_finished_job_waits_for_removed_workers_within_the_grace() -> None:
    members = added_then_original_removed()
    a = members.retired[0]
    a.workers = {0: 0, 1: 1}
    # The job finished before a generation without a was complete: its grace starts now.
    assert members.removed_to_stop(None, now=5.0) == []
    assert members.still_leaving()
    assert members.removed_to_stop(None, now=5.0 + LEAVE_GRACE - 0.1) == []
    assert members.removed_to_stop(None, now=5.0 + LEAVE_GRACE) == [a]
    assert not members.still_leaving()


def test_a_removal_whose_sync_never_completes_stops_the_job_after_the_wait() -> None:
    members = added_then_original_removed()
    assert isinstance(members.decide(2.0), Wait)
    stop = members.decide(2.0 + SYNC_WAIT + 0.1)
    assert isinstance(stop, Stop) and stop.message.splitlines() == [
        "No hosts from previous set remaining, unable to broadcast state.",
        "only the workers on a, which discovery removed, hold the training state, and the "
        f"hosts left (b) did not receive it within {SYNC_WAIT:g} s; stopping the job rather "
        "than training on from the initial state",
    ]


def test_a_host_replaced_in_one_go_stays_until_its_replacement_holds_the_state() -> None:
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=None)
    start_all(members)
    publish(members).members[0].agent = object()
    members.discovered = [HostSpec("b", 1)]  # a replaced at once: b is not even started
    assert members.drop_undiscovered(0.0) == []  # a holds the state: it stays for now
    (b,) = members.hosts_to_start(0.0)
    assert members.drop_undiscovered(1.0) == []  # b is starting
    members.ready(b)
    both = publish(members, now=2.0, synced=False)  # b joins a's generation ...
    assert [h.name for h in both.members] == ["a", "b"]
    (a,) = members.drop_undiscovered(3.0)  # ... and a leaves once b runs,
    waiting = members.decide(3.0)  # handing the state on first (as for a later removal)
    assert isinstance(waiting, Wait) and waiting.message is not None
    assert "the workers on b are still receiving the training state from a" in waiting.message
    sync(members, b)
    assert a.name == "a" and [h.name for h in publish(members, now=4.0).members] == ["b"]


def test_a_replacement_that_never_runs_cannot_hand_the_state_on() -> None:
    members = membership([("a", 1)], num_proc=1, min_np=1, max_np=None)
    start_all(members)
    publish(members).members[0].agent = object()
    members.discovered = [HostSpec("b", 1)]
    assert members.drop_undiscovered(0.0) == []
    members.hosts_to_start(0.0)  # b starts and never gets ready
    assert members.drop_undiscovered(SYNC_WAIT - 1) == []
    assert [h.name for h in members.drop_undiscovered(SYNC_WAIT + 1)] == ["a"]  # waited enough
    members.retire_finished()
    stop = members.decide(SYNC_WAIT + 1)
    assert isinstance(stop, Stop) and "(b) had no worker running yet to receive it" in stop.message
    assert "every worker" not in stop.message and "is lost" not in stop.message


def test_the_state_is_lost_only_when_every_holder_is_gone() -> None:
    members = added_then_original_removed()
    a = members.retired[0]
    assert isinstance(members.decide(2.0), Wait)
    a.exits = dict.fromkeys(a.workers, -9)  # the leaving holders die before b synced
    stop = members.decide(2.5)
    assert isinstance(stop, Stop) and stop.message == (
        "the training state is lost: every worker that held it is gone, and the workers left "
        "(b) never received it; stopping the job rather than training on from the initial state"
    )


def test_a_job_over_its_reset_limit_ends_with_horovods_sentence_first() -> None:
    members = added_then_original_removed(reset_limit=1)  # generation 2 was reset 1
    sync(members, members.retired[0])  # generation 2 trained on a alone; b still syncs
    stop = members.decide(2.0)  # needs reset 2, and b holds nothing: the limit comes first
    assert isinstance(stop, Stop) and stop.message.splitlines()[0] == (
        "Horovod was shutdown because number of resets during elastic job exceeded limit: 1"
    )
    members = added_then_original_removed(reset_limit=1)
    assert isinstance(members.decide(2.0), Wait)  # generation 2 has not trained yet
    sync(members, members.retired[0], members.hosts["b"])
    stop = members.decide(3.0)
    assert isinstance(stop, Stop) and "need reset 2, more than --reset-limit 1" in stop.message


class Agent:
    """What a host record asks of its agent."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def terminate(self) -> None:
        self.calls.append("terminate")

    def close(self) -> None:
        self.calls.append("close")


def test_stopping_an_agent_that_was_never_launched_closes_it_and_counts_it_finished() -> None:
    # A ready host (hello heard, no job sent): its agent has no workers, and would report to
    # no one, so the driver must not wait for its report (a Ctrl-C while the job waits for
    # --min-np took 15 s).
    ready = HostRecord("a", 2, 0, state="ready", agent=Agent())
    ready.stop_agent()
    assert (ready.agent.calls, ready.agent_alive) == (["close"], False)
    ready.stop_agent()
    assert ready.agent.calls == ["close"]
    running = HostRecord("b", 2, 1, state="running", agent=Agent(), workers={0: 0, 1: 1})
    running.stop_agent()
    assert (running.agent.calls, running.agent_alive) == (["terminate"], True)
