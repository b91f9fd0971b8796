"""Job insight: the engine's arrival accounting, and real jobs in which one rank is slow.

The accounting's comparison runs against simulated peers (the flush's two collectives over
members whose round durations the test sets), and every kind of round raises the flush on an
engine of one rank. The jobs are real: hvdrun with a rank slowed by a sleep and by a
CPU-bound loop, a balanced one, and a torchrun job that calls ``hvd.report()``.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from collectives.common import ReduceOp
from collectives.engine.core import Engine
from collectives.engine.insight import (
    CAPACITY,
    HELD_SECONDS,
    IDLE,
    INTERVAL,
    NO_OP,
    Arrivals,
    Summary,
    op_label,
    summarize,
)
from collectives.engine.reduction import Reduction
from collectives.runtime import insight as insight_runtime
from collectives.runtime.insight import Publisher
from collectives.runtime.state import RuntimeState, Topology
from rendezvous.insight import LiveWatch, RankFigures, analyse
from rendezvous.worker_env import INSIGHT_KEY_PREFIX
from tests.collectives.conftest import REPO, WORKERS, clean_env, run_hvdrun
from tests.collectives.test_engine_units import _request, one_rank_engine

WORKER = WORKERS / "insight_worker.py"

# ---- the comparison, against simulated peers ------------------------------------------


class Peers:
    """A set's Gloo group as a flush sees it: this member, and others whose round durations
    are given (``idle``: rounds in which a member had no op of its own)."""

    def __init__(self, others: dict[int, list[float]], idle: dict[int, set[int]] | None = None):
        self.others = others
        self.idle = idle or {}
        self.low = torch.zeros(0, dtype=torch.float64)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Peers:
        vector = tensors[0]
        n = int(vector[0].item()) if opts.reduceOp == dist.ReduceOp.MIN else len(self.low)
        if opts.reduceOp == dist.ReduceOp.MIN:
            for durations in self.others.values():
                theirs = torch.tensor(durations[:n], dtype=torch.float64)
                vector[1 : n + 1] = torch.minimum(vector[1 : n + 1], theirs)
            self.low = vector[1 : n + 1].clone()
            return self
        for index, durations in self.others.items():
            theirs = torch.tensor(durations[:n], dtype=torch.float64)
            excess = theirs - self.low
            for k in self.idle.get(index, ()):
                excess[k] = 0.0
            last = (theirs <= self.low).double()
            vector[:n] += excess
            vector[CAPACITY : CAPACITY + n] += last
            vector[2 * CAPACITY : 2 * CAPACITY + n] += last * index
            for k in self.idle.get(index, ()):  # (the last member had no op of its own)
                if len(vector) > 3 * CAPACITY:
                    vector[3 * CAPACITY + k] += last[k]
        return self

    def wait(self) -> None:
        return None


def _rounds(arrivals: Arrivals, durations: list[float], labels: list[str | None]) -> None:
    at = 100.0
    for duration, label in zip(durations, labels, strict=True):
        arrivals.note(at, at + duration, label)
        at += 0.01


def test_the_last_member_is_the_one_that_waited_least_and_caused_the_others_wait() -> None:
    # Member 0 (this one) and member 2 come early; member 1 is late in the first three
    # rounds, member 2 in the fourth; the fifth is balanced (below HELD_SECONDS).
    mine = [0.050, 0.030, 0.020, 0.012, 0.0003]
    others = {1: [0.0001, 0.0001, 0.0001, 0.011, 0.0002], 2: [0.040, 0.025, 0.019, 0.0001, 0.0001]}
    arrivals = Arrivals(index=0, size=3)
    labels = ["allreduce.grad", "allreduce.grad", "allreduce.noname.7", "allreduce.loss", None]
    _rounds(arrivals, mine, labels)
    arrivals.flush(Peers(others))
    snap = arrivals.snapshot
    assert (snap.flushes, snap.rounds, snap.held) == (1, 5, 4)
    assert snap.waited == pytest.approx(0.0499 + 0.0299 + 0.0199 + 0.0119 + 0.0002)
    assert snap.last == (0, 3, 1)  # (held rounds only: not the fifth)
    assert snap.caused[1] == pytest.approx(0.0898 + 0.0548 + 0.0388)
    assert snap.caused[2] == pytest.approx(0.0228 + 0.0003)
    assert snap.caused[0] == 0.0
    # The ops this member waited at (in held rounds), unnamed ones by kind, and for whom.
    assert set(snap.ops) == {"allreduce.grad", "allreduce.noname", "allreduce.loss"}
    waited, whom = snap.ops["allreduce.grad"]
    assert waited == pytest.approx(0.0499 + 0.0299) and whom == {1: pytest.approx(waited)}
    assert snap.ops["allreduce.loss"] == (pytest.approx(0.0119), {2: pytest.approx(0.0119)})
    assert arrivals.n == 0 and not arrivals.want


def test_a_member_with_no_op_of_its_own_waited_for_nothing() -> None:
    # Member 1 runs keepalive rounds while this member's op waits for it: this member
    # waited. In the second round this member is idle (it is shutting down, say): no wait.
    arrivals = Arrivals(index=0, size=2)
    _rounds(arrivals, [0.2, 0.3], ["allreduce.x", IDLE])
    arrivals.flush(Peers({1: [0.001, 0.001]}, idle={1: {0, 1}}))
    snap = arrivals.snapshot
    assert snap.waited == pytest.approx(0.199)
    assert snap.caused == (0.0, pytest.approx(0.199)) and snap.last == (0, 1)
    assert snap.held == 1


def test_a_member_flushes_after_a_flagged_round_or_a_full_buffer() -> None:
    arrivals = Arrivals(index=0, size=2)
    arrivals.note(0.0, 0.001, "a")
    arrivals.note(0.5, 0.501, "a")
    assert not arrivals.want
    arrivals.after(Peers({1: [0.001, 0.001]}), flagged=False)
    assert arrivals.n == 2 and arrivals.snapshot.flushes == 0
    arrivals.note(INTERVAL + 0.01, INTERVAL + 0.011, "a")
    assert arrivals.want  # (the next round that can carry the flag raises it)
    arrivals.after(Peers({1: [0.001] * 3}), flagged=True)
    assert arrivals.n == 0 and not arrivals.want and arrivals.snapshot.flushes == 1
    for k in range(CAPACITY):  # rounds that carry no flag: the full buffer flushes
        arrivals.note(k * 1e-6, k * 1e-6, "a")
        arrivals.after(Peers({1: [0.0] * CAPACITY}), flagged=False)
    assert arrivals.n == 0 and arrivals.snapshot.rounds == 3 + CAPACITY


def test_a_rank_sums_up_its_sets_by_global_rank() -> None:
    world = Arrivals(index=1, size=2)
    _rounds(world, [0.001, 0.004], ["allreduce.a", "allreduce.a"])
    world.flush(Peers({0: [0.003, 0.0005]}))
    subset = Arrivals(index=0, size=2)  # a process set of global ranks [1, 3]
    _rounds(subset, [0.010], ["allreduce.b"])
    subset.flush(Peers({1: [0.0001]}))
    summary = summarize([([0, 1], 1, world.snapshot), ([1, 3], 0, subset.snapshot)])
    assert summary.rounds == 3 and summary.held == 3
    assert summary.waited == pytest.approx(0.0035 + 0.0099)
    assert summary.caused == pytest.approx(0.002) and summary.last == 1
    assert summary.ops["allreduce.b"] == (pytest.approx(0.0099), {3: pytest.approx(0.0099)})
    assert summary.caused_by == {0: pytest.approx(0.0035), 1: pytest.approx(0.002)}
    assert HELD_SECONDS <= 0.002


def _two_ranks(snap: Any, elapsed: float) -> list[RankFigures]:
    """Both ranks' figures of a two-member set whose snapshot (alike on every member but
    for ``waited``, here member 0's) is ``snap``."""
    return [
        RankFigures(rank=rank, host="h", size=2, elapsed_s=elapsed, in_collectives_s=snap.busy,
                    waited_s=snap.waited if rank == 0 else 0.0,
                    wait_caused_s=snap.caused[rank], largest_wait_caused_s=snap.peak[rank],
                    times_last=snap.last[rank], held_rounds=snap.held)
        for rank in (0, 1)
    ]  # fmt: skip


