"""Elastic jobs on real sshd hosts (network namespaces): failures, growth, shrinking, limits.

Every job runs workers/elastic_steps.py, whose every step lowers one weight by exactly 1 and
commits: after the planned number of steps the weight must be exactly -steps on every rank,
whatever failed or changed on the way (a step lost, or applied twice, would show).
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.cluster import Cluster, ClusterHost, assert_hosts_clean, kill_host, write_hosts
from tests.collectives.conftest import REPO, clean_env

WORKER = Path(__file__).parent / "workers" / "elastic_steps.py"
PY = sys.executable
COMMITTED = re.compile(
    r"^\[\d+\]<stdout>:committed step=(\d+) rank=(\d+) size=(\d+) generation=(\d+)"
)
FINAL = re.compile(r"^\[\d+\]<stdout>:final rank=(\d+) size=(\d+) step=(\d+) weight=(\S+)")


class Job:
    """hvdrun as a subprocess whose output is read line by line, with a trigger on a line:
    on the cluster's hosts, or (``cluster`` None) on this machine's own, with ``env``."""

    def __init__(
        self, cluster: Cluster | None, *args: str, env: dict[str, str] | None = None
    ) -> None:
        if cluster is None:
            argv, environ = [PY, "-m", "hvdrun", *args], {**clean_env(), **(env or {})}
        else:
            argv, environ = cluster.hvdrun_argv(*args), cluster.env(**(env or {}))
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=environ,
        )
        self.lines: list[str] = []
        self._triggers: list[tuple[Callable[[str], bool], Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def when(self, matches: Callable[[str], bool], action: Callable[[], None]) -> None:
        with self._lock:
            self._triggers.append((matches, action))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            with self._lock:
                fired = [t for t in self._triggers if t[0](line)]
                for trigger in fired:
                    self._triggers.remove(trigger)
            for _, action in fired:
                action()

    def wait(self, timeout: float = 150) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            tail = "\n".join(self.lines[-80:])
            message = f"hvdrun still running after {timeout:g} s; last lines:\n{tail}"
            raise AssertionError(message) from None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return code, "\n".join(self.lines)


def committed(output: str) -> list[tuple[int, int, int, int]]:
    """(step, rank, size, generation) of every commit line."""
    return [tuple(map(int, m.groups())) for m in map(COMMITTED.match, output.splitlines()) if m]  # type: ignore[misc]


def finals(output: str) -> dict[int, tuple[int, int, float]]:
    """rank -> (size, steps, weight) of every worker that finished."""
    found = {}
    for match in map(FINAL.match, output.splitlines()):
        if match:
            rank, size, step, weight = match.groups()
            found[int(rank)] = (int(size), int(step), float(weight))
    return found


def after_step(step: int, size: int | None = None) -> Callable[[str], bool]:
    def matches(line: str) -> bool:
        found = COMMITTED.match(line)
        if found is None:
            return False
        return int(found.group(1)) >= step and (size is None or int(found.group(3)) == size)

    return matches


def at_size(size: int, generation: int) -> Callable[[str], bool]:
    """A commit at ``size`` workers in ``generation`` or a later one."""

    def matches(line: str) -> bool:
        found = COMMITTED.match(line)
        return (
            found is not None and int(found.group(3)) == size and int(found.group(4)) >= generation
        )

    return matches


def hosts_file(tmp_path: Path, *hosts: ClusterHost) -> Path:
    path = tmp_path / "hosts.txt"
    write_hosts(path, *hosts)
    return path


def elastic_args(discovery: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--host-discovery-script",
        f"cat {discovery}",
        *extra,
        "-x",
        f"STEPS={steps}",
        "-x",
        "STEP_INTERVAL=0.05",
        PY,
        str(WORKER),
    ]


def check_finished_exactly(output: str, steps: int | None, size: int) -> None:
    """Every final rank ran the same number of steps (``steps`` if given) and its weight is
    exactly minus that."""
    done = finals(output)
    if steps is None:
        steps = done[0][1] if 0 in done else -1
    assert sorted(done) == list(range(size)), output
    for rank_size, rank_steps, weight in done.values():
        assert (rank_size, rank_steps, weight) == (size, steps, -steps), output
    # Horovod's variables name each worker's final place, also after its rank changed; the
    # state's scheduler is the script's own, bound to its optimizer, and counted every step.
    for rank in done:
        assert re.search(
            rf"^\[\d+\]<stdout>:final rank={rank} size={size} .* scheduled={steps} bound=True "
            rf"HOROVOD_RANK={rank} HOROVOD_SIZE={size}$",
            output,
            re.MULTILINE,
        ), output
    # every step committed once, in order, on the final ranks
    last_commits = [c for c in committed(output) if c[2] == size and c[1] == 0]
    assert last_commits and last_commits[-1][0] == steps, output


def check_steps_never_go_back(output: str) -> None:
    """Rank 0's commits go 1, 2, 3, ... and never back to an earlier step (a restart from
    the initial state would), across every generation."""
    steps = [step for step, rank, _, _ in committed(output) if rank == 0]
    assert steps == sorted(steps), f"rank 0 committed {steps}"
    assert steps and steps[0] == 1, f"rank 0 committed {steps}"


def terminate_job_on(cluster: Cluster, host: ClusterHost) -> None:
    """SIGTERM to the job's processes on ``host`` (its agent and workers) at once, not to
    sshd: a ``pkill`` of the job there, a node's clean-up script."""
    for proc in cluster.processes_on(host):
        with contextlib.suppress(psutil.Error):
            if not proc.name().startswith("sshd"):
                proc.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("how", ["killed", "terminated"])
