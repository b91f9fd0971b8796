"""Elastic stress: elastic scenarios run over and over, to find the rare failures and hangs.

The elastic tests (tests/elastic/test_elastic_jobs.py) run each scenario once; a race may
show up only once in many runs, or only on a loaded machine. This driver builds ONE test cluster
(tests/cluster.py: three network namespaces, each a host with its own sshd; it needs root and
openssh-server) and runs each chosen scenario ``--runs`` times on it: every run starts hvdrun
as a subprocess, reads its output line by line, acts on it with triggers (kills a host after
step 10, ...) and then makes the same checks as the test (the tests' ``Job``, ``after_step``,
``at_size`` and ``check_finished_exactly`` are imported, not copied). It is not part of
``make test``; ``make bench`` runs it with no arguments (3 runs of each scenario). Without
root or sshd it prints its usage and why it cannot run, and exits 0.

    python bench/elastic_stress.py [--runs N] [--scenario NAME]... [--load] [--timeout S]
                                   [--keep-going] [--logs DIR]

``--load`` keeps one busy process per CPU core running for the whole run (a machine
"loaded by a busy process"). A run that has not ended ``--timeout`` seconds after it started
is HUNG: before its processes are killed, ``py-spy dump`` takes the Python stack of every
process of the job (hvdrun and its children here, the agents and workers on the hosts) into
``<scenario>-<run>.stacks.txt``. Without py-spy (``pip install py-spy``, in the ``dev``
extra) only the list of processes is written: the workers do not register ``faulthandler``,
so a SIGUSR1 would kill them rather than print their stacks. Without ``--keep-going`` the
first run that fails or hangs ends the stress run.

Reading the output. The first line names the log directory (``--logs``, by default a new
temporary one); it holds every run's full hvdrun output (``<scenario>-<run>.log``), and what
else a scenario saved (the autotune CSVs, the stacks of a hung job). Then one line per run::

    rank0-dies-cache-autotune run 2/5: ok (autotune: 6 samples in 3 log(s), ...) 32.5 s
    rank0-dies-cache-autotune run 3/5: FAILED: hvdrun exited 1: <its last line> 35.0 s
    rank0-dies-cache-autotune run 4/5: HUNG after 180 s (stacks in DIR/...) 180.6 s

the time being the whole run's, from starting hvdrun to the last check (hosts clean). The
closing table gives per scenario the number of ok, failed and hung runs, the median, minimum
and maximum time of the runs that ended (hung ones left out), and the runs that took more
than twice the median (a slow recovery is worth a look even when it passed). The exit
status is 1 when any run failed or hung, else 0.

Adding a scenario: a function of a :class:`Run` that returns an :class:`Outcome`, registered
with ``@scenario("name")``. It starts hvdrun with ``run.job(...)``, sets triggers with
``job.when(...)``, waits with ``run.wait(job)`` (which turns a timeout into a hang and takes
the stacks), and checks with :func:`expect` / :func:`check` (a failed check ends the run as
FAILED with a one-line reason). Between runs the driver brings the hosts back (links up,
sshd listening, nothing else running), whatever the scenario did to them; an ok run after
which processes were left there counts as FAILED (its own checks missed them).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.cluster import (  # noqa: E402
    Cluster,
    ClusterHost,
    assert_hosts_clean,
    kill_host,
    listening_sshd,
    start_cluster,
    unavailable_reason,
    write_hosts,
)
from tests.elastic.test_elastic_jobs import (  # noqa: E402
    Job,
    after_step,
    at_size,
    check_finished_exactly,
    check_steps_never_go_back,
    elastic_args,
    hosts_file,
)

DEFAULT_RUNS = 3
DEFAULT_TIMEOUT = 180.0
STATUSES = ("ok", "failed", "hung")


# ---- outcomes and checks --------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How a run ended: ``ok`` (``detail``: what it noted), ``failed`` (``detail``: why) or
    ``hung`` (``detail``: where the stacks are)."""

    status: str
    detail: str = ""

    def describe(self) -> str:
        if self.status == "ok":
            return f"ok ({self.detail})" if self.detail else "ok"
        return f"{self.status.upper()}: {self.detail}" if self.status == "failed" else self.detail


