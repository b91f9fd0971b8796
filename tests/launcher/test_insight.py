"""hvdrun's side of the job insight: the live watch on the supervision loop, and the
end-of-job table and report file (``--no-report``, ``--report-file``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from launcher.output import OutputOptions, OutputSink
from launcher.spec.options import ReportOptions
from launcher.supervision.insight import InsightWatch, report_insight
from rendezvous.insight import RankFigures
from rendezvous.worker_env import INSIGHT_KEY_PREFIX


def _sink() -> tuple[OutputSink, io.BytesIO]:
    err = io.BytesIO()
    return OutputSink(io.BytesIO(), err, options=OutputOptions(status_line=True)), err


def _figures(caused: float) -> dict[str, RankFigures]:
    """Rank 1 made rank 0 wait ``caused`` seconds so far, last in 20 collectives a second."""
    last = int(20 * caused)
    return {
        "0": RankFigures(rank=0, host="a", elapsed_s=10.0, waited_s=caused, held_rounds=last + 1),
        "1": RankFigures(rank=1, host="b", elapsed_s=10.0, wait_caused_s=caused, times_last=last,
                         held_rounds=last + 1),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("report", "details"),
    [
        (ReportOptions(), " (the end-of-job table has the details)"),
        (ReportOptions(table=False, file="r.json"), " (r.json will have the details)"),
        (ReportOptions(table=False), ""),  # (--no-report: no table to point at)
    ],
)
def test_the_watch_warns_once_and_keeps_the_status_line_while_a_rank_holds_the_job_back(
    report: ReportOptions, details: str
) -> None:
    sink, err = _sink()
    reads: list[str] = []
    values = {"0.0": 0.0, "1.0": 0.5, "2.0": 1.5, "3.0": 2.5}
    now = [0.0]

    def read(prefix: str) -> dict[str, bytes]:
        reads.append(prefix)
        figures = _figures(values[f"{now[0]:.1f}"])
        return {INSIGHT_KEY_PREFIX + key: value.to_json() for key, value in figures.items()}

    watch = InsightWatch(read, sink, report)
    for moment in (0.0, 0.5, 1.0, 2.0, 3.0):  # (looks once a second)
        now[0] = moment if moment != 0.5 else 0.0
        watch.step(moment)
    assert reads == [INSIGHT_KEY_PREFIX] * 4
    text = err.getvalue().decode()
    assert text.count("hvdrun: rank 1 on b is holding the job back") == 1, text
    warning = next(line for line in text.splitlines() if "is holding the job back" in line)
    assert warning.endswith("collectives, last at 100% of them" + details), warning
    assert "hvdrun: rank 1 on b holds the others back" in text  # the status line
    watch.stop()
    assert err.getvalue().endswith(b"\r\x1b[K")  # (the status line is cleared)


def test_a_watch_that_cannot_read_does_not_disturb_the_job() -> None:
    sink, err = _sink()

    def read(prefix: str) -> dict[str, bytes]:
        raise RuntimeError("the server is gone")

    InsightWatch(read, sink).step(5.0)
    assert err.getvalue() == b""


def test_the_table_and_the_report_file(tmp_path: Path) -> None:
    sink, err = _sink()
    path = tmp_path / "report.json"
    report_insight(_figures(4.0), 2, sink, ReportOptions(table=True, file=str(path)))
    text = err.getvalue().decode()
    assert "hvdrun:   RANK  HOST  IN COLLECTIVES" in text
    assert "hvdrun: rank 1 on b held the job back" in text
    assert json.loads(path.read_text())["straggler"]["rank"] == 1
    # --no-report: the file only; no figures at all: nothing, and no file.
    sink, err = _sink()
    report_insight(_figures(4.0), 2, sink, ReportOptions(table=False, file=str(path)))
    assert err.getvalue() == b""
    path.unlink()
    report_insight({}, 2, sink, ReportOptions(file=str(path)))
    said = err.getvalue().decode()
    assert "no worker published figures (a worker publishes them about once a second after its " \
        f"hvd.init(), and as it shuts down): {path} not written" in said  # fmt: skip
    assert not path.exists()
    report_insight(_figures(4.0), 2, sink, ReportOptions(file=str(tmp_path / "no" / "x.json")))
    assert "cannot write the report file" in err.getvalue().decode()
