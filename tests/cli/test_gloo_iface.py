"""``HOROVOD_GLOO_IFACE``, horovodrun users' way to choose Gloo's interface, is read as
``--network-interface`` when neither flag is given."""

from __future__ import annotations

import sys

import pytest

from hvdrun.cli import run_cli
from tests.cli.conftest import assert_usage_error


def worker_variables(argv: list[str], capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The ``NAME=VALUE`` lines of ``hvdrun --dry-run ARGV``'s plan."""
    code = run_cli(["--dry-run", "-np", "1", *argv, "true"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return {line.strip() for line in out.splitlines() if line.startswith("  ")}


@pytest.fixture(autouse=True)
def _no_ifname(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"):
        monkeypatch.delenv(name, raising=False)


def test_horovod_gloo_iface_chooses_the_interface(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "eth7")
    env = worker_variables([], capsys)
    assert {"GLOO_SOCKET_IFNAME=eth7", "NCCL_SOCKET_IFNAME=eth7"} <= env


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--network-interface", "eth1"], "GLOO_SOCKET_IFNAME=eth1"),
        (["--network-interfaces", "eth2"], "GLOO_SOCKET_IFNAME=eth2"),
        (["-x", "GLOO_SOCKET_IFNAME=eth3"], "GLOO_SOCKET_IFNAME=eth3"),
    ],
)
def test_the_flags_and_an_exported_gloo_socket_ifname_win(
    flags: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "eth7")
    env = worker_variables(flags, capsys)
    assert expected in env
    assert "GLOO_SOCKET_IFNAME=eth7" not in env


def test_an_interface_this_machine_lacks_is_a_usage_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "bogus0")
    assert_usage_error(
        ["-np", "1", sys.executable, "-c", "pass"],
        "invalid HOROVOD_GLOO_IFACE: this machine has no network interface bogus0; it has ",
        capsys,
    )