def ok(note: str = "") -> Outcome:
    return Outcome("ok", note)


class Failed(Exception):
    """A check of a run did not hold; the message is the one-line reason."""


class Hung(Exception):
    """The job was still running at the run's timeout; the message says where its stacks are."""


def expect(condition: bool, reason: str) -> None:
    if not condition:
        raise Failed(reason)


def expect_line(output: str, text: str, what: str, near: str) -> None:
    """``text`` is in the output; else fails with ``what`` and the lines that hold ``near``
    (what the job printed instead)."""
    if text in output:
        return
    instead = [line.strip() for line in output.splitlines() if near in line]
    seen = "; ".join(instead[:3]) if instead else f"no line with {near!r}"
    raise Failed(f"{what}: expected {text!r}, got: {seen}")


def expect_left(output: str, host: ClusterHost, workers: int) -> None:
    """The workers of ``host``, which discovery dropped, left by themselves (each says so,
    then exits 0) rather than being stopped with their agent."""
    said = output.count(f"hvdrun: leaving the elastic job: host {host.alias!r}")
    expect(
        said == workers,
        f"{workers - said} of the {workers} worker(s) on {host.alias}, which discovery "
        "dropped, were stopped before they left by themselves",
    )


def check(what: str, helper: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Runs one of the tests' assertion helpers; an AssertionError becomes a one-line
    reason: ``what``, and the assertion's message if short, else the failing ``assert``
    line itself (the tests' messages are often the job's whole output)."""
    try:
        helper(*args, **kwargs)
    except AssertionError as error:
        message = str(error).strip()
        if not message or len(message) > 300:
            frames = traceback.extract_tb(error.__traceback__)
            message = (frames[-1].line or "") if frames else ""
        raise Failed(f"{what}: {' | '.join(message.splitlines())}") from None


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


# ---- one run --------------------------------------------------------------------------------


@dataclass
class Run:
    """What a scenario gets: the cluster, an empty directory shared with the hosts, and the
    means to start and wait for hvdrun jobs under the run's timeout."""

    cluster: Cluster
    scenario: str
    number: int
    workdir: Path
    logs: Path
    timeout: float
    started: float = field(default_factory=time.monotonic)
    jobs: list[Job] = field(default_factory=list)
    watchers: list[FileVersions] = field(default_factory=list)

    @property
    def hosts(self) -> list[ClusterHost]:
        return self.cluster.hosts

    @property
    def name(self) -> str:
        """The run's name in the log directory, e.g. ``rank0-dies-cache-autotune-003``."""
        return f"{self.scenario}-{self.number:03d}"

    def log_path(self, suffix: str) -> Path:
        return self.logs / f"{self.name}{suffix}"

    def hosts_file(self, *hosts: ClusterHost) -> Path:
        """A discovery answer naming ``hosts`` (rewrite it with tests.cluster.write_hosts)."""
        return hosts_file(self.workdir, *hosts)

    def job(self, *args: str) -> Job:
        """Starts ``hvdrun ARGS`` on the cluster (the tests' Job: output read line by line)."""
        job = Job(self.cluster, *args)
        self.jobs.append(job)
        return job

    def watch(self, path: Path) -> FileVersions:
        """Keeps every version of a file the job writes (and may truncate) while it runs."""
        watcher = FileVersions(path)
        self.watchers.append(watcher)
        return watcher

    def wait(self, job: Job) -> tuple[int, str]:
        """(exit code, output) of the job; at the run's timeout, takes the stacks of the
        job's processes and raises Hung (the driver then kills them)."""
        remaining = self.started + self.timeout - time.monotonic()
        try:
            job.proc.wait(max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            stacks = self.log_path(".stacks.txt")
            how = dump_stacks(self.cluster, job, stacks)
            raise Hung(f"HUNG after {self.timeout:g} s ({how} in {stacks})") from None
        return job.wait(30)  # it has ended: this only joins the reader


class FileVersions:
    """Polls a file while a job runs and keeps every version of it: one the job truncates and
    writes again (autotune's log is reopened by the rank 0 of each generation) shows as a
    new version, so what earlier generations wrote is not lost."""

    def __init__(self, path: Path, interval: float = 0.05) -> None:
        self.path = path
        self.versions: list[str] = []
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stopped.wait(self._interval):
            self._read()

    def _read(self) -> None:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError):
            return
        if not text:
            return
        if self.versions and text.startswith(self.versions[-1]):
            self.versions[-1] = text  # it grew
        elif not self.versions or text != self.versions[-1]:
            self.versions.append(text)  # shorter or different: written again from the start

    def stop(self) -> list[str]:
        if not self._stopped.is_set():
            self._stopped.set()
            self._thread.join()
            self._read()
        return self.versions


def job_processes(cluster: Cluster, job: Job) -> Iterator[tuple[str, psutil.Process]]:
    """(where, process) for hvdrun and its children here, and everything on the hosts but
    their listening sshd (the agents, the workers, their SSH sessions)."""
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(job.proc.pid)
        yield "launcher", root
        for child in root.children(recursive=True):
            yield "launcher", child
    for host in cluster.hosts:
        for proc in cluster.processes_on(host):
            with contextlib.suppress(psutil.Error):
                if not listening_sshd(proc):
                    yield host.alias, proc


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stacks(cluster: Cluster, job: Job, path: Path) -> str:
    """Writes the process list of the job, with each Python process's stack (py-spy dump)
    if py-spy is installed; returns what it wrote ("stacks" or "process list")."""
    spy = py_spy()
    with path.open("w") as out:
        if spy is None:
            out.write(
                "py-spy is not installed (pip install py-spy): no stacks, only the processes.\n"
                "(SIGUSR1 is not used: the workers register no faulthandler for it.)\n"
            )
        for where, proc in job_processes(cluster, job):
            try:
                cmdline = " ".join(proc.cmdline())
                python = "python" in proc.name() or "python" in Path(proc.exe()).name
                status = proc.status()
            except psutil.Error as error:
                out.write(f"=== {where} pid {proc.pid}: gone ({error})\n")
                continue
            out.write(f"=== {where} pid {proc.pid} ({status}): {cmdline}\n")
            if spy is None or not python:
                continue
            try:
                dump = subprocess.run(
                    [spy, "dump", "--pid", str(proc.pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                out.write(dump.stdout + dump.stderr + "\n")
            except subprocess.TimeoutExpired:
                out.write("(py-spy dump took more than 30 s)\n")
            out.flush()
    return "process list" if spy is None else "stacks"


def kill_tree(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        for each in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                each.kill()
    proc.wait()


def reset_hosts(cluster: Cluster) -> list[str]:
    """Brings every host back to how a run starts: link up, sshd listening (a scenario may
    leave a host cut off or without sshd), nothing else running. Returns the processes it
    had to kill, by host (after an ok run there should be none)."""
    killed = []
    for host in cluster.hosts:
        cluster.set_link(host, up=True)
        if host.sshd is None or host.sshd.poll() is not None:
            cluster.stop_sshd(host)
            cluster.start_sshd(host)
        left = []
        for proc in cluster.processes_on(host):
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE and not listening_sshd(proc):
                    left.append(proc)
        if left:
            kill_host(cluster, host)
            killed.append(f"{len(left)} process(es) left on {host.alias}")
    return killed


def run_once(
    cluster: Cluster, name: str, number: int, logs: Path, timeout: float
) -> tuple[Outcome, float]:
    workdir = cluster.root / f"run-{name}-{number}"
    workdir.mkdir()
    run = Run(cluster, name, number, workdir, logs, timeout)
    try:
        outcome = SCENARIOS[name](run)
    except Failed as failure:
        outcome = Outcome("failed", str(failure))
    except Hung as hang:
        outcome = Outcome("hung", str(hang))
    except Exception as error:  # a bug of the scenario, or of the cluster: still a failure
        outcome = Outcome("failed", f"{type(error).__name__}: {error}")
    finally:
        for job in run.jobs:
            if job.proc.poll() is None:
                kill_tree(job.proc)
        for watcher in run.watchers:
            watcher.stop()
        seconds = time.monotonic() - run.started
        for index, job in enumerate(run.jobs):
            suffix = ".log" if index == 0 else f".job{index + 1}.log"
            run.log_path(suffix).write_text("\n".join(job.lines) + "\n")
        for index, watcher in enumerate(run.watchers):
            for version, text in enumerate(watcher.versions):
                run.log_path(
                    f".{watcher.path.stem}{index}.{version}{watcher.path.suffix}"
                ).write_text(text)
        shutil.rmtree(workdir, ignore_errors=True)
    left = reset_hosts(cluster)
    if left and outcome.status == "ok":  # the run's own checks should have seen this
        outcome = Outcome("failed", "the hosts were not clean after it: " + "; ".join(left))
    return outcome, seconds


# ---- scenarios ------------------------------------------------------------------------------

Scenario = Callable[[Run], Outcome]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    """Registers a scenario under ``name`` (its docstring's first line is its --help)."""

    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = fn
        return fn

    return register


@dataclass(frozen=True)
class AutotuneLog:
    """What autotune's CSVs (``--autotune-log-file``) say about a job. Each generation's
    engine starts autotune afresh and its rank 0 writes the file anew: one version each.

    A row is written at a sample's end, and the ranks switch settings right after a
    ``baseline`` row (to the candidate) and after a ``sample`` row (back to the baseline):
    those rows count as switches (a failure may cut the broadcast that carries the last)."""

    logs: int  # versions of the file: generations whose rank 0 started autotune
    samples: int  # rows: every sample that ended (warm-up, baseline, candidate)
    switches: int  # settings changed after a sample
    switched_logs: int  # logs (generations) with at least one switch
    without_cache: int  # candidate samples that ran with the response cache off

    @classmethod
    def parse(cls, versions: list[str]) -> AutotuneLog:
        samples = switches = switched_logs = without_cache = 0
        for text in versions:
            rows = list(csv.DictReader(io.StringIO(text)))
            samples += len(rows)
            switched = sum(row["phase"] in ("baseline", "sample") for row in rows)
            switches += switched
            switched_logs += switched > 0
            without_cache += sum(r["phase"] == "sample" and r["cache_enabled"] == "0" for r in rows)
        return cls(len(versions), samples, switches, switched_logs, without_cache)

    def describe(self) -> str:
        return (
            f"autotune: {self.samples} samples in {self.logs} log(s), {self.switches} "
            f"switch(es) in {self.switched_logs} of them, {self.without_cache} candidate "
            "sample(s) without the response cache"
        )


@scenario("rank0-dies-cache-autotune")
def rank0_dies_cache_autotune(run: Run) -> Outcome:
    """Rank 0's host dies, a new rank 0 carries on and the host comes back, with the
    response cache and autotune on (short autotune samples, so that it switches settings)."""
    # As tests/elastic/test_elastic_jobs.py's
    # test_rank_0_host_dies_a_new_rank_0_carries_on_and_the_host_comes_back, plus autotune
    # (the response cache is on by default; --cache-capacity says so). Each generation's
    # engine starts autotune afresh: a warm-up sample of 10 busy cycles, then baseline and
    # candidate samples of about 0.5 s alternate, the ranks agreeing on each switch in a
    # broadcast that a failure may cut; the first candidate (autotune's generator is
    # seeded) turns the response cache off. Why 10 and not 5: the warm-up sample of a new
    # generation starts with the burst of the state's sync, and the next sample is paced
    # from it; with 5 cycles it holds little but that burst (5 cycles in 0.04 s), the
    # baseline sample then lasts 60-odd cycles (about 25 steps) and generation 2, about
    # 1.5 s long, never gets to a candidate. With 10, generations 1 and 2 both switch.
    node1, node2, node3 = run.hosts
    discovery = run.hosts_file(node1, node2, node3)
    stop = run.workdir / "stop"
    log = run.workdir / "autotune.csv"
    job = run.job(
        "-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "1", "1",
        "--cache-capacity", "1024",
        "--autotune", "--autotune-log-file", str(log),
        "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "10",
        "-x", f"STOP_FILE={stop}",
        *elastic_args(discovery, 100000),
    )  # fmt: skip
    autotune = run.watch(log)
    job.when(after_step(10), lambda: kill_host(run.cluster, node1))
    # run until node1 is back and a step was taken on three hosts again
    job.when(at_size(3, generation=3), stop.touch)
    code, output = run.wait(job)
    expect(code == 0, f"hvdrun exited {code}: {last_line(output)}")
    expect_line(
        output,
        f"host {node1.alias} failed (lost the connection to its agent); blacklisted for 1 s",
        "the blacklist line",
        near=f"host {node1.alias} ",
    )
    # the survivors keep their order: node2 is the new rank 0
    expect_line(
        output,
        f"generation 2: 2 worker(s) on 2 host(s): {node2.alias}, {node3.alias}",
        "generation 2",
        near="generation 2:",
    )
    # after its cooldown node1 is back, as the newest host: the highest rank
    expect_line(
        output,
        f"generation 3: 3 worker(s) on 3 host(s): {node2.alias}, {node3.alias}, {node1.alias}",
        "generation 3",
        near="generation 3:",
    )
    check("exactly-once steps", check_finished_exactly, output, None, size=3)
    check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
    tuned = AutotuneLog.parse(autotune.stop())
    expect(tuned.switches > 0, f"autotune never switched settings ({tuned.describe()})")
    return ok(tuned.describe())


@scenario("hosts-added-removed")
def hosts_added_removed(run: Run) -> Outcome:
    """Discovery adds a third host after step 5, then drops the second: the job grows to
    three and shrinks back to two (a graceful removal: no host fails, no step is lost)."""
    node1, node2, node3 = run.hosts
    discovery = run.hosts_file(node1, node2)
    stop = run.workdir / "stop"
    job = run.job(
        "-np", "2", "--min-np", "2", "--max-np", "3", "-x", f"STOP_FILE={stop}",
        *elastic_args(discovery, 100000),
    )  # fmt: skip
    job.when(after_step(5), lambda: write_hosts(discovery, node1, node2, node3))
    job.when(after_step(1, size=3), lambda: write_hosts(discovery, node1, node3))
    job.when(at_size(2, generation=3), stop.touch)
    code, output = run.wait(job)
    expect(code == 0, f"hvdrun exited {code}: {last_line(output)}")
    expect(" failed (" not in output, "a host failed: " + failed_line(output))
    expect_line(output, f"host {node2.alias} is no longer discovered", "removal", "discovered")
    expect_left(output, node2, 1)
    check("exactly-once steps", check_finished_exactly, output, None, size=2)
    check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
    return ok()


#: Seconds between hvdrun publishing the generation that adds a host and discovery dropping
#: the original one (the added-then-original-removed scenarios).
REMOVAL_OFFSETS = (0.0, 0.5, 1.0, 1.5, 2.0)
SYNC_WAITING = "are still receiving the training state from"


def added_then_original_removed(offset: float) -> Scenario:
    def run_it(run: Run) -> Outcome:
        node1, node2 = run.hosts[:2]
        discovery = run.hosts_file(node1)
        stop = run.workdir / "stop"
        job = run.job(
            "-np", "2", "--min-np", "2", "--slots-per-host", "2", "-x", f"STOP_FILE={stop}",
            *elastic_args(discovery, 100000),
        )  # fmt: skip
        removal = threading.Timer(offset, lambda: write_hosts(discovery, node2))
        job.when(after_step(5), lambda: write_hosts(discovery, node1, node2))
        job.when(lambda line: "generation 2: 4 worker(s)" in line, removal.start)
        job.when(at_size(2, generation=3), stop.touch)
        try:
            code, output = run.wait(job)
        finally:
            removal.cancel()
        # Nothing failed and nobody died: a stop saying the state is lost (or not handed
        # on) is a false one, and training on from anything but the committed steps a loss.
        stops = [
            line.strip()
            for line in output.splitlines()
            if "the training state is lost" in line or "No hosts from previous set" in line
        ]
        expect(not stops, "false stop: " + (stops[0][:200] if stops else ""))
        expect(code == 0, f"hvdrun exited {code}: {last_line(output)}")
        expect_line(
            output,
            f"generation 3: 2 worker(s) on 1 host(s): {node2.alias}",
            "generation 3",
            near="generation 3:",
        )
        expect_left(output, node1, 2)
        check("no step lost or repeated", check_steps_never_go_back, output)
        check("exactly-once steps", check_finished_exactly, output, None, size=2)
        check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
        return ok("waited for the sync" if SYNC_WAITING in output else "after the sync")

    run_it.__doc__ = (
        f"A host is added (2 slots each), and {offset:g} s after hvdrun published the "
        "generation with it discovery drops the original one: the job goes on with the new "
        "host's workers, from the committed steps (its sync may still be under way)."
    )
    return run_it


for _offset in REMOVAL_OFFSETS:
    scenario(f"original-removed-{_offset:g}s")(added_then_original_removed(_offset))


@scenario("rank-fails")
def rank_fails(run: Run) -> Outcome:
    """A worker exits 1 after step 10: its host is blacklisted for good and the job
    finishes on the other two, every step applied once."""
    node1, node2, node3 = run.hosts
    discovery = run.hosts_file(node1, node2, node3)
    steps = 40
    job = run.job(
        "-np", "3", "--min-np", "2",
        "-x", f"FAIL_HOST={node3.alias}", "-x", "FAIL_AT_STEP=10",
        *elastic_args(discovery, steps),
    )  # fmt: skip
    code, output = run.wait(job)
    expect(code == 0, f"hvdrun exited {code}: {last_line(output)}")
    expect_line(
        output,
        f"host {node3.alias} failed (worker ",
        "the failure line",
        near=f"host {node3.alias}",
    )
    check("exactly-once steps", check_finished_exactly, output, steps, size=2)
    check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
    return ok()


def failed_job(run: Run, job: Job, horovods: str, stop: tuple[str, str]) -> Outcome:
    """The end of a job that must fail: exit 1, Horovod's sentence first, then hvdrun's
    stop line (its text and a word to show the nearest line by), no step lost or
    repeated, and nothing left on the hosts."""
    code, output = run.wait(job)
    expect(code == 1, f"hvdrun exited {code}, not 1: {last_line(output)}")
    expect_line(output, horovods, "Horovod's sentence", near="Horovod")
    expect_line(output, stop[0], "the stop", stop[1])
    check("no step lost or repeated", check_steps_never_go_back, output)
    check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
    return ok()


@scenario("all-ranks-fail")
def all_ranks_fail(run: Run) -> Outcome:
    """Every worker exits 1 after step 5: the job ends (exit 1) with Horovod's sentence,
    and no worker ever starts over from the initial state."""
    node1, node2 = run.hosts[:2]
    discovery = run.hosts_file(node1, node2)
    job = run.job(
        "-np", "2", "--min-np", "1", "-x", "FAIL_HOST=*", "-x", "FAIL_AT_STEP=5",
        *elastic_args(discovery, 100000),
    )  # fmt: skip
    return failed_job(
        run,
        job,
        "Horovod detected that one or more processes exited with non-zero status",
        ("every worker of the elastic job has failed", "every"),
    )


@scenario("reset-limit")
def reset_limit(run: Run) -> Outcome:
    """A worker fails after step 5 with --reset-limit 0: the reset that follows is one too
    many; the job ends (exit 1) with Horovod's sentence, then hvdrun's."""
    node1, node2, node3 = run.hosts
    discovery = run.hosts_file(node1, node2, node3)
    job = run.job(
        "-np", "3", "--min-np", "1", "--reset-limit", "0",
        "-x", f"FAIL_HOST={node3.alias}", "-x", "FAIL_AT_STEP=5",
        *elastic_args(discovery, 100000),
    )  # fmt: skip
    return failed_job(
        run,
        job,
        "Horovod was shutdown because number of resets during elastic job exceeded limit: 0",
        ("would need reset 1, more than --reset-limit 0", "reset"),
    )


@scenario("blacklist-cooldown")
def blacklist_cooldown(run: Run) -> Outcome:
    """Rank 0's worker exits 1 after step 5; its host is blacklisted for 2 s, then comes
    back with a new worker that gets the state: the job grows back to three."""
    node1, node2, node3 = run.hosts
    discovery = run.hosts_file(node1, node2, node3)
    stop = run.workdir / "stop"
    job = run.job(
        "-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "2", "2",
        "-x", f"FAIL_HOST={node1.alias}", "-x", "FAIL_AT_STEP=5", "-x", f"STOP_FILE={stop}",
        *elastic_args(discovery, 100000),
    )  # fmt: skip
    job.when(at_size(3, generation=3), stop.touch)
    code, output = run.wait(job)
    expect(code == 0, f"hvdrun exited {code}: {last_line(output)}")
    expect_line(output, f"host {node1.alias} failed (worker 0 exited", "the failure", near="failed")
    expect_line(
        output,
        f"generation 3: 3 worker(s) on 3 host(s): {node2.alias}, {node3.alias}, {node1.alias}",
        "generation 3",
        near="generation 3:",
    )
    check("exactly-once steps", check_finished_exactly, output, None, size=3)
    check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
    return ok()


@scenario("stopped-hvdrun")
def stopped_hvdrun(run: Run) -> Outcome:
    """hvdrun itself is stopped (SIGSTOP) for 8 s after step 10, then continued: no worker
    or agent may take that for a lost job; the job trains on."""
    node1, node2 = run.hosts[:2]
    discovery = run.hosts_file(node1, node2)
    steps = 60
    job = run.job("-np", "2", "--min-np", "1", *elastic_args(discovery, steps))

    def pause() -> None:
        job.proc.send_signal(signal.SIGSTOP)
        time.sleep(8)
        job.proc.send_signal(signal.SIGCONT)

    job.when(after_step(10), lambda: threading.Thread(target=pause, daemon=True).start())
    code, output = run.wait(job)
    expect(code == 0, f"hvdrun exited {code}: {last_line(output)}")
    expect(" failed (" not in output, "a host failed: " + failed_line(output))
    check("exactly-once steps", check_finished_exactly, output, steps, size=2)
    check("hosts clean", assert_hosts_clean, run.cluster, run.hosts, within=10)
    return ok()


def failed_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if " failed (" in line]
    return lines[0][:200] if lines else ""


# ---- the driver -----------------------------------------------------------------------------


@contextlib.contextmanager
def busy_load(enabled: bool) -> Iterator[int]:
    """One busy process per CPU core while the block runs; yields how many."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if enabled:
            for _ in range(os.cpu_count() or 1):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL
                    )
                )
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def summary(results: dict[str, list[tuple[int, Outcome, float]]]) -> list[str]:
    header = (
        f"{'scenario':<28}{'runs':>5}{'ok':>5}{'failed':>7}{'hung':>5}"
        f"{'median s':>10}{'min s':>8}{'max s':>8}  runs over 2x the median"
    )
    lines = [header]
    for name, runs in results.items():
        counts = {status: sum(o.status == status for _, o, _ in runs) for status in STATUSES}
        ended = [(n, s) for n, o, s in runs if o.status != "hung"]
        times = [s for _, s in ended]
        if times:
            median = statistics.median(times)
            slow = ", ".join(f"#{n} ({s:.1f} s)" for n, s in ended if s > 2 * median) or "-"
            stats = f"{median:>10.1f}{min(times):>8.1f}{max(times):>8.1f}  {slow}"
        else:
            stats = f"{'-':>10}{'-':>8}{'-':>8}  -"
        lines.append(
            f"{name:<28}{len(runs):>5}{counts['ok']:>5}{counts['failed']:>7}{counts['hung']:>5}"
            + stats
        )
    return lines


def parser() -> argparse.ArgumentParser:
    scenarios = "\n".join(
        textwrap.fill(
            " ".join((fn.__doc__ or "").split()),
            width=88,
            initial_indent=f"  {name}: ",
            subsequent_indent="    ",
        )
        for name, fn in SCENARIOS.items()
    )
    result = argparse.ArgumentParser(
        prog="elastic_stress.py",
        description="Runs elastic scenarios over and over on one network-namespace cluster\n"
        "(needs root and sshd); with no arguments, 3 runs of each scenario.",
        epilog=f"scenarios:\n{scenarios}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = result.add_argument
    add(
        "--runs",
        type=int,
        default=DEFAULT_RUNS,
        metavar="N",
        help=f"runs of each scenario (default {DEFAULT_RUNS})",
    )
    add(
        "--scenario",
        action="append",
        choices=list(SCENARIOS),
        metavar="NAME",
        help="a scenario to run (repeatable; default: all)",
    )
    add("--load", action="store_true", help="keep one busy process per CPU core running meanwhile")
    add(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"a run still going S s after it started is hung (default {DEFAULT_TIMEOUT:g})",
    )
    add(
        "--keep-going",
        action="store_true",
        help="go on after a run failed or hung (default: stop there)",
    )
    add(
        "--logs",
        type=Path,
        metavar="DIR",
        help="where the runs' output goes (default: a new temporary directory)",
    )
    return result


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.runs < 1:
        cli.error("--runs must be at least 1")
    reason = unavailable_reason()
    if reason is not None:
        cli.print_usage()
        print(f"elastic_stress: skipped: {reason}")
        return 0
    names = list(dict.fromkeys(args.scenario or SCENARIOS))
    logs = args.logs or Path(tempfile.mkdtemp(prefix="elastic-stress-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"elastic_stress: logs in {logs}", flush=True)
    # A SIGTERM unwinds like Ctrl-C: the jobs, the load and the cluster go.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results: dict[str, list[tuple[int, Outcome, float]]] = {name: [] for name in names}
    interrupted = False
    started = time.monotonic()
    with busy_load(args.load) as busy:
        if busy:
            print(f"elastic_stress: {busy} busy process(es) running meanwhile", flush=True)
        cluster = start_cluster(hosts=3, sshd_hosts=3)
        try:
            stop = False
            for name in names:
                for number in range(1, args.runs + 1):
                    outcome, seconds = run_once(cluster, name, number, logs, args.timeout)
                    results[name].append((number, outcome, seconds))
                    print(
                        f"{name} run {number}/{args.runs}: {outcome.describe()} {seconds:.1f} s",
                        flush=True,
                    )
                    if outcome.status != "ok" and not args.keep_going:
                        stop = True
                        break
                if stop:
                    print("elastic_stress: stopping at the first run that did not pass "
                          "(--keep-going goes on)")  # fmt: skip
                    break
        except KeyboardInterrupt:
            interrupted = True
            print("elastic_stress: interrupted", flush=True)
        finally:
            cluster.close()
    total = time.monotonic() - started
    print(f"elastic_stress: {total:.0f} s in all{', loaded' if args.load else ''}; logs in {logs}")
    for line in summary({name: runs for name, runs in results.items() if runs}):
        print(line)
    passed = all(o.status == "ok" for runs in results.values() for _, o, _ in runs)
    if interrupted:
        return 130
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
