"""One host's workers: started in new sessions, drained line by line, stopped as a tree.

Each worker runs in a session of its own, so its whole process group can be signalled; its
stdout and stderr are split into lines where they are produced, so a line always travels
whole. Stopping sends SIGTERM (then SIGCONT, for a stopped one) to every worker's process group and
to every process of its tree (children may have left the group), then SIGKILL after the
grace period.

The agent is the subreaper of the workers' descendants (Linux): a process whose parent
exits is re-parented to the agent, not to init. A worker's child that left its process group
(``setsid``, a double fork) and outlives the worker is found so, among the agent's children:
it gets SIGTERM with the workers when they are stopped (and SIGKILL after the grace period),
or once they have all exited (and SIGKILL a second later); one that exits earlier is reaped.

A worker that stops running (SIGSTOP, SIGTSTP, a debugger that attached and holds it) is
reported as :class:`Stopped`, and as :class:`Continued` when it runs again: its peers'
collectives time out waiting for it, and hvdrun names it, not them, as the cause. The state
is read from the process table (a debugger's ptrace stop reaches no ``waitpid`` of the
agent); the stopping signal from ``waitid(WSTOPPED | WNOWAIT)``, which consumes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import BinaryIO

import psutil

from launcher.output import LineSplitter
from launcher.spec.environment import file_here_hint
from launcher.transport.protocol import (
    AgentEvent,
    AgentSpec,
    Continued,
    Exit,
    Lines,
    Output,
    Started,
    Stopped,
    WorkerLaunch,
)

Emit = Callable[[AgentEvent], None]
READ_CHUNK = 65536
#: How often the agent looks for workers that were stopped or continued.
STOP_CHECK_INTERVAL = 0.5
#: How often it reaps the adopted processes that exited (a look at the whole process table).
REAP_INTERVAL = 5.0
#: What the workers left outside their process groups, once they have all exited by
#: themselves, gets this long (at most the grace period) between SIGTERM and SIGKILL:
#: hvdrun gives an elastic job's agents 2 s to report before it kills them.
ADOPTED_GRACE_S = 1.0
#: How long the agent keeps killing what the workers left outside their process groups.
ADOPTED_KILL_S = 2.0
#: prctl(2)'s option that makes a process the subreaper of its descendants.
PR_SET_CHILD_SUBREAPER = 36


#: What a host ran out of, by the errno of a worker's start that failed for want of it.
RAN_OUT = {
    errno.ENFILE: "the system's table of open files is full",
    errno.EAGAIN: "no more processes: the limit on processes (ulimit -u) or memory",
    errno.ENOMEM: "out of memory on this host",
}


def ran_out(number: int | None) -> str | None:
    """What the host ran out of where a worker's start failed with errno ``number`` (the
    limit on open files named with its values); None for other failures."""
    if number != errno.EMFILE:
        return RAN_OUT.get(number or 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return (
        f"this host's limit on open files, {soft}, was reached: raise it (ulimit -n, up to "
        f"{most} here) or start fewer workers on this host"
    )


def adopt_orphans() -> bool:
    """Makes this process the subreaper of its descendants (Linux; False elsewhere, or where
    it is refused): a descendant whose parent exits is re-parented here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _same_state(now: Stopped | None, before: Stopped | None) -> bool:
    """Whether two readings of a worker tell the same: running, or stopped alike (a stop
    read again, its signal known only now, is no news)."""
    if now is None or before is None:
        return now is before
    return now.traced == before.traced