def test_one_late_arrival_split_into_rounds_counts_once() -> None:
    # Member 1 sleeps after hvd.init(): its engine runs keepalive rounds (no op of its own)
    # about once a second, in each of which member 0 waited for it, over two flushes; in
    # one round in between nobody waited (member 0 came last by a hair). Then it brings the
    # op, and the job runs balanced.
    arrivals = Arrivals(index=0, size=2)
    _rounds(arrivals, [1.0, 0.001, 1.0], ["allreduce.grad"] * 3)
    arrivals.flush(Peers({1: [0.001, 0.0015, 0.002]}, idle={1: {0, 1, 2}}))
    _rounds(arrivals, [1.0, 0.5], ["allreduce.grad"] * 2)
    arrivals.flush(Peers({1: [0.001, 0.0001]}, idle={1: {0}}))
    balanced = [0.0004, 0.0001] * 20
    _rounds(arrivals, balanced, ["allreduce.grad"] * 40)
    arrivals.flush(Peers({1: balanced[1:] + balanced[:1]}))
    snap = arrivals.snapshot
    late = 0.999 + 0.998 + 0.999 + 0.4999
    assert snap.caused[1] == pytest.approx(late + 20 * 0.0003)
    assert snap.peak[1] == pytest.approx(late)  # one wait, though five rounds
    assert snap.last == (0, 1) and snap.held == 1
    report = analyse(_two_ranks(snap, elapsed=5.0))
    assert report.straggler is None, report.summary


