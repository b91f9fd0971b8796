"""A Spark driver of its own for tests/spark/test_driver.py: ``python -m
tests.spark.driver_process MASTER_URL DRIVER_HOST PID_DIR``.

It runs two jobs of :func:`tests.spark.test_run.train_until_stopped`: the test interrupts
the first (SIGINT, as Ctrl-C does), and kills this process (SIGKILL) during the second.
"""

from __future__ import annotations

import io
import os
import sys

from tests.spark.test_run import train_until_stopped
from tests.spark_cluster import make_session


def main() -> None:
    master_url, driver_host, pid_dir = sys.argv[1:4]
    session = make_session(master_url, driver_host, 2, "hvdrun-driver-test", {})
    print(f"driver jvm {session.sparkContext._gateway.proc.pid}", flush=True)
    import collectives.spark as hvd_spark

    for job in ("1", "2"):
        os.makedirs(os.path.join(pid_dir, job))
        try:
            hvd_spark.run(
                train_until_stopped, args=(os.path.join(pid_dir, job),), stderr=io.StringIO()
            )
        except KeyboardInterrupt:
            print(f"job {job} interrupted", flush=True)


if __name__ == "__main__":
    main()
