"""``run_job``: the one entry point that runs a job, fixed or elastic.

A spec with ``elastic`` set goes to the elastic driver (:mod:`launcher.supervision.elastic`),
any other to the fixed supervisor (:mod:`launcher.supervision.fixed`). The choice lives here,
in a module neither of them imports, so that the two never import each other. Both end the
same way: the table of where the ranks' time went (:mod:`launcher.supervision.insight`),
then, for a failed job, who failed first and why (:mod:`launcher.supervision.report`).
"""

from __future__ import annotations

from launcher.output import OutputSink
from launcher.spec.job import JobSpec
from launcher.supervision.core import JobResult
from launcher.supervision.elastic import run_elastic_job
from launcher.supervision.fixed import run_fixed_job
from launcher.supervision.insight import report_insight
from launcher.supervision.report import report_failure


def run_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    """Starts and supervises the job; raises LaunchError when a host cannot be started.
    Afterwards, where workers reported their figures, the end-of-job table (``spec.report``),
    then the failure, if any (last, where a user looks first)."""
    elastic = spec.elastic is not None
    result = run_elastic_job(spec, sink) if elastic else run_fixed_job(spec, sink)
    # (an elastic job's sizes change: its figures say which ranks there were)
    size = None if elastic else spec.num_proc
    report_insight(result.figures, size, sink, spec.report)
    # (last: who failed and why ends hvdrun's output, where a user looks first)
    report_failure(result, sink, spec.command, elastic=elastic)
    return result
