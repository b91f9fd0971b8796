"""A real standalone Spark cluster on the test hosts: a master here, one worker per host.

Built from PySpark's own jars (``pip install pyspark``; Spark 4 needs Java 17, Debian's
``openjdk-17-jre-headless``) on :mod:`tests.cluster`'s network-namespace hosts:

* the master in this machine's network namespace, at the bridge's address (the hosts reach
  it there, and nothing listens on another interface);
* one worker per host, in the host's namespaces (network, and UTS for a host name of its
  own), with two cores and 1.2 GiB for executors,
  so that two applications fit (one executor of each): the executors it starts run there,
  each a separate host with its own address;
* the driver (:meth:`SparkCluster.session`) here, at the bridge's address too.

Every JVM is small (256 MiB for the daemons, 512 MiB for the driver and each executor, the
client compiler only) because two cores serve them all. The daemons die with the test
process (``PR_SET_PDEATHSIG``); :meth:`SparkCluster.close` stops the driver's JVM, the
master, the workers and every executor they started, and checks by pid that none is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.cluster import Cluster, ClusterHost, cluster_for_tests, dying_with_parent, free_port

REPO = Path(__file__).resolve().parents[1]
#: Small and quick JVMs: two cores start six of them.
JAVA_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xss1m"
EXECUTOR_MEMORY = "512m"


def spark_unavailable_reason() -> str | None:
    """Why a Spark cluster cannot be built here, or None."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "PySpark is not installed (pip install 'hvdrun[spark]')"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime (apt-get install openjdk-17-jre-headless)"
    return None


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _wait_for_log(path: Path, text: str, proc: subprocess.Popen[bytes], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace") if path.exists() else ""
        if text in log:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name}: the JVM exited ({proc.returncode}):\n{log[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{path.name}: no {text!r} within {within:g} s")


@dataclass
class SparkCluster:
    hosts: Cluster
    root: Path
    master_url: str = ""
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # host address
    seen: set[int] = field(default_factory=set)  # every JVM pid the tests saw

    @property
    def driver_host(self) -> str:
        return self.hosts.gateway

    def _env(self, local_ip: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(self.root / "conf"),
            SPARK_LOCAL_IP=local_ip,
            SPARK_LOCAL_HOSTNAME=local_ip,
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS=JAVA_OPTIONS,
            SPARK_NO_DAEMONIZE="1",
            PYSPARK_PYTHON=sys.executable,
        )
        return env

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                dying_with_parent(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.daemons.append(proc)
        return proc

    def start(self) -> None:
        spark_class = str(spark_home() / "bin" / "spark-class")
        host = self.driver_host
        port = free_port(host)
        log = self.root / "master.log"
        master = self._spawn(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                host,
                "--port",
                str(port),
                "--webui-port",
                str(free_port(host)),
            ],
            self._env(host),
            log,
        )
        self.master_url = f"spark://{host}:{port}"
        _wait_for_log(log, "I have been elected leader", master, 90)
        for node in self.hosts.hosts:
            self.start_worker(node)
        for node in self.hosts.hosts:
            proc = self.workers[node.address]
            _wait_for_log(self._worker_log(node), "Successfully registered", proc, 90)

    def _worker_log(self, node: ClusterHost) -> Path:
        return self.root / f"worker-{node.index}.log"

    def start_worker(self, node: ClusterHost) -> None:
        spark_class = str(spark_home() / "bin" / "spark-class")
        work = self.root / f"work-{node.index}"
        work.mkdir(exist_ok=True)
        # A UTS namespace too: each host has a host name of its own, as real ones do.
        rename = 'hostname "$0" && exec "$@"'
        argv = ["ip", "netns", "exec", node.netns, "unshare", "--uts", "--", "sh", "-c", rename]
        argv += [f"hvdt-spark{node.index}-{os.getpid()}", spark_class]
        argv += ["org.apache.spark.deploy.worker.Worker", "--host", node.address]
        argv += ["--cores", "2", "--memory", "1200m", "--work-dir", str(work)]
        argv += ["--webui-port", "0", self.master_url]
        self.workers[node.address] = self._spawn(
            argv, self._env(node.address), self._worker_log(node)
        )

    def session(self, app: str, **conf: str) -> Any:
        """A SparkSession of this cluster (the driver runs here, in this process)."""
        session = make_session(self.master_url, self.driver_host, len(self.hosts.hosts), app, conf)
        self.note_jvms()
        return session

    def executors(self, app_id: str | None = None) -> list[tuple[str, psutil.Process]]:
        """The running executors' JVMs (of application ``app_id``, or all), with the host
        each runs on."""
        found = []
        for worker in self.workers.values():
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(worker.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        argv = child.cmdline()
                        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" not in argv:
                            continue
                        if app_id is None or app_id in argv:
                            found.append((argv[argv.index("--hostname") + 1], child))
        return found

    def wait_for_executors(self, context: Any, count: int, within: float = 90) -> None:
        """Until the application has ``count`` executors (besides the driver)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            status = context._jsc.sc().getExecutorMemoryStatus()
            if status.size() - 1 >= count:
                self.note_jvms()
                return
            time.sleep(0.3)
        raise AssertionError(f"the application did not get {count} executors in {within:g} s")

    def note_jvms(self) -> None:
        """Remembers every Spark process running now, to check at the end that it is gone."""
        from pyspark import SparkContext

        for proc in self.daemons:
            self.seen.add(proc.pid)
            with contextlib.suppress(psutil.Error):
                self.seen.update(child.pid for child in psutil.Process(proc.pid).children(True))
        gateway = SparkContext._gateway
        if gateway is not None and getattr(gateway, "proc", None) is not None:
            self.seen.add(gateway.proc.pid)

    def stop_driver(self) -> None:
        """Stops the SparkContext and the driver's JVM (PySpark leaves that running)."""
        from pyspark import SparkContext

        self.note_jvms()
        context = SparkContext._active_spark_context
        if context is not None:
            context.stop()
        gateway = SparkContext._gateway
        if gateway is not None:
            proc = getattr(gateway, "proc", None)
            with contextlib.suppress(Exception):
                gateway.shutdown()
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(30)
            SparkContext._gateway = None
            SparkContext._jvm = None

    def close(self) -> None:
        self.stop_driver()
        self.note_jvms()
        for proc in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.daemons:
            proc.wait(30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = [pid for pid in self.seen if alive(pid)]
            if not left:
                return
            time.sleep(0.1)
        raise AssertionError(f"Spark processes left running: {left}")


def make_session(
    master_url: str, driver_host: str, executors: int, app: str, conf: dict[str, str]
) -> Any:
    """A SparkSession of the cluster at ``master_url`` with one single-core executor on each
    of ``executors`` hosts, its driver in this process at ``driver_host``."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    settings = {
        "spark.driver.host": driver_host,
        "spark.driver.bindAddress": driver_host,
        "spark.driver.memory": EXECUTOR_MEMORY,
        "spark.driver.extraJavaOptions": JAVA_OPTIONS,
        "spark.executor.memory": EXECUTOR_MEMORY,
        "spark.executor.cores": "1",
        "spark.cores.max": str(executors),
        "spark.executor.extraJavaOptions": JAVA_OPTIONS,
        "spark.executorEnv.PYTHONPATH": str(REPO),
        "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.default.parallelism": str(executors),
        **conf,
    }
    builder = SparkSession.builder.master(master_url).appName(app)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as error:
        # pyspark's driver JVM (spark-submit, started by pyspark itself) once exited
        # before it wrote its port, without a word, late in a full suite run (1 run in
        # 3; the same tests passed alone and in the next run). Start it once more, and
        # say so; a second failure is the test's.
        if "JAVA_GATEWAY_EXITED" not in str(error):
            raise
        print(f"the Spark driver's JVM did not start ({error}); starting it again", file=sys.stderr)
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def eventually(check: Callable[[], bool], what: str, within: float = 20.0) -> None:
    """Waits (boundedly) for ``check()``: processes end and files appear asynchronously."""
    give_up = time.monotonic() + within
    while not check():
        assert time.monotonic() < give_up, what
        time.sleep(0.1)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Starts ``call()`` in a thread of its own; the list gets what it returned or raised."""
    outcome: list[Any] = []

    def body() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    return thread, outcome


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def no_worker_left(pids: list[int]) -> None:
    """Within seconds, the workers ``pids`` and every other Spark worker process are gone."""
    eventually(lambda: not any(alive(pid) for pid in pids), f"workers {pids} still run")
    workers = [
        proc.pid
        for proc in psutil.process_iter(["cmdline"])
        if "collectives.spark.worker" in " ".join(proc.info["cmdline"] or ())
    ]
    eventually(lambda: not any(alive(pid) for pid in workers), f"workers {workers} still run")


def worker_pids(pid_dir: Path, count: int, within: float = 60.0) -> dict[int, list[str]]:
    """``{rank or worker: [pid, ...]}`` from the files ``count`` workers wrote in ``pid_dir``."""
    eventually(lambda: len(list(pid_dir.glob("*.pid"))) == count, "workers not started", within)
    time.sleep(0.1)  # the files are written whole, but let both land
    return {int(path.stem): path.read_text().split() for path in pid_dir.glob("*.pid")}


def spark_cluster_for_tests(hosts: int) -> Iterator[SparkCluster]:
    """The body of a Spark cluster fixture; the tests skip, saying why, where it cannot be
    built."""
    reason = spark_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Spark cluster tests skipped: {reason}")
    for nodes in cluster_for_tests(hosts=hosts, sshd_hosts=0, tests="Spark cluster tests"):
        cluster = SparkCluster(nodes, nodes.root / "spark")
        (cluster.root / "conf").mkdir(parents=True)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.close()
