"""A network-namespace cluster of three sshd hosts for the elastic tests (tests/cluster.py),
and the collectives tests' runtime of one process (``hvd``) for test_state.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster import Cluster, cluster_for_tests
from tests.collectives.conftest import alone, hvd

__all__ = ["alone", "elastic_cluster", "hvd"]


@pytest.fixture(scope="session")
def elastic_cluster() -> Iterator[Cluster]:
    """hvd-node1..3, every one running sshd."""
    yield from cluster_for_tests(hosts=3, sshd_hosts=3, tests="elastic cluster tests")
