"""``--config-file``: Horovod's YAML settings file; flags win; every mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvdrun.cli import run_cli
from hvdrun.logging_setup import reset_logging
from tests.cli.conftest import assert_usage_error

#: Horovod's own test file (test/single/data/config.test.yaml), key for key.
HOROVOD_CONFIG = """\
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: true

autotune:
  enabled: true
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9

timeline:
  filename: '/tmp/horovod_timeline.json'
  mark_cycles: true

stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  ccl_bgt_affinity: 1
  gloo_timeout_seconds: 60

logging:
  level: INFO
  hide_timestamp: true
"""


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    yield None
    reset_logging()


def environment(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """The worker variables ``hvdrun --dry-run ARGV`` plans."""
    code = run_cli(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    env = {}
    for line in out.splitlines():
        name, sep, value = line.strip().partition("=")
        if line.startswith("  ") and sep and name.replace("_", "").isalnum():
            env[name] = value
    return env


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_horovods_config_file_reaches_the_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = environment(
        ["--config-file", write(tmp_path, HOROVOD_CONFIG), "-np", "1", "true"], capsys
    )
    assert env["HVDRUN_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HVDRUN_CYCLE_TIME"] == "10"
    assert env["HVDRUN_TIMELINE"] == "/tmp/horovod_timeline.json"
    assert env["HVDRUN_TIMELINE_MARK_CYCLES"] == "1"
    assert env["HVDRUN_STALL_CHECK_DISABLE"] == "0"  # (enabled: true)
    assert env["HVDRUN_STALL_CHECK_TIME_SECONDS"] == "120"
    assert env["HVDRUN_STALL_SHUTDOWN_TIME_SECONDS"] == "240"
    assert env["HVDRUN_GLOO_TIMEOUT_SECONDS"] == "60"
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert env["HOROVOD_HIERARCHICAL_ALLGATHER"] == "1"
    assert env["HOROVOD_MPI_THREADS_DISABLE"] == "1"
    assert env["HOROVOD_NUM_NCCL_STREAMS"] == "2"
    assert env["HOROVOD_THREAD_AFFINITY"] == "1"
    assert env["HOROVOD_LOG_LEVEL"] == "INFO"
    assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
    # keys whose flags live elsewhere (the engine's) reach the workers all the same
    cache = [value for name, value in env.items() if name.endswith("CACHE_CAPACITY")]
    assert cache == ["2048"]
    assert any(name.endswith("AUTOTUNE") and value == "1" for name, value in env.items())


def test_command_line_wins_over_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, HOROVOD_CONFIG)
    argv = ["--fusion-threshold-mb", "256", "--config-file", config, "--cycle-time-ms", "20"]
    argv += ["--stall-check-warning-time-seconds", "5", "--no-hierarchical-allreduce"]
    argv += ["--log-level", "ERROR", "--stall-check", "-np", "1", "true"]
    env = environment(argv, capsys)
    assert env["HVDRUN_FUSION_THRESHOLD"] == str(256 * 1024 * 1024)
    assert env["HVDRUN_CYCLE_TIME"] == "20"
    assert env["HVDRUN_STALL_CHECK_TIME_SECONDS"] == "5"
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "0"
    assert env["HOROVOD_LOG_LEVEL"] == "ERROR"
    assert env["HVDRUN_GLOO_TIMEOUT_SECONDS"] == "60"  # not on the command line: the file's


def test_a_setting_exported_with_x_wins_over_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, HOROVOD_CONFIG)
    argv = ["--config-file", config, "-x", "HOROVOD_FUSION_THRESHOLD=1024"]
    argv += ["-x", "HVDRUN_CYCLE_TIME=3", "-np", "1", "true"]
    env = environment(argv, capsys)
    assert env["HOROVOD_FUSION_THRESHOLD"] == "1024"
    assert "HVDRUN_FUSION_THRESHOLD" not in env  # (it would win over the -x spelling)
    assert env["HVDRUN_CYCLE_TIME"] == "3"
    assert env["HVDRUN_STALL_CHECK_TIME_SECONDS"] == "120"  # not exported: the file's
    # A flag on the command line still wins over -x.
    env = environment([*argv[:4], "--fusion-threshold-mb", "1", *argv[4:]], capsys)
    assert env["HVDRUN_FUSION_THRESHOLD"] == str(1024 * 1024)


def test_x_wins_over_the_file_for_every_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule for every key: -x (either spelling) wins over the file's value."""
    config = write(tmp_path, HOROVOD_CONFIG)
    exports = {
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "120",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_LOG_HIDE_TIME": "0",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_NUM_NCCL_STREAMS": "4",
        "HOROVOD_THREAD_AFFINITY": "7",
        "HOROVOD_MPI_THREADS_DISABLE": "0",
        "HVDRUN_STALL_CHECK_DISABLE": "1",
        "HOROVOD_TIMELINE_MARK_CYCLES": "0",
    }
    argv = ["--config-file", config]
    for name, value in exports.items():
        argv += ["-x", f"{name}={value}"]
    env = environment([*argv, "-np", "1", "true"], capsys)
    for name, value in exports.items():
        assert env[name] == value, name
    assert "HVDRUN_GLOO_TIMEOUT_SECONDS" not in env  # (it would win over the -x spelling)
    assert "HVDRUN_TIMELINE_MARK_CYCLES" not in env
    # ... and a flag's own variable in hvdrun's environment loses to -x too
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "INFO")
    env = environment(["-x", "HOROVOD_LOG_LEVEL=ERROR", "-np", "1", "true"], capsys)
    assert env["HOROVOD_LOG_LEVEL"] == "ERROR"
    # A flag on the command line still wins over -x.
    argv += ["--gloo-timeout-seconds", "9", "--log-level", "WARNING", "--num-nccl-streams", "1"]
    env = environment([*argv, "-np", "1", "true"], capsys)
    assert env["HVDRUN_GLOO_TIMEOUT_SECONDS"] == "9"
    assert env["HOROVOD_LOG_LEVEL"] == "WARNING"
    assert env["HOROVOD_NUM_NCCL_STREAMS"] == "1"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            {"HOROVOD_FUSION_THRESHOLD": "abc"},
            "HOROVOD_FUSION_THRESHOLD must be a number, got 'abc'",
        ),
        (["-x", "HVDRUN_CYCLE_TIME=-3"], "HVDRUN_CYCLE_TIME must be at least 0, got '-3'"),
        ({"HOROVOD_STALL_CHECK_DISABLE": "maybe"}, "HOROVOD_STALL_CHECK_DISABLE must be 0 or 1"),
        (  # (0 to 1, as --autotune-gaussian-process-noise and the config file take it)
            {"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "5"},
            "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE must be at most 1, got '5'",
        ),
    ],
)
def test_a_bad_engine_setting_stops_hvdrun_before_any_worker_starts(
    how: dict[str, str] | list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["-np", "1", "true"]
    if isinstance(how, dict):  # from this shell
        for name, value in how.items():
            monkeypatch.setenv(name, value)
    else:  # -x
        argv = [*how, *argv]
    assert_usage_error(argv, message, capsys)
    assert_usage_error(["--dry-run", *argv], message, capsys)


def test_disabled_stall_check_and_timestamps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, "stall_check:\n  enabled: false\nlogging:\n  with_timestamp: false\n")
    env = environment(["--config-file", config, "-np", "1", "true"], capsys)
    assert env["HVDRUN_STALL_CHECK_DISABLE"] == "1"
    assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
    env = environment(["--config-file", config, "--stall-check", "-np", "1", "true"], capsys)
    assert env["HVDRUN_STALL_CHECK_DISABLE"] == "0"


