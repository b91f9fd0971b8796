"""The CLI boundary: every user mistake is one line and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvdrun import __version__
from hvdrun.cli import run_cli


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
        (["-H", "a:1,a:1", "true"], "'a' is listed more than once"),
        (["-np", "2"], "no command given"),
        (["true"], "give the number of processes with -np N"),
        (["-np", "two", "true"], "'two' is not a valid integer"),
        (["--no-such-flag", "true"], "No such option '--no-such-flag'"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdrun: error: ")
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_missing_command_and_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["-np", "2", "no-such-program-xyz"]) == 127
    assert "hvdrun: error: command not found: no-such-program-xyz" in capsys.readouterr().err
    assert run_cli(["-np", "2", sys.executable, "missing_script.py"]) == 2
    assert "hvdrun: error: script not found: missing_script.py" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out == f"hvdrun {__version__}\n"


def test_help_mentions_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("-np", "--hosts", "--check-build", "--version"):
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
    result = subprocess.run(
        [sys.executable, "-m", "hvdrun", "--check-build"],
        capture_output=True,
        text=True,
        timeout=60,
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