def exit_code_of(returncode: int) -> int:
    """Shell convention: a worker killed by signal N exits with 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class Worker:
    """One worker process and the threads that drain its output and report its exit."""

    def __init__(
        self, launch: WorkerLaunch, spec: AgentSpec, base_env: Mapping[str, str], emit: Emit
    ) -> None:
        self.rank = launch.rank
        self._emit = emit
        env = dict(base_env)
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
        self.reported_stop: Stopped | None = None  # (the HostAgent's checks only)
        #: Why the agent stopped it on its own (not asked by hvdrun), said with its exit.
        self.stopped_because: str | None = None
        self._ps: psutil.Process | None = None
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
            run, pieces = splitter.split_run(chunk) if chunk else (b"", splitter.tail())
            if run:  # (the read's whole lines: one event)
                self._emit(Lines(self.rank, stream, run))
            for piece in pieces:
                self._emit(Output(self.rank, stream, *piece))
            if not chunk:
                pipe.close()
                return

    def stop_state(self) -> Stopped | None:
        """How this worker is stopped now; None while it runs (or once it has exited)."""
        if self.proc.returncode is not None:
            return None  # (reaped: its pid may belong to another process now)
        try:
            if self._ps is None:
                self._ps = psutil.Process(self.proc.pid)
            status = self._ps.status()
        except psutil.Error:
            return None
        if status == psutil.STATUS_TRACING_STOP:
            return Stopped(self.rank, self.proc.pid, traced=True)
        if status != psutil.STATUS_STOPPED:
            return None
        signum = None
        with contextlib.suppress(OSError):
            info = os.waitid(os.P_PID, self.proc.pid, os.WSTOPPED | os.WNOWAIT | os.WNOHANG)
            if info is not None and info.si_code == os.CLD_STOPPED:
                signum = info.si_status
        return Stopped(self.rank, self.proc.pid, signum)

    def _wait(self) -> None:
        # Wait without reaping, so the pid cannot be reused while we clear its process group:
        # anything the worker left behind in its group dies with it.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = exit_code_of(self.proc.wait())
        # The last output, for at most 2 s in all: a descendant outside the group (setsid)
        # may hold the pipes open for good.
        deadline = time.monotonic() + 2.0
        for reader in self._readers:
            reader.join(timeout=max(deadline - time.monotonic(), 0.0))
        # Reported before it counts as exited: the agent's "done" must come after every exit.
        why = self.stopped_because if code != 0 else None
        self._emit(Exit(self.rank, code, error=why and f"stopped by its host's agent: {why}"))
        self.exited.set()


class HostAgent:
    """Starts one host's workers and stops them all on request."""

    def __init__(
        self, spec: AgentSpec, base_env: Mapping[str, str], emit: Emit, adopting: bool = False
    ) -> None:
        self.spec = spec
        #: Whether this process is the subreaper of the workers' descendants
        #: (:func:`adopt_orphans`): only then are its other children theirs.
        self.adopting = adopting
        self.base_env = dict(base_env)
        self._emit = emit
        self.workers: list[Worker] = []
        self._lock = threading.Lock()
        self._terminating = False
        self._next_stop_check = 0.0
        self._next_reap = 0.0

    def start(self, stop: threading.Event | None = None) -> None:
        """Starts the workers in turn; once ``stop`` is set (hvdrun asked, or a signal came),
        or once one could not be started (the job fails with it), the ones not started yet
        are reported stopped (143) instead."""
        failed = False
        for launch in self.spec.workers:
            with self._lock:
                if failed or self._terminating or (stop is not None and stop.is_set()):
                    self._emit(Exit(launch.rank, 143))
                    continue
                try:
                    worker = Worker(launch, self.spec, self.base_env, self._emit)
                except OSError as exc:
                    failed = True
                    code, error = self._start_failure(exc)
                    self._emit(Exit(launch.rank, code, error=error))
                    continue
                self.workers.append(worker)
            self._emit(Started(launch.rank, worker.proc.pid))

    def _start_failure(self, exc: OSError) -> tuple[int, str]:
        """The exit code and the error of a worker that could not be started: 127 for a
        program not found, 126 for one that cannot be run, as a shell says; 1 where this
        host ran out of something (open files, processes, memory), which the error names."""
        program = self.spec.command[0]
        short = ran_out(exc.errno)
        if short is not None:
            return 1, f"cannot start {program!r}: {exc.strerror or exc} ({short})"
        error = f"cannot run {program!r}: {exc.strerror or exc}"
        how = file_here_hint(program, self.spec.cwd)
        if isinstance(exc, FileNotFoundError) and how is not None:
            error += f" (a file in the working directory: {how})"
        return (127 if isinstance(exc, FileNotFoundError) else 126), error

    def signal(self, signum: int) -> None:
        """Sends ``signum`` to each running worker's process group (forwarded signals)."""
        with self._lock:
            workers = [worker for worker in self.workers if not worker.exited.is_set()]
        for worker in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.proc.pid, signum)

    def check_stops(self, force: bool = False) -> None:
        """Reports each running worker that was stopped or continued since the last check
        (at most one check every ``STOP_CHECK_INTERVAL`` s, unless ``force``)."""
        now = time.monotonic()
        if now < self._next_stop_check and not force:
            return
        self._next_stop_check = now + STOP_CHECK_INTERVAL
        with self._lock:
            if self._terminating:
                return  # (hvdrun's stop continues them itself)
            workers = [worker for worker in self.workers if not worker.exited.is_set()]
        for worker in workers:
            stop = worker.stop_state()
            if _same_state(stop, worker.reported_stop):
                continue
            worker.reported_stop = stop
            self._emit(stop if stop is not None else Continued(worker.rank))
        if now >= self._next_reap:  # (the workers are all started: none is taken for adopted)
            self._next_reap = now + REAP_INTERVAL
            self._reap(self.adopted())

    def adopted(self) -> list[psutil.Process]:
        """The agent's children that are not its workers: descendants of the workers whose
        parents exited (see the module's docstring). Nothing where the agent is no
        subreaper (its children are then its workers alone). A worker counts until it is
        reaped: its pid may be another process's afterwards."""
        if not self.adopting:
            return []
        with self._lock:
            workers = {w.proc.pid for w in self.workers if w.proc.returncode is None}
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return []
        return [child for child in children if child.pid not in workers]

    def end_adopted(self, grace: float, hurry: Callable[[], bool] | None = None) -> None:
        """Ends what the host's workers left running outside their process groups (the
        adopted processes and their descendants): SIGTERM (and SIGCONT), SIGKILL after
        ``grace`` seconds (or once ``hurry()``), again for what they fork meanwhile or leave
        behind (their children are adopted in turn), reaping all, for at most
        ``ADOPTED_KILL_S`` more."""
        adopted = self.adopted()
        if grace > 0 and adopted:
            tree = _whole_trees(adopted)
            _signal_each(tree, signal.SIGTERM, signal.SIGCONT)
            _wait_gone(tree, grace, hurry)
        deadline = time.monotonic() + ADOPTED_KILL_S
        while adopted:
            self._reap(adopted)
            live = [proc for proc in adopted if _running(proc)]
            if not live or time.monotonic() > deadline:
                return
            _signal_each(_whole_trees(live), signal.SIGKILL)
            time.sleep(0.02)
            adopted = self.adopted()

    @staticmethod
    def _reap(procs: list[psutil.Process]) -> None:
        """Reaps those of ``procs`` (children of the agent, not workers) that exited."""
        for proc in procs:
            with contextlib.suppress(psutil.Error, OSError):
                if proc.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(proc.pid, os.WNOHANG)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every started worker has exited and been reported."""
        return all(worker.exited.wait(timeout) for worker in list(self.workers))

    def terminate(
        self,
        grace: float | None = None,
        hurry: Callable[[], bool] | None = None,
        because: str | None = None,
    ) -> None:
        """SIGTERM (and SIGCONT) every worker's process tree, SIGKILL what is left after
        ``grace`` seconds, or as soon as ``hurry()`` says so (hvdrun asked to kill
        meanwhile). ``because``: why the agent stops them on its own (hvdrun did not ask),
        which their exits say."""
        grace = self.spec.term_grace if grace is None else grace
        with self._lock:
            self._terminating = True
            workers = list(self.workers)
        for worker in workers:
            worker.stopped_because = because
        trees = _process_trees([worker.proc.pid for worker in workers])
        adopted = _whole_trees(self.adopted())
        for worker, tree in zip(workers, trees, strict=False):
            signal_tree(worker.proc.pid, tree, signal.SIGTERM)
            # A stopped process (SIGSTOP, Ctrl-Z, a hung debugger session) keeps a SIGTERM
            # pending until it runs again: continued, it exits or runs its handler now,
            # instead of being SIGKILLed after the grace period (mpirun and Slurm do too).
            signal_tree(worker.proc.pid, tree, signal.SIGCONT)
        _signal_each(adopted, signal.SIGTERM, signal.SIGCONT)  # (what the workers left: the same)
        procs = [proc for tree in trees for proc in tree] + adopted
        alive = _wait_gone(procs, grace, hurry)
        for worker, tree in zip(workers, trees, strict=False):
            signal_tree(worker.proc.pid, [p for p in tree if p in alive], signal.SIGKILL)
        self.wait(timeout=5.0)


def _process_trees(roots: list[int]) -> list[list[psutil.Process]]:
    """Each root's process and its descendants, from one pass over the process table
    (``children(recursive=True)`` reads the whole table once per root: with a thousand
    workers, stopping them took longer than hvdrun waits for the agent's report)."""
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc)
    trees: list[list[psutil.Process]] = []
    for pid in roots:
        try:
            tree = [psutil.Process(pid)]
        except psutil.Error:
            trees.append([])
            continue
        for proc in tree:  # (grows while it is walked: breadth first)
            tree.extend(children.get(proc.pid, ()))
        trees.append(tree)
    return trees


