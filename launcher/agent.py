"""The per-host agent: ``python -m launcher.agent``.

One agent runs on every host of a job, for local and remote hosts alike. It reads its
:class:`~launcher.protocol.AgentSpec` from stdin, starts the host's workers (each in a new
session, so its whole process group can be signalled), splits their output into lines and
reports them, with exits, as events on stdout.

The agent is the middleman that guarantees no worker outlives the job: when its stdin
closes (hvdrun exited or was killed with -9, the SSH connection dropped) or it is told to
terminate, it sends SIGTERM to every worker's process group and every process of its tree,
then SIGKILL after the grace period. It imports neither torch nor grpc, so it starts fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

import psutil

from launcher.output import LineSplitter
from launcher.protocol import AgentSpec, WorkerLaunch, encode_event, text_of

Emit = Callable[[dict[str, Any]], None]
READ_CHUNK = 65536


def exit_code_of(returncode: int) -> int:
    """Shell convention: a worker killed by signal N exits with 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class Worker:
    """One worker process and the threads that drain its output and report its exit."""

    def __init__(self, launch: WorkerLaunch, spec: AgentSpec, emit: Emit) -> None:
        self.rank = launch.rank
        self._emit = emit
        env = dict(spec.env)
        env.update(launch.env)
        self.proc = subprocess.Popen(
            spec.command,
            cwd=spec.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.exited = threading.Event()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._drain, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stderr, "stderr"), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _drain(self, pipe: BinaryIO, stream: str) -> None:
        splitter = LineSplitter()
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, READ_CHUNK)
            except OSError:
                chunk = b""
            lines = splitter.feed(chunk) if chunk else splitter.flush()
            for line in lines:
                self._emit(
                    {"ev": "out", "rank": self.rank, "stream": stream, "data": text_of(line)}
                )
            if not chunk:
                pipe.close()
                return

    def _wait(self) -> None:
        # Wait without reaping, so the pid cannot be reused while we clear its process group:
        # anything the worker left behind in its group dies with it.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = exit_code_of(self.proc.wait())
        for reader in self._readers:
            reader.join(timeout=2.0)
        self.exited.set()
        self._emit({"ev": "exit", "rank": self.rank, "code": code})

    def process_tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []


class HostAgent:
    """Starts one host's workers and stops them all on request."""

    def __init__(self, spec: AgentSpec, emit: Emit) -> None:
        self.spec = spec
        self._emit = emit
        self.workers: list[Worker] = []
        self._lock = threading.Lock()
        self._terminating = False

    def start(self) -> None:
        for launch in self.spec.workers:
            with self._lock:
                if self._terminating:
                    self._emit({"ev": "exit", "rank": launch.rank, "code": 143})
                    continue
                try:
                    worker = Worker(launch, self.spec, self._emit)
                except OSError as exc:
                    self._emit(
                        {
                            "ev": "exit",
                            "rank": launch.rank,
                            "code": 127 if isinstance(exc, FileNotFoundError) else 126,
                            "error": f"cannot run {self.spec.command[0]!r}: {exc.strerror or exc}",
                        }
                    )
                    continue
                self.workers.append(worker)
            self._emit({"ev": "started", "rank": launch.rank, "pid": worker.proc.pid})

    def wait(self, timeout: float | None = None) -> bool:
        """True once every started worker has exited and been reported."""
        return all(worker.exited.wait(timeout) for worker in list(self.workers))

    def terminate(self, grace: float | None = None) -> None:
        """SIGTERM every worker's process tree, SIGKILL what is left after ``grace`` seconds."""
        grace = self.spec.term_grace if grace is None else grace
        with self._lock:
            self._terminating = True
            workers = list(self.workers)
        trees = [worker.process_tree() for worker in workers]
        for worker, tree in zip(workers, trees, strict=False):
            _signal_tree(worker.proc.pid, tree, signal.SIGTERM)
        procs = [proc for tree in trees for proc in tree]
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for worker, tree in zip(workers, trees, strict=False):
            _signal_tree(worker.proc.pid, [p for p in tree if p in alive], signal.SIGKILL)
        self.wait(timeout=5.0)


def _signal_tree(pgid: int, tree: list[psutil.Process], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
    for proc in tree:  # children may have left the group (setsid, double fork)
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signum)


def main() -> int:
    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer
    out_lock = threading.Lock()
    stop = threading.Event()

    def emit(event: dict[str, Any]) -> None:
        data = encode_event(event)
        with out_lock:
            try:
                stdout.write(data)
                stdout.flush()
            except (BrokenPipeError, ValueError):
                stop.set()  # hvdrun is gone: nobody to report to

    line = stdin.readline()
    if not line:
        return 0
    spec = AgentSpec.from_line(line)

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, on_signal)

    def watch_stdin() -> None:
        # Any line is a terminate request; EOF means hvdrun or the connection is gone.
        stdin.readline()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    agent = HostAgent(spec, emit)
    agent.start()
    while not stop.is_set():
        if agent.wait(timeout=0.1):
            break
    if stop.is_set():
        agent.terminate()
    emit({"ev": "done"})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # The stdin watcher may still be blocked in readline(); a normal interpreter shutdown
    # would then abort on the buffered reader's lock, so leave without it.
    os._exit(code)
