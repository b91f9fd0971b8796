"""The command line a remote login shell runs to start the agent (run here by a shell)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.transport.connection import NO_CWD_EXIT
from launcher.transport.remote import agent_command
from tests.launcher.pythons import venv_needing_library_path


def run_as_login_shell(command: str) -> subprocess.CompletedProcess[bytes]:
    # what sshd does with the command: the login shell gets it after -c
    return subprocess.run(["bash", "-c", command], input=b"", capture_output=True, timeout=30)


def test_agent_starts_in_a_quoted_directory(tmp_path: Path) -> None:
    odd = tmp_path / "it's a dir; $(echo no)"
    odd.mkdir()
    result = run_as_login_shell(agent_command(sys.executable, str(odd), {}))
    assert result.returncode == 0, result.stderr
    hello = json.loads(result.stdout.splitlines()[0])
    assert hello["ev"] == "hello"
    assert hello["executable"] == sys.executable


def test_missing_working_directory_is_its_own_exit_code(tmp_path: Path) -> None:
    missing = tmp_path / "not here"
    result = run_as_login_shell(agent_command(sys.executable, str(missing), {}))
    assert result.returncode == NO_CWD_EXIT
    assert result.stderr.decode() == f"hvdrun: no directory {missing} on this host\n"


def test_missing_python_exits_127(tmp_path: Path) -> None:
    command = agent_command(str(tmp_path / "python"), "/", {"PYTHONPATH": "/a b"})
    result = run_as_login_shell(command)
    assert result.returncode == 127


def test_no_secret_or_environment_in_the_command() -> None:
    job_env = {
        "PYTHONPATH": "src",
        "LD_LIBRARY_PATH": "/opt/py/lib",
        "LD_PRELOAD": "/opt/profiler/libprof.so",
        "HVDRUN_SECRET": "s3cr3t",
        "WANDB_API_KEY": "k3y",
        "PYTHONHOME": "",
    }
    command = agent_command("/venv/bin/python", "/work", job_env)
    assert command == (
        "exec /bin/sh -c 'if [ ! -d /work ]; then echo '\"'\"'hvdrun: no directory "
        "'\"'\"'/work'\"'\"' on this host'\"'\"' >&2; exit 200; fi; cd / && exec env "
        "LD_LIBRARY_PATH=/opt/py/lib PYTHONPATH=/work/src /venv/bin/python -m launcher.agent'"
    )


def test_the_interpreter_gets_its_loader_variables_through_the_login_shell(
    tmp_path: Path,
) -> None:
    """LD_LIBRARY_PATH, DYLD_LIBRARY_PATH and PYTHONHOME reach the interpreter byte-exact,
    whatever they hold, with PYTHONPATH; nothing else of the job's environment does."""
    python = tmp_path / "python"  # (prints what it started with)
    names = ["LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "PYTHONHOME", "PYTHONPATH"]
    python.write_text(
        "#!/bin/sh\n" + "".join(f"printf '%s=%s\\n' {n} \"${{{n}-<unset>}}\"\n" for n in names)
    )
    python.chmod(0o755)
    odd = "/opt/it's a lib:/$(echo no):/x;y`z`"
    job_env = {
        "LD_LIBRARY_PATH": odd,
        "DYLD_LIBRARY_PATH": "/opt/dy lib",
        "PYTHONHOME": "/opt/py home",
        "PYTHONPATH": "a dir",
        "LD_PRELOAD": "/opt/profiler/libprof.so",
    }
    command = agent_command(str(python), "/", job_env)
    assert "LD_PRELOAD" not in command
    result = run_as_login_shell(command)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().splitlines() == [
        f"LD_LIBRARY_PATH={odd}",
        "DYLD_LIBRARY_PATH=/opt/dy lib",
        "PYTHONHOME=/opt/py home",
        "PYTHONPATH=/a dir",
    ]


def test_a_python_that_needs_ld_library_path_starts_with_the_jobs(tmp_path: Path) -> None:
    """A Python of an Lmod or Spack module starts only with its LD_LIBRARY_PATH, which the
    job's environment has (hvdrun runs under it): the agent's command line passes it on."""
    libdir = tmp_path / "lib"
    python = venv_needing_library_path(tmp_path / "venv", libdir)
    command = agent_command(str(python), "/", {"LD_LIBRARY_PATH": str(libdir)})
    result = run_as_login_shell(command)
    assert result.returncode == 0, result.stderr
    hello = json.loads(result.stdout.splitlines()[0])
    assert (hello["ev"], hello["executable"]) == ("hello", str(python))
    without = run_as_login_shell(agent_command(str(python), "/", {}))
    assert without.returncode == 127
    assert b"error while loading shared libraries" in without.stderr
