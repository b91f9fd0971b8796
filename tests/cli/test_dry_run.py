"""``--dry-run``: the plan of local, SSH, hostfile and elastic jobs, with nothing started."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hvdrun.cli import run_cli

SSH_CONFIG = """\
Host gpu*.invalid
    User trainer
    Port 2200
    IdentityFile ~/keys/gpu_key
    IdentitiesOnly yes

Host inner.invalid
    HostName 10.254.0.7
    ProxyJump admin@bastion.invalid:2022
"""


def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = run_cli(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def section(out: str, title: str) -> list[str]:
    """The indented lines under ``title:``."""
    lines = out.splitlines()
    start = lines.index(f"{title}:") + 1
    body = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        body.append(line.strip())
    return body


def test_local_job(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = dry_run(["-np", "3", "sh", "-c", f"touch {marker}"], capsys)
    assert not marker.exists()  # nothing ran
    assert out.startswith("hvdrun dry run: 3 worker(s) on 1 host(s); nothing was started\n")
    assert f"command: sh -c 'touch {marker}'" in out
    assert section(out, "hosts") == [
        "localhost  3 worker(s)  this machine (agent as a local process)"
    ]
    assert [line.split() for line in section(out, "ranks")] == [
        ["rank", "host", "local_rank", "local_size", "cross_rank", "cross_size"],
        ["0", "localhost", "0", "3", "0", "1"],
        ["1", "localhost", "1", "3", "0", "1"],
        ["2", "localhost", "2", "3", "0", "1"],
    ]
    tuning = section(out, "tuning the workers run with")
    assert (
        "fusion threshold        134217728 bytes (128 MiB), 4 MiB for CUDA reductions  (default)"
        in tuning
    )


def test_the_tuning_shows_the_cache_and_under_autotune_the_autotuner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tuning = section(
        dry_run(["-np", "1", "--cache-capacity", "0", "true"], capsys),
        "tuning the workers run with",
    )
    assert "response cache          0 ops (no cache)  (from --cache-capacity)" in tuning
    argv = ["-np", "1", "--stall-check-warning-time-seconds", "0", "true"]  # (0 turns them off)
    tuning = section(dry_run(argv, capsys), "tuning the workers run with")
    assert (
        "stall warning after     0 s (no warnings)  (from --stall-check-warning-time-seconds)"
        in tuning
    )
    assert "autotune                0  (default)" in tuning
    assert not any(line.startswith("autotune sample") for line in tuning)
    argv = ["-np", "1", "--autotune", "--autotune-steps-per-sample", "4", "true"]
    tuning = section(dry_run(argv, capsys), "tuning the workers run with")
    assert "response cache          1024 ops  (default)" in tuning
    assert "autotune                1  (from --autotune)" in tuning
    assert "autotune sample         4 steps  (from --autotune-steps-per-sample)" in tuning
    assert "autotune warm-up        3 samples  (default)" in tuning


def test_cuda_backend_flag_reaches_the_workers(capsys: pytest.CaptureFixture[str]) -> None:
    tuning = section(dry_run(["-np", "2", "true"], capsys), "tuning the workers run with")
    assert "CUDA tensors through    nccl where there are GPUs  (default)" in tuning
    out = dry_run(["-np", "2", "--cuda-backend", "gloo", "true"], capsys)
    tuning = section(out, "tuning the workers run with")
    assert "CUDA tensors through    gloo  (from --cuda-backend)" in tuning
    assert run_cli(["--dry-run", "-np", "2", "--cuda-backend", "mpi", "true"]) == 2
    assert "'mpi' is not one of 'nccl', 'gloo'" in capsys.readouterr().err


def test_secrets_are_masked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-value")
    monkeypatch.setenv("HVDRUN_TEST_PLAIN", "visible")
    more = ("MYSQL_PWD", "GITHUB_PAT", "AZURE_STORAGE_CONNECTION_STRING", "SLACK_WEBHOOK_URL")
    for name in more:
        monkeypatch.setenv(name, "other-secret-value")
    monkeypatch.setenv("DATABASE_URL", "postgres://trainer:url-secret-value@db:5432/runs")
    monkeypatch.setenv("HVDRUN_TEST_PATH", "/data/PWD/keys")  # (a word in a value: shown)
    monkeypatch.setenv("HVDRUN_SECRET", "env-secret-value")
    monkeypatch.setenv("HVDRUN_TEST_LINES", "one\ntwo")
    out = dry_run(["-np", "1", "-x", "DB_PASSWORD=pw-secret-value", "true"], capsys)
    assert "secret-value" not in out
    env = section(
        out, "every worker's environment (secrets masked; rank variables as in the table)"
    )
    for name in ("WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "DB_PASSWORD", *more):
        assert f"{name}=****" in env
    assert "DATABASE_URL=postgres://trainer:****@db:5432/runs" in env
    assert "HVDRUN_TEST_PATH=/data/PWD/keys" in env
    assert "HVDRUN_TEST_LINES=one\\ntwo" in env  # (one line of the plan)
    # The job's own secret replaces one in the environment: shown once, as hvdrun's.
    assert [line for line in env if line.startswith("HVDRUN_SECRET=")] == [
        "HVDRUN_SECRET=**** (made at start)"
    ]
    assert "HVDRUN_TEST_PLAIN=visible" in env
    assert "HVDRUN_SECRET=**** (made at start)" in env


def test_ssh_hosts_say_how_they_are_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(SSH_CONFIG)
    argv = ["-np", "4", "-H", "localhost:1,gpu1.invalid:2,inner.invalid:1", "true"]
    out = dry_run(argv, capsys)
    hosts = section(out, "hosts")
    assert hosts[0].split("  ")[0] == "localhost"
    assert "this machine" in hosts[0]
    assert (
        f"ssh trainer@gpu1.invalid:2200, key {tmp_path}/keys/gpu_key, host keys accept-new"
        in hosts[1]
    )
    assert "ssh " in hosts[2] and "@10.254.0.7:22" in hosts[2]
    assert "via ProxyJump admin@bastion.invalid:2022" in hosts[2]
    ranks = [line.split()[:2] for line in section(out, "ranks")[1:]]
    assert ranks == [
        ["0", "localhost"],
        ["1", "gpu1.invalid"],
        ["2", "gpu1.invalid"],
        ["3", "inner.invalid"],
    ]
    # the flags win over the config, as for the real connection
    out = dry_run(["-np", "1", "-H", "root@gpu2.invalid", "-p", "2222", "true"], capsys)
    assert "ssh root@gpu2.invalid:2222" in section(out, "hosts")[0]


def test_hostfile_with_a_repeated_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a.invalid slots=1\nb.invalid slots=2\na.invalid slots=2\n")
    out = dry_run(["--hostfile", str(hostfile), "true"], capsys)
    assert out.startswith("hvdrun dry run: 5 worker(s) on 2 host(s)")
    rows = [line.split() for line in section(out, "ranks")[1:]]
    assert [(r[1], r[2], r[4]) for r in rows] == [
        ("a.invalid", "0", "0"),
        ("a.invalid", "1", "0"),
        ("a.invalid", "2", "0"),
        ("b.invalid", "0", "1"),
        ("b.invalid", "1", "1"),
    ]


def test_elastic_job_shows_the_first_discovery(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    argv = ["-np", "3", "--min-np", "2", "--max-np", "4", "--host-discovery-script", str(script)]
    out = dry_run([*argv, "true"], capsys)
    # (a real run starts on every slot up once -np are, up to --max-np: all four)
    assert out.startswith("hvdrun dry run: 4 worker(s) on 2 host(s)")
    assert (
        "elastic: min-np 2, max-np 4, elastic timeout 600 s; the plan of the first discovery "
        "(localhost:2, 127.0.0.1:2)" in out
    )
    assert [line.split()[1] for line in section(out, "ranks")[1:]] == [
        "localhost",
        "localhost",
        "127.0.0.1",
        "127.0.0.1",
    ]
    # elastic workers time out faster on a silent peer
    assert "collective timeout      5 s  (elastic default)" in section(
        out, "tuning the workers run with"
    )
    # and get what a real run gives them
    env = section(
        out, "every worker's environment (secrets masked; rank variables as in the table)"
    )
    for line in ("HVDRUN_ELASTIC=1", "HVDRUN_ELASTIC_TIMEOUT=630", "HVDRUN_GLOO_TIMEOUT_SECONDS=5"):
        assert line in env, env
    assert "HVDRUN_GENERATION, HVDRUN_WORKER" in out


def test_elastic_headline_counts_the_workers_that_would_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """-np 4 on 2 slots with --min-np 2: a real run starts 2 workers; the plan says 2."""
    out = dry_run(["-np", "4", "--min-np", "2", "-H", "localhost:2", "true"], capsys)
    assert out.startswith("hvdrun dry run: 2 worker(s) on 1 host(s); nothing was started\n")
    assert len(section(out, "ranks")[1:]) == 2
    assert (
        "elastic: the first discovery offers 2 slot(s), fewer than -np 4 but at least min-np 2: "
        "the job starts with 2 worker(s)" in out
    )


@pytest.mark.parametrize(
    ("flags", "discovered", "planned", "hosts"),
    [
        # the first generation takes every slot up, up to --max-np, as the real run does
        (
            ["-np", "2", "--max-np", "3"],
            "localhost:2\n127.0.0.1:2",
            3,
            ["localhost"] * 2 + ["127.0.0.1"],
        ),
        (["-np", "1", "--min-np", "1"], "localhost:2", 2, ["localhost"] * 2),
    ],
)
def test_elastic_plan_is_the_first_generation_a_real_run_starts(
    flags: list[str],
    discovered: str,
    planned: int,
    hosts: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = f"printf '{discovered}\\n'"
    out = dry_run([*flags, "--host-discovery-script", script, "echo", "hi"], capsys)
    count = len(set(hosts))
    assert out.startswith(f"hvdrun dry run: {planned} worker(s) on {count} host(s);")
    assert [line.split()[1] for line in section(out, "ranks")[1:]] == hosts
    assert (
        "elastic: the job starts on every slot the first discovery offers, up to max-np, as "
        f"Horovod does: {planned} worker(s), more than -np {flags[1]}" in out
    )


def test_dry_run_checks_no_command_or_output_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan is for the hosts: a program missing here is not an error in a dry run."""
    out_dir = tmp_path / "out"
    out = dry_run(["-np", "1", "--output-filename", str(out_dir), "no-such-program-xyz"], capsys)
    assert "command: no-such-program-xyz" in out
    assert not os.path.exists(out_dir)


