"""horovodrun's command lines work under hvdrun: every flag is accepted, with its effect,
its notice, or one line saying what to do instead (issue 14)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from hvdrun.cli import cli, run_cli
from hvdrun.logging_setup import reset_logging
from tests.cli.conftest import assert_usage_error


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    yield None
    reset_logging()


def plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """``hvdrun --dry-run ARGV``: its plan (stdout) and notes (stderr); it must succeed."""
    code = run_cli(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def options_of(name: str) -> list[str]:
    return next(p.opts + p.secondary_opts for p in cli.params if p.name == name)


@pytest.mark.parametrize(
    ("name", "spellings"),
    [
        ("num_proc", ["-np", "--num-proc"]),
        ("hostfile", ["-hostfile", "--hostfile"]),
        ("check_build", ["-cb", "--check-build"]),
        ("version", ["-v", "--version"]),
        ("ssh_port", ["-p", "--ssh-port"]),
        ("identity_files", ["-i", "--ssh-identity-file"]),
        (
            "prefix_timestamp",
            ["-prefix-timestamp", "--prefix-timestamp", "--prefix-output-with-timestamp"],
        ),
        ("min_np", ["--min-np", "--min-num-proc"]),
        ("max_np", ["--max-np", "--max-num-proc"]),
        ("log_hide_timestamp", ["--log-hide-timestamp", "--no-log-hide-timestamp"]),
        ("log_without_timestamp", ["--log-without-timestamp", "--log-with-timestamp"]),
    ],
)
def test_horovod_spellings(name: str, spellings: list[str]) -> None:
    assert set(spellings) <= set(options_of(name))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--gloo"], []),
        (["--disable-cache"], []),
        (["--gloo-timeout-seconds", "60"], ["HVDRUN_GLOO_TIMEOUT_SECONDS=60"]),
        (["--hierarchical-allreduce"], ["HOROVOD_HIERARCHICAL_ALLREDUCE=1"]),
        (["--no-hierarchical-allreduce"], ["HOROVOD_HIERARCHICAL_ALLREDUCE=0"]),
        (["--hierarchical-allgather"], ["HOROVOD_HIERARCHICAL_ALLGATHER=1"]),
        (["--no-hierarchical-allgather"], ["HOROVOD_HIERARCHICAL_ALLGATHER=0"]),
        (["--torus-allreduce"], ["HOROVOD_TORUS_ALLREDUCE=1"]),
        (["--no-torus-allreduce"], ["HOROVOD_TORUS_ALLREDUCE=0"]),
        (["--num-nccl-streams", "2"], ["HOROVOD_NUM_NCCL_STREAMS=2"]),
        (["--thread-affinity", "3"], ["HOROVOD_THREAD_AFFINITY=3"]),
        (["--ccl-bgt-affinity", "4"], ["HOROVOD_THREAD_AFFINITY=4"]),
        (["--mlsl-bgt-affinity", "5"], ["HOROVOD_THREAD_AFFINITY=5"]),
        (["--mpi-threads-disable"], ["HOROVOD_MPI_THREADS_DISABLE=1"]),
        (["--no-mpi-threads-disable"], ["HOROVOD_MPI_THREADS_DISABLE=0"]),
        (["--log-level", "INFO"], ["HOROVOD_LOG_LEVEL=INFO"]),
        (["--log-level", "trace"], ["HOROVOD_LOG_LEVEL=TRACE"]),
        (["--log-hide-timestamp"], ["HOROVOD_LOG_HIDE_TIME=1"]),
        (["--log-without-timestamp"], ["HOROVOD_LOG_HIDE_TIME=1"]),
        (["--log-with-timestamp"], []),
        (["--no-log-hide-timestamp"], []),
        (
            ["--network-interfaces", "eth0,eth1", "--network-interface", "eth2"],
            # (Gloo the first, as horovodrun: torch's would use each, lo or docker0 too)
            ["GLOO_SOCKET_IFNAME=eth2", "NCCL_SOCKET_IFNAME=eth2,eth0,eth1"],
        ),
        (
            ["--network-interface", "eth0", "--network-interface", "eth1,eth0"],
            ["GLOO_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=eth0,eth1"],
        ),
        (["--fusion-threshold-mb", "32"], ["HVDRUN_FUSION_THRESHOLD=33554432"]),
        (["--cycle-time-ms", "5"], ["HVDRUN_CYCLE_TIME=5"]),
        (["--timeline-filename", "/tmp/t.json"], ["HVDRUN_TIMELINE=/tmp/t.json"]),
        (["--no-stall-check"], ["HVDRUN_STALL_CHECK_DISABLE=1"]),
        (["--stall-check-warning-time-seconds", "9"], ["HVDRUN_STALL_CHECK_TIME_SECONDS=9"]),
        (["--prefix-output-with-timestamp"], []),
        (["-prefix-timestamp"], []),
        (["--verbose"], []),
        (["--stall-check"], []),
        (["--no-timeline-mark-cycles"], []),
        (["--no-autotune"], []),
        (["--num-proc", "1"], []),
    ],
)
def test_every_flag_is_accepted_with_its_effect(
    flags: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = plan(["-np", "1", *flags, "true"], capsys)
    env = {line.strip() for line in out.splitlines() if line.startswith("  ")}
    for line in expected:
        assert line in env, out


def test_flags_without_effect_get_one_notice(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["-np", "1", "--hierarchical-allreduce", "--num-nccl-streams", "2", "true"]
    _, err = plan(argv, capsys)
    notes = [line for line in err.splitlines() if "no effect yet" in line]
    assert notes == [
        "hvdrun: note: --hierarchical-allreduce, --num-nccl-streams accepted for Horovod "
        "compatibility but no effect yet (the workers get HOROVOD_HIERARCHICAL_ALLREDUCE, "
        "HOROVOD_NUM_NCCL_STREAMS)"
    ]
    _, err = plan(["-np", "1", "--no-hierarchical-allreduce", "--gloo", "true"], capsys)
    assert "no effect" not in err


def test_horovods_choice_of_mpi_or_ccl_in_the_environment_gets_a_note(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--mpi is refused with advice; the variables that ask a Horovod worker for MPI or
    oneCCL are not hvdrun's to refuse (they may be left in a shell), but they are said."""
    monkeypatch.setenv("HOROVOD_CONTROLLER", "mpi")
    _, err = plan(["-np", "1", "-x", "HOROVOD_CPU_OPERATIONS=ccl", "true"], capsys)
    assert (
        "hvdrun: note: HOROVOD_CONTROLLER=mpi has no effect: hvdrun's workers run their "
        "collectives on Gloo (NCCL for CUDA tensors)\n"
    ) in err
    assert "hvdrun: note: HOROVOD_CPU_OPERATIONS=ccl has no effect" in err
    monkeypatch.setenv("HOROVOD_CONTROLLER", "gloo")
    assert "has no effect" not in plan(["-np", "1", "true"], capsys)[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mpi"], "hvdrun does not drive MPI: it starts the workers itself"),
        (["--jsrun"], "hvdrun does not drive jsrun"),
        (["--mpi-args=--map-by ppr:6:node"], "so --mpi-args has nothing to go to"),
        (["--binding-args", "--rankfile f"], "so --binding-args has nothing to go to"),
    ],
)
def test_mpi_flags_say_what_to_do_instead(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(["-np", "2", *argv, "python", "train.py"], message, capsys)


def test_tcp_keeps_nccl_off_infiniband_unless_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    out, _ = plan(["-np", "1", "--tcp", "true"], capsys)
    assert "  NCCL_IB_DISABLE=1" in out.splitlines()
    out, _ = plan(["-np", "1", "true"], capsys)
    assert "NCCL_IB_DISABLE" not in out
    out, _ = plan(["-np", "1", "--tcp", "-x", "NCCL_IB_DISABLE=0", "true"], capsys)
    assert "  NCCL_IB_DISABLE=0" in out.splitlines()
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")
    out, _ = plan(["-np", "1", "--tcp", "true"], capsys)
    assert "  NCCL_IB_DISABLE=0" in out.splitlines()


def test_hidden_opposites_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """horovodrun writes HOROVOD_STALL_CHECK_DISABLE=0 and HOROVOD_TIMELINE_MARK_CYCLES=0
    for --stall-check and --no-timeline-mark-cycles: the flags win over hvdrun's environment."""
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "1")
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    argv = ["-np", "1", "--stall-check", "--no-timeline-mark-cycles"]
    out, _ = plan([*argv, "--timeline-filename", "t.json", "true"], capsys)
    assert "stall check disabled    0  (from --stall-check)" in out
    assert "timeline marks cycles   0  (from --no-timeline-mark-cycles)" in out
    monkeypatch.setenv("HOROVOD_LOG_HIDE_TIME", "1")
    out, _ = plan(["-np", "1", "--log-with-timestamp", "true"], capsys)
    assert "  HOROVOD_LOG_HIDE_TIME=0" in out.splitlines()
    monkeypatch.delenv("HOROVOD_LOG_HIDE_TIME")
    # (and without them, the environment's values stand)
    out, _ = plan(["-np", "1", "--timeline-filename", "t.json", "true"], capsys)
    assert "stall check disabled    1  (from HOROVOD_STALL_CHECK_DISABLE)" in out
    assert "timeline marks cycles   1  (from HOROVOD_TIMELINE_MARK_CYCLES)" in out


