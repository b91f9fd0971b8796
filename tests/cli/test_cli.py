"""The CLI boundary: every user mistake is one line and exit code 2, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from hvdrun import __version__
from hvdrun.cli import run_cli
from hvdrun.command_check import hidden_packages_note
from tests.cli.conftest import assert_usage_error
from tests.processes import with_repo_on_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "0", "python", "x.py"], "invalid '-np': must be at least 1, got 0"),
        (["-np", "-3", "python", "x.py"], "invalid '-np': must be at least 1, got -3"),
        (
            ["-np", "5", "-H", "localhost:4", "true"],
            "invalid '-np': 5 processes requested but -H localhost:4 has only 4 slot(s)",
        ),
        (["-H", "host:", "true"], "invalid '-H': slot count missing in 'host:'"),
        (["-H", ":4", "true"], "invalid '-H': host name missing in ':4'"),
        (["-H", "host:x", "true"], "invalid '-H': slot count 'x' in 'host:x' is not a number"),
        (["-H", "", "true"], "invalid '-H': the host list is empty"),
        (["-np", "2"], "no command given"),
        (["true"], "give the number of processes with -np N"),
        (["-np", "two", "true"], "'two' is not a valid integer"),
        # Absurd counts are refused while the command line is read (they used to hang).
        (
            ["-np", "99999999999999999999", "true"],
            "Invalid value for '-np' / '-n' / '--num-proc': 99999999999999999999 is above "
            "the limit of 1048576 processes",
        ),
        (["-np", "1048577", "true"], "1048577 is above the limit of 1048576 processes"),
        (
            ["-np", "65537", "true"],
            "invalid '-np': 65537 processes on this machine is above the limit of "
            "65536 slots per host",
        ),
        (
            ["-H", "localhost:99999999999999999999", "true"],
            "invalid '-H': slot count 99999999999999999999 in 'localhost:99999999999999999999' "
            "is above the limit of 65536 slots per host",
        ),
        (
            ["-H", ",".join(f"h{i}:65536" for i in range(17)), "true"],
            "the hosts have 1114112 slots, above the limit of 1048576 processes of one job: "
            "give the number of processes with -np N",
        ),
        (
            ["--min-np", "99999999999999999999", "-np", "1", "true"],
            "Invalid value for '--min-np' / '--min-num-proc': 99999999999999999999 is above "
            "the limit of 1048576 processes",
        ),
        (
            ["--max-np", "2000000", "-np", "1", "true"],
            "Invalid value for '--max-np' / '--max-num-proc': 2000000 is above the limit of "
            "1048576 processes",
        ),
        (
            ["--slots-per-host", "70000", "-np", "1", "true"],
            "Invalid value for '--slots-per-host': 70000 is above the limit of 65536 slots per "
            "host",
        ),
        (["--no-such-flag", "true"], "No such option '--no-such-flag'"),
        (["-H", "a:1", "--hostfile", "f", "true"], "give the hosts with -H or with --hostfile"),
        (["--hostfile", "/nonexistent/hosts", "true"], "cannot read hostfile /nonexistent/hosts"),
        (
            ["-x", "1=2", "-np", "1", "true"],
            "invalid '-x': '1=...' is not VAR or VAR=VALUE: '1' is not a name",
        ),
        (["--check-hosts"], "--check-hosts needs the hosts"),
        (["--check-hosts", "-H", "a", "true"], "--check-hosts runs no command"),
        (["--rendezvous-addr", "h:99999", "-np", "1", "true"], "is not ADDR or ADDR:PORT"),
        (["--ssh-host-key-policy", "yolo", "true"], "'yolo' is not one of"),
        (["-i", "/nonexistent/key", "true"], "'/nonexistent/key' does not exist"),
        (["--start-timeout", "0", "-np", "1", "true"], "0 is not in the range x>0"),
        (["-p", "70000", "true"], "70000 is not in the range 1<=x<=65535"),
        (
            ["--network-interface", "lo,nosuchif9", "-np", "1", "true"],
            "invalid '--network-interface': this machine has no network interface nosuchif9; "
            "it has lo",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


def test_missing_command_and_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["-np", "2", "no-such-program-xyz"]) == 127
    assert "hvdrun: error: command not found: no-such-program-xyz" in capsys.readouterr().err
    assert run_cli(["-np", "2", ""]) == 127  # (an unset shell variable: hvdrun -np 2 "$PY")
    assert (
        "hvdrun: error: command not found: '' (the command's first word is empty)\n"
        in capsys.readouterr().err
    )
    assert run_cli(["-np", "2", sys.executable, "missing_script.py"]) == 2
    assert "hvdrun: error: script not found: missing_script.py" in capsys.readouterr().err
    assert run_cli(["-np", "2", sys.executable, "no\nsuch.py"]) == 2  # (one line, as typed)
    assert "hvdrun: error: script not found: 'no\\nsuch.py' (in " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # the whole command quoted as one word (a blank in it, a trailing one unseen)
        (
            ["python argv.py"],
            "command not found: 'python argv.py' (one word with blanks in it: was the whole "
            "command quoted as one?",
        ),
        (["python "], "command not found: 'python ' (one word with blanks"),
        # a newline shown as one, the message kept to one line
        (["no\nsuch"], "command not found: 'no\\nsuch' (one word with blanks"),
        (["no\x1bsuch"], "command not found: 'no\\x1bsuch' (it holds characters that do not"),
        # a shell's assignment, which is no program
        (["FOO=1", "python", "x.py"], "command not found: FOO=1 (a variable for the workers? "),
    ],
)
def test_a_command_not_found_is_shown_as_typed_with_a_hint(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["-np", "1", *argv]) == 127
    err = capsys.readouterr().err
    assert err.startswith(f"hvdrun: error: {message}") and err.count("\n") == 1, err


def test_no_python_on_the_workers_path_names_the_one_hvdrun_runs_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # (a cron job's PATH, /usr/bin:/bin, with python3 only)
    assert run_cli(["-np", "1", "-x", "PATH=/nonexistent", "python", "train.py"]) == 127
    assert capsys.readouterr().err == (
        f"hvdrun: error: command not found: python (the workers' PATH has none: hvdrun runs "
        f"on {sys.executable}; give that path, or activate its virtualenv)\n"
    )


def test_a_program_or_script_behind_a_closed_directory_is_not_said_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A user's 0700 home holding the virtualenv (root, who runs the tests, is never refused:
    # the refusal is the kernel's, stood in for here)
    closed = tmp_path / "closed"
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(closed)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    assert run_cli(["-np", "1", str(closed / "bin" / "python"), "x.py"]) == 126
    assert capsys.readouterr().err == (
        f"hvdrun: error: permission denied: {closed}/bin/python (a directory on its path is "
        "not open to this user)\n"
    )
    assert run_cli(["-np", "1", sys.executable, str(closed / "train.py")]) == 2
    assert capsys.readouterr().err == (
        f"hvdrun: error: cannot read script {closed}/train.py: permission denied (a directory "
        "on its path is not open to this user)\n"
    )


def test_options_after_the_command_are_said_to_be_the_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_cli(["python", "-np", "2", "train.py"]) == 2
    assert "the -np after python is the command's own argument (hvdrun's options go before" in (
        capsys.readouterr().err
    )


def test_the_command_is_looked_up_on_the_workers_path(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # -x PATH=... gives the workers a PATH of their own: the program is found there (and
    # runs), though hvdrun's own PATH lacks it
    (tmp_path / "bin dir").mkdir()
    program = tmp_path / "bin dir" / "only-here-xyz"
    program.write_text("#!/bin/sh\necho ran from the workers PATH\n")
    program.chmod(0o755)
    path = f"{program.parent}:{os.environ['PATH']}"
    assert run_cli(["-np", "1", "-x", f"PATH={path}", "only-here-xyz"]) == 0
    assert "ran from the workers PATH" in capfd.readouterr().out
    assert run_cli(["-np", "1", "only-here-xyz"]) == 127


@pytest.mark.parametrize(
    ("name", "mode", "how"),
    [
        ("train.py", 0o755, "run it as python train.py"),
        ("train", 0o755, "run it as ./train"),
        # (./run.sh would be refused as well: not executable)
        ("run.sh", 0o644, "chmod +x run.sh and run it as ./run.sh, or run it with its interpreter"),
    ],
)
def test_a_bare_name_of_a_file_here_is_not_found_with_the_way_to_run_it(
    name: str,
    mode: int,
    how: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("print('ran')\n")
    (tmp_path / name).chmod(mode)
    assert run_cli(["-np", "2", name]) == 127  # as a shell exits: PATH has no "."
    assert capsys.readouterr().err == (
        f"hvdrun: error: command not found: {name} (a file here: {how})\n"
    )


def test_a_shell_builtin_is_not_found_and_said_to_be_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_cli(["-np", "1", "cd", "/tmp"]) == 127
    assert capsys.readouterr().err == (
        "hvdrun: error: command not found: cd (a shell builtin: run the command through a "
        "shell, sh -c 'cd ...')\n"
    )


def test_absurd_slot_count_in_a_hostfile_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=99999999999999999999\n")
    assert_usage_error(
        ["--hostfile", str(hostfile), "true"],
        f"invalid '--hostfile': {hostfile} line 1: slot count 99999999999999999999",
        capsys,
    )


@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_a_script_without_execute_bit_is_permission_denied(
    mode: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.py").write_text("print('ran')\n")
    (tmp_path / "w.py").chmod(mode)
    assert run_cli(["-np", "2", "./w.py"]) == 126  # as a shell exits
    out, err = capsys.readouterr()
    assert err == (
        "hvdrun: error: permission denied: ./w.py is not executable "
        "(run it with python ./w.py, or chmod +x)\n"
    )
    assert out == ""


def test_a_file_or_directory_that_cannot_run_is_permission_denied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.txt"
    data.write_text("not a program\n")
    assert run_cli(["-np", "2", str(data)]) == 126
    assert capsys.readouterr().err == (
        f"hvdrun: error: permission denied: {data} is not executable "
        f"(chmod +x {data}, or run it with its interpreter)\n"
    )
    assert run_cli(["-np", "2", str(tmp_path)]) == 126
    assert capsys.readouterr().err == (
        f"hvdrun: error: permission denied: {tmp_path} is a directory\n"
    )


@pytest.mark.parametrize(
    ("args", "reads_stdin"),
    [
        (["-"], True),
        ([], True),
        (["-u", "-W", "ignore"], True),
        (["-u", "-", "x"], True),
        (["--", "-"], True),
        (["train.py"], False),
        (["-c", "pass"], False),
        (["-m", "pkg"], False),
        (["-u", "train.py", "-"], False),  # (a script's own argument)
    ],
)
def test_python_reading_its_program_from_stdin_is_refused(
    args: list[str], reads_stdin: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hvdrun -np 2 python - < train.py`` ran nothing and exited 0: workers' stdin is
    /dev/null (mpirun forwards its own to rank 0)."""
    from hvdrun.command_check import check_command

    (tmp_path / "train.py").write_text("")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        if reads_stdin:
            with pytest.raises(click.ClickException, match="reads its program from stdin"):
                check_command(["python3", *args])
        else:
            check_command(["python3", *args])
        job = tmp_path / "python_job.sh"  # (a program named python-something, not python)
        job.write_text("#!/bin/sh\necho hi\n")
        job.chmod(0o755)
        check_command([str(job), *args])
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(
    ("first_line", "said"),
    [
        (
            b"#!/bin/sh\r\n",
            "line ends in a carriage return (Windows line endings): convert the file "
            "(dos2unix) or run it with its interpreter",
        ),
        (b"#!/opt/nowhere/python3 -u\n", "line names /opt/nowhere/python3, which does not"),
    ],
)
def test_a_script_whose_interpreter_is_missing_is_a_bad_interpreter(
    first_line: bytes, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a shell says: every worker would fail with "No such file or directory" for a
    script that is there."""
    script = tmp_path / "train.sh"
    script.write_bytes(first_line + b"echo hi\n")
    script.chmod(0o755)
    assert run_cli(["-np", "2", str(script)]) == 126
    err = capsys.readouterr().err
    assert err.startswith(f"hvdrun: error: bad interpreter: {script}'s #! "), err
    assert said in err, err


@pytest.mark.parametrize(
    ("python_args", "exit_code", "message"),
    [
        # The script after python's own options: a missing one starts nothing (exit 2).
        (["-u", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-O", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-OO", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-B", "-E", "-s", "-S", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-I", "-q", "-b", "-d", "-v", "-x", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-uB", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-W", "ignore", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-Werror", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-u", "-X", "dev", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-Xutf8", "nonexist.py"], 2, "script not found: nonexist.py"),
        (["-u", "--", "nonexist.py"], 2, "script not found: nonexist.py"),
        # Whatever its name: python runs any file (or a directory, a zip) given to it.
        (["nonexist"], 2, "script not found: nonexist"),
        (["-u", "nonexist.py.bak"], 2, "script not found: nonexist.py.bak"),
        # No script runs: code, a module; nothing is checked (stdin: refused, below).
        (["-c", "print('code ran')", "nonexist.py"], 0, "[0]<stdout>:code ran"),
        (["-uc", "print('code ran')", "nonexist.py"], 0, "[0]<stdout>:code ran"),
        (["-m", "no_such_module_xyz", "nonexist.py"], 1, "No module named no_such_module_xyz"),
    ],
)
def test_script_check_reads_python_options_as_python_does(
    python_args: list[str],
    exit_code: int,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_cli(["-np", "1", sys.executable, *python_args]) == exit_code
    out, err = capsys.readouterr()
    assert message in out + err
    if exit_code == 2:  # refused before anything started
        assert err == f"hvdrun: error: {message} (in {tmp_path})\n"
        assert out == ""
    else:
        assert "script not found" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out == f"hvdrun {__version__}\n"


def test_help_mentions_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "-np",
        "--hosts",
        "--hostfile",
        "--start-timeout",
        "--ssh-port",
        "--ssh-identity-file",
        "--ssh-host-key-policy",
        "-x",
        "--rendezvous-addr",
        "--network-interface",
        "--output-filename",
        "--prefix-timestamp",
        "--check-hosts",
        "--check-build",
        "--version",
    ):
        assert flag in out


def test_cli_process_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from hvdrun.cli import run_cli\n"
        "rc = run_cli(['-np', '2', 'true'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_check_build_lists_what_is_available() -> None:
    # (Keras's backend named: its default, TensorFlow, is what a machine without
    # TensorFlow, the GPU image for one, lists as unusable)
    result = subprocess.run(
        [sys.executable, "-m", "hvdrun", "--check-build"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
    )
    assert result.returncode == 0, result.stderr
    import torch
    import torch.distributed as dist

    out = result.stdout
    assert out.startswith(f"hvdrun v{__version__}:")
    assert f"[X] PyTorch {torch.__version__}" in out
    gloo_mark = "[X]" if dist.is_gloo_available() else "[ ]"
    nccl_mark = "[X]" if dist.is_nccl_available() else "[ ]"
    mpi_mark = "[X]" if dist.is_mpi_available() else "[ ]"
    assert f"{gloo_mark} Gloo" in out
    assert f"{nccl_mark} NCCL" in out
    assert f"{mpi_mark} MPI" in out
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"{devices} device(s)" in out
    # TensorFlow and Keras with their versions (from their metadata: nothing imported)
    from importlib import metadata

    def installed(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    mpi4py = installed("mpi4py")  # (what hvd.init() under mpirun without MASTER_ADDR uses)
    assert (f"[X] mpi4py {mpi4py} (" if mpi4py else "[ ] mpi4py (not installed: ") in out, out
    # (TensorFlow's CPU build is the distribution tensorflow-cpu, the same package)
    tensorflow, keras = installed("tensorflow", "tensorflow-cpu"), installed("keras")
    assert (f"[X] TensorFlow {tensorflow}" if tensorflow else "[ ] TensorFlow") in out, out
    if keras is None:
        assert "[ ] Keras" in out, out
    elif not keras.startswith("3."):  # (Keras 2 is TensorFlow's own)
        assert f"Keras {keras}" in out, out
    elif tensorflow:
        assert f"[X] Keras {keras}, backend tensorflow" in out, out
    else:
        assert f"[ ] Keras {keras}, backend tensorflow (" in out, out
        assert "this backend needs TensorFlow" in out, out
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    torch_backend = subprocess.run(
        [sys.executable, "-m", "hvdrun", "--check-build"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    ).stdout
    if keras is not None and keras.startswith("3."):
        expected = f"[X] Keras {keras}, backend torch (collectives.keras)"
        assert expected in torch_backend, torch_backend


def test_check_build_says_which_launcher_started_the_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HVDRUN_"))}
    env.update(
        OMPI_COMM_WORLD_RANK="1",
        OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    result = subprocess.run(
        [sys.executable, "-m", "hvdrun", "--check-build"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Launcher of this process (what hvd.init() would join):" in result.stdout
    assert "    Open MPI (mpirun): rank 1 of 4, local rank 1 of 2\n" in result.stdout


def test_hostfile_errors_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=two\n")
    assert run_cli(["--hostfile", str(hostfile), "true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"hvdrun: error: invalid '--hostfile': {hostfile} line 2: slot count 'two' in "
        "'b slots=two' is not a number\n"
    )


def test_too_many_processes_for_the_hostfile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    assert run_cli(["-np", "3", "--hostfile", str(hostfile), "true"]) == 2
    assert "3 processes requested but the hostfile has only 2 slot(s)" in capsys.readouterr().err


def test_check_hosts_on_this_machine() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hvdrun", "--check-hosts", "-H", "localhost:2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["HOST", "STATUS", "PYTHON"]
    assert lines[1].split()[:3] == ["localhost", "ok", ".".join(map(str, sys.version_info[:3]))]
    assert lines[1].split()[-2:] == ["lo", "127.0.0.1"]
    assert lines[-1] == "1 of 1 host(s) usable"


def test_a_ctrl_c_while_the_cli_is_imported_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.abc

    from hvdrun import command

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, *args: object) -> None:
            if name == "hvdrun.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "hvdrun.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    with pytest.raises(SystemExit) as exited:
        command.main()
    assert exited.value.code == 130
    assert capsys.readouterr().err == "\nhvdrun: interrupted before the job started\n"


def test_a_ctrl_c_while_the_command_line_is_read_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C before hvdrun's own handlers are in place (reading the command line): exit
    130 and a line that says nothing started, not click's bare newline alone."""
    from hvdrun import cli as cli_module

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "read_hosts", interrupted)
    assert cli_module.run_cli(["-np", "1", "true"]) == 130
    assert capsys.readouterr().err == "\nhvdrun: interrupted before the job started\n"


