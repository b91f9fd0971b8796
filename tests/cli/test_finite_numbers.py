"""Numbers of flags that are not finite, or times too long for a clock, are usage errors
(click's FloatRange alone lets nan through, and inf or 1e300 s overflowed the launcher's
deadlines: "timestamp out of range for platform time_t", or a wait without end)."""

from __future__ import annotations

import pytest

from tests.cli.conftest import assert_usage_error

FLAGS = [
    "--start-timeout",
    "--agent-timeout",
    "--heartbeat-timeout",
    "--term-grace",
    "--gloo-timeout-seconds",
    "--stall-check-warning-time-seconds",
    "--stall-check-shutdown-time-seconds",
    "--fusion-threshold-mb",
    "--cycle-time-ms",
]


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-nan"])
def test_a_number_that_is_not_finite_is_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(["-np", "1", f"{flag}={value}", "true"], f"'{flag}'", capsys)


@pytest.mark.parametrize("flag", ["--start-timeout", "--elastic-timeout", "--term-grace"])
def test_a_time_beyond_any_clock_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(
        ["-np", "1", "--min-np", "1", "-H", "localhost:1", f"{flag}=1e300", "true"],
        "1e300 s is longer than any wait (at most 1e+09 s)",
        capsys,
    )


def test_the_cooldown_range_and_a_variable_are_checked_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_usage_error(
        ["-np", "1", "--min-np", "1", "--blacklist-cooldown-range", "1", "nan", "true"],
        "nan is not a finite number",
        capsys,
    )
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "inf")
    assert_usage_error(["-np", "1", "true"], "(from HOROVOD_START_TIMEOUT)", capsys)