def test_horovod_variables_without_effect_are_noted_wherever_they_were_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job script's exports, a cluster's defaults: as the flags are, in one line, unless
    off (0) or already noted for its flag."""
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLGATHER", "0")
    monkeypatch.setenv("HOROVOD_TORUS_ALLREDUCE", "false")  # (off, as a switch reads it)
    monkeypatch.setenv("HOROVOD_THREAD_AFFINITY", "0")  # (a value: core 0)
    monkeypatch.setenv("HOROVOD_DISABLE_GROUP_FUSION", "1")
    _, err = plan(["-np", "1", "-x", "HOROVOD_NUM_NCCL_STREAMS=2", "true"], capsys)
    assert (
        "hvdrun: note: HOROVOD_HIERARCHICAL_ALLREDUCE=1, HOROVOD_NUM_NCCL_STREAMS=2, "
        "HOROVOD_THREAD_AFFINITY=0, HOROVOD_DISABLE_GROUP_FUSION=1 accepted for Horovod "
        "compatibility but no effect in hvdrun's workers\n"
    ) in err, err
    _, err = plan(["-np", "1", "--hierarchical-allreduce", "true"], capsys)
    assert "note: --hierarchical-allreduce accepted" in err
    assert "HOROVOD_HIERARCHICAL_ALLREDUCE=1," not in err
    assert "HOROVOD_DISABLE_GROUP_FUSION=1 accepted" in err


@pytest.mark.parametrize("flag", ["--ccl-bgt-affinity", "--mlsl-bgt-affinity"])
def test_older_spellings_of_thread_affinity_are_hidden_aliases(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Older horovodrun's names of --thread-affinity: its values, its note, out of --help."""
    _, err = plan(["-np", "1", flag, "3", "true"], capsys)
    assert (
        f"hvdrun: note: {flag} accepted for Horovod compatibility but no effect yet (the "
        "workers get HOROVOD_THREAD_AFFINITY)\n"
    ) in err
    _, err = plan(["-np", "1", "--thread-affinity", "1", flag, "3", "true"], capsys)
    assert f"--thread-affinity, {flag} accepted" in err
    assert "(the workers get HOROVOD_THREAD_AFFINITY)\n" in err
    assert_usage_error(
        ["-np", "1", flag, "-1", "true"], f"Invalid value for '{flag}': -1 is not in the", capsys
    )
    assert run_cli(["--help"]) == 0
    assert "bgt" not in capsys.readouterr().out


