"""hvdrun inside a batch allocation: the allocation is the default host list, and workers
never see the rank variables of the launcher that started hvdrun."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hvdrun.cli import resolve_hosts
from launcher.spec.hosts import HostSpec
from launcher.spec.schedulers import read_allocation
from tests.cli.conftest import assert_usage_error

REPO = Path(__file__).resolve().parents[2]

SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}


def allocation_hosts(num_proc: int | None) -> tuple[list[HostSpec], int]:
    return resolve_hosts(None, None, num_proc, read_allocation(SLURM))


def test_no_np_takes_every_slot_of_the_allocation() -> None:
    assert allocation_hosts(None) == ([HostSpec("node1", 2), HostSpec("node2", 2)], 4)


@pytest.mark.parametrize(
    ("num_proc", "expected"),
    [
        (1, [HostSpec("node1", 1)]),
        (2, [HostSpec("node1", 2)]),
        (3, [HostSpec("node1", 2), HostSpec("node2", 1)]),
        (4, [HostSpec("node1", 2), HostSpec("node2", 2)]),
    ],
)
def test_np_below_the_slots_fills_hosts_in_order(num_proc: int, expected: list[HostSpec]) -> None:
    assert allocation_hosts(num_proc) == (expected, num_proc)


def test_host_list_wins_over_the_allocation() -> None:
    given = [HostSpec("a", 3)]
    assert resolve_hosts(given, "a:3", None, read_allocation(SLURM)) == (given, 3)


def test_np_above_the_slots_is_an_error_naming_the_allocation_and_the_ways_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert_usage_error(
        ["-np", "9", "true"],
        "invalid '-np': 9 processes requested but the Slurm allocation (job 42) "
        "has only 4 slot(s) on 2 node(s): give the hosts and their slots with -H "
        "(e.g. -H node1:5,node2:5), or ask Slurm for more tasks (e.g. --ntasks-per-node=N)",
        capsys,
    )
    # one node that is not this machine (salloc's shell on a login node): the way out names
    # that node, not this machine, which is no part of the allocation
    monkeypatch.setenv("SLURM_JOB_NODELIST", "elsewhere.invalid")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1")
    assert_usage_error(
        ["-np", "2", "true"],
        "has only 1 slot(s) on 1 node(s): give the hosts and their slots with -H "
        "(-H elsewhere.invalid:2 to run them all on its node), or ask Slurm",
        capsys,
    )


@pytest.mark.parametrize("node", [socket.gethostname(), "localhost"])
def test_np_above_the_slots_of_this_machine_alone_runs_here(
    node: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """sbatch -N1 --gres=gpu:8 has one task slot; horovodrun runs -np 8 as localhost:8."""
    from hvdrun.cli import run_cli

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", node)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1")
    assert run_cli(["--dry-run", "-np", "8", "true"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("hvdrun dry run: 8 worker(s) on 1 host(s)")
    assert f"  {node}  8 worker(s)" in out
    assert (
        f"hvdrun: note: -np 8 is more than the 1 slot(s) of the Slurm allocation (job 42), "
        f"which holds only this machine ({node}): its 8 workers run here" in err
    )
    # (within the slots, no note)
    assert run_cli(["--dry-run", "-np", "1", "true"]) == 0
    assert "more than the" not in capsys.readouterr().err


def test_hvdrun_as_one_of_several_srun_tasks_is_told_each_runs_a_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """srun hvdrun -np 2 ... on 2 nodes (mpirun's habit): two jobs of their own, silently."""
    from hvdrun.cli import run_cli

    note = "hvdrun: note: this hvdrun is one of the 2 tasks of a Slurm step (srun hvdrun ...)"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2")
    for step, tasks, said in (("0", "2", True), ("0", "1", False), ("batch", "2", False)):
        monkeypatch.setenv("SLURM_STEP_ID", step)
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", tasks)
        assert run_cli(["--dry-run", "-np", "2", "true"]) == 0
        assert (note in capsys.readouterr().err) == said, (step, tasks)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        (
            {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-"},
            "cannot use the batch allocation: unbalanced brackets in the node list 'node[1-'",
        ),
        (
            dict(SLURM, SLURM_TASKS_PER_NODE="2(x3)"),
            "SLURM_TASKS_PER_NODE='2(x3)' does not match the 2 node(s)",
        ),
        ({"PBS_NODEFILE": "/nonexistent/nodes"}, "cannot read PBS_NODEFILE=/nonexistent/nodes"),
        ({"LSB_MCPU_HOSTS": "h1 4 h2"}, "LSB_MCPU_HOSTS='h1 4 h2' is not 'host slots"),
    ],
)
def test_malformed_allocation_is_one_line_exit_2(
    variables: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert_usage_error(["true"], message, capsys)
    assert_usage_error(["-np", "2", "true"], message, capsys)


def test_host_list_wins_over_a_malformed_allocation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PBS_NODEFILE", "/nonexistent/nodes")
    # the allocation is never read: the error is about -H, not about PBS_NODEFILE
    assert_usage_error(
        ["-np", "5", "-H", "localhost:4", "true"],
        "5 processes requested but -H localhost:4 has only 4 slot(s)",
        capsys,
    )


def hvdrun(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SLURM", "PBS_", "LSB_", "COBALT_", "PE_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "hvdrun", *argv],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


PROBE = (
    "import os; "
    "print('rank', os.environ['HVDRUN_RANK'], 'of', os.environ['HVDRUN_SIZE'], "
    "'on', os.environ['HVDRUN_HOSTNAME']); "
    "names = ['SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_STEP_ID', 'OMPI_COMM_WORLD_RANK', "
    "'PMIX_RANK', 'MASTER_PORT', 'BASH_FUNC_hvdtest%%', 'SLURM_JOB_ID', 'SLURM_JOB_NAME']; "
    "print(' '.join(n + '=' + os.environ[n] for n in names if n in os.environ))"
)

# What hvdrun itself would see started by srun: task 1 of a 2-task step (so the allocation
# is not hvdrun's to use), and in a login shell that exported a bash function.
LAUNCHED = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "nowhere-node[1-2]",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "OMPI_COMM_WORLD_RANK": "7",
    "PMIX_RANK": "7",
    "MASTER_PORT": "29500",
    "BASH_FUNC_hvdtest%%": "() {  echo hi\n}",
}


