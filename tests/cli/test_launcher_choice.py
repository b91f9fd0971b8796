"""``--launcher``: which transport starts the agents, and the mistakes it names."""

from __future__ import annotations

import pytest

from hvdrun.cli import choose_launcher
from launcher.spec.hosts import HostSpec
from launcher.transport.srun import expand_tasks, srun_argv
from tests.cli.conftest import assert_usage_error

SLURM = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
NODES = [HostSpec("node1", 2), HostSpec("node2", 2)]


def in_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)


def test_auto_takes_srun_when_every_host_is_a_node_of_the_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert choose_launcher("auto", NODES, elastic=False) == "ssh"  # no allocation: SSH
    in_allocation(monkeypatch)
    assert choose_launcher("auto", NODES, elastic=False) == "slurm"
    assert choose_launcher("auto", [HostSpec("node2", 1)], elastic=False) == "slurm"
    # a host outside the allocation, an elastic job, or an explicit choice: SSH
    assert choose_launcher("auto", [*NODES, HostSpec("login", 1)], elastic=False) == "ssh"
    assert choose_launcher("auto", NODES, elastic=True) == "ssh"
    assert choose_launcher("ssh", NODES, elastic=False) == "ssh"
    # inside a job step (srun hvdrun ...) srun cannot start another step for the agents
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert choose_launcher("auto", NODES, elastic=False) == "ssh"


def test_launcher_mistakes_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(
        ["--launcher", "slurm", "-np", "1", "true"], "run hvdrun inside salloc", capsys
    )
    assert_usage_error(
        ["--launcher", "local", "-H", "node7:1", "true"],
        "'local' starts workers on this machine only, but the hosts include node7",
        capsys,
    )
    assert_usage_error(["--launcher", "pbs", "true"], "'pbs' is not one of", capsys)
    in_allocation(monkeypatch)
    assert_usage_error(
        ["--launcher", "slurm", "-H", "node1:1,other:1", "true"],
        "srun starts agents on the allocation's nodes (node1,node2) only, not on other",
        capsys,
    )
    assert_usage_error(
        ["--launcher", "slurm", "--min-np", "1", "-H", "node1:1", "true"],
        "elastic jobs start their agents over SSH",
        capsys,
    )


def test_the_srun_command_keeps_every_agent_on_its_own_node_and_nothing_secret() -> None:
    argv = srun_argv("/usr/bin/srun", ["node1", "node2"], "/venv/bin/python")
    assert argv[0] == "/usr/bin/srun"
    for flag in ("--overlap", "--input=all", "--label", "--ntasks-per-node=1", "--cpu-bind=none"):
        assert flag in argv
    assert "--nodelist=node1,node2" in argv and "--ntasks=2" in argv
    assert argv[-4:] == ["/venv/bin/python", "-m", "launcher.agent", "--shared-stdin"]
    assert not [a for a in argv if "SECRET" in a.upper()]


def test_srun_task_lists() -> None:
    assert expand_tasks("3") == [3]
    assert expand_tasks("0-2") == [0, 1, 2]
    assert expand_tasks("0,2-3") == [0, 2, 3]


def test_dry_run_inside_an_allocation_shows_the_srun_plan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hvdrun.cli import run_cli

    in_allocation(monkeypatch)
    assert run_cli(["--dry-run", "-np", "3", "python", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "node1" in out and "node2" in out
    assert "srun (one task of hvdrun's job step in the Slurm allocation, no SSH)" in out
    assert run_cli(["--dry-run", "--launcher", "ssh", "-np", "3", "python", "train.py"]) == 0
    assert "srun (one task" not in capsys.readouterr().out