def test_a_rank_late_at_every_step_is_late_every_time() -> None:
    # Member 1 is late at every step: a keepalive round of its own while member 0 waits,
    # then the round in which it brings the op. Each step is a late arrival of its own.
    arrivals = Arrivals(index=0, size=2)
    _rounds(arrivals, [0.05, 0.01] * 8, ["allreduce.grad"] * 16)
    arrivals.flush(Peers({1: [0.0001, 0.0001] * 8}, idle={1: set(range(0, 16, 2))}))
    snap = arrivals.snapshot
    assert snap.last == (0, 8) and snap.held == 8
    assert snap.peak[1] == pytest.approx(0.0499 + 0.0099)
    report = analyse(_two_ranks(snap, elapsed=1.0))
    assert report.straggler is not None and report.straggler.rank == 1, report.summary


def test_a_stuck_round_counts_a_wait_only_when_its_last_member_had_no_op() -> None:
    # Rounds 0 and 1 made no op ready: in round 0 member 1 came last with an op of its own
    # (the members waited on ops the others had not submitted: a deadlock, say), in round 1
    # it came last with none (it is late). Round 2 made its op ready.
    arrivals = Arrivals(index=0, size=2)
    for k, (duration, progress) in enumerate([(0.5, False), (0.3, False), (0.2, True)]):
        arrivals.note(100.0 + k, 100.0 + k + duration, "allreduce.a")
        arrivals.after(None, flagged=False, progress=progress)
    arrivals.flush(Peers({1: [0.001] * 3}, idle={1: {1}}))
    snap = arrivals.snapshot
    assert snap.waited == pytest.approx(0.299 + 0.199)
    assert snap.caused == (0.0, pytest.approx(0.299 + 0.199))
    assert snap.last == (0, 1) and snap.held == 1  # (rounds 1 and 2: one late arrival)
    # (the mark is the flushed rounds' only)
    _rounds(arrivals, [0.5], ["allreduce.a"])
    arrivals.flush(Peers({1: [0.001]}))
    assert arrivals.snapshot.waited == pytest.approx(0.299 + 0.199 + 0.499)


def test_time_in_collectives_covers_the_waits_of_the_last_round() -> None:
    # The round in which a member leaves flushes inside its cycle, before the cycle's time
    # is added to busy: the wait in it must still be time in collectives.
    arrivals = Arrivals(index=0, size=2)
    arrivals.busy = 2.0  # (the cycles before)
    _rounds(arrivals, [1.0, 1.0, 3.0], ["allreduce.never"] * 3)
    arrivals.flush(Peers({1: [0.001] * 3}, idle={1: {0, 1, 2}}))
    snap = arrivals.snapshot
    assert snap.waited == pytest.approx(4.997)
    assert snap.busy >= snap.waited