def test_workers_never_see_the_rank_variables_of_hvdruns_launcher() -> None:
    result = hvdrun(
        ["-np", "2", "-x", "OMPI_COMM_WORLD_RANK", sys.executable, "-c", PROBE], LAUNCHED
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        # nothing but the job-level Slurm variables, the one given with -x, and hvdrun's own
        # MASTER_PORT (picked on rank 0's host), not the inherited one
        found = re.search(
            rf"^\[{rank}\]<stdout>:OMPI_COMM_WORLD_RANK=7 MASTER_PORT=(\d+) SLURM_JOB_ID=42 "
            r"SLURM_JOB_NAME=train$",
            result.stdout,
            re.M,
        )
        assert found is not None and found.group(1) != "29500", result.stdout
        assert f"[{rank}]<stdout>:rank {rank} of 2 on localhost\n" in result.stdout


def test_a_job_fills_the_allocation_when_no_np_is_given() -> None:
    allocation = {
        "SLURM_JOB_ID": "43",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_TASKS_PER_NODE": "3",
        "SLURM_PROCID": "0",  # a batch script is task 0 of the batch step
        "SLURM_NTASKS": "3",
    }
    # There is no Slurm here to start agents with srun (tests/launcher/test_slurm_launch.py
    # runs that on a real cluster): the one node is this machine, reached without srun.
    result = hvdrun(["--launcher", "ssh", sys.executable, "-c", PROBE], allocation)
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert f"[{rank}]<stdout>:rank {rank} of 3 on localhost\n" in result.stdout
        assert re.search(
            rf"^\[{rank}\]<stdout>:MASTER_PORT=\d+ SLURM_JOB_ID=43$", result.stdout, re.M
        )


def test_an_elastic_job_in_an_allocation_without_hosts_says_it_runs_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """horovodrun's elastic jobs take their hosts from a discovery script or -H, never from
    the batch allocation: one without either would run on the batch node alone, silently."""
    from hvdrun.cli import run_cli

    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert run_cli(["--dry-run", "-np", "4", "--min-np", "2", "true"]) == 0
    err = capsys.readouterr().err
    assert "not from the batch allocation: without either, this one runs on this machine" in err
    assert run_cli(["--dry-run", "-np", "2", "--min-np", "1", "-H", "node1:2", "true"]) == 0
    assert "batch allocation" not in capsys.readouterr().err
