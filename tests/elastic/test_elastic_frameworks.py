"""Elastic Keras on real sshd hosts: a ``model.fit`` under ``hvd.elastic.run`` survives a
killed host and finishes on the others with every epoch applied exactly once
(workers/keras_elastic_steps.py). Skipped where Keras or TensorFlow is not installed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster import Cluster, assert_hosts_clean, kill_host
from tests.elastic.test_elastic_jobs import PY, Job, hosts_file

pytest.importorskip("tensorflow", reason="TensorFlow not installed (pip install -e '.[keras]')")
pytest.importorskip("keras", reason="Keras not installed (pip install -e '.[keras]')")

WORKER = Path(__file__).parent / "workers" / "keras_elastic_steps.py"
COMMITTED = re.compile(r"^\[\d+\]<stdout>:committed epoch=(\d+) rank=(\d+) size=(\d+) ")
FINAL = re.compile(
    r"^\[\d+\]<stdout>:final rank=(\d+) size=(\d+) epoch=(\d+) weight=(\S+) resets=(\S+)"
)


def test_a_keras_fit_survives_a_killed_host(elastic_cluster: Cluster, tmp_path: Path) -> None:
    node1, node2, node3 = elastic_cluster.hosts
    discovery = hosts_file(tmp_path, node1, node2, node3)
    epochs, steps = 6, 10
    job = Job(
        elastic_cluster,
        "-np",
        "3",
        "--min-np",
        "2",
        "--host-discovery-script",
        f"cat {discovery}",
        "-x",
        "KERAS_BACKEND=tensorflow",
        "-x",
        f"EPOCHS={epochs}",
        "-x",
        f"STEPS={steps}",
        PY,
        str(WORKER),
    )

    def after_epoch_2(line: str) -> bool:
        found = COMMITTED.match(line)
        return found is not None and int(found.group(1)) >= 2

    job.when(after_epoch_2, lambda: kill_host(elastic_cluster, node3, sshd=True))
    try:
        code, output = job.wait(timeout=240)
    finally:
        elastic_cluster.stop_sshd(node3)
        elastic_cluster.start_sshd(node3)
    assert code == 0, output
    assert f"host {node3.alias} failed" in output, output
    finals = {int(m.group(1)): m.groups()[1:] for m in map(FINAL.match, output.splitlines()) if m}
    # both survivors finish every epoch, each step applied once: the weight is exact
    assert sorted(finals) == [0, 1], output
    for size, epoch, weight, _ in finals.values():
        assert (size, epoch, float(weight)) == ("2", str(epochs), -epochs * steps), output
    # The state's reset() hook, then the reset callbacks, once, at the new size.
    assert all(resets == "reset:2,callback:2" for *_, resets in finals.values()), output
    sizes = {int(m.group(3)) for m in map(COMMITTED.match, output.splitlines()) if m}
    assert sizes == {3, 2}, output
    assert_hosts_clean(elastic_cluster, [node1, node2, node3], within=10)
