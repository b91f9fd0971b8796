"""Who started a process (rendezvous.launchers): the detection table and Slurm's list formats."""

from __future__ import annotations

import pytest

from rendezvous.launchers import (
    DetectionError,
    beside_hvdrun,
    derived_port,
    describe,
    detect,
    expand_nodelist,
    expand_tasks_per_node,
    in_slurm_step,
    is_foreign,
    slurm_allocation,
)

# What srun sets for task 3 of `srun -N2 --ntasks-per-node=2` (seen on the test cluster).
SLURM_TASK = {
    "SLURM_JOB_ID": "17",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "hvdh[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURMD_NODENAME": "hvdh2",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.mark.parametrize(
    ("text", "nodes"),
    [
        ("node1", ["node1"]),
        (
            "node[01-04,07],gpu-a[1-2]",
            ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"],
        ),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("hvdh[1-2]", ["hvdh1", "hvdh2"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
    ],
)
def test_expand_nodelist(text: str, nodes: list[str]) -> None:
    assert expand_nodelist(text) == nodes


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "node[a-b]", "node[3-1]"])
def test_expand_nodelist_rejects(text: str) -> None:
    with pytest.raises(DetectionError, match="node list"):
        expand_nodelist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("8(x2)", [8, 8])],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


def test_expand_tasks_per_node_rejects() -> None:
    with pytest.raises(DetectionError, match=r"2\(y3\)"):
        expand_tasks_per_node("2(y3)")


def test_nothing_detected_for_a_plain_process() -> None:
    assert detect({"PATH": "/usr/bin"}) is None


def test_slurm_task() -> None:
    found = detect(SLURM_TASK)
    assert found is not None
    assert (found.launcher, found.rank, found.size) == ("slurm", 3, 4)
    assert (found.local_rank, found.local_size, found.host) == (1, 2, "hvdh2")
    assert found.first_host == "hvdh1"
    assert found.job_key == "slurm/17/0"


def test_slurm_uneven_tasks_give_each_node_its_local_size() -> None:
    env = dict(SLURM_TASK, SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_NODEID="1", SLURM_LOCALID="0")
    found = detect(env)
    assert found is not None and found.local_size == 1


def test_batch_script_is_not_a_task_but_an_allocation() -> None:
    batch = {
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "hvdh[1-2]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
    }
    assert detect(batch) is None
    allocation = slurm_allocation(batch)
    assert allocation is not None
    assert (allocation.where, allocation.nodes, allocation.tasks) == (
        "batch script",
        ["hvdh1", "hvdh2"],
        4,
    )
    salloc = {k: v for k, v in batch.items() if k != "SLURM_PROCID"}
    assert slurm_allocation(salloc) is not None and slurm_allocation(salloc).where == "salloc shell"  # type: ignore[union-attr]
    assert slurm_allocation(SLURM_TASK) is None  # inside a step
    for step in ("4294967290", "interactive"):  # salloc's shell in Slurm's interactive step
        shell = slurm_allocation({**batch, "SLURM_STEP_ID": step})
        assert shell is not None and shell.where == "salloc shell"


def test_open_mpi() -> None:
    found = detect(OPEN_MPI)
    assert found is not None
    assert (found.launcher, found.name, found.rank, found.size) == (
        "mpi",
        "Open MPI (mpirun)",
        2,
        4,
    )
    assert (found.local_rank, found.local_size) == (0, 2)
    assert found.master_addr is None