def test_a_fusion_threshold_that_was_set_is_cudas_too(capsys: pytest.CaptureFixture[str]) -> None:
    tuning = section(
        dry_run(["-np", "1", "--fusion-threshold-mb", "2", "true"], capsys),
        "tuning the workers run with",
    )
    assert "fusion threshold        2097152 bytes (2 MiB)  (from --fusion-threshold-mb)" in tuning


def test_the_tuning_says_where_each_value_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flag, the config file's key, the flag's variable in hvdrun's environment, or a
    variable given to the workers (-x, or forwarded): each value says which."""
    config = tmp_path / "c.yaml"
    config.write_text("params:\n  cycle_time_ms: 2\n")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "90")
    argv = ["-np", "1", "--config-file", str(config), "--cache-capacity", "7"]
    argv += ["-x", "HVDRUN_FUSION_THRESHOLD=1048576", "true"]
    tuning = section(dry_run(argv, capsys), "tuning the workers run with")
    assert (
        f"cycle time              2 ms  (from config file {config}: params.cycle_time_ms)" in tuning
    )
    assert "response cache          7 ops  (from --cache-capacity)" in tuning
    assert "stall warning after     90 s  (from HOROVOD_STALL_CHECK_TIME_SECONDS)" in tuning
    assert "fusion threshold        1048576 bytes (1 MiB)  (from HVDRUN_FUSION_THRESHOLD)" in tuning