def test_dry_run_warns_of_an_interface_this_machine_lacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run stops with a usage error; --dry-run shows the plan and says that it would."""
    _, err = plan(["-np", "1", "--network-interface", "bogus0", "true"], capsys)
    assert (
        "hvdrun: warning: Invalid value for '--network-interface': this machine has no "
        "network interface bogus0; it has "
    ) in err, err
    assert ": a run stops here\n" in err, err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--network-interface", ""), ("--network-interface", " "), ("--network-interfaces", ",")],
)
def test_an_interface_flag_that_names_no_interface_is_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(
        ["-np", "1", flag, value, "true"],
        f"Invalid value for '{flag}': {value!r} names no interface (give IFNAME[,IFNAME], "
        "e.g. eth0)",
        capsys,
    )


def test_start_timeout_error_names_the_timeout_and_how_to_raise_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_cli(["--start-timeout", "0.001", "-np", "1", "-H", "localhost:1", "true"]) == 255
    err = capsys.readouterr().err
    assert "could not start the job on 1 of 1 host(s):\n  localhost  timed out" in err
    assert err.endswith(
        "\nthe start timeout (0.001 s) ran out: give the hosts longer with --start-timeout "
        "SECONDS (or HOROVOD_START_TIMEOUT=SECONDS)\n"
    )


def test_a_stall_shutdown_time_below_the_warning_time_gets_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Horovod's stall inspector does not shut the job down at a time below its warning
    time: hvdrun says so before the job starts, wherever the two times came from."""
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    monkeypatch.delenv("HOROVOD_STALL_CHECK_TIME_SECONDS", raising=False)
    shutdown = ["-np", "1", "--stall-check-shutdown-time-seconds"]
    _, err = plan([*shutdown, "30", "true"], capsys)
    assert (
        "hvdrun: note: --stall-check-shutdown-time-seconds 30 is below the stall warning time "
        "(60 s): as in Horovod, a stall will not shut the job down; set it to at least 60 s\n"
    ) in err
    assert run_cli([*shutdown, "30", "true"]) == 0  # (the job runs, with the same note)
    assert "--stall-check-shutdown-time-seconds 30 is below" in capsys.readouterr().err
    config = tmp_path / "cfg.yaml"
    config.write_text("stall_check:\n  warning_time_seconds: 120\n  shutdown_time_seconds: 90\n")
    _, err = plan(["--config-file", str(config), "-np", "1", "true"], capsys)
    assert "seconds 90 is below the stall warning time (120 s)" in err
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5")  # (named as it was set)
    assert (
        "hvdrun: note: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5 is below the stall warning "
        in (plan(["-np", "1", "true"], capsys)[1])
    )
    # no note: never (0), at or above the warning time, or the stall check off
    for argv in (["0"], ["60"], ["9", "--stall-check-warning-time-seconds", "8"]):
        assert "below the stall" not in plan([*shutdown, *argv, "true"], capsys)[1]
    assert "below the stall" not in plan([*shutdown, "30", "--no-stall-check", "true"], capsys)[1]


