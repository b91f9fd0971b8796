"""hvdrun.run(fn, ...) in elastic jobs on real SSH hosts (tests/cluster.py): a host whose
worker fails leaves the job, and what ``run`` returns or raises is the survivors' own.

Each test runs a driver script that calls ``hvdrun.run`` as a user's script would, through
``cluster.python_argv`` (DNS pointed at loopback), and prints what ``run`` gave back.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.cluster import Cluster, assert_hosts_clean

DRIVER = """
import json, os, socket, sys
import hvdrun

def train(victim, how):
    import torch
    import collectives.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < 4:
            hvd.allreduce(torch.ones(1))
            state.epoch += 1
            state.commit()
            if state.epoch == 2 and socket.gethostname() in victim:
                if how == "exit":
                    os._exit(1)
                raise ValueError("shard 7 is corrupt")
        return [hvd.rank(), hvd.size(), state.epoch, socket.gethostname()]

    placed = loop(state)
    hvd.shutdown()  # (a script's last line: the rank it had stays its place)
    return placed

victim, how, hosts = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
try:
    results = hvdrun.run(train, args=(victim, how), num_proc=2, min_num_proc=1, hosts=hosts)
    print("RESULTS", json.dumps(results))
except hvdrun.JobFailed as failed:
    print("FAILED", json.dumps([str(failed), failed.rank, failed.error_type, failed.error]))
"""


def run_driver(cluster: Cluster, tmp_path: Path, victims: list[str], how: str) -> tuple[str, Any]:
    node1, node2 = cluster.hosts[:2]
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    hosts = f"{node1.alias}:1,{node2.alias}:1"
    result = subprocess.run(
        cluster.python_argv(str(script), ",".join(victims), how, hosts),
        capture_output=True,
        text=True,
        timeout=120,
        env=cluster.env(),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    line = next(
        line for line in result.stdout.splitlines() if line.startswith(("RESULTS ", "FAILED "))
    )
    assert_hosts_clean(cluster, [node1, node2], within=10)
    kind, _, value = line.partition(" ")
    return kind, json.loads(value)


def test_an_elastic_call_returns_the_survivors_ranks_after_a_host_failed(
    cluster: Cluster, tmp_path: Path
) -> None:
    """rank 0's host fails; the survivor becomes rank 0 of one, and its result is placed by
    that rank even though its function shut hvd down before returning."""
    node1, node2 = cluster.hosts[:2]
    kind, value = run_driver(cluster, tmp_path, [node1.uts_hostname], "exit")
    assert (kind, value) == ("RESULTS", [[0, 1, 4, node2.uts_hostname]])


def test_an_elastic_call_whose_ranks_raised_names_the_exception(
    cluster: Cluster, tmp_path: Path
) -> None:
    node1, node2 = cluster.hosts[:2]
    victims = [node1.uts_hostname, node2.uts_hostname]
    kind, value = run_driver(cluster, tmp_path, victims, "raise")
    assert kind == "FAILED"
    message, rank, error_type, error = value
    assert message.startswith("hvdrun.run: the elastic job failed: rank "), message
    assert message.endswith(" raised ValueError: shard 7 is corrupt"), message
    assert rank in (0, 1)
    assert (error_type, error) == ("ValueError", "shard 7 is corrupt")
