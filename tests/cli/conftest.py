"""Shared checks for the CLI tests."""

from __future__ import annotations

import pytest

from hvdrun.cli import run_cli
from launcher.spec.schedulers import ALLOCATION_VARIABLES


def assert_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``hvdrun ARGV`` exits with 2 and one ``hvdrun: error:`` line containing ``message``."""
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdrun: error: ")
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


@pytest.fixture(autouse=True)
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CLI test starts outside any batch allocation, whatever a test before it set."""
    for name in ALLOCATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