def test_mpirun_inside_a_slurm_allocation_is_mpi() -> None:
    # mpirun's daemons run as Slurm tasks, one per node: their step counts nodes.
    env = {**SLURM_TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", **OPEN_MPI}
    found = detect(env)
    assert found is not None and (found.launcher, found.rank, found.size) == ("mpi", 2, 4)


def test_pmi_mpich_and_cray() -> None:
    found = detect(
        {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    )
    assert found is not None and (found.launcher, found.rank, found.size, found.local_rank) == (
        "mpi",
        1,
        3,
        1,
    )
    cray = detect({"ALPS_APP_PE": "5", "PMI_SIZE": "8"})
    assert cray is not None and (cray.rank, cray.size, cray.local_rank) == (5, 8, None)


def test_srun_with_its_pmi2_plugin_is_slurm_not_mpi() -> None:
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE alongside the step's own numbers.
    pmi2 = {**SLURM_TASK, "PMI_RANK": SLURM_TASK["SLURM_PROCID"], "PMI_FD": "5"}
    pmi2["PMI_SIZE"] = pmi2.get("SLURM_STEP_NUM_TASKS") or pmi2["SLURM_NTASKS"]
    found = detect(pmi2)
    assert found is not None and (found.launcher, found.name) == ("slurm", "Slurm (srun)")
    # Hydra's proxies started by srun: one task per node, MPI ranks of their own.
    hydra = {**SLURM_TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    hydra.update({"PMI_RANK": "3", "PMI_SIZE": "4"})
    found = detect(hydra)
    assert found is not None and (found.launcher, found.rank, found.size) == ("mpi", 3, 4)


def test_jsrun() -> None:
    env = {
        "JSM_NAMESPACE_RANK": "0",
        "JSM_NAMESPACE_SIZE": "6",
        "JSM_NAMESPACE_LOCAL_RANK": "0",
        "JSM_NAMESPACE_LOCAL_SIZE": "6",
        "LSB_JOBID": "99",
    }
    found = detect(env)
    assert found is not None and (found.launcher, found.size, found.job_key) == (
        "jsrun",
        6,
        "lsf/99",
    )


def test_torchrun_with_its_agent_store() -> None:
    found = detect(TORCHRUN)
    assert found is not None
    assert (found.launcher, found.name, found.rank, found.size) == ("torchrun", "torchrun", 1, 2)
    assert (found.master_addr, found.master_port, found.agent_store) == ("127.0.0.1", 29500, True)
    assert found.job_key == "torchrun/abc/0"


def test_torchrun_inside_srun_is_torchrun() -> None:
    env = {**SLURM_TASK, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", **TORCHRUN}
    found = detect(env)
    assert found is not None and (found.launcher, found.rank, found.size) == ("torchrun", 1, 2)


def test_kubernetes_style_environment() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    found = detect(env)
    assert found is not None
    assert (found.launcher, found.rank, found.size, found.agent_store) == ("torchrun", 0, 2, False)
    assert found.name == "the RANK/WORLD_SIZE/MASTER_ADDR environment"
    assert (found.master_addr, found.master_port) == ("job-master-0", 23456)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0"},  # scripts set RANK=0 for purposes of their own
        {"WORLD_SIZE": "1"},
        {"RANK": "0", "WORLD_SIZE": "1"},
        {"WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1"},
    ],
)
def test_environment_of_a_process_on_its_own(env: dict[str, str]) -> None:
    assert detect(env) is None


@pytest.mark.parametrize("rank", ["0", "1"])
def test_rank_and_world_size_without_an_address_are_a_job(rank: str) -> None:
    # No silent size 1: the job is detected on every rank, and the runtime refuses it at
    # once for want of an address (tests/collectives/test_adopted.py runs it).
    found = detect({"RANK": rank, "WORLD_SIZE": "2"})
    assert found is not None
    assert (found.launcher, found.rank, found.size) == ("torchrun", int(rank), 2)
    assert found.name == "the RANK/WORLD_SIZE environment"
    assert found.master_addr is None


def test_rank_and_world_size_with_only_a_port() -> None:
    found = detect({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "23456"})
    assert found is not None and (found.size, found.master_addr) == (1, None)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
        ({"RANK": "3", "MASTER_ADDR": "10.0.0.1"}, "RANK=3 is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, r"WORLD_SIZE=2 says this process is one of 2, but RANK"),
        ({"WORLD_SIZE": "4", "MASTER_ADDR": "h"}, r"one of 4, but RANK \(which one\) is not"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, "says this is rank 1 of a job of 1"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK/WORLD_SIZE environment says this is rank 2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "says the job has 0 processes"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK must be an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank 2 of a job of 2 \(ranks are 0 to 1\)"),
        *(
            (
                {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": port},
                f"MASTER_PORT must be a port number from 1 to 65535, got '{port}'",
            )
            for port in ("70000", "0", "-1")
        ),
    ],
)
def test_environment_that_cannot_be_a_job(env: dict[str, str], message: str) -> None:
    with pytest.raises(DetectionError, match=message):
        detect(env)


def test_launcher_none_overrides_the_environment() -> None:
    assert detect({"RANK": "1", "WORLD_SIZE": "2", "HVDRUN_LAUNCHER": "none"}) is None


def test_hvdrun_wins() -> None:
    env = {
        **SLURM_TASK,
        "HVDRUN_RENDEZVOUS_ADDR": "10.0.0.1:5000",
        "HVDRUN_RANK": "1",
        "HVDRUN_SIZE": "2",
    }
    found = detect(env)
    assert found is not None and (found.launcher, found.rank, found.size) == ("hvdrun", 1, 2)


def test_override_picks_a_launcher() -> None:
    env = {**SLURM_TASK, **OPEN_MPI}
    found = detect({**env, "HVDRUN_LAUNCHER": "slurm"})
    assert found is not None and found.launcher == "slurm"
    assert detect({**env, "HVDRUN_LAUNCHER": "none"}) is None


def test_override_without_that_launchers_variables() -> None:
    with pytest.raises(DetectionError, match="HVDRUN_LAUNCHER=jsrun, but this process has none"):
        detect({**OPEN_MPI, "HVDRUN_LAUNCHER": "jsrun"})


def test_unknown_override() -> None:
    with pytest.raises(DetectionError, match="HVDRUN_LAUNCHER='pbs' is not one of auto, hvdrun"):
        detect({"HVDRUN_LAUNCHER": "pbs"})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"},
            "OMPI_COMM_WORLD_RANK must be an integer",
        ),
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "rank 4 of a job of 4"),
        ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "has 0 processes"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "local rank 2 of 2"),
        # Half of a launcher's pair never makes a job of size 1 in silence.
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE=2 says this process is one of 2"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK=1 is set but OMPI_COMM_WORLD_SIZE"),
        ({"PMI_RANK": "1"}, "PMI_RANK=1 is set but PMI_SIZE is not"),
    ],
)
def test_inconsistent_variables(env: dict[str, str], message: str) -> None:
    with pytest.raises(DetectionError, match=message):
        detect(env)


