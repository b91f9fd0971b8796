"""What the engine records in a timeline: the job's own file across ``hvd.init()``s (an elastic
job's generations), and the phases of ops whose data rode their round."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from collectives.engine.timeline import Timeline, open_for_job, open_for_rank
from tests.processes import REPO


def _op(timeline: Timeline, row: str, round_id: str) -> None:
    """One allreduce through its phases, now."""
    now = time.monotonic()
    timeline.begin(row, "NEGOTIATE_ALLREDUCE", now)
    timeline.negotiated(row, "ALLREDUCE", {0: now}, now, round_id)
    timeline.end(row, "QUEUE", now)
    timeline.end(row, "ALLREDUCE", now)


def _events(path: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads(path.read_text())
    return events


def _rows(events: list[dict[str, Any]]) -> dict[str, int]:
    return {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}


def test_a_process_writes_on_in_the_job_s_timeline_where_it_left_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HVDRUN_JOB_ID", "job-a")
    path = tmp_path / "t.json"
    first = open_for_job(str(path), False, 0, False, "h", 1)
    assert first is not None
    _op(first, "allreduce.before", "0:1")
    first.close()
    second = open_for_job(str(path), False, 0, False, "h", 2)  # the next generation
    assert second is not None
    _op(second, "allreduce.after", "0:1")
    second.flush()
    assert _rows(_events(path)).keys() >= {"allreduce.before", "allreduce.after"}  # (valid)
    _op(second, "allreduce.before", "0:2")
    second.close()
    events = _events(path)
    rows = _rows(events)
    assert list(rows) == ["negotiation cycles", "allreduce.before", "allreduce.after"]
    assert sum(e["name"] == "hvdrun_rank" for e in events) == 1
    ends = [e for e in events if e["name"] == "NEGOTIATE_ALLREDUCE" and e["ph"] == "E"]
    assert [(e["pid"], e["args"]["round"]) for e in ends] == [
        (rows["allreduce.before"], "1/0:1"),
        (rows["allreduce.after"], "2/0:1"),
        (rows["allreduce.before"], "2/0:2"),
    ]
    stamps = [e["ts"] for e in events if "ts" in e]
    assert stamps == sorted(stamps)  # (one clock)
    # Another job's opening, or one after someone else wrote the file: afresh.
    monkeypatch.setenv("HVDRUN_JOB_ID", "job-b")
    for opening in ("another job's", "after another writer"):
        again = open_for_job(str(path), False, 0, False, "h", 1)
        assert again is not None
        _op(again, "allreduce.again", "0:1")
        again.close()
        assert list(_rows(_events(path))) == ["negotiation cycles", "allreduce.again"], opening
        other = Timeline(str(path))
        _op(other, "allreduce.other", "0:1")
        other.close()
    # A recording the script starts: afresh, though this process left the file as it is.
    again = open_for_job(str(path), False, 0, False, "h", 1)
    assert again is not None
    again.close()
    recording = open_for_rank(str(path), False, 0)
    assert recording is not None
    recording.close()
    assert list(_rows(_events(path))) == ["negotiation cycles"]


def test_the_job_s_timeline_spans_a_process_s_hvd_init_calls(
    alone: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import collectives.torch as hvd

    path = tmp_path / "t.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    for name in ("first", "second"):
        hvd.init()
        try:
            hvd.allreduce(torch.ones(2), name=name)
        finally:
            hvd.shutdown()
    assert _rows(_events(path)).keys() >= {"allreduce.first", "allreduce.second"}


def test_every_allreduce_holds_how_its_data_was_reduced(hvd: ModuleType, tmp_path: Path) -> None:
    # A loop of small allreduces runs from the response cache's and predicted rounds, whose
    # allreduce carries their data: the op's phase shows it (REDUCE_FROM_NEGOTIATION), as a
    # full negotiation's, instead of an empty QUEUE only.
    path = tmp_path / "t.json"
    hvd.start_timeline(str(path))
    for step in range(30):
        hvd.allreduce(torch.ones(10), name="metric")
        hvd.allreduce(torch.tensor(float(step)), name="step")
    hvd.stop_timeline()
    events = _events(path)
    names = {pid: name for name, pid in _rows(events).items()}
    inside: dict[int, list[set[str]]] = {}  # per row: each ALLREDUCE's inner phases
    for event in events:
        if event["ph"] == "B" and event["name"] == "ALLREDUCE":
            inside.setdefault(event["pid"], []).append(set())
        elif event["ph"] == "B" and event["pid"] in inside:
            inside[event["pid"]][-1].add(event["name"])
    assert {names[pid] for pid in inside} == {"allreduce.metric", "allreduce.step"}
    for pid, phases in inside.items():
        assert len(phases) == 30
        assert all(inner - {"QUEUE"} for inner in phases), (names[pid], phases)


def test_a_timeline_that_cannot_be_written_names_its_file_and_leaves_none(
    tmp_path: Path,
) -> None:
    # (a full disk: a rank said "writes no timeline: No space left on device" naming the
    # path's {rank} template, and left an empty file that is no timeline)
    script = (
        "import resource, sys\n"
        "from collectives.engine.timeline import open_for_rank\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    open_for_rank(sys.argv[1], False, 3)\n"
        "except OSError as error:\n"
        "    print(error.strerror, error.filename)\n"
    )
    template = str(tmp_path / "trace.{rank}.json")
    result = subprocess.run(
        [sys.executable, "-c", script, template],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.stdout == f"File too large {tmp_path}/trace.3.json\n", result
    assert list(tmp_path.iterdir()) == []