def test_killed_host_training_finishes_on_the_rest(
    elastic_cluster: Cluster, tmp_path: Path, how: str
) -> None:
    node1, node2, node3 = elastic_cluster.hosts
    discovery = hosts_file(tmp_path, node1, node2, node3)
    steps = 50
    job = Job(elastic_cluster, "-np", "3", "--min-np", "2", *elastic_args(discovery, steps))
    if how == "killed":
        job.when(after_step(10), lambda: kill_host(elastic_cluster, node3, sshd=True))
    else:
        job.when(after_step(10), lambda: terminate_job_on(elastic_cluster, node3))
    try:
        code, output = job.wait()
    finally:
        elastic_cluster.stop_sshd(node3)
        elastic_cluster.start_sshd(node3)
    assert code == 0, output
    assert f"host {node3.alias} failed" in output, output
    said = f"host {node3.alias}: its agent received SIGTERM from outside hvdrun; its workers stop"
    assert (said in output) == (how == "terminated"), output
    check_finished_exactly(output, steps, size=2)
    sizes = {c[2] for c in committed(output)}
    assert sizes == {3, 2}, output
    assert_hosts_clean(elastic_cluster, [node1, node2, node3], within=10)


def test_cut_link_training_finishes_on_the_rest(elastic_cluster: Cluster, tmp_path: Path) -> None:
    node1, node2, node3 = elastic_cluster.hosts
    discovery = hosts_file(tmp_path, node1, node2, node3)
    steps = 40
    # The cut-off host's agent and workers give the job up after the heartbeat timeout.
    job = Job(
        elastic_cluster,
        "-np",
        "3",
        "--min-np",
        "2",
        "--heartbeat-timeout",
        "8",
        *elastic_args(discovery, steps),
    )
    job.when(after_step(10), lambda: elastic_cluster.set_link(node3, up=False))
    try:
        code, output = job.wait()
    finally:
        elastic_cluster.set_link(node3, up=True)
    assert code == 0, output
    assert f"host {node3.alias} failed (heard nothing from its agent" in output, output
    check_finished_exactly(output, steps, size=2)
    # cut off, the host's own agent stopped its workers
    assert_hosts_clean(elastic_cluster, [node1, node2, node3], within=15)


