"""Which variables reach the workers: the caller's minus host-specific ones, plus -x."""

import os
import re
from pathlib import Path

import pytest

from launcher.spec.environment import (
    MALLOC_DEFAULTS,
    EnvSpecError,
    forwarded_env,
    is_host_specific,
    parse_exports,
    unset_exports,
    worker_base_env,
    working_directory,
)


@pytest.mark.parametrize(
    "name",
    [
        "HOSTNAME",
        "HOME",
        "USER",
        "SHELL",
        "PWD",
        "SSH_AUTH_SOCK",
        "SSH_CONNECTION",
        "DISPLAY",
        "XDG_RUNTIME_DIR",
        "CUDA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
    ],
)
def test_host_specific(name: str) -> None:
    assert is_host_specific(name)


@pytest.mark.parametrize(
    "name",
    ["PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "HVDRUN_FUSION_THRESHOLD", "NCCL_DEBUG", "MY_VAR"],
)
def test_forwarded(name: str) -> None:
    assert not is_host_specific(name)


def test_forwarded_env_drops_host_specific_and_adds_exports() -> None:
    caller = {"PATH": "/bin", "HOME": "/home/me", "DISPLAY": ":0", "SSH_TTY": "/dev/pts/1"}
    env = forwarded_env(caller, {"DISPLAY": ":0", "NEW": "1"})
    assert env == {"PATH": "/bin", "DISPLAY": ":0", "NEW": "1"}


def test_parse_exports() -> None:
    caller = {"CUDA_VISIBLE_DEVICES": "2,3", "A": "x"}
    exports = ["CUDA_VISIBLE_DEVICES", "B=1=2", "C=", "A", "MISSING"]
    assert parse_exports(exports, caller) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "B": "1=2",
        "C": "",
        "A": "x",
    }
    # -x of a variable not set here: nothing to pass on, as with mpirun (hvdrun notes it)
    assert unset_exports(exports, caller) == ["MISSING"]


@pytest.mark.parametrize(
    ("export", "message"),
    [
        ("=x", "'=...' is not VAR or VAR=VALUE: '' is not a name"),
        ("1A=2", "'1A=...' is not VAR or VAR=VALUE: '1A' is not a name"),
        ("A-B", "'A-B' is not VAR or VAR=VALUE: 'A-B' is not a name"),
        ("MY-TOKEN=supersecret123", "'MY-TOKEN=...' is not VAR or VAR=VALUE"),
        # a newline shown as one: the error stays on one line
        ("A\nB=v", "'A\\nB=...' is not VAR or VAR=VALUE: 'A\\nB' is not a name"),
    ],
)
def test_parse_exports_rejects(export: str, message: str) -> None:
    # (never with the value: it may be a secret, and the message lands in logs)
    with pytest.raises(EnvSpecError, match=re.escape(message)) as raised:
        parse_exports([export], {})
    assert "=" not in export or export.partition("=")[2] not in str(raised.value)


def test_worker_keeps_its_own_hosts_values_under_hvdrun_s() -> None:
    # The agent's environment is what the host's login set (~/.bashrc's exports: a node's own
    # NCCL_* settings, modules loaded there); hvdrun's own environment wins where it has
    # the variable, as with horovodrun (ssh host 'VAR=... command') and mpirun.
    agent = {
        "HOME": "/root",
        "SSH_CONNECTION": "a b c d",
        "PATH": "/usr/bin",
        "NCCL_IB_HCA": "mlx5_0",
        "PWD": "/",
        "OLDPWD": "/root",
    }
    forwarded = {"PATH": "/venv/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert worker_base_env(agent, forwarded, "/work") == {
        "HOME": "/root",
        "SSH_CONNECTION": "a b c d",
        "PATH": "/venv/bin",  # the caller's, not the login's
        "NCCL_IB_HCA": "mlx5_0",  # the login's own: hvdrun's environment has none
        "CUDA_VISIBLE_DEVICES": "0",  # forced with -x: the caller's wins
        "PWD": "/work",  # the workers' working directory, not the agent's (/)
        **MALLOC_DEFAULTS,
    }


