"""The names of unnamed ops (``allgather.noname.N``): ranks must draw the same counters for
the same ops, whatever was refused or run while a rank had joined; where they still diverge,
the stall inspector stops the job with an error that says so; the object collectives'
names never come from the counters. One launch of 2 ranks (workers/names_worker.py) and unit
tests of the parts."""

from __future__ import annotations

import logging
from types import ModuleType

import pytest
import torch

from collectives import runtime
from collectives.engine.config import EngineConfig
from collectives.engine.names import UnnamedCounters, unnamed_counter
from collectives.engine.negotiation import Table
from collectives.engine.requests import FIELD, RECORD, Kind, noname
from collectives.engine.stall import StallInspector, diverged
from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun


def test_counters_stay_in_step_after_refused_ops_and_divergence_fails_on_every_rank() -> None:
    # A short stall check time, so that the divergence at the end fails within seconds
    # (the bound on the run is the subprocess timeout, not an assertion on time).
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2"}
    code, output = run_hvdrun(
        2, WORKERS / "names_worker.py", "refused", "diverged", env=env, timeout=120
    )
    every_rank = [
        "join.same_on_every_rank",
        "after.allreduce",
        "after.allgather",
        "after.broadcast",
        "after.broadcast_object",
        "after.allgather_object",
        "diverged.raises",
        "diverged.message",
    ]
    assert_all_ok(code, output, 2, every_rank)
    for name in ("joined.allreduce", "joined.allgather_refused", "local.refused"):
        assert f"[1]<stdout>:OK {name}\n" in output, output


# ---- the counters ----------------------------------------------------------------------


def test_unnamed_counters_are_parsed_from_names_and_caught_up() -> None:
    assert unnamed_counter(Kind.ALLGATHER, noname(Kind.ALLGATHER, 7)) == (Kind.ALLGATHER, 7)
    assert unnamed_counter(Kind.BARRIER, "barrier.noname.0") == (Kind.BARRIER, 0)
    # An unnamed Adasum allreduce travels as an allgather but drew the allreduce counter.
    adasum = "allgather.adasum." + noname(Kind.ALLREDUCE, 3)
    assert unnamed_counter(Kind.ALLGATHER, adasum) == (Kind.ALLREDUCE, 3)
    for named in ("allgather.x", "allgather.noname.x", "allgather.noname.", "join.join"):
        assert unnamed_counter(Kind.ALLGATHER, named) is None, named
    counters = UnnamedCounters()
    assert [counters.draw(Kind.ALLGATHER, 0) for _ in range(2)] == [0, 1]
    # A joined rank counts the ops it did not submit: its next draw follows them.
    counters.catch_up(Kind.ALLREDUCE, 0, 0)
    assert counters.draw(Kind.ALLREDUCE, 0) == 1
    counters.catch_up(Kind.ALLREDUCE, 0, 4)
    assert counters.draw(Kind.ALLREDUCE, 0) == 5
    # Per kind and process set.
    assert counters.draw(Kind.ALLGATHER, 0) == 2 and counters.draw(Kind.ALLGATHER, 1) == 0
    # A removed set's counters go (a loop of add/remove_process_set kept one per set).
    counters.forget(1)
    assert (1, Kind.ALLGATHER) not in counters._counts
    assert counters.draw(Kind.ALLGATHER, 0) == 3


# ---- the stall inspector's divergence ----------------------------------------------------


def _announce(table: Table, rank: int, *names: str, kind: Kind = Kind.ALLGATHER,
              set_id: int = 0, now: float = 0.0) -> None:  # fmt: skip
    records = [FIELD.join([str(int(kind)), str(set_id), name, "sig", "1"]) for name in names]
    table.add(rank, RECORD.join(records).encode(), cycle=1, now=now)


def _everyone(entry: object) -> list[int]:
    return [0, 1]


def test_unnamed_ops_a_rank_counted_past_are_divergence() -> None:
    table = Table(size=2)
    _announce(table, 0, "allgather.noname.6")
    _announce(table, 1, "allgather.noname.7")
    found = diverged(table, _everyone)
    assert [(d.entry.name, d.rank, d.later.name) for d in found] == [
        ("allgather.noname.6", 1, "allgather.noname.7")
    ]
    # Either way round.
    table = Table(size=2)
    _announce(table, 0, "allgather.noname.9")
    _announce(table, 1, "allgather.noname.3")
    found = diverged(table, _everyone)
    assert [(d.entry.name, d.rank, d.later.name) for d in found] == [
        ("allgather.noname.3", 0, "allgather.noname.9")
    ]


