"""Which variables reach the workers: the caller's minus host-specific ones, plus -x."""

import pytest

from launcher.spec.environment import (
    MALLOC_DEFAULTS,
    EnvSpecError,
    forwarded_env,
    is_host_specific,
    parse_exports,
    worker_base_env,
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
    assert parse_exports(["CUDA_VISIBLE_DEVICES", "B=1=2", "C=", "A"], caller) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "B": "1=2",
        "C": "",
        "A": "x",
    }


@pytest.mark.parametrize(
    ("export", "message"),
    [
        ("MISSING", "MISSING is not set here; give its value with -x MISSING=VALUE"),
        ("=x", "'=x' is not VAR or VAR=VALUE"),
        ("1A=2", "'1A=2' is not VAR or VAR=VALUE"),
        ("A-B", "'A-B' is not VAR or VAR=VALUE"),
    ],
)
def test_parse_exports_rejects(export: str, message: str) -> None:
    with pytest.raises(EnvSpecError, match=message):
        parse_exports([export], {})


def test_worker_keeps_its_own_hosts_specific_values() -> None:
    agent = {"HOME": "/root", "SSH_CONNECTION": "a b c d", "PATH": "/usr/bin", "OTHER": "x"}
    forwarded = {"PATH": "/venv/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert worker_base_env(agent, forwarded) == {
        "HOME": "/root",
        "SSH_CONNECTION": "a b c d",
        "PATH": "/venv/bin",  # the caller's, not the login's
        "CUDA_VISIBLE_DEVICES": "0",  # forced with -x: the caller's wins
        **MALLOC_DEFAULTS,
    }


def test_malloc_defaults_yield_to_the_jobs_own_setting() -> None:
    env = worker_base_env({}, {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert "MALLOC_MMAP_THRESHOLD_" not in env  # the job tunes malloc itself: both are its own
    assert worker_base_env({}, {})["MALLOC_MMAP_THRESHOLD_"] == str(64 << 20)