def test_malloc_defaults_yield_to_the_jobs_own_setting() -> None:
    env = worker_base_env({}, {"MALLOC_TRIM_THRESHOLD_": "0"}, "/")
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert "MALLOC_MMAP_THRESHOLD_" not in env  # the job tunes malloc itself: both are its own
    assert worker_base_env({}, {}, "/")["MALLOC_MMAP_THRESHOLD_"] == str(64 << 20)


def test_the_working_directory_is_spelled_as_pwd_where_it_names_the_same(tmp_path: Path) -> None:
    # Other hosts may have the path through a link (or an automount) as it is, and not its
    # target: as OpenMPI does, $PWD's spelling is kept where it names the same directory.
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    before = os.getcwd()
    os.chdir(tmp_path / "link")
    try:
        assert working_directory({"PWD": str(tmp_path / "link")}) == str(tmp_path / "link")
        assert working_directory({"PWD": str(tmp_path)}) == str(real)  # (another directory)
        assert working_directory({"PWD": "link"}) == str(real)  # (not absolute)
        assert working_directory({}) == str(real)
    finally:
        os.chdir(before)


# What a process started by srun inside `mpirun`/`torchrun`/a login shell may carry, next to
# what its job may log. Lightning, Accelerate and submitit read the first kind as a rank.
LAUNCHED = {
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEPID": "0",
    "SLURM_TASK_PID": "991",
    "SLURM_GTIDS": "2,3",
    "SLURM_SRUN_COMM_PORT": "4100",
    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_MCA_ess_base_jobid": "77",
    "OMPI_MCA_orte_hnp_uri": "x",
    "MV2_COMM_WORLD_RANK": "5",
    "PMI_RANK": "5",
    "PMI_SIZE": "8",
    "PMIX_RANK": "5",
    "PMIX_NAMESPACE": "prterun-1",
    "TORCHELASTIC_RUN_ID": "abc",
    "GROUP_RANK": "1",
    "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.0.0.9",
    "MASTER_PORT": "29500",
    "PBS_TASKNUM": "2",
    "PBS_VNODENUM": "1",
    "BASH_FUNC_module%%": "() {  eval $($LMOD_CMD bash $@)\n}",
}
JOB_LEVEL = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "hvdh[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_SUBMIT_DIR": "/home/u",
    "SLURM_CLUSTER_NAME": "c",
    "PBS_JOBID": "1.pbs",
    "OMPI_MCA_btl": "tcp,self",
    "LOCAL_RANK_OFFSET": "0",
}


def test_forwarded_env_drops_other_launchers_per_process_variables() -> None:
    forwarded = forwarded_env({**LAUNCHED, **JOB_LEVEL, "PATH": "/bin"}, {})
    assert forwarded == {**JOB_LEVEL, "PATH": "/bin"}


def test_an_export_forwards_a_foreign_variable_all_the_same() -> None:
    exports = parse_exports(["SLURM_PROCID", "MASTER_PORT=1234"], LAUNCHED)
    forwarded = forwarded_env(LAUNCHED, exports)
    assert forwarded == {"SLURM_PROCID": "3", "MASTER_PORT": "1234"}


def test_workers_get_nothing_of_their_agents_launcher() -> None:
    # An agent that srun started is task N of a step; its workers are not.
    agent_env = {**LAUNCHED, "SLURMD_NODENAME": "hvdh2", "HOME": "/home/u", "PATH": "/bin"}
    env = worker_base_env(agent_env, {"PATH": "/usr/bin"}, "/")
    assert not set(env) & set(LAUNCHED)
    assert env["SLURMD_NODENAME"] == "hvdh2"  # the worker's own node, not hvdrun's
    assert env["HOME"] == "/home/u" and env["PATH"] == "/usr/bin"


def test_slurm_node_variables_are_the_workers_hosts() -> None:
    assert is_host_specific("SLURMD_NODENAME") and is_host_specific("SLURM_CPUS_ON_NODE")
    assert "SLURMD_NODENAME" not in forwarded_env({"SLURMD_NODENAME": "hvdh1"}, {})
