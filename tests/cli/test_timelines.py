"""Every rank's timeline: file names, the merge (clocks aligned, who submitted last) and the
report flags on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import pytest

from collectives.engine.timeline import Timeline, open_for_rank
from hvdrun.cli import run_cli
from hvdrun.report_flags import creatable_directory, merge_after_job
from hvdrun.timelines import TimelineError, merge_files, merged_path, rank_files, start_time
from rendezvous.worker_env import timeline_file
from tests.cli.conftest import assert_usage_error

REPO = Path(__file__).resolve().parents[2]


def test_each_rank_has_its_own_file_with_all_ranks_or_a_rank_pattern(tmp_path: Path) -> None:
    assert timeline_file("t.json", 0) == "t.json" and timeline_file("t.json", 1) is None
    assert timeline_file("t.json", 3, all_ranks=True) == "t.3.json"
    assert timeline_file("dir/trace", 2, all_ranks=True) == "dir/trace.2"
    assert timeline_file("t-{rank}.json", 4) == "t-4.json"
    assert rank_files("t.json", 2) == ["t.0.json", "t.1.json"]
    assert merged_path("t.json") == "t.json" and merged_path("t-{rank}.json") == "t-all.json"
    assert open_for_rank(str(tmp_path / "x.json"), False, 1) is None
    timeline = open_for_rank(str(tmp_path / "x.json"), False, 1, all_ranks=True, host="h")
    assert timeline is not None and timeline.path == str(tmp_path / "x.1.json")
    timeline.close()
    meta = json.loads((tmp_path / "x.1.json").read_text())[0]
    assert meta["name"] == "hvdrun_rank" and meta["args"]["rank"] == 1
    assert meta["args"]["host"] == "h"


@pytest.fixture
def base() -> float:
    """The time 0 of the ops in a test's timelines, on the clock they share (ahead of the
    timelines' start: a timeline records nothing from before)."""
    return time.monotonic() + 1.0


def _write(path: Path, base: float, rank: int, host: str, submits: list[float],
           ends: list[float], skew: float = 0.0,
           rounds: list[str] | None = None, job: str | None = None) -> None:  # fmt: skip
    """A rank's timeline of one op per round: submitted at ``submits``, ready at ``ends``
    (seconds after ``base``) in ``rounds`` (by default 0:1, 0:2, ...), recorded on a clock
    ``skew`` seconds ahead; ``job``: the id of the job whose own timeline it is."""
    timeline = Timeline(str(path), rank=rank, host=host, job=job)
    base += skew
    rounds = rounds or [f"0:{k + 1}" for k in range(len(ends))]
    for submit, end, round_id in zip(submits, ends, rounds, strict=True):
        timeline.begin("allreduce.grad", "NEGOTIATE_ALLREDUCE", base + submit)
        timeline.negotiated("allreduce.grad", "ALLREDUCE", {}, base + end, round_id)
        timeline.end("allreduce.grad", "QUEUE", base + end + 0.001)
        timeline.end("allreduce.grad", "ALLREDUCE", base + end + 0.002)
    timeline.close()


