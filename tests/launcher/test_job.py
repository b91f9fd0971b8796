"""hvdrun end to end with real worker processes (torch-free scripts, so they start fast)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.output import STUCK_SECONDS

SCRIPTS = Path(__file__).parent / "scripts"
HVDRUN = [sys.executable, "-m", "hvdrun"]


def hvdrun(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HVDRUN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def reported_pids(stdout: str) -> list[int]:
    return [
        int(p)
        for line in stdout.splitlines()
        if "pids " in line
        for p in line.split("pids ", 1)[1].split()
    ]


def running(argv: list[str]) -> list[psutil.Process]:
    """The processes on this machine whose command line is ``argv`` (a test's own marker)."""
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == argv]


def assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    alive = pids
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes still running: {alive}")


def test_identity_env_and_output_prefixes(tmp_path: Path) -> None:
    result = hvdrun(
        "-np",
        "4",
        "-H",
        "localhost:4",
        sys.executable,
        str(SCRIPTS / "identity.py"),
        "--flag",
        "-np",
        "9",
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    for rank in range(4):
        assert (
            f"[{rank}]<stdout>:env HVDRUN_RANK={rank} HVDRUN_SIZE=4 HVDRUN_LOCAL_RANK={rank} "
            f"HVDRUN_LOCAL_SIZE=4 HVDRUN_CROSS_RANK=0 HVDRUN_CROSS_SIZE=1 "
            f"HVDRUN_HOSTNAME=localhost RANK={rank} WORLD_SIZE=4 LOCAL_RANK={rank} "
            f"LOCAL_WORLD_SIZE=4 PYTHONUNBUFFERED=1"
        ) in out
        assert f"[{rank}]<stdout>:cwd {tmp_path}" in out
        assert f"[{rank}]<stdout>:args --flag -np 9" in out
        assert f"[{rank}]<stdout>:secret-in-env True" in out
        # \r ends a line, \r\n is one terminator, an unterminated tail is flushed at exit
        assert f"[{rank}]<stdout>:progress 50%" in out
        assert f"[{rank}]<stdout>:progress 100%" in out
        assert f"[{rank}]<stdout>:no newline at end" in out
        assert f"[{rank}]<stderr>:to stderr" in result.stderr.splitlines()
    # every line carries a prefix: nothing interleaved inside a line
    assert all(re.match(r"\[\d\]<stdout>:", line) for line in out)
    assert len(out) == 4 * 7


def test_failing_rank_stops_everyone_and_sets_exit_code() -> None:
    result = hvdrun(
        "-np",
        "4",
        sys.executable,
        str(SCRIPTS / "fail_rank.py"),
        env={"FAIL_RANK": "2", "FAIL_CODE": "3"},
    )
    assert result.returncode == 3, result.stderr
    assert "rank 2 on host localhost failed first: exit code 3" in result.stderr
    assert "last lines of rank 2's stderr:" in result.stderr
    assert "    rank 2 gives up" in result.stderr
    pids = reported_pids(result.stdout)
    assert len(pids) == 8  # four workers and the child each started
    assert_all_gone(pids)


def test_worker_killed_by_signal_exits_128_plus_n() -> None:
    result = hvdrun(
        "-np",
        "2",
        sys.executable,
        "-c",
        "import os, signal, time\n"
        "if os.environ['HVDRUN_RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)",
    )
    assert result.returncode == 128 + 9
    assert "rank 1 on host localhost failed first: killed by SIGKILL (exit code 137)" in (
        result.stderr
    )


def start_and_wait_ready(np: int) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [*HVDRUN, "-np", str(np), sys.executable, str(SCRIPTS / "fail_rank.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    assert proc.stdout is not None
    while len(pids) < 2 * np:
        line = proc.stdout.readline()
        assert line, (
            f"hvdrun ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
        )
        pids += reported_pids(line)
    return proc, pids


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGQUIT])
def test_signal_to_hvdrun_stops_all_workers(signum: int) -> None:
    proc, pids = start_and_wait_ready(2)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}; stopping all workers" in stderr
    assert_all_gone(pids)


