"""hvdrun inside a real Slurm allocation (tests/slurm.py) with sshd stopped on every node.

The agents can only start through srun: the allocation is the host list, ranks land on the
right nodes, exit codes and failures come back, ``scancel`` and Ctrl-C end everything on
every node, workers see no rank variables of the launchers above them, and a plain DDP
script meets at ``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.launcher.reports import placements
from tests.processes import rest_of_output
from tests.slurm import SlurmCluster, slurm_for_tests

SCRIPTS = Path(__file__).parent / "scripts"
EXAMPLES = Path(__file__).parents[2] / "examples"
HVDRUN = [sys.executable, "-m", "hvdrun"]
SALLOC = ("salloc", "-N2", "--ntasks-per-node=2")
#: Slurm's own daemons live on the nodes; anything else left there is the job's.
DAEMONS = ("slurmd", "sshd")


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    for cluster in slurm_for_tests(hosts=2):
        for host in cluster.nodes:
            cluster.hosts.stop_sshd(host)  # no SSH between the nodes: srun or nothing
        yield cluster


@pytest.fixture(autouse=True)
def idle(slurm: SlurmCluster) -> Iterator[None]:
    yield
    slurm.cancel_all()
    slurm.wait_idle()


def left_on_nodes(slurm: SlurmCluster, within: float) -> list[str]:
    """Processes other than Slurm's daemons still on the nodes after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for host in slurm.nodes:
            for proc in slurm.hosts.processes_on(host):
                try:
                    if proc.status() == psutil.STATUS_ZOMBIE or proc.name() in DAEMONS:
                        continue
                    left.append(f"{host.alias}: {proc.pid} {' '.join(proc.cmdline())}")
                except psutil.Error:
                    continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def running_job(slurm: SlurmCluster) -> subprocess.Popen[str]:
    """``salloc ... hvdrun fail_rank.py``, once all 4 workers (and their children) run."""
    proc = subprocess.Popen(
        slurm.argv(*SALLOC, *HVDRUN, sys.executable, str(SCRIPTS / "fail_rank.py")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=slurm.env(),
    )
    assert proc.stdout is not None
    started = 0
    while started < 4:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        started += "pids " in line
    return proc


def test_the_allocation_is_the_host_list_and_srun_places_the_ranks(slurm: SlurmCluster) -> None:
    placement = str(SCRIPTS / "placement.py")
    result = slurm.run(*SALLOC, *HVDRUN, sys.executable, placement)
    assert result.returncode == 0, result.stderr
    found = placements(result.stdout)
    assert sorted(found) == [0, 1, 2, 3]
    node1, node2 = slurm.nodes
    for rank, report in found.items():
        host = node1 if rank < 2 else node2
        assert report["hostname"] == slurm.node_name(host)  # it ran there, through srun
        assert report["address"] == host.address
        assert (report["rank"], report["size"], report["local_rank"]) == (rank, 4, rank % 2)
        assert report["sum"] == 1 + 2 + 3 + 4

    # -np below the slots fills the first node first
    result = slurm.run(*SALLOC, *HVDRUN, "-np", "3", sys.executable, placement)
    assert result.returncode == 0, result.stderr
    hosts = {rank: r["hostname"] for rank, r in placements(result.stdout).items()}
    assert hosts == {0: "hvdh1", 1: "hvdh1", 2: "hvdh2"}

    # above the slots: one line, exit 2, nothing started
    result = slurm.run(*SALLOC, *HVDRUN, "-np", "5", sys.executable, placement)
    assert result.returncode == 2
    assert re.search(
        r"hvdrun: error: .*5 processes requested but the Slurm allocation \(job \d+\) has "
        r"only 4 slot\(s\)",
        result.stderr,
    ), result.stderr


def test_workers_see_no_launcher_variables_and_the_secret_is_in_no_argv(
    slurm: SlurmCluster,
) -> None:
    names = [
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_NTASKS",
        "SLURM_STEP_ID",
        "SLURM_STEP_NODELIST",
        "PMI_RANK",
        "OMPI_COMM_WORLD_RANK",
        "BASH_FUNC_probe%%",
        "SLURM_JOB_ID",
        "HVDRUN_RANK",
    ]
    env = slurm.env(
        PMI_RANK="7", OMPI_COMM_WORLD_RANK="7", **{"BASH_FUNC_probe%%": "() {  echo hi\n}"}
    )
    proc = subprocess.Popen(
        slurm.argv(
            *SALLOC, *HVDRUN, "-x", "STAY=4", sys.executable, str(SCRIPTS / "show_env.py"), *names
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    while not any(line.startswith("[3]<stdout>:secret=") for line in seen):
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        seen.append(line.rstrip("\n"))
    secret = next(line.split("=", 1)[1] for line in seen if "secret=" in line)
    assert len(secret) > 20
    argvs = []
    for other in psutil.process_iter(["cmdline"]):
        argvs.append(" ".join(other.info["cmdline"] or []))
    assert not [argv for argv in argvs if secret in argv]  # srun, agents, workers alike
    out, err = rest_of_output(proc, timeout=60)
    assert proc.returncode == 0, err
    lines = seen + out.splitlines()
    for rank in range(4):
        mine = {
            line.split(":", 1)[1].split("=", 1)[0]: line.split("=", 1)[1]
            for line in lines
            if line.startswith(f"[{rank}]<stdout>:") and "=" in line
        }
        for name in names[:-2]:
            assert mine[name] == "<unset>", (rank, name, mine[name])
        assert mine["SLURM_JOB_ID"].isdigit()  # the job-level ones stay
        assert mine["HVDRUN_RANK"] == str(rank)


def test_a_failing_rank_ends_the_job_with_its_code_and_nothing_is_left(
    slurm: SlurmCluster,
) -> None:
    env = slurm.env(FAIL_RANK="3", FAIL_CODE="3", FAIL_AFTER="1.0")
    result = slurm.run(*SALLOC, *HVDRUN, sys.executable, str(SCRIPTS / "fail_rank.py"), env=env)
    assert result.returncode == 3, result.stderr
    assert "rank 3 gives up" in result.stderr
    assert re.search(r"rank 3 .*hvdh2", result.stderr), result.stderr
    assert left_on_nodes(slurm, within=10) == []


def test_long_output_lines_arrive_whole_through_srun(slurm: SlurmCluster) -> None:
    # srun --label cuts lines at 1024 bytes; a worker's long line (an event of the agent's,
    # longer again when JSON escapes non-ASCII text) was lost, with a warning per piece.
    code = 'print("y" * 3000); print("\\u2588" * 400, flush=True); print("short")'
    result = slurm.run("salloc", "-N1", *HVDRUN, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert "malformed" not in result.stderr, result.stderr[:600]
    lines = [line.removeprefix("[0]<stdout>:") for line in result.stdout.splitlines()]
    assert lines == ["y" * 3000, "\u2588" * 400, "short"], [line[:40] for line in lines]


@pytest.mark.parametrize("what", ["job", "step"])
def test_scancel_ends_hvdrun_and_every_worker_on_every_node(slurm: SlurmCluster, what: str) -> None:
    proc = running_job(slurm)
    (job,) = slurm.jobs()
    cancelled = time.monotonic()
    # The step's SIGKILL (scancel JOB.STEP) leaves the agents no last words: the cancel
    # message alone says what happened, no "lost the connection" per host.
    target = job if what == "job" else f"{job}.0"
    assert slurm.run("scancel", target).returncode == 0
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - cancelled < 10
    assert "the Slurm job step running hvdrun's agents was cancelled" in err, err
    assert "not reported" not in err, err
    # salloc passes hvdrun's own exit code on: 128 + SIGTERM, as for a scancel'd srun
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert left_on_nodes(slurm, within=10) == []


def test_a_cancelled_batch_job_is_not_blamed_on_a_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    # scancel -b -s TERM ends the batch shell, and with it the job: Slurm signals every
    # step, the agents and their workers at once, and a worker's exit used to reach hvdrun
    # first ("rank 2 on host hvdh2 failed first: killed by SIGTERM").
    script = tmp_path / "job.sh"
    code = "import time; print('up', flush=True); time.sleep(120)"
    script.write_text(f'#!/bin/sh\n{" ".join(HVDRUN)} {sys.executable} -c "{code}"\n')
    log = tmp_path / "job.log"
    submitted = slurm.run(
        "sbatch", "--parsable", "-o", str(log), *SALLOC[1:], str(script), cwd=tmp_path
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().count("<stdout>:up") == 4):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no output"
        time.sleep(0.2)
    assert slurm.run("scancel", "-b", "-s", "TERM", job).returncode == 0
    slurm.wait_idle(within=60)
    output = log.read_text()
    assert "received SIGTERM from outside hvdrun" in output, output
    assert "failed first" not in output and "Horovod detected" not in output, output
    assert left_on_nodes(slurm, within=10) == []


def test_ctrl_c_on_hvdrun_cancels_its_step(slurm: SlurmCluster) -> None:
    proc = running_job(slurm)
    hvdrun = next(
        child
        for child in psutil.Process(proc.pid).children(recursive=True)
        if child.cmdline()[1:3] == ["-m", "hvdrun"]
    )
    hvdrun.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "received SIGINT; stopping all workers" in err, err
    assert proc.returncode == 130, err
    assert left_on_nodes(slurm, within=10) == []


def test_hvdrun_in_an_sbatch_script_and_a_plain_ddp_script(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/sh\n{' '.join(HVDRUN)} {sys.executable} {EXAMPLES / 'pytorch_ddp.py'} --epochs 1\n"
    )
    code, output = slurm.sbatch(str(script), options=["-N2", "--ntasks-per-node=1"], cwd=tmp_path)
    assert code == 0, output
    assert "[0]<stdout>:ddp: 2 ranks, test accuracy" in output
    assert "[1]<stdout>:ddp rank 1: weights equal rank 0's: True" in output


def test_check_hosts_inside_the_allocation_goes_through_srun(slurm: SlurmCluster) -> None:
    result = slurm.run(*SALLOC, *HVDRUN, "--check-hosts")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[:2] for row in rows if row and row[0].startswith("hvdh")] == [
        ["hvdh1", "ok"],
        ["hvdh2", "ok"],
    ], result.stdout


def test_the_hvdrun_sbatch_example(slurm: SlurmCluster) -> None:
    """examples/hvdrun_digits.sbatch as a user submits it: from the repository, with this
    installation first on PATH, and no SSH between the nodes."""
    repo = EXAMPLES.parent
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    code, output = slurm.sbatch(
        "examples/hvdrun_digits.sbatch", "--epochs", "1", env=slurm.env(PATH=path), cwd=repo
    )
    assert code == 0, output
    assert "trained on 4 process(es)" in output, output
