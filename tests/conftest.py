"""The whole suite behaves the same inside a batch job (``sbatch make test``, ``srun pytest``).

hvdrun takes its hosts from the batch allocation it runs in, and hvd.init() joins the job
step it runs in: a test that runs ``hvdrun -np 2`` inside a real allocation would otherwise
start its workers on the allocation's nodes. Tests that want an allocation set one up with
``monkeypatch`` (or pass the variables to the processes they start).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import pytest

from launcher.spec.schedulers import ALLOCATION_VARIABLES
from rendezvous.launchers import is_foreign


def scheduler_variables(environ: Mapping[str, str]) -> list[str]:
    """The names that put a process inside an allocation or a launcher's job."""
    return [name for name in environ if name in ALLOCATION_VARIABLES or is_foreign(name)]


@pytest.fixture(autouse=True, scope="session")
def outside_any_batch_job() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name in scheduler_variables(os.environ):
            patch.delenv(name)
        yield