def _negotiations(events: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    return [e for e in events if e.get("pid") == rank and e["name"] == "NEGOTIATE_ALLREDUCE"]


def test_merging_aligns_the_clocks_of_other_hosts_and_names_the_last_submitter(
    tmp_path: Path,
    base: float,
) -> None:
    ends = [0.1 * k + 0.05 for k in range(20)]
    # Rank 1, on another host whose clock is 7 s ahead, submits every op 40 ms late.
    _write(tmp_path / "t.0.json", base, 0, "a", [0.1 * k for k in range(20)], ends)
    _write(tmp_path / "t.1.json", base, 1, "b", [e - 0.01 for e in ends], ends, skew=7.0)
    output = tmp_path / "merged.json"
    assert merge_files(str(output), [str(tmp_path / "t.1.json"), str(tmp_path / "t.0.json")]) == []
    events = json.loads(output.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (a)", 1: "rank 1 (b)"}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "allreduce.grad" in threads
    rows = {rank: _negotiations(events, rank) for rank in (0, 1)}
    for rank in (0, 1):  # every op in order, on aligned clocks
        assert [e["ph"] for e in rows[rank]] == ["B", "E"] * 20
        stamps = [e["ts"] for e in rows[rank]]
        assert stamps == sorted(stamps)
    for mine, theirs in zip(rows[0], rows[1], strict=True):
        if mine["ph"] == "E":  # the rounds ended together
            assert abs(mine["ts"] - theirs["ts"]) < 5.0
            assert mine["args"]["last_rank"] == 1 and theirs["args"]["last_rank"] == 1
            # Rank 0 waited for rank 1's submission; rank 1, the last, for nobody (the rest
            # of either phase, 10 ms, is the round's own time).
            assert mine["args"]["waited_ms"] == pytest.approx(40.0, abs=0.1)
            assert theirs["args"]["waited_ms"] == 0.0


def test_ranks_of_one_host_align_on_its_clock(tmp_path: Path, base: float) -> None:
    _write(tmp_path / "a.json", base, 0, "h", [0.0, 0.2], [0.1, 0.3])
    time.sleep(0.05)  # (the second file starts later: its times count from then)
    _write(tmp_path / "b.json", base, 1, "h", [0.09, 0.25], [0.1, 0.3])
    events, _ = _merged(tmp_path, ["a.json", "b.json"])
    ends = [[e["ts"] for e in _negotiations(events, rank) if e["ph"] == "E"] for rank in (0, 1)]
    assert ends[0] == pytest.approx(ends[1], abs=2.0)


def test_a_round_named_again_in_a_file_is_another_occurrence(tmp_path: Path, base: float) -> None:
    # A process that opened its file again in one generation (hvd.init() after
    # hvd.shutdown()) names its rounds from 1 again: the n-th of each rank are one op.
    _write(tmp_path / "a.json", base, 0, "h", [0.0, 0.3], [0.1, 0.4], rounds=["0:1", "0:1"])
    _write(tmp_path / "b.json", base, 1, "h", [0.09, 0.2], [0.1, 0.4], rounds=["0:1", "0:1"])
    events, _ = _merged(tmp_path, ["a.json", "b.json"])
    for rank, waits in ((0, [90.0, 0.0]), (1, [0.0, 100.0])):
        ends = [e for e in _negotiations(events, rank) if e["ph"] == "E"]
        assert [e["args"]["last_rank"] for e in ends] == [1, 0]
        assert [e["args"]["waited_ms"] for e in ends] == pytest.approx(waits, abs=0.1)


def _merged(tmp_path: Path, names: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    output = tmp_path / "out.json"
    notes = merge_files(str(output), [str(tmp_path / name) for name in names])
    return json.loads(output.read_text()), notes


def test_a_rank_that_shares_no_round_is_left_as_it_is(tmp_path: Path, base: float) -> None:
    _write(tmp_path / "a.json", base, 0, "h1", [0.0], [0.1])
    (tmp_path / "b.json").write_text('[{"name":"x","ph":"i","ts":5,"pid":0,"tid":0,"s":"t"}]')
    events, notes = _merged(tmp_path, ["a.json", "b.json"])
    assert notes and "shares no round with rank 0" in notes[0]
    assert any(e.get("pid") == 1 and e["name"] == "x" for e in events)


def test_unreadable_or_clashing_timelines_are_named(tmp_path: Path, base: float) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TimelineError, match=r"bad\.json is not a timeline"):
        merge_files(str(tmp_path / "o.json"), [str(tmp_path / "bad.json")])
    with pytest.raises(TimelineError, match="cannot read"):
        merge_files(str(tmp_path / "o.json"), [str(tmp_path / "missing.json")])
    _write(tmp_path / "x.json", base, 0, "h", [0.0], [0.1])
    _write(tmp_path / "y.json", base, 0, "h", [0.0], [0.1])
    with pytest.raises(TimelineError, match="both rank 0's"):
        merge_files(str(tmp_path / "o.json"), [str(tmp_path / "x.json"), str(tmp_path / "y.json")])
    (tmp_path / "numbers.json").write_text("[1, 2]")
    with pytest.raises(TimelineError, match=r"numbers\.json is not a timeline: not a JSON array"):
        merge_files(str(tmp_path / "o.json"), [str(tmp_path / "numbers.json")])


def test_a_merge_never_overwrites_a_rank_s_file_or_leaves_half_a_file(
    tmp_path: Path, base: float
) -> None:
    _write(tmp_path / "t.0.json", base, 0, "h", [0.0], [0.1])
    _write(tmp_path / "t.1.json", base, 1, "h", [0.05], [0.1])
    inputs = [str(tmp_path / "t.0.json"), str(tmp_path / "t.1.json")]
    before = (tmp_path / "t.0.json").read_text()
    with pytest.raises(TimelineError, match=r"t\.0\.json is one of the timelines to merge"):
        merge_files(str(tmp_path / "t.0.json"), inputs)
    assert (tmp_path / "t.0.json").read_text() == before
    (tmp_path / "taken").mkdir()  # the output's name is a directory's
    with pytest.raises(TimelineError, match=r"cannot write .*taken: Is a directory"):
        merge_files(str(tmp_path / "taken"), inputs)
    (tmp_path / "file").write_text("")
    with pytest.raises(TimelineError, match=r"cannot write .*file/o\.json: File exists"):
        merge_files(str(tmp_path / "file" / "o.json"), inputs)
    assert sorted(os.listdir(tmp_path)) == ["file", "t.0.json", "t.1.json", "taken"]
    assert os.listdir(tmp_path / "taken") == []


def test_merge_timelines_on_the_command_line(
    tmp_path: Path, base: float, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "t.0.json", base, 0, "h", [0.0], [0.1])
    _write(tmp_path / "t.1.json", base, 1, "h", [0.05], [0.1])
    out = tmp_path / "all.json"
    assert run_cli(["--merge-timelines", str(out), str(tmp_path / "t.0.json"),
                    str(tmp_path / "t.1.json")]) == 0  # fmt: skip
    assert f"merged 2 timelines into {out}" in capsys.readouterr().err
    assert {e["pid"] for e in json.loads(out.read_text())} == {0, 1}
    assert run_cli(["--merge-timelines", str(out), str(tmp_path / "t.0.json")]) == 0
    assert f"merged 1 timeline into {out}" in capsys.readouterr().err
    assert_usage_error(["--merge-timelines", str(out)], "needs the timelines to merge", capsys)
    assert run_cli(["--merge-timelines", str(out), str(tmp_path / "none.json")]) == 1
    assert "hvdrun: error: cannot read" in capsys.readouterr().err
    assert run_cli(["--merge-timelines", "/proc/none/all.json", str(tmp_path / "t.0.json")]) == 1
    err = capsys.readouterr().err
    assert "hvdrun: error: cannot write /proc/none/all.json: No such file or directory" in err
    assert "Traceback" not in err


def test_after_a_job_hvdrun_merges_the_timelines_it_can_see(tmp_path: Path, base: float) -> None:
    path = str(tmp_path / "trace.json")
    _write(tmp_path / "trace.0.json", base, 0, "h", [0.0], [0.1])
    said: list[str] = []
    env = {"HVDRUN_TIMELINE": path, "HVDRUN_TIMELINE_ALL_RANKS": "1"}
    merge_after_job(env, 2, 0.0, echo=said.append)
    assert "merged the timelines of 1 rank(s)" in said[0] and "trace.1.json" in said[1]
    assert json.loads(Path(path).read_text())
    said.clear()
    merge_after_job({"HVDRUN_TIMELINE": path}, 2, 0.0, echo=said.append)  # rank 0's file only
    assert said == []
    os.unlink(path)
    os.mkdir(path)  # the merge cannot be written: the job's end says so, no traceback
    merge_after_job(env, 2, 0.0, echo=said.append)
    assert said == [f"hvdrun: the timelines were not merged: cannot write {path}: Is a directory"]


def test_after_a_job_the_files_an_earlier_job_left_are_left_out(
    tmp_path: Path, base: float
) -> None:
    path = str(tmp_path / "trace.json")
    env = {"HVDRUN_TIMELINE": path, "HVDRUN_TIMELINE_ALL_RANKS": "1"}
    for rank in range(3):  # an earlier job's files: every rank's
        _write(tmp_path / f"trace.{rank}.json", base, rank, "h", [0.0], [0.1])
    (tmp_path / "trace.2.json").write_text("[]")  # (no start of its own: its mtime counts)
    os.utime(tmp_path / "trace.2.json", (1.0, 1.0))
    since = time.time()
    began = start_time(str(tmp_path / "trace.0.json"))
    assert began is not None and began < since
    _write(tmp_path / "trace.0.json", base, 0, "h", [0.0], [0.1])  # this job's: rank 0 only
    said: list[str] = []
    merge_after_job(env, 4, since, echo=said.append)
    assert said[0] == (
        "hvdrun: left out 2 timeline(s) that another job wrote: "
        f"{tmp_path}/trace.1.json, {tmp_path}/trace.2.json"
    )
    assert "merged the timelines of 1 rank(s)" in said[1] and "trace.3.json" in said[2]
    assert {e["pid"] for e in json.loads(Path(path).read_text())} == {0}


def test_after_a_job_its_own_files_are_known_by_its_id_whatever_the_clocks_say(
    tmp_path: Path, base: float
) -> None:
    # A rank whose wall clock runs behind hvdrun's (another host's, on a shared filesystem;
    # an NTP step back) began "before the job": its file, which says which job wrote it, is
    # merged all the same, and another job's file is left out whenever it began.
    path = str(tmp_path / "trace.json")
    env = {"HVDRUN_TIMELINE": path, "HVDRUN_TIMELINE_ALL_RANKS": "1"}
    _write(tmp_path / "trace.0.json", base, 0, "h", [0.0], [0.1], job="job-a")
    _write(tmp_path / "trace.1.json", base, 1, "h", [0.0], [0.1], job="job-a")
    _write(tmp_path / "trace.2.json", base, 2, "h", [0.0], [0.1], job="job-b")
    said: list[str] = []
    merge_after_job(env, 3, time.time() + 60, job="job-a", echo=said.append)
    assert (
        said[0] == f"hvdrun: left out 1 timeline(s) that another job wrote: {tmp_path}/trace.2.json"
    )
    assert "merged the timelines of 2 rank(s)" in said[1]
    assert {e["pid"] for e in json.loads(Path(path).read_text())} == {0, 1}


def test_report_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    out = capsys.readouterr().out
    output_section = out[out.index("Output:") :]
    for flag in ("--report-file", "--no-report", "--timeline-all-ranks", "--merge-timelines"):
        assert flag in out
    assert output_section.index("--report-file") < output_section.index("Logging:")


@pytest.mark.parametrize("option", ["--report-file", "--timeline-filename", "--autotune-log-file"])
def test_an_output_file_whose_directory_cannot_be_made_is_a_usage_error(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (the timeline's and the autotune log's only for a job that runs on this machine:
    # elsewhere its hosts write them)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_usage_error(
        [option, str(blocker / "out.json"), "--autotune", "-np", "1", "true"],
        f"invalid '{option}': cannot create",
        capsys,
    )


@pytest.mark.parametrize(
    "option", ["--report-file", "--timeline-filename", "--autotune-log-file", "--output-filename"]
)
def test_an_output_directory_that_exists_but_takes_no_file_is_a_usage_error(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # (/proc takes no new file, not even from root, whom permissions would not stop)
    path = "/proc" if option == "--output-filename" else "/proc/out.json"
    assert_usage_error(
        [option, path, "--autotune", "-np", "1", "true"],
        f"invalid '{option}': cannot write in /proc: this directory takes no new files",
        capsys,
    )


def test_an_existing_file_that_cannot_be_written_is_a_usage_error(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text("{}")
    creatable_directory(str(tmp_path), "--report-file", str(report))
    assert report.read_text() == "{}"  # (opened, not truncated)
    # A file that cannot be written: on a read-only mount for root (whom permissions do
    # not stop), else without write permission.
    mounted = tmp_path / "ro"
    mounted.mkdir()
    root = os.geteuid() == 0
    if root and subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mounted / "old.json").write_text("{}")
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(mounted)], check=True)
        else:
            (mounted / "old.json").chmod(0o444)
        with pytest.raises(click.BadParameter, match=r"cannot write .*old\.json"):
            creatable_directory(str(mounted), "--report-file", str(mounted / "old.json"))
    finally:
        if root:
            subprocess.run(["umount", str(mounted)], check=False)


def test_every_rank_s_timeline_tries_the_directory_though_the_named_file_exists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # (--timeline-all-ranks writes trace.N.json beside the file named, which may be an
    # earlier run's merged trace: /proc/version stands for one in a read-only directory)
    assert_usage_error(
        ["--timeline-filename", "/proc/version", "--timeline-all-ranks", "-np", "1", "true"],
        "invalid '--timeline-filename': cannot write in /proc",
        capsys,
    )


def test_a_rank_pattern_in_the_timeline_s_directory_is_checked_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # (rank 0's directory, /proc/0, where rank 0 would write: no rank could)
    assert_usage_error(
        ["--timeline-filename", "/proc/{rank}/t.json", "-np", "1", "true"],
        "invalid '--timeline-filename': cannot create /proc/0",
        capsys,
    )


def test_an_existing_file_is_taken_as_it_is_wherever_it_lies() -> None:
    # (a descriptor's file, /dev/null: opened by name, in a directory that takes no new file)
    creatable_directory("/proc/self/fd", "--report-file", "/proc/self/fd/2")
    with pytest.raises(click.BadParameter, match="cannot write in /proc/self/fd"):
        creatable_directory("/proc/self/fd", "--report-file", "/proc/self/fd/no-such")


def test_every_rank_s_own_file_is_not_named_after_a_device_or_a_pipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (--timeline-all-ranks beside /dev/null made the regular files /dev/null.0, ...: a
    # pipe stands for the device, which a test must not touch)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert_usage_error(
        ["--timeline-filename", str(pipe), "--timeline-all-ranks", "-np", "1", "true"],
        f"invalid '--timeline-filename': {pipe} is a device or a pipe: every rank's own "
        f"timeline would be a new file named after it ({pipe}.0, ...)",
        capsys,
    )
    with pytest.raises(OSError, match="every rank's own timeline would be a new file"):
        open_for_rank(str(pipe), False, 1, all_ranks=True)  # (a worker on another host)
    assert os.listdir(tmp_path) == ["pipe"]


def test_a_setting_given_as_a_variable_is_named_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.delenv("HVDRUN_TIMELINE", raising=False)
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    for spelling in ("HOROVOD_TIMELINE", "HVDRUN_TIMELINE"):
        assert_usage_error(
            ["-x", f"{spelling}={blocker}/t.json", "-np", "1", "true"],
            f"invalid '{spelling}': cannot create {blocker}",
            capsys,
        )
    monkeypatch.setenv("HOROVOD_TIMELINE", f"{blocker}/t.json")  # (hvdrun's environment)
    assert_usage_error(
        ["-np", "1", "true"], f"invalid 'HOROVOD_TIMELINE': cannot create {blocker}", capsys
    )
    # The flag wins over the variable, and is named.
    assert_usage_error(
        ["--timeline-filename", f"{blocker}/u.json", "-np", "1", "true"],
        f"invalid '--timeline-filename': cannot create {blocker}",
        capsys,
    )


RENDER = REPO / "docs" / "render_timeline.py"


def test_render_timeline_says_when_it_has_nothing_to_draw(tmp_path: Path, base: float) -> None:
    # (before matplotlib, which the tests do without: it draws nothing)
    _write(tmp_path / "t.0.json", base, 0, "h", [0.0], [0.1])
    _write(tmp_path / "t.1.json", base, 1, "h", [0.05], [0.1])
    merge_files(str(tmp_path / "all.json"), [str(tmp_path / f"t.{r}.json") for r in (0, 1)])
    for trace, options, why in [
        ("t.0.json", [], "not a merged timeline"),
        ("all.json", ["--start", "5"], "no allreduce, broadcast or allgather between 5.000 s"),
    ]:
        done = subprocess.run(
            [sys.executable, str(RENDER), str(tmp_path / trace), str(tmp_path / "t.png"),
             *options],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert why in done.stderr and "no " + str(tmp_path / "t.png") in done.stderr
        assert not (tmp_path / "t.png").exists()


def test_timeline_switches_without_a_timeline_file_are_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--timeline-all-ranks or --timeline-mark-cycles with no timeline file would write
    nothing, and the user would find out after the job: hvdrun says so before it starts."""
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    argv = ["--dry-run", "-np", "1", "--timeline-all-ranks", "--timeline-mark-cycles", "true"]
    assert run_cli(argv) == 0
    err = capsys.readouterr().err
    for flag in ("--timeline-all-ranks", "--timeline-mark-cycles"):
        assert f"hvdrun: note: {flag} has no effect without a timeline file" in err
    # a timeline file from the command line or the environment: no note
    assert run_cli([*argv[:-1], "--timeline-filename", "t.json", "true"]) == 0
    assert "timeline file" not in capsys.readouterr().err
    monkeypatch.setenv("HOROVOD_TIMELINE", "t.json")
    assert run_cli(argv) == 0
    assert "timeline file" not in capsys.readouterr().err


def test_autotune_settings_without_autotune_are_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--autotune-log-file (or another of the autotuner's settings) without --autotune would
    write no log and tune nothing: hvdrun says so before the job starts."""
    monkeypatch.delenv("HOROVOD_AUTOTUNE", raising=False)
    argv = ["--dry-run", "-np", "1", "--autotune-log-file", "at.csv"]
    assert run_cli([*argv, "--autotune-warmup-samples", "2", "true"]) == 0
    err = capsys.readouterr().err
    for flag in ("--autotune-log-file", "--autotune-warmup-samples"):
        assert f"hvdrun: note: {flag} has no effect without --autotune" in err
    assert err.count("without --autotune") == 2  # (each said once, by the flag's name)
    # The variable, with -x or in hvdrun's environment: named as given.
    monkeypatch.setenv("HOROVOD_AUTOTUNE_LOG", "at.csv")
    assert (
        run_cli(["--dry-run", "-np", "1", "-x", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=3", "true"]) == 0
    )
    err = capsys.readouterr().err
    for name in ("HOROVOD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"):
        assert f"hvdrun: note: {name} has no effect without --autotune" in err, err
    monkeypatch.delenv("HOROVOD_AUTOTUNE_LOG")
    # autotune on, from the command line or the environment: no note
    assert run_cli([*argv, "--autotune", "true"]) == 0
    assert "without --autotune" not in capsys.readouterr().err
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    assert run_cli([*argv, "true"]) == 0
    assert "without --autotune" not in capsys.readouterr().err


MERGE_IN_LITTLE_MEMORY = """
import json, resource, sys, time
from pathlib import Path
from hvdrun.timelines import merge_files
folder = Path(sys.argv[1])
paths = []
for rank in range(2):  # (a long job's timelines: 6000 ops of 10 events, as a fused bucket's)
    path = folder / f"t.{rank}.json"
    with path.open("w") as out:
        meta = {"rank": rank, "host": "h", "monotonic_us": 1000.0 + rank, "unix_s": time.time()}
        out.write("[\\n" + json.dumps({"name": "hvdrun_rank", "ph": "M", "pid": 0, "args": meta}))
        out.write(',\\n{"name":"process_name","ph":"M","pid":1,"args":{"name":"allreduce.grad"}}')
        for k in range(6000):
            ts = k * 100.0
            out.write(f',\\n{{"name":"NEGOTIATE_ALLREDUCE","ph":"B","pid":1,"ts":{ts}}}')
            out.write(f',\\n{{"name":"NEGOTIATE_ALLREDUCE","ph":"E","pid":1,"ts":{ts + 20},'
                      f'"args":{{"round":"0:{k + 1}"}}}}')
            for i, phase in enumerate(("QUEUE", "MEMCPY_IN", "ALLREDUCE", "MEMCPY_OUT")):
                out.write(f',\\n{{"name":"{phase}","ph":"B","pid":1,"ts":{ts + 21 + 10 * i},'
                          f'"args":{{"tensor_sizes":[1024,2048,4096],"dtype":"float32"}}}}')
                out.write(f',\\n{{"name":"{phase}","ph":"E","pid":1,"ts":{ts + 29 + 10 * i}}}')
        out.write("\\n]\\n")
    paths.append(str(path))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
merge_files(str(folder / "merged.json"), paths)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(sum(Path(p).stat().st_size for p in paths), grew)
"""


def test_merging_long_timelines_takes_memory_for_their_rounds_not_their_events(
    tmp_path: Path,
) -> None:
    """A long job's timelines (gigabytes over hours) are merged at its end by hvdrun itself:
    loading them whole took twelve times their size (a 1 GB peak for 86 MB, and a MemoryError
    for the job's exit code under a limit). They are read as streams, twice, so what stays
    in memory is the index of their rounds."""
    done = subprocess.run(
        [sys.executable, "-c", MERGE_IN_LITTLE_MEMORY, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    size, grew = map(int, done.stdout.split())
    assert grew < 3 * size, f"merging {size} bytes of timelines took {grew} bytes more memory"
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sum(1 for e in merged if e.get("name") == "NEGOTIATE_ALLREDUCE") == 2 * 2 * 6000
    waited = [e["args"]["waited_ms"] for e in merged if "waited_ms" in e.get("args", {})]
    assert len(waited) == 2 * 6000