def _whole_trees(roots: list[psutil.Process]) -> list[psutil.Process]:
    """``roots`` and all their descendants, in one list."""
    if not roots:
        return []  # (no look at the process table)
    return [proc for tree in _process_trees([root.pid for root in roots]) for proc in tree]


def _signal_each(procs: list[psutil.Process], *signums: int) -> None:
    """Sends each of ``signums`` in turn to each process of ``procs`` (gone ones skipped)."""
    for signum in signums:
        for proc in procs:
            with contextlib.suppress(psutil.Error, OSError):
                proc.send_signal(signum)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(
    procs: list[psutil.Process], timeout: float, hurry: Callable[[], bool] | None = None
) -> list[psutil.Process]:
    """The processes still running after up to ``timeout`` s (less once ``hurry()`` is
    true). Unlike psutil.wait_procs this never reaps: a worker's exit status belongs to its
    Worker._wait thread."""
    deadline = time.monotonic() + timeout
    alive = [proc for proc in procs if _running(proc)]
    while alive and time.monotonic() < deadline and not (hurry is not None and hurry()):
        time.sleep(0.02)
        alive = [proc for proc in alive if _running(proc)]
    return alive


def signal_tree(pgid: int, tree: list[psutil.Process], signum: int) -> None:
    """Sends ``signum`` once to each process of a worker's ``tree``: to its process group,
    then to those that left the group (setsid, double fork). A worker's handler must run
    once: a second SIGTERM would interrupt its cleanup (a checkpoint being saved)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
    for proc in tree:
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) != pgid:
                proc.send_signal(signum)