def test_check_build_marks_a_keras_backend_collectives_keras_cannot_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hvdrun.check_build import framework_lines

    monkeypatch.setenv("KERAS_BACKEND", "jax")
    lines = [line for line in framework_lines() if "Keras 3" in line]
    if not lines:
        pytest.skip("Keras 3 is not installed")
    assert lines[0].startswith("    [ ] Keras 3"), lines
    assert lines[0].endswith(
        "backend jax (collectives.keras needs its tensorflow or torch backend)"
    ), lines


def test_check_build_says_how_to_install_a_missing_framework(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hvdrun import check_build

    monkeypatch.setattr(check_build, "_version", lambda *distributions: None)
    assert list(check_build.framework_lines()) == [
        "    [ ] TensorFlow (not installed: pip install 'hvdrun[tensorflow]', for "
        "collectives.tensorflow)",
        "    [ ] Keras (not installed: pip install 'hvdrun[keras]', for collectives.keras)",
    ]


def test_a_deleted_current_directory_is_one_line(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    result = subprocess.run(
        ["sh", "-c", f"cd {gone} && rmdir {gone} && exec {sys.executable} -m hvdrun -np 2 true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": with_repo_on_path()},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "hvdrun: error: the current directory no longer exists (it was deleted or moved): cd "
        "to one that does\n"
    )


def test_a_file_on_hvdrun_s_stdin_is_said_to_reach_no_worker(tmp_path: Path) -> None:
    # (mpirun gives it to rank 0; an empty file, /dev/null or a pipe says nothing)
    data = tmp_path / "data.txt"
    data.write_text("some input\n")
    note = "hvdrun: note: hvdrun's stdin is a file (hvdrun ... < FILE) that no worker reads"
    for stdin, said in ((data, True), (tmp_path / "empty", False), (Path(os.devnull), False)):
        stdin.touch()
        with stdin.open() as handle:
            result = subprocess.run(
                [sys.executable, "-m", "hvdrun", "-np", "1", "true"],
                stdin=handle,
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "PYTHONPATH": with_repo_on_path()},
            )
        assert result.returncode == 0, result.stderr
        assert (note in result.stderr) == said, (stdin, result.stderr)
    # a shell run as "bash < job.sh" that starts hvdrun: the file is the shell's script
    job = tmp_path / "job.sh"
    job.write_text(f"{sys.executable} -m hvdrun -np 1 true\n")
    with job.open() as handle:
        result = subprocess.run(
            ["bash"],
            stdin=handle,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": with_repo_on_path()},
        )
    assert result.returncode == 0 and note not in result.stderr, result.stderr


def test_a_loopback_interface_that_is_down_is_said_at_once() -> None:
    # (a fresh network namespace, a container without networking set up: the workers'
    # rendezvous on 127.0.0.1 was "Network is unreachable" after 17 s)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a network namespace of its own")
    result = subprocess.run(
        ["unshare", "-n", sys.executable, "-m", "hvdrun", "-np", "2", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": with_repo_on_path()},
    )
    assert result.returncode == 1
    assert result.stderr == (
        "hvdrun: error: this machine's loopback interface (lo) is down, and a job on this "
        "machine alone talks over it: bring it up (ip link set lo up)\n"
    )


def test_x_of_a_variable_not_set_here_is_a_note_as_with_mpirun(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``mpirun -x LD_LIBRARY_PATH`` lines carried over run where it is not set: mpirun
    warns and runs, and so does hvdrun."""
    from hvdrun.cli import run_cli

    assert run_cli(["--dry-run", "-x", "NOT_SET_ANYWHERE_XYZ", "-np", "1", "true"]) == 0
    out, err = capsys.readouterr()
    assert (
        "hvdrun: note: -x NOT_SET_ANYWHERE_XYZ: NOT_SET_ANYWHERE_XYZ is not set here, so the "
        "workers do not get it (give a value with -x NOT_SET_ANYWHERE_XYZ=VALUE)\n"
    ) in err
    assert "NOT_SET_ANYWHERE_XYZ=" not in out


def test_x_of_a_variable_hvdrun_sets_itself_says_it_is_not_used(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hvdrun.cli import run_cli

    assert run_cli(["--dry-run", "-x", "RANK=7", "-x", "HVDRUN_SECRET=s", "-np", "1", "true"]) == 0
    _, err = capsys.readouterr()
    assert (
        "hvdrun: note: -x HVDRUN_SECRET, RANK: hvdrun sets these for each worker (its place in "
        "the job and the job's rendezvous); the values given are not used\n"
    ) in err


def test_a_module_named_as_a_worker_package_beside_the_script_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Python puts the script's directory first on sys.path: a collectives.py or rendezvous/
    # package there hides hvdrun's, and every worker's import collectives.torch fails.
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert hidden_packages_note([sys.executable, str(script)]) is None
    (tmp_path / "rendezvous").mkdir()
    assert hidden_packages_note([sys.executable, str(script)]) is None  # a namespace: harmless
    (tmp_path / "rendezvous" / "__init__.py").write_text("")
    (tmp_path / "collectives.py").write_text("")
    note = hidden_packages_note([sys.executable, "-u", str(script)])
    assert note == (
        f"warning: {tmp_path / 'collectives.py'} and {tmp_path / 'rendezvous'} hide hvdrun's "
        "packages of that name from the workers (Python puts the script's directory first on "
        "sys.path), so their import collectives.torch (or another frontend) fails: rename them"
    )
    assert hidden_packages_note(["bash", str(script)]) is None
    assert hidden_packages_note([sys.executable, "-c", "pass"]) is None
    assert run_cli(["-np", "1", sys.executable, str(script)]) == 0
    assert f"hvdrun: warning: {tmp_path / 'collectives.py'} and " in capsys.readouterr().err


def test_ssh_files_given_with_a_tilde_after_an_equals_sign_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The shell expands ~ only at a word's start: -i=~/.ssh/key reaches hvdrun as it is
    # written (horovodrun passes it to ssh, which expands it); it was "does not exist".
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "key").write_text("not a real key\n")
    (tmp_path / ".ssh" / "cfg").write_text("Host otherhost\n  Port 2222\n")
    argv = ["--dry-run", "-H", "otherhost:1", "-i=~/.ssh/key", "--ssh-config-file=~/.ssh/cfg"]
    assert run_cli([*argv, "true"]) == 0, capsys.readouterr().err
    assert "otherhost" in capsys.readouterr().out


def test_hosts_that_name_this_machine_twice_get_a_note() -> None:
    # -H localhost:1,127.0.0.1:1 runs as two hosts (as in horovodrun; a way to stand in for
    # two hosts), each with local rank 0: on a GPU machine both workers would take cuda:0.
    def run(hosts: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "hvdrun", "-np", "2", "-H", hosts, "--no-report", "true"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    twice = run("localhost:1,127.0.0.1:1")
    assert twice.returncode == 0, twice.stderr
    assert (
        "hvdrun: note: the hosts name this machine 2 times (localhost, 127.0.0.1): they run as "
        "2 hosts, as in horovodrun, each with local ranks from 0, so workers that choose "
        "cuda:<local_rank> share GPUs; name it once (e.g. -H localhost:2)"
    ) in twice.stderr
    # Only hosts that get workers count: the second one here gets none.
    for hosts in ("localhost:2", "localhost:2,127.0.0.1:2"):
        once = run(hosts)
        assert once.returncode == 0 and "name this machine" not in once.stderr, once.stderr