def test_switches_turned_off_win_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As horovodrun writes HOROVOD_STALL_CHECK_DISABLE=0 and HOROVOD_TIMELINE_MARK_CYCLES=0,
    the file's ``enabled: true`` and ``mark_cycles: false`` win over hvdrun's environment."""
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "1")
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    text = "stall_check:\n  enabled: true\ntimeline:\n  filename: t.json\n  mark_cycles: false\n"
    text += "logging:\n  with_timestamp: true\n"
    env = environment(["--config-file", write(tmp_path, text), "-np", "1", "true"], capsys)
    assert env["HVDRUN_STALL_CHECK_DISABLE"] == "0"
    assert env["HVDRUN_TIMELINE_MARK_CYCLES"] == "0"
    assert env["HOROVOD_LOG_HIDE_TIME"] == "0"  # (with_timestamp: true)


def test_empty_file_and_empty_sections_are_fine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    environment(["--config-file", write(tmp_path, ""), "-np", "1", "true"], capsys)
    environment(["--config-file", write(tmp_path, "params:\n"), "-np", "1", "true"], capsys)
    # a key with nothing after it sets nothing, as in horovodrun (a value left out for now)
    text = "params:\n  fusion_threshold_mb:\n  cycle_time_ms: 3\n"
    env = environment(["--config-file", write(tmp_path, text), "-np", "1", "true"], capsys)
    assert "HOROVOD_FUSION_THRESHOLD" not in env and "HVDRUN_FUSION_THRESHOLD" not in env
    assert env["HVDRUN_CYCLE_TIME"] == "3"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms: must be a number, got 'fast'"),
        ("params:\n  cycle_time_ms: -1\n", "params.cycle_time_ms: must be at least 0, got -1"),
        (
            "params:\n  cache_capacity: 1.5\n",
            "params.cache_capacity: must be a whole number, got 1.5",
        ),
        (
            "params:\n  hierarchical_allreduce: 1\n",
            "params.hierarchical_allreduce: must be true or false, got 1",
        ),
        (
            "autotune:\n  gaussian_process_noise: 2\n",
            "autotune.gaussian_process_noise: must be between 0 and 1, got 2",
        ),
        (
            "logging:\n  level: LOUD\n",
            "logging.level: must be one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL, got 'LOUD'",
        ),
        ("timeline:\n  filename: 3\n", "timeline.filename: must be a non-empty text, got 3"),
        ("params: 3\n", "params: expected 'key: value' lines under it"),
        ("- a\n- b\n", "expected sections such as 'params:'"),
        ("params:\n  cycle_time_ms: [1\n", "line 3: expected ',' or ']'"),
        (
            "controller: mpi\n",
            "controller: mpi: hvdrun does not drive MPI: it starts the workers itself (Gloo on "
            "CPU, NCCL on GPU); set controller: gloo, or run mpirun",
        ),
        ("controller: nccl\n", "controller: must be gloo, got 'nccl'"),
        # A value the file's own checks pass and the flag's refuses names the key, not a
        # flag nobody typed ("Invalid value for '--gloo-timeout-seconds'").
        (
            "library_options:\n  gloo_timeout_seconds: 0\n",
            "library_options.gloo_timeout_seconds: 0 is not in the range x>0",
        ),
    ],
)
def test_mistakes_are_one_line_naming_the_key(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, text)
    assert_usage_error(["--config-file", config, "-np", "1", "true"], message, capsys)
    # the file is named too
    assert run_cli(["--config-file", config, "-np", "1", "true"]) == 2
    assert f"hvdrun: error: config file {config}" in capsys.readouterr().err


def test_unknown_sections_and_keys_are_ignored_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Horovod's set_args_from_config ignores keys it does not know, so a Horovod file with
    extra keys runs; hvdrun says which it ignores, with the key it may have meant."""
    text = "parms:\n  cycle_time_ms: 1\nparams:\n  fusion_treshold_mb: 1\n  cycle_time_ms: 7\n"
    config = write(tmp_path, text + "library_options:\n  foo: 1\n")
    warnings = [
        f"hvdrun: warning: config file {config}: unknown section 'parms' (did you mean "
        "'params'?): ignored, as horovodrun ignores it",
        f"hvdrun: warning: config file {config}: unknown key 'params.fusion_treshold_mb' (did "
        "you mean 'fusion_threshold_mb'?): ignored, as horovodrun ignores it",
        f"hvdrun: warning: config file {config}: unknown key 'library_options.foo' (known: "
        "mpi_threads_disable, num_nccl_streams, thread_affinity, ccl_bgt_affinity, "
        "mlsl_bgt_affinity, gloo_timeout_seconds): ignored, as horovodrun ignores it",
    ]
    assert run_cli(["--dry-run", "--config-file", config, "-np", "1", "true"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "warning" in line] == warnings
    assert "  HVDRUN_CYCLE_TIME=7" in out.splitlines()  # (the keys it knows apply)
    assert "FUSION_THRESHOLD=" not in out
    # ... and the job runs
    assert run_cli(["--config-file", config, "-np", "1", "true"]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == warnings


def test_older_spellings_of_thread_affinity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in ("ccl_bgt_affinity", "mlsl_bgt_affinity"):
        config = write(tmp_path, f"library_options:\n  {key}: 5\n")
        env = environment(["--config-file", config, "-np", "1", "true"], capsys)
        assert env["HOROVOD_THREAD_AFFINITY"] == "5"


def test_switches_take_any_whole_number_as_horovod_reads_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Horovod reads its switches with strtol(value) > 0: HOROVOD_AUTOTUNE=2 is on, -1 off."""
    for value, on in (("2", True), ("-1", False), ("yes", True)):
        monkeypatch.setenv("HOROVOD_AUTOTUNE", value)
        code = run_cli(["--dry-run", "-np", "1", "true"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert ("autotune warm-up" in out) is on, value
    monkeypatch.delenv("HOROVOD_AUTOTUNE")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "3")
    assert environment(["-np", "1", "true"], capsys)["HOROVOD_STALL_CHECK_DISABLE"] == "3"


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(
        ["--config-file", "/nonexistent/cfg.yaml", "-np", "1", "true"],
        "cannot read config file /nonexistent/cfg.yaml: No such file or directory",
        capsys,
    )
