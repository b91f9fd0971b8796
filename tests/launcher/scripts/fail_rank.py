"""Every rank starts a child and reports pids; rank FAIL_RANK exits with FAIL_CODE, others wait."""

import os
import subprocess
import sys
import time

rank = int(os.environ["HVDRUN_RANK"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(f"pids {os.getpid()} {child.pid}", flush=True)
fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
if rank == fail_rank:
    time.sleep(float(os.environ.get("FAIL_AFTER", "1.0")))
    print("about to fail", file=sys.stderr, flush=True)
    print(f"rank {rank} gives up", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("FAIL_CODE", "3")))
time.sleep(120)
