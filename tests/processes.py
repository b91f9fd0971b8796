"""Reading the rest of a process's output after reading some of it line by line, and a job
stopped for a while in the middle.

``Popen.communicate(timeout=...)`` reads the pipes' file descriptors directly, so lines that
``readline()`` (or iterating over ``proc.stdout``) had already read ahead into the file
object's buffer are skipped: a test that waits for one line and then communicates loses
whatever came with that line's read, now and then. Read the rest through the file objects.

Also: the ``PYTHONPATH`` of a child that runs the checkout's code without an install, and
a wait for processes to be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def with_repo_on_path() -> str:
    """``PYTHONPATH`` with the checkout first and this process's entries kept: where the
    packages a child needs come from ``PYTHONPATH`` (a machine that runs the suite from
    source), replacing it would give the child other versions of them."""
    return os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))


def rest_of_output(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """What ``proc`` writes to its stdout and stderr pipes from now on, once it has exited
    (at most ``timeout`` seconds: then it is killed and the test fails)."""
    found: dict[str, str] = {}

    def drain(name: str, stream: object) -> None:
        found[name] = stream.read() if stream is not None else ""  # type: ignore[attr-defined]

    readers = [
        threading.Thread(target=drain, args=(name, stream), daemon=True)
        for name, stream in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    for reader in readers:
        reader.join(10)
    return found.get("out", ""), found.get("err", "")


def run_stopped_for_a_while(
    command: Sequence[str], cwd: Path, env: Mapping[str, str], after: str, seconds: float
) -> tuple[int, str]:
    """Runs ``command``, stops it (SIGSTOP) for ``seconds`` once it printed a line holding
    ``after``, lets it go on; returns its exit code and whole output (stdout and stderr)."""
    job = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert job.stdout is not None
        for line in job.stdout:
            lines.append(line)
            if after in line:
                break
        job.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        job.send_signal(signal.SIGCONT)
        output = "".join(lines) + rest_of_output(job, timeout=120)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return job.returncode, output


def assert_gone(pids: Sequence[int], within: float) -> None:
    """Waits up to ``within`` seconds until none of ``pids`` runs (a zombie, dead but not
    reaped, does not); AssertionError naming those that still do."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes still running: {alive}")
