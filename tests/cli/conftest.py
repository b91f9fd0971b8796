"""Shared checks for the CLI tests."""

from __future__ import annotations

import pytest

from hvdrun.cli import run_cli


def assert_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``hvdrun ARGV`` exits with 2 and one ``hvdrun: error:`` line containing ``message``."""
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdrun: error: ")
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