@pytest.mark.parametrize(
    "rank0, rank1",
    [
        (["allgather.noname.6"], []),  # rank 1 is slow, or stopped: a plain stall
        # Rank 0 runs two at once; rank 1's second may still come.
        (["allgather.noname.6", "allgather.noname.7"], ["allgather.noname.6"]),
        (["allgather.noname.6"], ["allgather.x"]),  # a named op: ranks submit different ops
        (["allgather.noname.6"], ["allreduce.noname.7"]),  # another kind counts on its own
    ],
)
def test_stalls_that_may_still_resolve_are_not_divergence(
    rank0: list[str], rank1: list[str]
) -> None:
    table = Table(size=2)
    _announce(table, 0, *rank0)
    for name in rank1:
        _announce(table, 1, name, kind=Kind.ALLREDUCE if name.startswith("allreduce") else
                  Kind.ALLGATHER)  # fmt: skip
    assert diverged(table, _everyone) == []


def test_other_sets_and_joined_ranks_are_not_divergence() -> None:
    table = Table(size=2)
    _announce(table, 0, "allgather.noname.6")
    _announce(table, 1, "allgather.noname.7", set_id=1)
    assert diverged(table, _everyone) == []
    joined = Table(size=2)
    joined.add(1, FIELD.join(["6", "0", "join.join", "", ""]).encode(), cycle=1, now=0.0)
    _announce(joined, 0, "allgather.noname.6")
    _announce(joined, 1, "allgather.noname.7")  # (rank 1 joined: noname.6 does not wait)
    assert diverged(joined, _everyone) == []


def test_divergence_stops_the_job_at_the_stall_check_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = EngineConfig(stall_warning_seconds=5.0, stall_shutdown_seconds=0.0)
    inspector = StallInspector(config, rank=0, inspects=True)
    table = Table(size=2)
    _announce(table, 0, "allgather.noname.6", now=100.0)
    _announce(table, 1, "allgather.noname.7", now=100.0)
    assert not inspector.check(table, _everyone, now=104.0)  # not yet the check time
    with caplog.at_level(logging.WARNING, logger="collectives.engine"):
        assert inspector.check(table, _everyone, now=105.5)
    assert "unnamed op counters diverged" in caplog.text, caplog.text
    report = inspector.report(table, _everyone, 105.5, aborting=True)
    assert "allgather 'noname.6' (process set 0, waiting 6 s, submitted by ranks [0]) waits " \
        "for rank 1, which has already submitted allgather 'noname.7'" in report  # fmt: skip
    assert "name=" in report
    # A plain stall only warns at the check time (no shutdown time set).
    plain = Table(size=2)
    _announce(plain, 0, "allgather.noname.6", now=100.0)
    assert not StallInspector(config, rank=0, inspects=True).check(plain, _everyone, 200.0)
    # --no-stall-check turns it off.
    off = StallInspector(EngineConfig(stall_check=False), rank=0, inspects=True)
    assert not off.check(table, _everyone, now=1000.0)


# ---- in one process: what draws a counter -------------------------------------------------


def _next(kind: Kind) -> int:
    return int(runtime.engine("test").next_counter(kind, 0))


def test_refused_submissions_and_object_collectives_draw_no_counter(hvd: ModuleType) -> None:
    start = _next(Kind.ALLREDUCE)
    with pytest.raises(ValueError, match="same device"):
        hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")])
    with pytest.raises(ValueError, match="same device"):  # (Adasum draws the allreduce's)
        hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")], op=hvd.Adasum)
    assert _next(Kind.ALLREDUCE) == start + 1
    gathered_before = _next(Kind.ALLGATHER)
    broadcast_before = _next(Kind.BROADCAST)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object(None) == [None]
    assert hvd.broadcast_object([2], name="mine") == [2]
    assert _next(Kind.ALLGATHER) == gathered_before + 1
    assert _next(Kind.BROADCAST) == broadcast_before + 1