@pytest.mark.parametrize(("value", "shown"), [("2", "1"), ("-1", "0"), ("yes", "1")])
def test_log_hide_time_variable_reads_whole_numbers_as_horovod_does(
    value: str, shown: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Horovod reads HOROVOD_LOG_HIDE_TIME with strtol(value) > 0."""
    monkeypatch.setenv("HOROVOD_LOG_HIDE_TIME", value)
    out, _ = plan(["-np", "1", "true"], capsys)
    assert f"  HOROVOD_LOG_HIDE_TIME={shown}" in out.splitlines()
    monkeypatch.setenv("HOROVOD_LOG_HIDE_TIME", "maybe")
    assert_usage_error(["-np", "1", "true"], "'maybe' is not a valid boolean", capsys)


def test_start_and_elastic_timeouts_read_horovod_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "7")
    out, _ = plan(["-np", "1", "true"], capsys)
    assert "start timeout: 7 s" in out
    out, _ = plan(["-np", "1", "--start-timeout", "9", "true"], capsys)
    assert "start timeout: 9 s" in out  # the flag wins
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    out, _ = plan(["-np", "1", "--min-num-proc", "1", "--max-num-proc", "2", "true"], capsys)
    assert "elastic: min-np 1, max-np 2, elastic timeout 42 s" in out
    # ... and a fixed job does not mistake the variable for a misplaced --elastic-timeout
    plan(["-np", "1", "true"], capsys)


def test_log_level_from_horovod_variable_configures_hvdrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "debug")
    out, _ = plan(["-np", "1", "true"], capsys)
    assert "  HOROVOD_LOG_LEVEL=DEBUG" in out.splitlines()
    assert logging.getLogger("launcher").getEffectiveLevel() == logging.DEBUG
    # Python's names of levels, which the workers take too: read as the level they name
    for exported, level in (("warn", "WARNING"), ("CRITICAL", "FATAL")):
        monkeypatch.setenv("HOROVOD_LOG_LEVEL", exported)
        out, _ = plan(["-np", "1", "true"], capsys)
        assert f"  HOROVOD_LOG_LEVEL={level}" in out.splitlines()
    assert (
        "  HOROVOD_LOG_LEVEL=WARNING"
        in plan(["-np", "1", "--log-level", "Warn", "true"], capsys)[0]
    )


def test_hosts_flag_given_a_file_suggests_hostfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n")
    assert_usage_error(
        ["-np", "2", "-H", "hosts.txt", "true"],
        "-H takes host names (host1:4,host2:4), and 'hosts.txt' is a file here: "
        "read it with --hostfile hosts.txt",
        capsys,
    )
    out, _ = plan(["-np", "2", "-hostfile", "hosts.txt", "true"], capsys)
    assert "localhost  2 worker(s)" in out


def test_omp_notice_only_when_a_host_runs_several_workers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    omp = "OMP_NUM_THREADS is not set"
    assert omp in plan(["-np", "2", "true"], capsys)[1]
    assert omp not in plan(["-np", "1", "true"], capsys)[1]
    assert omp not in plan(["-np", "2", "-H", "a.invalid:1,b.invalid:1", "true"], capsys)[1]
    assert omp not in plan(["-np", "2", "-x", "OMP_NUM_THREADS=3", "true"], capsys)[1]


def test_help_is_grouped_in_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    out = capsys.readouterr().out
    titles = [
        "Processes and hosts:",
        "SSH:",
        "Starting and supervising:",
        "Environment and network:",
        "Output:",
        "Logging:",
        "Elastic jobs:",
        "Tuning (passed to the workers):",
        "Horovod compatibility:",
        "Planning and information:",
    ]
    positions = [out.index(f"\n{title}\n") for title in titles]
    assert positions == sorted(positions)
    assert "Other options" not in out  # every flag has its section (help_sections.SECTIONS)
    assert out.count("[COMMAND]...") == 1  # in the usage line only
    for param in cli.params:
        if getattr(param, "hidden", False) or param.name == "command":
            continue
        assert max(param.opts, key=len) in out, param.name


def test_verbose_shows_hvdrun_and_agent_messages_and_omp_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One real launch: --verbose turns on the logs of hvdrun and of the host's agent, and
    two workers on this machine share its cores through OMP_NUM_THREADS."""
    code = "import os; print('omp', os.environ['OMP_NUM_THREADS'], os.environ['HOROVOD_LOG_LEVEL'])"
    assert (
        run_cli(["-np", "2", "--verbose", "--log-level", "INFO", sys.executable, "-c", code]) == 0
    )
    out, err = capsys.readouterr()
    cores = len(os.sched_getaffinity(0))
    assert out.count(f"omp {max(1, cores // 2)} INFO") == 2, out
    # hvdrun's own records (with the time) and its rendezvous server's; no grpc noise
    assert "] hvdrun INFO rendezvous.server: rendezvous server for job" in err
    assert "grpc" not in err
    assert "hvdrun agent: DEBUG launcher.agent.session: starting 2 worker(s)" in err
    assert err.count("OMP_NUM_THREADS is not set") == 1


def test_a_bad_horovod_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "soon")
    assert_usage_error(["-np", "1", "true"], "(from HOROVOD_START_TIMEOUT)", capsys)
    monkeypatch.delenv("HOROVOD_START_TIMEOUT")
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "loud")
    assert_usage_error(["-np", "1", "true"], "'loud' is not one of", capsys)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HOROVOD_START_TIMEOUT", "abc"),
        ("HOROVOD_LOG_LEVEL", "bogus"),
        ("HOROVOD_LOG_HIDE_TIME", "maybe"),
        ("HOROVOD_ELASTIC_TIMEOUT", "abc"),
    ],
)
def test_variables_an_invocation_does_not_use_never_stop_it(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--version and --check-build answer whatever the environment holds, wherever they
    stand; a fixed-size job runs whatever the elastic-only variable holds."""
    import hvdrun.check_build

    monkeypatch.setattr(hvdrun.check_build, "build_report", lambda: ["(the build report)"])
    monkeypatch.setenv(variable, value)
    for argv in (["--version"], ["-np", "2", "-v"], ["-v", "--start-timeout", "x"]):
        assert run_cli(argv) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("hvdrun ")
    for argv in (["-cb"], ["--check-build"], ["-np", "1", "-cb"]):
        assert run_cli(argv) == 0, capsys.readouterr().err
        assert capsys.readouterr().out == "(the build report)\n"
    if variable == "HOROVOD_ELASTIC_TIMEOUT":
        plan(["-np", "1", "true"], capsys)
        # (an elastic job uses it: a bad value is the error it was)
        assert_usage_error(
            ["--dry-run", "-np", "1", "--min-np", "1", "true"],
            "HOROVOD_ELASTIC_TIMEOUT must be a number, got 'abc'",
            capsys,
        )


def test_a_bad_elastic_timeout_variable_names_the_flag_and_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HVDRUN_ELASTIC_TIMEOUT", "5")  # (passes the workers' check)
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "-1")
    assert_usage_error(
        ["--dry-run", "-np", "1", "--min-np", "1", "true"],
        "Invalid value for '--elastic-timeout': -1 is not in the range x>0 "
        "(from HOROVOD_ELASTIC_TIMEOUT)",
        capsys,
    )
    out, _ = plan(["-np", "1", "--min-np", "1", "--elastic-timeout", "7", "true"], capsys)
    assert "elastic timeout 7 s" in out  # (the flag wins over the variable)


def test_dry_run_never_contacts_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(
        ["--dry-run", "--check-hosts", "-H", "a.invalid"],
        "--check-hosts contacts the hosts",
        capsys,
    )


def test_output_directories_are_zero_padded_from_ten_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    assert run_cli(["-np", "11", "--output-filename", str(out_dir), "true"]) == 0
    assert sorted(os.listdir(out_dir)) == [f"rank.{rank:02d}" for rank in range(11)]


def test_warnings_without_log_flags_read_as_hvdrun_messages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With no logging flag, a warning of the launcher still shows, worded as hvdrun's own
    messages (Python's fallback printed it bare); info stays quiet."""
    from hvdrun.logging_setup import LogSettings, configure_logging

    configure_logging(LogSettings())
    logging.getLogger("launcher.transport.ssh").warning("could not add the host key of %s", "n1")
    logging.getLogger("launcher.transport.ssh").info("connected")
    assert capsys.readouterr().err == "hvdrun: warning: could not add the host key of n1\n"