def test_rank_0_host_dies_a_new_rank_0_carries_on_and_the_host_comes_back(
    elastic_cluster: Cluster, tmp_path: Path
) -> None:
    node1, node2, node3 = elastic_cluster.hosts
    discovery = hosts_file(tmp_path, node1, node2, node3)
    stop = tmp_path / "stop"
    job = Job(
        elastic_cluster,
        "-np",
        "3",
        "--min-np",
        "2",
        "--blacklist-cooldown-range",
        "1",
        "1",
        "-x",
        f"STOP_FILE={stop}",
        *elastic_args(discovery, 100000),
    )
    job.when(after_step(10), lambda: kill_host(elastic_cluster, node1))
    # run until node1 is back and a step was taken on three hosts again
    job.when(at_size(3, generation=3), stop.touch)
    code, output = job.wait()
    assert code == 0, output
    assert (
        f"host {node1.alias} failed (lost the connection to its agent); blacklisted for 1 s"
        in output
    ), output
    # the survivors keep their order: node2 is the new rank 0
    assert f"generation 2: 2 worker(s) on 2 host(s): {node2.alias}, {node3.alias}" in output
    # after its cooldown node1 is back, as the newest host: the highest rank
    assert (
        f"generation 3: 3 worker(s) on 3 host(s): {node2.alias}, {node3.alias}, {node1.alias}"
        in output
    ), output
    check_finished_exactly(output, None, size=3)
    assert_hosts_clean(elastic_cluster, [node1, node2, node3], within=10)


def test_discovery_grows_then_shrinks_the_job(elastic_cluster: Cluster, tmp_path: Path) -> None:
    node1, node2, node3 = elastic_cluster.hosts
    discovery = hosts_file(tmp_path, node1, node2)
    stop = tmp_path / "stop"
    job = Job(
        elastic_cluster,
        "-np",
        "2",
        "--min-np",
        "2",
        "--max-np",
        "3",
        "-x",
        f"STOP_FILE={stop}",
        *elastic_args(discovery, 100000),
    )
    job.when(after_step(5), lambda: write_hosts(discovery, node1, node2, node3))
    # once the job runs on three, discovery drops the second host: a graceful removal
    job.when(after_step(1, size=3), lambda: write_hosts(discovery, node1, node3))
    # once it has shrunk back to two, the job may end
    job.when(at_size(2, generation=3), stop.touch)
    code, output = job.wait()
    assert code == 0, output
    commits = committed(output)
    generations = [c[3] for c in commits]
    assert generations == sorted(generations), output  # a rank never goes back
    sizes = [size for _, _, size, _ in commits]
    first3, first2 = sizes.index(3), len(sizes) - sizes[::-1].index(2)
    assert 0 < first3 < first2, output  # 2 -> 3 -> 2
    # the new host got the state: it went on from the step the others had reached
    grown = [c for c in commits if c[2] == 3]
    assert min(c[0] for c in grown) > 1, output
    assert f"host {node2.alias} is no longer discovered" in output
    assert " failed (" not in output, output  # no host failed: a graceful removal
    assert f"leaving the elastic job: host '{node2.alias}' is no longer part" in output
    check_finished_exactly(output, None, size=2)
    assert_hosts_clean(elastic_cluster, [node1, node2, node3], within=10)


def test_too_few_slots_for_longer_than_the_elastic_timeout(
    elastic_cluster: Cluster, tmp_path: Path
) -> None:
    node1, node2 = elastic_cluster.hosts[:2]
    discovery = hosts_file(tmp_path, node1, node2)
    job = Job(
        elastic_cluster,
        "-np",
        "2",
        "--min-np",
        "2",
        "--elastic-timeout",
        "2",
        *elastic_args(discovery, 1000),
    )
    job.when(after_step(3), lambda: kill_host(elastic_cluster, node2))
    code, output = job.wait()
    assert code == 1, output
    assert (
        "hvdrun: only 1 slot(s) were available for longer than the elastic timeout (2 s), "
        "fewer than --min-np 2; stopping the job" in output
    ), output
    assert_hosts_clean(elastic_cluster, [node1, node2], within=10)


def test_the_last_holder_of_the_state_dies_and_the_job_stops_instead_of_starting_over(
    elastic_cluster: Cluster, tmp_path: Path
) -> None:
    # node2 joins in generation 2; node1, the only worker that holds the training state,
    # dies before node2's worker got it. Training on from node2's initial state would
    # lose every step taken: the job stops with an error instead.
    node1, node2 = elastic_cluster.hosts[:2]
    discovery = hosts_file(tmp_path, node1)
    job = Job(elastic_cluster, "-np", "1", "--min-np", "1", *elastic_args(discovery, 100000))
    job.when(after_step(5), lambda: write_hosts(discovery, node1, node2))
    job.when(
        lambda line: "generation 2: 2 worker(s)" in line,
        lambda: kill_host(elastic_cluster, node1),
    )
    code, output = job.wait()
    assert code == 1, output
    assert (
        f"hvdrun: the training state is lost: every worker that held it is gone, and the "
        f"workers left ({node2.alias}) never received it" in output
    ), output
    assert "final " not in output, output
    steps = [c[0] for c in committed(output)]
    assert steps == list(range(1, len(steps) + 1)), output  # no step taken twice
    assert_hosts_clean(elastic_cluster, [node1, node2], within=10)


