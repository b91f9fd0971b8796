"""A network-namespace cluster of three sshd hosts for the elastic tests (tests/cluster.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster import Cluster, start_cluster, unavailable_reason


@pytest.fixture(scope="session")
def elastic_cluster() -> Iterator[Cluster]:
    """hvd-node1..3, every one running sshd."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"elastic cluster tests skipped: {reason}")
    try:
        built = start_cluster(hosts=3, sshd_hosts=3)
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        pytest.skip(f"elastic cluster tests skipped: cannot build the test cluster: {detail}")
    try:
        yield built
    finally:
        built.close()