STUBBORN_WITH_A_DAEMON = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (saving a checkpoint, say)
if os.fork() == 0:  # a daemon that keeps the worker's output: the agent adopts it
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "1777.25"])
    os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_second_ctrl_c_leaves_nothing_running_not_even_a_worker_s_daemon() -> None:
    """Workers that ignore SIGTERM, each with a double-forked daemon holding its output:
    a second Ctrl-C kills everything at once, the daemons too (hvdrun kills the agent that
    had adopted them, and what it had, before they pass to init)."""
    proc = subprocess.Popen(
        [*HVDRUN, "-np", "2", "--term-grace", "20", sys.executable, "-c", STUBBORN_WITH_A_DAEMON],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        for _ in range(2):
            assert "ready" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "second signal: killing all workers now" in stderr, stderr
    deadline = time.monotonic() + 5
    while running(["sleep", "1777.25"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = running(["sleep", "1777.25"])
    for process in left:
        process.kill()
    assert not left, stderr


@pytest.mark.parametrize("stderr_too", [False, True])
def test_a_stdout_nobody_reads_holds_off_neither_a_signal_nor_hvdrun_s_memory(
    tmp_path: Path, stderr_too: bool
) -> None:
    """Workers flood a pipe whose reader stopped reading (``| less``, a paused pipe; with
    ``stderr_too``, ``2>&1 | less``): the workers wait on their writes, as with a plain pipe,
    hvdrun's memory stays bounded, and Ctrl-C stops the job; what could not be written is
    dropped at the end, said on stderr where stderr can be written."""
    flood = (
        "import sys\nline = b'x' * 100 + b'\\n'\nwhile True:\n    sys.stdout.buffer.write(line)\n"
    )
    reader, writer = os.pipe()  # (never read)
    errors = tmp_path / "stderr"
    with errors.open("wb") as err:
        proc = subprocess.Popen(
            [*HVDRUN, "-np", "2", sys.executable, "-c", flood],
            stdout=writer,
            stderr=writer if stderr_too else err,
        )
    os.close(writer)
    hvdrun_process = psutil.Process(proc.pid)
    pids: list[int] = []
    try:
        time.sleep(6)  # (the pipe, then hvdrun's backlog, filled long ago)
        before = hvdrun_process.memory_info().rss
        time.sleep(3)
        grew = hvdrun_process.memory_info().rss - before
        pids = [p.pid for p in hvdrun_process.children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # (it did not stop: nothing of it may outlive the test)
            for pid in [proc.pid, *pids]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        os.close(reader)
    said = errors.read_text()
    assert code == 130, said
    assert grew < 16 * 1024 * 1024, f"hvdrun grew by {grew} bytes in 3 s"
    if not stderr_too:
        assert "received SIGINT; stopping all workers" in said, said
        assert "could not be written for 5 s (a reader that stopped reading)" in said, said
    assert_all_gone(pids)


def test_a_reader_that_reads_late_gets_every_line_then_the_failure() -> None:
    """``hvdrun ... 2>&1 | (sleep 60; cat)``: a reader that starts reading long after the job
    ended gets every line of it, then who failed and why (last), as through a plain pipe."""
    script = (
        "import os, sys, time\nrank = int(os.environ['HOROVOD_RANK'])\n"
        "sys.stdout.write(''.join(f'rank {rank} line {i}\\n' for i in range(5000)))\n"
        "sys.stdout.flush()\nif rank == 1:\n    time.sleep(2)\n    sys.exit(3)\n"
    )
    reader, writer = os.pipe()
    proc = subprocess.Popen(
        [*HVDRUN, "-np", "2", "--no-report", sys.executable, "-c", script],
        stdout=writer,
        stderr=writer,
    )
    os.close(writer)
    try:
        hvdrun_process = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while hvdrun_process.children() and time.monotonic() < deadline:
            time.sleep(0.2)  # (until the job ended: its agent and workers are gone)
        time.sleep(STUCK_SECONDS + 2)  # (past the time hvdrun once waited for a reader)
        with os.fdopen(reader, "rb") as stream:
            output = stream.read().decode()
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 3, output
    for rank in (0, 1):
        lines = re.findall(rf"^\[{rank}\]<stdout>:rank {rank} line (\d+)$", output, re.M)
        assert lines == [str(i) for i in range(5000)], (rank, len(lines))
    assert "dropped" not in output, output[-2000:]
    failed = output.index("hvdrun: rank 1 on host localhost failed first: exit code 3")
    assert failed > output.index("[0]<stdout>:rank 0 line 4999"), output[-2000:]


def test_a_worker_the_host_has_no_open_files_left_for_fails_the_job_in_one_line() -> None:
    """Under a low limit on open files (``ulimit -n``), the first worker that cannot be
    started fails the job with one line that names the limit; the others are not tried, and
    the ones started are stopped."""
    command = [*HVDRUN, "--no-report", "-np", "32", "sleep", "31.37"]
    result = subprocess.run(
        ["sh", "-c", 'ulimit -Sn 40 && exec "$@"', "sh", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    said = re.findall(r"hvdrun: rank (\d+) on localhost: cannot start 'sleep': (.*)", result.stderr)
    assert len(said) == 1, result.stderr
    rank, why = said[0]
    assert why.startswith("Too many open files (this host's limit on open files, 40, "), why
    assert f"rank {rank} on host localhost failed first: exit code 1" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    left = running(["sleep", "31.37"])
    assert not left, left


@pytest.mark.parametrize("stdout", [">&-", ">/dev/full"])
def test_hvdrun_whose_stdout_cannot_be_written_runs_the_job(stdout: str) -> None:
    """stdout closed before hvdrun starts, or a full disk: the job runs and succeeds, as a
    plain ``python`` would; on a full disk hvdrun says once that the output is lost."""
    command = " ".join([*HVDRUN, "-np", "2", sys.executable, "-c", "'print(1)'"])
    result = subprocess.run(
        ["sh", "-c", f"exec {stdout}; exec {command}"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("cannot write the job's output to stdout") == 1
    if stdout == ">&-":
        assert "the descriptor was closed when hvdrun started" in result.stderr


def test_sigusr1_to_hvdrun_reaches_every_worker_and_the_job_goes_on() -> None:
    """mpirun forwards SIGUSR1/SIGUSR2 to the job (Slurm's ``--signal=USR1@60``: checkpoint
    before the time limit); so does hvdrun, and the job is not stopped."""
    script = (
        "import os, signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda *_: got.append(1))\n"
        "print('ready', flush=True)\n"
        "deadline = time.monotonic() + 20\n"
        "while not got and time.monotonic() < deadline: time.sleep(0.05)\n"
        "print('checkpoint' if got else 'no signal', flush=True)\n"
    )
    proc = subprocess.Popen(
        [*HVDRUN, "-np", "2", sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready = [proc.stdout.readline(), proc.stdout.readline()]
    assert sorted(ready) == ["[0]<stdout>:ready\n", "[1]<stdout>:ready\n"]
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert sorted(stdout.splitlines()) == ["[0]<stdout>:checkpoint", "[1]<stdout>:checkpoint"]
    assert "hvdrun: forwarding SIGUSR1 to the workers" in stderr


def test_kill_9_of_hvdrun_leaves_no_worker() -> None:
    proc, pids = start_and_wait_ready(2)
    agents = [c.pid for c in psutil.Process(proc.pid).children()]
    proc.kill()
    proc.wait()
    assert_all_gone(pids + agents, within=10.0)


def test_output_files_timestamps_and_exports(tmp_path: Path) -> None:
    out_dir = tmp_path / "logs"
    result = hvdrun(
        "-np",
        "2",
        "--output-filename",
        str(out_dir),
        "--prefix-timestamp",
        "-x",
        "EXTRA=1",
        sys.executable,
        "-c",
        "import os, sys\n"
        "print('rank', os.environ['HVDRUN_RANK'], os.environ['EXTRA'], os.environ['HOME'])\n"
        "print('oops', file=sys.stderr, flush=True)\n"
        "sys.stderr.buffer.write(b'10%\\r100%\\r\\n\\x01 binary\\x00\\nno newline')",
        env={"HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        # host-specific variables (HOME) of the local host are the caller's own
        expected = f"rank {rank} 1 {tmp_path}\n"
        assert (out_dir / f"rank.{rank}" / "stdout").read_text() == expected
        # byte for byte, as the rank wrote it (progress bars' CRs, binary, no last newline)
        said = b"oops\n10%\r100%\r\n\x01 binary\x00\nno newline"
        assert (out_dir / f"rank.{rank}" / "stderr").read_bytes() == said
        stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
        assert re.search(rf"^{stamp}\[{rank}\]<stdout>:{expected}", result.stdout, re.M)


def test_local_failure_report_has_a_summary_table() -> None:
    result = hvdrun(
        "-np",
        "3",
        sys.executable,
        str(SCRIPTS / "fail_rank.py"),
        env={"FAIL_RANK": "1", "FAIL_CODE": "4"},
    )
    assert result.returncode == 4
    assert re.search(
        r"^hvdrun:   1\s+localhost\s+4\s+FAILED FIRST\s+rank 1 gives up$", result.stderr, re.M
    )
    assert re.search(r"^hvdrun:   0\s+localhost\s+143\s+stopped$", result.stderr, re.M)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_rendezvous_addr_and_network_interface_flags() -> None:
    port = free_port()
    result = hvdrun(
        "-np",
        "2",
        "--rendezvous-addr",
        f"127.0.0.1:{port}",
        "--network-interface",
        "lo",
        sys.executable,
        str(SCRIPTS / "register.py"),
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:registered rank {rank} on " in result.stdout


def _non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


@pytest.mark.parametrize("channel", ["plain", "tls"])
def test_a_grpc_trace_shows_no_token(channel: str) -> None:
    # GRPC_TRACE=all makes gRPC print every header's value, in hvdrun's server and in the
    # workers' clients, and the job's token travels in one; the workers print it once here,
    # on purpose, and it must appear nowhere else, not even in part (nor as the hex that
    # gRPC prints beside it). Over TLS (a rendezvous address that is not loopback), gRPC's
    # secure_endpoint tracer dumps the first bytes of each decrypted frame, headers too.
    options: list[str] = []
    if channel == "tls":
        address = _non_loopback_ipv4()
        if address is None:
            pytest.skip("this machine has no IPv4 address but loopback")
        options = ["--rendezvous-addr", f"{address}:{free_port()}", "--verbose"]
    trace = {"GRPC_TRACE": "all", "GRPC_VERBOSITY": "debug", "SHOW_SECRET": "1"}
    result = hvdrun("-np", "2", *options, sys.executable, str(SCRIPTS / "register.py"), env=trace)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    shown = set(re.findall(r"<stdout>:the secret is (\S+)\n", result.stdout))
    assert len(shown) == 1, result.stdout
    secret = shown.pop()
    part = secret[:12]  # (what a trace cut short would show)
    assert output.count(part) == 2, [line for line in output.splitlines() if part in line]
    assert " ".join(f"{byte:02x}" for byte in part.encode()) not in output
    assert "x-hvdrun-token" in output  # (gRPC did trace the headers, the token's among them)


def test_connections_that_fail_the_tls_handshake_print_nothing() -> None:
    # Anyone on the network can open the rendezvous port of a TLS job (a port scanner, a
    # plain HTTP probe): gRPC, at its default INFO level, printed a raw line on hvdrun's
    # stderr for each such connection's failed handshake.
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no IPv4 address but loopback")
    port = free_port()
    probe = (
        "import socket, time\n"
        "for _ in range(20):\n"
        f"    with socket.create_connection(({address!r}, {port})) as s:\n"
        "        s.sendall(b'GET / HTTP/1.1\\r\\n\\r\\n'); s.recv(100)\n"
        "time.sleep(0.5)\n"
        "print('probed')\n"
    )
    result = hvdrun(
        "-np", "1", "--rendezvous-addr", f"{address}:{port}", sys.executable, "-c", probe
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0]<stdout>:probed" in result.stdout
    assert "Handshake failed" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("\n") < 5, result.stderr[-3000:]


def test_interface_chosen_and_user_setting_kept() -> None:
    code = "import os; print(os.environ['GLOO_SOCKET_IFNAME'], os.environ['NCCL_SOCKET_IFNAME'])"
    result = hvdrun("-np", "1", sys.executable, "-c", code)
    assert result.stdout == "[0]<stdout>:lo lo\n", result.stderr  # faces 127.0.0.1
    result = hvdrun("-np", "1", sys.executable, "-c", code, env={"NCCL_SOCKET_IFNAME": "ib0"})
    assert result.stdout == "[0]<stdout>:lo ib0\n", result.stderr


def test_plain_torch_scripts_get_master_addr_and_a_free_master_port() -> None:
    result = hvdrun(
        "-np", "2", sys.executable, str(SCRIPTS / "show_env.py"), "MASTER_ADDR", "MASTER_PORT"
    )
    assert result.returncode == 0, result.stderr
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        values = set(re.findall(rf"<stdout>:{name}=(\S+)", result.stdout))
        assert len(values) == 1, result.stdout  # the same for both ranks
    assert re.search(r"\[0\]<stdout>:MASTER_ADDR=127\.0\.0\.1$", result.stdout, re.M)
    port = int(re.findall(r"MASTER_PORT=(\d+)", result.stdout)[0])
    assert 0 < port < 65536
    # a user's own -x wins
    result = hvdrun(
        "-np",
        "1",
        "-x",
        "MASTER_PORT=29511",
        sys.executable,
        str(SCRIPTS / "show_env.py"),
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    assert "MASTER_PORT=29511" in result.stdout and "MASTER_ADDR=127.0.0.1" in result.stdout


def test_a_plain_ddp_script_trains_under_hvdrun() -> None:
    example = Path(__file__).parents[2] / "examples" / "pytorch_ddp.py"
    result = hvdrun("-np", "2", sys.executable, str(example), "--epochs", "1", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[0]<stdout>:ddp: 2 ranks, test accuracy" in result.stdout
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:ddp rank {rank}: weights equal rank 0's: True" in result.stdout
