"""Reading the rest of a process's output after reading some of it line by line.

``Popen.communicate(timeout=...)`` reads the pipes' file descriptors directly, so lines that
``readline()`` (or iterating over ``proc.stdout``) had already read ahead into the file
object's buffer are skipped: a test that waits for one line and then communicates loses
whatever came with that line's read, now and then. Read the rest through the file objects.
"""

from __future__ import annotations

import subprocess
import threading


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
