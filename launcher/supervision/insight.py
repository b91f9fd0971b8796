"""Which rank holds the job back: hvdrun's live watch and its end-of-job table.

The workers publish their arrival figures in the rendezvous store every second or so while
their collectives run, and at shutdown (:mod:`rendezvous.insight` has the format and the
analysis). A supervisor (fixed or elastic) holds an :class:`InsightWatch` that reads them
from its server about once a second: a rank that makes the others wait for longer than a
threshold within a window shows in the status line while it does, and in one warning line
(again at most every few minutes). When the job ends, the supervisor keeps the figures in
its :class:`~launcher.supervision.core.JobResult`, and :func:`report_insight` prints the
table (unless ``--no-report``) and writes ``--report-file``, after failed jobs too, for the
ranks that reported.

The watch runs on the supervision loop's thread; it owns all its fields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from launcher.output import OutputSink
from launcher.spec.options import ReportOptions
from rendezvous import worker_env
from rendezvous.insight import LiveWatch, RankFigures, analyse, decode_all

__all__ = ["InsightWatch", "report_insight"]

log = logging.getLogger(__name__)

#: How often the watch reads the figures.
POLL_SECONDS = 1.0


class InsightWatch:
    """Reads the workers' figures from the rendezvous (``read``: the store's values under a
    prefix) and says when one rank holds the others back."""

    def __init__(
        self,
        read: Callable[[str], Mapping[str, bytes]],
        sink: OutputSink,
        report: ReportOptions | None = None,
    ) -> None:
        self._read = read
        self._sink = sink
        self._live = LiveWatch((report or ReportOptions()).details)
        self._next = 0.0
        self._status: str | None = None

    def figures(self) -> dict[str, RankFigures]:
        return decode_all(self._read(worker_env.INSIGHT_KEY_PREFIX))

    def step(self, now: float) -> None:
        """Called every loop step; looks at the figures once per :data:`POLL_SECONDS`."""
        if now < self._next:
            return
        self._next = now + POLL_SECONDS
        try:
            figures = self.figures()
        except Exception as error:  # (a bonus: it never disturbs the supervision)
            log.debug("could not read the workers' figures: %s", error)
            return
        if not figures:
            return
        news = self._live.update(now, figures)
        if news.warning:
            self._sink.message(news.warning)
        if news.status != self._status:
            self._status = news.status
            self._sink.status(news.status)

    def stop(self) -> None:
        """The job is stopping: the status line is no longer this watch's."""
        if self._status is not None:
            self._status = None
            self._sink.status(None)


def report_insight(
    figures: Mapping[str, RankFigures], size: int | None, sink: OutputSink, options: ReportOptions
) -> None:
    """The end-of-job table (unless turned off) and the report file, for the ranks that
    reported figures (none: nothing to say, no file)."""
    if not figures:
        if options.file:
            sink.message(
                "no worker published figures (a worker publishes them about once a second "
                f"after its hvd.init(), and as it shuts down): {options.file} not written"
            )
        return
    result = analyse(figures.values(), size)
    if options.table:
        for line in result.table(at_end=True):
            sink.message(line)
    if options.file:
        try:
            result.write(options.file)
        except OSError as error:
            sink.message(f"cannot write the report file {options.file}: {error.strerror or error}")
