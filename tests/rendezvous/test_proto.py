"""The committed gRPC code must be what `make proto` generates from rendezvous.proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("rendezvous_pb2.py", "rendezvous_pb2.pyi", "rendezvous_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = str(tmp_path)
    # the same command as the Makefile's `proto` target, writing to a temporary directory
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            "rendezvous/rendezvous.proto",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    stale = [
        name
        for name in GENERATED
        if (tmp_path / "rendezvous" / name).read_bytes()
        != (REPO / "rendezvous" / name).read_bytes()
    ]
    if stale:
        pytest.fail(f"generated code is stale: run make proto ({', '.join(stale)} differ)")
