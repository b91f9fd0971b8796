"""What one job runs: the command, how many workers, on which hosts, with which environment.

The CLI builds a :class:`JobSpec` from the user's flags; the launcher only reads it. A spec
with ``elastic`` set describes an elastic job (see :mod:`launcher.supervision.elastic`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from launcher.spec.hosts import HostSpec
from launcher.spec.options import ElasticOptions, LaunchOptions, ReportOptions

#: A Python interpreter's name: python, python3, python3.11 (not python_job.sh).
_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?")


def is_python(program: str) -> bool:
    """Whether the command's ``program`` is a Python interpreter (by its name)."""
    return _PYTHON_NAME.fullmatch(os.path.basename(program)) is not None


@dataclass
class JobSpec:
    command: list[str]
    num_proc: int
    hosts: list[HostSpec]
    env: dict[str, str]  # already without host-specific variables (launcher.spec.environment)
    cwd: str
    term_grace: float = 5.0  # seconds between SIGTERM and SIGKILL when workers are stopped
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    elastic: ElasticOptions | None = None  # set: an elastic job
    report: ReportOptions = field(default_factory=ReportOptions)  # the end-of-job report
    # Rendezvous store entries the workers find from the start (hvdrun.run's function), and
    # the prefix of those they leave that the result keeps (JobResult.collected)
    preset: dict[str, bytes] = field(default_factory=dict, repr=False)
    collect: str | None = None
