"""A server under a low limit on open files still takes its job's calls when strangers hold
more idle connections to its port than that limit (as with a thousand hosts' relays)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

from rendezvous.client import RendezvousClient
from rendezvous.server.serving import OPEN_FILES, raise_open_files_limit
from tests.processes import with_repo_on_path

SERVER = Path(__file__).with_name("rdzv_server_process.py")
SOFT = 128


#: Starts the server script (argv[1]) under a soft limit of SOFT open files. A
#: ``preexec_fn`` would do it in the child before exec, but it makes ``subprocess`` fork()
#: this test process, whose gRPC threads (earlier tests') can kill such a child first.
UNDER_A_LOW_LIMIT = (
    "import resource, runpy, sys\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, hard))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def test_idle_connections_beyond_the_soft_limit_do_not_lock_the_job_out() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    server = subprocess.Popen(
        [sys.executable, "-c", UNDER_A_LOW_LIMIT, str(SERVER), "job-fds", "1", "1.0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": with_repo_on_path()},
    )
    sockets: list[socket.socket] = []
    try:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write("the-secret\n")
        server.stdin.flush()
        port = int(server.stdout.readline())
        wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
        assert _soft_limit_of(server.pid) == max(SOFT, wanted)
        for _ in range(SOFT + 72):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        with RendezvousClient(f"127.0.0.1:{port}", "the-secret", "job-fds", rpc_timeout=5) as c:
            c.set("fds/alive", b"yes")
            assert c.get("fds/alive", timeout=5) == b"yes"
    finally:
        for sock in sockets:
            sock.close()
        server.kill()
        server.wait(10)


def test_the_limit_is_never_lowered() -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_open_files_limit(wanted=16)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == before
