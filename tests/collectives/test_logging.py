"""``HOROVOD_LOG_LEVEL`` (what ``hvdrun --log-level`` passes on) turns a worker's logging on."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = "import collectives.torch as hvd; hvd.init(); hvd.shutdown()"


def run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HVDRUN_"))}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_horovod_log_level_shows_the_runtime_records_on_stderr() -> None:
    assert "initialized rank" not in run()  # quiet unless asked
    for hide in ("1", "2"):  # (as in Horovod, any whole number above 0 is on)
        err = run(HOROVOD_LOG_LEVEL="trace", HOROVOD_LOG_HIDE_TIME=hide)
        line = next(line for line in err.splitlines() if "initialized rank 0 of 1" in line)
        assert line.startswith("hvd DEBUG collectives.runtime.bootstrap: ")  # no timestamp
    err = run(HOROVOD_LOG_LEVEL="DEBUG")
    assert any(line.startswith("[") and "initialized" in line for line in err.splitlines())
    assert "initialized rank" not in run(HOROVOD_LOG_LEVEL="WARNING")
    assert "HOROVOD_LOG_LEVEL=LOUD is not one of" in run(HOROVOD_LOG_LEVEL="loud")
