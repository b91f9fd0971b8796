"""Prints this worker's view of the job, a partial line, \\r-progress and stderr."""

import os
import sys

names = [
    "HVDRUN_RANK",
    "HVDRUN_SIZE",
    "HVDRUN_LOCAL_RANK",
    "HVDRUN_LOCAL_SIZE",
    "HVDRUN_CROSS_RANK",
    "HVDRUN_CROSS_SIZE",
    "HVDRUN_HOSTNAME",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PYTHONUNBUFFERED",
]
print("env " + " ".join(f"{n}={os.environ.get(n)}" for n in names))
print("cwd " + os.getcwd())
print("args " + " ".join(sys.argv[1:]))
print("secret-in-env " + str(bool(os.environ.get("HVDRUN_SECRET"))))
sys.stdout.write("progress 50%\rprogress 100%\r\n")
sys.stdout.write("no newline at end")
sys.stdout.flush()
sys.stderr.write("to stderr\n")