def test_a_set_that_stops_without_a_last_flush_keeps_its_own_clocks_figures() -> None:
    # A peer died: no round compares the rounds since the last flush. Time in collectives
    # and since the start are this member's own clock's, and count up to the stop.
    arrivals = Arrivals(index=0, size=2)
    _rounds(arrivals, [0.01] * 5, ["allreduce.a"] * 5)
    arrivals.busy = 0.05
    before = arrivals.snapshot
    assert before.busy == 0.0 and before.elapsed == 0.0  # (no flush yet)
    arrivals.close()
    snap = arrivals.snapshot
    assert snap.busy == pytest.approx(0.05) and 0.0 < snap.elapsed < 60.0
    assert (snap.rounds, snap.waited, snap.flushes) == (0, 0.0, 0)  # (nothing compared)


def _live(rank: int, caused: float, last: int, held: int, **more: Any) -> RankFigures:
    return RankFigures(rank=rank, host=f"h{rank}", wait_caused_s=caused, times_last=last,
                       held_rounds=held, **more)  # fmt: skip


def test_the_live_watch_leaves_out_one_late_start() -> None:
    # Rank 1 starts 4 s late (one late arrival, the others wait for it in keepalive rounds);
    # then the job is balanced, with rank 1 last a little more often than rank 0 by chance.
    watch = LiveWatch()
    news = []
    for now in range(12):
        late = min(float(now), 4.0)
        steps = max(0, now - 4) * 10
        figures = {
            "0": _live(0, 0.0005 * steps, steps // 2 - 1 if steps else 0, 1 + steps,
                       largest_wait_caused_s=0.001 if steps else 0.0),
            "1": _live(1, late + 0.0005 * steps, 1 + steps // 2 + (1 if steps else 0),
                       1 + steps, largest_wait_caused_s=late),
        }  # fmt: skip
        news.append(watch.update(float(now), figures))
    assert all(n.warning is None and n.status is None for n in news), news
    # A rank late at every step still shows, its longest late arrival left out.
    watch = LiveWatch()
    for now in range(6):
        figures = {
            "0": _live(0, 0.0, 0, 20 * now),
            "1": _live(1, 0.9 * now, 20 * now, 20 * now, largest_wait_caused_s=0.06),
        }
        news.append(watch.update(float(now), figures))
    assert news[-1].status is not None and "rank 1 on h1" in news[-1].status


def test_the_live_watch_claims_no_more_waiting_than_its_window() -> None:
    # The figures of a comparison come late and at once: in 2 s of the watcher's own, rank 1
    # published 3 s of the others' waiting (rounds that began before its previous figures).
    watch = LiveWatch()
    watch.update(0.0, {"0": _live(0, 0.0, 0, 0, elapsed_s=10.0),
                       "1": _live(1, 0.0, 0, 0, elapsed_s=10.0)})  # fmt: skip
    news = watch.update(2.0, {"0": _live(0, 0.0, 0, 30, elapsed_s=11.9),
                              "1": _live(1, 2.98, 30, 30, elapsed_s=11.9,
                                         largest_wait_caused_s=0.1)})  # fmt: skip
    assert news.warning is not None and news.status is not None
    for text in (news.warning, news.status):
        found = re.search(r"in the last (\d+) s", text)
        waited = re.search(r"waited ([\d.]+) (m?s)", text)
        assert found and waited, text
        claimed = float(waited[1]) / (1000.0 if waited[2] == "ms" else 1.0)
        assert claimed <= float(found[1]), text


