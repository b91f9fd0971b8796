"""The elastic flags at the CLI boundary: each mistake is one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvdrun.cli import run_cli
from tests.cli.conftest import assert_usage_error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--min-np", "3", "-np", "2", "true"],
            "invalid '--min-np': must be between 1 and -np (2)",
        ),
        (["--min-np", "0", "-np", "2", "true"], "invalid '--min-np': must be between 1 and -np"),
        (
            ["--min-np", "1", "--max-np", "1", "-np", "2", "true"],
            "invalid '--max-np': must be at least -np (2)",
        ),
        (["--host-discovery-script", "echo a", "true"], "an elastic job needs -np N"),
        # (--max-np alone leaves the job fixed, as with horovodrun: -np is needed)
        (["--max-np", "4", "true"], "give the number of processes with -np N"),
        (["--min-np", "1", "-np", "2", "--reset-limit", "-1", "true"], "must not be negative"),
        (
            ["--min-np", "1", "-np", "2", "--blacklist-cooldown-range", "5", "1", "true"],
            "invalid '--blacklist-cooldown-range': needs 0 < MIN <= MAX, got 5 1",
        ),
        (
            ["--min-np", "1", "-np", "2", "--slots-per-host", "0", "true"],
            "invalid '--slots-per-host': must be at least 1, got 0",
        ),
        (["--min-np", "1", "-np", "2", "--elastic-timeout", "0", "true"], "0 is not in the range"),
        (
            ["--host-discovery-script", "true", "-H", "a:1", "-np", "1", "true"],
            "give the hosts with --host-discovery-script or with -H/--hostfile, not both",
        ),
        (
            ["--host-discovery-script", "exit 3", "-np", "1", "true"],
            "invalid '--host-discovery-script': exit 3: exited with code 3",
        ),
        (
            ["--host-discovery-script", "echo 'a:x'", "-np", "1", "true"],
            "invalid '--host-discovery-script': echo 'a:x': line 1: slot count 'x' in 'a:x'",
        ),
        (["--min-np", "1", "-np", "2"], "no command given"),
    ],
)
def test_bad_elastic_input_is_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--reset-limit", "2"], ["--reset-limit"]),
        (["--max-np", "4"], ["--max-np"]),
        (["--max-np", "1"], ["--max-np"]),
        (["--elastic-timeout", "5"], ["--elastic-timeout"]),
        (["--slots-per-host", "2"], ["--slots-per-host"]),
        (["--blacklist-cooldown-range", "1", "10"], ["--blacklist-cooldown-range"]),
        (
            ["--slots=2", "--elastic-t", "5", "--reset-limit", "0"],
            ["--slots-per-host", "--elastic-timeout", "--reset-limit"],
        ),
    ],
)
@pytest.mark.parametrize("program", ["true", "false"])
def test_elastic_only_flags_on_a_fixed_job_are_noted_and_the_job_runs(
    flags: list[str], names: list[str], program: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # horovodrun ignores them in a job that is not elastic: the command line must work.
    code = run_cli(["-np", "2", *flags, program])
    err = capsys.readouterr().err
    assert code == (0 if program == "true" else 1)  # the job's own exit code
    notes = [line for line in err.splitlines() if "has no effect" in line]
    assert notes == [
        f"hvdrun: note: {name} has no effect: the job is not elastic (--min-np or "
        "--host-discovery-script makes it elastic)"
        for name in names
    ]


def test_max_np_alone_leaves_the_job_fixed(capsys: pytest.CaptureFixture[str]) -> None:
    """horovodrun's job is elastic only with --min-np or --host-discovery-script."""
    assert run_cli(["--dry-run", "-np", "2", "--max-np", "4", "true"]) == 0
    out, err = capsys.readouterr()
    assert "elastic:" not in out
    assert "start timeout: 30 s; agent timeout: 30 s" in out  # (not the elastic 5 s)
    assert "collective timeout      30 s  (default)" in out
    assert "--max-np has no effect: the job is not elastic" in err
    assert run_cli(["--dry-run", "-np", "2", "--min-np", "1", "--max-np", "4", "true"]) == 0
    assert "elastic: min-np 1, max-np 4" in capsys.readouterr().out


def test_a_host_the_script_prints_twice_takes_its_last_lines_slots(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = "printf 'localhost:1\\nlocalhost:2\\n'"
    argv = ["--dry-run", "--host-discovery-script", script, "-np", "2", "true"]
    assert run_cli(argv) == 0
    out, err = capsys.readouterr()
    assert "the plan of the first discovery (localhost:2)" in out
    assert "prints host localhost more than once: its last line counts (2 slot(s))" in err


def test_discovery_script_failing_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'cannot reach the scheduler' >&2\nexit 1\n")
    script.chmod(0o755)
    assert run_cli(["--host-discovery-script", str(script), "-np", "1", "true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"hvdrun: error: invalid '--host-discovery-script': {script}: exited with code 1: "
        "cannot reach the scheduler\n"
    )


SINGLE_HOST = (
    "hvdrun: warning: this elastic job has one host (localhost, {given}): a failure of any "
    "of its workers fails the host and ends the job; list at least 2 hosts (as horovodrun "
    "requires) or use --host-discovery-script to survive failures"
)


def test_an_elastic_job_on_one_fixed_host_is_warned_that_a_failure_ends_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """horovodrun refuses -H with fewer than 2 hosts in elastic mode; hvdrun runs it, with a
    warning, and none where the list may change (a discovery script) or has 2 hosts."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    for hosts, given in (
        (["-H", "localhost:2"], "from -H"),
        (["--hostfile", str(hostfile)], "from --hostfile"),
        ([], "no -H given"),  # (this machine)
    ):
        assert run_cli(["--dry-run", "-np", "2", "--min-np", "1", *hosts, "true"]) == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if "one host" in line]
        assert warnings == [SINGLE_HOST.format(given=given)]
    for argv in (
        ["--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
        ["--min-np", "1", "--host-discovery-script", "echo localhost:2"],
        ["-H", "localhost:2"],  # (not elastic)
    ):
        assert run_cli(["--dry-run", "-np", "2", *argv, "true"]) == 0
        assert "one host" not in capsys.readouterr().err
