"""Which environment variables travel from hvdrun to the workers on every host.

Workers get their host's agent's environment (on a remote host: what the SSH login set,
~/.bashrc's exports included; on the local host: hvdrun's own), overlaid with hvdrun's
environment (as with ``horovodrun``, which runs ``ssh host 'VAR=... command'``, and
``mpirun``, whose daemons pass the login's environment on), except variables of hvdrun's that
describe the machine, the login session or the devices of the host hvdrun runs on: copying
those to another host would be wrong there, so each worker keeps its own host's value.
``-x VAR`` forwards such a variable anyway and ``-x VAR=VALUE`` sets one (mpirun's syntax).
hvdrun then adds ``PYTHONUNBUFFERED=1`` and the ``HVDRUN_*``/torch rank variables, and
``PWD`` is the workers' working directory.

Nor do workers inherit another launcher's per-process variables, from hvdrun's environment or
from their agent's (an agent that srun started is a Slurm task): ``SLURM_PROCID``,
``SLURM_NTASKS``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, torchrun's ``MASTER_ADDR``,
exported bash functions, ... (:data:`rendezvous.launchers.FOREIGN_VARIABLES`). Libraries that
look for them (Lightning, Accelerate, submitit, mpi4py) would otherwise take a rank or a job
size that is not the worker's. ``-x`` forwards one of them all the same.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Mapping

from launcher.errors import LauncherError
from rendezvous.launchers import is_foreign

#: Names (shell patterns) that are never copied from hvdrun's host; see the module docstring.
HOST_SPECIFIC: tuple[str, ...] = (
    # the machine and the shell hvdrun was started from
    "HOSTNAME",
    "HOST",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "TMUX",
    "TMUX_PANE",
    "STY",
    "WINDOWID",
    "TERM_SESSION_ID",
    # the login: a remote host's account may differ
    "HOME",
    "USER",
    "LOGNAME",
    "MAIL",
    "SHELL",
    "KRB5CCNAME",
    # remote and graphical sessions
    "SSH_*",
    "DISPLAY",
    "XAUTHORITY",
    "WAYLAND_DISPLAY",
    "DBUS_SESSION_BUS_ADDRESS",
    "XDG_*",
    # the devices of this host
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ZE_AFFINITY_MASK",
    # the node of a batch allocation
    "SLURMD_NODENAME",
    "SLURM_CPUS_ON_NODE",
    "SLURM_GPUS_ON_NODE",
    "SLURM_JOB_GPUS",
    "SLURM_TOPOLOGY_ADDR*",
)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvSpecError(LauncherError, ValueError):
    """A ``-x`` argument that cannot be used; the message is for the user."""


def is_host_specific(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in HOST_SPECIFIC)


def parse_exports(exports: Iterable[str], caller_env: Mapping[str, str]) -> dict[str, str]:
    """``-x VAR`` (the caller's value) and ``-x VAR=VALUE`` → the variables to set. A
    ``-x VAR`` of a variable not set here sets nothing, as with mpirun (which warns: see
    :func:`unset_exports`)."""
    result: dict[str, str] = {}
    for export in exports:
        name, sep, value = export.partition("=")
        if not _NAME.match(name):
            # (named without its value: a value may be a secret, and this lands in logs)
            shown = f"{name}=..." if sep else name
            raise EnvSpecError(f"{shown!r} is not VAR or VAR=VALUE: {name!r} is not a name")
        if not sep:
            if name not in caller_env:
                continue
            value = caller_env[name]
        result[name] = value
    return result


def unset_exports(exports: Iterable[str], caller_env: Mapping[str, str]) -> list[str]:
    """The names of ``-x VAR`` exports whose variable is not set here."""
    return [e for e in exports if "=" not in e and _NAME.match(e) and e not in caller_env]


def forwarded_env(caller_env: Mapping[str, str], exports: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment minus host-specific and other launchers' per-process
    variables, plus the ``-x`` variables."""
    env = {
        name: value
        for name, value in caller_env.items()
        if not is_host_specific(name) and not is_foreign(name)
    }
    env.update(exports)
    return env


#: glibc malloc settings workers get unless the job sets either variable itself. With glibc's
#: defaults a training step's gradients (freed by ``zero_grad()``, allocated again by the
#: next backward pass) are handed back to the kernel and page-faulted in afresh every step:
#: thousands of faults per step, about as much CPU as the step's communication. Keeping
#: allocations below 64 MiB on the heap, and up to 256 MiB of freed heap, reuses them.
MALLOC_DEFAULTS: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
}


def worker_base_env(
    agent_env: Mapping[str, str], forwarded: Mapping[str, str], cwd: str
) -> dict[str, str]:
    """On the worker's host: the agent's own environment (what the host's login set), then
    what hvdrun sent, then the malloc defaults unless the job set its own; ``PWD`` the
    workers' working directory ``cwd``. No launcher's rank variables of the agent's reach the
    workers."""
    env = {name: value for name, value in agent_env.items() if not is_foreign(name)}
    env.update(forwarded)
    if not any(name in env for name in MALLOC_DEFAULTS):
        env.update(MALLOC_DEFAULTS)
    env["PWD"] = cwd  # (the agent's is /, where it runs)
    env.pop("OLDPWD", None)
    return env


def working_directory(environ: Mapping[str, str]) -> str:
    """The directory the workers start in: this process's, spelled as ``$PWD`` spells it
    where that names the same directory (a path through a symbolic link or an automount,
    which other hosts may have as it is, as OpenMPI does), else the physical path."""
    here = os.getcwd()
    logical = environ.get("PWD", "")
    if logical != here and os.path.isabs(logical):
        try:
            if os.path.samefile(logical, here):
                return logical
        except OSError:
            pass
    return here


def file_here_hint(program: str, cwd: str) -> str | None:
    """How to run ``program``, a bare name that no shell finds on ``PATH`` although a file of
    that name is in ``cwd`` (a shell does not look there for a bare name either); None
    where that is not the case."""
    path = os.path.join(cwd, program)
    if os.sep in program or not os.path.isfile(path):
        return None
    if program.endswith(".py"):
        return f"run it as python {program}"
    if os.access(path, os.X_OK):
        return f"run it as ./{program}"
    # (./name would be refused too: permission denied)
    return f"chmod +x {program} and run it as ./{program}, or run it with its interpreter"
