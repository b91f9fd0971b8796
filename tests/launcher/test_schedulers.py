"""The batch allocation as the default host list (launcher.spec.schedulers): every
scheduler's format, read from sample files the tests write, and the errors for bad ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.errors import LauncherError
from launcher.spec.hosts import HostSpec
from launcher.spec.schedulers import (
    Allocation,
    AllocationError,
    parse_mcpu_hosts,
    parse_node_lines,
    parse_pe_hostfile,
    read_allocation,
)

# An `salloc -N4 --ntasks-per-node=...` shell: compressed node list and task counts.
SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "node[01-02,07],gpu-a1",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
}


def hosts(*entries: tuple[str, int]) -> list[HostSpec]:
    return [HostSpec(name, slots) for name, slots in entries]


def test_outside_any_scheduler_there_is_no_allocation() -> None:
    assert read_allocation({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_slurm_expands_the_node_list_and_task_counts() -> None:
    allocation = read_allocation(SLURM)
    assert allocation is not None
    assert allocation.scheduler == "slurm"
    assert allocation.hosts == hosts(("node01", 2), ("node02", 2), ("node07", 2), ("gpu-a1", 1))
    assert allocation.slots == 7
    assert allocation.source == "the Slurm allocation (job 42)"
    assert allocation.job_id == "42"


def test_slurm_batch_script_uses_the_allocation() -> None:
    # sbatch's script runs as task 0 of the batch step, with the job's task count.
    batch = dict(SLURM, SLURM_PROCID="0", SLURM_NTASKS="7", SLURM_NODEID="0")
    assert read_allocation(batch) == read_allocation(SLURM)


@pytest.mark.parametrize("step", ["batch", "4294967291", "interactive", "4294967290", "extern"])
def test_slurm_special_steps_are_not_job_steps(step: str) -> None:
    allocation = read_allocation(dict(SLURM, SLURM_STEP_ID=step, SLURM_PROCID="0"))
    assert allocation is not None and allocation.slots == 7


@pytest.mark.parametrize("variable", ["SLURM_STEP_ID", "SLURM_STEPID"])
def test_slurm_task_of_a_job_step_does_not_own_the_allocation(variable: str) -> None:
    assert read_allocation(dict(SLURM, **{variable: "0", "SLURM_PROCID": "3"})) is None


def test_slurm_without_task_counts_gives_one_slot_per_node() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[8-10]"}
    allocation = read_allocation(env)
    assert allocation is not None
    assert allocation.hosts == hosts(("n8", 1), ("n9", 1), ("n10", 1))


def test_slurm_needs_both_the_job_and_its_nodes() -> None:
    assert read_allocation({"SLURM_JOB_ID": "7"}) is None
    assert read_allocation({"SLURM_JOB_NODELIST": "n1"}) is None


def test_slurm_old_variable_names() -> None:
    allocation = read_allocation({"SLURM_JOBID": "9", "SLURM_NODELIST": "a,b"})
    assert allocation is not None and allocation.hosts == hosts(("a", 1), ("b", 1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_JOB_NODELIST": "node[01-"}, "node list"),
        ({"SLURM_JOB_NODELIST": "node[3-1]"}, "reversed"),
        ({"SLURM_TASKS_PER_NODE": "2(y3)"}, "2(y3)"),
        ({"SLURM_TASKS_PER_NODE": "2(x2)"}, "does not match the 4 node(s)"),
        ({"SLURM_TASKS_PER_NODE": "0(x4)"}, "at least 1"),
    ],
)
def test_slurm_malformed_variables_are_one_line_errors(
    change: dict[str, str], message: str
) -> None:
    with pytest.raises(AllocationError) as caught:
        read_allocation(dict(SLURM, **change))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, LauncherError)


def test_pbs_nodefile_has_one_line_per_slot(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn3.cluster\ncn3.cluster\ncn1.cluster\n\ncn3.cluster\ncn1.cluster\n")
    allocation = read_allocation({"PBS_NODEFILE": str(nodefile), "PBS_JOBID": "123.pbs"})
    assert allocation is not None
    assert allocation.scheduler == "pbs"
    # file order, repeated hosts merged with their slots summed
    assert allocation.hosts == hosts(("cn3.cluster", 3), ("cn1.cluster", 2))
    assert allocation.source == "the PBS allocation (job 123.pbs)"


def test_lsf_host_file_and_mcpu_hosts(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1\nh1\nh2\nh2\n")
    from_file = read_allocation(
        {"LSB_DJOB_HOSTFILE": str(hostfile), "LSB_MCPU_HOSTS": "x 9", "LSB_JOBID": "55"}
    )
    assert from_file is not None and from_file.scheduler == "lsf"
    assert from_file.hosts == hosts(("h1", 2), ("h2", 2))
    assert from_file.source == "the LSF allocation (job 55)"
    from_variable = read_allocation({"LSB_MCPU_HOSTS": "h1 4 h2 3 h1 1"})
    assert from_variable is not None
    assert from_variable.hosts == hosts(("h1", 5), ("h2", 3))
    assert from_variable.source == "the LSF allocation"


def test_cobalt_nodefile_gives_one_slot_per_node(tmp_path: Path) -> None:
    nodefile = tmp_path / "cobalt"
    nodefile.write_text("thetagpu01\nthetagpu02\n")
    allocation = read_allocation({"COBALT_NODEFILE": str(nodefile), "COBALT_JOBID": "8"})
    assert allocation is not None and allocation.scheduler == "cobalt"
    assert allocation.hosts == hosts(("thetagpu01", 1), ("thetagpu02", 1))


def test_sge_pe_hostfile(tmp_path: Path) -> None:
    pe = tmp_path / "pe_hostfile"
    pe.write_text(
        "node2.local 4 all.q@node2.local UNDEFINED\nnode1.local 2 all.q@node1.local <NULL>\n"
    )
    allocation = read_allocation({"PE_HOSTFILE": str(pe), "JOB_ID": "77"})
    assert allocation is not None and allocation.scheduler == "sge"
    assert allocation.hosts == hosts(("node2.local", 4), ("node1.local", 2))
    assert allocation.source == "the SGE allocation (job 77)"


def test_slurm_wins_over_a_host_file_left_in_the_environment(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("other\n")
    allocation = read_allocation(dict(SLURM, PBS_NODEFILE=str(nodefile)))
    assert allocation is not None and allocation.scheduler == "slurm"


@pytest.mark.parametrize(
    ("variable", "content", "message"),
    [
        ("PBS_NODEFILE", "", "PBS_NODEFILE lists no hosts"),
        ("PBS_NODEFILE", "a\nb c\n", "PBS_NODEFILE line 2: expected one host name, got 'b c'"),
        ("PBS_NODEFILE", "-oProxyCommand=x\n", "starts with '-'"),
        ("COBALT_NODEFILE", "\n\n", "COBALT_NODEFILE lists no hosts"),
        ("LSB_DJOB_HOSTFILE", "h1 h2\n", "LSB_DJOB_HOSTFILE line 1"),
        ("PE_HOSTFILE", "node1\n", "PE_HOSTFILE line 1: expected 'host slots queue processors'"),
        ("PE_HOSTFILE", "node1 four q p\n", "slot count 'four' is not a number"),
        ("PE_HOSTFILE", "node1 0 q p\n", "slot count must be at least 1, got 0"),
    ],
)
def test_malformed_host_files(tmp_path: Path, variable: str, content: str, message: str) -> None:
    path = tmp_path / "file"
    path.write_text(content)
    with pytest.raises(AllocationError) as caught:
        read_allocation({variable: str(path)})
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "variable", ["PBS_NODEFILE", "LSB_DJOB_HOSTFILE", "COBALT_NODEFILE", "PE_HOSTFILE"]
)
def test_a_missing_host_file_names_the_variable(tmp_path: Path, variable: str) -> None:
    missing = tmp_path / "gone"
    with pytest.raises(AllocationError, match=f"cannot read {variable}={missing}: No such file"):
        read_allocation({variable: str(missing)})


@pytest.mark.parametrize("text", ["h1", "h1 4 h2", "h1 x", "h1 0", ""])
def test_malformed_mcpu_hosts(text: str) -> None:
    with pytest.raises(AllocationError, match="LSB_MCPU_HOSTS"):
        parse_mcpu_hosts(text)


def test_parsers_directly() -> None:
    assert parse_node_lines(" a \na\n", "F") == hosts(("a", 2))
    assert parse_pe_hostfile("a 1 q p\nb 2 q p\na 3 q p\n") == hosts(("a", 4), ("b", 2))


@pytest.mark.parametrize(
    ("num_proc", "expected"),
    [
        (1, [("a", 1)]),
        (2, [("a", 2)]),
        (3, [("a", 2), ("b", 1)]),
        (5, [("a", 2), ("b", 2), ("c", 1)]),
    ],
)
def test_first_slots_fill_hosts_in_order(num_proc: int, expected: list[tuple[str, int]]) -> None:
    allocation = Allocation("slurm", hosts(("a", 2), ("b", 2), ("c", 1)), "the Slurm allocation")
    assert allocation.first_slots(num_proc) == hosts(*expected)
