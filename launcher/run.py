"""``run_job``: the one entry point that runs a job, fixed or elastic.

A spec with ``elastic`` set goes to the elastic driver (:mod:`launcher.supervision.elastic`),
any other to the fixed supervisor (:mod:`launcher.supervision.fixed`). The choice lives here,
in a module neither of them imports, so that the two never import each other.
"""

from __future__ import annotations

from launcher.output import OutputSink
from launcher.spec.job import JobSpec
from launcher.supervision.core import JobResult
from launcher.supervision.elastic import run_elastic_job
from launcher.supervision.fixed import run_fixed_job


def run_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    """Starts and supervises the job; raises LaunchError when a host cannot be started."""
    if spec.elastic is not None:
        return run_elastic_job(spec, sink)
    return run_fixed_job(spec, sink)
