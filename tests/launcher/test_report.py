"""The failure report: first failure, a table of ranks, the failing rank's stderr."""

import io
import os
from pathlib import Path

from launcher.output import OutputSink
from launcher.supervision.core import JobResult, WorkerFailure
from launcher.supervision.report import python_hint, report_failure, summary_table


def sink_with(tails: dict[int, list[bytes]]) -> OutputSink:
    sink = OutputSink(io.BytesIO(), io.BytesIO())
    for rank, lines in tails.items():
        for line in lines:
            sink.line(rank, "stderr", line)
    return sink


def test_small_job_lists_every_rank() -> None:
    result = JobResult(
        exit_code=3,
        failure=WorkerFailure(2, "b", 3),
        exits={0: 143, 1: 0, 2: 3},
        stopped={0},
        lost={3: "lost its agent"},
        hosts={0: "a", 1: "a", 2: "b", 3: "b"},
    )
    # (rank 2's last line is blank, as TensorFlow's tracebacks end: the line before is shown)
    sink = sink_with({2: [b"Traceback", b"ValueError: " + b"x" * 100, b"  "]})
    assert summary_table(result, sink, result.hosts) == [
        "RANK  HOST  EXIT  STATUS        LAST STDERR LINE",
        "0     a     143   stopped",
        "1     a     0     ok",
        "2     b     3     FAILED FIRST  ValueError: " + "x" * 45 + "...",
        "3     b     -     lost          lost its agent",
    ]


def test_big_job_counts_the_unremarkable_ranks() -> None:
    hosts = {rank: f"h{rank // 8}" for rank in range(64)}
    exits = dict.fromkeys(range(64), 143)
    exits[17] = 1
    exits[40] = 139
    result = JobResult(
        exit_code=1,
        failure=WorkerFailure(17, "h2", 1),
        exits=exits,
        stopped=set(range(64)) - {17, 40},
        hosts=hosts,
    )
    lines = summary_table(result, sink_with({}), hosts)
    assert lines[1:] == [
        "17    h2    1     FAILED FIRST",
        "40    h5    139   failed",
        "... and 62 more rank(s) stopped",
    ]


def test_report_wording() -> None:
    result = JobResult(
        exit_code=137,
        failure=WorkerFailure(1, "n2", 137),
        exits={0: 143, 1: 137},
        stopped={0},
        hosts={0: "n1", 1: "n2"},
    )
    err = io.BytesIO()
    sink = OutputSink(io.BytesIO(), err)
    sink.line(1, "stderr", b"out of memory")
    report_failure(result, sink)
    text = err.getvalue().decode()
    assert "hvdrun: rank 1 on host n2 failed first: killed by SIGKILL (exit code 137)\n" in text
    assert "hvdrun: stopped or failed afterwards: rank(s) 0\n" in text
    assert "hvdrun: summary:\nhvdrun:   RANK  HOST  EXIT  STATUS" in text
    assert text.endswith("hvdrun: last lines of rank 1's stderr:\nhvdrun:     out of memory\n")


def test_a_missing_module_with_another_python_than_hvdruns_gets_a_hint(tmp_path: Path) -> None:
    """``.venv/bin/hvdrun -np 2 python train.py`` with the virtualenv not activated: the
    workers' ``python`` lacks its packages; hvdrun says which Python it runs on."""
    import sys

    other = tmp_path / "python3"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    tail = ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'torch'"]
    hint = python_hint(tail, [str(other), "train.py"])
    assert hint == (
        f"hint: the workers ran {other} (the command's {other}), not the Python hvdrun runs "
        f"on ({sys.executable}), whose packages they may need: give {sys.executable}, or "
        "activate its virtualenv"
    )
    assert python_hint(tail, [sys.executable, "train.py"]) is None  # the same Python
    beside = os.path.join(os.path.dirname(sys.executable), "python3")  # (its venv's python3)
    if os.path.exists(beside):
        assert python_hint(tail, [beside, "train.py"]) is None
    assert python_hint(["ValueError: bad"], [str(other), "train.py"]) is None
    assert python_hint(tail, ["./train.sh"]) is None


def test_ranks_that_exited_0_before_the_failure_are_named() -> None:
    # (a rank that left without a word, os._exit(0) mid-job, fails its peers' next
    # collective: the failing rank's error speaks of a dead peer, this names it)
    result = JobResult(
        exit_code=1,
        failure=WorkerFailure(0, "a", 1),
        exits={2: 0, 1: 0, 0: 1, 3: 0},
        hosts={0: "a", 1: "a", 2: "b", 3: "b"},
    )
    err = io.BytesIO()
    report_failure(result, OutputSink(io.BytesIO(), err))
    text = err.getvalue().decode()
    assert "hvdrun: before it, rank(s) 1, 2 had exited with code 0\n" in text  # (not 3)
    quiet = io.BytesIO()
    result.exits = {0: 1, 1: 0}
    report_failure(result, OutputSink(io.BytesIO(), quiet))
    assert "before it" not in quiet.getvalue().decode()
