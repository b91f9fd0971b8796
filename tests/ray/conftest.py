"""Ray's head gives its GCS server 30 s to come up and write its port file; on a loaded 2-core
CI host that has run out once, and every test of the module then errored at set-up. The
tests give it the longer wait Ray itself uses for its RocksDB backend, unless the user set
one; the variable reaches the examples' own ``ray.init()`` through the environment too.
Its raylet has 30 s too, which no setting changes: a head whose raylet did not register in
time (seen once in a full run here, no raylet log written at all) is started again once."""

from __future__ import annotations

import glob
import os

os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


def head_log_tail(lines: int = 30) -> str:
    """The last lines of the newest Ray session's GCS server and raylet logs: why the head
    did not come up, for a test's failure message."""
    tails = []
    logs = "/tmp/ray/session_latest/logs"
    for path in sorted(glob.glob(f"{logs}/gcs_server*") + glob.glob(f"{logs}/raylet*")):
        with open(path, errors="replace") as log:
            text = log.read().splitlines()[-lines:]
        tails.append(f"--- {path}\n" + "\n".join(text))
    return "\n".join(tails) or f"(no GCS server or raylet log under {logs})"