def test_the_live_watch_judges_the_newest_generation_only() -> None:
    # An elastic job: worker 1 (rank 1 of generation 1) holds the others back, then dies;
    # in generation 2 worker 2 is rank 1 and the job is balanced. Worker 1's last figures
    # stay in the store, and worker 2's carry its earlier generation's.
    watch = LiveWatch()
    news = []
    for now in range(3):
        figures = {
            "w0": _live(0, 0.0, 0, 20 * now, generation=1),
            "w1": _live(1, 0.8 * now, 20 * now, 20 * now, generation=1),
            "w2": _live(2, 0.0, 0, 20 * now, generation=1),
        }
        news.append(watch.update(float(now), figures))
    dead = figures["w1"]
    for now in range(3, 9):
        steps = 10 * (now - 3)
        figures = {
            "w0": _live(0, 0.001 * steps, steps // 2, 40 + steps, generation=2),
            "w1": dead,
            "w2": _live(1, 0.001 * steps, steps // 2, 40 + steps, generation=2),
        }
        news.append(watch.update(float(now), figures))
    assert all(n.warning is None for n in news[3:]), news
    assert all(n.status is None for n in news[3:]), news
    # While an elastic worker resets, its figures dip (its stopped engine's are not carried
    # over yet) and come back: the dip is no starting point.
    watch = LiveWatch()
    for now in range(26):
        dip = now == 11
        figures = {
            "w0": _live(0, 0.0, 0, 10 if dip else 60),
            "w1": _live(1, 0.5 if dip else 3.0, 10 if dip else 60, 10 if dip else 60),
        }
        news = [watch.update(float(now), figures)]
        assert news[0].status is None, (now, news)


def test_op_labels_put_an_unnamed_ops_calls_together() -> None:
    assert op_label("allreduce.noname.12") == "allreduce.noname"
    assert op_label("allreduce.grad.3") == "allreduce.grad.3"
    assert op_label(None) == "allreduce.noname"
    # (TensorFlow graph ops named after their kind and input: the kind once)
    assert op_label("allreduce.allreduce.gradient_tape/d/MatMul_0") == (
        "allreduce.gradient_tape/d/MatMul_0"
    )
    assert op_label(IDLE) == NO_OP


# ---- publishing a worker's figures ------------------------------------------------------


class FakeEngine:
    """An engine as the publisher sees it: its figures, and its timeline (if one is open)."""

    def __init__(self, rounds: int, waited: float, ops: dict[str, Any]) -> None:
        self.summary = Summary(1, rounds, rounds // 2, waited, 2 * waited, 10.0 * waited,
                               0.1, 0.1, 1, ops, {}, {})  # fmt: skip
        self.timeline: object = None

    def arrivals(self) -> Summary:
        return self.summary


def test_a_worker_publishes_its_figures_and_carries_them_from_engine_to_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = dist.HashStore()
    topology = Topology(rank=1, size=3, local_rank=1, local_size=3, cross_rank=0, cross_size=1)
    runtime_ = RuntimeState(topology=topology, backend="gloo", timeout=timedelta(seconds=5),
                            store=store, host="h1")  # fmt: skip
    publisher = Publisher(runtime_)
    first = FakeEngine(10, 0.5, {"allreduce.g": (0.5, {0: 0.5})})
    runtime_.engine = first  # type: ignore[assignment]
    published = publisher.publish(only_new=True)
    assert RankFigures.from_json(store.get(INSIGHT_KEY_PREFIX + "1")) == published
    assert published.rank == 1 and published.host == "h1" and published.waited_s == 0.5
    assert not published.timeline
    store.set(INSIGHT_KEY_PREFIX + "1", "")
    publisher.publish(only_new=True)  # (nothing new: not written again)
    assert store.get(INSIGHT_KEY_PREFIX + "1") == b""
    # An elastic reset: the next engine's figures add to the first one's, counted once.
    publisher.engine_stopped(first)  # type: ignore[arg-type]
    publisher.engine_stopped(first)  # type: ignore[arg-type]
    runtime_.engine = FakeEngine(4, 0.25, {"allreduce.g": (0.25, {2: 0.25})})  # type: ignore[assignment]
    runtime_.engine.timeline = object()  # type: ignore[assignment]  # (hvd.start_timeline())
    assert publisher.publish().timeline
    runtime_.engine.timeline = None
    figures = publisher.publish()
    assert figures.timeline  # (it wrote one: its lateness then may be the timeline's)
    assert (figures.rounds, figures.waited_s, figures.times_last) == (14, 0.75, 2)
    assert figures.ops == {"allreduce.g": {"waited_s": 0.75, "for": {"0": 0.5, "2": 0.25}}}
    # The job's report: rank 0 published, rank 2 never did (its row is missing).
    rank0 = RankFigures(rank=0, host="h0", flushes=5, waited_s=0.1, wait_caused_s=0.5)
    store.set(INSIGHT_KEY_PREFIX + "0", rank0.to_json().decode())
    monkeypatch.setattr(insight_runtime, "COLLECT_SECONDS", 0.1)
    report = publisher.collect(figures, final=False)
    assert [f.rank for f in report.ranks] == [0, 1] and report.missing == [2]


# ---- every kind of round carries the flag (an engine of one rank) -----------------------


@pytest.fixture
def engine() -> Iterator[Engine]:
    with one_rank_engine(dist.HashStore()) as (started, _):
        yield started


def _blocking(engine: Engine, name: str, value: float) -> torch.Tensor:
    request = _request(name, torch.full((3,), value))
    request.outputs = [None]
    request.handle = engine.new_handle()
    if not engine.run_now(request):
        engine.submit(request, True)
    result: torch.Tensor = request.handle.wait()
    return result


def _flushes_after(engine: Engine, run: Any) -> int:
    before = engine.arrivals().flushes
    assert engine.flush_arrivals()
    run()
    return engine.arrivals().flushes - before


def test_every_kind_of_round_flushes_when_a_member_asks(engine: Engine) -> None:
    # A new op: the full negotiation.
    assert _flushes_after(engine, lambda: _blocking(engine, "first", 1.0)) == 1
    # The op again and again: cache rounds, then predicted rounds on the caller's thread.
    for k in range(6):
        assert torch.equal(_blocking(engine, "loop", float(k)), torch.full((3,), float(k)))
    assert engine.stats["predicted_rounds"] >= 2
    assert _flushes_after(engine, lambda: _blocking(engine, "loop", 9.0)) == 1
    # The hot lane: allreduce_ of the op that just ran in a lane.
    tensor = torch.full((3,), 4.0)

    def hot() -> None:
        done = engine.run_hot("allreduce.loop", tensor, Reduction(int(ReduceOp.SUM)), _refuse)
        assert done is not None and done.done()

    assert _flushes_after(engine, hot) == 1
    assert engine.stats["hot_rounds"] == 1 and torch.equal(tensor, torch.full((3,), 4.0))
    summary = engine.arrivals()
    assert summary.rounds >= 9 and summary.busy > 0 and summary.elapsed > 0
    assert summary.waited == 0.0 and summary.caused == 0.0  # (alone: nobody to wait for)


def _refuse(counter: int) -> Any:
    raise AssertionError("the hot lane built a request for an op it predicted")


# ---- real jobs ----------------------------------------------------------------------------


def _report(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def _timeline_rows(merged: list[dict[str, Any]], rank: int) -> list[tuple[float, str, str]]:
    """(time, op, round) of each NEGOTIATE end of one rank in the merged trace, in order."""
    names = {
        e["tid"]: e["args"]["name"]
        for e in merged
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == rank
    }
    return sorted(
        (e["ts"], names[e["tid"]], e["args"]["round"])
        for e in merged
        if e.get("pid") == rank and e.get("ph") == "E" and e["name"].startswith("NEGOTIATE_")
    )


def test_a_rank_slowed_by_a_sleep_is_named_live_at_the_end_and_in_the_timelines(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    timeline = tmp_path / "trace.json"
    options = ["--report-file", str(report), "--timeline-filename", str(timeline),
               "--timeline-all-ranks"]  # fmt: skip
    code, output = run_hvdrun(2, WORKER, "--slow", "1", "--steps", "120", options=options)
    assert code == 0, output
    # Live: one warning, before the end of the job.
    warnings = re.findall(r"hvdrun: rank 1 on \S+ is holding the job back: .*", output)
    assert len(warnings) == 1, output
    assert output.index(warnings[0]) < output.index("DONE rank 0"), output
    # The table, and the straggler in one sentence.
    assert re.search(r"hvdrun:   RANK +HOST +IN COLLECTIVES +BETWEEN", output), output
    assert re.search(r"hvdrun: rank 1 on \S+ held the job back: it arrived last at", output)
    document = _report(report)
    assert document["straggler"]["rank"] == 1, document
    ranks = {f["rank"]: f for f in document["ranks"]}
    assert set(ranks) == {0, 1} and all(f["final"] for f in ranks.values())
    assert ranks[0]["waited_s"] > 1.0 and ranks[1]["wait_caused_s"] > 1.0, ranks
    # (rank 1 was last far more often than rank 0; a loaded machine delays rank 0 at times)
    assert ranks[1]["times_last"] > 2 * ranks[0]["times_last"], document
    assert document["ops"][0]["mostly_for"] == 1
    # Every rank's timeline, merged: one process per rank, each rank's ops in order.
    assert "merged the timelines of 2 rank(s)" in output, output
    merged = json.loads(timeline.read_text())
    rows = {rank: _timeline_rows(merged, rank) for rank in (0, 1)}
    for rank in (0, 1):
        ops = [op for _, op, _ in rows[rank]]
        assert ops[:240:2] == ["allreduce.grad"] * 120 and ops[1:240:2] == ["allreduce.loss"] * 120
        rounds = [int(r.split(":")[1]) for _, _, r in rows[rank]]
        assert rounds == sorted(rounds)
    assert [r for _, _, r in rows[0]] == [r for _, _, r in rows[1]]
    # Aligned: the ranks left each round at about the same time.
    gaps = sorted(abs(a[0] - b[0]) for a, b in zip(rows[0], rows[1], strict=True))
    assert gaps[len(gaps) // 2] < 5000, gaps[-10:]  # microseconds
    # Who submitted each gradient last: the slow rank (the loss follows the gradient at once).
    names = {e["tid"]: e["args"]["name"] for e in merged if e["name"] == "thread_name"}
    lasts = [e["args"]["last_rank"] for e in merged
             if e.get("ph") == "E" and e["pid"] == 0 and "last_rank" in e.get("args", {})
             and names[e["tid"]] == "allreduce.grad"]  # fmt: skip
    assert len(lasts) >= 100 and lasts.count(1) > 0.9 * len(lasts), lasts


def test_a_rank_slowed_by_a_busy_loop_is_named(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code, output = run_hvdrun(
        2, WORKER, "--slow", "0", "--how", "spin", "--steps", "120",
        options=["--report-file", str(report)],
    )  # fmt: skip
    assert code == 0, output
    assert re.search(r"hvdrun: rank 0 on \S+ is holding the job back", output), output
    assert re.search(r"hvdrun: rank 0 on \S+ held the job back", output), output
    assert _report(report)["straggler"]["rank"] == 0


def test_a_balanced_job_that_fails_at_the_end_names_no_rank(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code, output = run_hvdrun(
        2, WORKER, "--steps", "150", "--fail", "3", options=["--report-file", str(report)]
    )
    assert code == 3, output
    assert "hvdrun: rank 1 on host localhost failed first: exit code 3" in output, output
    assert "holding the job back" not in output, output
    # The table, for the ranks that reported, then the failure: what ends hvdrun's output.
    table = re.search(r"hvdrun:   RANK +HOST +IN COLLECTIVES", output)
    assert table is not None and table.start() < output.index("failed first"), output
    assert "hvdrun: no rank stood out: the ranks waited" in output, output
    document = _report(report)
    assert document["straggler"] is None, document
    assert {f["rank"] for f in document["ranks"]} == {0, 1}


LATE_START = """
import time, torch
import collectives.torch as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(3.0)  # (loading data, say: its engine runs keepalive rounds meanwhile)
grad = torch.ones(100)
for step in range(100):
    hvd.allreduce_(grad, name="grad")
print(f"DONE rank {hvd.rank()}")
"""


def _job(tmp_path: Path, script: str, *options: str) -> tuple[int, str, Path]:
    """A two-rank hvdrun job of ``script``: its exit code, its output and its report file."""
    path = tmp_path / "job.py"
    path.write_text(script)
    report = tmp_path / "report.json"
    code, output = run_hvdrun(2, path, options=["--report-file", str(report), *options])
    return code, output, report


def test_one_late_start_split_into_rounds_names_no_rank(tmp_path: Path) -> None:
    code, output, report = _job(tmp_path, LATE_START)
    assert code == 0, output
    assert "holding the job back" not in output, output
    assert "hvdrun: no rank stood out" in output, output
    ranks = {f["rank"]: f for f in _report(report)["ranks"]}
    late = ranks[1]
    assert late["wait_caused_s"] > 1.5, ranks  # (keepalive rounds about once a second)
    assert late["largest_wait_caused_s"] > 0.9 * late["wait_caused_s"], ranks  # (one wait)
    assert all(f["in_collectives_s"] >= f["waited_s"] for f in ranks.values()), ranks


DEADLOCK = """
import torch
import collectives.torch as hvd
hvd.init()
for step in range(20):
    hvd.allreduce_(torch.ones(4), name="warm")
hvd.allreduce_(torch.ones(4), name="a" if hvd.rank() == 0 else "b")
"""


def test_a_deadlock_names_no_rank_and_counts_no_waiting(tmp_path: Path) -> None:
    # Each rank waits on an op the other never submits: the engines go on with rounds that
    # make nothing ready, and which rank comes last in them is chance; the stall inspector
    # ends the job. No rank held the others back.
    code, output, report = _job(
        tmp_path,
        DEADLOCK,
        *("--stall-check-warning-time-seconds", "4", "--stall-check-shutdown-time-seconds", "8"),
    )
    assert code == 1 and "the stall inspector stopped the job's collectives" in output, output
    assert "holding the job back" not in output, output
    document = _report(report)
    assert document["straggler"] is None, document
    ranks = {f["rank"]: f for f in document["ranks"]}
    assert ranks[0]["rounds"] > 100, ranks  # (the rounds of 8 s stuck)
    assert document["total_wait_s"] < 1.0, document  # (the rounds before: a few ms)


LATE_WITH_NEW_NAMES = """
import time, torch
import collectives.torch as hvd
hvd.init()
for step in range(12):
    if hvd.rank() == 1:
        time.sleep(0.3)  # (its data loader, say)
    hvd.allreduce_(torch.ones(4), name=f"step.{step}")  # (a name per step: never cached)
print(f"DONE rank {hvd.rank()}")
"""


def test_a_late_rank_that_brings_ops_new_to_the_cache_is_named(tmp_path: Path) -> None:
    # Each step's op is new to the response cache: its rounds fail (then back off to the
    # full negotiation), and neither kind of round is judged stuck when the late rank
    # brings the op, so its lateness counts.
    code, output, report = _job(tmp_path, LATE_WITH_NEW_NAMES)
    assert code == 0, output
    ranks = {f["rank"]: f for f in _report(report)["ranks"]}
    assert ranks[1]["wait_caused_s"] > 2.0, ranks  # (12 x 0.3 s, less the first steps)
    assert ranks[0]["waited_s"] > 2.0 and ranks[0]["wait_caused_s"] < 0.5, ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_a_torchrun_job_gets_the_report_from_hvd_report_and_its_file(tmp_path: Path) -> None:
    at_shutdown = tmp_path / "shutdown.json"
    from_call = tmp_path / "call.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), str(WORKER),
        "--slow", "1", "--steps", "80", "--report", str(from_call),
    ]  # fmt: skip
    env = {**clean_env(), "HVDRUN_REPORT_FILE": str(at_shutdown)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"^  RANK +HOST +IN COLLECTIVES", output, re.MULTILINE), output
    assert re.search(r"^rank 1 on \S+ held the job back", output, re.MULTILINE), output
    # rank 0's live warning (no hvdrun runs: not said in its name, nor pointing at its table)
    warning = re.search(r"^.*rank 1 is holding the job back.*$", output, re.MULTILINE)
    assert warning, output
    assert "hvdrun" not in warning.group(), warning.group()
    assert warning.group().endswith("(hvd.report() has the details)"), warning.group()
    assert _report(from_call)["straggler"]["rank"] == 1
    final = _report(at_shutdown)
    assert final["straggler"]["rank"] == 1
    assert all(f["final"] for f in final["ranks"]) and len(final["ranks"]) == 2