def test_derived_port_is_stable_and_unprivileged() -> None:
    port = derived_port("slurm/17/0")
    assert port == derived_port("slurm/17/0")
    assert 10000 <= port < 30000
    assert derived_port("slurm/17/1") != port


def test_describe() -> None:
    assert describe(SLURM_TASK) == "Slurm (srun): rank 3 of 4, local rank 1 of 2 on hvdh2"
    assert describe({}) == "none: hvd.init() runs a job of size 1"
    assert describe({"HVDRUN_LAUNCHER": "none", **OPEN_MPI}).startswith(
        "none (HVDRUN_LAUNCHER=none)"
    )
    assert describe({"HVDRUN_LAUNCHER": "bad"}).startswith("cannot tell: HVDRUN_LAUNCHER='bad'")
    salloc = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "2"}
    assert "Slurm salloc shell of job 5 (2 tasks on 1 node(s))" in describe(salloc)


@pytest.mark.parametrize("step", ["batch", "4294967291", "interactive", "4294967290"])
def test_batch_and_interactive_steps_are_allocations_not_tasks(step: str) -> None:
    shell = {
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "hvdh[1-2]",
        "SLURM_STEP_ID": step,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
    }
    assert not in_slurm_step(shell)
    assert detect(shell) is None  # not rank 0 of a job of 4 that never comes
    assert slurm_allocation(shell) is not None
    assert in_slurm_step(SLURM_TASK)


@pytest.mark.parametrize(
    "name",
    ["SLURM_PROCID", "SLURM_STEP_NODELIST", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "BASH_FUNC_f%%"],
)
def test_foreign_variables(name: str) -> None:
    assert is_foreign(name)


@pytest.mark.parametrize(
    "name", ["SLURM_JOB_ID", "SLURM_JOB_NAME", "RANK", "WORLD_SIZE", "OMPI_MCA_btl", "PATH"]
)
def test_not_foreign(name: str) -> None:
    assert not is_foreign(name)


def test_every_rank_of_an_mpi_job_derives_the_same_job_key() -> None:
    """The job key names the port and token the ranks derive: it must be the job's, alike
    on every rank (PMI_ID numbers the process), and differ between jobs where the launcher
    says which job (Open MPI 5's PMIx namespace)."""

    def keys(*envs: dict[str, str]) -> set[str]:
        found = [detect(env) for env in envs]
        return {placement.job_key for placement in found if placement is not None}

    hydra = [{"PMI_RANK": str(rank), "PMI_SIZE": "2", "PMI_ID": str(rank)} for rank in (0, 1)]
    assert len(keys(*hydra)) == 1
    ompi5 = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    assert keys({**ompi5, "PMIX_NAMESPACE": "prterun-a-1@1"}) != keys(
        {**ompi5, "PMIX_NAMESPACE": "prterun-a-2@1"}
    )
    pmix = [{"PMI_RANK": str(rank), "PMI_SIZE": "2", "PMIX_NAMESPACE": "ns7"} for rank in (0, 1)]
    assert keys(*pmix) == {"pmi/ns7"}


def test_hvdrun_variables_beside_another_launcher_get_a_hint() -> None:
    """hvdrun's variables win (its workers may run inside srun's tasks); where torchrun or
    mpirun started the process too, they may be left over, and a failed registration says
    so, with the ways out."""
    left = {"HVDRUN_RENDEZVOUS_ADDR": "127.0.0.1:1", "HVDRUN_RANK": "0", "HVDRUN_SIZE": "2"}
    hint = beside_hvdrun({**left, **OPEN_MPI})
    assert hint is not None and "started by Open MPI (mpirun) as well" in hint, hint
    assert "unset them, or set HVDRUN_LAUNCHER=mpi to join Open MPI (mpirun)'s job" in hint
    torchrun = {**left, **TORCHRUN, "TORCHELASTIC_RUN_ID": "j"}
    assert "HVDRUN_LAUNCHER=torchrun" in (beside_hvdrun(torchrun) or "")
    assert beside_hvdrun({**left, **SLURM_TASK}) is None  # (hvdrun's own agents under srun)
    assert beside_hvdrun(left) is None and beside_hvdrun(OPEN_MPI) is None
