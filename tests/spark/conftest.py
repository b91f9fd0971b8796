"""One standalone Spark cluster for all of tests/spark (master here, a worker on each of two
namespace hosts) and one driver session on it, stopped after the package's last test: JVMs
start slowly on two cores, and must not idle through the rest of the suite."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.spark_cluster import SparkCluster, spark_cluster_for_tests


@pytest.fixture(scope="package")
def spark_cluster() -> Iterator[SparkCluster]:
    yield from spark_cluster_for_tests(hosts=2)


@pytest.fixture(scope="package")
def spark(spark_cluster: SparkCluster) -> Iterator[Any]:
    """The tests' SparkSession, with one executor on each host."""
    session = spark_cluster.session("hvdrun-tests")
    spark_cluster.wait_for_executors(session.sparkContext, 2)
    try:
        yield session
    finally:
        spark_cluster.stop_driver()