def test_a_stopped_agent_does_not_fail_its_host(elastic_cluster: Cluster, tmp_path: Path) -> None:
    # node2's agent is stopped (SIGSTOP) for longer than the agents' 5 s heartbeat timeout
    # of elastic jobs: its workers still train with the others, so nobody is failed.
    node1, node2 = elastic_cluster.hosts[:2]
    discovery = hosts_file(tmp_path, node1, node2)
    steps = 100
    job = Job(elastic_cluster, "-np", "2", "--min-np", "1", *elastic_args(discovery, steps))

    def stop_agent_for_a_while() -> None:
        agents = [
            proc
            for proc in elastic_cluster.processes_on(node2)
            if "launcher.agent" in " ".join(proc.cmdline())
        ]
        assert agents, "no agent on node2"
        for agent in agents:
            agent.suspend()
        time.sleep(8)
        for agent in agents:
            agent.resume()

    job.when(after_step(10), lambda: threading.Thread(target=stop_agent_for_a_while).start())
    code, output = job.wait()
    assert code == 0, output
    assert f"heard nothing from the agent of {node2.alias} for " in output, output
    assert "but its workers still train with the others; waiting" in output, output
    assert " failed (" not in output, output
    check_finished_exactly(output, steps, size=2)
    assert_hosts_clean(elastic_cluster, [node1, node2], within=10)


def test_hosts_whose_gloo_addresses_drop_packets_are_named_in_an_elastic_job(
    elastic_cluster: Cluster, tmp_path: Path
) -> None:
    """node2's packets to node1 vanish while both reach hvdrun: in an elastic job each host's
    first rank warns within about 15 s which host and address it cannot reach (Gloo alone
    says nothing for minutes) and goes on, leaving the launcher to handle the failed
    generation; stopping hvdrun then leaves nothing running."""
    node1, node2, _ = elastic_cluster.hosts
    discovery = hosts_file(tmp_path, node1, node2)
    elastic_cluster.blackhole(node2, node1, on=True)
    try:
        warned = threading.Event()
        said = f"rank 1 cannot reach host {node1.alias} at {node1.address} (eth0, "
        job = Job(elastic_cluster, "-np", "2", "--min-np", "2", *elastic_args(discovery, 5))
        job.when(lambda line: said in line, warned.set)
        started = time.monotonic()
        seen = warned.wait(60)
        elapsed = time.monotonic() - started
        job.proc.terminate()
        _, output = job.wait(60)
    finally:
        elastic_cluster.blackhole(node2, node1, on=False)
    assert seen, output
    assert elapsed < 45, output
    assert "this elastic job goes on until Gloo gives up" in output, output
    assert_hosts_clean(elastic_cluster, [node1, node2], within=15)


def test_a_host_reached_over_another_network_gives_gloo_the_one_its_peers_share(
    elastic_cluster: Cluster, tmp_path: Path
) -> None:
    """hvdrun reaches node1 over a link of its own that node2 has no route to (a management
    network), and node2 over the network both share: node1's workers give Gloo the shared
    network's interface, the one toward the other hosts of their generation, not the one
    facing hvdrun (before: node2's rank could not connect to node1's and the job stopped
    after the elastic timeout). Gloo's pairs choose by address which side dials: with the
    side link's addresses above the shared network's, node1's rank would dial node2's and
    the job would pass either way, so they sort below."""
    _, node2, node1 = elastic_cluster.hosts
    with elastic_cluster.side_link(node1) as (_, side_address):
        discovery = tmp_path / "hosts"
        discovery.write_text(f"{node2.alias}:1\n{side_address}:1\n")
        key = str(elastic_cluster.client_key)
        args = ["-np", "2", "--min-np", "2", "--elastic-timeout", "20", "-i", key]
        code, output = Job(elastic_cluster, *args, *elastic_args(discovery, 3)).wait(90)
    assert code == 0, output
    assert "cannot reach host" not in output, output
    check_finished_exactly(output, 3, size=2)
