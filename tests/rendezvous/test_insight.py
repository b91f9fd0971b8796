"""What the workers' arrival figures say: the straggler, the table, the JSON, the live watch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rendezvous.insight import (
    FULL_TABLE_RANKS,
    LIVE_REPEAT_SECONDS,
    LiveWatch,
    RankFigures,
    analyse,
    decode_all,
    stands_out,
)
from tests.processes import REPO


def _rank(rank: int, waited: float, caused: float, last: int, **more: object) -> RankFigures:
    return RankFigures(
        rank=rank,
        host=f"host{rank}",
        size=more.pop("size", 3),  # type: ignore[arg-type]
        elapsed_s=10.0,
        in_collectives_s=4.0,
        waited_s=waited,
        wait_caused_s=caused,
        times_last=last,
        held_rounds=100,
        **more,  # type: ignore[arg-type]
    )


def test_figures_travel_as_json_and_garbage_is_left_out() -> None:
    figures = _rank(1, 0.5, 2.0, 80, ops={"allreduce.grad": {"waited_s": 0.4, "for": {"2": 0.4}}})
    assert RankFigures.from_json(figures.to_json()) == figures
    found = decode_all({"hvdrun/insight/1": figures.to_json(), "hvdrun/insight/2": b"{oops"})
    assert list(found) == ["hvdrun/insight/1"]
    assert RankFigures.from_json(b'{"rank": 3, "from_a_newer_worker": 1}').rank == 3


def test_the_rank_that_made_the_others_wait_is_named_in_one_sentence(tmp_path: Path) -> None:
    grad = {"allreduce.grad": {"waited_s": 2.9, "for": {"2": 2.9}}}
    ranks = [
        _rank(0, 3.0, 0.1, 5, ops=grad),
        _rank(1, 3.1, 0.0, 3, ops=grad),
        _rank(2, 0.1, 6.1, 92),
    ]
    report = analyse(ranks)
    assert report.straggler is not None and report.straggler.rank == 2
    assert report.summary == (
        "rank 2 on host2 held the job back: it arrived last at 92 of the 100 collectives that "
        "waited (92%), and the others waited 6.10 s for it (33 ms each time, 30% of their "
        "time), mostly at allreduce.grad."
    )
    lines = report.table()
    assert lines[1].split() == ["RANK", "HOST", "IN", "COLLECTIVES", "BETWEEN", "WAITED", "FOR",
                                "OTHERS", "LAST", "WAIT", "CAUSED"]  # fmt: skip
    assert lines[4].split() == ["2", "host2", "4.00", "s", "(40%)", "6.00", "s", "100", "ms",
                                "(1%)", "92", "(92%)", "6.10", "s"]  # fmt: skip
    assert lines[-1] == report.summary
    path = tmp_path / "report.json"
    report.write(str(path))
    document = json.loads(path.read_text())
    assert document["straggler"]["rank"] == 2 and document["missing_ranks"] == []
    assert [r["rank"] for r in document["ranks"]] == [0, 1, 2]
    assert document["ranks"][0]["between_s"] == 6.0
    assert document["ops"] == [
        {"op": "allreduce.grad", "waited_s": 5.8, "mostly_for": 2, "share": 1.0}
    ]


def test_a_report_that_cannot_be_written_leaves_the_earlier_one_as_it_was(
    tmp_path: Path,
) -> None:
    # (a full disk truncated an earlier report to nothing)
    path = tmp_path / "report.json"
    path.write_text('{"earlier": true}\n')
    script = (
        "import resource, sys\n"
        "from rendezvous.insight import analyse\n"
        "from tests.rendezvous.test_insight import _rank\n"
        "report = analyse([_rank(0, 1.0, 1.2, 40), _rank(1, 1.2, 0.6, 30)])\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    report.write(sys.argv[1])\n"
        "except OSError as error:\n"
        "    print(error.strerror)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.stdout == "File too large\n", result
    assert path.read_text() == '{"earlier": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # (nothing half-written)


def test_a_report_through_a_link_is_written_to_its_target_with_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "report.json"
    target.write_text("{}")
    target.chmod(0o664)
    link = tmp_path / "report.json"
    link.symlink_to(target)
    analyse([_rank(0, 1.0, 1.2, 40), _rank(1, 1.2, 0.6, 30)]).write(str(link))
    assert link.is_symlink() and json.loads(target.read_text())["ranks"]
    assert target.stat().st_mode & 0o777 == 0o664


def test_no_rank_is_named_when_the_waiting_is_spread_or_small() -> None:
    spread = analyse([_rank(0, 1.0, 1.2, 40), _rank(1, 1.2, 0.6, 30), _rank(2, 0.6, 1.0, 30)])
    assert spread.straggler is None and spread.summary.startswith("no rank stood out")
    small = analyse([_rank(0, 0.05, 0.0, 0), _rank(1, 0.0, 0.05, 3)])  # 0.5% of their time
    assert small.straggler is None
    assert stands_out({0: 0.0, 1: 0.0}) is None
    assert stands_out({0: 1.0, 1: 0.3}) == 0 and stands_out({0: 1.0, 1: 0.4}) is None


def test_one_late_start_does_not_make_a_straggler() -> None:
    late_once = [_rank(0, 2.0, 0.0, 0), _rank(1, 0.0, 2.0, 2, largest_wait_caused_s=1.95)]
    assert analyse(late_once).straggler is None
    watch = LiveWatch()
    watch.update(0.0, {"0": _live(0, 0.0, 0, 0), "1": _live(1, 0.0, 0, 0)})
    once = {"0": _live(0, 0.0, 0, 1), "1": _live(1, 1.5, 1, 1)}
    assert watch.update(3.0, once).warning is None


def test_ranks_without_figures_are_listed_and_big_jobs_show_the_worst() -> None:
    report = analyse([_rank(0, 0.0, 0.0, 0, size=4), _rank(2, 0.0, 0.0, 0, size=4)], size=4)
    assert report.missing == [1, 3] and "no figures from rank(s) 1, 3" in "\n".join(report.table())
    many = [_rank(r, 0.1, 0.1 * r, 1, size=64) for r in range(64)]
    lines = analyse(many).table()
    assert len(lines) == 2 + FULL_TABLE_RANKS // 2 + 2
    assert lines[2].split()[0] == "48" and "... and 48 more rank(s)" in lines[-2]
    assert analyse([]).table() == [] and str(analyse([])) == "no rank reported its figures."


def _live(rank: int, caused: float, last: int, held: int) -> RankFigures:
    return RankFigures(rank=rank, host="h", wait_caused_s=caused, times_last=last, held_rounds=held)


def test_the_live_watch_warns_once_while_a_rank_holds_the_others_back() -> None:
    watch = LiveWatch(window=10.0, wait_seconds=1.0)
    assert watch.update(0.0, {"0": _live(0, 0, 0, 0), "1": _live(1, 0, 0, 0)}).status is None
    # 1.5 s in, rank 1 cost the others 0.2 s: below 1 s a 10 s window (0.15 s so far)...
    news = watch.update(1.5, {"0": _live(0, 0, 0, 5), "1": _live(1, 0.2, 5, 5)})
    assert news == news.__class__()  # (too short a stretch to judge)
    news = watch.update(3.0, {"0": _live(0, 0.01, 1, 30), "1": _live(1, 0.9, 29, 30)})
    assert news.status is not None and news.status.startswith("rank 1 on h holds the others")
    assert news.warning is not None and "last at 97% of them" in news.warning
    news = watch.update(4.0, {"0": _live(0, 0.01, 1, 40), "1": _live(1, 1.5, 39, 40)})
    assert news.status is not None and news.warning is None  # (once)
    # It stops: the window moves past its waits and the status goes.
    for now in range(5, 16):
        news = watch.update(float(now), {"0": _live(0, 0.01, 1, 40), "1": _live(1, 1.5, 39, 40)})
    assert news.status is None
    later = 16.0 + LIVE_REPEAT_SECONDS
    watch.update(later - 3, {"0": _live(0, 0.01, 1, 40), "1": _live(1, 1.5, 39, 40)})
    news = watch.update(later, {"0": _live(0, 0.01, 1, 80), "1": _live(1, 9.5, 79, 80)})
    assert news.warning is not None  # (again, after LIVE_REPEAT_SECONDS)


def test_the_live_watch_says_nothing_about_a_balanced_job() -> None:
    watch = LiveWatch()
    for now in range(12):
        figures = {str(r): _live(r, 0.3 * now, 2 * now, 4 * now) for r in (0, 1)}
        assert watch.update(float(now), figures).status is None


def test_the_live_watch_judges_a_worker_from_its_first_figures_in_the_window() -> None:
    watch = LiveWatch()
    watch.update(0.0, {"0": _live(0, 0.0, 0, 0)})
    # Rank 1 publishes for the first time with 5 s caused since the start: not in the window.
    watch.update(1.0, {"0": _live(0, 0.0, 0, 90), "1": _live(1, 5.0, 90, 90)})
    news = watch.update(3.5, {"0": _live(0, 0.0, 0, 95), "1": _live(1, 5.2, 95, 95)})
    assert news.warning is None  # 0.2 s since then: below 1 s in 10 s
    news = watch.update(4.0, {"0": _live(0, 0.0, 0, 99), "1": _live(1, 6.2, 99, 99)})
    assert news.warning is not None and "in the last 3 s" in news.warning


def test_a_rank_stopped_before_its_last_figures_is_marked_at_the_end() -> None:
    ranks = [_rank(0, 0.1, 6.0, 90, final=False, size=2), _rank(1, 6.0, 0.1, 1, final=True, size=2)]
    live = analyse(ranks).table()
    assert not any("*" in line for line in live)  # (hvd.report(): no rank's are final yet)
    ended = analyse(ranks).table(at_end=True)
    assert ended[2].split()[:2] == ["0*", "host0"] and ended[3].split()[:2] == ["1", "host1"]
    assert ended[4] == (
        "  * its figures as of its last comparison with the others (about once a second): it "
        "was stopped or killed before it published its last ones"
    )


def test_elastic_workers_are_rows_of_their_own_and_missing_from_the_last_generation() -> None:
    # Generation 1 had 3 ranks; its rank 1 failed, and its rank 2 went on as rank 1 of
    # generation 2. Every worker reported: no rank is missing, and the two workers that
    # were rank 1 are told apart (their figures are not added up as one rank's).
    ranks = [
        _rank(0, 1.0, 0.1, 1, generation=2, size=2, final=True),
        _rank(1, 0.2, 0.1, 1, generation=1, size=3, final=True),
        _rank(1, 1.0, 2.5, 40, generation=2, size=2, largest_wait_caused_s=0.1, final=True),
    ]
    ranks[1].host = ranks[2].host = "other"
    report = analyse(ranks)
    assert report.size == 2 and report.missing == []
    lines = report.table(at_end=True)
    assert lines[1].split()[:3] == ["RANK", "GEN", "HOST"]
    assert [line.split()[:2] for line in lines[2:5]] == [["0", "2"], ["1", "1"], ["1", "2"]]
    assert "(elastic: a row per worker" in lines[5]
    assert report.straggler is not None and report.straggler.wait_caused_s == 2.5
    # Generation 2's rank 1 never reported: it is missing, though generation 1's did.
    gone = analyse(ranks[:2])
    assert gone.missing == [1]
    assert "no figures from rank(s) 1 of the last generation" in "\n".join(gone.table())


def test_a_straggler_that_alone_writes_a_timeline_is_said_to_do_so() -> None:
    # A timeline slows its rank's collectives: with the default (rank 0's only), rank 0 can
    # be named though only its timeline held the job back. The report says so.
    ranks = [_rank(0, 0.1, 6.1, 92, timeline=True), _rank(1, 3.0, 0.1, 5), _rank(2, 3.0, 0.0, 3)]
    named = analyse(ranks).summary
    assert named.startswith("rank 0 on host0 held the job back") and named.endswith(
        "It writes a timeline and the others do not, which slows its collectives (the engine's "
        "fast paths stay off while a timeline is open): run with --timeline-all-ranks, or "
        "without the timeline, to tell the two apart."
    )
    for rank in ranks:
        rank.timeline = True  # (--timeline-all-ranks: every rank alike, nothing to say)
    assert "timeline" not in analyse(ranks).summary
    watch = LiveWatch("the end-of-job table has the details")
    late = {"0": _live(0, 0, 0, 0), "1": _live(1, 0, 0, 0)}
    late["1"].timeline = True
    watch.update(0.0, late)
    late = {"0": _live(0, 0.01, 1, 30), "1": _live(1, 2.9, 29, 30)}
    late["1"].timeline = True
    warning = watch.update(3.0, late).warning
    assert warning is not None and "(the end-of-job table has the details). It writes a" in warning
