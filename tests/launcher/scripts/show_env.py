"""Prints the variables named on the command line (unset ones as <unset>), cwd and the secret."""

import os
import sys

for name in sys.argv[1:]:
    print(f"{name}={os.environ.get(name, '<unset>')}")
print(f"cwd={os.getcwd()}")
print(f"secret={os.environ.get('HVDRUN_SECRET', '')}", flush=True)
if os.environ.get("STAY"):
    import time

    time.sleep(float(os.environ["STAY"]))
