"""A tiny check recorder shared by the worker scripts: prints ``OK name`` or ``FAIL name``.

Workers run every check even after a failure, so one launch reports everything that is wrong,
and exit non-zero at the end if anything failed.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import torch


def say(line: str) -> None:
    """Prints a line in one write: ranks that share a pipe (torchrun, mpirun) never split it."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def expect(self, name: str, condition: bool, detail: object = "") -> None:
        if condition:
            self.passed += 1
            say(f"OK {name}")
        else:
            self.failed.append(name)
            say(f"FAIL {name}: {detail}")

    def equal(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        same = actual.dtype == expected.dtype and torch.equal(actual, expected)
        self.expect(name, same, f"got {actual!r}, expected {expected!r}")

    def close(self, name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
        same = actual.dtype == expected.dtype and actual.shape == expected.shape
        same = same and torch.allclose(actual, expected, rtol=0, atol=atol)
        self.expect(name, same, f"got {actual!r}, expected {expected!r}")

    def run(self, name: str, body: Callable[[], None]) -> None:
        """Runs a group of checks; an exception fails the group instead of the script."""
        try:
            body()
        except Exception:
            self.failed.append(name)
            say(f"FAIL {name}: raised")
            traceback.print_exc()

    def finish(self, rank: int) -> None:
        if self.failed:
            say(f"rank {rank}: {len(self.failed)} FAILED: {self.failed}")
            sys.exit(1)
        say(f"ALL OK rank {rank}: {self.passed} checks")


def states_equal(a: dict, b: dict) -> bool:
    """Whether two optimizer state_dicts hold the same values, tensors compared exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b
