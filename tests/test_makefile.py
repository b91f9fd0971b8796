"""The Makefile's set-up and the variables the README documents (`make -n`: nothing runs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def dry_run(venv: Path, *overrides: str) -> str:
    result = subprocess.run(
        ["make", "-n", "setup", f"VENV={venv}", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_new_torch_spec_reruns_the_set_up(tmp_path: Path) -> None:
    """`make demo TORCH_SPEC=...` on a machine set up already installs that torch, rather
    than keeping the one installed before without a word."""
    venv = tmp_path / "venv"
    venv.mkdir()
    # a set-up with the defaults, every command of it /bin/true (PY names the venv's python)
    subprocess.run(
        ["make", "setup", f"VENV={venv}", "PY=/bin/true"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=60,
    )
    stamp = venv / ".hvdrun-installed"
    os.utime(stamp)  # newer than pyproject.toml, whatever its mtime
    assert "pip install" not in dry_run(venv)
    assert '"torch==2.11.0"' in dry_run(venv, "TORCH_SPEC=torch==2.11.0")
    assert '"tensorflow==2.20.0"' in dry_run(venv, "TF_SPEC=tensorflow==2.20.0")
